"""bench/gpu_check.py in its tiny CPU mode: every step of the device check runs (so the script never rots between GPU
runs), a failing step is recorded while the rest go on, and a step past the budget is skipped and reported."""

import importlib.util
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_STEPS = ["rl_1b_fsdp1", "sft_1b_fsdp1", "sft_1b_single", "sft_1b_single_packed", "rm_1b_fsdp1", "dpo_1b_fsdp1",
               "grpo_1b_single", "sft_w8b_fsdp1"]  # fmt: skip


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_gpu_check_runs_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("BUDGET", None), env.pop("ONLY", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--tiny", "--out", str(out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert [n for n, r in steps.items() if r["status"] != "ok"] == []
    assert set(TRAIN_STEPS) <= set(steps)
    parity = steps["parity"]
    assert parity["ok"] and all(parity["checks"].values())
    for name in TRAIN_STEPS:
        r = steps[name]
        assert r["rc"] == 0 and r["losses_finite"] and r["tokens_per_second"] > 0, (name, r)
        assert r["predicted_gb"] > 0, name  # plan's prediction beside the (GPU-only) measured peak
        assert "peak_allocated_gb" in r and r["peak_allocated_gb"] is None  # no GPU keys on CPU
    assert steps["sft_1b_fsdp1"]["dcp_checkpoint"] and steps["sft_1b_fsdp1"]["final_export"]
    # The same data and weights padded and packed: the first loss agrees (fp32 on CPU: reduction order only).
    assert steps["sft_1b_single_packed"]["first_loss_vs"]["ok"]
    assert steps["sft_1b_single"]["first_loss_vs"]["ok"]
    table = (out / "results.md").read_text()
    assert all(f"| {name} | ok |" in table for name in TRAIN_STEPS)


def test_a_failing_step_is_recorded_and_the_rest_go_on_and_late_steps_are_skipped(tmp_path, monkeypatch):
    gpu_check = _module()

    def broken(check):
        raise RuntimeError("simulated failure")

    monkeypatch.setitem(gpu_check.LOCAL_STEPS, "env", broken)
    monkeypatch.delenv("BUDGET", raising=False)
    out = tmp_path / "a"
    assert gpu_check.main(["--tiny", "--out", str(out), "--only", "env peak"]) == 1
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert steps["env"]["status"] == "failed" and "simulated failure" in steps["env"]["error"]
    assert steps["peak"]["status"] == "ok" and steps["peak"]["bf16_tflops"] > 0

    out = tmp_path / "b"
    assert gpu_check.main(["--tiny", "--out", str(out), "--only", "peak", "--budget", "1e-9"]) == 0
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert steps["peak"]["status"] == "skipped"
    assert "Skipped (would start after BUDGET" in (out / "results.md").read_text()
