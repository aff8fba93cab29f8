"""open_instruct/rlvr_ppo.py end to end on the tiny model: PPO and GRPO learn, resume is exact, bad input stops early.

The starting policy is the tiny model SFT'd (with sft.py) on arithmetic answers of which 60% are off by one
("3+4=8"): it copies the operands well but puts only ~40% of its mass on the right result, so greedy held-out
accuracy starts around 0.37. The verifier rewards the right result only, so RL has to move mass from the "+1" habit
to the correct sum; a broken sign, advantage or ratio leaves it flat or drives it down.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import pytest
from _reliability_helpers import signal_stopped, stop_at, wait_until_stopped
from tolerances import backward_atol, forward_atol
from training_helpers import noisy_sft_args, recipe_args, run_script, script_env

from demo import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "open_instruct", "rlvr_ppo.py")
ENV = script_env()


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return run_script(args, ENV, timeout)


def read_rows(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_full_and_preempted(task: dict, full_dir: str, cut_dir: str, *extra: str) -> int:
    """The same 8-rollout run (a checkpoint after each) twice: whole into full_dir, and into cut_dir with a SIGTERM
    once a few rollouts are logged (it checkpoints at the next rollout boundary and exits 0), then resumed there.
    Returns the last rollout logged before the signal."""
    settings = ["--local_rollout_batch_size", "8", "--num_samples_per_prompt", "2", "--per_device_train_batch_size"]
    settings += ["8", "--total_episodes", "128", "--checkpointing_steps", "1", "--eval_steps", "4"]
    settings += ["--max_eval_samples", "32", *extra]
    run(rl_args(task, full_dir, *settings))
    proc = subprocess.Popen(
        [sys.executable, *rl_args(task, cut_dir, *settings)],
        cwd=REPO,
        env={**ENV, **stop_at("metrics_row", 2)},  # stops itself after rollout 2's row: the SIGTERM lands there
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until_stopped(proc.pid, 300)
    signal_stopped(proc.pid, signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert "SIGTERM: checkpoint written" in log
    stopped_at = max(r["rollout_step"] for r in read_rows(cut_dir))
    assert stopped_at < 8, "the run finished before the signal: nothing was resumed"
    run(rl_args(task, cut_dir, *settings, "--resume_from_checkpoint", "auto"))
    return stopped_at


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_models):
    """RL prompt files and the SFT'd starting policy."""
    root = str(tmp_path_factory.mktemp("rlvr"))
    files = synthetic.write_task_files(os.path.join(root, "data"), n_train=2000, n_eval=200)
    sft_dir = os.path.join(root, "sft")
    sft_args = noisy_sft_args(os.path.join(root, "data"), tiny_models["causal_lm"], files["sft_eval"], sft_dir)
    run([os.path.join(REPO, "open_instruct", "sft.py"), *sft_args])
    return {
        "policy": os.path.join(sft_dir, "final_model"),
        "train": files["rl_train"],
        "eval": files["rl_eval"],
        "root": root,
    }


def rl_args(task: dict, output_dir: str, *extra: str) -> list[str]:
    return [SCRIPT, *recipe_args("rlvr_tiny.yaml", task["policy"], task["train"], task["eval"], output_dir, *extra)]


def learning_run(task: dict, name: str, *extra: str) -> tuple[list[float], list[dict], float]:
    out_dir = os.path.join(task["root"], name)
    t0 = time.perf_counter()
    run(
        rl_args(task, out_dir, "--total_episodes", "1024", "--eval_steps", "4", "--checkpointing_steps", "1000", *extra)
    )
    seconds = time.perf_counter() - t0
    rows = read_rows(out_dir)
    evals = [r["eval/correct_rate"] for r in rows if "eval/correct_rate" in r]
    train = [r for r in rows if "train/correct_rate" in r]
    print(f"{name}: held-out greedy correct rate by eval {evals} in {seconds:.0f}s")
    return evals, train, seconds


@pytest.mark.slow
def test_ppo_raises_heldout_accuracy(task):
    # Measured (fixed seed): 0.37 -> 0.79 after 4 rollouts of 32 prompts x 4 completions, ~0.8 after 8.
    evals, train, _ = learning_run(task, "ppo")
    assert len(evals) == 3  # rollout 0 (baseline), 4, 8
    assert 0.2 <= evals[0] <= 0.6, evals
    assert evals[-1] >= evals[0] + 0.2, evals
    # Every PPO quantity is logged and sane.
    row = train[-1]
    for key in (
        "train/score_std",
        "train/non_stop_rate",
        "train/response_length",
        "train/kl",
        "train/entropy",
        "loss/policy",
        "loss/value",
        "clipfrac/policy",
        "clipfrac/value",
        "train/approx_kl",
        "lr",
        "perf/episodes_per_second",
        "time/generation",
        "time/training",
    ):
        assert key in row, key
    assert (
        row["episode"] == 1024 and row["rollout_step"] == 8 and row["optimizer_step"] == 8 * 2 * 2
    )  # epochs x mini-batches
    assert 0 < row["train/entropy"] < 5 and 0 <= row["clipfrac/policy"] <= 1 and row["train/response_length"] < 12


@pytest.mark.slow
def test_grpo_raises_heldout_accuracy(task):
    # Measured (fixed seed): 0.37 -> ~0.8 after 4 rollouts of 16 prompts x 8 completions.
    evals, train, _ = learning_run(
        task,
        "grpo",
        "--algo",
        "grpo",
        "--num_samples_per_prompt",
        "8",
        "--local_rollout_batch_size",
        "16",
        "--kl_estimator",
        "k3",
    )
    assert len(evals) == 3
    assert 0.2 <= evals[0] <= 0.6, evals
    assert evals[-1] >= evals[0] + 0.2, evals
    row = train[-1]
    assert "loss/value" not in row and "loss/kl" in row  # no value model; the KL is a loss term
    with open(os.path.join(task["root"], "grpo", "samples.jsonl")) as f:
        sample = json.loads(f.readline())
    assert {"prompt", "response", "score", "ground_truth"} <= set(sample)


@pytest.mark.slow
@pytest.mark.concurrency
def test_resume_after_preemption_matches_uninterrupted(task):
    full_dir, cut_dir = os.path.join(task["root"], "full"), os.path.join(task["root"], "cut")
    run_full_and_preempted(task, full_dir, cut_dir)

    def stable(rows):  # wall-clock numbers differ between runs; everything else must be identical
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    full, resumed = stable(read_rows(full_dir)), stable(read_rows(cut_dir))
    assert len(full) == len(resumed) and full == resumed

    import torch
    from safetensors.torch import load_file

    a = load_file(os.path.join(full_dir, "final_model", "model.safetensors"))
    b = load_file(os.path.join(cut_dir, "final_model", "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def _exit_message(argv: list[str], capsys) -> str:
    from open_instruct import rlvr_ppo, runtime

    with pytest.raises(SystemExit) as e:
        runtime.run(rlvr_ppo.main, argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_inputs_stop_before_models_load(task, tmp_path, capsys):
    base = rl_args(task, str(tmp_path / "out"))[1:]  # the recipe and the run's paths
    # An unknown verifier name in a row names the file's row.
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in open(task["train"])][:40]
    rows[7]["dataset"] = "chemistry"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _exit_message([*base, "--dataset_name_or_path", str(bad), "--total_episodes", "128"], capsys)
    assert f"{bad} line 8" in err and "chemistry" in err  # row 7 (0-based) is line 8 of the file
    # A ground truth the row's verifier cannot use.
    rows[7]["dataset"], rows[9]["ground_truth"] = "arithmetic", "seven"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _exit_message([*base, "--dataset_name_or_path", str(bad), "--total_episodes", "128"], capsys)
    assert f"{bad} line 10" in err and "seven" in err
    # Prompt + response longer than the model's positions.
    err = _exit_message([*base, "--response_length", "5000"], capsys)
    assert "max_position_embeddings" in err
    # GRPO groups that a device's mini-batch would split.
    err = _exit_message(
        [
            *base,
            "--algo",
            "grpo",
            "--num_samples_per_prompt",
            "3",
            "--local_rollout_batch_size",
            "8",
            "--per_device_train_batch_size",
            "4",
        ],
        capsys,
    )
    assert "group size" in err
    # best_metric must be an RLVR eval metric.
    err = _exit_message([*base, "--best_metric", "train/loss"], capsys)
    assert "eval/correct_rate" in err


@pytest.mark.numerics
def test_shared_prompt_forward_matches_plain_forward(tiny_models):
    """Running each prompt once and its responses on the repeated cache gives the plain forward's logits, values and
    gradients; it is used only when rows really come in runs of identical prompts."""
    import torch

    from open_instruct.data import collate_episodes
    from open_instruct.models import (
        TokenValueModel,
        load_causal_lm,
        load_sequence_classifier,
        response_logits,
        shared_prompt_groups,
        token_values,
    )

    rng = random.Random(0)
    prompts = [[rng.randint(5, 90) for _ in range(rng.randint(8, 14))] for _ in range(3)]
    responses = [[rng.randint(5, 90) for _ in range(rng.randint(1, 6))] for _ in range(12)]
    batch = collate_episodes([p for p in prompts for _ in range(4)], responses, pad_id=0)
    policy = load_causal_lm(tiny_models["causal_lm"])
    assert shared_prompt_groups(policy, batch, 4) == 4
    assert shared_prompt_groups(policy, batch, 3) == 1  # runs of 3 would mix prompts
    plain = response_logits(policy, batch, 0.7)
    with warnings.catch_warnings(record=True) as caught:  # the cache is read and passed back under its current name
        warnings.simplefilter("always")
        shared = response_logits(policy, batch, 0.7, group=4)
    assert not [str(w.message) for w in caught if "deprecated" in str(w.message)]
    mask = batch["mask"].bool()
    width, tokens = batch["input_ids"].shape[1], batch["input_ids"].numel()
    bound = forward_atol(policy, width, plain[mask])  # the KV cache holds the same numbers: only sums reorder
    assert (shared[mask] - plain[mask]).abs().max().item() <= bound
    grads = [torch.autograd.grad(x[mask].logsumexp(-1).sum(), list(policy.parameters())) for x in (plain, shared)]
    grad_bound = backward_atol(policy, width, tokens, list(grads[0]))
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) <= grad_bound
    torch.manual_seed(0)
    value = TokenValueModel(load_sequence_classifier(tiny_models["causal_lm"]))
    plain_values = token_values(value, batch)[mask]
    assert (token_values(value, batch, 4)[mask] - plain_values).abs().max().item() <= forward_atol(
        value, width, plain_values
    )


def test_mixture_trains_and_reports_correct_rate_per_source(task):
    """Train on a two-file mixture and evaluate on a two-file mixture: eval/<source>/correct_rate per source, and
    the overall rate is their prompt-weighted mean."""
    rows = [json.loads(line) for line in open(task["eval"])]
    d = os.path.join(task["root"], "mix")
    gsm = synthetic.write_jsonl(os.path.join(d, "eval_gsm.jsonl"), rows[:120])
    ifx = synthetic.write_jsonl(os.path.join(d, "eval_if.jsonl"), rows[120:])  # 80 rows, 40 taken
    train = [json.loads(line) for line in open(task["train"])]
    part_a = synthetic.write_jsonl(os.path.join(d, "train_a.jsonl"), train[:1000])
    part_b = synthetic.write_jsonl(os.path.join(d, "train_b.jsonl"), train[1000:])
    out = os.path.join(d, "run")
    args = rl_args(task, out, "--total_episodes", "128", "--eval_steps", "1", "--checkpointing_steps", "1000")
    at = args.index("--dataset_name_or_path")
    args[at : at + 4] = ["--dataset_name_or_path", "", "--eval_dataset_name_or_path", "null"]
    args += ["--dataset_mixer_list", part_a, "0.75", part_b, "250"]
    args += ["--eval_dataset_mixer_list", gsm, "1.0", ifx, "40"]
    proc = run(args)
    assert "per source: train_a 750 kept of 750 taken (fraction 0.75 of 1000), train_b 250 kept" in proc.stdout
    evals = [r for r in read_rows(out) if "eval/correct_rate" in r]
    assert len(evals) == 2  # the baseline at rollout 0 and after the one rollout
    for r in evals:
        mixed = (120 * r["eval/eval_gsm/correct_rate"] + 40 * r["eval/eval_if/correct_rate"]) / 160
        assert r["eval/correct_rate"] == pytest.approx(mixed, abs=1e-12)
        assert 0 < r["eval/correct_rate"] < 1  # the SFT'd policy gets some right, so the check is not 0 == 0


def test_phase_clock_rates_and_the_process_cpu_time():
    """The log row's rates are the rollouts' episodes and tokens over the phases' seconds, and
    perf/process_cpu_minutes is this process's CPU time when the row was made (the x axis of a learning curve)."""
    from types import SimpleNamespace

    from open_instruct.rollouts import PhaseClock

    clock = PhaseClock()
    clock.add({"generation": 3.0, "training": 1.0}, tokens=120, sync_bytes=0)
    clock.add({"generation": 2.0, "scoring": 2.0}, tokens=80, sync_bytes=0)
    before = time.process_time() / 60
    row = clock.report(SimpleNamespace(num_processes=1), episodes_per_rollout=48)
    after = time.process_time() / 60
    assert row["perf/episodes_per_second"] == 2 * 48 / 8.0
    assert row["perf/response_tokens_per_second"] == 200 / 8.0
    assert row["time/generation"] == 2.5 and row["time/scoring"] == 1.0
    assert before <= row["perf/process_cpu_minutes"] <= after
