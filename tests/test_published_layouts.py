"""Every launch line the project publishes for its recipes passes `plan` with its own layout: each scripts/*.sh (with
DRY_RUN=1 it runs the plan of the layout it launches), and each command in README.md, docs/*.md, the recipes' and
the accelerate configs' headers and the scripts' own comments: `bash scripts/X.sh`, `python -m open_instruct.plan`
and `accelerate launch --config_file C ... configs/R.yaml` (C's num_processes). The lines are read from the files,
so a layout edited anywhere is checked; a line the docs mark "exit 2" must be refused."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = ("sft_8b", "rm_8b", "dpo_8b", "rlvr_8b", "rlvr_70b")
SOURCES = ("README.md", "docs/*.md", "configs/*.yaml", "configs/accelerate/*.yaml", "scripts/*.sh")
RECIPE = r"configs/(?:%s)\.yaml" % "|".join(PUBLISHED)
PATTERNS = {
    "script": re.compile(r"((?:[A-Z_]+=\S+\s+)*)bash (scripts/(?:%s)\.sh)(.*)" % "|".join(PUBLISHED)),
    "plan": re.compile(r"(?:python3? -m open_instruct\.|`)plan (%s)(.*)" % RECIPE),
    "accelerate": re.compile(
        r"accelerate launch --config_file (configs/accelerate/\S+\.yaml)(.*?) open_instruct/\w+\.py (%s)(.*)" % RECIPE
    ),
}  # fmt: skip


def logical_lines(path: str) -> list[str]:
    """The file's lines, comment markers off (the shell and YAML headers hold the commands), a trailing backslash
    joined to the next line, placeholders such as <machine 0> and $SLURM_NODEID made concrete."""
    out, pending = [], ""
    for raw in open(os.path.join(REPO, path)):
        line = re.sub(r"^\s*#+ ?", "", raw.rstrip("\n")) if path.endswith((".sh", ".yaml")) else raw.rstrip("\n")
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        out.append(re.sub(r"<[^>]*>", "host0", line).replace("$SLURM_NODEID", "0"))
    return out


def arguments(text: str) -> list[str]:
    """The --key value arguments at the start of `text`, up to its comment, a closing backquote or prose."""
    text = re.split(r"`|\s#|\[--key", text)[0]
    args: list[str] = []
    for token in shlex.split(text, posix=True):
        if token.startswith("--") or (args and args[-1].startswith("--") or args and re.match(r"^https?://", token)):
            if not re.match(r"^[\w./:,+-]+$", token):
                break
            args.append(token)
        else:
            break
    return args


def published_commands() -> list[tuple[str, str, list[str], dict[str, str], int]]:
    """(where, kind, argv, env, expected exit) for every launch or plan line of a published recipe."""
    found = []
    for pattern in SOURCES:
        for path in sorted(glob.glob(os.path.join(REPO, pattern))):
            rel = os.path.relpath(path, REPO)
            lines = logical_lines(rel)
            for n, line in enumerate(lines, 1):
                # what the docs say of the command, on its line or the next: "# exit 2", "... is refused"
                said = line + " " + (lines[n] if n < len(lines) else "")
                expected = 2 if re.search(r"exit 2|is refused", said) else 0
                where = f"{rel}:{n}"
                for m in PATTERNS["script"].finditer(line):
                    env = dict(a.split("=", 1) for a in m.group(1).split())
                    found.append((where, "script", [m.group(2), *arguments(m.group(3))], env, expected))
                for m in PATTERNS["plan"].finditer(line):
                    found.append((where, "plan", [m.group(1), *arguments(m.group(2))], {}, expected))
                for m in PATTERNS["accelerate"].finditer(line):
                    launch = arguments(m.group(2))
                    if "--num_processes" in launch:
                        processes = launch[launch.index("--num_processes") + 1]
                    else:
                        with open(os.path.join(REPO, m.group(1))) as f:
                            processes = str(yaml.safe_load(f)["num_processes"])
                    argv = [m.group(3), "--num_processes", processes, *arguments(m.group(4))]
                    found.append((where, "plan", argv, {}, expected))
    return found


def distinct(commands: list) -> list:
    """One of each command (DRY_RUN in a line's environment is what the test sets anyway)."""
    seen, out = set(), []
    for where, kind, argv, env, expected in commands:
        key = (kind, tuple(argv), tuple(sorted((k, v) for k, v in env.items() if k != "DRY_RUN")))
        if key not in seen:
            seen.add(key)
            out.append((where, kind, argv, env, expected))
    return out


COMMANDS = distinct(published_commands())


def test_the_published_launch_lines_are_all_found():
    """Each script is launched somewhere (its own header at least: `bash scripts/X.sh`, which runs it as it stands),
    the RL recipes are planned with their layouts: the parser reads them."""
    scripts = {argv[0] for _, kind, argv, _, _ in COMMANDS if kind == "script"}
    assert scripts >= {f"scripts/{name}.sh" for name in PUBLISHED}, scripts
    recipes = {argv[0] for _, kind, argv, _, _ in COMMANDS if kind == "plan"}
    assert {"configs/rlvr_8b.yaml", "configs/rlvr_70b.yaml", "configs/dpo_8b.yaml"} <= recipes, recipes
    rlvr_8b = [argv for _, kind, argv, _, _ in COMMANDS if kind == "plan" and argv[0] == "configs/rlvr_8b.yaml"]
    assert ["configs/rlvr_8b.yaml", "--num_processes", "7"] in rlvr_8b  # README.md, the recipe, fsdp_7gpu.yaml


@pytest.mark.parametrize(
    "where,kind,argv,env,expected",
    # a script runs plan in a process of its own (twice for RL: the engine layout, then the plan): seconds each
    [pytest.param(*c, marks=[pytest.mark.slow] if c[1] == "script" else [], id=f"{c[0]}:{c[1]}") for c in COMMANDS],
)
def test_each_published_line_passes_plan(where, kind, argv, env, expected, capsys):
    if kind == "script":
        assert_script_plans(argv[0], argv[1:], env, expected)
        return
    from open_instruct import plan

    try:
        rc = plan.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert rc == expected, f"{where}: plan {' '.join(argv)} exited {rc}\n{out.out[-1500:]}{out.err[-1500:]}"


def assert_script_plans(script: str, args: list[str], env: dict[str, str], expected: int) -> None:
    run_env = {k: v for k, v in os.environ.items() if k not in ("NUM_MACHINES", "NUM_PROCESSES", "MACHINE_RANK")}
    run_env.update(env, DRY_RUN="1", PYTHON=sys.executable, PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    proc = subprocess.run(["bash", script, *args], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=300)
    said = f"{script} {args} {env}: exit {proc.returncode}\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}"
    assert proc.returncode == expected, said
    if expected == 0:
        assert "Memory per GPU" in proc.stdout, proc.stdout[-1500:]  # the plan of the layout ran
