"""correct_rate_by (open_instruct/correct_rates.py): each group of prompts' own training correct rate, worked by
hand on a rollout, through a real run (the groups' completions add up to the rollout, their rates to the overall
rate), and a column no training prompt has (a misspelt name) stops the run before any model loads."""

from __future__ import annotations

import json
import os
import types

import pytest
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from training_helpers import rl_exit_code as exit_code

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "rlvr_tiny.yaml")


def test_group_of_reads_a_nested_column_or_the_source():
    from open_instruct.correct_rates import group_of

    row = {"problem": {"shape": "sub", "n": 2}, "family": "shop"}
    assert group_of(row, "mix_a", "problem.shape") == "sub"
    assert group_of(row, "mix_a", "problem.n") == "2"  # values as strings
    assert group_of(row, "mix_a", "family") == "shop"
    assert group_of(row, "mix_a", "source") == "mix_a"
    assert group_of(row, "mix_a", "problem.size") is None and group_of(row, "mix_a", "family.x") is None


def test_rates_by_hand():
    """Groups a (3 of 4 right), b (1 of 2), c (not drawn), and prompts without the column (1 of 1): rates 0.75,
    0.5 and 1, c's completions 0 and no rate."""
    from open_instruct.correct_rates import CorrectRateByGroup

    cfg = types.SimpleNamespace(correct_rate_by="kind")
    by = CorrectRateByGroup(cfg, [{"rate_group": g} for g in "abcab"] + [{}])
    assert by.groups == ["a", "b", "c", "(missing)"]
    episodes = [{"rate_group": g} for g in "aaaabb"] + [{}]
    rollout = types.SimpleNamespace(episodes=episodes, correct=[1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    sums = by.rollout_sums(rollout)
    assert sums == {"correct_by/a": 3, "correct_by/b": 1, "correct_by/c": 0, "correct_by/(missing)": 1,
                    "count_by/a": 4, "count_by/b": 2, "count_by/c": 0, "count_by/(missing)": 1}  # fmt: skip
    row = by.metrics(cfg, rollout, sums, {}, 1, None)
    assert row == {"train/completions/a": 4, "train/correct_rate/a": 0.75, "train/completions/b": 2,
                   "train/correct_rate/b": 0.5, "train/completions/c": 0, "train/completions/(missing)": 1,
                   "train/correct_rate/(missing)": 1.0}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from demo.synthetic import rl_rows, write_jsonl

    rows = [{**r, "meta": {"parity": ["even", "odd"][i % 2], "third": i % 3}} for i, r in enumerate(rl_rows(64, 0))]
    root = tmp_path_factory.mktemp("rate_data")
    return {
        "train": write_jsonl(str(root / "train.jsonl"), rows),
        "eval": write_jsonl(str(root / "eval.jsonl"), rl_rows(8, 1)),
    }


def argv(tiny_models, files, out, *extra) -> list[str]:
    return [
        RECIPE, "--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", files["train"],
        "--eval_dataset_name_or_path", files["eval"], "--eval_steps", "100", "--output_dir", str(out),
        "--algo", "grpo", "--total_episodes", "64", "--local_rollout_batch_size", "4", "--num_samples_per_prompt",
        "4", "--per_device_train_batch_size", "4", "--response_length", "8", "--checkpointing_steps", "100",
        "--beta", "0", "--learning_rate", "1e-2", *extra,
    ]  # fmt: skip


def test_a_run_logs_each_groups_rate(tiny_models, files, tmp_path):
    """meta.third (0, 1, 2) over 4 rollouts of 16 completions: each row's groups are exactly those three, their
    completions add up to 16, and their correct counts to the overall rate x 16."""
    assert exit_code(argv(tiny_models, files, tmp_path / "out", "--correct_rate_by", "meta.third")) == 0
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    rows = [r for r in rows if "train/correct_rate" in r]
    assert len(rows) == 4
    for r in rows:
        counts = {k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("train/completions/")}
        assert sorted(counts) == ["0", "1", "2"] and sum(counts.values()) == 16
        right = sum(r.get(f"train/correct_rate/{g}", 0.0) * n for g, n in counts.items())
        assert right == pytest.approx(r["train/correct_rate"] * 16, abs=1e-9)
        assert all((f"train/correct_rate/{g}" in r) == (n > 0) for g, n in counts.items())


def test_a_column_no_prompt_has_stops_before_any_model_loads(tiny_models, files, tmp_path, monkeypatch, capsys):
    from open_instruct import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    monkeypatch.setattr(models, "load_policy", refuse)
    assert exit_code(argv(tiny_models, files, tmp_path / "out", "--correct_rate_by", "meta.shape")) == 2
    err = capsys.readouterr().err
    assert "correct_rate_by 'meta.shape': no training prompt has it (the first: " in err, err[-2000:]
    assert "train.jsonl" in err, err[-2000:]
