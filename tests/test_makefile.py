"""`make help`: a bare `make` lists every target with its one-line description and installs nothing."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def phony_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*?)(?<!\\)\n", text, flags=re.M | re.S).group(1)
    return set(phony.replace("\\", " ").split())


def test_bare_make_prints_every_target_and_installs_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    env["VENV"] = str(tmp_path / "venv")  # a bare make must not create it
    out = subprocess.run(["make", "-s", "-C", str(ROOT)], env=env, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    targets = phony_targets()
    assert "help" in targets and len(targets) > 30
    assert targets == listed, f"in .PHONY but not in `make help`: {targets - listed}; listed only: {listed - targets}"
    for line in out.splitlines():
        assert len(line.split(maxsplit=1)) == 2, f"a target without a description: {line!r}"
    assert not (tmp_path / "venv").exists()
