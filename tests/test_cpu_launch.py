"""`accelerate launch --num_processes N` on a machine without a GPU: accelerate's simple launcher starts the script
once (no WORLD_SIZE), so the scripts stop with exit 2 and the documented CPU path instead of training alone."""

import os
import subprocess
import sys

import pytest

from open_instruct.distributed import launcher_process_count

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_process_count_is_read_from_the_launchers_own_options(tmp_path):
    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
    assert launcher_process_count([*launch, "--num_processes", "2", "s.py", "r.yaml"], "s.py") == 2
    assert launcher_process_count([*launch, "--num-processes=3", "s.py"], "s.py") == 3
    # the script's own options are not the launcher's
    assert launcher_process_count([*launch, "s.py", "--num_processes", "4"], "s.py") is None
    config = tmp_path / "multi_cpu.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\n")
    assert launcher_process_count([*launch, "--config_file", str(config), "s.py"], "s.py") == 4
    assert launcher_process_count([*launch, "--config_file", str(config), "--num_processes", "1", "s.py"], "s.py") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the launcher's /proc/<pid>/cmdline")
def test_accelerate_launch_two_processes_without_gpu_exits_2_with_the_cpu_path(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU accelerate really starts 2 processes")
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [accelerate, "launch", "--num_processes", "2", "open_instruct/dpo.py", "configs/dpo_tiny.yaml",
         "--output_dir", str(out_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    # accelerate wraps the script's exit status 2 in its own CalledProcessError (exit 1)
    assert proc.returncode != 0 and "returned non-zero exit status 2" in proc.stderr, proc.stderr[-3000:]
    assert "accelerate launch was asked for 2 processes but started one" in proc.stderr
    assert (
        "OPEN_INSTRUCT_CPU_FSDP=1 accelerate launch --config_file configs/accelerate/fsdp_cpu_2proc.yaml "
        "--num_processes 2 open_instruct/dpo.py" in proc.stderr
    )
    assert not (out_dir / "metrics.jsonl").exists()  # stopped before anything trained
