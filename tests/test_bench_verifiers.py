"""bench/bench_verifiers.py's measuring half under the installed verifiers: rollouts of its task through the run's
environment adapter, every episode answered "yes" by the scripted generator and so scored 1 by the task's reward,
and the summary row built from those times."""

from __future__ import annotations

import os

import pytest
from training_helpers import bench_script

pytest.importorskip("verifiers", reason="verifiers is not installed")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokenizer_of(folder):
    """The tokenizer of the tiny model the bench saved under `folder`."""
    from open_instruct.models import load_tokenizer

    return load_tokenizer(os.path.join(folder, "tiny", "causal_lm"))


def test_the_bench_plays_its_task_and_every_episode_scores_the_scripted_answer(tmp_path, monkeypatch):
    bench_verifiers = bench_script("bench_verifiers.py")
    monkeypatch.chdir(tmp_path)
    result = bench_verifiers.measure(str(tmp_path), rollouts=2)
    assert result["episodes"] == 8 and len(result["walls"]) == len(result["cpus"]) == 2
    assert result["scores"] == [1.0, 1.0]
    answer = len(tokenizer_of(tmp_path)("yes", add_special_tokens=False)["input_ids"]) + 1  # + the end-of-turn id
    assert result["sampled_tokens"] == [8 * answer, 8 * answer]
    row = bench_verifiers.summary(result)
    assert row.startswith(f"| {result['api']} | {result['verifiers']} | 8 | ") and row.endswith(
        f"| 1.00 | {8 * answer} |"
    )
