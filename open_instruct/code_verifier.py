"""The `code` verifier: run the program in a response against its row's test cases in the sandbox (sandbox.py), and
decide every verdict here, in the trainer, from plain data the sandbox returns.

Ground truth (a Python object, or a JSON string of one), in the formats RLVR code datasets use:

    assert tests   a list of strings, each test code run after the program (open-instruct `code`, AceCoder
                   `test_cases`, MBPP `test_list`), or one string of test code: each top-level `assert` is a test
                   when every statement is one (leading imports are kept as every test's setup), else the whole string
                   is a single test; {"test_list": [...]} and {"tests": [...]} too
    stdin/stdout   a list of {"input": str, "output": str} (open-instruct `code_stdio`), {"inputs": [...],
                   "outputs": [...]} (APPS / TACO), or PrimeIntellect's {"test_cases": [{"type": "stdin_stdout",
                   "input", "output"}, ...]}; an input/output given as a list of lines is joined with newlines
    function call  the same with "fn_name" (TACO) or "type": "function_call" (PrimeIntellect): input = the JSON list
                   of arguments, output = the expected value (or [value], as APPS stores it); a method of a
                   `Solution` class (LeetCode style) is found too

A malformed ground truth (unparseable test code, no tests, lengths that differ, a test that checks nothing) raises
ValueError naming what is wrong; the trainer reports it with the row before any model loads (rewards.check_verifiers,
exit 2): a test without a check would pay any program that runs.

The program: the last fenced code block of the response (```python / ```py / ```), else the whole answer.

Where the verdict comes from (the expected values never enter the sandbox):
    stdin/stdout   the program runs as __main__ with the input; its stdout comes back and is compared here: equal after
                   dropping trailing spaces per line and trailing blank lines, or token by token with numbers within
                   1e-6 relative or absolute (the APPS/TACO/LiveCodeBench judges' leniency)
    value tests    function calls and asserts of the shapes `assert E == L` (also !=, <, <=, >, >=, in, not in, is,
                   is not, either side), `assert math.isclose(E, L, ...)`, `assert abs(E - L) < L2`, `assert E`,
                   `assert not E` (after imports and `x = <answer>` lines, if any), where L is a literal (or
                   set/frozenset/sorted/list/tuple of one) and E only the program's answer (value_check): only E is
                   evaluated in the sandbox, in a clean interpreter per test after the program's definitions, and its
                   value leaves as tagged JSON of built-in types (exact type checks: an int subclass or an object with
                   its own __eq__ is "unplain", a wrong answer); the comparison with L runs here on plain data
    script tests   any other test shape runs whole, after the program, in a clean interpreter per test; it passes when
                   the interpreter reports it ran to its end. NOT hack-proof: the program shares that interpreter
                   with the test, so it can patch what the test calls, read the test's constants and fake the report.
                   `count_test_paths` counts the tests on each path (docs/sandbox.md has the shares per dataset layout).

Scoring (per test): pass, or a failure reason: syntax_error (the program does not compile), wrong_answer (an assert
fails / the value or output differs / the value is not plain data), timeout (a test ran past its CPU or wall time),
memory (MemoryError / the address-space limit), crash (any other exception, a non-zero exit, no result), output
(printed more than the limit), no_code (an empty response). The reward is 1.0 when every test passes
(`code_reward: all`) or passed / total (`fraction`).

Cost: all tests of a response run in ONE sandbox start (script tests, if any, in a second one: their source may
hold expected values, which must not be where the judged tests' program runs; it starts only once every judged call
of the batch has ended). Inside, the sandbox's supervisor gives each test a fresh interpreter on a fresh tmpfs
(SandboxRun), under its own CPU limit summed over all its processes (test_seconds; 2 x test_seconds for a value test:
the program's definitions, then the call); every process of a test is killed before the next test starts, and what
each test printed comes back keyed by the supervisor, never by the program.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import logging
import math
import operator
import re
from typing import Any, Optional, Sequence

from open_instruct.sandbox import SandboxCall, SandboxLimits, SandboxPool, SandboxResult, SandboxRun

logger = logging.getLogger(__name__)

FAILURE_REASONS = ("syntax_error", "wrong_answer", "timeout", "memory", "crash", "output", "no_code")
TEST_STATUSES = ("pass", *FAILURE_REASONS)
# Time limits are CPU time (ITIMER_PROF per assert test, RLIMIT_CPU per stdin/stdout case), which other jobs on the
# machine do not stretch; the wall limit (for programs that sleep or block) is generous: WALL_FACTOR x the CPU
# budget + STARTUP_SECONDS for an interpreter start on a loaded machine.
STARTUP_SECONDS = 5.0
WALL_FACTOR = 2.0
_FENCE_RE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class CodeSettings:
    """How the `code` verifier runs: the config fields code_reward, code_test_seconds, code_memory_mb,
    sandbox_workers, sandbox_batch_timeout."""

    reward: str = "all"  # all | fraction
    test_seconds: float = 2.0  # per test case
    memory_mb: int = 1024
    workers: int = 2
    batch_timeout: Optional[float] = None  # seconds for a whole batch of responses (None: no batch limit)
    hide_paths: tuple[str, ...] = ()  # besides the sandbox's defaults: the run's output_dir

    def validate(self) -> None:
        if self.reward not in ("all", "fraction"):
            raise ValueError(f"code_reward must be all or fraction, got {self.reward!r}")
        if not self.test_seconds > 0:
            raise ValueError(f"code_test_seconds must be > 0, got {self.test_seconds!r}")
        if self.workers < 1:
            raise ValueError(f"sandbox_workers must be >= 1, got {self.workers!r}")
        if self.batch_timeout is not None and not self.batch_timeout > 0:
            raise ValueError(f"sandbox_batch_timeout must be > 0 (or null), got {self.batch_timeout!r}")
        SandboxLimits(memory_mb=self.memory_mb).validate()


@dataclasses.dataclass(frozen=True)
class CodeTests:
    kind: str  # assert | stdio | call
    tests: tuple  # assert: test source strings; stdio: (stdin, expected stdout); call: (args list, expected)
    fn_name: Optional[str] = None
    setup: tuple[str, ...] = ()  # assert: import lines run before every test


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """A test whose verdict is computed in the trainer: `expression` (or fn_name(*args)) is evaluated in the sandbox
    and its plain-data value checked here by `check` against `expected` (which never enters the sandbox)."""

    check: (
        str  # an operator name (eq, ne, lt, le, gt, ge, in, not_in, is, is_not), isclose, absdiff, truthy, falsy, call
    )
    expected: Any = None
    expression: Optional[str] = None
    literal_left: bool = False  # `assert L == E`: the literal is the left operand
    options: tuple = ()  # isclose keyword arguments; absdiff: (op, tolerance)
    setup: tuple[str, ...] = ()  # statements run before `expression`: imports, `x = <the program's answer>`


@dataclasses.dataclass
class CodeOutcome:
    statuses: list[str]  # one per test: "pass" or a FAILURE_REASONS entry

    @property
    def passed(self) -> int:
        return sum(s == "pass" for s in self.statuses)

    def score(self, reward: str) -> float:
        """all: 1.0 iff every test passed; fraction: passed / total."""
        total = len(self.statuses)
        if reward == "fraction":
            return self.passed / total if total else 0.0
        return 1.0 if total and self.passed == total else 0.0


# --------------------------------------------------------------------------------------------------------
# Ground truth
# --------------------------------------------------------------------------------------------------------
def _check_test_source(source: str, where: str) -> None:
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{where}: a test must be non-empty Python source, got {str(source)[:100]!r}")
    try:
        ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"{where}: test code does not parse ({e.msg}, line {e.lineno}): {source[:200]!r}") from None


def _split_asserts(source: str) -> tuple[list[str], list[str]]:
    """'import m\\nassert f(1) == 2\\nassert f(2) == 3' -> (one test per assert, the imports as setup); anything else
    (other setup lines) -> one test, no setup."""
    _check_test_source(source, "test code")
    tree = ast.parse(source)
    imports = 0
    while imports < len(tree.body) and isinstance(tree.body[imports], (ast.Import, ast.ImportFrom)):
        imports += 1
    rest = tree.body[imports:]
    if rest and all(isinstance(node, ast.Assert) for node in rest):
        segment = [ast.get_source_segment(source, node) or ast.unparse(node) for node in tree.body]
        return segment[imports:], segment[:imports]
    return [source], []


def _checks_something(tree: ast.AST) -> bool:
    """An assert with a condition that is not a constant, a raise, or a call of an assert* function (unittest)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and not _is_literal(node.test):
            return True
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name.lower().startswith("assert"):
                return True
    return False


def _assert_tests(sources: Sequence[str], setup: Sequence[str] = ()) -> CodeTests:
    for i, source in enumerate(sources):
        _check_test_source(source, f"test {i}")
        if not _checks_something(ast.parse(source)):
            raise ValueError(
                f"test {i} checks nothing (no assert on anything the program computes): {source[:200]!r}; "
                "it would reward any program that runs"
            )
    return CodeTests("assert", tuple(sources), setup=tuple(setup))


def _text(value: Any, what: str) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if isinstance(value, str):
        return value
    raise ValueError(f"{what} must be a string (or a list of lines), got {str(value)[:100]!r}")


def _io_tests(inputs: Sequence, outputs: Sequence, fn_name: Optional[str]) -> CodeTests:
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs (need the same number, at least one)")
    if fn_name:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"fn_name must be a Python identifier, got {fn_name!r}")
        cases = []
        for i, (args, expected) in enumerate(zip(inputs, outputs)):
            args = json.loads(args) if isinstance(args, str) else args
            expected = json.loads(expected) if isinstance(expected, str) else expected
            if not isinstance(args, list):
                raise ValueError(f"function-call test {i}: input must be a JSON list of arguments, got {args!r:.100}")
            cases.append((args, expected))
        return CodeTests("call", tuple(cases), fn_name)
    return CodeTests(
        "stdio",
        tuple(
            (_text(i, f"test {n} input"), _text(o, f"test {n} output")) for n, (i, o) in enumerate(zip(inputs, outputs))
        ),
    )


def _from_case_dicts(cases: list) -> CodeTests:
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"test case {i} must be a dict with input and output, got {str(case)[:100]!r}")
    fn_names = {c.get("fn_name") for c in cases if c.get("type") == "function_call" or c.get("fn_name")}
    if len(fn_names) > 1:
        raise ValueError(f"test cases name different functions: {sorted(map(str, fn_names))}")
    return _io_tests([c["input"] for c in cases], [c["output"] for c in cases], next(iter(fn_names), None))


def parse_code_tests(ground_truth: Any) -> CodeTests:
    """The test cases of one row (formats in the module docstring); ValueError if there are none or they are broken."""
    gt = ground_truth
    if isinstance(gt, str):
        stripped = gt.strip()
        if stripped[:1] in "[{":
            try:
                gt = json.loads(stripped)
            except json.JSONDecodeError:
                pass  # e.g. a test string starting with a list literal: parsed as Python below
        if isinstance(gt, str):
            return _assert_tests(*_split_asserts(gt))
    if isinstance(gt, (list, tuple)):
        if not gt:
            raise ValueError("code ground truth has no tests (empty list)")
        if all(isinstance(t, str) for t in gt):
            return _assert_tests(list(gt))
        return _from_case_dicts(list(gt))
    if isinstance(gt, dict):
        if "test_cases" in gt:
            return parse_code_tests(gt["test_cases"])
        for key in ("test_list", "tests"):
            if key in gt:
                return parse_code_tests(gt[key])
        if "inputs" in gt and "outputs" in gt:
            return _io_tests(list(gt["inputs"]), list(gt["outputs"]), gt.get("fn_name"))
        if "input" in gt and "output" in gt:
            return _from_case_dicts([gt])
        raise ValueError(
            f"code ground truth dict has none of test_cases/tests/test_list/inputs+outputs: keys {sorted(gt)}"
        )
    raise ValueError(f"code ground truth must be test code, a list of tests or a dict of them, got {type(gt).__name__}")


# --------------------------------------------------------------------------------------------------------
# The program
# --------------------------------------------------------------------------------------------------------
def extract_program(response: str) -> str:
    """The last fenced code block (```python, ```py or a bare ```; an unclosed last fence runs to the end), else
    the whole response."""
    blocks = _FENCE_RE.findall(response)
    return blocks[-1][1] if blocks else response


def outputs_match(actual: str, expected: str) -> bool:
    """Equal after trailing spaces per line and trailing blank lines are dropped, or token by token (numbers within
    1e-6 relative or absolute): contest judges' usual leniency."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    if lines(actual) == lines(expected):
        return True
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        try:
            fa, fb = float(a), float(b)
        except ValueError:
            return False
        if not math.isclose(fa, fb, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


# --------------------------------------------------------------------------------------------------------
# Value checks: which tests are judged here, from plain data
# --------------------------------------------------------------------------------------------------------
_LITERAL_WRAPPERS = {"set": set, "frozenset": frozenset, "sorted": sorted, "list": list, "tuple": tuple}
_COMPARE = {
    ast.Eq: "eq",
    ast.NotEq: "ne",
    ast.Lt: "lt",
    ast.LtE: "le",
    ast.Gt: "gt",
    ast.GtE: "ge",
    ast.In: "in",
    ast.NotIn: "not_in",
    ast.Is: "is",
    ast.IsNot: "is_not",
}
_OPERATORS = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "in": lambda a, b: a in b,
    "not_in": lambda a, b: a not in b,
    "is": operator.is_,
    "is_not": operator.is_not,
}
_NO_VALUE = object()


def _literal(node: ast.AST) -> Any:
    """The value of a literal (ast.literal_eval), or of set/frozenset/sorted/list/tuple applied to one; else
    _NO_VALUE."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _LITERAL_WRAPPERS
        and len(node.args) == 1
        and not node.keywords
    ):
        inner = _literal(node.args[0])
        return _NO_VALUE if inner is _NO_VALUE else _LITERAL_WRAPPERS[node.func.id](inner)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_VALUE


def _is_literal(node: ast.AST) -> bool:
    return _literal(node) is not _NO_VALUE


def _isclose_call(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Name) and func.id == "isclose") or (
        isinstance(func, ast.Attribute)
        and func.attr == "isclose"
        and isinstance(func.value, ast.Name)
        and func.value.id == "math"
    )


_OPERATOR_NODES = (ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp)


def _depends_on_program(node: ast.AST) -> bool:
    return any(isinstance(n, (ast.Name, ast.Call)) for n in ast.walk(node))


def _answer_only(node: ast.AST) -> bool:
    """Whether evaluating `node` in the program's interpreter yields only the program's answer: a call of a name
    (or of a method of one, `Solution().f`), a name, an attribute or a literal index of one, with arguments in which
    no operator (==, <, and, -, not...) touches anything the program computes and no dunder is named. Else a value the
    program controls could meet a literal inside the sandbox (`assert 1 < f(x) < 3`, `assert f(x) - 2 == 0`,
    `assert f(x).__eq__(2)`) and decide the verdict there."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr.startswith("__"):
            return False
        if isinstance(sub, _OPERATOR_NODES) and _depends_on_program(sub):
            return False
        if isinstance(sub, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            func = func.value.func if isinstance(func.value, ast.Call) else func.value
        return isinstance(func, ast.Name)
    if isinstance(node, ast.Subscript):
        return _answer_only(node.value) and _is_literal(node.slice)
    if isinstance(node, ast.Attribute):
        return _answer_only(node.value)
    return False


def value_check(test_source: str) -> Optional[ValueCheck]:
    """The ValueCheck of an assert test of a shape judged here (module docstring), else None (a script test)."""
    tree = ast.parse(test_source)
    if not tree.body or not isinstance(tree.body[-1], ast.Assert):
        return None
    setup = tree.body[:-1]  # imports and `name = <the program's answer>` only: no literal that could be expected
    for node in setup:
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name) or not _answer_only(node.value):
                return None
        elif not isinstance(node, (ast.Import, ast.ImportFrom)):
            return None
    found = _value_check_of(tree.body[-1].test)
    if found is None or not setup:
        return found
    return dataclasses.replace(found, setup=tuple(ast.unparse(node) for node in setup))


def _value_check_of(cond: ast.AST) -> Optional[ValueCheck]:
    """The ValueCheck of an assert's condition, or None."""

    def evaluated(node: ast.AST) -> Optional[str]:  # the part that runs in the sandbox
        return ast.unparse(node) if _answer_only(node) else None

    if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and type(cond.ops[0]) in _COMPARE:
        left, right, op = cond.left, cond.comparators[0], _COMPARE[type(cond.ops[0])]
        if (
            op in ("lt", "le")
            and isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name)
            and left.func.id == "abs"
            and len(left.args) == 1
            and isinstance(left.args[0], ast.BinOp)
            and isinstance(left.args[0].op, ast.Sub)
            and _is_literal(right)
        ):
            diff = left.args[0]
            for side, other in ((diff.left, diff.right), (diff.right, diff.left)):
                if _is_literal(other) and evaluated(side):
                    return ValueCheck("absdiff", _literal(other), evaluated(side), options=(op, _literal(right)))
        if _is_literal(right) and evaluated(left):
            return ValueCheck(op, _literal(right), evaluated(left))
        if _is_literal(left) and evaluated(right):
            return ValueCheck(op, _literal(left), evaluated(right), literal_left=True)
        return None
    if _isclose_call(cond) and len(cond.args) == 2:
        kwargs = {k.arg: _literal(k.value) for k in cond.keywords}
        if any(k not in ("rel_tol", "abs_tol") or v is _NO_VALUE for k, v in kwargs.items()):
            return None
        for side, other in ((cond.args[0], cond.args[1]), (cond.args[1], cond.args[0])):
            if _is_literal(other) and evaluated(side):
                return ValueCheck("isclose", _literal(other), evaluated(side), options=tuple(sorted(kwargs.items())))
        return None
    if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not) and evaluated(cond.operand):
        return ValueCheck("falsy", None, evaluated(cond.operand))
    if evaluated(cond):
        return ValueCheck("truthy", None, evaluated(cond))
    return None


def count_test_paths(tests: CodeTests) -> collections.Counter:
    """How many of a row's tests are judged here from plain data ("value": stdin/stdout, function calls and the
    assert shapes of value_check) and how many run whole in the sandbox ("script")."""
    if tests.kind != "assert":
        return collections.Counter(value=len(tests.tests))
    return collections.Counter("value" if value_check(t) else "script" for t in tests.tests)


def _plain(encoded: Any, depth: int = 0) -> Any:
    """The Python value of the sandbox's tagged JSON (built-in types only); ValueError if it is malformed."""
    if depth > 64 or not isinstance(encoded, list) or not encoded or not isinstance(encoded[0], str):
        raise ValueError("malformed value")
    tag, rest = encoded[0], encoded[1:]
    if tag == "n" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError("malformed value")
    (payload,) = rest
    if tag == "b" and isinstance(payload, bool):
        return payload
    if tag == "i" and isinstance(payload, str):
        return int(payload)
    if tag == "f" and isinstance(payload, str):
        return float.fromhex(payload)
    if tag == "s" and isinstance(payload, str):
        return payload
    if tag == "y" and isinstance(payload, str):
        return bytes.fromhex(payload)
    if tag in ("l", "t", "S", "F") and isinstance(payload, list):
        items = [_plain(v, depth + 1) for v in payload]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d" and isinstance(payload, list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in payload):
            raise ValueError("malformed dict")
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in payload}
    raise ValueError(f"unknown value tag {tag!r}")


def _lists(value: Any) -> Any:
    """Tuples as lists, recursively (a JSON expected value has no tuples: APPS/TACO compare that way)."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def check_value(check: ValueCheck, value: Any) -> bool:
    """The verdict of a value test on the plain value the sandbox returned (never raises: a comparison that does not
    apply, e.g. < between a str and an int, is a wrong answer)."""
    try:
        if check.check == "call":
            got = _lists(value)
            return bool(got == check.expected or [got] == check.expected)
        if check.check == "truthy":
            return bool(value)
        if check.check == "falsy":
            return not value
        if check.check == "isclose":
            kinds = (int, float)
            if type(value) not in kinds or type(check.expected) not in kinds:
                return False
            return math.isclose(value, check.expected, **dict(check.options))
        if check.check == "absdiff":
            op, tolerance = check.options
            return bool(_OPERATORS[op](abs(value - check.expected), tolerance))
        a, b = (check.expected, value) if check.literal_left else (value, check.expected)
        return bool(_OPERATORS[check.check](a, b))
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError):
        return False


# --------------------------------------------------------------------------------------------------------
# The sandbox side: one run per test (SandboxRun: a fresh interpreter started by the sandbox's supervisor, with its
# own CPU and wall limits, every process of it killed before the next), results come back per run
# --------------------------------------------------------------------------------------------------------
# One test in a clean interpreter: the program's definitions, then one expression (or the function call) whose value
# leaves as tagged JSON of built-in types. Every reference the encoder uses is taken before the program runs, and the
# encoder accepts a value only by exact type (`type(x) is int`), so a subclass or an object with its own __eq__ is
# "unplain" (a wrong answer). What the program could still do here (write its own line to the result fd) gives it
# nothing it could not return: the expected value is not in this sandbox.
PROBE = r"""
import json, os, sys
_exit, _write, _type, _len, _isinstance = os._exit, os.write, type, len, isinstance
_dumps = json.dumps
_int, _float, _str, _bytes, _bool, _list, _tuple, _dict, _set, _frozenset, _NoneType = (
    int, float, str, bytes, bool, list, tuple, dict, set, frozenset, type(None))
_int_repr, _float_hex, _bytes_hex, _dict_items = int.__repr__, float.hex, bytes.hex, dict.items
_AssertionError, _MemoryError = AssertionError, MemoryError
_out = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the program's prints do not mix with the result
test = json.load(open("plan.json", encoding="utf-8"))["runs"][int(sys.argv[1])]
class _Unplain(Exception):
    pass
def _encode(x, depth):
    if depth > 64:
        raise _Unplain("nesting deeper than 64")
    t = _type(x)
    if t is _NoneType:
        return ["n"]
    if t is _bool:
        return ["b", x is True]
    if t is _int:
        return ["i", _int_repr(x)]
    if t is _float:
        return ["f", _float_hex(x)]
    if t is _str:
        return ["s", x]
    if t is _bytes:
        return ["y", _bytes_hex(x)]
    if t is _list or t is _tuple or t is _set or t is _frozenset:
        tag = "l" if t is _list else "t" if t is _tuple else "S" if t is _set else "F"
        return [tag, [_encode(v, depth + 1) for v in x]]
    if t is _dict:
        return ["d", [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in _dict_items(x)]]
    raise _Unplain(t.__name__ if _isinstance(t.__name__, _str) else "?")
def _emit(obj):
    data = _dumps(obj).encode()
    while data:
        data = data[_write(_out, data):]
    _exit(0)
def _failed(e):
    if _isinstance(e, _AssertionError):
        _emit(["raised", "wrong_answer"])
    if _isinstance(e, _MemoryError):
        _emit(["raised", "memory"])
    _emit(["raised", "crash"])
try:
    program = compile(open("solution.py", encoding="utf-8").read(), "solution.py", "exec")
except BaseException:
    _emit(["syntax_error"])
ns = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(program, ns)
    for line in test.get("setup", ()):
        exec(compile(line, "test_setup", "exec"), ns)
    if test["kind"] == "script":
        exec(compile(test["source"], "test", "exec"), ns)
        _emit(["ran"])
    if "fn_name" in test:
        name = test["fn_name"]
        target = ns[name] if name in ns else getattr(ns["Solution"](), name)
        value = target(*test["args"])
    else:
        value = eval(compile(test["expression"], "test", "eval"), ns)
except BaseException as e:
    _failed(e)
try:
    _emit(["value", _encode(value, 0)])
except _Unplain as e:
    _emit(["unplain", str(e)])
except BaseException:
    _emit(["unplain", "?"])
"""


def _checks(tests: CodeTests) -> list[Optional[ValueCheck]]:
    """Per test: its ValueCheck (judged here) or None (stdio, or a script test)."""
    if tests.kind == "call":
        return [ValueCheck("call", expected) for _, expected in tests.tests]
    if tests.kind == "stdio":
        return [None] * len(tests.tests)
    return [value_check(t) for t in tests.tests]


def build_calls(program: str, tests: CodeTests, settings: CodeSettings) -> list[tuple[SandboxCall, list[int]]]:
    """The sandbox calls that test a program, each with the indices of the tests it runs: one call (the program, a run
    per test) for the stdio and value tests, and a second one only for script tests, whose source
    (with its expected values) must not sit in the memory the value tests' program can read. No call holds an
    expected value of a test judged here."""
    cpu = max(1, math.ceil(settings.test_seconds))
    value_cpu = max(1, math.ceil(2 * settings.test_seconds))  # the program's definitions, then the call
    groups: dict[str, tuple[list[dict], list[int]]] = {"judged": ([], []), "script": ([], [])}
    for index, (test, check) in enumerate(zip(tests.tests, _checks(tests))):
        if tests.kind == "stdio":
            run = {"kind": "stdio", "stdin": test[0], "cpu_seconds": cpu}
        else:
            run = {"kind": "value", "setup": [*tests.setup, *(check.setup if check else ())], "cpu_seconds": value_cpu}
            if tests.kind == "call":
                run.update(fn_name=tests.fn_name, args=test[0])
            elif check is not None:
                run["expression"] = check.expression
            else:
                run.update(kind="script", source=test)
        run["wall_seconds"] = STARTUP_SECONDS + WALL_FACTOR * run["cpu_seconds"]
        runs, indices = groups["script" if run["kind"] == "script" else "judged"]
        runs.append(run)
        indices.append(index)
    calls = []
    for phase, (runs, indices) in enumerate(groups.values()):  # script calls start after every judged call ended
        if not runs:
            continue
        limits = SandboxLimits(
            wall_seconds=STARTUP_SECONDS + sum(r["wall_seconds"] for r in runs), memory_mb=settings.memory_mb
        )
        plan = json.dumps({"runs": runs})
        files = {"solution.py": program, "probe.py": PROBE, "plan.json": plan}
        sandbox_runs = tuple(
            SandboxRun(
                ("solution.py",) if run["kind"] == "stdio" else ("probe.py", str(i)),
                run.get("stdin", ""),
                cpu_seconds=run["cpu_seconds"],
                wall_seconds=run["wall_seconds"],
            )
            for i, run in enumerate(runs)
        )
        calls.append((SandboxCall("", files=files, limits=limits, runs=sandbox_runs, phase=phase), indices))
    return calls


_SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
_SIGXCPU, _SIGKILL, _SIGXFSZ = 24, 9, 25


def _records(result: SandboxResult) -> dict[int, dict]:
    """Per run (its position in the call), what the sandbox's supervisor saw of it: the program cannot write these."""
    found = {}
    for i, run in enumerate(result.runs):
        if run.setup_error is None and (run.exit_code is not None or run.limit is not None):
            found[i] = {
                "exit": None if run.limit == "output" else run.exit_code,
                "timeout": run.limit in ("wall_time", "cpu_time"),
                "output": run.limit == "output",
                "stdout": run.stdout,
                "stderr": run.stderr[-4000:],
            }
    return found


def _run_failure(record: dict) -> Optional[str]:
    """The failure reason of a test's interpreter that was stopped or failed, from what the supervisor saw."""
    code, stderr = record.get("exit"), str(record.get("stderr", ""))
    if record.get("timeout") or code in (-_SIGXCPU, -_SIGKILL):
        return "timeout"
    if record.get("output") or code == -_SIGXFSZ:
        return "output"
    if code == 0:
        return None
    lines = [line for line in stderr.splitlines() if line.strip()]
    if lines and lines[-1].startswith(_SYNTAX_ERRORS):
        return "syntax_error"
    if "MemoryError" in stderr[-1000:]:
        return "memory"
    return "crash"


def _judge_value(record: dict, check: Optional[ValueCheck]) -> str:
    failure = _run_failure(record)
    if failure:
        return failure
    try:
        reply = json.loads(record.get("stdout", ""))
    except (ValueError, RecursionError):
        return "crash"  # no result: the program ended the interpreter before the test did (os._exit, exit at import)
    if not isinstance(reply, list) or not reply:
        return "crash"
    if reply == ["syntax_error"]:
        return "syntax_error"
    if reply[0] == "raised" and len(reply) == 2 and reply[1] in FAILURE_REASONS:
        return reply[1]
    if check is None:  # a script test: the interpreter's own report (the path that is not hack-proof)
        return "pass" if reply == ["ran"] else "crash"
    if reply[0] == "unplain":
        return "wrong_answer"
    if reply[0] != "value" or len(reply) != 2:
        return "crash"
    try:
        value = _plain(reply[1])
    except (ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        return "wrong_answer"
    return "pass" if check_value(check, value) else "wrong_answer"


def _limit_status(result: SandboxResult) -> str:
    return {"wall_time": "timeout", "cpu_time": "timeout", "memory": "memory", "output": "output"}.get(
        result.limit or "", "crash"
    )


def judge(tests: CodeTests, parts: Sequence[tuple[list[int], SandboxResult]]) -> CodeOutcome:
    """Per-test statuses from the results of build_calls (each with the test indices its call ran), decided here."""
    statuses: list[Optional[str]] = [None] * len(tests.tests)
    checks = _checks(tests)
    for indices, result in parts:
        records = _records(result)
        for position, i in enumerate(indices):
            record = records.get(position)
            if record is None:
                statuses[i] = _limit_status(result)
            elif tests.kind == "stdio":
                failure = _run_failure(record)
                matched = outputs_match(str(record["stdout"]), tests.tests[i][1])
                statuses[i] = failure or ("pass" if matched else "wrong_answer")
            else:
                statuses[i] = _judge_value(record, checks[i])
    return CodeOutcome([s or "crash" for s in statuses])


def score_programs(responses: Sequence[str], ground_truths: Sequence[Any], settings: CodeSettings) -> list[CodeOutcome]:
    """Test every response's program against its row's tests, `settings.workers` sandboxes at a time (one sandbox
    start per response; two when it has script tests)."""
    settings.validate()
    plans, calls = [], []
    for response, gt in zip(responses, ground_truths):
        tests = parse_code_tests(gt)
        program = extract_program(response)
        these = build_calls(program, tests, settings) if program.strip() else []
        plans.append((tests, [indices for _, indices in these], len(calls)))
        calls.extend(call for call, _ in these)
    results: list[SandboxResult] = []
    if calls:
        with SandboxPool(settings.workers, hide_paths=settings.hide_paths) as pool:
            results = pool.run(calls, batch_timeout=settings.batch_timeout)
    outcomes = []
    for tests, groups, first in plans:
        if not groups:
            outcomes.append(CodeOutcome(["no_code"] * len(tests.tests)))
        else:
            outcomes.append(judge(tests, list(zip(groups, results[first : first + len(groups)]))))
    return outcomes


def count_statuses(outcomes: Sequence[CodeOutcome]) -> collections.Counter:
    """Tests per status ("pass" and each failure reason) over a batch."""
    return collections.Counter(s for o in outcomes for s in o.statuses)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m open_instruct.code_verifier DATA.jsonl [COLUMN ...]`: the tests of a dataset file on each path
    (value: judged in the trainer; script: run whole in the sandbox), from the first column present of COLUMN
    (default: ground_truth, test_list, test_cases, input_output, tests)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(main.__doc__, file=sys.stderr)
        return 2
    path, columns = args[0], args[1:] or ["ground_truth", "test_list", "test_cases", "input_output", "tests"]
    total, rows, bad = collections.Counter(), 0, 0
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            column = next((c for c in columns if c in row), None)
            if column is None:
                print(f"{path}:{line_number}: none of the columns {columns}", file=sys.stderr)
                return 2
            try:
                total += count_test_paths(parse_code_tests(row[column]))
            except ValueError as e:
                bad += 1
                print(f"{path}:{line_number}: {e}", file=sys.stderr)
            rows += 1
    tests = sum(total.values())
    share = total["value"] / tests if tests else 0.0
    print(json.dumps({"rows": rows, "bad_rows": bad, "tests": tests, **total, "value_share": round(share, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
