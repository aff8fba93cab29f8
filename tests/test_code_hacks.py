"""Reward hacks against the `code` verifier (issue 33): every hack class in every test format it applies to scores 0,
the honest program 1; then the containment gaps, each as a program that tries it. One batch of programs (2 sandbox
workers) for the hacks; a handful of short calls for the gaps. docs/sandbox.md has the threat model."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import types

import pytest

from open_instruct import code_checks, code_verifier, rewards, sandbox
from open_instruct.code_verifier import CodeSettings, count_test_paths, parse_code_tests
from open_instruct.errors import DataError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
SETTINGS = CodeSettings(reward="fraction", test_seconds=1.0, memory_mb=256, workers=2)
ARGS, SUMS = ((1000, 2003), (2000, 5011)), (3003, 7011)  # sums no harness constant equals

# An EvalPlus-style harness (inputs, results, a loop of assertion(f(*inp), exp, atol)); its `assertion` is recognized by
# the shape of its syntax tree (code_checks.EVALPLUS_ASSERTIONS), registered for this one in the fixture below.
EVALPLUS_ASSERTION = """
import math

def assertion(out, exp, atol):
    if out == exp:
        return
    assert atol != 0 and math.isclose(out, exp, abs_tol=atol)
"""
EVALPLUS_HARNESS = EVALPLUS_ASSERTION + (
    f"\ninputs = {[list(a) for a in ARGS]}\nresults = {list(SUMS)}\n"
    "for i, (inp, exp) in enumerate(zip(inputs, results)):\n    assertion(add(*inp), exp, 0)\n"
)


@pytest.fixture(scope="module", autouse=True)
def evalplus_harness_recognized():
    definition = next(n for n in ast.parse(EVALPLUS_ASSERTION).body if isinstance(n, ast.FunctionDef))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(code_checks.EVALPLUS_ASSERTIONS, code_checks.shape(definition), "_evalplus")
        yield


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
    # HumanEval: check(candidate) called in the test code, or stored without the call and its entry_point column
    "HumanEval check, called": "def check(candidate):\n"
    + "".join(f"    assert candidate{a} == {s}\n" for a, s in zip(ARGS, SUMS))
    + "\ncheck(add)\n",
    "HumanEval check + entry_point": {
        "test": "METADATA = {'author': 'x'}\n\ndef check(candidate):\n"
        + "".join(f"    assert candidate{a} == {s}, 'message'\n" for a, s in zip(ARGS, SUMS)),
        "entry_point": "add",
    },
    "check over a literal loop": {
        "test": "def check(candidate):\n    for args, want in " + repr(list(zip(ARGS, SUMS))) + ":\n"
        "        assert candidate(*args) == want\n",
        "entry_point": "add",
    },
    "pytest test_ functions": "".join(
        f"def test_{i}():\n    assert add{a} == {s}\n" for i, (a, s) in enumerate(zip(ARGS, SUMS))
    ),
    "abs tolerance in check": {
        "test": "def check(candidate):\n"
        + "".join(f"    assert abs(candidate{a} - {s}) < 1e-6\n" for a, s in zip(ARGS, SUMS)),
        "entry_point": "add",
    },
    "EvalPlus assertion harness": EVALPLUS_HARNESS,
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
        statuses = hack_scores[("honest", fmt)].statuses
        tests = len(parse_code_tests(FORMATS[fmt]).tests)  # 2, or 1 where one piece of test code runs whole
        assert statuses == ["pass"] * tests and tests in (1, 2), fmt


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


def test_rl_view_on_a_humaneval_check_row():
    """A GRPO group on a HumanEval row (check(candidate) + entry_point, as stored): 2 honest completions and every
    hack, scored by the trainer's path and turned into group advantages (rl_algorithms.group_advantages, the grpo
    estimator's formula): the honest ones get reward 1 and the one positive advantage; every hack gets reward 0 and
    the same negative advantage (on main, 5 of 6 hacks on such a row got the honest program's advantage)."""
    import torch

    from open_instruct.rl_algorithms import group_advantages

    truth = FORMATS["HumanEval check + entry_point"]
    completions = [f"```python\n{HONEST}```"] * 2 + [f"```python\n{p}```" for p, _ in HACKS.values()]
    scored = rewards.score_batch(
        completions, [truth] * len(completions), "code", verification_reward=1.0, code=SETTINGS
    )
    assert scored.rewards == [1.0, 1.0] + [0.0] * len(HACKS)
    advantages = group_advantages(torch.tensor(scored.rewards), len(completions)).tolist()
    n, mean = len(completions), 2 / len(completions)
    std = math.sqrt((2 * (1 - mean) ** 2 + len(HACKS) * mean**2) / (n - 1))
    assert advantages[:2] == pytest.approx([(1 - mean) / (std + 1e-6)] * 2)
    assert advantages[2:] == pytest.approx([-mean / (std + 1e-6)] * len(HACKS))


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
                    code_max_tests=16,
                    code_allow_script_tests=False,
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
    with pytest.raises(DataError, match=r"train row 1: code: test 0: the test code checks nothing"):
        rewards.check_verifiers(rows, "train")
    for nothing in (["assert True"], "def check(candidate):\n    assert True\ncheck(add)\n"):
        with pytest.raises(ValueError, match="checks nothing"):
            parse_code_tests(nothing)


def test_checks_never_called_are_bad_ground_truth_unless_the_row_names_the_entry_point():
    """HumanEval's `test` as stored defines check(candidate) and never calls it: alone it would check nothing (on main
    it paid every program); the row's entry_point makes it callable; pytest-style test_* functions are called as
    pytest would."""
    stored = FORMATS["HumanEval check + entry_point"]["test"]
    rows = [{"verifier": "code", "ground_truth": {"test": stored}, "row": 7}]
    with pytest.raises(DataError, match=r"train row 7: code: .*defines check\(candidate\) with checks but never calls"):
        rewards.check_verifiers(rows, "train")
    assert count_test_paths(parse_code_tests({"test": stored, "entry_point": "add"})) == {"whole": 1}
    assert parse_code_tests(stored, entry_point="add").tests[0].endswith("\ncheck(add)\n")  # HumanEval's harness
    assert count_test_paths(parse_code_tests(FORMATS["pytest test_ functions"])) == {"whole": 1}
    with pytest.raises(ValueError, match="entry_point must be a Python identifier"):
        parse_code_tests({"test": stored, "entry_point": "not a name"})


def test_value_paths_per_layout():
    """Only `assert f(<literals>) == <literal>` (after imports) is judged on the value path, where that is provably
    the test's own verdict; every other piece of test code runs unmodified in lock-step, one test each."""
    assert count_test_paths(parse_code_tests(FORMATS["assert list"])) == {"value": 2}
    assert count_test_paths(parse_code_tests(FORMATS["MBPP string"])) == {"whole": 1}
    simple = ["assert f(1) == [1, 2]", "assert (3, 4) == f(2)", "import math\nassert f(x=1.5) == 2.0"]
    assert count_test_paths(parse_code_tests(simple)) == {"value": 3}
    mixed = ["assert set(f(1)) == {1}", "x = f(1)\nassert x == 2", "x = [2]\nassert f(1) == x", "assert f(1) != 2"]
    assert count_test_paths(parse_code_tests(mixed)) == {"whole": 4}
    assert count_test_paths(parse_code_tests(FORMATS["APPS stdio"])) == {"value": 2}
    changed = EVALPLUS_HARNESS.replace("atol != 0 and", "")
    assert count_test_paths(parse_code_tests(changed)) == {"whole": 1}


@pytest.mark.parametrize(
    "test, condition, answers",
    [
        ("assert f(1) == [1, 2]", "_answer0 == [1, 2]", ("f(1)",)),
        ("assert (3, 4) != f(2)", "(3, 4) != _answer0", ("f(2)",)),
        ("assert set(f(1)) == set([3, 1])", "set(_answer0) == set([3, 1])", ("f(1)",)),
        ("assert f(1) is None", "_answer0 is None", ("f(1)",)),
        ("assert 2 in f(1)", "2 in _answer0", ("f(1)",)),
        ("assert math.isclose(f(0.1), 0.3, rel_tol=1e-3)", "math.isclose(_answer0, 0.3, rel_tol=0.001)", ("f(0.1)",)),
        ("assert abs(f(2) - 1.5) < 1e-6", "abs(_answer0 - 1.5) < 1e-06", ("f(2)",)),
        ("assert f(7)", "_answer0", ("f(7)",)),
        ("assert not f(8)", "not _answer0", ("f(8)",)),
        ("assert isinstance(to_list('abc'), list)", "isinstance(_answer0, list)", ("to_list('abc')",)),
        ("assert f('abc').startswith('ab')", "_answer0.startswith('ab')", ("f('abc')",)),
        ("assert len(f(3)) == 3", "len(_answer0) == 3", ("f(3)",)),
        ("assert 1 < f(1) < 3", "1 < _answer0 < 3", ("f(1)",)),
        ("assert f(1) == 2 or f(1) == 3", "_answer0 == 2 or _answer1 == 3", ("f(1)", "f(1)")),
        ("assert f(1) == math.pi", "_answer0 == math.pi", ("f(1)",)),
        ("y = 3\nassert f(1) == y", "_answer0 == 3", ("f(1)",)),
        ("assert Solution().count(3) == 1", "_answer0 == 1", ("Solution().count(3)",)),
        ("assert sum(10, 15) == 6", "_answer0 == 6", ("sum(10, 15)",)),  # the builtin fails: the program's sum
        (  # HumanEval/151's shape: a computed expected value, evaluated here
            "lst = list(range(1, 4))\nodd = sum([i * i for i in lst if i % 2])\nprint\nassert f(lst) == odd",
            "_answer0 == sum([i * i for i in list(range(1, 4)) if i % 2])",
            ("f(list(range(1, 4)))",),
        ),
    ],
)
def test_assert_shapes_judged_outside(test, condition, answers):
    """Only the program's answers run in the sandbox; everything around them (predicates, comparisons, tolerances,
    literals) is evaluated in the trainer on the decoded values."""
    found = code_verifier.value_check(test)
    assert (found.condition, found.answers) == (condition, answers)


@pytest.mark.parametrize(
    "test, raises",
    [
        ("try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False", ("ValueError",)),
        ("try:\n    f(-1)\n    assert False\nexcept (KeyError, IndexError):\n    pass", ("KeyError", "IndexError")),
        ("import pytest\nwith pytest.raises(ZeroDivisionError):\n    f(0)", ("ZeroDivisionError",)),
        ("self.assertRaises(TypeError, f, 'x')", ("TypeError",)),
    ],
)
def test_raises_tests_are_judged_outside(test, raises):
    found = code_verifier.value_check(test)
    assert found.raises == raises and len(found.answers) == 1


def test_other_shapes_run_whole_in_lock_step():
    """Shapes the value path would have to transform (or could not judge): run unmodified in lock-step, never as a
    script in the program's interpreter."""
    for test in (
        "assert f(1).__eq__(2)",
        "assert all(x > 0 for x in f(1))",
        "def helper(x):\n    return x > 0\nassert helper(f(1))",
        "import random\nx = random.randint(1, 9)\nassert f(x) == x + 1",
        "try:\n    f(-1)\nexcept MyError:\n    pass\nelse:\n    assert False",
    ):
        assert code_verifier.value_check(test) is None, test
        assert count_test_paths(parse_code_tests([test])) == {"whole": 1}, test


def test_plain_value_comparisons():
    call = code_checks.ValueCheck(expected=[3, [4, 5]], call=True)
    assert code_checks.check_value(call, [(3, (4, 5))])  # tuples compare as the JSON lists they would be
    assert code_checks.check_value(code_checks.ValueCheck(expected=[7], call=True), [7])  # APPS's [value]
    assert not code_checks.check_value(call, [[3, [4, 6]]])
    assert not code_checks.check_value(code_verifier.value_check("assert f() < 3"), ["a"])  # str < int: no raise
    close = code_verifier.value_check("assert math.isclose(f(), 0.3, rel_tol=1e-3)")
    assert code_checks.check_value(close, [0.3001]) and not code_checks.check_value(close, [0.31])
    assert not code_checks.check_value(close, ["0.3"])
    exact = code_verifier.value_check("assert f() == 998244353")
    assert code_checks.check_value(exact, [998244353]) and not code_checks.check_value(exact, [998244000])
    assert not code_checks.check_value(exact, [998244000.0]) and code_checks.check_value(exact, [998244353.0])
    huge = code_verifier.value_check("assert f() * 10**9 == 0")  # a product this big is refused, not computed
    assert not code_checks.check_value(huge, ["x" * 1000])


def test_integers_compare_exactly_in_stdout():
    assert not code_verifier.outputs_match("998244000\n", "998244353\n")
    assert not code_verifier.outputs_match("998244000.0", "998244353")
    assert code_verifier.outputs_match("0.3333334", "0.333333") and code_verifier.outputs_match("+7", "7")
    assert not code_verifier.outputs_match("1e3", "1000")  # an expected integer: only an integer


def test_path_counts_of_a_dataset_file(tmp_path, capsys):
    rows = [
        {"ground_truth": ["assert f(1) == 2", "assert all(v for v in f(1))"]},
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
        "whole": 1,
        "value_share": 0.75,
    }


def test_a_whole_tests_source_never_reaches_the_program():
    """A row mixing a value test with a whole test whose source holds the expected value: a program that searches its
    files, its own memory (it is a fork of the supervisor) and every other process's memory for `v == <number> for`
    finds nothing in either (the whole test's source travels sealed to its test process only, which is not dumpable),
    so it scores 0; the honest program scores 1. On 65ee6f9 the whole test was a script test whose source sat in the
    program's interpreter: the same cheat passed it (when script tests were allowed)."""
    cheat = textwrap.dedent(
        """
        import os, re
        PATTERN = re.compile(rb"v == (\\d+) for")
        def found_in_memory(pid):
            try:
                maps = open(f"/proc/{pid}/maps").read().splitlines()
                mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
            except OSError:
                return None
            for line in maps:
                span, perms = line.split()[:2]
                if not perms.startswith("r"):
                    continue
                start, end = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(start)
                    hit = PATTERN.search(mem.read(min(end - start, 1 << 26)))
                except (OSError, ValueError, OverflowError):
                    continue
                if hit and hit.group(1) != b"(":
                    return int(hit.group(1))
            return None
        def add(a, b):
            for name in sorted(os.listdir(".")):
                try:
                    hit = PATTERN.search(open(name, "rb").read())
                except OSError:
                    continue
                if hit:
                    return int(hit.group(1))
            for pid in ["self"] + [p for p in os.listdir("/proc") if p.isdigit()]:
                value = found_in_memory(pid)
                if value is not None:
                    return value
            return 0
        """
    )
    truth = ["assert add(10000, 20003) == 30003", "assert all(v == 30003 for v in [add(10000, 20003)])"]
    assert count_test_paths(parse_code_tests(truth)) == {"value": 1, "whole": 1}
    cheated, honest = code_verifier.score_programs([cheat, HONEST], [truth, truth], SETTINGS)
    assert cheated.statuses == ["wrong_answer", "wrong_answer"]
    assert honest.statuses == ["pass", "pass"]


FORGE = "import os\nos.write(3, b'[\"ran\"]')\nos._exit(0)\n"


def test_tests_with_helpers_run_whole_and_a_forged_verdict_pays_nothing():
    """A test with a helper of its own (a script test on 65ee6f9: refused by default, and when allowed the one-line
    forge paid) runs unmodified in lock-step without any setting: the honest program passes, the forge (a report on
    fd 3, exit 0) scores 0, as on HumanEval's check() as stored."""
    truth = ["def positive(x):\n    return x > 0\nassert positive(add(1, 2))"]
    rewards.check_verifiers([{"verifier": "code", "ground_truth": truth, "row": 3}], "train")
    honest, forged = code_verifier.score_programs([HONEST, FORGE], [truth, truth], SETTINGS)
    assert honest.statuses == ["pass"] and forged.statuses == ["crash"]
    (on_check,) = code_verifier.score_programs([FORGE], [FORMATS["HumanEval check + entry_point"]], SETTINGS)
    assert on_check.passed == 0


PREDICATE_ROWS = {
    "isinstance": ("def to_list(s):\n    return list(s)\n", ["assert isinstance(to_list('abc'), list)"]),
    "startswith": ("def f(s):\n    return s + '!'\n", ["assert f('abc').startswith('ab')"]),
    "len and in": ("def f(n):\n    return list(range(n))\n", ["assert len(f(3)) == 3 and 2 in f(3)"]),
    "Counter": (
        "from collections import Counter\ndef f(s):\n    return Counter(s)\n",
        ["from collections import Counter\nassert f('aab') == Counter({'a': 2, 'b': 1})"],
    ),
    "complex": ("def f(a):\n    return complex(a, -1)\n", ["assert f(2) == (2-1j)", "assert f(3).imag == -1"]),
    "re.Match truthy": (
        "import re\ndef f(s):\n    return re.search('ab+', s)\n",
        ["assert f('xabb')", "assert not f('b')"],
    ),
    "tuple, set, frozenset": (
        "def f(x):\n    return (x, {x}, frozenset([x]))\n",
        ["assert f(1) == (1, {1}, frozenset({1}))", "assert type(f(1)) is tuple"],
    ),
    "raises": (
        "def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return x\n",
        ["try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False", "assert f(2) == 2"],
    ),
}
PREDICATE_HACKS = {
    "isinstance": "isinstance = lambda *a: True\nimport builtins\nbuiltins.isinstance = isinstance\n"
    "def to_list(s):\n    return s\n",
    "startswith": "class S(str):\n    def startswith(self, *a):\n        return True\ndef f(s):\n    return S('zz')\n",
    "len and in": "class L(list):\n    def __len__(self):\n        return 3\n    def __contains__(self, x):\n"
    "        return True\ndef f(n):\n    return L()\nlen = lambda x: 3\n",
    "Counter": "from collections import Counter\nclass C(Counter):\n    __eq__ = lambda s, o: True\n"
    "def f(s):\n    return C()\n",
    "complex": "class Z(complex):\n    __eq__ = lambda s, o: True\n    imag = -1\ndef f(a):\n    return Z(0)\n",
    "re.Match truthy": "import re\ndef f(s):\n    return re.search('q', 'q')\n",
    "tuple, set, frozenset": "class T(tuple):\n    __eq__ = lambda s, o: True\ndef f(x):\n    return T()\n",
    "raises": "class ValueError(Exception):\n    pass\ndef f(x):\n    raise ValueError(x)\n",
}


def test_predicates_exceptions_and_more_types_are_judged_outside():
    """Truthy tests (isinstance, startswith, len, in), raises tests and Counter/complex/re.Match/tuple/set returns,
    each with the honest program (every test passes) and a hack of its kind (patched predicates, objects whose
    methods answer yes, subclasses with an always-true ==, a look-alike exception class): no hack test passes."""
    names = list(PREDICATE_ROWS)
    programs = [PREDICATE_ROWS[n][0] for n in names] + [PREDICATE_HACKS[n] for n in names]
    truths = [PREDICATE_ROWS[n][1] for n in names] * 2
    outcomes = code_verifier.score_programs(programs, truths, SETTINGS)
    for name, honest, hack in zip(names, outcomes[: len(names)], outcomes[len(names) :]):
        assert set(honest.statuses) == {"pass"}, (name, honest.statuses)
        if name == "raises":
            # its own ValueError is no ValueError: it escapes the test's `except ValueError`
            assert hack.statuses[0] == "crash", (name, hack.statuses)
        elif name == "re.Match truthy":
            assert hack.statuses == ["pass", "wrong_answer"]  # a real match is truthy: only the falsy test fails it
        else:
            assert hack.passed == 0, (name, hack.statuses)


def test_a_forged_reply_of_colliding_ints_costs_the_trainer_little():
    """A program that writes its own reply: 1 MB of a set of distinct ints with one hash (x + k * (2**61 - 1)), which
    would take the trainer minutes to build into a set; it is refused (0, counted as `oversized`) after one hashing
    pass."""
    modulus = (1 << 61) - 1
    members = [["i", format(5 + k * modulus, "x")] for k in range(30_000)]
    reply = json.dumps(["values", [["S", members]]])
    assert 800_000 < len(reply) < 1 << 20
    with pytest.raises(ValueError, match="colliding"):
        code_checks.decode_value(["S", members])
    program = f"import os\nos.write(3, {reply.encode()!r})\nos._exit(0)\n"
    start = time.process_time()
    (outcome,) = code_verifier.score_programs([program], [["assert f() == 30000"]], SETTINGS)
    assert outcome.statuses == ["oversized"]
    assert time.process_time() - start < 2.0  # the unguarded set build: ~30_000**2 / 2 probes, minutes


def test_a_row_with_more_tests_than_the_cap_is_refused():
    rows = [{"verifier": "code", "ground_truth": [f"assert add({i}, 1) == {i + 1}" for i in range(5)], "row": 4}]
    with pytest.raises(DataError, match=r"train row 4: code: 5 tests, more than code_max_tests 4"):
        rewards.check_verifiers(rows, "train", dataclasses.replace(SETTINGS, max_tests=4))
    rewards.check_verifiers(rows, "train", dataclasses.replace(SETTINGS, max_tests=5))


def test_long_test_seconds_work_on_both_paths():
    """code_test_seconds over its whole range: at 11 s (2 x 11 CPU seconds for a value test) the honest program passes
    on the value and the stdio path (on main every test crashed: the runner's hard RLIMIT_CPU was 11); past 60 the
    setting is refused."""
    slow = dataclasses.replace(SETTINGS, test_seconds=11.0)
    outcomes = code_verifier.score_programs([HONEST, HONEST], [FORMATS["assert list"], FORMATS["stdio list"]], slow)
    assert [o.statuses for o in outcomes] == [["pass", "pass"], ["pass", "pass"]]
    with pytest.raises(ValueError, match="code_test_seconds must be > 0 and <= 60"):
        dataclasses.replace(SETTINGS, test_seconds=61.0).validate()
    assert code_verifier.CodeSettings().batch_timeout == 600.0


def test_trainer_memory_is_bounded_under_1_mb_of_output_per_test(tmp_path):
    """A program printing 1 MB of \\xff for each of 24 stdio tests (escaped 6x as JSON on main: +432 MB of trainer
    RSS): the trainer's peak RSS over scoring it stays within the per-response output cap (16 MiB of raw bytes) times
    the few copies decoding makes, measured in a fresh process against the same run with 1 test."""
    script = textwrap.dedent(
        """
        import json, resource, sys
        from open_instruct import code_verifier
        n = int(sys.argv[1])
        program = "import sys\\nsys.stdout.buffer.write(b'\\\\xff' * (1 << 20))\\n"
        truth = [{"input": str(i), "output": "1"} for i in range(n)]
        settings = code_verifier.CodeSettings(test_seconds=2.0, memory_mb=256, workers=1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        (outcome,) = code_verifier.score_programs([program], [truth], settings)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"statuses": sorted(set(outcome.statuses)), "grown_kb": after - before}))
        """
    )
    grown = {}
    for n in (1, 24):
        out = subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True, check=True)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert set(report["statuses"]) <= {"wrong_answer", "output"}
        grown[n] = report["grown_kb"]
    assert grown[24] - grown[1] < 4 * (code_verifier.MAX_RESPONSE_OUTPUT_BYTES >> 10)  # main: ~24 x 18 MB


def test_a_raises_test_passes_only_when_its_call_raises_not_the_program_or_the_setup():
    """Issue 67: a raises test passed when the program's import raised the named exception (every raises test of a
    row paid a program of one line, `raise ValueError`), or when a setup line before the call raised it (where the
    unmodified test errors out). The exception counts only when the call the test wraps raised it."""
    raises = "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False\n"
    raises_after_setup = "x = f(-1)\ntry:\n    f(x)\nexcept ValueError:\n    pass\nelse:\n    assert False\n"
    honest = "def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return x\n"
    at_import = "raise ValueError('at import')\n"
    outcomes = code_verifier.score_programs(
        [honest, at_import, honest, at_import], [raises, raises, raises_after_setup, raises_after_setup], SETTINGS
    )
    assert [o.statuses for o in outcomes] == [["pass"], ["crash"], ["crash"], ["crash"]]  # main: all four pass
