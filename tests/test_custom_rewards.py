"""Custom reward functions by import path (`reward_functions: [module:function, ...]`), TRL's reward_funcs
convention, added to the built-in verifiers' reward: loaded from a user's file, combined by hand-worked numbers,
and every bad path, import or signature stops the run with exit 2 before any model loads."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from training_helpers import write_fake_model

from demo import synthetic
from open_instruct.errors import ConfigError
from open_instruct.rewards import custom_rewards, load_reward_function, reward_function_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

USER_FILE = textwrap.dedent(
    """
    import asyncio

    def brevity(completions, **kwargs):
        return [1.0 - len(c) / 10 for c in completions]

    def exact(completions, ground_truth, **kwargs):  # None: not applicable to that row
        return [None if g == "skip" else float(c.strip() == str(g)) for c, g in zip(completions, ground_truth)]

    def per_token(completion_ids, **kwargs):
        return [0.01 * len(ids) for ids in completion_ids]

    def takes_text(text):
        return [0.0]

    def by_position(completions, /):
        return [0.0]

    def narrow(completions, ground_truth):
        return [0.0] * len(completions)

    async def later(completions, **kwargs):
        return [0.0] * len(completions)

    def one_value(completions, **kwargs):
        return [1.0]

    def not_a_number(completions, **kwargs):
        return [float("nan")] * len(completions)
    """
)


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return str(path)


def columns(completions, ground_truth):
    """reward_function_inputs of string-prompt rows with ground_truth and dataset columns."""
    rows = [{"prompt": "q", "columns": {"ground_truth": g, "dataset": "arithmetic"}} for g in ground_truth]
    return reward_function_inputs(rows, completions, [[0] * len(c) for c in completions])


def test_weighted_sum_of_user_functions_by_hand(user_file):
    specs = [f"{user_file}:brevity", f"{user_file}:exact"]
    extra = custom_rewards(specs, [0.5, 2.0], columns(["7", "12345", "x"], ["7", "5", "skip"]))
    # brevity 0.9, 0.5, 0.9 (x 0.5); exact 1, 0, None (x 2): a None adds nothing
    assert extra == pytest.approx([0.5 * 0.9 + 2.0, 0.5 * 0.5, 0.5 * 0.9])
    assert custom_rewards(specs[:1], None, columns(["7"], ["7"])) == pytest.approx([0.9])  # weight 1 by default
    # a function without **kwargs gets the inputs it names; one requiring a column the rows lack is refused
    assert custom_rewards([f"{user_file}:narrow"], None, columns(["7"], ["7"])) == [0.0]
    with pytest.raises(ConfigError, match=r"requires \['text'\], which is never passed: it gets prompts, "):
        custom_rewards([f"{user_file}:takes_text"], None, columns(["7"], ["7"]))


def test_dotted_module_from_the_current_folder(user_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # my_rewards.py here; the scripts do not have the current folder on sys.path
    assert load_reward_function("my_rewards:brevity")(completions=["ab"]) == pytest.approx([0.8])


@pytest.mark.parametrize(
    "spec,message",
    [
        ("my_rewards", "must be module:function or path/to/file.py:function"),
        ("{f}:", "must be module:function"),
        ("{d}/missing.py:brevity", "missing.py' does not exist"),
        ("no_such_module_xyz:fn", "importing 'no_such_module_xyz' failed: ModuleNotFoundError"),
        ("{d}/broken.py:fn", "importing '{d}/broken.py' failed: SyntaxError"),
        ("{f}:nope", "has no function 'nope' (it has ["),
        ("{f}:by_position", "requires ['completions'] by position"),
        ("{f}:later", "is async"),
    ],
)
def test_bad_spec_import_or_signature_is_a_config_error(user_file, tmp_path, spec, message):
    (tmp_path / "broken.py").write_text("def fn(:\n")
    fill = {"f": user_file, "d": str(tmp_path)}
    with pytest.raises(ConfigError) as e:
        load_reward_function(spec.format(**fill))
    assert message.format(**fill) in str(e.value)


@pytest.mark.parametrize(
    "name,message",
    [("one_value", "must return a list of 2 rewards (one per completion): 1 values on a batch of 2 rows from row 7"),
     ("not_a_number", "returned nan for completion 0: not a finite number (row 7)")],
)  # fmt: skip
def test_bad_return_value_names_the_function(user_file, name, message):
    with pytest.raises(ConfigError) as e:
        custom_rewards([f"{user_file}:{name}"], None, columns(["a", "b"], ["1", "2"]), ["row 7", "row 8"])
    assert str(e.value) == f"reward function '{user_file}:{name}' {message}"


def rl_command(model, files, out_dir, *extra):
    return [
        sys.executable, os.path.join(REPO, "open_instruct", "rlvr_ppo.py"),
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", model, "--dataset_name_or_path", files["rl_train"],
        "--eval_dataset_name_or_path", files["rl_eval"], "--output_dir", str(out_dir), *extra,
    ]  # fmt: skip


def test_bad_reward_function_exits_2_before_the_model_loads(user_file, tmp_path):
    model = tmp_path / "model"
    write_fake_model(str(model))  # passes the folder checks; loading it would fail: the run must stop before
    files = synthetic.write_task_files(str(tmp_path / "data"), n_train=8, n_eval=4)
    for spec, message in [
        (f"{user_file}:by_position", "requires ['completions'] by position"),
        (f"{tmp_path}/nowhere.py:fn", "nowhere.py' does not exist"),
    ]:
        proc = subprocess.run(
            rl_command(str(model), files, tmp_path / "out", "--reward_functions", spec),
            env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_user_function_adds_to_the_verifier_reward_in_a_run(user_file, tiny_models, tmp_path):
    """eval/score_mean = verification_reward x correct_rate + 0.01 x mean response tokens (per_token, weight 1):
    the custom reward is added to the verifier's, and correct_rate stays the verifier's verdict."""
    files = synthetic.write_task_files(str(tmp_path / "data"), n_train=64, n_eval=16)
    out = tmp_path / "out"
    proc = subprocess.run(
        rl_command(
            tiny_models["causal_lm"], files, out, "--reward_functions", f"{user_file}:per_token",
            "--total_episodes", "128", "--eval_steps", "1", "--checkpointing_steps", "100",
            "--best_metric", "eval/correct_rate", "--save_final_model", "false",
        ),
        env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in rows if "eval/score_mean" in r]
    assert len(evals) == 2
    for r in evals:  # verification_reward 1.0 in rlvr_tiny.yaml
        expected = 1.0 * r["eval/correct_rate"] + 0.01 * r["eval/response_length"]
        assert r["eval/score_mean"] == pytest.approx(expected, abs=1e-9)
        assert r["eval/score_mean"] > r["eval/correct_rate"]  # every response has tokens: the function added to it


def test_one_weight_per_function():
    from open_instruct.config import RLVRConfig, parse_config

    recipe = os.path.join(REPO, "configs", "rlvr_tiny.yaml")
    with pytest.raises(ConfigError) as e:
        parse_config(RLVRConfig, [recipe, "--reward_functions", "a.py:f", "--reward_function_weights", "1", "2"])
    assert str(e.value) == (
        "reward_function_weights has 2 entries but reward_functions has 1: give one weight per function"
    )
    two = ["--reward_functions", "a.py:f", "b:g", "--reward_function_weights", "1", "2"]
    cfg = parse_config(RLVRConfig, [recipe, *two])
    assert cfg.reward_functions == ["a.py:f", "b:g"] and cfg.reward_function_weights == [1.0, 2.0]
