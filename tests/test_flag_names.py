"""Option names from TRL, HF TrainingArguments, open-instruct and OpenRLHF: the parser answers them from the one table
in open_instruct/flag_names.yaml (read by flag_names.py), and docs/porting.md shows those same tables."""

import dataclasses
import os
import subprocess
import sys

import pytest

from open_instruct import flag_names
from open_instruct.config import CONFIG_CLASSES, DPOConfig, RLVRConfig, SFTConfig, parse_config
from open_instruct.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_KEYS = {f.name for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls)}
RL_KEYS = {f.name for f in dataclasses.fields(RLVRConfig)}


PORTING = os.path.join(REPO, "docs", "porting.md")


def test_porting_page_shows_the_tables_the_parser_reads():
    with open(PORTING) as f:
        page = f.read()
    assert flag_names.markdown_table() in page
    assert flag_names.unsupported_table() in page
    assert flag_names.differences_table() in page


def test_every_replacement_is_a_real_option_and_no_foreign_name_is_one():
    for entry in flag_names.FOREIGN_NAMES:
        assert set(entry.keys) <= ALL_KEYS, entry  # a renamed option breaks this test, not the hint
        # a real option is never answered as a foreign name; loss_type is DPO's option and TRL GRPO's name for RL
        assert entry.name not in ALL_KEYS or (entry.name == "loss_type" and entry.name not in RL_KEYS), entry
        for key in entry.keys:
            assert f"--{key}" in entry.here or key in entry.note or entry.here == "always on", entry


def error_for(cls, argv):
    with pytest.raises(ConfigError) as e:
        parse_config(cls, argv)
    return str(e.value)


# (script config, the user's tokens, what the message must say, what it must not suggest): the wrong hints of
# issue 26 were `--packing` -> with_tracking, `--max_steps`/`--save_steps` -> eval_steps,
# `--num_generations` -> generation_backend, and nothing for `--report_to wandb` and `--bf16`.
CASES = [
    (SFTConfig, ["--packing"], "here: --max_tokens_per_micro_batch N", "with_tracking"),
    (SFTConfig, ["--max_steps", "100"], "here: --total_episodes N", "eval_steps"),
    (DPOConfig, ["--save_steps", "50"], "here: --checkpointing_steps N", "eval_steps"),
    (RLVRConfig, ["--num_generations", "8"], "here: --num_samples_per_prompt N", "generation_backend"),
    (DPOConfig, ["--report_to", "wandb"], "here: --with_tracking true", None),
    (DPOConfig, ["--bf16"], "here: --mixed_precision bf16", None),
    (RLVRConfig, ["--rollout.n_samples_per_prompt", "4"], "OpenRLHF's name; here: --num_samples_per_prompt", None),
    (SFTConfig, ["--gradient-checkpointing"], "here: --activation_checkpointing true", None),
]


@pytest.mark.parametrize("cls,tokens,expected,wrong", CASES)
def test_foreign_flag_gets_the_table_hint(cls, tokens, expected, wrong):
    message = error_for(cls, ["--model_name_or_path", "m", *tokens])
    assert message.startswith(f"unknown key '{tokens[0][2:].replace('-', '_')}' in command-line overrides: ")
    assert expected in message
    if wrong:
        assert wrong not in message


def test_replacement_missing_from_this_script_is_said():
    message = error_for(SFTConfig, ["--num_generations", "8"])
    assert "'num_generations' is TRL's name; here: --num_samples_per_prompt N" in message
    assert message.endswith("num_samples_per_prompt is not an option of sft.py")
    # an option of this script: no such remark
    assert "not an option" not in error_for(RLVRConfig, ["--num_generations", "8"])


def test_recipe_key_gets_the_hint_too(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("script: sft\nmodel_name_or_path: m\npacking: true\n")
    message = error_for(SFTConfig, [str(recipe)])
    assert message == (
        f"unknown key 'packing' in recipe {recipe}: 'packing' is TRL's name; here: --max_tokens_per_micro_batch N "
        "(padding-free packing of whole sequences up to N tokens per micro-batch)"
    )


def test_unknown_names_still_get_the_closest_key():
    assert error_for(SFTConfig, ["--learning_rat", "1"]).endswith("did you mean 'learning_rate'?")


@pytest.mark.parametrize("script", ["sft", "reward_model", "dpo", "rlvr_ppo"])
def test_every_script_exits_2_with_the_hint(script):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "open_instruct", f"{script}.py"), "--bf16"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "'bf16' is HF TrainingArguments / TRL / OpenRLHF's name; here: --mixed_precision bf16" in out.stderr


def test_every_name_the_porting_concept_table_shows_is_known_to_the_parser():
    """The porting page's concept table (open-instruct, OpenRLHF, TRL and verl columns) and the paragraph of
    OpenRLHF's older names: each option name there is ours or answered by the hint table, so the two tables cannot
    disagree."""
    import re

    with open(PORTING) as f:
        readme = f.read()
    start = readme.index("| concept | here | open-instruct")
    section = readme[start : readme.index("**Every name the parser answers:**", start)]
    names = []
    for line in section.splitlines():
        cells = line.split("|")[3:7] if line.startswith("| ") and not line.startswith("| concept") else [line]
        for cell in cells:
            names += [t.lstrip("-") for t in re.findall(r"`([^`]+)`", cell)]
    names = [n for n in names if re.fullmatch(r"[a-z_.]+", n)]
    assert {"train.micro_batch_size", "num_generations", "micro_train_batch_size", "data.prompt_probs"} <= set(names)
    unknown = [n for n in names if n not in ALL_KEYS and flag_names.lookup(n) is None]
    assert not unknown, f"porting-page names the parser does not know: {unknown}"
