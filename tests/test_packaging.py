"""Building the package leaves the checkout as it was (issue 69): setuptools' `build/` folder goes to a temporary
folder (setup.py), so `pip install '.[envs]'` leaves no `build/` behind."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_building_a_wheel_leaves_no_build_folder_in_the_checkout(tmp_path):
    """A copy of what the build reads (so an old build/ in this checkout cannot hide one), built as pip builds it
    (in place, with this environment's setuptools: no download); the wheel holds the package, the copy no build/."""
    source = tmp_path / "checkout"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "open_instruct", "eval", "demo"):
        if not os.path.exists(os.path.join(REPO, name)):
            continue
        copy = shutil.copytree if os.path.isdir(os.path.join(REPO, name)) else shutil.copy
        copy(os.path.join(REPO, name), source / name)
    wheels = tmp_path / "wheels"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(wheels)],
        cwd=source, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = [p.name for p in wheels.iterdir()]
    assert wheel.startswith("open_instruct_farm-") and wheel.endswith("-py3-none-any.whl"), wheel
    assert not (source / "build").exists(), sorted(os.listdir(source / "build"))
