"""What a program returns cannot stall the trainer (issue 67, part 3): every reply the red team built to cost the
trainer seconds or gigabytes (a Fraction read as 10**E, colliding set members, a `%` format, a repeated list, int()
of a huge Decimal) is refused by a bound checked before any arithmetic, scores 0 and is counted as `oversized`;
honest values of the same types still pass. The trainer's CPU and RSS over the worst of them are measured in a fresh
process."""

from __future__ import annotations

import decimal
import fractions
import json
import subprocess
import sys
import textwrap
import time

import pytest

from open_instruct import code_checks, code_verifier
from open_instruct.code_verifier import CodeSettings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
SETTINGS = CodeSettings(reward="fraction", test_seconds=1.0, memory_mb=256, workers=2)

# Three ways to make the trainer read Fraction("1e1000000000") (10**(10**9), which never finishes building) on main.
FRACTION_STR = "import fractions\nfractions.Fraction.__str__ = lambda self: '1e1000000000'\n"
HUGE_FRACTION = {
    "patched Fraction.__str__": FRACTION_STR + "def f():\n    return fractions.Fraction(1, 3)\n",
    "planted fractions module": (
        "import sys, types\nfake = types.ModuleType('fractions')\n"
        "class Fraction:\n    def __str__(self):\n        return '1e1000000000'\n"
        "fake.Fraction = Fraction\nsys.modules['fractions'] = fake\n"
        "def f():\n    return Fraction()\n"
    ),
    "the runner's emit function": (
        "import __main__\n__main__._emit(['values', [['Q', '1e1000000000']]])\ndef f():\n    return 0\n"
    ),
}
MODULUS = (1 << 61) - 1  # hash(k * MODULUS) == 0 for every k: a set of them is built in quadratic time
# (name, program, test, what the honest program of the same row returns): each hostile reply is over a bound
OVER_BOUND = {
    **{name: (program, "assert f() == 1", "def f():\n    return 1\n") for name, program in HUGE_FRACTION.items()},
    "set() of 34k colliding ints": (
        f"def f():\n    return [k * {MODULUS} for k in range(34_000)]\n",
        "assert len(set(f())) == 3",
        "def f():\n    return [1, 2, 2, 3]\n",
    ),
    "`%` with a 1e9-wide format": (
        "def f():\n    return '%01000000000d'\n",
        "assert f() % 2 == '2'",
        "def f():\n    return '%d'\n",
    ),
    "a list times 1000": (
        "def f():\n    return list(range(20_000))\n",
        "assert len(f() * 1000) == 3000",
        "def f():\n    return [1, 2, 3]\n",
    ),
    "int() of Decimal('1E+999999999')": (
        "from decimal import Decimal\ndef f():\n    return Decimal('1E+999999999')\n",
        "assert int(f()) == 5",
        "from decimal import Decimal\ndef f():\n    return Decimal('5.5')\n",
    ),
    "math.floor of Decimal('1E+999999999')": (
        "from decimal import Decimal\ndef f():\n    return Decimal('1E+999999999')\n",
        "import math\nassert math.floor(f()) == 5",
        "from decimal import Decimal\ndef f():\n    return Decimal('5.5')\n",
    ),
}


WHOLE_FAILURES = ("timeout", "memory", "wrong_answer", "crash")


def test_every_reply_over_a_bound_scores_0_and_is_counted_and_honest_ones_pass():
    names = list(OVER_BOUND)
    programs = [OVER_BOUND[n][0] for n in names] + [OVER_BOUND[n][2] for n in names]
    truths = [[OVER_BOUND[n][1]] for n in names] * 2
    outcomes = code_verifier.score_programs(programs, truths, SETTINGS)
    judged_here = [code_verifier.value_equivalent(OVER_BOUND[n][1]) for n in names]
    for name, here, hostile, honest in zip(names, judged_here, outcomes[: len(names)], outcomes[len(names) :]):
        # a value test's reply is decoded here, under the bounds; a whole test's values are decoded by its test
        # process in the sandbox, whose own limits stop them (the trainer never sees them)
        assert hostile.statuses == ["oversized"] if here else hostile.statuses[0] in WHOLE_FAILURES, (name, hostile)
        assert honest.statuses == ["pass"], (name, honest.statuses)
    counts = code_verifier.count_statuses(outcomes[: len(names)])
    assert counts["oversized"] == sum(judged_here) == 3  # the three hostile Fractions: `assert f() == 1`
    assert code_verifier.status_sums(type("Rollout", (), {"code_statuses": counts})())["code_oversized"] == sum(
        judged_here
    )


@pytest.mark.parametrize(
    "encoded",
    [
        ["Q", "1e1000000000"],
        ["Q", "1" * 4301],
        ["D", "1E+999999999"],
        ["D", "1E+10001"],
        ["D", "1" * 4301],
        ["i", "f" * (code_checks.MAX_INT_BITS // 4 + 2)],
        ["l", [["S", [["i", format(k * MODULUS, "x")] for k in range(65)]]]],
        ["d", [[["i", format(k * MODULUS, "x")], ["n"]] for k in range(65)]],
    ],
)
def test_decoding_refuses_each_bound_before_building(encoded):
    with pytest.raises(code_checks.OverBound):
        code_checks.decode_value(encoded)


def test_nesting_is_bounded():
    value: list = ["n"]
    for _ in range(code_checks.MAX_DEPTH):
        value = ["l", [value]]
    assert code_checks.decode_value(value) is not None
    with pytest.raises(code_checks.OverBound):
        code_checks.decode_value(["l", [value]])


def test_honest_values_at_the_bounds_decode_exactly():
    assert code_checks.decode_value(["Q", "-" + "9" * 4300 + "/7"]) == fractions.Fraction(-int("9" * 4300), 7)
    assert code_checks.decode_value(["D", "1.5E+10000"]) == decimal.Decimal("1.5E+10000")
    assert code_checks.decode_value(["D", "-Infinity"]) == decimal.Decimal("-Infinity")
    big = (1 << code_checks.MAX_INT_BITS) - 1
    assert code_checks.decode_value(["i", format(big, "x")]) == big
    members = [["i", format(k * MODULUS, "x")] for k in range(64)]  # 64 of one hash: the bound itself
    assert len(code_checks.decode_value(["S", members])) == 64


@pytest.mark.parametrize(
    "condition, values, status",
    [
        ("_answer0 % 2 == '0'", ["%01000000000d"], "oversized"),
        ("_answer0 % 2 == '0'", ["%*d"], "oversized"),
        ("_answer0 % 2 == '2'", ["%d"], "pass"),
        ("'%5.2f' % _answer0 == ' 1.50'", [1.5], "pass"),
        ("len(_answer0 * 1000) == 3000", [list(range(20_000))], "oversized"),
        ("len(_answer0 * 1000) == 3000", [[1, 2, 3]], "pass"),
        ("len(1000 * _answer0) == 3000", ["x" * 2000], "oversized"),
        ("_answer0 * _answer0 > 0", [1 << 600_000], "oversized"),
        ("_answer0 ** 1000 > 0", [1 << 2000], "oversized"),
        ("_answer0 ** 2 == 4", [2], "pass"),
        ("2 ** _answer0 > 0", [10**9], "oversized"),
        ("1 << _answer0 > 0", [10**9], "oversized"),
        ("len(set(_answer0)) == 1", [[k * ((1 << 61) - 1) for k in range(65)]], "oversized"),
        ("len({x for x in _answer0}) == 1", [[k * ((1 << 61) - 1) for k in range(65)]], "oversized"),
        ("len({*_answer0}) == 1", [[k * ((1 << 61) - 1) for k in range(65)]], "oversized"),
        ("len(set(_answer0)) == 64", [[k * ((1 << 61) - 1) for k in range(64)]], "pass"),
        ("len(sum(_answer0, [])) == 1", [[[1]] * 20_000], "oversized"),
        (
            "collections.Counter(_answer0) == collections.Counter()",
            [[k * ((1 << 61) - 1) for k in range(65)]],
            "oversized",
        ),
        ("len(dict([(k, 0) for k in _answer0])) == 1", [[k * ((1 << 61) - 1) for k in range(65)]], "oversized"),
        ("isinstance(_answer0, set) and isinstance(_answer1, dict)", [{1}, {1: 2}], "pass"),  # the names stay types
        (
            "type(_answer0) == Fraction and isinstance(_answer1, Decimal)",
            [fractions.Fraction(1, 3), decimal.Decimal(1)],
            "pass",
        ),
        ("set(_answer0) == {1, 2} and dict(a=1) == {'a': 1}", [[2, 1, 2]], "pass"),
        ("int(Decimal(_answer0)) == 1", ["1E+999999999"], "oversized"),
        ("Fraction(_answer0) == 1", ["1e1000000000"], "oversized"),
        ("Fraction(_answer0) == Fraction(1, 4)", ["0.25"], "pass"),
        (
            "int(_answer0 * _answer0 * _answer0) > 0",
            [decimal.Decimal("1E+10000")],
            "wrong_answer",
        ),  # overflows the context
    ],
)
def test_operators_on_values_are_bounded_before_they_run(condition, values, status):
    check = code_checks.ValueCheck(condition, tuple(f"a{i}" for i in range(len(values))))
    start = time.process_time()
    assert code_checks.judge_values(check, values) == status
    assert time.process_time() - start < 0.5


def test_integer_tokens_in_stdout_compare_as_text():
    """int() of a printed token past 4300 digits raises (it crashed the judge) and is quadratic below: compared as
    text now, leading zeros and a + sign allowed."""
    long = "7" * 5000
    assert code_verifier.outputs_match(f"1 {long}", f"1.0 {long}")
    assert not code_verifier.outputs_match(f"1 {long}8", f"1.0 {long}")
    assert code_verifier.outputs_match("007 +3 -0", "7.0 3 0")
    assert not code_verifier.outputs_match("-7 1", "7 1.0")


def test_the_trainers_cpu_and_memory_over_the_worst_replies_are_small():
    """Each hostile program above scored in a fresh process: the trainer's own CPU (its thread that reads the
    sandbox's frames, decodes and judges; the sandbox's processes are not the trainer's) at most 0.5 s a response
    beyond an honest one's, and its peak RSS grown by at most 64 MB over all of them (on main: 24.7 s for E = 1e7,
    80 s for the colliding set, 1 GB for the format)."""
    script = textwrap.dedent(
        """
        import json, resource, sys, time
        from open_instruct import code_verifier
        cases = json.loads(sys.stdin.read())
        settings = code_verifier.CodeSettings(test_seconds=1.0, memory_mb=256, workers=1)
        code_verifier.score_programs(["def f():\\n    return 1\\n"], [["assert f() == 1"]], settings)  # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        report = {}
        for name, (program, test) in cases.items():
            start = time.process_time()
            (outcome,) = code_verifier.score_programs([program], [[test]], settings)
            report[name] = [outcome.statuses, time.process_time() - start]
        start = time.process_time()
        code_verifier.score_programs(["def f():\\n    return 1\\n"], [["assert f() == 1"]], settings)
        report["honest"] = [["pass"], time.process_time() - start]
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps({"cases": report, "grown_kb": grown}))
        """
    )
    cases = {name: [program, test] for name, (program, test, _) in OVER_BOUND.items()}
    out = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(report))  # the numbers for docs/sandbox.md (pytest -s)
    honest_cpu = report["cases"].pop("honest")[1]
    for name, (statuses, cpu) in report["cases"].items():
        here = code_verifier.value_equivalent(OVER_BOUND[name][1])
        assert statuses == ["oversized"] if here else statuses[0] in WHOLE_FAILURES, name
        assert cpu - honest_cpu <= 0.5, (name, cpu, honest_cpu)
    assert report["grown_kb"] <= 64 << 10
