"""bench/gpu_check.py's time shares: at the first run's `--budget 400` and at a rerun's `--budget 120 --only STEP`
every step gets at least the seconds it is expected to take on an H100 and the smoke step its 90, the shares add up
to the budget; and a step killed at its share writes no checkpoint: the kill's SIGTERM ends a training script at once
(runtime.SIGTERM_ENV, set in every child of the check) instead of checkpointing first."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from training_helpers import bench_script

from open_instruct import runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_check():
    return bench_script("gpu_check.py", "gpu_check_shares")


def planned_shares(gpu_check, budget: float, only: set) -> dict:
    """Each step's share as main() computes it when every step before it ran to its whole share (the worst case:
    a step that ends early leaves its rest to the later ones)."""
    to_run = gpu_check.steps_to_run(only)
    run = SimpleNamespace(budget=budget, elapsed=0.0, tiny=False)
    out = {}
    for i, name in enumerate(to_run):
        out[name] = gpu_check.share(run, name, to_run[i:])
        run.elapsed += out[name]
    return out


def test_every_step_gets_its_expected_seconds_at_budget_400(gpu_check):
    shares = planned_shares(gpu_check, 400, set())
    expected = gpu_check.EXPECTED_S
    assert list(shares) == [n for n in gpu_check.STEP_ORDER if n != "summarize"]
    assert sum(shares.values()) == pytest.approx(400)
    # The smoke step gets its 90 s; the other 12 steps are expected to take 300 s together and share the other 310.
    assert shares["fsdp_smoke"] == 90
    assert sum(v for n, v in expected.items() if n != "fsdp_smoke") == 300
    for name, seconds in shares.items():
        if name != "fsdp_smoke":
            assert seconds == pytest.approx(expected[name] * 310 / 300), name
        assert seconds >= expected[name], (name, seconds)


@pytest.mark.parametrize("step", ["fsdp_smoke", "env", "peak", "build", "parity", "rl_1b_fsdp1", "sft_1b_fsdp1",
                                  "sft_1b_single", "sft_1b_single_packed", "rm_1b_fsdp1", "dpo_1b_fsdp1",
                                  "grpo_1b_single", "sft_w8b_fsdp1"])  # fmt: skip
def test_a_rerun_of_one_step_at_budget_120_fits(gpu_check, step):
    """`--budget 120 --only STEP` runs STEP with the build and peak steps it needs: each gets its expected seconds."""
    shares = planned_shares(gpu_check, 120, {step})
    assert step in shares and sum(shares.values()) == pytest.approx(120)
    for name, seconds in shares.items():
        assert seconds >= gpu_check.EXPECTED_S[name], (step, name, seconds)
    if step == "sft_1b_single_packed":  # peak 10 + build 25 + the step 20 = 55 s expected, 120 s shared
        assert shares == pytest.approx({"peak": 120 * 10 / 55, "build": 120 * 25 / 55, step: 120 * 20 / 55})
    if step == "fsdp_smoke":  # the smoke step needs no model, only the MFU denominator
        assert shares == {"fsdp_smoke": 90, "peak": 30}


def test_the_smoke_floor_gives_way_when_the_budget_has_not_the_room(gpu_check):
    """At 100 s the other steps' 300 expected seconds leave no 90 for the smoke step: every step its proportion."""
    shares = gpu_check.shares(100, gpu_check.steps_to_run(set()))
    assert shares["fsdp_smoke"] == pytest.approx(100 * 30 / 330)
    assert sum(shares.values()) == pytest.approx(100)


def _sigterm_child(on_sigterm):
    """A process that installs the training scripts' SIGTERM handling, says so, then waits for its stdin to close."""
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop(runtime.SIGTERM_ENV, None)
    if on_sigterm:
        env[runtime.SIGTERM_ENV] = on_sigterm
    code = (
        "import sys\nfrom open_instruct import runtime\np = runtime.preemption()\nprint('ready', flush=True)\n"
        "sys.stdin.read()\nprint('requested', p.requested, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate("", timeout=60)  # closes stdin: a process still alive prints and exits
    return proc.returncode, out


def test_a_step_killed_at_its_share_ends_at_once_and_a_preemption_notice_still_checkpoints(gpu_check):
    """The check's children get SIGTERM_ENV=exit: SIGTERM's default action ends the script where it is, so
    end_of_step never sees a request to checkpoint. Without it SIGTERM is the preemption notice it always was: noted,
    and the loop checkpoints at the next step boundary (tests/test_reliability.py)."""
    assert gpu_check.child_env()[runtime.SIGTERM_ENV] == "exit"
    assert _sigterm_child("exit") == (-signal.SIGTERM, "")
    assert _sigterm_child(None) == (0, "requested True\n")
