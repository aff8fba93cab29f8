"""The `code` verifier: run the program in a response against its row's test cases in the sandbox (sandbox.py), and
decide every verdict here, in the trainer, from plain data the sandbox returns.

Ground truth (a Python object, or a JSON string of one), in the formats RLVR code datasets use:

    assert tests   a list of strings, each test code run after the program (open-instruct `code`, AceCoder
                   `test_cases`, MBPP `test_list`), or one string of test code; {"test_list": [...], "test_imports":
                   [...]} (MBPP), {"tests": [...]}, {"test": code, "entry_point": name} (HumanEval's check(candidate),
                   EvalPlus's assertion() harness, pytest-style test_* functions); each is expanded into one test per
                   assert (code_checks.expand), or kept whole as a script test
    stdin/stdout   a list of {"input": str, "output": str} (open-instruct `code_stdio`), {"inputs": [...],
                   "outputs": [...]} (APPS / TACO), or PrimeIntellect's {"test_cases": [{"type": "stdin_stdout",
                   "input", "output"}, ...]}; an input/output given as a list of lines is joined with newlines
    function call  the same with "fn_name" (TACO) or "type": "function_call" (PrimeIntellect): input = the JSON list
                   of arguments, output = the expected value (or [value], as APPS stores it); a method of a
                   `Solution` class (LeetCode style) is found too

A malformed ground truth (unparseable test code, no tests, lengths that differ, a test that checks nothing, a check
function nothing calls without an entry_point) raises ValueError naming what is wrong, and so do a row with more tests
than settings.max_tests and one with script tests the run does not allow (check_limits); the trainer reports it with
the row before any model loads (rewards.check_verifiers, exit 2): a test without a check would pay any program.

The program: the last fenced code block of the response (```python / ```py / ```), else the whole answer.

Where the verdict comes from (the expected values never enter the sandbox):
    stdin/stdout   the program runs as __main__ with the input; its stdout comes back and is compared here: equal after
                   dropping trailing spaces per line and trailing blank lines, or token by token with expected decimal
                   numbers met within 1e-6 relative or absolute (the APPS/TACO/LiveCodeBench judges' leniency) and
                   expected integers exactly
    value tests    function calls, and every assert of test code that code_checks can split into the program's
                   answers (evaluated in the sandbox, in a clean interpreter per test after the program's
                   definitions; their values leave as tagged JSON of built-in and standard-library types, by exact
                   type: a subclass or an object with its own __eq__ is "unplain", a wrong answer) and the rest (the
                   comparison, predicates, tolerances, literals), evaluated here on the decoded values; raises tests
                   pass when the answer raised the named built-in exception
    whole tests    every other piece of test code (value_equivalent is false: HumanEval check(candidate), harnesses,
                   several asserts, helpers, raises tests) runs unmodified in a sandboxed process that never loads
                   the program, against stand-ins that call the program's own process (lockstep_harness.py,
                   lockstep_program.py); the verdict is that process's exit status, read by the sandbox's supervisor
    script tests   (no test code takes this path since whole tests; kept for code_allow_script_tests until it goes)
                   test code the value path cannot judge runs whole, after the program, in a clean interpreter per
                   test (only with allow_script_tests); it passes when the interpreter reports it ran to its end. NOT
                   hack-proof: the program shares that interpreter with the test, so it can patch what the test
                   calls, read the test's constants and fake the report. `count_test_paths` counts the tests on each
                   path (docs/sandbox.md has the shares per dataset).

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
import functools
import json
import logging
import math
import os
import re
from typing import Any, Optional, Sequence

from open_instruct.code_checks import MAX_REPLY_CHARS, OverBound, ValueCheck, decode_value, expand, judge_values
from open_instruct.sandbox import SandboxCall, SandboxLimits, SandboxPool, SandboxResult, SandboxRun

logger = logging.getLogger(__name__)

# oversized: a reply over one of code_checks' bounds (size, nesting, integer bits, a Fraction's or Decimal's digits or
# exponent, colliding set members), or an operation of the test that would build a huge value from it: a wrong answer,
# counted apart
FAILURE_REASONS = ("syntax_error", "wrong_answer", "timeout", "memory", "crash", "output", "no_code", "oversized")
TEST_STATUSES = ("pass", *FAILURE_REASONS)
# Time limits are CPU time (ITIMER_PROF per assert test, RLIMIT_CPU per stdin/stdout case), which other jobs on the
# machine do not stretch; the wall limit (for programs that sleep or block) is generous: WALL_FACTOR x the CPU
# budget + STARTUP_SECONDS for an interpreter start on a loaded machine.
STARTUP_SECONDS = 5.0
WALL_FACTOR = 2.0
_FENCE_RE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


MAX_TEST_SECONDS = 60.0  # code_test_seconds' upper end: a row's tests run one after another in one sandbox call
MAX_RESPONSE_OUTPUT_BYTES = 16 << 20  # what the trainer keeps of one response's tests' stdout and stderr in all


@dataclasses.dataclass(frozen=True)
class CodeSettings:
    """How the `code` verifier runs: the config fields code_reward, code_test_seconds, code_memory_mb,
    code_max_tests, code_allow_script_tests, sandbox_workers, sandbox_batch_timeout."""

    reward: str = "all"  # all | fraction
    test_seconds: float = 2.0  # per test case, in (0, MAX_TEST_SECONDS]
    memory_mb: int = 1024
    workers: int = 2
    batch_timeout: Optional[float] = 600.0  # seconds for a whole batch of responses (None: no batch limit)
    hide_paths: tuple[str, ...] = ()  # besides the sandbox's defaults: the run's output_dir
    max_tests: int = 1024  # tests per row (a row with more is bad ground truth)
    allow_script_tests: bool = False  # run tests the value path cannot judge (NOT hack-proof: docs/sandbox.md)

    def validate(self) -> None:
        if self.reward not in ("all", "fraction"):
            raise ValueError(f"code_reward must be all or fraction, got {self.reward!r}")
        if not 0 < self.test_seconds <= MAX_TEST_SECONDS:
            raise ValueError(f"code_test_seconds must be > 0 and <= {MAX_TEST_SECONDS:g}, got {self.test_seconds!r}")
        if self.workers < 1:
            raise ValueError(f"sandbox_workers must be >= 1, got {self.workers!r}")
        if self.batch_timeout is not None and not self.batch_timeout > 0:
            raise ValueError(f"sandbox_batch_timeout must be > 0 (or null), got {self.batch_timeout!r}")
        if self.max_tests < 1:
            raise ValueError(f"code_max_tests must be >= 1, got {self.max_tests!r}")
        SandboxLimits(memory_mb=self.memory_mb).validate()


@dataclasses.dataclass(frozen=True)
class WholeTest:
    """A test run unmodified in lock-step (docs/sandbox.md): `source` is the stored test code, plus `check(<entry
    point>)` where the row names an entry point its `check` is never called with (HumanEval's harness)."""

    source: str
    checks: int = 1  # how many checks it holds (what its CPU limit is scaled by: build_calls)


@dataclasses.dataclass(frozen=True)
class CodeTests:
    kind: str  # assert | stdio | call
    tests: tuple  # assert: each test's source (a script test: the code run whole); stdio: (stdin, expected stdout);
    # call: (args list, expected)
    fn_name: Optional[str] = None
    checks: tuple = ()  # assert: per test its ValueCheck (judged here), its WholeTest (run unmodified in lock-step),
    # or None (a script test)

    @property
    def scripts(self) -> int:
        return sum(c is None for c in self.checks) if self.kind == "assert" else 0


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


def _display(check: ValueCheck) -> str:
    """A check as the test it stands for: `assert f(1) == 2`, `f(-1) raises ValueError` (after its setup lines)."""
    if check.raises:
        shown = f"{check.answers[0]} raises {' or '.join(check.raises)}"
    else:
        shown = "assert " + re.sub(r"\b_answer(\d+)\b", lambda m: check.answers[int(m.group(1))], check.condition)
    return "\n".join((*check.setup, shown))


_CHECK_CALLS = ("raises", "assertRaises", "assertRaisesRegex")


def _has_check(node: ast.AST) -> bool:
    """An assert, a raise or a `raises`/`assertRaises` call anywhere in `node`."""
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assert, ast.Raise)):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, (ast.Attribute, ast.Name)):
            if (sub.func.attr if isinstance(sub.func, ast.Attribute) else sub.func.id) in _CHECK_CALLS:
                return True
    return False


def _reachable_checks(tree: ast.Module) -> bool:
    """Whether the test code checks something when it runs: a check (_has_check) at module level or in a function
    that module-level code calls (directly or through functions it calls)."""

    def called(nodes: Sequence[ast.AST]) -> set:
        return {
            sub.func.id
            for node in nodes
            for sub in ast.walk(node)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)
        }

    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    top = [n for n in tree.body if n.__class__ not in (ast.FunctionDef, ast.AsyncFunctionDef)]
    if any(_has_check(n) for n in top if not isinstance(n, ast.ClassDef)):
        return True
    reached, todo = set(), called(top)
    while todo:
        name = todo.pop()
        if name in functions and name not in reached:
            reached.add(name)
            todo |= called(functions[name].body)
    return any(_has_check(functions[name]) for name in reached)


def whole_test(source: str, entry_point: Optional[str] = None) -> WholeTest:
    """The test code as a lock-step test: unmodified, with the calls a harness makes appended where its module-level
    code makes none (as code_checks.expand reads them): `test_*()` functions (pytest), and a one-parameter function
    with checks called with the row's entry point (HumanEval's `check(candidate)`, HumanEval+'s); ValueError when it
    checks nothing a run would reach."""
    tree = ast.parse(source)
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    top_calls = {
        s.func.id for n in top for s in ast.walk(n) if isinstance(s, ast.Call) and isinstance(s.func, ast.Name)
    }
    checking = {f.name for f in functions if _has_check(f)}  # functions that check, directly or through a call
    while True:
        more = {
            f.name
            for f in functions
            if f.name not in checking
            and any(isinstance(c, ast.Call) and getattr(c.func, "id", None) in checking for c in ast.walk(f))
        }
        if not more:
            break
        checking |= more
    implicit = []
    for function in functions:
        if function.name in top_calls:
            continue
        params = function.args.args
        if function.name.startswith("test") and not params:
            implicit.append(f"{function.name}()")
        elif entry_point and len(params) == 1 and function.name in checking:
            implicit.append(f"{function.name}({entry_point})")
    if implicit:
        source = source.rstrip() + "\n\n\n" + "\n".join(implicit) + "\n"
        tree = ast.parse(source)
    if not _reachable_checks(tree):
        raise ValueError("the test code checks nothing when it runs (no assert, raise or assertRaises it reaches)")
    return WholeTest(source)


def _longest_literal_list(source: str) -> int:
    """The length of the longest list or tuple display in `source` (a harness's `inputs = [...]`): how many checks
    a loop over it makes, where code_checks.expand could not count them (at least 1)."""
    return max([1, *(len(n.elts) for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.List, ast.Tuple)))])


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def value_equivalent(source: str) -> bool:
    """Whether judging `source` on the value path is the unmodified test's verdict: imports, then one `assert
    f(<literals>) == <literal>` (either side) of a name the test does not bind. The call's arguments are fresh
    literals (no mutation or identity the test could see afterwards), the comparison is `==` on the returned value
    (a value that is not plain data is a wrong answer on both paths: a program's object is never equal to the test's
    data), nothing else runs. Everything else runs whole, in lock-step."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    *imports, last = tree.body or [None]
    if not all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in imports) or not isinstance(last, ast.Assert):
        return False
    if last.msg is not None and not isinstance(last.msg, ast.Constant):
        return False
    test = last.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    bound = {(a.asname or a.name).split(".")[0] for n in imports for a in n.names}
    sides = [test.left, test.comparators[0]]
    for call, other in (sides, sides[::-1]):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id not in bound
            and all(not isinstance(a, ast.Starred) and _literal(a) for a in call.args)
            and all(k.arg is not None and _literal(k.value) for k in call.keywords)
            and _literal(other)
        ):
            return True
    return False


def _assert_tests(sources: Sequence[str], entry_point: Optional[str] = None, numbered: bool = True) -> CodeTests:
    """Each piece of test code: judged here when that is provably its own verdict (value_equivalent), else run
    unmodified in lock-step (WholeTest). Test code expand() refuses as checking nothing is bad ground truth."""
    if entry_point is not None and (not isinstance(entry_point, str) or not entry_point.isidentifier()):
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    tests, checks = [], []
    for i, source in enumerate(sources):
        where = f"test {i}" if numbered else "test code"
        _check_test_source(source, where)
        refused = None
        try:
            found, script = expand(source, entry_point)
        except ValueError as e:
            if "checks nothing" in str(e):
                raise ValueError(f"{where}: {e}") from None
            found, script, refused = [], None, e  # a helper nothing calls: the whole test's run decides, if it runs one
        if script is None and len(found) == 1 and value_equivalent(source):
            tests.append(_display(found[0]))
            checks.append(found[0])
            continue
        try:
            whole = whole_test(source, entry_point)
        except ValueError as e:
            raise ValueError(f"{where}: {refused or e}") from None
        whole = dataclasses.replace(whole, checks=max(len(found), _longest_literal_list(whole.source)))
        tests.append(whole.source)
        checks.append(whole)
    return CodeTests("assert", tuple(tests), checks=tuple(checks))


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


def parse_code_tests(ground_truth: Any, entry_point: Optional[str] = None) -> CodeTests:
    """The test cases of one row (formats in the module docstring); ValueError if there are none or they are broken.
    `entry_point`: the function a `check(candidate)` the test code never calls is called with."""
    gt = ground_truth
    if isinstance(gt, str):
        stripped = gt.strip()
        if stripped[:1] in "[{":
            try:
                gt = json.loads(stripped)
            except json.JSONDecodeError:
                pass  # e.g. a test string starting with a list literal: parsed as Python below
        if isinstance(gt, str):
            return _assert_tests([gt], entry_point, numbered=False)
    if isinstance(gt, (list, tuple)):
        if not gt:
            raise ValueError("code ground truth has no tests (empty list)")
        if all(isinstance(t, str) for t in gt):
            return _assert_tests(list(gt), entry_point)
        return _from_case_dicts(list(gt))
    if isinstance(gt, dict):
        entry_point = gt.get("entry_point", entry_point)
        if "test_cases" in gt:
            return parse_code_tests(gt["test_cases"], entry_point)
        for key in ("test_list", "tests", "test"):
            if key in gt:
                imports = gt.get("test_imports") or []
                if imports and not (isinstance(imports, list) and all(isinstance(i, str) for i in imports)):
                    raise ValueError(f"test_imports must be a list of import lines, got {str(imports)[:100]!r}")
                tests = gt[key]
                if imports and isinstance(tests, list) and all(isinstance(t, str) for t in tests):
                    tests = ["\n".join([*imports, t]) for t in tests]  # MBPP's test_imports: every test's setup
                return parse_code_tests(tests, entry_point)
        if "inputs" in gt and "outputs" in gt:
            return _io_tests(list(gt["inputs"]), list(gt["outputs"]), gt.get("fn_name"))
        if "input" in gt and "output" in gt:
            return _from_case_dicts([gt])
        raise ValueError(
            f"code ground truth dict has none of test_cases/tests/test_list/test/inputs+outputs: keys {sorted(gt)}"
        )
    raise ValueError(f"code ground truth must be test code, a list of tests or a dict of them, got {type(gt).__name__}")


@functools.lru_cache(maxsize=256)
def _parse_key(key: str, is_text: bool) -> CodeTests:
    return parse_code_tests(key if is_text else json.loads(key))


def parse_cached(ground_truth: Any) -> CodeTests:
    """parse_code_tests, remembered for the last 256 rows: a group's completions (and the check before scoring) share
    their row's tests, and expanding a harness of hundreds of asserts takes tens of milliseconds."""
    if isinstance(ground_truth, str):
        return _parse_key(ground_truth, True)
    return _parse_key(json.dumps(ground_truth, sort_keys=True, default=str), False)


def check_limits(tests: CodeTests, settings: "CodeSettings") -> None:
    """ValueError when a row has more tests than settings.max_tests, or script tests the run does not allow."""
    if len(tests.tests) > settings.max_tests:
        raise ValueError(
            f"{len(tests.tests)} tests, more than code_max_tests {settings.max_tests} (raise it, or split the row)"
        )
    if tests.scripts and not settings.allow_script_tests:
        first = next(t for t, c in zip(tests.tests, tests.checks) if c is None)
        raise ValueError(
            f"{tests.scripts} test(s) can only run as a script, which a program can fake (e.g. {first[:160]!r}); "
            "rewrite them as asserts on the program's answers, or set code_allow_script_tests: true "
            "(docs/sandbox.md says what that risks)"
        )


def value_check(test_source: str) -> Optional[ValueCheck]:
    """The ValueCheck of a test of one check judged here (code_checks), else None (a script test)."""
    found, script = expand(test_source)
    return found[0] if script is None and len(found) == 1 else None


def count_test_paths(tests: CodeTests) -> collections.Counter:
    """How many of a row's tests are judged here from plain data ("value": stdin/stdout, function calls and the
    checks of code_checks) and how many run whole in the sandbox ("script")."""
    if tests.kind != "assert":
        return collections.Counter(value=len(tests.tests))
    return collections.Counter(
        "script" if c is None else "whole" if isinstance(c, WholeTest) else "value" for c in tests.checks
    )


# --------------------------------------------------------------------------------------------------------
# The program
# --------------------------------------------------------------------------------------------------------
def extract_program(response: str) -> str:
    """The last fenced code block (```python, ```py or a bare ```; an unclosed last fence runs to the end), else
    the whole response."""
    blocks = _FENCE_RE.findall(response)
    return blocks[-1][1] if blocks else response


_INTEGER_RE = re.compile(r"[+-]?\d+")
_DECIMAL_RE = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def _integer_text(token: str) -> tuple[bool, str]:
    """An integer token as (negative, digits without leading zeros): compared as text, never converted (int() of a
    printed 10**6-digit token is quadratic, and past 4300 digits it raises)."""
    digits = token.lstrip("+-").lstrip("0") or "0"
    return token.startswith("-") and digits != "0", digits


def outputs_match(actual: str, expected: str) -> bool:
    """Equal after trailing spaces per line and trailing blank lines are dropped, or token by token where an expected
    decimal number (1.5, 2e-3) may be met within 1e-6 relative or absolute (contest judges' usual leniency); an
    expected integer only by the same integer."""

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
        if _INTEGER_RE.fullmatch(b):
            if not (_INTEGER_RE.fullmatch(a) and _integer_text(a) == _integer_text(b)):
                return False
        elif not (_DECIMAL_RE.fullmatch(a) and _DECIMAL_RE.fullmatch(b)):
            return False
        elif not math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


# --------------------------------------------------------------------------------------------------------
# The sandbox side: one run per test (SandboxRun: a fresh interpreter started by the sandbox's supervisor, with its
# own CPU and wall limits, every process of it killed before the next), results come back per run
# --------------------------------------------------------------------------------------------------------
# One test in a clean interpreter: the program's definitions, then the test's answers (expressions, or the function
# call) whose values leave as tagged JSON of built-in and standard library types. Every reference the encoder uses is
# taken before the program runs, and the encoder accepts a value only by exact type (`type(x) is int`), so a subclass
# or an object with its own __eq__ is "unplain" (a wrong answer). An exception leaves as the names of the built-in
# exception classes it is an instance of (for raises tests). What the program could still do here (write its own
# reply to stdout) gives it nothing it could not return: the expected value is not in this sandbox.
PROBE = r"""
import builtins, collections, json, os, re, sys
_exit, _write, _type, _len, _isinstance, _id = os._exit, os.write, type, len, isinstance, id
_dumps = json.dumps
_int, _float, _complex, _str, _bytes, _bool, _list, _tuple, _dict, _set, _frozenset, _NoneType = (
    int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset, type(None))
_Counter, _OrderedDict, _defaultdict, _deque = (
    collections.Counter, collections.OrderedDict, collections.defaultdict, collections.deque)
_Match, _modules, _getattr = re.Match, sys.modules, getattr
_int_format, _float_hex, _bytes_hex, _dict_items, _od_items = (
    int.__format__, float.hex, bytes.hex, dict.items, collections.OrderedDict.items)
_str_of, _match_group, _match_span = str, re.Match.group, re.Match.span
_mro = type.__dict__["__mro__"].__get__
_exceptions = {_id(c): c.__name__ for c in vars(builtins).values()
               if _isinstance(c, type) and issubclass(c, BaseException)}
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
        return ["i", _int_format(x, "x")]
    if t is _float:
        return ["f", _float_hex(x)]
    if t is _complex:
        return ["c", [_float_hex(x.real), _float_hex(x.imag)]]
    if t is _str:
        return ["s", x]
    if t is _bytes:
        return ["y", _bytes_hex(x)]
    for module, name, tag in (("fractions", "Fraction", "Q"), ("decimal", "Decimal", "D")):
        # (looked up now, not imported per test: a value can only be one if the program imported the module; a
        # module it planted under that name only decides how its own value is written, decoded as a real one)
        if t is _getattr(_modules.get(module), name, None):
            text = _str_of(x)
            if _type(text) is not _str:
                raise _Unplain(name)
            return [tag, text]
    if t is _Match:
        text, span = _match_group(x, 0), _match_span(x)
        if _type(text) is not _str:
            raise _Unplain("bytes match")
        return ["M", [text, span[0], span[1]]]
    if t is _list or t is _tuple or t is _set or t is _frozenset or t is _deque:
        tag = "l" if t is _list else "t" if t is _tuple else "S" if t is _set else "F" if t is _frozenset else "q"
        return [tag, [_encode(v, depth + 1) for v in (x if t is not _deque else _list(x))]]
    if t is _dict or t is _Counter or t is _defaultdict or t is _OrderedDict:
        tag = "d" if t is _dict else "C" if t is _Counter else "E" if t is _defaultdict else "O"
        items = _od_items(x) if t is _OrderedDict else _dict_items(x)
        return [tag, [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in items]]
    raise _Unplain(t.__name__ if _isinstance(t.__name__, _str) else "?")
def _emit(obj):
    data = _dumps(obj).encode()
    while data:
        data = data[_write(_out, data):]
    _exit(0)
def _failed(e, where):
    names = [_exceptions[_id(c)] for c in _mro(_type(e)) if _id(c) in _exceptions]
    kind = "wrong_answer" if _isinstance(e, _AssertionError) else "memory" if _isinstance(e, _MemoryError) else "crash"
    _emit(["raised", kind, names, where])
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
except BaseException as e:
    _failed(e, "setup")  # the program, the test's imports or its setup lines: never what a raises test asks for
try:
    if "fn_name" in test:
        name = test["fn_name"]
        target = ns[name] if name in ns else getattr(ns["Solution"](), name)
        values = [target(*test["args"])]
    else:
        values = [eval(compile(answer, "test", "eval"), ns) for answer in test["answers"]]
except BaseException as e:
    _failed(e, "answer")
try:
    _emit(["values", [_encode(value, 0) for value in values]])
except _Unplain as e:
    _emit(["unplain", str(e)])
except BaseException:
    _emit(["unplain", "?"])
"""


def _source_of(name: str) -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as f:
        return f.read()


# P and T of a whole test (standard library only, written into the sandbox as files of the call)
LOCKSTEP_FILES = {name: _source_of(name) for name in ("lockstep_program.py", "lockstep_harness.py")}


def _checks(tests: CodeTests) -> list[Optional[ValueCheck]]:
    """Per test: its ValueCheck (judged here) or None (stdio, or a script test)."""
    if tests.kind == "call":
        return [ValueCheck(expected=expected, call=True) for _, expected in tests.tests]
    if tests.kind == "stdio":
        return [None] * len(tests.tests)
    return list(tests.checks)


def build_calls(program: str, tests: CodeTests, settings: CodeSettings) -> list[tuple[SandboxCall, list[int]]]:
    """The sandbox calls that test a program, each with the indices of the tests it runs: one call (the program, a run
    per test) for the stdio, value and whole tests, and a second one only for script tests, whose source (with its
    expected values) must not sit in the memory the value tests' program can read. A whole test's source travels
    sealed (run_in_sandbox's `sealed`): only its test process reads it, never the supervisor that forks the
    programs."""
    cpu = max(1, math.ceil(settings.test_seconds))
    value_cpu = max(1, math.ceil(2 * settings.test_seconds))  # the program's definitions, then the call
    groups: dict[str, tuple[list[dict], list[int], list[str]]] = {"judged": ([], [], []), "script": ([], [], [])}
    for index, (test, check) in enumerate(zip(tests.tests, _checks(tests))):
        if tests.kind == "stdio":
            run = {"kind": "stdio", "stdin": test[0], "cpu_seconds": cpu}
        elif isinstance(check, WholeTest):
            # the CPU the value path gave its checks together (each: the definitions, then the call), at most 60 s
            run = {"kind": "whole", "cpu_seconds": min(MAX_TEST_SECONDS, value_cpu * check.checks)}
        else:
            run = {"kind": "value", "setup": list(check.setup) if check else [], "cpu_seconds": value_cpu}
            if tests.kind == "call":
                run.update(fn_name=tests.fn_name, args=test[0])
            elif check is not None:
                run["answers"] = list(check.answers)
            else:
                run.update(kind="script", source=test)
        run["wall_seconds"] = STARTUP_SECONDS + WALL_FACTOR * run["cpu_seconds"]
        runs, indices, sealed = groups["script" if run["kind"] == "script" else "judged"]
        runs.append(run)
        indices.append(index)
        if isinstance(check, WholeTest):
            sealed.append(check.source)
    calls = []
    for phase, (runs, indices, sealed) in enumerate(groups.values()):  # script calls start after every judged call
        if not runs:
            continue
        limits = SandboxLimits(
            wall_seconds=STARTUP_SECONDS + sum(r["wall_seconds"] for r in runs),
            memory_mb=settings.memory_mb,
            # every test's stdout and stderr together (its share of the response's): all the trainer holds of them
            max_total_output_bytes=MAX_RESPONSE_OUTPUT_BYTES * len(runs) // len(tests.tests),
        )
        plan = json.dumps({"runs": [r for r in runs if r["kind"] != "whole"]})
        files = {"solution.py": program, "probe.py": PROBE, "plan.json": plan}
        if sealed:
            files.update(LOCKSTEP_FILES)
        sandbox_runs, value_index = [], 0
        for run in runs:
            if run["kind"] == "whole":
                argv, runner = ("lockstep_program.py",), "lockstep_harness.py"
            else:
                argv = ("solution.py",) if run["kind"] == "stdio" else ("probe.py", str(value_index))
                runner, value_index = None, value_index + 1
            sandbox_runs.append(
                SandboxRun(
                    argv,
                    run.get("stdin", ""),
                    cpu_seconds=run["cpu_seconds"],
                    wall_seconds=run["wall_seconds"],
                    test_runner=runner,
                )
            )
        call = SandboxCall("", files=files, limits=limits, runs=tuple(sandbox_runs), phase=phase, sealed=tuple(sealed))
        calls.append((call, indices))
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


# a whole test's exit status (lockstep_harness.py): 0 the test ran to its end
_WHOLE_EXITS = {0: "pass", 1: "wrong_answer", 3: "memory", 4: "syntax_error"}


def _judge_whole(record: dict) -> str:
    """A whole test's verdict: its test process's exit status as the supervisor saw it (or the limit that ended the
    run). Nothing the program or the test printed is read."""
    if record.get("timeout"):
        return "timeout"
    if record.get("output"):
        return "output"
    return _WHOLE_EXITS.get(record.get("exit"), "crash")


def _judge_value(record: dict, check: Optional[ValueCheck]) -> str:
    failure = _run_failure(record)
    if failure:
        return failure
    if len(record["stdout"]) > MAX_REPLY_CHARS:
        return "oversized"
    try:
        reply = json.loads(record["stdout"])
    except RecursionError:
        return "oversized"  # nested deeper than the parser goes (the C parser stops itself, in linear time)
    except ValueError:
        return "crash"  # no result: the program ended the interpreter before the test did (os._exit, exit at import)
    if not isinstance(reply, list) or not reply:
        return "crash"
    if reply == ["syntax_error"]:
        return "syntax_error"
    if reply[0] == "raised" and len(reply) == 4 and reply[1] in FAILURE_REASONS and isinstance(reply[2], list):
        if check is not None and check.raises and reply[3] == "answer":  # (not the program's import or the setup)
            return "pass" if set(check.raises) & {n for n in reply[2] if isinstance(n, str)} else "wrong_answer"
        return reply[1]
    if check is None:  # a script test: the interpreter's own report (the path that is not hack-proof)
        return "pass" if reply == ["ran"] else "crash"
    if reply[0] == "unplain" or check.raises:  # a raises test whose call returned: a wrong answer
        return "wrong_answer"
    if reply[0] != "values" or len(reply) != 2 or not isinstance(reply[1], list):
        return "crash"
    try:
        values = [decode_value(v) for v in reply[1]]
    except (OverBound, RecursionError, MemoryError):
        return "oversized"
    except (ValueError, TypeError, OverflowError):
        return "wrong_answer"
    return judge_values(check, values)


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
                matched = outputs_match(record["stdout"], tests.tests[i][1])
                statuses[i] = failure or ("pass" if matched else "wrong_answer")
            elif isinstance(checks[i], WholeTest):
                statuses[i] = _judge_whole(record)
            else:
                statuses[i] = _judge_value(record, checks[i])
    return CodeOutcome([s or "crash" for s in statuses])


def score_programs(responses: Sequence[str], ground_truths: Sequence[Any], settings: CodeSettings) -> list[CodeOutcome]:
    """Test every response's program against its row's tests, `settings.workers` sandboxes at a time (one sandbox
    start per response; two when it has script tests)."""
    settings.validate()
    plans, calls = [], []
    for response, gt in zip(responses, ground_truths):
        tests = parse_cached(gt)
        check_limits(tests, settings)
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


def status_sums(rollout: Any) -> dict[str, float]:
    """rlvr_ppo's rollout_sums hook: this rank's tests per status (code_<status>), summed over ranks in the row."""
    return {f"code_{s}": float(rollout.code_statuses.get(s, 0)) for s in TEST_STATUSES}


def status_metrics(cfg: Any, rollout: Any, sums: dict[str, float], train: Any, updates: float, _: Any) -> dict:
    """rlvr_ppo's metrics hook: the code verifier's tests by outcome over every rank (none when no test ran)."""
    if not any(sums[f"code_{s}"] for s in TEST_STATUSES):
        return {}
    return {f"train/code_tests_{s}": sums[f"code_{s}"] for s in TEST_STATUSES}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m open_instruct.code_verifier DATA.jsonl [COLUMN ...]`: the tests of a dataset file on each path
    (value: judged in the trainer; script: run whole in the sandbox), from the first column present of COLUMN
    (default: ground_truth, test_list, test_cases, input_output, tests, test) and the row's entry_point, if any."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(main.__doc__, file=sys.stderr)
        return 2
    path, columns = args[0], args[1:] or ["ground_truth", "test_list", "test_cases", "input_output", "tests", "test"]
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
                total += count_test_paths(parse_code_tests(row[column], row.get("entry_point")))
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
