"""The `code` verifier: run the program in a response against its row's test cases in the sandbox (sandbox.py).

Ground truth (a Python object, or a JSON string of one), in the formats RLVR code datasets use:

    assert tests   a list of strings, each test code run after the program (open-instruct `code`, AceCoder
                   `test_cases`, MBPP `test_list`), or one string of test code: each top-level `assert` is a test
                   when every statement is one, else the whole string is a single test; {"test_list": [...]} and
                   {"tests": [...]} too
    stdin/stdout   a list of {"input": str, "output": str} (open-instruct `code_stdio`), {"inputs": [...],
                   "outputs": [...]} (APPS / TACO), or PrimeIntellect's {"test_cases": [{"type": "stdin_stdout",
                   "input", "output"}, ...]}; an input/output given as a list of lines is joined with newlines
    function call  the same with "fn_name" (TACO) or "type": "function_call" (PrimeIntellect): input = the JSON list
                   of arguments, output = the expected value (or [value], as APPS stores it); a method of a
                   `Solution` class (LeetCode style) is found too

A malformed ground truth (unparseable test code, no tests, lengths that differ) raises ValueError naming what is wrong;
the trainer reports it with the row before any model loads (rewards.check_verifiers).

The program: the last fenced code block of the response (```python / ```py / ```), else the whole answer.

Scoring (per test): pass, or a failure reason: syntax_error (the program does not compile), wrong_answer (an assert
fails / the output differs), timeout (a test ran past test_seconds, or the program past its wall/CPU limit), memory
(MemoryError / the address-space limit), crash (any other exception, a non-zero exit, a forbidden fork),
output (printed more than the limit), no_code (an empty response). The reward is 1.0 when every test passes
(`code_reward: all`) or passed / total (`fraction`).

All assert tests of a response run in one sandboxed process (program, then each test under its own CPU-time timer,
results on a duplicate of stderr tagged with a per-call random token the program is not shown): one process start per
response. Each stdin/stdout case is its own process (the program reads stdin at import time). stdout matches when,
after dropping trailing spaces on every line and trailing blank lines, it is equal, or when its whitespace-separated
tokens equal the expected ones (numbers within 1e-6 relative or absolute).

Limit of the scheme (shared with open-instruct's and verl's in-process test runners): the program runs in the same
process as its tests, so one written to attack the harness (walk the stack to read the token) could fake a pass. It
cannot reach the trainer, the network or the run's files (the sandbox's job).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import logging
import math
import re
import secrets
from typing import Any, Optional, Sequence

from open_instruct.sandbox import SandboxCall, SandboxLimits, SandboxPool, SandboxResult

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


def _split_asserts(source: str) -> list[str]:
    """'assert f(1) == 2\\nassert f(2) == 3' -> one test per assert; anything else (setup lines) -> one test."""
    _check_test_source(source, "test code")
    tree = ast.parse(source)
    if tree.body and all(isinstance(node, ast.Assert) for node in tree.body):
        return [ast.get_source_segment(source, node) or ast.unparse(node) for node in tree.body]
    return [source]


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
            return CodeTests("assert", tuple(_split_asserts(gt)))
    if isinstance(gt, (list, tuple)):
        if not gt:
            raise ValueError("code ground truth has no tests (empty list)")
        if all(isinstance(t, str) for t in gt):
            for i, t in enumerate(gt):
                _check_test_source(t, f"test {i}")
            return CodeTests("assert", tuple(gt))
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


# The harness is trusted code; the program and tests reach it as files (solution.py, tests.json).
_HARNESS = r"""
import json, os, signal, sys
cfg = json.load(open("tests.json"))
os.remove("tests.json")  # the token is not left for the program to read
def _reporter(token, report):
    def say(which, status):
        report.write("\n%s %s %s\n" % (token, which, status))
    return say
say = _reporter(cfg.pop("token"), os.fdopen(os.dup(2), "w", buffering=1))
class _TestTimeout(BaseException):
    pass
def _on_alarm(*_):
    raise _TestTimeout()
def status_of(exc):
    if isinstance(exc, AssertionError): return "wrong_answer"
    if isinstance(exc, _TestTimeout): return "timeout"
    if isinstance(exc, MemoryError): return "memory"
    return "crash"
def _call(name, args, ns):
    if name in ns: return ns[name](*args)
    if "Solution" in ns: return getattr(ns["Solution"](), name)(*args)
    raise NameError(name)
try:
    program = compile(open("solution.py", encoding="utf-8").read(), "solution.py", "exec")
except BaseException:
    say("all", "syntax_error")
    sys.exit(1)
ns = {"__name__": "__main__", "__builtins__": __builtins__, "_call": _call}
if cfg["kind"] == "stdio":
    try:
        exec(program, ns)
    except SystemExit:
        raise
    except BaseException as e:
        say("all", status_of(e))
        raise
    sys.exit(0)
signal.signal(signal.SIGPROF, _on_alarm)
def run(code):
    signal.setitimer(signal.ITIMER_PROF, cfg["test_seconds"])
    try:
        exec(code, ns)
        return "pass"
    except BaseException as e:
        return status_of(e)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
status = run(program)
if status != "pass":
    say("all", status)
    sys.exit(1)
for i, test in enumerate(cfg["tests"]):
    say(i, run(compile(test, "test_%d" % i, "exec")))
"""


def _call_test_source(fn_name: str, args: list, expected: Any) -> str:
    """A function-call case as assert code (APPS also accepts the result wrapped in a list)."""
    return f"_r = _call({fn_name!r}, {args!r}, globals())\nassert _r == {expected!r} or [_r] == {expected!r}"


def build_calls(program: str, tests: CodeTests, settings: CodeSettings) -> tuple[list[SandboxCall], str]:
    """The sandbox calls that test one program (one for assert/call tests, one per stdin/stdout case) and the
    token that marks the harness's reports."""
    token = secrets.token_hex(16)
    if tests.kind == "stdio":
        limits = SandboxLimits(
            wall_seconds=STARTUP_SECONDS + WALL_FACTOR * settings.test_seconds,
            cpu_seconds=math.ceil(settings.test_seconds),  # whole seconds (RLIMIT_CPU): 0.5 s runs 1 s of CPU
            memory_mb=settings.memory_mb,
        )
        cfg = json.dumps({"token": token, "kind": "stdio"})
        files = {"solution.py": program, "tests.json": cfg}
        return [SandboxCall(_HARNESS, stdin, files, limits) for stdin, _ in tests.tests], token
    sources = (
        list(tests.tests)
        if tests.kind == "assert"
        else [_call_test_source(tests.fn_name, a, e) for a, e in tests.tests]
    )
    budget = settings.test_seconds * (len(sources) + 1)  # the program's own run, then each test
    limits = SandboxLimits(
        wall_seconds=STARTUP_SECONDS + WALL_FACTOR * budget,
        cpu_seconds=math.ceil(budget) + 1,
        memory_mb=settings.memory_mb,
    )
    cfg = json.dumps({"token": token, "kind": "assert", "tests": sources, "test_seconds": settings.test_seconds})
    return [SandboxCall(_HARNESS, "", {"solution.py": program, "tests.json": cfg}, limits)], token


def _reports(result: SandboxResult, token: str) -> dict[str, str]:
    found = {}
    for line in result.stderr.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == token:
            found[parts[1]] = parts[2]
    return found


def _limit_status(result: SandboxResult) -> str:
    return {"wall_time": "timeout", "cpu_time": "timeout", "memory": "memory", "output": "output"}.get(
        result.limit or "", "crash"
    )


def judge(tests: CodeTests, results: list[SandboxResult], token: str) -> CodeOutcome:
    """Per-test statuses from the sandbox results of build_calls."""
    if tests.kind == "stdio":
        statuses = []
        for (_, expected), res in zip(tests.tests, results):
            reported = _reports(res, token).get("all")
            if reported == "syntax_error":
                statuses.append("syntax_error")
            elif res.limit:
                statuses.append(_limit_status(res))
            elif reported:
                statuses.append(reported)
            elif res.exit_code != 0:
                statuses.append("crash")
            else:
                statuses.append("pass" if outputs_match(res.stdout, expected) else "wrong_answer")
        return CodeOutcome(statuses)
    (res,) = results
    reported = _reports(res, token)
    n = len(tests.tests)
    if "all" in reported:
        return CodeOutcome([reported["all"]] * n)
    missing = _limit_status(res) if res.limit or res.exit_code != 0 else "crash"
    return CodeOutcome([reported.get(str(i), missing) for i in range(n)])


def score_programs(responses: Sequence[str], ground_truths: Sequence[Any], settings: CodeSettings) -> list[CodeOutcome]:
    """Test every response's program against its row's tests, `settings.workers` sandboxes at a time."""
    settings.validate()
    plans, calls = [], []
    for response, gt in zip(responses, ground_truths):
        tests = parse_code_tests(gt)
        program = extract_program(response)
        if not program.strip():
            plans.append((tests, None, 0, 0))
            continue
        these, token = build_calls(program, tests, settings)
        plans.append((tests, token, len(calls), len(these)))
        calls.extend(these)
    results: list[SandboxResult] = []
    if calls:
        with SandboxPool(settings.workers, hide_paths=settings.hide_paths) as pool:
            results = pool.run(calls, batch_timeout=settings.batch_timeout)
    outcomes = []
    for tests, token, first, count in plans:
        if token is None:
            outcomes.append(CodeOutcome(["no_code"] * len(tests.tests)))
        else:
            outcomes.append(judge(tests, results[first : first + count], token))
    return outcomes


def count_statuses(outcomes: Sequence[CodeOutcome]) -> collections.Counter:
    """Tests per status ("pass" and each failure reason) over a batch."""
    return collections.Counter(s for o in outcomes for s in o.statuses)
