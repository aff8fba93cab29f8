"""A start never loses a run, and a dry run checks what a real start checks (issue 41).

Replaying a finished run's saved config.yaml into its own folder: plainly (refused, nothing touched), with a recipe
that still sets overwrite_output_dir (refused), with --overwrite_output_dir true on the command line (the finished
run moved aside, byte for byte), with a check that fails (refused before the folder is touched), and with deletion
asked for (--delete_finished_run true: gone). `--dry_run` runs the same start checks (runtime.start_checks) and
exits 2 with a real start's message for a missing dataset, a missing reward-function file, a misspelt function name,
a function that raises, and a **kwargs function that needs a column the rows lack. The memory check judges the
layout named (gpu / gpu_memory_gb / num_processes), and every flag a hint or error names exists."""

from __future__ import annotations

import ast
import dataclasses
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from training_helpers import one_torch_thread, write_fake_model  # noqa: F401  (autouse fixture)

from demo import synthetic
from open_instruct import plan, rlvr_ppo, run_dir, runtime
from open_instruct.config import CONFIG_CLASSES, DPOConfig, RLVRConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARDS = textwrap.dedent(
    """
    def length(completions, **kwargs):
        return [0.1 * len(c) for c in completions]

    def raises(completions, **kwargs):
        raise ValueError("no score for this")

    def needs_answer(completions, **kwargs):
        return [float(c == a) for c, a in zip(completions, kwargs["answer"])]

    def names_answer(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]
    """
)


def snapshot(folder) -> dict[str, str]:
    """sha256 of every file under `folder` (relative path -> digest)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def exit_and_output(call, capsys) -> tuple[int, str]:
    """call() in this process: its exit code (0 when it returns) and stderr + stdout; the folder locks released."""
    try:
        call()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        run_dir.release_all()
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def start(argv: list[str], capsys) -> tuple[int, str]:
    """runtime.start in this process (what a script runs before loading a model): exit code (0 when it returns:
    a real start got past every check and claimed the folder) and stderr + stdout."""
    return exit_and_output(lambda: runtime.start(RLVRConfig, argv), capsys)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("start_checks")
    files = synthetic.write_task_files(str(d / "data"), n_train=16, n_eval=4)
    (d / "my_rewards.py").write_text(REWARDS)
    return {"files": files, "rewards": str(d / "my_rewards.py"), "dir": d}


def rl_argv(model: str, inputs, out, *extra: str) -> list[str]:
    return [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", model, "--dataset_name_or_path", inputs["files"]["rl_train"],
        "--eval_dataset_name_or_path", inputs["files"]["rl_eval"], "--output_dir", str(out),
        "--total_episodes", "16", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2",
        "--per_device_train_batch_size", "4", "--num_epochs", "1", "--response_length", "8",
        "--eval_steps", "100", "--checkpointing_steps", "1", "--reward_functions", f"{inputs['rewards']}:length",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tiny_models, inputs, tmp_path_factory):
    """A finished tiny RL run driven by a reward function (final_model/, metrics, checkpoints, config.yaml)."""
    out = tmp_path_factory.mktemp("finished_rl") / "out"
    try:
        runtime.run(rlvr_ppo.main, rl_argv(tiny_models["causal_lm"], inputs, out))
    except SystemExit as e:
        assert e.code in (0, None)
    assert run_dir.read_run(str(out))["finished"] and (out / "final_model").is_dir()
    return out


@pytest.fixture()
def run_copy(finished_run, tmp_path):
    """A copy of the finished run in a fresh folder (its config.yaml's output_dir is the copy), and its snapshot."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    saved = (out / "config.yaml").read_text()
    assert f"\noutput_dir: {finished_run}\n" in saved
    (out / "config.yaml").write_text(saved.replace(f"\noutput_dir: {finished_run}\n", f"\noutput_dir: {out}\n"))
    return out, snapshot(out)


def replaced_folders(out) -> list[str]:
    parent = os.path.dirname(str(out))
    return sorted(n for n in os.listdir(parent) if n.startswith(os.path.basename(str(out)) + ".replaced-"))


def test_saved_config_never_carries_a_destructive_setting(run_copy):
    out, _ = run_copy
    saved = (out / "config.yaml").read_text()
    assert "overwrite_output_dir" not in saved and "delete_finished_run" not in saved and "dry_run" not in saved
    assert "reward_functions" in saved  # the recipe itself is there


def test_plain_replay_is_refused_and_touches_nothing(run_copy, capsys):
    out, before = run_copy
    code, text = start([str(out / "config.yaml")], capsys)
    assert code == 2 and "not starting a new run over it" in text and "finished" in text
    assert snapshot(out) == before and replaced_folders(out) == []


def test_a_recipe_that_sets_overwrite_output_dir_is_refused(run_copy, capsys):
    """An older saved config.yaml (or any recipe) with overwrite_output_dir: true: exit 2, nothing touched."""
    out, _ = run_copy
    old_style = out.parent / "old_config.yaml"
    old_style.write_text((out / "config.yaml").read_text() + "overwrite_output_dir: true\n")
    before = snapshot(out)
    code, text = start([str(old_style)], capsys)
    assert code == 2 and "sets overwrite_output_dir: True, which only the command line may set" in text
    assert snapshot(out) == before and replaced_folders(out) == []
    old_style.write_text((out / "config.yaml").read_text() + "overwrite_output_dir: false\n")  # harmless: accepted
    code, text = start([str(old_style)], capsys)
    assert code == 2 and "not starting a new run over it" in text  # refused for the finished run, not the key


@pytest.mark.parametrize(
    "override,message",
    [
        (["--reward_functions", "REWARDS:raises"], "raised ValueError: no score for this"),
        (["--dataset_name_or_path", "MISSING.jsonl"], "does not exist"),
        (["--reward_functions", "REWARDS:lenght"], "lenght"),
    ],
    ids=["reward-function-raises", "dataset-missing", "misspelt-function"],
)
def test_replay_with_overwrite_that_fails_a_check_touches_nothing(run_copy, inputs, capsys, override, message):
    out, before = run_copy
    override = [a.replace("REWARDS", inputs["rewards"]).replace("MISSING", str(out.parent / "gone")) for a in override]
    code, text = start([str(out / "config.yaml"), "--overwrite_output_dir", "true", *override], capsys)
    assert code == 2 and message in text, text
    assert snapshot(out) == before and replaced_folders(out) == []


def test_replay_with_overwrite_moves_the_finished_run_aside(run_copy, capsys):
    out, before = run_copy
    old_id = run_dir.run_id_of(str(out))
    (out / "notes.txt").write_text("mine")  # not a run file: stays
    code, text = start([str(out / "config.yaml"), "--overwrite_output_dir", "true"], capsys)
    assert code == 0, text
    (aside,) = replaced_folders(out)
    assert f"was moved to {out.parent / aside}" in text
    assert snapshot(out.parent / aside) == before  # every file of the finished run, byte for byte
    assert run_dir.run_id_of(str(out.parent / aside)) == old_id
    new = run_dir.read_run(str(out))
    assert new["run_id"] != old_id and not new.get("finished")
    assert sorted(os.listdir(out)) == ["config.yaml", "notes.txt", "run.json"]


def test_replay_with_deletion_asked_deletes_the_finished_run(run_copy, capsys):
    out, _ = run_copy
    old_id = run_dir.run_id_of(str(out))
    code, text = start(
        [str(out / "config.yaml"), "--overwrite_output_dir", "true", "--delete_finished_run", "true"], capsys
    )
    assert code == 0, text
    assert replaced_folders(out) == [] and sorted(os.listdir(out)) == ["config.yaml", "run.json"]
    assert run_dir.run_id_of(str(out)) != old_id


def test_delete_finished_run_needs_overwrite_and_is_refused_in_a_recipe(run_copy, capsys):
    out, before = run_copy
    code, text = start([str(out / "config.yaml"), "--delete_finished_run", "true"], capsys)
    assert code == 2 and "delete_finished_run applies with --overwrite_output_dir true only" in text
    recipe = out.parent / "deleting.yaml"
    recipe.write_text((out / "config.yaml").read_text() + "delete_finished_run: true\n")
    code, text = start([str(recipe), "--overwrite_output_dir", "true"], capsys)
    assert code == 2 and "sets delete_finished_run" in text
    assert snapshot(out) == before and replaced_folders(out) == []


# ---------------------------------------------------------------------------------------------------------------------
# --dry_run: the checks of a real start, the same message


@pytest.fixture()
def fake_model(tmp_path):
    """Passes the folder checks; loading it would fail (the dry run and the refused start never load it)."""
    path = tmp_path / "model"
    write_fake_model(str(path))
    return str(path)


@pytest.mark.parametrize(
    "override,message",
    [
        (["--dataset_name_or_path", "DIR/nowhere.jsonl"], "dataset file 'DIR/nowhere.jsonl' does not exist"),
        (["--reward_functions", "DIR/nowhere.py:length"], "nowhere.py' does not exist"),
        (["--reward_functions", "REWARDS:lenght"], "'lenght'"),
        (["--reward_functions", "REWARDS:raises"], "raised ValueError: no score for this"),
        (["--reward_functions", "REWARDS:needs_answer"], "requires ['answer'], which is never passed"),
        (["--reward_functions", "REWARDS:names_answer"], "requires ['answer'], which is never passed"),
    ],
    ids=["dataset-missing", "reward-file-missing", "misspelt-function", "function-raises", "kwargs-column",
         "named-column-with-kwargs"],
)  # fmt: skip
def test_dry_run_exits_2_with_the_message_of_a_real_start(fake_model, inputs, tmp_path, capsys, override, message):
    override = [a.replace("REWARDS", inputs["rewards"]).replace("DIR", str(tmp_path)) for a in override]
    message = message.replace("DIR", str(tmp_path))
    argv = rl_argv(fake_model, inputs, tmp_path / "out", *override)
    dry_code, dry_text = start([*argv, "--dry_run", "true"], capsys)
    real_code, real_text = start(argv, capsys)
    assert dry_code == real_code == 2 and message in dry_text, dry_text
    assert dry_text == real_text  # one code path: the same message
    assert not os.path.exists(tmp_path / "out" / "run.json")  # the real start stopped before claiming the folder
    if "answer" in override[-1]:
        assert "the rows' columns ['dataset', 'ground_truth'" in dry_text  # the columns there are


def test_dry_run_checks_the_first_rows_in_the_declared_format(fake_model, inputs, tmp_path, capsys):
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    code, text = start(rl_argv(fake_model, inputs, tmp_path / "out", "--dataset_name_or_path", str(sft_file),
                               "--reward_functions", "null", "--dry_run", "true"), capsys)  # fmt: skip
    assert code == 2 and f"DataError: {sft_file} line 1: RL prompt column(s) ['ground_truth'] not found" in text, text
    bad_rows = tmp_path / "rl.jsonl"  # the declared format, a bad row: the loader's message for it
    row = '{"messages": [{"role": "asistant", "content": "hi"}], "ground_truth": "1", "dataset": "gsm8k"}'
    bad_rows.write_text(row + "\n")
    code, text = start(rl_argv(fake_model, inputs, tmp_path / "out", "--dataset_name_or_path", str(bad_rows),
                               "--reward_functions", "null", "--dry_run", "true"), capsys)  # fmt: skip
    assert code == 2 and f"DataError: {bad_rows} line 1:" in text and "did you mean 'assistant'" in text, text


def test_dry_run_of_good_inputs_exits_0_and_says_the_layout(tiny_models, inputs, tmp_path, capsys):
    code, text = start(rl_argv(tiny_models["causal_lm"], inputs, tmp_path / "out", "--dry_run", "true"), capsys)
    assert code == 0, text
    assert "Layout judged: 1 process(es) on " in text and not os.path.exists(tmp_path / "out" / "run.json")


# ---------------------------------------------------------------------------------------------------------------------
# The memory check judges the layout named


def dpo_8b_start(argv: list[str], capsys) -> tuple[int, str]:
    try:
        runtime.start(DPOConfig, [os.path.join(REPO, "configs", "dpo_8b.yaml"), "--dry_run", "true", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err + captured.out


@pytest.fixture()
def no_gpu_here(monkeypatch):
    """A machine without a GPU and with 24 GB of memory (whatever runs the test)."""
    monkeypatch.setattr(plan.shutil, "which", lambda name: None)
    monkeypatch.setattr(plan, "host_memory_gb", lambda: 24.0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_8b_dry_run_without_a_gpu_judges_the_layout_named(no_gpu_here, capsys, monkeypatch):
    code, text = dpo_8b_start(["--gpu", "H100", "--num_processes", "8"], capsys)
    assert code == 0, text
    assert "Layout judged: 8 process(es) on H100, 80 GB each (as named)" in text
    # fp32 weights + gradients + AdamW (16 bytes/parameter) of 8.03e9 parameters over 8 FSDP shards: 16.06 GB resident
    assert re.search(r"Memory per GPU \(predicted peak; docs/gpu\.md\): \d+\.\d GB of 80 GB", text)
    assert re.search(r"policy AdamW moments \(fp32\)\s+8\.03 GB", text)  # 8 bytes x 8.03e9 / 8 shards
    monkeypatch.setenv("WORLD_SIZE", "8")  # the launcher's world size instead of num_processes
    code, text = dpo_8b_start(["--gpu_memory_gb", "80"], capsys)
    assert code == 0 and "Layout judged: 8 process(es) on H100, 80 GB each (as named)" in text


def test_8b_dry_run_told_nothing_says_how_to_name_the_layout(no_gpu_here, capsys):
    code, text = dpo_8b_start([], capsys)
    assert code == 2
    judged = "judged: 1 process(es) on this machine's CPU, 24 GB of host memory each"
    assert f"does not fit in host memory ({judged})" in text
    assert "name it: --gpu H100 (or --gpu_memory_gb N) and --num_processes 8" in text


def test_a_real_start_refuses_num_processes_other_than_the_launch(fake_model, inputs, tmp_path, capsys):
    code, text = start(rl_argv(fake_model, inputs, tmp_path / "out", "--num_processes", "8"), capsys)
    assert code == 2 and "num_processes 8 (the world size a --dry_run plans) differs from this launch's 1" in text


# ---------------------------------------------------------------------------------------------------------------------
# Every flag named in a hint or error exists


LAUNCHER_FLAGS = {"config_file", "num-processes", "cpu"}  # accelerate launch's, named in launch hints
OTHER_PROGRAMS = {
    # files that build other programs' command lines (vllm serve, bwrap/unshare), not advice to the user
    "open_instruct/engines.py", "open_instruct/engine_client.py", "open_instruct/vllm_gloo_transfer.py",
    "open_instruct/sandbox.py",
}  # fmt: skip
NOT_OPTIONS = {
    "worker",  # rewards.py re-runs itself as `python -m open_instruct.rewards --worker`
    "no-build-isolation",  # pip's, in the flash-attn install hint
    "key", "flag", "other", "name",  # placeholders in config.py's docstrings about the syntax
    "help",
    "model",  # python -m open_instruct.export's own option (its docstring)
    "port", "max-model-len", "logprobs-mode",  # vllm serve's, in teacher_server.py's advice on starting a teacher
}  # fmt: skip


def planner_flags() -> set[str]:
    """The options `python -m open_instruct.plan` accepts, from its --help."""
    proc = subprocess.run(
        [sys.executable, "-m", "open_instruct.plan", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"--([a-z_]+)", proc.stdout))


def test_every_flag_named_in_a_hint_exists():
    keys = {f.name for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls)}
    planner = planner_flags()
    assert {"mfu", "gpu", "num_examples"} <= planner  # the --help was read
    unknown = []
    for path in sorted(glob.glob(os.path.join(REPO, "open_instruct", "*.py"))):
        relative = os.path.relpath(path, REPO)
        if relative in OTHER_PROGRAMS:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):  # every string literal, f-strings' literal parts included
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for flag in re.findall(r"(?<![\w-])--([a-z][a-z0-9_\-]*[a-z0-9])", node.value):
                key = flag.replace("-", "_")  # the dashed aliases are accepted (config._option_key)
                key = key[3:] if key.startswith("no_") and key[3:] in keys else key
                script_key = key in keys
                planner_flag = relative == "open_instruct/plan.py" and key in planner
                if not (script_key or planner_flag or flag in LAUNCHER_FLAGS or flag in NOT_OPTIONS):
                    unknown.append(f"{relative}: --{flag}")
    assert unknown == [], unknown


# ---------------------------------------------------------------------------------------------------------------------
# One start-check path for every source (issue 69): the rows an integration makes are read, tokenized with the run's
# limits and probed like a local file's, so the dry run refuses what the real script refuses, before any model loads


def real_script(argv: list[str], capsys) -> tuple[int, str]:
    """rlvr_ppo.py's entry point in this process (runtime.run(main)): its exit code and stderr + stdout."""
    return exit_and_output(lambda: runtime.run(rlvr_ppo.main, argv), capsys)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("DataError:", "config error:", "ConfigError:"))]


LEG_COUNTING = "reasoning_gym:leg_counting?size=16&seed=3"  # prompts of 400-700 characters; a char-level tokenizer


@pytest.mark.parametrize(
    "override,message",
    [
        (["--max_prompt_length", "4"], "no usable rows (0/16 rows kept: 0 bad, 16 dropped as over-long"),
        (["--dataset_name_or_path", LEG_COUNTING, "--max_prompt_length", "512"],
         f"dataset '{LEG_COUNTING}': no usable rows (0/16 rows kept: 0 bad, 16 dropped as over-long"),
        (["--dataset_name_or_path", LEG_COUNTING, "--max_prompt_length", "4096", "--reward_functions",
          "REWARDS:needs_answer"], "requires ['answer'], which is never passed"),
    ],
    ids=["local-rows-over-long", "reasoning-gym-rows-over-long", "reasoning-gym-rows-lack-a-column"],
)  # fmt: skip
def test_dry_run_refuses_what_the_real_script_refuses(tiny_models, inputs, tmp_path, capsys, no_model_loads,
                                                      override, message):  # fmt: skip
    if "reasoning_gym" in " ".join(override):
        pytest.importorskip("reasoning_gym")
    override = [a.replace("REWARDS", inputs["rewards"]) for a in override]
    argv = rl_argv(tiny_models["causal_lm"], inputs, tmp_path / "out", *override)
    dry_code, dry_text = start([*argv, "--dry_run", "true"], capsys)
    real_code, real_text = real_script(argv, capsys)
    assert dry_code == real_code == 2 and message in dry_text, dry_text
    assert error_lines(dry_text) == error_lines(real_text) and len(error_lines(dry_text)) == 1, (dry_text, real_text)
    assert not os.path.exists(tmp_path / "out" / "run.json")


def test_dry_run_passes_first_rows_dropped_when_a_later_row_is_usable(tiny_models, inputs, tmp_path, capsys):
    """The first rows all over-long is no verdict: the loader's whole path decides, as a real start's does."""
    rows = tmp_path / "rows.jsonl"
    long_row = {"messages": [{"role": "user", "content": "x" * 300}], "ground_truth": "1", "dataset": "gsm8k"}
    short_row = {"messages": [{"role": "user", "content": "1+0?"}], "ground_truth": "1", "dataset": "gsm8k"}
    rows.write_text("".join(json.dumps(r) + "\n" for r in [long_row] * 6 + [short_row] * 2))
    argv = rl_argv(tiny_models["causal_lm"], inputs, tmp_path / "out", "--dataset_name_or_path", str(rows),
                   "--max_prompt_length", "96", "--dry_run", "true")  # fmt: skip
    code, text = start(argv, capsys)
    assert code == 0, text


# ---------------------------------------------------------------------------------------------------------------------
# TRL's run length (issue 69): num_train_epochs is refused with the total_episodes it means; a total_episodes that
# is not whole rollouts is said


def test_rl_run_given_num_train_epochs_is_refused_with_the_total_episodes_it_means(fake_model, inputs, tmp_path,
                                                                                   capsys):  # fmt: skip
    argv = rl_argv(fake_model, inputs, tmp_path / "out", "--num_samples_per_prompt", "4", "--num_train_epochs", "3")
    for extra in (["--dry_run", "true"], []):
        code, text = start([*argv, *extra], capsys)
        # rl_train.jsonl holds 16 prompts: 3 passes x 16 prompts x 4 completions each
        assert code == 2 and "3 epochs x 16 prompts x 4 completions = --total_episodes 192" in text, text
        assert text.startswith("config error: num_train_epochs is HF's / TRL's run length")


def test_total_episodes_not_whole_rollouts_says_what_it_trains(tiny_models, inputs, tmp_path, capsys):
    # a rollout: local_rollout_batch_size 4 x num_samples_per_prompt 2 = 8 completions; 18 = 2 rollouts + 2
    argv = rl_argv(tiny_models["causal_lm"], inputs, tmp_path / "out", "--total_episodes", "18", "--dry_run", "true")
    code, text = start(argv, capsys)
    assert code == 0, text
    said = "total_episodes 18 is not a whole number of rollouts of 8 completions (rollout_batch_size 4 x "
    said += "num_samples_per_prompt 2): training 16 (2 rollouts); --total_episodes 24 for one more"
    assert said in text
    code, text = start([*argv[:-2], "--total_episodes", "16", "--dry_run", "true"], capsys)
    assert code == 0 and "not a whole number of rollouts" not in text
