"""Dedicated vLLM engines (generation_backend vllm_server) under whole GRPO runs: async against sync, a preempted
async run resuming with its rollouts in flight, an engine killed mid-run, the trainer SIGKILLed and resumed. The
engine-level tests and the other runs: tests/test_engine_client.py (two files, so two pytest workers run them side by
side; what both use: tests/engine_client_helpers.py).

Needs vLLM (the vLLM venv: `make test-vllm`); skipped in the main venv.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # engines, trainers and kills: every wait is on an event

from _reliability_helpers import signal_stopped, stop_at, wait_until_stopped  # noqa: E402
from engine_client_helpers import (  # noqa: E402
    ENV,
    REPO,
    build_task,
    engine_pids,
    evals,
    group_members,
    grpo_args,
    read_rows,
    read_rows_of,
    run,
)

from open_instruct.engines import healthy  # noqa: E402


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """RL prompt files and an SFT'd starting policy at hidden 128 (engine_client_helpers.build_task)."""
    return build_task(tmp_path_factory)


def test_async_grpo_learns_and_matches_sync(task):
    """8 rollouts of GRPO with generation on a dedicated engine, synchronous and one-step off-policy (async_steps 1,
    truncated IS on by default). Both raise held-out accuracy by a clear margin; the async run's final accuracy is
    within 0.12 of the sync run's (the same prompts and seeds; lag 1 changes the samples, so not bit-equal).
    The async run's logs show the lag (1 after the first rollout) and generation hidden behind training."""
    sync_dir, async_dir = os.path.join(task["root"], "sync"), os.path.join(task["root"], "async")
    run(grpo_args(task, sync_dir))
    run(grpo_args(task, async_dir, "--async_steps", "1"))
    sync_rows, async_rows = read_rows(sync_dir), read_rows(async_dir)
    sync_acc, async_acc = evals(sync_rows), evals(async_rows)
    assert len(sync_acc) == len(async_acc) == 3  # rollouts 0 (baseline), 4, 8
    assert sync_acc[0] == async_acc[0]  # the same starting policy, evaluated by the engine
    assert sync_acc[-1] >= sync_acc[0] + 0.15, sync_acc
    assert async_acc[-1] >= async_acc[0] + 0.15, async_acc
    assert abs(async_acc[-1] - sync_acc[-1]) <= 0.12, (sync_acc, async_acc)
    train_sync = [r for r in sync_rows if "train/policy_lag_mean" in r]
    train_async = [r for r in async_rows if "train/policy_lag_mean" in r]
    assert all(r["train/policy_lag_max"] == 0 for r in train_sync)
    assert train_async[0]["train/policy_lag_mean"] == 0 and all(
        r["train/policy_lag_mean"] == 1 for r in train_async[1:]
    )
    sent = [r["perf/weight_sync_bytes"] for r in train_async[1:]]  # 0 where an eval had just sent these weights
    assert len(set(sent) - {0}) == 1 and sent.count(0) <= 2, sent  # the whole model each time
    assert all(r["perf/generation_hidden_fraction"] == 0 for r in train_sync)
    hidden = [r["perf/generation_hidden_fraction"] for r in train_async[1:]]
    assert sum(hidden) / len(hidden) > 0.5, hidden  # most of the engine's time is behind training


def test_async_two_with_in_flight_updates_preempted_resumes_with_its_rollouts_in_flight(task):
    """async_steps 2 on a dedicated engine (weights updated with the next rollout generating): every sampled token is
    at most 2 versions older than the trainer, the first rollouts' lags are 0 then <= 1; SIGTERM after rollout 3 drains
    the rollouts in flight into the checkpoint, and the resumed run trains on them as saved (the first rollout after
    the resume was sampled before it: a lag > 0, where a regenerated one would be 0), so each rollout's prompts are
    the synchronous run's, none lost or repeated."""
    sync_dir = os.path.join(task["root"], "sync")
    if not os.path.exists(os.path.join(sync_dir, "final_model")):  # (test_async_grpo_learns_and_matches_sync's)
        run(grpo_args(task, sync_dir))
    out_dir = os.path.join(task["root"], "async2")
    args = grpo_args(task, out_dir, "--async_steps", "2")
    proc = subprocess.Popen(  # stops itself after rollout 3's row: the SIGTERM lands there
        [sys.executable, *args], cwd=REPO, env={**ENV, **stop_at("metrics_row", 3)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    trained = lambda: [r for r in read_rows(out_dir) if "train/version_lag_mean" in r]  # noqa: E731
    wait_until_stopped(proc.pid, 900)
    signal_stopped(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-3000:]
    reached = trained()[-1]["rollout_step"]
    assert reached == 3, reached
    run([*args, "--resume_from_checkpoint", "auto"])
    rows = trained()
    assert [r["rollout_step"] for r in rows] == list(range(1, 9))
    assert all(r["train/version_lag_max"] <= 2 for r in rows) and rows[0]["train/version_lag_max"] == 0
    assert rows[1]["train/version_lag_max"] <= 1 and rows[reached]["train/version_lag_mean"] > 0
    sampled = lambda d: [(r["rollout_step"], r["prompt"]) for r in read_rows_of(d, "samples.jsonl")]  # noqa: E731
    assert sampled(out_dir) == sampled(sync_dir)


def test_killed_engine_stops_the_run_with_a_clear_error(task):
    """Kill the engine after the first checkpoint: the trainer exits non-zero naming the engine, and the checkpoint
    it had written is intact (a resume with a new engine finishes the run)."""
    out_dir = os.path.join(task["root"], "engine_killed")
    args = grpo_args(task, out_dir, "--async_steps", "1", "--vllm_server_timeout", "60")
    env = {**ENV, **stop_at("checkpoint_prune")}  # the trainer stops itself once its first checkpoint is in place
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_until_stopped(proc.pid, 600)
    engine_pid = engine_pids(out_dir)
    assert engine_pid, "no engine process found"
    for pid in engine_pid:
        os.kill(pid, signal.SIGKILL)  # the server only: its engine core and worker are orphaned
    os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=300)
    stderr = stderr.decode()
    assert proc.returncode not in (0, None)
    assert "vLLM engine 0" in stderr, stderr[-3000:]
    assert not group_members(engine_pid), "the killed engine's core/worker processes outlived the run"
    run([*args, "--resume_from_checkpoint", "auto"])  # a new engine; the saved state loads and the run completes
    assert read_rows(out_dir)[-1]["rollout_step"] == 8


def test_sigkill_of_the_trainer_then_resume_completes(task):
    """SIGKILL the async trainer mid-run: its engine dies with it (no orphan holding the device), and --resume
    completes the run from the last checkpoint, regenerating the rollout that was in flight."""
    out_dir = os.path.join(task["root"], "trainer_killed")
    args = grpo_args(task, out_dir, "--async_steps", "1")
    proc = subprocess.Popen(  # stops itself once its first checkpoint is in place (a rollout in flight)
        [sys.executable, *args], cwd=REPO, env={**ENV, **stop_at("checkpoint_prune")}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    wait_until_stopped(proc.pid, 600)
    servers = engine_pids(out_dir)
    assert servers
    proc.kill()
    proc.wait()
    for _ in range(60):  # PR_SET_PDEATHSIG: the engine gets SIGTERM when the trainer dies, and stops its core
        if not engine_pids(out_dir) and not group_members(servers):
            break
        time.sleep(1)
    assert not engine_pids(out_dir), "the engine outlived the killed trainer"
    assert not group_members(servers), "the engine's core/worker processes outlived the killed trainer"
    run([*args, "--resume_from_checkpoint", "auto"])
    rows = read_rows(out_dir)
    assert rows[-1]["rollout_step"] == 8 and evals(rows)
    assert not healthy("http://127.0.0.1:1")  # sanity of the probe itself
