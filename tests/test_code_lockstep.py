"""Issue 67, part 2: a verdict is the unmodified test's. Test code that is not a plain `assert f(<literals>) ==
<literal>` runs as stored in a test process that never loads the program, against stand-ins that call the program's
process (docs/sandbox.md#the-unmodified-tests-verdict-issue-67-part-2-lock-step-stand-ins).
The red team's shapes: each wrong program scores 0, each honest program 1 (on 65ee6f9 the helper-parameter and
non-mutation programs scored 1, and the honest programs of six shapes 0 or their rows were refused: docs/sandbox.md)."""

from __future__ import annotations

import sys

import pytest

from open_instruct import code_verifier, sandbox
from open_instruct.code_verifier import CodeSettings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
SETTINGS = CodeSettings(test_seconds=1.0, memory_mb=256, workers=2)

# (name, wrong program, its test): the wrong program passes only a transformed test
WRONG = [
    (
        "a non-mutation assert",
        "def sorted_copy(a):\n    a.sort()\n    return a\n",
        ["a = [3, 1, 2]\nassert sorted_copy(a) == [1, 2, 3]\nassert a == [3, 1, 2]"],
    ),
    (
        "a helper parameter substituted by name",
        # answers 2, 2, 91 to the three checks of the helper when each ran apart (it read which one from argv)
        "import sys\ndef find_factor(n):\n    return [2, 2, 91][int(sys.argv[1]) % 3] if len(sys.argv) > 1 else 2\n",
        [
            "def check_factor(n, d):\n    assert d > 1\n    assert d < n\n    assert n % d == 0\n"
            "check_factor(91, find_factor(91))"
        ],
    ),
    (
        "a raises test when the import raises",
        "raise ValueError('at import')\ndef parse(x):\n    return int(x)\n",
        ["try:\n    parse('x')\nexcept ValueError:\n    pass\nelse:\n    assert False"],
    ),
    (
        "a raises test when a setup line raises",
        "def parse(x):\n    raise ValueError(x)\n",
        ["n = parse('1')\ntry:\n    parse('x')\nexcept ValueError:\n    pass\nelse:\n    assert False"],
    ),
    (
        "a stale global inside a called helper",
        "def square(x):\n    return (x + 1) ** 2\n",  # right only for the value N had when check was defined
        ["N = 5\ndef check(candidate):\n    assert candidate(N) == 36\nN = 6\ncheck(square)"],
    ),
    (
        "HumanEval+'s shape-strict assert_allclose (a length-1 answer broadcast)",
        "def halves(xs):\n    return [xs[0] / 2]\n",
        {
            "test": "import math\n\ndef assertion(out, exp, atol):\n    assert len(out) == len(exp)\n"
            "    assert all(math.isclose(o, e, abs_tol=atol) for o, e in zip(out, exp))\n\n"
            "def check(candidate):\n    assertion(candidate([1.0, 1.0]), [0.5, 0.5], 1e-6)\n",
            "entry_point": "halves",
        },
    ),
    (
        "an always-equal object the test does not name",
        "class Yes:\n    def __eq__(self, other):\n        return True\n"
        "    def startswith(self, *a):\n        return True\n"
        "def f(x):\n    return Yes()\n",
        ["x = f(1)\nassert x == 5 and x.startswith('ab')"],
    ),
    (
        "a program that rebinds a builtin the test uses",
        "isinstance = lambda *a: True\nlen = lambda x: 3\ndef to_list(s):\n    return s\n",
        ["out = to_list('abcd')\nassert isinstance(out, list) and len(out) == 4"],
    ),
    ("a program that names os._exit as its function", "import os\nsolve = os._exit\n", ["assert solve(0) == 1"]),
]

# (name, honest program, its test)
HONEST = [
    (
        "state across asserts",
        "class Counter:\n    def __init__(self):\n        self.n = 0\n    def inc(self):\n        self.n += 1\n"
        "        return self.n\n",
        ["c = Counter()\nassert c.inc() == 1\nassert c.inc() == 2\nassert c.n == 2"],
    ),
    ("eager `or`", "def f(x):\n    return x > 1\n", ["assert f(0) or f(2)"]),
    ("`is` identity", "def first(a):\n    return a[0] if a else None\n", ["a = [[1]]\nassert first(a) is a[0]"]),
    ("`is None`", "def f(x):\n    return None\n", ["assert f(1) is None"]),
    (
        "a program-defined class in isinstance",
        "class Node:\n    def __init__(self, v):\n        self.v = v\ndef make(v):\n    return Node(v)\n",
        ["n = make(3)\nassert isinstance(n, Node) and n.v == 3"],
    ),
    (
        "Match.span() and .group(1)",
        "import re\ndef find(s):\n    return re.search(r'a(b+)', s)\n",
        ["m = find('xabbc')\nassert m.span() == (1, 4) and m.group(1) == 'bb'"],
    ),
    (
        "isclose on a Fraction",
        "from fractions import Fraction\ndef third():\n    return Fraction(1, 3)\n",
        ["import math\nassert math.isclose(third(), 1 / 3)"],
    ),
    ("isclose on a bool", "def one():\n    return True\n", ["import math\nassert math.isclose(one(), 1)"]),
    (
        "a mutation the test checks",
        "def push(stack, x):\n    stack.append(x)\n",
        ["s = [1]\npush(s, 2)\nassert s == [1, 2]"],
    ),
    (
        "the program's own exception class",
        "class Invalid(ValueError):\n    pass\ndef parse(x):\n    raise Invalid(x)\n",
        [
            "try:\n    parse('x')\nexcept Invalid:\n    pass\nelse:\n    assert False",
            "import pytest\nwith pytest.raises(ValueError):\n    parse('y')",
        ],
    ),
    (
        "a generator iterated",
        "def squares(n):\n    return (i * i for i in range(n))\n",
        ["assert list(squares(3)) == [0, 1, 4]"],
    ),
    (
        "a program global read after a call",
        "count = 0\ndef bump():\n    global count\n    count += 1\n",
        ["bump()\nbump()\nassert count == 2"],
    ),
    (
        "HumanEval+ as stored (assertion() inside check, entry_point)",
        "def halves(xs):\n    return [x / 2 for x in xs]\n",
        {
            "test": "import math\n\ndef assertion(out, exp, atol):\n    assert len(out) == len(exp)\n"
            "    assert all(math.isclose(o, e, abs_tol=atol) for o, e in zip(out, exp))\n\n"
            "def check(candidate):\n    inputs = [[[1.0, 3.0]], [[2.0]]]\n    results = [[0.5, 1.5], [1.0]]\n"
            "    for inp, exp in zip(inputs, results):\n        assertion(candidate(*inp), exp, 1e-6)\n",
            "entry_point": "halves",
        },
    ),
]


@pytest.fixture(scope="module")
def scores():
    rows = WRONG + HONEST
    outcomes = code_verifier.score_programs(
        [f"```python\n{p}\n```" for _, p, _ in rows], [t for *_, t in rows], SETTINGS
    )
    return {name: outcome for (name, _, _), outcome in zip(rows, outcomes)}


@pytest.mark.parametrize("name", [w[0] for w in WRONG])
def test_a_wrong_program_fails_the_unmodified_test(scores, name):
    assert scores[name].score("all") == 0.0, scores[name].statuses


@pytest.mark.parametrize("name", [h[0] for h in HONEST])
def test_an_honest_program_passes_the_unmodified_test(scores, name):
    assert scores[name].score("all") == 1.0, scores[name].statuses


def test_a_whole_test_runs_in_every_isolation_mode():
    """The pair run (the sealed source on the supervisor's stdin, two forks, the pipe pair) without namespaces too:
    the rlimits fallback gives the same verdicts."""
    check = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"}
    truth = {**check, "entry_point": "add"}
    programs = ["def add(a, b):\n    return a + b\n", "def add(a, b):\n    return 3\n"]
    try:
        sandbox.force_isolation("rlimits")
        right, wrong = code_verifier.score_programs(programs, [truth, truth], SETTINGS)
    finally:
        sandbox.force_isolation(None)
    assert right.statuses == ["pass"] and wrong.statuses == ["wrong_answer"]
