"""Reward functions you can watch (issue 41, item 4): `reward/<function>/mean` and `/std` in metrics.jsonl, checked
against the values the functions returned; samples.jsonl shows each function's value and the columns it took; the
probe call before loading is announced in one console line."""

import json

import pytest
from test_reward_functions_trl import command, run

REWARDS = """
import json, os

LOG = os.environ["REWARD_LOG"]


def log(name, completions, values):
    with open(LOG, "a") as f:
        f.write(json.dumps({"name": name, "n": len(completions), "values": values}) + "\\n")
    return values


def solution_length(completions, solution, **kwargs):  # every column (**kwargs)
    return log("solution_length", completions, [float(len(s)) for s in solution])


def easy_only(completions, difficulty):  # one column; None ("not applicable") on odd difficulty
    return log("easy_only", completions, [None if d % 2 else float(d + 1) for d in difficulty])
"""


def write_rows(path, n=8):
    with open(path, "w") as f:
        for i in range(n):  # solutions of 1, 2 and 3 characters; difficulty 0, 1, 2
            row = {"prompt": f"What is {i} + 1?", "solution": str(10 ** (i % 3)), "difficulty": i % 3, "meta": "m"}
            f.write(json.dumps(row) + "\n")
    return str(path)


def mean_std(values):
    real = [v for v in values if v is not None]
    mean = sum(real) / len(real)
    return mean, (sum((v - mean) ** 2 for v in real) / len(real)) ** 0.5


def test_per_function_reward_metrics_samples_and_probe_line(tiny_models, tmp_path, monkeypatch, capsys):
    rewards_file = tmp_path / "watch_rewards.py"
    rewards_file.write_text(REWARDS)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    data, out = write_rows(tmp_path / "rows.jsonl"), tmp_path / "out"
    argv = command(tiny_models["causal_lm"], data, out, "--reward_functions", f"{rewards_file}:solution_length",
                   f"{rewards_file}:easy_only", "--reward_function_weights", "1.0", "0.5",
                   "--num_samples_logged", "3")  # fmt: skip
    assert run(argv) == 0
    printed = capsys.readouterr().out
    probe_lines = [line for line in printed.splitlines() if line.startswith("reward functions: probing")]
    assert probe_lines == [
        "reward functions: probing solution_length, easy_only once before any model loads, on the first 4 training "
        "rows with 4 empty completions (a model can answer with nothing)"
    ]

    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    probe, rollout = [("solution_length", 4), ("easy_only", 4)], [("solution_length", 8), ("easy_only", 8)]
    assert [(c["name"], c["n"]) for c in calls] == probe + rollout  # 4 rows before loading, then 4 prompts x 2
    lengths, easy = calls[2]["values"], calls[3]["values"]
    assert len(set(lengths)) > 1 and None in easy and any(v is not None for v in easy)  # a real std, a real None

    (train,) = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
    for name, values in (("solution_length", lengths), ("easy_only", easy)):
        mean, std = mean_std(values)  # population std over the completions the function scored
        # a handful of float64 sums of small integers
        assert train[f"reward/{name}/mean"] == pytest.approx(mean, abs=1e-9)
        assert train[f"reward/{name}/std"] == pytest.approx(std, abs=1e-9)
    weighted = [a + 0.5 * (b or 0.0) for a, b in zip(lengths, easy)]  # no verifier: the functions alone
    assert train["train/score_mean"] == pytest.approx(sum(weighted) / len(weighted), abs=1e-6)

    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 3
    rows = {json.loads(line)["prompt"]: json.loads(line) for line in open(data)}
    for j, sample in enumerate(samples):
        assert "ground_truth" not in sample  # the rows have none: no "None" shown
        assert sample["rewards"] == {"solution_length": lengths[j], "easy_only": easy[j]}
        row = next(r for p, r in rows.items() if p in sample["prompt"])
        # solution_length takes every column (**kwargs), easy_only difficulty: the row's columns but the prompt
        assert sample["columns"] == {"solution": row["solution"], "difficulty": row["difficulty"], "meta": "m"}
        assert sample["score"] == pytest.approx(weighted[j], abs=1e-6)
