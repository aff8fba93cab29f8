"""Never overwrite or resume the wrong run; every bad input caught before a model loads (issue 17).

The table runs each bad invocation through the script's real entry point (`runtime.run(main, argv)`) and asserts: exit
code 2, the culprit named in the message, that no model was loaded (transformers' from_pretrained/from_config are
booby-trapped), and that the files of finished runs nearby (one in a neighbouring folder, and the target folder when it
holds one) are byte-identical afterwards. Then: a finished run's command re-run without resume / with `auto` / with
`--overwrite_output_dir`; two concurrent runs and a stale lock; resume with the same batch layout uses every example
(SFT) and every prompt (RL) exactly once, a changed layout is refused; export of every model of a PPO checkpoint;
umask; SIGTERM during the model load and the DPO reference pass; --help; no torch import before the config is
checked."""

from __future__ import annotations

import collections
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from _reliability_helpers import stop_at, wait_until_stopped
from training_helpers import (
    TINY_PPO_ROLLOUTS,
    assert_rows_match,
    assert_weights_match,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    read_metrics,
    recipe_args,
    sigterm_at_step,
    write_fake_model,
)

from demo.synthetic import preference_rows, rl_rows, sft_rows, write_jsonl
from open_instruct import checkpoint, data, dpo, reward_model, rlvr_ppo, run_dir, runtime, sft
from open_instruct.config import CONFIG_CLASSES, DPOConfig, RewardModelConfig, RLVRConfig, SFTConfig, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"sft": sft, "reward_model": reward_model, "dpo": dpo, "rlvr_ppo": rlvr_ppo}


def recipe(name: str) -> str:
    return os.path.join(REPO, "configs", name)


def run_script(script: str, argv: list[str]) -> int:
    """The script's entry point in this process; its exit status (0 when main returns)."""
    try:
        runtime.run(SCRIPTS[script].main, argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def snapshot(folder) -> dict[str, str]:
    """sha256 of every file under `folder` (relative path -> digest), to prove nothing was touched."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: data, and finished runs (one SFT, one PPO) made once


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_inputs_data")
    pairs = preference_rows(16, 2)
    pairs[2]["rejected"] = pairs[2]["chosen"]  # line 3: a pair that prefers nothing
    return {
        "sft": write_jsonl(str(d / "sft.jsonl"), sft_rows(32, 0)),
        "sft_eval": write_jsonl(str(d / "sft_eval.jsonl"), sft_rows(8, 1)),
        "pref": write_jsonl(str(d / "pref.jsonl"), preference_rows(16, 2)),
        "pref_same": write_jsonl(str(d / "pref_same.jsonl"), pairs),
        "rl": write_jsonl(str(d / "rl.jsonl"), rl_rows(32, 4)),
        "rl_eval": write_jsonl(str(d / "rl_eval.jsonl"), rl_rows(4, 5)),
        "dir": str(d),
    }


def sft_argv(models, files, out, *extra):
    """4 optimizer steps of 8 conversations (4 x 2 micro-batches), eval every 2, a checkpoint every 2."""
    settings = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--logging_steps", "1"]
    settings += ["--eval_steps", "2", "--checkpointing_steps", "2"]
    return recipe_args("sft_tiny.yaml", models["causal_lm"], files["sft"], files["sft_eval"], out, *settings, *extra)


def rl_argv(models, files, out, *extra):
    """PPO, 4 rollouts of 4 prompts x 2 completions (2 mini-batches each), a checkpoint after every rollout."""
    settings = ["--total_episodes", "32", *TINY_PPO_ROLLOUTS, "--eval_steps", "2", "--checkpointing_steps", "1"]
    return recipe_args("rlvr_tiny.yaml", models["causal_lm"], files["rl"], files["rl_eval"], out, *settings, *extra)


def dpo_argv(models, files, out, *extra):
    settings = ["--reference_cache_dir", os.path.join(files["dir"], "ref_cache"), "--per_device_train_batch_size", "4"]
    settings += ["--gradient_accumulation_steps", "1"]
    return recipe_args("dpo_tiny.yaml", models["causal_lm"], files["pref"], files["pref"], out, *settings, *extra)


@pytest.fixture(scope="module")
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture(scope="module")
def finished_sft(tiny_models, files, tmp_path_factory, umask_022):
    out = tmp_path_factory.mktemp("finished_sft") / "out"
    assert run_script("sft", sft_argv(tiny_models, files, out)) == 0
    return out


@pytest.fixture(scope="module")
def finished_ppo(tiny_models, files, tmp_path_factory, umask_022):
    out = tmp_path_factory.mktemp("finished_ppo") / "out"
    assert run_script("rlvr_ppo", rl_argv(tiny_models, files, out)) == 0
    return out


@pytest.fixture()
def live_process():
    """Another live process on this host (its pid goes into a planted lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def plant_lock(output_dir, pid: int) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, run_dir.LOCK_FILE)
    holder = {"pid": pid, "host": socket.gethostname(), "start_time": run_dir._process_start_time(pid)}
    with open(path, "w") as f:
        json.dump({**holder, "started_at": "earlier", "token": "theirs"}, f)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# The table


def last_checkpoint(out) -> str:
    return checkpoint.list_checkpoints(str(out))[-1][1]


def corrupt_copy(src: str, dst: str) -> str:
    """A copy of a checkpoint with one byte of a checksummed file flipped (same size: only the hash can tell)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, checkpoint.MANIFEST)) as f:
        hashed = sorted(k for k, v in json.load(f)["files"].items() if "sha256" in v and v["size"] > 0)
    path = os.path.join(dst, hashed[0])
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    return dst


def truncated_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    return dst


def build_case(name: str, t) -> tuple[str, list[str], list[str], object]:
    """(script, argv, texts the message must contain, folder holding a finished run that must stay intact or None)."""
    m, f, tmp, out = t.models, t.files, t.tmp, t.tmp / "out"
    sft_ckpt, ppo_ckpt = last_checkpoint(t.sft), last_checkpoint(t.ppo)
    if name == "rerun_finished_without_resume":
        return "sft", sft_argv(m, f, t.target), ["holds run", "finished", "--resume_from_checkpoint auto"], t.target
    if name == "second_run_while_one_holds_the_lock":
        plant_lock(out, t.live.pid)
        return "sft", sft_argv(m, f, out), [f"in use by another run (pid {t.live.pid}"], None
    if name == "files_of_an_unknown_run_with_auto":
        os.makedirs(out)
        shutil.copy(os.path.join(t.sft, "metrics.jsonl"), out)
        return "sft", sft_argv(m, f, out, "--resume_from_checkpoint", "auto"), ["no run.json", "metrics.jsonl"], None
    if name == "overwrite_with_auto":
        argv = sft_argv(m, f, t.target, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "auto")
        return "sft", argv, ["cannot be combined"], t.target
    if name == "dpo_resumes_an_sft_checkpoint":
        return "dpo", dpo_argv(m, f, out, "--resume_from_checkpoint", sft_ckpt), ["script: checkpoint 'sft'"], None
    if name == "grpo_resumes_a_ppo_checkpoint":
        argv = rl_argv(m, f, out, "--resume_from_checkpoint", ppo_ckpt, "--algo", "grpo")
        return "rlvr_ppo", argv, ["algo: checkpoint 'ppo', now 'grpo'"], None
    if name == "sft_resume_with_changed_batch_size":
        argv = sft_argv(m, f, out, "--resume_from_checkpoint", sft_ckpt, "--per_device_train_batch_size", "2")
        return "sft", argv, ["mini_batch_size: checkpoint 8", "now 4 (per_device_train_batch_size 2"], None
    if name == "rl_resume_with_changed_rollout_batch":
        argv = rl_argv(m, f, out, "--resume_from_checkpoint", ppo_ckpt, "--local_rollout_batch_size", "2")
        return "rlvr_ppo", argv, ["rollout_batch_size: checkpoint 4", "now 2 (local_rollout_batch_size 2"], None
    if name == "resume_with_another_model_shape":
        other = write_fake_model(str(tmp / "other_model"))
        with open(os.path.join(other, "config.json"), "w") as fh:
            json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 96}, fh)
        argv = sft_argv(m, f, out, "--resume_from_checkpoint", sft_ckpt, "--model_name_or_path", other)
        return "sft", argv, ["model hidden_size: checkpoint 64, now 96"], None
    if name == "resume_checkpoint_failing_its_checksum":
        bad = corrupt_copy(sft_ckpt, str(tmp / "corrupt" / "step_4"))
        return "sft", sft_argv(m, f, out, "--resume_from_checkpoint", bad), ["fails its checksum", bad], None
    if name == "adam_epsilon_negative":
        return "sft", sft_argv(m, f, out, "--adam_epsilon", "-0.1"), ["adam_epsilon must be >= 0"], None
    if name == "eval_response_length_negative":
        return "rlvr_ppo", rl_argv(m, f, out, "--eval_response_length", "-1"), ["eval_response_length"], None
    if name == "sft_best_metric_typo":
        return "sft", sft_argv(m, f, out, "--best_metric", "eval/los"), ["'eval/los'", "did you mean 'eval/loss'"], None
    if name == "rm_best_metric_typo":
        argv = [recipe("rm_tiny.yaml"), "--model_name_or_path", m["causal_lm"], "--dataset_name_or_path", f["pref"]]
        argv += ["--output_dir", str(out), "--best_metric", "eval/acc"]
        return "reward_model", argv, ["'eval/acc'", "eval/accuracy"], None
    if name == "rlvr_best_metric_typo":
        argv = rl_argv(m, f, out, "--best_metric", "eval/correct")
        return "rlvr_ppo", argv, ["'eval/correct'", "eval/correct_rate"], None
    if name == "model_folder_without_config":
        folder = tmp / "no_config"
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"x")
        return (
            "sft",
            sft_argv(m, f, out, "--model_name_or_path", str(folder)),
            ["has no config.json", "weights.bin"],
            None,
        )
    if name == "empty_model_folder":
        (tmp / "empty").mkdir()
        return "sft", sft_argv(m, f, out, "--model_name_or_path", str(tmp / "empty")), ["is empty"], None
    if name == "truncated_weights":
        folder = truncated_model(m["causal_lm"], str(tmp / "truncated"))
        return "sft", sft_argv(m, f, out, "--model_name_or_path", folder), ["model.safetensors is truncated"], None
    if name == "gguf_file_not_in_folder":
        return "sft", sft_argv(m, f, out, "--gguf_file", "model.Q4.gguf"), ["gguf_file 'model.Q4.gguf' is not in"], None
    if name == "dataset_with_unknown_extension":
        tsv = tmp / "data.tsv"  # .csv is read (docs/data.md#data-formats-tokenization-and-the-cache)
        tsv.write_text("messages\n")
        return "sft", sft_argv(m, f, out, "--dataset_name_or_path", str(tsv)), ["unknown file type '.tsv'"], None
    if name == "missing_dataset_file":
        missing = str(tmp / "nope.jsonl")
        return "sft", sft_argv(m, f, out, "--dataset_name_or_path", missing), [f"{missing!r} does not exist"], None
    if name == "duplicate_key_in_recipe":
        path = tmp / "dup.yaml"
        path.write_text("script: sft\nlearning_rate: 1.0e-3\nseed: 1\nlearning_rate: 300\n")
        return "sft", [str(path), *sft_argv(m, f, out)[1:]], ["'learning_rate' is given twice", str(path)], None
    if name == "eval_fraction_with_an_eval_file":
        return (
            "sft",
            sft_argv(m, f, out, "--eval_fraction", "0.1"),
            ["eval_fraction", "eval_dataset_name_or_path"],
            None,
        )
    if name == "dpo_pair_with_chosen_equal_rejected":
        argv = dpo_argv(m, f, out, "--dataset_name_or_path", f["pref_same"])
        return "dpo", argv, [f"{f['pref_same']} line 3", "chosen and rejected are identical"], None
    if name == "recipe_after_the_flags":
        argv = sft_argv(m, f, out)
        return "sft", [*argv[1:], argv[0]], ["recipe comes first", "sft_tiny.yaml"], None
    if name == "reward_model_path_is_a_causal_lm":
        argv = rl_argv(m, f, out, "--reward_model_path", m["causal_lm"], "--reward_model_multiplier", "1")
        return "rlvr_ppo", argv, ["reward_model_path", m["causal_lm"], "not a trained reward model"], None
    if name == "missing_model_folder_as_a_relative_path":
        argv = sft_argv(m, f, out, "--model_name_or_path", "output/no_such_run/final_model")
        return "sft", argv, ["model_name_or_path 'output/no_such_run/final_model' does not exist"], None
    if name == "invalid_chat_template":
        argv = sft_argv(m, f, out, "--chat_template", "{% for m in messages %}{{ m.content }}")
        return "sft", argv, ["chat_template is not a valid Jinja template"], None
    return build_issue_22_case(name, t)


def write_lines(path, lines: list[str]) -> str:
    """A .jsonl file of these exact lines (for escapes json.dumps would not write)."""
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return str(path)


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def build_issue_22_case(name: str, t) -> tuple[str, list[str], list[str], object]:
    """The bad inputs of issue 22 (items 8-11), in build_case's form."""
    m, f, tmp, out = t.models, t.files, t.tmp, t.tmp / "out"
    mixture = ["--dataset_name_or_path", "", "--dataset_mixer_list", f["sft"], "1.0"]
    rm = [recipe("rm_tiny.yaml"), "--model_name_or_path", m["seq_cls"], "--dataset_name_or_path", f["pref"]]
    rm += ["--eval_dataset_name_or_path", f["pref"], "--output_dir", str(out)]
    # item 8: every mixture source gets the checks of a single dataset
    if name == "mixture_source_of_unknown_type":
        csv = tmp / "extra.tsv"
        csv.write_text("messages\n")
        argv = sft_argv(m, f, out, *mixture, str(csv), "0.5")
        return "sft", argv, ["dataset_mixer_list", str(csv), "unknown file type '.tsv'"], None
    if name == "mixture_source_folder_missing":
        missing = str(tmp / "no_such_folder")
        return "sft", sft_argv(m, f, out, *mixture, missing, "0.5"), [f"dataset file {missing!r} does not exist"], None
    if name == "mixture_source_with_a_misspelt_extension":
        argv = sft_argv(m, f, out, *mixture, "nope/train.jsnol", "0.5")
        return "sft", argv, ["dataset_mixer_list", "'nope/train.jsnol' does not exist", "did you mean '.jsonl'"], None
    # item 9: what failed after the model load (or with a traceback) fails before it
    if name == "lora_target_that_does_not_exist":
        argv = sft_argv(m, f, out, "--use_lora", "true", "--lora_target_modules", "q_proj", "q_prj")
        return "sft", argv, ["lora_target_modules 'q_prj' names no layer", "did you mean 'q_proj'"], None
    if name == "lora_target_on_the_reward_head":
        argv = [*rm, "--use_lora", "true", "--lora_target_modules", "q_proj", "score"]
        return "reward_model", argv, ["lora_target_modules 'score' is the scalar head"], None
    if name == "flash_attention_2_without_flash_attn":
        if importlib.util.find_spec("flash_attn") is not None:
            pytest.skip("flash-attn is installed here")
        argv = sft_argv(m, f, out, "--attn_implementation", "flash_attention_2")
        return "sft", argv, ["flash_attention_2 needs the flash-attn package"], None
    if name == "tokenizer_folder_without_tokenizer_files":
        folder = tmp / "no_tokenizer"
        folder.mkdir()
        shutil.copy(os.path.join(m["causal_lm"], "config.json"), folder)
        argv = sft_argv(m, f, out, "--tokenizer_name_or_path", str(folder))
        return "sft", argv, [f"tokenizer_name_or_path {str(folder)!r} holds no tokenizer files", "config.json"], None
    if name == "json_lone_surrogate_escape":
        good = json.dumps(chat(("user", "1+1?"), ("assistant", "2")))
        path = write_lines(tmp / "surrogate.jsonl", [good, good.replace('"2"', '"2 \\ud800"')])
        argv = sft_argv(m, f, out, "--dataset_name_or_path", path)
        return "sft", argv, [f"{path} line 2", "messages[1].content", "\\ud800", "lone UTF-16 surrogate"], None
    if name == "seed_beyond_64_bits":
        argv = sft_argv(m, f, out, "--seed", str(10**23))
        return "sft", argv, [f"seed must be in [0, 2**32 - 1], got {10**23}"], None
    if name == "reward_margin_beyond_float32":
        rows = [{**row, "margin": 1e300 if i == 2 else 1.0} for i, row in enumerate(preference_rows(16, 2))]
        path = write_jsonl(str(tmp / "margins.jsonl"), rows)
        argv = [*rm, "--dataset_name_or_path", path, "--margin_column", "margin"]
        return "reward_model", argv, [f"{path} line 3", "'margin' holds 1e+300, beyond float32's range"], None
    # item 10
    if name == "yaml_list_for_a_scalar_key":
        path = tmp / "list.yaml"
        path.write_text("script: sft\nlearning_rate: [1.0e-3, 2.0e-3]\n")
        argv = [str(path), *sft_argv(m, f, out)[1:]]
        return "sft", argv, [f"recipe {path}: key 'learning_rate' takes one value, got the list"], None
    # item 11
    if name in ("misspelt_role_in_a_middle_turn", "unknown_role"):
        role = "asistant" if name == "misspelt_role_in_a_middle_turn" else "robot"
        turns = [("user", "1+1?"), (role, "2"), ("user", "and 2+2?"), ("assistant", "4")]
        path = write_jsonl(str(tmp / "roles.jsonl"), [chat(("user", "1+1?"), ("assistant", "2")), chat(*turns)])
        needles = [f"{path} line 2: messages[1] has role {role!r}"]
        needles += ["did you mean 'assistant'"] if role == "asistant" else ["roles: system, developer, user"]
        return "sft", sft_argv(m, f, out, "--dataset_name_or_path", path), needles, None
    if name == "chat_template_rendering_no_content":
        argv = sft_argv(m, f, out, "--chat_template", "{% for m in messages %}<|{{ m.role }}|>{% endfor %}")
        return "sft", argv, ["chat_template renders no content of the user and assistant message"], None
    if name == "mixture_source_all_over_long":
        long_rows = [chat(("user", "x" * 200), ("assistant", "y")) for _ in range(4)]  # > max_seq_length 128
        path = write_jsonl(str(tmp / "long.jsonl"), long_rows)
        argv = sft_argv(m, f, out, *mixture, path, "1.0")
        return "sft", argv, [f"dataset_mixer_list: source {path!r} has no usable rows: all 4 rows"], None
    raise KeyError(name)


CASES = [
    "rerun_finished_without_resume",
    "second_run_while_one_holds_the_lock",
    "files_of_an_unknown_run_with_auto",
    "overwrite_with_auto",
    "dpo_resumes_an_sft_checkpoint",
    "grpo_resumes_a_ppo_checkpoint",
    "sft_resume_with_changed_batch_size",
    "rl_resume_with_changed_rollout_batch",
    "resume_with_another_model_shape",
    "resume_checkpoint_failing_its_checksum",
    "adam_epsilon_negative",
    "eval_response_length_negative",
    "sft_best_metric_typo",
    "rm_best_metric_typo",
    "rlvr_best_metric_typo",
    "model_folder_without_config",
    "empty_model_folder",
    "truncated_weights",
    "gguf_file_not_in_folder",
    "dataset_with_unknown_extension",
    "missing_dataset_file",
    "duplicate_key_in_recipe",
    "eval_fraction_with_an_eval_file",
    "dpo_pair_with_chosen_equal_rejected",
    "recipe_after_the_flags",
    "reward_model_path_is_a_causal_lm",
    "invalid_chat_template",
    "missing_model_folder_as_a_relative_path",
]


class Setting:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture()
def setting(tiny_models, files, finished_sft, finished_ppo, tmp_path, live_process) -> Setting:
    target = tmp_path / "finished_copy"
    shutil.copytree(finished_sft, target)
    return Setting(
        models=tiny_models,
        files=files,
        tmp=tmp_path,
        sft=finished_sft,
        ppo=finished_ppo,
        target=target,
        live=live_process,
    )


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_naming_it_before_any_model_loads(name, setting, capsys, no_model_loads):
    assert_refused_before_any_model_loads(build_case(name, setting), setting, capsys)


ISSUE_22_CASES = [
    "mixture_source_of_unknown_type",
    "mixture_source_folder_missing",
    "mixture_source_with_a_misspelt_extension",
    "lora_target_that_does_not_exist",
    "lora_target_on_the_reward_head",
    "flash_attention_2_without_flash_attn",
    "tokenizer_folder_without_tokenizer_files",
    "json_lone_surrogate_escape",
    "seed_beyond_64_bits",
    "reward_margin_beyond_float32",
    "yaml_list_for_a_scalar_key",
    "misspelt_role_in_a_middle_turn",
    "unknown_role",
    "chat_template_rendering_no_content",
    "mixture_source_all_over_long",
]


@pytest.mark.parametrize("name", ISSUE_22_CASES)
def test_issue_22_bad_inputs_exit_2_before_any_model_loads(name, setting, capsys, no_model_loads):
    """Issue 22, items 8-11: each exits 2 naming the file/row/parameter, before any model loads.

    Item 11 (silent acceptances), decided case by case; every one is an error, none a warning, because each one
    trains something other than what the data or recipe says, and a warning scrolls by unread in a long run:
    - a role outside system/developer/user/assistant/tool/function/ipython (`asistant`, `robot`): the template
      renders it as some other turn and it is never trained; the error names file, line, turn and role (with
      skip_bad_rows such rows are skipped and counted like any bad row);
    - an RL prompt whose last turn is the assistant's: not an error (open-instruct's own RLVR rows carry the answer
      there and its loader drops it), but no longer silent: counted and said in the start-up data line
      (test_rl_prompt_ending_with_the_answer_loses_that_turn_and_says_so);
    - a chat template that renders no message content: every example would train on markup alone;
    - a mixture source that loses every row (over-long, or bad under skip_bad_rows): the mixture silently loses a
      source; the error names the source;
    - LoRA settings without use_lora, learning_rate 1e-400 (reads as 0.0), num_samples_logged -3, seed -1 (Python's
      random seeds with abs(seed): identical to seed 1): config errors (tests/test_bad_config.py). An explicit
      learning_rate 0 stays accepted (a deliberate no-update run, e.g. to measure throughput or eval only)."""
    assert_refused_before_any_model_loads(build_issue_22_case(name, setting), setting, capsys)


@pytest.mark.parametrize("skip_bad_rows", [False, True])
def test_mixture_upsampling_keeps_every_repeat_of_rows_with_ids(tmp_path, skip_bad_rows):
    """Issue 22, item 8: a count above a source's size repeats its rows (10 rows, count 25: every row twice, 5 of
    them three times); those repeats share their row's `id` on purpose, so all 25 are kept, with or without
    skip_bad_rows (before: 'duplicate id', or 15 of 25 silently dropped). Two different rows sharing an id are still
    refused, naming both lines."""
    from demo.tiny import build_tokenizer

    path = write_jsonl(str(tmp_path / "ids.jsonl"), sft_rows(10, 0))
    cfg = SFTConfig(model_name_or_path="m", dataset_mixer_list=[path, "25"], skip_bad_rows=skip_bad_rows)
    train, _, stats = data.load_train_eval(cfg, build_tokenizer(), data.tokenize_sft)
    per_row = collections.Counter(e["row"] for e in train)
    assert len(train) == 25 and stats.duplicate_ids == 0 and stats.kept == 25
    assert sorted(per_row.values()) == [2] * 5 + [3] * 5 and sorted(per_row) == list(range(10))
    # Held out by eval_fraction: 2 of the 10 rows with all their copies, so no held-out row is also trained on.
    cfg.eval_fraction = 0.2
    train, held_out, _ = data.load_train_eval(cfg, build_tokenizer(), data.tokenize_sft)
    rows_out = {e["row"] for e in held_out}
    assert (
        len(rows_out) == 2 and len(held_out) == sum(per_row[r] for r in rows_out) and len(train) == 25 - len(held_out)
    )
    assert rows_out.isdisjoint(e["row"] for e in train)

    rows = sft_rows(4, 0)
    rows[3]["id"] = rows[1]["id"]  # another row under the same id: a real duplicate
    dup = write_jsonl(str(tmp_path / "dup.jsonl"), rows)
    cfg = SFTConfig(model_name_or_path="m", dataset_mixer_list=[dup, "1.0"], skip_bad_rows=skip_bad_rows)
    if skip_bad_rows:
        train, _, stats = data.load_train_eval(cfg, build_tokenizer(), data.tokenize_sft)
        assert len(train) == 3 and stats.duplicate_ids == 1
    else:
        with pytest.raises(data.DataError, match=rf"{dup} line 4: duplicate id 'sft-0-1' \(first at {dup} line 2\)"):
            data.load_train_eval(cfg, build_tokenizer(), data.tokenize_sft)


def test_an_engine_of_vllm_server_urls_that_does_not_answer_is_a_config_error():
    """Issue 22, item 9: an unreachable URL in vllm_server_urls (checked before any model loads) exits 2 naming it,
    not with an EngineError traceback. Port 1 on this host: nothing listens there, the refusal is immediate."""
    from open_instruct.engines import check_running_engines
    from open_instruct.errors import ConfigError

    with pytest.raises(ConfigError, match=r"vLLM engine 0 \(http://127.0.0.1:1\) of vllm_server_urls does not answer"):
        check_running_engines(["http://127.0.0.1:1"], 1, 64)


def test_a_flash_attn_that_does_not_import_is_named_before_loading(tmp_path, monkeypatch):
    """Issue 22, item 9: flash-attn built for another torch fails on import (an undefined symbol); that is named
    before any model loads too (a stand-in package here that raises what such a build raises)."""
    from open_instruct.errors import ConfigError
    from open_instruct.preflight import check_attention_kernel

    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c104cuda9SetDevice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    with pytest.raises(ConfigError, match=r"flash-attn package does not import \(undefined symbol: _ZN3c104cuda"):
        check_attention_kernel("flash_attention_2")
    check_attention_kernel("sdpa")  # other kernels need nothing


def assert_refused_before_any_model_loads(case, t, capsys) -> None:
    """Run the case's script: exit 2, every needle in the message, the finished runs nearby (and the case's own
    finished folder) untouched, nothing but run.json written into the output folder."""
    script, argv, needles, intact = case
    finished_sft, finished_ppo, tmp_path = t.sft, t.ppo, t.tmp
    neighbours = {str(finished_sft): snapshot(finished_sft), str(finished_ppo): snapshot(finished_ppo)}
    before = snapshot(intact) if intact else None
    out_before = snapshot(tmp_path / "out")
    capsys.readouterr()

    code = run_script(script, argv)

    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    for folder, files_before in neighbours.items():
        assert snapshot(folder) == files_before, f"{folder} changed"
    if intact:
        assert snapshot(intact) == before, "the finished run's folder changed"
    written = set(snapshot(tmp_path / "out")) - set(out_before)
    assert written <= {run_dir.RUN_FILE, run_dir.CONFIG_FILE}, f"a refused run wrote {sorted(written)}"  # not results


def test_every_best_metric_the_configs_accept_is_what_the_scripts_log(finished_sft, finished_ppo):
    for out, cls in ((finished_sft, SFTConfig), (finished_ppo, RLVRConfig)):
        logged = {k for row in read_metrics(str(out)) for k in row if k.startswith("eval/")}
        assert logged == set(cls.eval_metrics), (cls.__name__, logged)
    assert DPOConfig.eval_metrics == tuple(f"eval/{k}" for k in dpo.STAT_KEYS)
    assert RewardModelConfig.eval_metrics == tuple(
        reward_model.summarize(dict.fromkeys(reward_model.STAT_KEYS, 0.0), 1, "eval")
    )


def test_identical_pairs_are_skipped_and_counted_with_skip_bad_rows(files):
    from demo.tiny import build_tokenizer

    cfg = DPOConfig(model_name_or_path="m", dataset_name_or_path=files["pref_same"], skip_bad_rows=True)
    examples, stats = data.tokenize_preferences(data.load_rows(files["pref_same"]), build_tokenizer(), cfg)
    assert len(examples) == 15 and stats.bad_rows == 1 and 2 not in [e["row"] for e in examples]
    assert "line 3: chosen and rejected are identical" in stats.first_errors[0]


def test_a_reward_model_without_a_trained_head_is_refused_after_loading_too(tiny_models):
    """For hub names (not checkable before loading) the loader refuses a head that transformers had to initialise."""
    from open_instruct.errors import ConfigError
    from open_instruct.models import load_sequence_classifier

    with pytest.raises(ConfigError, match=r"not a trained reward model: its weights have no \['score.weight'\]"):
        load_sequence_classifier(tiny_models["causal_lm"], require_trained_head=True)
    load_sequence_classifier(tiny_models["seq_cls"], require_trained_head=True)  # a trained head loads


def test_plan_counts_the_evaluations_a_run_makes_and_names_a_missing_local_file(finished_sft, finished_ppo):
    from open_instruct.batch_math import count_eval_points
    from open_instruct.plan import dataset_size

    def evals(out):
        return sum(1 for row in read_metrics(str(out)) if any(k.startswith("eval/") for k in row))

    assert evals(finished_sft) == count_eval_points(4, 2, baseline=False) == 2  # steps 2 and 4
    assert evals(finished_ppo) == count_eval_points(4, 2, baseline=True) == 3  # rollout 0 (baseline), 2, 4
    assert count_eval_points(5, 2, baseline=False) == 3  # 2, 4 and the last step 5
    assert dataset_size("output/no_such/train.jsonl", "train") == (
        None,
        "local file 'output/no_such/train.jsonl' does not exist",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_checkpoints_folder_exits_2_at_start(tiny_models, files, finished_sft, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(finished_sft, out)
    run = run_dir.read_run(str(out))
    run_dir.write_run(str(out), {**run, "finished": False})
    os.chmod(out / "checkpoints", 0o555)
    try:
        assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 2
    finally:
        os.chmod(out / "checkpoints", 0o755)
    assert "checkpoints folder" in capsys.readouterr().err


def test_full_disk_is_said_plainly(tmp_path, monkeypatch):
    """Torch's own words for a full disk are 'PytorchStreamWriter failed writing file ...': the error says ENOSPC."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("u", "total used free")(10, 10, 0))
    with pytest.raises(OSError, match=r"No space left on device while writing .* \(0 bytes free\)") as e:
        checkpoint.raise_plainly_if_disk_full(RuntimeError("PytorchStreamWriter failed writing file data/0"), "/x")
    assert e.value.errno == errno.ENOSPC


# ---------------------------------------------------------------------------------------------------------------------
# Re-running a finished run; overwrite; concurrent runs


def test_rerun_of_a_finished_run_with_auto_finds_it_finished_and_touches_nothing(
    tiny_models, files, finished_sft, tmp_path, capsys, no_model_loads
):
    out = tmp_path / "out"
    shutil.copytree(finished_sft, out)
    before = snapshot(out)
    assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 0
    said = capsys.readouterr().out
    assert "already finished" in said
    assert f"--resume_from_checkpoint {out / 'checkpoints' / 'step_4'} or an older one" in said  # its newest
    assert snapshot(out) == before

    shutil.rmtree(out / "checkpoints")  # a run that kept none is not told to resume one
    assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 0
    said = capsys.readouterr().out
    assert "--resume_from_checkpoint" not in said
    assert "it kept no checkpoints: start a new run from its final model" in said
    assert f"--model_name_or_path {out / 'final_model'}" in said


def test_delete_finished_run_says_what_it_deletes(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "final_model").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    run_dir.clear_for_new_run(str(out), delete_finished=True)
    assert f"--delete_finished_run true: deleting the finished run in {out}" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == []


def test_overwrite_replaces_the_old_run_cleanly(tiny_models, files, finished_sft, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_sft, out)
    old_id = run_dir.run_id_of(str(out))
    shutil.copytree(out / "checkpoints" / "step_4", out / "checkpoints" / "step_999")  # an old run's later step
    (out / "notes.txt").write_text("mine")  # not a run file: left alone

    assert run_script("sft", sft_argv(tiny_models, files, out, "--overwrite_output_dir", "true")) == 0

    new = run_dir.read_run(str(out))
    assert new["run_id"] != old_id and new["finished"]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_4"]  # step_999 went with the old run
    for _, path in checkpoint.list_checkpoints(str(out)):
        assert checkpoint.read_state(path)["run_id"] == new["run_id"]
    assert (out / "notes.txt").read_text() == "mine"
    assert_rows_match(read_metrics(str(finished_sft)), read_metrics(str(out)))  # the same command: the same run
    assert_weights_match(finished_sft / "final_model", out / "final_model")


def test_auto_resumes_only_checkpoints_of_its_own_run(tiny_models, files, finished_sft, tmp_path, capsys):
    """A checkpoint planted from another run (another run_id) is skipped with its reason; the run's own one is used."""
    out = tmp_path / "out"
    shutil.copytree(finished_sft, out)
    run_dir.write_run(str(out), {**run_dir.read_run(str(out)), "finished": False})
    shutil.rmtree(out / "final_model")
    foreign = out / "checkpoints" / "step_6"
    shutil.copytree(out / "checkpoints" / "step_4", foreign)
    state = checkpoint.read_state(str(foreign))
    with open(foreign / checkpoint.STATE, "w") as f:
        json.dump({**state, "run_id": "someoneelse"}, f)
    checkpoint.write_manifest(str(foreign))

    assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 0
    printed = capsys.readouterr().out
    assert "written by run someoneelse, not this run" in printed
    assert f"resumed from {out / 'checkpoints' / 'step_4'}" in printed
    assert_weights_match(finished_sft / "final_model", out / "final_model")


@pytest.mark.concurrency
def test_two_concurrent_runs_the_second_refuses(tiny_models, files, tmp_path, capsys):
    out = tmp_path / "out"
    argv = sft_argv(tiny_models, files, out, "--num_train_epochs", "12")  # 48 steps
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.update(
        stop_at("metrics_row", 1)
    )  # the first run holds its folder, stopped after step 1, while the second tries
    first = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "open_instruct", "sft.py"), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_stopped(first.pid, 300)
        capsys.readouterr()
        assert run_script("sft", argv + ["--resume_from_checkpoint", "auto"]) == 2
        assert f"in use by another run (pid {first.pid}" in capsys.readouterr().err
        os.kill(first.pid, signal.SIGCONT)
        log, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, log[-3000:]
    rows = read_metrics(str(out))
    assert max(r["optimizer_step"] for r in rows) == 48 and run_dir.read_run(str(out))["finished"]
    assert not os.path.exists(out / run_dir.LOCK_FILE)


def test_a_lock_left_by_a_dead_process_is_taken_over(tiny_models, files, tmp_path):
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    plant_lock(out, dead.pid)
    assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 0
    assert not os.path.exists(out / run_dir.LOCK_FILE)  # released at the end


def crashed_copy(finished, out) -> None:
    """A copy of a finished run as if it had crashed after its last checkpoint (not finished, no final_model)."""
    shutil.copytree(finished, out)
    run_dir.write_run(str(out), {**run_dir.read_run(str(out)), "finished": False})
    shutil.rmtree(out / "final_model")


def test_auto_never_continues_a_run_of_another_script(
    tiny_models, files, finished_sft, tmp_path, capsys, no_model_loads
):
    """Issue 22.6: `dpo.py ... --resume_from_checkpoint auto` into an SFT run's folder (crashed before its first
    checkpoint, crashed later, or finished) exits 2 naming the script found and the folder, before any model loads,
    and changes nothing there. The old code adopted a folder without checkpoints (a fresh DPO run that wiped the SFT
    run's metrics), said "already finished" (exit 0) for a finished one, and refused the crashed one only through
    its checkpoint's script."""
    for case in ("crashed_before_a_checkpoint", "crashed", "finished"):
        out = tmp_path / case
        if case == "finished":
            shutil.copytree(finished_sft, out)
        else:
            crashed_copy(finished_sft, out)
        if case == "crashed_before_a_checkpoint":
            shutil.rmtree(out / "checkpoints")
        before = snapshot(out)
        capsys.readouterr()
        assert run_script("dpo", dpo_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 2
        err = capsys.readouterr().err
        assert f"output_dir {str(out)!r} holds run {run_dir.run_id_of(str(out))} of script 'sft'" in err
        assert "not 'dpo'" in err
        assert snapshot(out) == before


def test_resume_refuses_changed_data_run_length_and_schedule_naming_old_and_new(
    tiny_models, files, finished_sft, tmp_path, capsys, no_model_loads
):
    """Issue 22.7: the old code resumed a changed dataset ("finished" with no training on a smaller one), run length
    (the learning rate jumped) or schedule silently. Each is refused with exit 2 before any model loads, naming the
    key with its checkpoint and new values and the flag that accepts it; nothing in the folder changes."""
    out = tmp_path / "out"
    crashed_copy(finished_sft, out)
    before = snapshot(out)
    grown = write_jsonl(str(tmp_path / "grown.jsonl"), sft_rows(40, 0))  # the 32 rows of files["sft"] and 8 more

    def refused(*extra: str) -> str:
        capsys.readouterr()
        assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto", *extra)) == 2
        return capsys.readouterr().err

    err = refused("--num_train_epochs", "3")
    assert "num_train_epochs: checkpoint 1.0, now 3.0" in err and "--allow_resume_changes num_train_epochs" in err
    err = refused("--learning_rate", "1e-3", "--lr_scheduler_type", "cosine")
    assert "learning_rate: checkpoint 0.003, now 0.001" in err and "lr_scheduler_type: checkpoint 'linear'" in err
    assert "--allow_resume_changes learning_rate lr_scheduler_type" in err
    # another file: its name is accepted, its content is not (the checkpoint's file had 32 rows, this one 40)
    err = refused("--dataset_name_or_path", grown, "--allow_resume_changes", "dataset_name_or_path")
    size = os.path.getsize(files["sft"])
    assert f"dataset_content: {files['sft']} (now {grown}): {size:,} -> {os.path.getsize(grown):,} bytes" in err
    assert "dataset_name_or_path" not in err.split("dataset_content")[0]  # accepted: not among the refused
    err = refused("--allow_resume_changes", "lora_rank")
    assert "allow_resume_changes: ['lora_rank'] cannot be accepted" in err
    assert "not resume keys" in refused("--allow_resume_changes", "num_train_epoch")
    assert run_script("sft", sft_argv(tiny_models, files, out, "--allow_resume_changes", "learning_rate")) == 2
    assert "allow_resume_changes ['learning_rate'] applies to a resume" in capsys.readouterr().err
    assert snapshot(out) == before


def test_resume_content_identity_and_accepted_changes(tiny_models, files, finished_sft, tmp_path, capsys):
    """The data identity a checkpoint records (path, size, mtime, blake2b of each training file): a copy with the
    same bytes under another name (its name accepted) or the same file touched resumes; the same size with other
    bytes is refused (the digest tells); lora_alpha is compared for LoRA runs; an accepted change is printed."""
    from open_instruct.errors import ConfigError

    step = last_checkpoint(finished_sft)
    state = checkpoint.read_state(step)
    assert state["data_identity"] == [
        {"path": os.path.abspath(files["sft"]), "size": os.path.getsize(files["sft"]),
         "mtime_ns": os.stat(files["sft"]).st_mtime_ns, "blake2b": checkpoint.file_digest(files["sft"])}
    ]  # fmt: skip
    copy = tmp_path / "copy.jsonl"
    shutil.copy(files["sft"], copy)  # a new mtime, the same bytes
    allow = ["--resume_from_checkpoint", step, "--allow_resume_changes", "dataset_name_or_path"]
    cfg = parse_config(
        SFTConfig, sft_argv(tiny_models, files, tmp_path / "o", "--dataset_name_or_path", str(copy), *allow)
    )
    checkpoint.check_resume_compatible(step, cfg, 1)
    assert "accepting a change (allow_resume_changes): dataset_name_or_path" in capsys.readouterr().out
    text = copy.read_text()
    copy.write_text(text.replace("a", "b", 1))  # same size, other bytes
    with pytest.raises(ConfigError, match=r"dataset_content: .*copy.jsonl\): [\d,]+ bytes both, blake2b"):
        checkpoint.check_resume_compatible(step, cfg, 1)
    # lora_alpha 16 -> 32 in a LoRA run: refused, accepted when named
    lora_step = tmp_path / "lora_step"
    lora_step.mkdir()
    saved = {**state, "config": {**state["config"], "use_lora": True, "lora_rank": 8, "lora_alpha": 16.0}}
    (lora_step / checkpoint.STATE).write_text(json.dumps(saved))
    lora_argv = sft_argv(tiny_models, files, tmp_path / "o", "--use_lora", "true", "--lora_rank", "8")
    lora_argv += ["--resume_from_checkpoint", str(lora_step)]
    with pytest.raises(ConfigError, match=r"lora_alpha: checkpoint 16.0 \(the adapters' scale"):
        checkpoint.check_resume_compatible(str(lora_step), parse_config(SFTConfig, lora_argv), 1)
    accepted = parse_config(SFTConfig, [*lora_argv, "--allow_resume_changes", "lora_alpha"])
    checkpoint.check_resume_compatible(str(lora_step), accepted, 1)


def test_an_accepted_longer_run_resumes_and_trains_on(tiny_models, files, finished_sft, tmp_path, capsys):
    """--allow_resume_changes num_train_epochs: the crashed 4-step run continues to 8 steps from its checkpoint."""
    out = tmp_path / "out"
    crashed_copy(finished_sft, out)
    argv = sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto", "--num_train_epochs", "2")
    assert run_script("sft", [*argv, "--allow_resume_changes", "num_train_epochs"]) == 0
    printed = capsys.readouterr().out
    assert "accepting a change (allow_resume_changes): num_train_epochs: checkpoint 1.0, now 2.0" in printed
    assert f"resumed from {out / 'checkpoints' / 'step_4'}" in printed
    steps = [r["optimizer_step"] for r in read_metrics(str(out)) if "train/loss" in r or "loss" in r]
    assert max(steps) == 8 and run_dir.read_run(str(out))["finished"]


# ---------------------------------------------------------------------------------------------------------------------
# Resume with the same layout: every example / prompt used exactly once; a changed layout is refused


@pytest.fixture()
def count_uses(monkeypatch):
    """Every index the scripts take from data.EpisodeStream (examples in SFT, prompts in RL), in order."""
    taken: list[int] = []
    original = data.EpisodeStream.take

    def take(self, start, count):
        got = original(self, start, count)
        taken.extend(got)
        return got

    monkeypatch.setattr(data.EpisodeStream, "take", take)
    return taken


def test_sft_resumed_with_the_same_layout_uses_each_example_once(
    tiny_models, files, tmp_path, monkeypatch, count_uses, capsys
):
    out = tmp_path / "out"
    with sigterm_at_step(monkeypatch, 3):  # SIGTERM in step 3: checkpoint at step 3, exit 0
        assert run_script("sft", sft_argv(tiny_models, files, out)) == 0
    assert "SIGTERM: checkpoint written at optimizer step 3" in capsys.readouterr().out
    assert len(count_uses) == 24
    assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 0
    uses = collections.Counter(count_uses)
    assert len(count_uses) == 32 and sorted(uses) == list(range(32)) and set(uses.values()) == {1}

    # The same resume with another batch layout is refused before any model loads, naming the keys.
    shutil.rmtree(out / "final_model")
    run_dir.write_run(str(out), {**run_dir.read_run(str(out)), "finished": False})
    capsys.readouterr()
    argv = sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto", "--gradient_accumulation_steps", "1")
    assert run_script("sft", argv) == 2
    err = capsys.readouterr().err
    assert "mini_batch_size: checkpoint 8" in err and "gradient_accumulation_steps 1" in err


def test_sft_train_order_as_written_reads_the_file_in_order_across_a_resume(
    tiny_models, files, tmp_path, monkeypatch, count_uses, capsys
):
    out = tmp_path / "out"
    with sigterm_at_step(monkeypatch, 3):
        assert run_script("sft", sft_argv(tiny_models, files, out, "--train_order", "as_written")) == 0
    assert count_uses == list(range(24))  # 3 steps of 8, the file's first 24 rows in order
    resume = ["--train_order", "as_written", "--resume_from_checkpoint", "auto"]
    assert run_script("sft", sft_argv(tiny_models, files, out, *resume)) == 0
    assert count_uses == list(range(32))

    # A resume that would read the rows in another order continues another experiment: refused, naming the key.
    shutil.rmtree(out / "final_model")
    run_dir.write_run(str(out), {**run_dir.read_run(str(out)), "finished": False})
    capsys.readouterr()
    assert run_script("sft", sft_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 2
    assert "train_order" in capsys.readouterr().err


def test_rl_resumed_with_the_same_layout_uses_each_prompt_once(
    tiny_models, files, tmp_path, monkeypatch, count_uses, capsys
):
    out = tmp_path / "out"
    with sigterm_at_step(monkeypatch, 2):  # SIGTERM during rollout 2: checkpoint after it, exit 0
        assert run_script("rlvr_ppo", rl_argv(tiny_models, files, out)) == 0
    assert len(count_uses) == 8
    assert run_script("rlvr_ppo", rl_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto")) == 0
    uses = collections.Counter(count_uses)
    assert len(count_uses) == 16 and len(uses) == 16 and set(uses.values()) == {1}  # 4 rollouts x 4 prompts
    assert max(r["rollout_step"] for r in read_metrics(str(out))) == 4

    shutil.rmtree(out / "final_model")
    run_dir.write_run(str(out), {**run_dir.read_run(str(out)), "finished": False})
    capsys.readouterr()
    argv = rl_argv(tiny_models, files, out, "--resume_from_checkpoint", "auto", "--num_samples_per_prompt", "4")
    assert run_script("rlvr_ppo", argv) == 2
    assert "num_samples_per_prompt: checkpoint 2, now 4" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Export, umask, SIGTERM before training, --help, no torch before the config is checked


def test_every_model_of_a_ppo_checkpoint_exports_and_loads(finished_ppo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from open_instruct.export import export_checkpoint

    step = last_checkpoint(finished_ppo)
    assert checkpoint.read_state(step)["model_classes"] == {
        "policy": "AutoModelForCausalLM",
        "value": "AutoModelForSequenceClassification",
    }
    policy = export_checkpoint(step, str(tmp_path / "policy"), "policy")
    assert_weights_match(finished_ppo / "final_model", policy)  # the last checkpoint is the last rollout
    AutoModelForCausalLM.from_pretrained(policy)
    value = export_checkpoint(step, str(tmp_path / "value"), "value")
    model, info = AutoModelForSequenceClassification.from_pretrained(value, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.config.num_labels == 1
    # The exported head is the trained one stored in the checkpoint (under the TokenValueModel's `seq_cls.` prefix).
    import torch
    import torch.distributed.checkpoint as dcp

    stored = {"model.value": {"seq_cls.score.weight": torch.zeros_like(model.score.weight)}}
    dcp.load(stored, checkpoint_id=os.path.join(step, "state"))
    assert torch.equal(stored["model.value"]["seq_cls.score.weight"], model.score.weight)
    assert model.score.weight.abs().sum() > 0


def test_outputs_are_made_with_the_users_umask(finished_sft, tmp_path, umask_022):
    from open_instruct.export import export_checkpoint

    exported = export_checkpoint(last_checkpoint(finished_sft), str(tmp_path / "exported"))
    for folder in ("final_model", "best_model", "checkpoints/step_4", exported):
        path = os.path.join(finished_sft, folder)
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o755), folder
    files = ["metrics.jsonl", "run.json", "final_model/model.safetensors", "checkpoints/step_4/trainer_state.json"]
    files += [
        os.path.join("checkpoints/step_4/state", n) for n in os.listdir(finished_sft / "checkpoints/step_4/state")
    ]
    for file in files:
        assert oct(os.stat(os.path.join(finished_sft, file)).st_mode & 0o777) == oct(0o644), file


@pytest.mark.concurrency
def test_sigterm_while_the_model_loads_exits_0_saying_so(tiny_models, files, tmp_path, monkeypatch, capsys):
    from open_instruct import models

    original = models.load_causal_lm

    def load_and_get_preempted(*args, **kwargs):
        model = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler (installed by runtime.start) runs before os.kill returns
        return model

    monkeypatch.setattr(models, "load_causal_lm", load_and_get_preempted)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert run_script("sft", sft_argv(tiny_models, files, tmp_path / "out")) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "SIGTERM during start-up (model load): stopped before training started" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")
    assert not os.path.exists(tmp_path / "out" / run_dir.LOCK_FILE)


@pytest.mark.concurrency
def test_sigterm_in_the_dpo_reference_pass_exits_0_saying_so(tiny_models, files, tmp_path, monkeypatch, capsys):
    from open_instruct import models

    original, calls = models.pair_logps, {"n": 0}

    def forward_then_sigterm(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(models, "pair_logps", forward_then_sigterm)
    cache = tmp_path / "cache"
    argv = dpo_argv(tiny_models, files, tmp_path / "out", "--reference_cache_dir", str(cache))
    argv += ["--per_device_eval_batch_size", "4"]  # 4 batches in the reference pass
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert run_script("dpo", argv) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "SIGTERM during the DPO reference pass" in capsys.readouterr().err
    assert calls["n"] == 1  # stopped at the next batch
    assert not cache.exists() or not os.listdir(cache)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_lists_every_option_with_help_text_and_the_recipe(script):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "open_instruct", f"{script}.py"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 0, proc.stderr
    assert f"usage: {script}.py [RECIPE.yaml] [--key value ...]" in proc.stdout
    import dataclasses

    for f in dataclasses.fields(CONFIG_CLASSES[script]):
        assert f"--{f.name}" in proc.stdout
        assert f.metadata.get("help"), f"{script}: --{f.name} has no help text"


def test_dashed_aliases_that_help_shows_are_accepted():
    cfg = parse_config(
        SFTConfig, ["--model-name-or-path", "m", "--dataset_name_or_path", "d.jsonl", "--learning-rate", "3e-4"]
    )
    assert cfg.learning_rate == 3e-4 and cfg.model_name_or_path == "m"
    assert (
        parse_config(
            SFTConfig, ["--model_name_or_path", "m", "--dataset_name_or_path", "d", "--no_save_final_model"]
        ).save_final_model
        is False
    )


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_no_torch_import_before_the_config_is_checked(script, tmp_path):
    """`python -X importtime` lists every module imported: a bad config, and a model folder without config.json
    (checked after parsing, before any model), must exit 2 without torch among them."""
    empty = tmp_path / "empty_model"
    empty.mkdir()
    data_file = write_jsonl(str(tmp_path / "d.jsonl"), sft_rows(2, 0))
    base = ["--dataset_name_or_path", data_file, "--output_dir", str(tmp_path / "out"), "--total_episodes", "8"]
    if script != "rlvr_ppo":
        base = base[:-2]
    for extra, needle in (
        (["--model_name_or_path", str(empty), "--adam_epsilon", "-1"], "adam_epsilon"),
        (["--model_name_or_path", str(empty)], "is empty"),
    ):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", os.path.join(REPO, "open_instruct", f"{script}.py"), *base, *extra],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")
        }
        assert "yaml" in imported and "torch" not in imported, script


def test_rl_prompt_ending_with_the_answer_loses_that_turn_and_says_so(tmp_path):
    """Issue 22, item 11: an RL prompt whose last turn is the assistant's answer (open-instruct's RLVR rows are shaped
    so, and its loader drops that turn) trains on the prompt without it, as a row without the answer would; the
    start-up data line counts such rows, so it is never silent."""
    from demo.tiny import build_tokenizer

    rows = rl_rows(8, 4)
    answered = [dict(r, messages=r["messages"] + [{"role": "assistant", "content": r["ground_truth"]}]) for r in rows]
    answered[0] = rows[0]  # one row without an answer
    cfg = RLVRConfig(
        model_name_or_path="m", total_episodes=64, dataset_name_or_path=write_jsonl(str(tmp_path / "a.jsonl"), answered)
    )
    plain = RLVRConfig(
        model_name_or_path="m", total_episodes=64, dataset_name_or_path=write_jsonl(str(tmp_path / "p.jsonl"), rows)
    )
    for c in (cfg, plain):
        c.dataset_cache_dir = "none"
    train, _, stats = data.load_train_eval(cfg, build_tokenizer(), data.tokenize_prompts)
    expected, _, plain_stats = data.load_train_eval(plain, build_tokenizer(), data.tokenize_prompts)
    assert [e["prompt_ids"] for e in train] == [e["prompt_ids"] for e in expected] and len(train) == 8
    assert stats.answer_turns_dropped == 7 and plain_stats.answer_turns_dropped == 0
    assert "7 RL prompts ended with an assistant turn: that turn dropped" in stats.summary()


# ---------------------------------------------------------------------------------------------------------------------
# Issue 69: bad inputs a user makes with the newer features (docs/testing.md's table). Each exits 2, naming it, before
# a model loads; no finished run is needed, so the cases run on the data and tiny models alone.

JUDGE_FILE = """
from open_instruct.judge import Judge

judge = Judge({template!r}, url="http://127.0.0.1:9/v1", model="m"{extra})
"""


def build_issue_69_case(name: str, tiny_models, files, tmp) -> tuple[list[str], list[str]]:
    """(the RL script's argv, the needles its message must hold)."""
    out = tmp / "out"

    def rl(*extra):
        return rl_argv(tiny_models, files, out, *extra)

    def write(file_name: str, text: str) -> str:
        (tmp / file_name).write_text(text)
        return str(tmp / file_name)

    from importlib.metadata import version

    if name == "reasoning_gym_task_misspelt":
        return rl("--dataset_name_or_path", "reasoning_gym:leg_countin"), [
            f"'leg_countin' is not a reasoning-gym {version('reasoning-gym')} task",
            "did you mean leg_counting",
        ]
    if name == "reasoning_gym_setting_misspelt":
        return rl("--dataset_name_or_path", "reasoning_gym:leg_counting?max_animal=5"), ["max_animal", "max_animals"]
    if name == "reasoning_gym_size_not_a_number":
        return rl("--dataset_name_or_path", "reasoning_gym:leg_counting?size=many"), ["size", "'many'"]
    if name == "verifiers_file_missing":
        spec = f"verifiers:{tmp / 'no_env.py'}"
        return rl("--dataset_name_or_path", spec, "--environment", spec), ["no_env.py"]
    if name == "verifiers_file_without_a_taskset":
        spec = f"verifiers:{write('my_env.py', 'x = 1')}"
        return rl("--dataset_name_or_path", spec, "--environment", spec), ["exports no verifiers.v1 Taskset subclass"]
    if name == "judge_template_without_completion":
        spec = write("judges.py", JUDGE_FILE.format(template="Rate {prompt}", extra="")) + ":judge"
        return rl("--reward_functions", spec), ["Judge: the template must contain {completion}"]
    if name == "judge_score_pattern_without_group":
        extra = ', score_pattern=r"\\d+"'
        spec = write("judges.py", JUDGE_FILE.format(template="Rate {completion}", extra=extra)) + ":judge"
        return rl("--reward_functions", spec), ["Judge: score_pattern", "needs a group around the number"]
    if name == "gpu_not_in_the_planners_table":
        return rl("--gpu", "H1000"), ["gpu 'H1000' is not in the planner's table"]
    if name == "num_processes_zero":
        return rl("--num_processes", "0"), ["num_processes must be > 0, got 0"]
    if name == "num_processes_other_than_the_launch":
        return rl("--num_processes", "4"), ["num_processes 4", "differs from this launch's 1 processes"]
    if name == "algo_kwargs_no_function_takes":
        return rl("--algo_kwargs", "cap=3"), ["algo_kwargs ['cap'] is taken by none of"]
    if name == "user_estimator_returning_its_input":
        spec = write("wrong.py", "def wrong_sig(x):\n    return x\n") + ":wrong_sig"
        return rl("--advantage_estimator", spec), [
            "returned an AdvantageInputs",
            "must return rl_algorithms.Advantages",
        ]
    if name == "delete_finished_run_without_overwrite":
        return rl("--delete_finished_run", "true"), ["delete_finished_run applies with --overwrite_output_dir true"]
    if name == "openenv_url_without_a_scheme":
        env = "from open_instruct.openenv_env import OpenEnvEnvironment\n\n\nclass Echo(OpenEnvEnvironment):\n"
        spec = write("envs.py", env + "    url = 'localhost:8000'\n") + ":Echo"
        return rl("--environment", spec), ["Echo.url 'localhost:8000' has no scheme: add http://"]
    if name == "teacher_path_empty":
        return rl("--teacher_model_name_or_path", ""), ["teacher_model_name_or_path is empty ('')"]
    raise KeyError(name)


ISSUE_69_CASES = [
    "reasoning_gym_task_misspelt",
    "reasoning_gym_setting_misspelt",
    "reasoning_gym_size_not_a_number",
    "verifiers_file_missing",
    "verifiers_file_without_a_taskset",
    "judge_template_without_completion",
    "judge_score_pattern_without_group",
    "gpu_not_in_the_planners_table",
    "num_processes_zero",
    "num_processes_other_than_the_launch",
    "algo_kwargs_no_function_takes",
    "user_estimator_returning_its_input",
    "delete_finished_run_without_overwrite",
    "openenv_url_without_a_scheme",
    "teacher_path_empty",
]


@pytest.mark.parametrize("name", ISSUE_69_CASES)
def test_issue_69_bad_inputs_exit_2_before_any_model_loads(name, tiny_models, files, tmp_path, capsys, no_model_loads):
    """The table in docs/testing.md: each exits 2 naming what is wrong, writes nothing but run.json/config.yaml into
    the output folder, and loads no model."""
    if name.startswith("reasoning_gym") and importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning-gym is not installed")
    argv, needles = build_issue_69_case(name, tiny_models, files, tmp_path)
    capsys.readouterr()
    code = run_script("rlvr_ppo", argv)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    written = set(snapshot(tmp_path / "out")) if (tmp_path / "out").exists() else set()
    assert written <= {run_dir.RUN_FILE, run_dir.CONFIG_FILE}, f"a refused run wrote {sorted(written)}"
