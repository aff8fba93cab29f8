"""TRL-style reward functions (issue 34, items 4 and 7): `def f(prompts, completions, **kwargs)` gets every column of
the dataset row and TRL's completion shape (strings for string prompts, lists of one assistant message for
conversational ones); rows need no verifier column when reward functions are given; each function is called on real
rows before any model loads, and one that raises, hangs, returns the wrong length or NaN/inf exits 2 naming itself
and the row."""

import json
import os

import pytest

from open_instruct import rlvr_ppo, runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARDS = """
import json, math, os, threading

LOG = os.environ["REWARD_LOG"]


def record(prompts, completions, **kwargs):
    with open(LOG, "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "kwargs": kwargs}) + "\\n")
    return [float(len(kwargs["solution"][i])) for i in range(len(completions))]


def raises(completions, solution, **kwargs):
    return [1.0 / 0 if s == "boom" else 0.0 for s in solution]


def hangs(completions, **kwargs):
    threading.Event().wait()


def short(completions, **kwargs):
    return [0.0]


def infinite(completions, **kwargs):
    return [math.inf for _ in completions]
"""


def write_rows(path, conversational, n=8, bad_row=None):
    with open(path, "w") as f:
        for i in range(n):
            question = f"What is {i} + 1?"
            prompt = [{"role": "user", "content": question}] if conversational else question
            row = {"prompt": prompt, "solution": "boom" if i == bad_row else str(i + 1), "difficulty": i % 3,
                   "meta": {"source": "test", "tags": ["a", "b"]}}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture
def rewards_file(tmp_path, monkeypatch):
    path = tmp_path / "trl_rewards.py"
    path.write_text(REWARDS)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    return str(path)


def command(model, data, out, *extra):
    return [
        os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", model,
        "--dataset_name_or_path", data, "--output_dir", str(out), "--total_episodes", "8",
        "--num_samples_per_prompt", "2", "--local_rollout_batch_size", "4", "--per_device_train_batch_size", "8",
        "--response_length", "4", "--max_prompt_length", "64", "--logging_steps", "1", "--save_final_model", "false",
        "--num_samples_logged", "0", *extra,
    ]  # fmt: skip


def run(argv) -> int:
    try:
        runtime.run(rlvr_ppo.main, argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


@pytest.mark.parametrize("conversational", [True, False])
def test_trl_style_reward_function_sees_every_column_and_trls_completion_shape(
    conversational, rewards_file, tiny_models, tmp_path
):
    """Rows with a prompt and three other columns, no verifier and no ground truth: the run trains on the function
    alone, which gets every column by name, the prompt as the row gives it and the completions in TRL's shape. The
    first call is the probe before loading (an empty completion); the logged reward is the function's value,
    len(solution) (1 or 2 characters) for each completion."""
    data = write_rows(tmp_path / "rows.jsonl", conversational)
    out = tmp_path / "out"
    assert run(command(tiny_models["causal_lm"], data, out, "--reward_functions", f"{rewards_file}:record")) == 0
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert len(calls) == 1 + 1  # the probe on the first 4 rows, then the one rollout (4 prompts x 2)
    probe, rollout = calls
    assert len(probe["completions"]) == 4 and len(rollout["completions"]) == 8
    for call in calls:
        assert set(call["kwargs"]) == {"completion_ids", "solution", "difficulty", "meta", "ground_truth", "dataset"}
        assert call["kwargs"]["meta"][0] == {"source": "test", "tags": ["a", "b"]}  # nested values as written
        assert call["kwargs"]["ground_truth"] == [None] * len(call["completions"])  # no such column in the rows
        for prompt, completion in zip(call["prompts"], call["completions"]):
            if conversational:
                assert prompt[0]["role"] == "user" and prompt[0]["content"].startswith("What is ")
                assert isinstance(completion, list) and len(completion) == 1
                assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
            else:
                assert isinstance(prompt, str) and prompt.startswith("What is ")
                assert isinstance(completion, str)
    assert probe["completions"] == ([[{"role": "assistant", "content": ""}]] * 4 if conversational else [""] * 4)
    solutions = rollout["kwargs"]["solution"]
    assert sorted(set(rollout["kwargs"]["difficulty"])) <= [0, 1, 2]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "loss/policy" in r]
    expected = sum(len(s) for s in solutions) / len(solutions)  # verification_reward applies to no row here
    scores = [v for k, v in train[0].items() if k.endswith("score_mean") and not k.startswith("eval")]
    assert scores and scores[0] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "name,message",
    [
        ("raises", "raised ZeroDivisionError: float division by zero on {data} line 3"),
        ("hangs", "did not return within 0.5 s (reward_function_timeout) on a batch of 4 rows from {data} line 1"),
        ("short", "must return a list of 4 rewards (one per completion): 1 values on a batch of 4 rows"),
        ("infinite", "returned inf for completion 0: not a finite number ({data} line 1)"),
    ],
)
def test_bad_reward_function_exits_2_naming_it_and_the_row_before_loading(
    name, message, rewards_file, tiny_models, tmp_path, capsys, no_model_loads
):
    data = write_rows(tmp_path / "rows.jsonl", True, bad_row=2)
    out = tmp_path / "out"
    argv = command(tiny_models["causal_lm"], data, out, "--reward_functions", f"{rewards_file}:{name}",
                   "--reward_function_timeout", "0.5")  # fmt: skip
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert f"reward function '{rewards_file}:{name}' {message.format(data=data)}" in err, err
    assert "probe call before loading" in err
    assert not (out / "metrics.jsonl").exists()
