"""bench/gpu_check.py in its tiny CPU mode: every step of the device check runs with only the packages the GPU image has
(so the script never rots between GPU runs), the FSDP steps run one-process FSDP2 (gloo here, NCCL there), the output
fits what a device run brings back, a failing step is recorded while the rest go on, and a hung step is killed at its
share of the budget together with every process it started."""

import importlib.util
import json
import os
import subprocess
import sys

from training_helpers import bench_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_STEPS = ["fsdp_smoke", "rl_1b_fsdp1", "sft_1b_fsdp1", "sft_1b_single", "sft_1b_single_packed", "rm_1b_fsdp1",
               "dpo_1b_fsdp1", "grpo_1b_single", "sft_w8b_fsdp1"]  # fmt: skip
# What the GPU image lacks: importing any of them fails in the check's processes and in every script it starts.
ABSENT_ON_THE_GPU_IMAGE = ("datasets", "trl", "wandb", "vllm", "flash_attn", "math_verify")
MAX_FILES, MAX_DEPTH = 8, 2  # what a device run brings back of its output folder


def _module():
    return bench_script("gpu_check.py")


def _files(folder):
    return [os.path.relpath(os.path.join(root, n), folder) for root, _, names in os.walk(folder) for n in names]


def test_tiny_gpu_check_runs_every_step_with_only_the_gpu_images_packages(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    # A None in sys.modules makes `import x` fail and importlib.util.find_spec(x) answer None, as for a package that
    # is not installed; sitecustomize runs at the start of every Python process that has this folder on its path.
    (block / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT_ON_THE_GPU_IMAGE!r}:\n    sys.modules[name] = None\n"
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--tiny", "--out", str(out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = _files(out)
    assert len(files) <= MAX_FILES and all(f.count(os.sep) < MAX_DEPTH for f in files), files
    assert sorted(files) == ["logs.tar.gz", "results.json", "results.md"]
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert [n for n, r in steps.items() if r["status"] != "ok"] == []
    assert list(steps)[0] == "fsdp_smoke" and set(TRAIN_STEPS) <= set(steps)
    assert steps["env"]["missing_optional_packages"] == list(ABSENT_ON_THE_GPU_IMAGE) + (
        [] if importlib.util.find_spec("peft") else ["peft"]
    )
    # The smoke step is FSDP2 with one process (every trained parameter a DTensor), checkpointed with DCP, exported.
    smoke = steps["fsdp_smoke"]
    assert smoke["world_size"] == 1 and smoke["distributed_type"].endswith("FSDP") and smoke["fsdp2_dtensor_params"]
    assert smoke["dcp_checkpoint"] and smoke["final_export"]
    parity = steps["parity"]
    assert parity["ok"] and all(parity["checks"].values())
    for name in TRAIN_STEPS:
        r = steps[name]
        assert r["rc"] == 0 and r["losses_finite"] and r["tokens_per_second"] > 0, (name, r)
        assert r["predicted_gb"] > 0, name  # plan's prediction beside the (GPU-only) measured peak
        assert "peak_allocated_gb" in r and r["peak_allocated_gb"] is None  # no GPU keys on CPU
    assert steps["sft_1b_fsdp1"]["final_export"]
    # The same data and weights: FSDP2 on one process and plain autocast agree, and padded and packed agree (fp32 on
    # CPU: reduction order only).
    assert steps["sft_1b_single"]["first_loss_vs"]["ok"]
    assert steps["sft_1b_single_packed"]["first_loss_vs"]["ok"]
    table = (out / "results.md").read_text()
    assert all(f"| {name} | ok |" in table for name in TRAIN_STEPS)
    # Each row was printed as its step ended: the console keeps the table when the files do not come back.
    assert all(f"| {name} | ok |" in proc.stdout.split("# gpu-check")[0] for name in TRAIN_STEPS)


def test_a_failing_step_is_recorded_and_the_rest_go_on_and_late_steps_are_skipped(tmp_path, monkeypatch):
    gpu_check = _module()
    real = gpu_check.step_command

    def env_fails(c, name):
        command, env = real(c, name)
        return ([sys.executable, "-c", "raise SystemExit('simulated failure')"] if name == "env" else command), env

    monkeypatch.setattr(gpu_check, "step_command", env_fails)
    out = tmp_path / "a"
    assert gpu_check.main(["--tiny", "--out", str(out), "--only", "env peak"]) == 1
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert steps["env"]["status"] == "failed" and "simulated failure" in steps["env"]["error"]
    assert steps["peak"]["status"] == "ok" and steps["peak"]["bf16_tflops"] > 0

    out = tmp_path / "b"
    assert gpu_check.main(["--tiny", "--out", str(out), "--only", "peak", "--budget", "1e-9"]) == 0
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert steps["peak"]["status"] == "skipped"
    assert "Skipped: peak (budget" in (out / "results.md").read_text()


def test_a_hung_step_is_killed_at_its_share_with_the_processes_it_started(tmp_path, monkeypatch):
    """The hung step starts a child in a session of its own (as torchrun starts its workers) and both block: at its
    share of the budget both are gone, the step is recorded as failed, and the check goes on to the next step."""
    gpu_check = _module()
    pid_file = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    real = gpu_check.step_command

    def env_hangs(c, name):
        command, env = real(c, name)
        return ([sys.executable, "-c", hang] if name == "env" else command), env

    monkeypatch.setattr(gpu_check, "step_command", env_hangs)
    monkeypatch.setattr(gpu_check, "KILL_GRACE_S", 5)
    out = tmp_path / "out"
    budget = 20.0  # env's share: 20 x 5 / (5 + 10) = 6.7 s, then peak gets what is left
    assert gpu_check.main(["--tiny", "--out", str(out), "--only", "env peak", "--budget", str(budget)]) == 1
    steps = json.loads((out / "results.json").read_text())["steps"]
    env = steps["env"]
    assert env["status"] == "failed" and "killed at its share" in env["error"]
    assert budget * 5 / 15 - 1 < env["share_s"] <= budget * 5 / 15  # less what the start took
    assert env["seconds"] < env["share_s"] + 2 * gpu_check.KILL_GRACE_S
    assert not gpu_check.alive(int(pid_file.read_text()))
    assert steps["peak"]["status"] in ("ok", "skipped")  # the check went on (peak may find the budget spent)
