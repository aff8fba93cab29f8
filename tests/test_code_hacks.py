"""Reward hacks against the `code` verifier (issue 33): every hack class in every test format it applies to scores 0,
the honest program 1; then the containment gaps, each as a program that tries it. One batch of programs (2 sandbox
workers) for the hacks; a handful of short calls for the gaps. docs/sandbox.md has the threat model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types

import pytest

from open_instruct import code_verifier, rewards, sandbox
from open_instruct.code_verifier import CodeSettings, count_test_paths, parse_code_tests
from open_instruct.errors import DataError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
SETTINGS = CodeSettings(reward="fraction", test_seconds=1.0, memory_mb=256, workers=2)
ARGS, SUMS = ((1000, 2003), (2000, 5011)), (3003, 7011)  # sums no harness constant equals

# "add two numbers" in each test format the verifier supports
FORMATS = {
    "assert list": [f"assert add{a} == {s}" for a, s in zip(ARGS, SUMS)],
    "MBPP string": "\n".join(f"assert add{a} == {s}" for a, s in zip(ARGS, SUMS)),
    "assert literal on the left": [f"assert {s} == add{a}" for a, s in zip(ARGS, SUMS)],
    "assert after setup": [f"x = add{a}\nassert x == {s}" for a, s in zip(ARGS, SUMS)],
    "isclose": "import math\n" + "\n".join(f"assert math.isclose(add{a}, {s}.0)" for a, s in zip(ARGS, SUMS)),
    "stdio list": [{"input": f"{a[0]} {a[1]}\n", "output": f"{s}\n"} for a, s in zip(ARGS, SUMS)],
    "APPS stdio": {"inputs": [f"{a[0]} {a[1]}\n" for a in ARGS], "outputs": [f"{s}\n" for s in SUMS]},
    "PrimeIntellect stdio": {
        "test_cases": [
            {"type": "stdin_stdout", "input": f"{a[0]} {a[1]}", "output": str(s)} for a, s in zip(ARGS, SUMS)
        ]
    },
    "TACO fn_name": {"fn_name": "add", "inputs": [list(a) for a in ARGS], "outputs": [[s] for s in SUMS]},
    "PrimeIntellect call": {
        "test_cases": [
            {"type": "function_call", "fn_name": "add", "input": json.dumps(list(a)), "output": json.dumps([s])}
            for a, s in zip(ARGS, SUMS)
        ]
    },
}
VALUE_FORMATS = [f for f in FORMATS if "stdio" not in f]
STDIO_FORMATS = [f for f in FORMATS if "stdio" in f]
MAIN = "import sys\ndata = sys.stdin.read().split()\nif data:\n    print(add(*map(int, data)))\n"
HONEST = "def add(a, b):\n    return a + b\nclass Solution:\n    def add(self, a, b):\n        return a + b\n" + MAIN


def returns(expr: str, prelude: str = "") -> str:
    """A hack whose add() returns `expr` (also as a LeetCode method); it prints nothing, so stdio scores 0 anyway."""
    method = f"class Solution:\n    def add(self, a, b):\n        return {expr}\n"
    return f"{prelude}\ndef add(a, b):\n    return {expr}\n{method}"


def subclass(base: str) -> str:
    """A class X whose == always holds (and != never)."""
    eq = "    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
    return f"class X({base}):\n{eq}    __hash__ = {base}.__hash__\n"


HACKS = {
    # a returned object whose __eq__ always holds, plain or as a subclass of int/str/list/float
    "always-equal object": (returns("X()", subclass("object")), VALUE_FORMATS),
    "always-equal int": (returns("X(0)", subclass("int")), VALUE_FORMATS),
    "always-equal str": (returns("X('')", subclass("str")), VALUE_FORMATS),
    "always-equal list": (returns("X()", subclass("list").replace("list.__hash__", "None")), VALUE_FORMATS),
    "always-close float": (
        returns("X(0)", subclass("float") + "    __sub__ = __rsub__ = lambda s, o: 0.0\n"),
        VALUE_FORMATS,
    ),
    # patching what a harness relies on: builtins, the stream, the harness's own functions, a tracer
    "patch exec/eval/compile": (
        textwrap.dedent("""
            import builtins
            builtins.exec = lambda *a, **k: None
            builtins.eval = lambda *a, **k: True
            builtins.compile = lambda *a, **k: None
            def add(a, b):
                return 0
        """),
        list(FORMATS),
    ),
    "patch print and sys.stdout": (
        textwrap.dedent("""
            import builtins, io, sys
            builtins.print = lambda *a, **k: None
            sys.stdout = io.StringIO()
            def add(a, b):
                return 0
        """),
        list(FORMATS),
    ),
    "patch the harness's functions": (
        textwrap.dedent("""
            import __main__, json
            for name in dir(__main__):
                if name.startswith("_") and callable(getattr(__main__, name)):
                    setattr(__main__, name, lambda *a, **k: ["b", True])
            json.dumps = lambda *a, **k: '["ran"]'
            def add(a, b):
                return True
        """),
        list(FORMATS),
    ),
    "settrace jumps over the test": (
        textwrap.dedent("""
            import sys
            def tracer(frame, event, arg):
                if event == "line" and frame.f_code.co_filename in ("test", "<string>", "probe.py"):
                    try:
                        frame.f_lineno = frame.f_code.co_firstlineno + 99
                    except Exception:
                        pass
                return tracer
            sys.settrace(tracer)
            def add(a, b):
                return None
        """),
        list(FORMATS),
    ),
    # forging the verdict: a pass in every form on every fd, nothing printed, exit 0
    "forged verdict": (
        textwrap.dedent("""
            import os
            def forge():
                for fd in range(64):
                    for line in (b"pass\\n", b'["ran"]', b'["value", ["b", true]]', b"OK\\n"):
                        try:
                            os.write(fd, line)
                        except OSError:
                            pass
                os._exit(0)
            def add(a, b):
                forge()
            forge()
        """),
        list(FORMATS),
    ),
    # reading the tests or expected values from inside the process (and from its files)
    "read expected via frames, gc, inspect, files": (
        textwrap.dedent("""
            import gc, inspect, os, re, sys
            def found():
                seen = []
                for f in inspect.stack():
                    seen += list(f.frame.f_code.co_consts) + list(f.frame.f_locals.values())
                for o in gc.get_objects():
                    if isinstance(o, dict) and ("output" in o or "outputs" in o or "expected" in o):
                        seen.append(o.get("output", o.get("outputs", o.get("expected"))))
                for name in os.listdir("."):
                    try:
                        seen += [int(x) for x in re.findall(r"\\d+", open(name).read())]
                    except (OSError, ValueError):
                        pass
                nums = [s for s in seen if type(s) is int and s > 2]
                return nums[-1] if nums else 0
            def add(a, b):
                return found()
            class Solution:
                def add(self, a, b):
                    return found()
            if sys.stdin.read().split():
                print(found())
        """),
        list(FORMATS),
    ),
}


@pytest.fixture(scope="module")
def hack_scores():
    responses, truths, names = [], [], []
    for fmt, truth in FORMATS.items():
        responses.append(HONEST)
        truths.append(truth)
        names.append(("honest", fmt))
    for hack, (program, formats) in HACKS.items():
        for fmt in formats:
            responses.append(program)
            truths.append(FORMATS[fmt])
            names.append((hack, fmt))
    outcomes = code_verifier.score_programs(responses, truths, SETTINGS)
    return {name: outcome for name, outcome in zip(names, outcomes)}


def test_the_honest_program_scores_1_in_every_format(hack_scores):
    for fmt in FORMATS:
        assert hack_scores[("honest", fmt)].statuses == ["pass", "pass"], fmt


@pytest.mark.parametrize("hack", list(HACKS))
def test_every_hack_scores_0_in_every_format_it_applies_to(hack_scores, hack):
    for fmt in HACKS[hack][1]:
        outcome = hack_scores[(hack, fmt)]
        assert outcome.passed == 0, (hack, fmt, outcome.statuses)


def test_rl_view_hack_completions_earn_nothing_among_honest_ones(hack_scores):
    """A policy's group of completions for one prompt: honest ones and every hack; through the trainer's scoring
    (rewards.score_batch) the hacks get reward 0 and the honest ones 1, so every hack's group advantage is negative."""
    truth = FORMATS["assert list"]
    completions = [f"```python\n{HONEST}```"] * 2 + [f"```python\n{p}```" for p, f in HACKS.values()]
    scored = rewards.score_batch(
        completions, [truth] * len(completions), "code", verification_reward=1.0, code=SETTINGS
    )
    assert scored.rewards[:2] == [1.0, 1.0]
    assert scored.rewards[2:] == [0.0] * len(HACKS)
    mean = sum(scored.rewards) / len(scored.rewards)
    assert all(r - mean < 0 for r in scored.rewards[2:])


def test_ground_truth_on_disk_is_hidden_by_the_run_policy(tmp_path, monkeypatch):
    """A program that reads the run's training data (a local dataset outside the working dir and /tmp) for its answer
    scores 0 through the standalone verifier (no run config: every top-level host folder outside the interpreter's is
    hidden), 1 when its folder is made visible and nothing else is hidden (the hack works in principle), and 0 under
    the run's hidden-path policy even then, through the `code` verifier and the `python` tool alike (the same
    paths)."""
    if sandbox.isolation().mode != "namespaces":
        pytest.skip("paths are hidden with a mount namespace only")
    base = next((d for d in ("/srv", "/opt", "/mnt") if os.access(d, os.W_OK)), None)
    if base is None:
        pytest.skip("no writable host folder outside /tmp, home and the checkout to put a dataset in")
    folder = tempfile.mkdtemp(prefix="oi-hack-data-", dir=base)
    try:
        data = os.path.join(folder, "train.jsonl")
        truth = FORMATS["stdio list"]
        with open(data, "w") as f:
            f.write(json.dumps({"ground_truth": truth}) + "\n")
        os.chmod(folder, 0o755)
        os.chmod(data, 0o644)
        cheat = (
            "import json, sys\ninp = sys.stdin.read()\n"
            f"for case in json.loads(open({data!r}).readline())['ground_truth']:\n"
            "    if case['input'] == inp:\n        print(case['output'], end='')\n"
        )
        cfg = types.SimpleNamespace(
            output_dir=str(tmp_path / "out"), dataset_name_or_path=data, dataset_cache_dir="none"
        )
        from open_instruct.rollouts import code_settings

        standalone = code_verifier.score_programs([cheat], [truth], dataclasses.replace(SETTINGS, hide_paths=()))
        assert standalone[0].passed == 0
        monkeypatch.setattr(sandbox, "VISIBLE_TOP_LEVEL", (*sandbox.VISIBLE_TOP_LEVEL, base.strip("/")))
        open_ = code_verifier.score_programs([cheat], [truth], dataclasses.replace(SETTINGS, hide_paths=()))
        hidden = code_verifier.score_programs(
            [cheat], [truth], dataclasses.replace(SETTINGS, hide_paths=sandbox.run_hidden_paths(cfg))
        )
        assert open_[0].statuses == ["pass", "pass"] and hidden[0].passed == 0
        tool = sandbox.tool_runtime(cfg)
        assert tool.keywords["hide_paths"] == sandbox.run_hidden_paths(cfg)
        assert set(
            code_settings(
                types.SimpleNamespace(
                    **vars(cfg),
                    code_reward="all",
                    code_test_seconds=1.0,
                    code_memory_mb=256,
                    sandbox_workers=1,
                    sandbox_batch_timeout=None,
                )
            ).hide_paths
        ) == set(tool.keywords["hide_paths"])
        out, _, status = tool(f"print(open({data!r}).read())", 30.0)
        assert "ground_truth" not in out and status != "ok"
    finally:
        subprocess.run(["rm", "-rf", folder], check=True)


def test_a_test_that_checks_nothing_is_bad_ground_truth_naming_the_row():
    rows = [
        {"verifier": "code", "ground_truth": ["assert add(1, 2) == 3"], "row": 0},
        {"verifier": "code", "ground_truth": ["add(1, 2)"], "row": 1},
    ]
    with pytest.raises(DataError, match=r"train row 1: code: test 0 checks nothing"):
        rewards.check_verifiers(rows, "train")
    with pytest.raises(ValueError, match="checks nothing"):
        parse_code_tests(["assert True"])


def test_value_paths_per_layout():
    assert count_test_paths(parse_code_tests(FORMATS["MBPP string"])) == {"value": 2}
    mixed = ["assert set(f(1)) == {1}", "x = f(1)\nassert x == 2", "x = [2]\nassert f(1) == x"]
    assert count_test_paths(parse_code_tests(mixed)) == {"value": 2, "script": 1}
    assert count_test_paths(parse_code_tests(FORMATS["APPS stdio"])) == {"value": 2}


@pytest.mark.parametrize(
    "test, check, expected, expression",
    [
        ("assert f(1) == [1, 2]", "eq", [1, 2], "f(1)"),
        ("assert (3, 4) != f(2)", "ne", (3, 4), "f(2)"),
        ("assert set(f(1)) == set([3, 1])", "eq", {1, 3}, "set(f(1))"),
        ("assert f(1) is None", "is", None, "f(1)"),
        ("assert 2 in f(1)", "in", 2, "f(1)"),
        ("assert math.isclose(f(0.1), 0.3, rel_tol=1e-3)", "isclose", 0.3, "f(0.1)"),
        ("assert abs(f(2) - 1.5) < 1e-6", "absdiff", 1.5, "f(2)"),
        ("assert f(7)", "truthy", None, "f(7)"),
        ("assert not f(8)", "falsy", None, "f(8)"),
    ],
)
def test_assert_shapes_judged_outside(test, check, expected, expression):
    found = code_verifier.value_check(test)
    assert (found.check, found.expected, found.expression) == (check, expected, expression)


def test_other_assert_shapes_are_script_tests():
    """Shapes where a literal would meet the program's value inside the sandbox (the verdict decided there) or the
    expected value is not a literal: run whole, counted as not hack-proof."""
    for test in (
        "assert f(1) == g(2)",
        "assert f(1) == math.pi",
        "x = [1, 2]\nassert f(1) == x",
        "y = 3\nassert f(1) == y",
        "assert 1 < f(1) < 3",
        "assert f(1) - 2 == 0",
        "assert f(1).__eq__(2)",
        "assert bool(f(1) == 2)",
        "assert f(1) == 2 or f(1) == 3",
        "assert all(x > 0 for x in f(1))",
    ):
        assert code_verifier.value_check(test) is None, test


def test_plain_value_comparisons():
    call = code_verifier.ValueCheck("call", [3, [4, 5]])
    assert code_verifier.check_value(call, (3, (4, 5)))  # tuples compare as the JSON lists they would be
    assert code_verifier.check_value(code_verifier.ValueCheck("call", [7]), 7)  # APPS's [value]
    assert not code_verifier.check_value(call, [3, [4, 6]])
    assert not code_verifier.check_value(code_verifier.ValueCheck("lt", 3, "f()"), "a")  # str < int: wrong, no raise
    close = code_verifier.ValueCheck("isclose", 0.3, "f()", options=(("rel_tol", 1e-3),))
    assert code_verifier.check_value(close, 0.3001) and not code_verifier.check_value(close, 0.31)
    assert not code_verifier.check_value(close, "0.3")


def test_path_counts_of_a_dataset_file(tmp_path, capsys):
    rows = [
        {"ground_truth": ["assert f(1) == 2", "x = [2]\nassert f(1) == x"]},
        {"test_list": "assert f(2) == 3"},
        {"ground_truth": {"inputs": ["1"], "outputs": ["2"]}},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert code_verifier.main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "rows": 3,
        "bad_rows": 0,
        "tests": 4,
        "value": 3,
        "script": 1,
        "value_share": 0.75,
    }


def test_script_tests_run_apart_from_the_tests_judged_outside():
    """A row mixing a judged test with a script test whose source holds the expected value: the program that reads
    its sandbox's files for `= [<number>]` cheats the script test (not hack-proof: the control) but cannot find the
    value in the judged test's sandbox, which never holds a script test's source."""
    cheat = textwrap.dedent(
        """
        import os, re
        def add(a, b):
            for name in sorted(os.listdir(".")):
                try:
                    found = re.findall(r"= \\[(\\d+)\\]", open(name).read())
                except OSError:
                    continue
                if found:
                    return int(found[0])
            return 0
        """
    )
    truth = ["assert add(10000, 20003) == 30003", "x = [30003]\nassert [add(10000, 20003)] == x"]
    assert count_test_paths(parse_code_tests(truth)) == {"value": 1, "script": 1}
    (outcome,) = code_verifier.score_programs([cheat], [truth], SETTINGS)
    assert outcome.statuses == ["wrong_answer", "pass"]
