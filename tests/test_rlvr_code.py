"""A tiny RLVR run with the `code` verifier on synthetic programming tasks (demo.synthetic.code_rl_rows, every other
assert row as a HumanEval `check(candidate)` with its entry point), end to end through rlvr_ppo.main. The tiny model
cannot write programs, so the generator's texts are replaced by known programs ("return x + J", J cycling 0..3, and a
program that forges a script verdict) while its token ids still drive training: every logged sample's score must then
be the hand-computed reward, 1.0 exactly when J equals the row's k (never for the forger), for assert, check() and
stdin/stdout rows alike."""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest
from training_helpers import read_metrics

from demo.synthetic import code_rl_rows, write_jsonl
from open_instruct import generation_backends, rlvr_ppo, runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = """```python
import sys
def f(x):
    return x + {j}
data = sys.stdin.read().split()
if data:
    print(f(int(data[0])))
```"""


FORGER = """```python
import os
os.write(3, b'["ran"]')
os._exit(0)
```"""


def known_text(i: int) -> str:
    """Response i: PROGRAM for j = i % 5, or the forger for i % 5 == 4."""
    return FORGER if i % 5 == 4 else PROGRAM.format(j=i % 5)


def check_rows(rows: list[dict]) -> list[dict]:
    """Every other assert row's asserts as HumanEval stores them: check(candidate) without its call, + entry_point."""
    for n, row in enumerate(r for r in rows if isinstance(json.loads(r["ground_truth"])[0], str)):
        if n % 2 == 0:
            asserts = json.loads(row["ground_truth"])
            body = "".join("    " + a.replace("assert f(", "assert candidate(") + "\n" for a in asserts)
            row["ground_truth"] = json.dumps({"test": f"def check(candidate):\n{body}", "entry_point": "f"})
    return rows


def known_responses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generator the run makes answers response i with known_text(i)."""
    real = generation_backends.make_generator

    def make_generator(*args, **kwargs):
        gen = real(*args, **kwargs)
        generate = gen.generate

        def with_known_texts(prompts, config, *args, **kwargs):
            out = generate(prompts, config, *args, **kwargs)
            out.texts = [known_text(i) for i in range(len(out.texts))]
            return out

        gen.generate = with_known_texts
        return gen

    monkeypatch.setattr(generation_backends, "make_generator", make_generator)
    monkeypatch.setattr(rlvr_ppo, "make_generator", make_generator)  # the script's own name for it


def expected_score(sample: dict) -> float:
    if "return x + " not in sample["response"]:
        return 0.0  # the forger
    truth = json.loads(sample["ground_truth"])
    if isinstance(truth, dict):  # check(candidate): its first assert is candidate(0) == k
        k = int(truth["test"].split("==")[1].split("\n")[0])
    else:
        k = int(truth[0].split("==")[1]) if isinstance(truth[0], str) else int(truth[0]["output"])  # f(0) == k / 0 -> k
    j = int(sample["response"].split("return x + ")[1].split("\n")[0])
    return 1.0 if j == k else 0.0  # verification_reward 1.0 (rlvr_tiny.yaml), non-stop penalty off


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_rlvr_with_the_code_verifier_scores_known_programs(tiny_models, tmp_path, monkeypatch):
    train = write_jsonl(str(tmp_path / "code_train.jsonl"), check_rows(code_rl_rows(16, 0)))
    evals = write_jsonl(str(tmp_path / "code_eval.jsonl"), code_rl_rows(8, 1))
    out = tmp_path / "rlvr_code"
    known_responses(monkeypatch)
    args = [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"]]
    args += ["--dataset_name_or_path", train, "--eval_dataset_name_or_path", evals, "--output_dir", str(out)]
    args += ["--local_rollout_batch_size", "8", "--num_samples_per_prompt", "2", "--per_device_train_batch_size", "16"]
    args += ["--total_episodes", "32", "--num_epochs", "1", "--non_stop_penalty", "0", "--num_samples_logged", "16"]
    args += ["--eval_steps", "2", "--checkpointing_steps", "100", "--save_final_model", "false"]
    args += ["--max_prompt_length", "128", "--code_test_seconds", "1", "--sandbox_workers", "2"]
    rlvr_ppo.main(args)

    with open(out / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 32  # 2 rollouts x 16 completions
    truths = [json.loads(s["ground_truth"]) for s in samples]
    assert {isinstance(t, dict) for t in truths} == {True, False}  # check() rows and the others were scored
    assert any(isinstance(t, list) and isinstance(t[0], str) for t in truths)  # assert rows
    assert any(isinstance(t, list) and isinstance(t[0], dict) for t in truths)  # stdin/stdout rows
    assert any(s["response"] == FORGER for s in samples)
    for s in samples:
        assert s["score"] == expected_score(s), s
    assert 0 < sum(s["score"] for s in samples) < len(samples)  # both verdicts occur
    rows = read_metrics(str(out))
    train_rows = [r for r in rows if "train/correct_rate" in r]
    assert len(train_rows) == 2
    # 3 tests a response, but 1 for a check() row (its test code runs whole); a right program passes all, a wrong one
    # none (every sample is logged: both rollouts' counts add up to the samples')
    counts = collections.Counter()
    prefix = "train/code_tests_"
    for r in train_rows:
        counts.update({k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)})
    tests_of = [1 if isinstance(t, dict) else 3 for t in truths]
    assert sum(counts.values()) == sum(tests_of)
    assert counts["pass"] == sum(n * s["score"] for n, s in zip(tests_of, samples))
    assert counts.get("timeout", 0) == 0  # (the forger's tests fail as crash or wrong_answer)
    evals_rows = [r for r in rows if "eval/correct_rate" in r]
    assert evals_rows and all(0.0 <= r["eval/correct_rate"] <= 1.0 for r in evals_rows)


@pytest.mark.parametrize(
    "truth, message",
    [
        (["assert f(0) =="], "does not parse"),
        ({"test": "def check(candidate):\n    assert candidate(0) == 1\n"}, "defines check(candidate) with checks but"),
        (["assert True"], "checks nothing"),
    ],
)
def test_bad_code_ground_truth_exits_2_naming_the_row(tiny_models, tmp_path, capsys, truth, message):
    """Unparseable tests, a check(candidate) nothing calls (no entry_point) and a test that checks nothing stop the
    run before any model loads, naming the row."""
    rows = code_rl_rows(8, 0)
    rows[3]["ground_truth"] = json.dumps(truth)
    train = write_jsonl(str(tmp_path / "bad_code.jsonl"), rows)
    args = [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"]]
    args += ["--dataset_name_or_path", train, "--eval_dataset_name_or_path", train, "--output_dir", str(tmp_path / "o")]
    args += ["--total_episodes", "128", "--max_prompt_length", "128"]
    with pytest.raises(SystemExit) as e:
        runtime.run(rlvr_ppo.main, args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{train} line 4" in err and message in err
