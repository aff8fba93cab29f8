"""A bench's measured side runs in a fresh process of its own script, which prints its numbers as one JSON line after
`RESULT `; the parent reads that line. The benches run as `python bench/bench_<name>.py`, so this folder is on
sys.path and they import this module by name."""

from __future__ import annotations

import json
import subprocess
from typing import Optional

PREFIX = "RESULT "


def print_result(result: dict) -> None:
    """The worker's side: its numbers, as the line `run_worker` reads."""
    print(PREFIX + json.dumps(result), flush=True)


def run_worker(cmd: list[str], env: dict, what: str, cwd: Optional[str] = None) -> dict:
    """Run a worker process and return the dict on its last `RESULT ` line; exit naming `what`, with the ends of its
    output, when it fails or prints none."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(PREFIX) :])
