"""The `code` verifier (open_instruct/code_verifier.py) against hand-made responses with known verdicts: every test's
status (pass or the failure reason) is asserted, in one parallel batch through the rewards registry. Then the ground
truth formats, bad ground truth, and the reward modes."""

from __future__ import annotations

import json
import sys

import pytest

from open_instruct import code_verifier, rewards
from open_instruct.code_verifier import CodeSettings, extract_program, outputs_match, parse_code_tests
from open_instruct.errors import DataError

P, WA, SE, TO, MEM, CR, OUT, NC = (
    "pass",
    "wrong_answer",
    "syntax_error",
    "timeout",
    "memory",
    "crash",
    "output",
    "no_code",
)
SETTINGS = CodeSettings(reward="fraction", test_seconds=0.5, memory_mb=256, workers=2)


def fence(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\nIt runs in O(1)."


ADD = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0", "assert add(2, 5) == 7"]
ADD2 = ["assert add(1, 2) == 3", "assert add(2, 5) == 7"]
SUM = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8\n"}, {"input": "0 0\n", "output": "0"}]
ONE = [{"input": "3 4\n", "output": "7\n"}]
GOOD_ADD = "def add(a, b):\n    return a + b"
GOOD_SUM = "a, b = map(int, input().split())\nprint(a + b)"

# (name, response, ground truth, expected status per test)
CASES = [
    # function-signature tests (asserts appended to the program)
    ("correct, fenced", fence(GOOD_ADD), ADD, [P] * 4),
    ("correct, no fence", GOOD_ADD, ADD, [P] * 4),
    ("correct, py fence", fence(GOOD_ADD, "py"), ADD, [P] * 4),
    ("correct, bare fence", fence(GOOD_ADD, ""), ADD, [P] * 4),
    ("last fence wins", fence("def add(a, b):\n    return a - b") + "\nFixed:\n" + fence(GOOD_ADD), ADD, [P] * 4),
    ("unclosed last fence", "```python\n" + GOOD_ADD + "\n", ADD, [P] * 4),
    ("after </think>", "<think>def add(a, b): return 0</think>" + fence(GOOD_ADD), ADD, [P] * 4),
    ("wrong", fence("def add(a, b):\n    return a - b"), ADD, [WA, WA, P, WA]),
    ("partial", fence("def add(a, b):\n    return abs(a) + b"), ADD, [P, WA, P, P]),
    ("syntax error", fence("def add(a, b)\n    return a + b"), ADD, [SE] * 4),
    ("indentation error", fence("def add(a, b):\nreturn a + b"), ADD, [SE] * 4),
    ("loop in function", fence("def add(a, b):\n    while True:\n        pass"), ADD2, [TO, TO]),
    ("loop at import", fence("while True:\n    pass"), ADD2, [TO, TO]),
    (
        "slow for one input",
        fence("def add(a, b):\n    while a == 2:\n        pass\n    return a + b"),
        ADD,
        [P, P, P, TO],
    ),
    ("missing function", fence("def plus(a, b):\n    return a + b"), ADD, [CR] * 4),
    ("raises", fence("def add(a, b):\n    raise ValueError('no')"), ADD2, [CR, CR]),
    ("raises for one", fence("def add(a, b):\n    return a + b if a else 1 // a"), ADD, [P, P, CR, P]),
    ("memory", fence("def add(a, b):\n    return len(bytearray(2**40))"), ADD2, [MEM, MEM]),
    ("exit at import", fence("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b"), ADD2, [CR, CR]),
    ("os._exit fake pass", fence("import os\ndef add(a, b):\n    os._exit(0)"), ADD2, [CR, CR]),
    (
        "forged report line",
        fence("import sys\nsys.stderr.write('\\nabc 0 pass\\nabc 1 pass\\n')\ndef add(a, b): 0"),
        ADD2,
        [WA, WA],
    ),
    # a value test's verdict is the returned value: what the program prints is discarded, however much
    ("floods stdout", fence("print('x' * 3_000_000)\ndef add(a, b):\n    return a + b"), ADD2, [P, P]),
    ("empty answer", "", ADD2, [NC, NC]),
    (
        "recursive fib",
        fence("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"),
        ["assert fib(10) == 55"],
        [P],
    ),
    (
        "uses the stdlib",
        fence("import math\ndef hyp(a, b):\n    return math.hypot(a, b)"),
        ["assert hyp(3, 4) == 5"],
        [P],
    ),
    ("main block", fence(GOOD_ADD + "\nif __name__ == '__main__':\n    print(add(1, 1))"), ADD2, [P, P]),
    # one stored piece of test code is one test, run unmodified (its second assert fails)
    ("MBPP string of asserts", fence(GOOD_ADD), "assert add(1, 2) == 3\nassert add(1, 1) == 3", [WA]),
    ("setup + asserts string", fence(GOOD_ADD), "x = add(1, 2)\nassert x == 3", [P]),
    ("MBPP test_list dict", fence(GOOD_ADD), {"test_list": ADD2}, [P, P]),
    ("JSON string of asserts", fence(GOOD_ADD), json.dumps(ADD2), [P, P]),
    # stdin/stdout tests
    ("stdio correct", fence(GOOD_SUM), SUM, [P, P, P]),
    (
        "stdio sys.stdin.read",
        fence("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)"),
        SUM,
        [P] * 3,
    ),
    ("stdio trailing spaces", fence("a, b = map(int, input().split())\nprint(a + b, ' ')\nprint()"), SUM, [P] * 3),
    ("stdio wrong", fence("a, b = map(int, input().split())\nprint(a - b)"), SUM, [WA, WA, P]),
    ("stdio syntax error", fence("a, b = map(int input().split())"), SUM, [SE] * 3),
    ("stdio loop", fence("while True:\n    pass"), ONE, [TO]),
    ("stdio crash", fence("a, b = map(int, input().split())\nprint(a // (b - 4))"), SUM, [CR, WA, P]),
    ("stdio floods stdout", fence("print('x' * 3_000_000)"), ONE, [OUT]),
    ("stdio memory", fence("x = bytearray(2**40)"), ONE, [MEM]),
    ("stdio exit() after print", fence("print(7)\nexit()"), ONE, [P]),
    ("stdio exit(1)", fence("print(7)\nexit(1)"), ONE, [CR]),
    ("stdio stderr noise", fence("import sys\nsys.stderr.write('debug\\n')\n" + GOOD_SUM), ONE, [P]),
    (
        "stdio floats",
        fence("a, b = map(int, input().split())\nprint(a / b)"),
        [{"input": "1 3", "output": "0.333333"}],
        [P],
    ),
    ("stdio lines as lists", fence(GOOD_SUM), [{"input": ["3 4"], "output": ["7"]}], [P]),
    ("APPS inputs/outputs", fence(GOOD_SUM), {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "11\n"]}, [P, WA]),
    (
        "PrimeIntellect stdin_stdout",
        fence(GOOD_SUM),
        {"test_cases": [{"type": "stdin_stdout", "input": "2 2\n", "output": "4\n", "fn_name": None}]},
        [P],
    ),
    # function-call tests (TACO fn_name, PrimeIntellect function_call, LeetCode classes)
    (
        "PrimeIntellect function_call",
        fence(GOOD_ADD),
        {"test_cases": [{"type": "function_call", "fn_name": "add", "input": "[1, 2]", "output": "[3]"}]},
        [P],
    ),
    ("TACO fn_name", fence(GOOD_ADD), {"fn_name": "add", "inputs": [[1, 2], [4, 4]], "outputs": [[3], 9]}, [P, WA]),
    (
        "LeetCode Solution class",
        fence("class Solution:\n    def add(self, a, b):\n        return a + b"),
        {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]},
        [P],
    ),
]


@pytest.fixture(scope="module")
def batch():
    """All cases in one parallel run (2 workers); then the same outcomes through rewards.score_batch, which maps
    them to rewards and counts (its sandbox step replaced by the outcomes already measured, to run programs once)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox needs Linux")
    texts, gts = [c[1] for c in CASES], [c[2] for c in CASES]
    outcomes = code_verifier.score_programs([rewards.strip_thinking(t) for t in texts], gts, SETTINGS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(code_verifier, "score_programs", lambda responses, *_: outcomes)
        scored = rewards.score_batch(texts, gts, "code", verification_reward=10.0, code=SETTINGS)
    return scored, outcomes


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_case_verdicts(batch, index):
    scored, outcomes = batch
    name, _, _, expected = CASES[index]
    assert outcomes[index].statuses == expected, name
    fraction = expected.count(P) / len(expected)
    assert scored.rewards[index] == pytest.approx(10.0 * fraction)  # code_reward: fraction
    assert scored.correct[index] == (fraction == 1.0)


def test_batch_counts_every_failure_reason(batch):
    scored, _ = batch
    expected = {}
    for *_, statuses in CASES:
        for s in statuses:
            expected[s] = expected.get(s, 0) + 1
    assert scored.code_statuses == expected
    assert set(expected) == {P, WA, SE, TO, MEM, CR, OUT, NC}  # every reason is exercised


def test_reward_all_gives_nothing_for_partial():
    outcome = code_verifier.CodeOutcome([P, WA, P, P])
    assert outcome.score("all") == 0.0 and outcome.score("fraction") == 0.75
    assert code_verifier.CodeOutcome([P, P]).score("all") == 1.0


def test_registry_verifier_scores_one_completion():
    assert rewards.run_verifier("code", fence(GOOD_ADD), ADD2) == (1.0, False)
    assert rewards.run_verifier("code", "", ADD2) == (0.0, False)


def test_ground_truth_formats_parse():
    assert parse_code_tests(ADD).kind == "assert" and len(parse_code_tests(ADD).tests) == 4
    assert parse_code_tests("assert f(1) == 1\nassert f(2) == 2").tests == ("assert f(1) == 1\nassert f(2) == 2",)
    stdio = parse_code_tests(json.dumps(SUM))
    assert stdio.kind == "stdio" and stdio.tests[0] == ("3 4\n", "7\n")
    call = parse_code_tests({"fn_name": "f", "inputs": ["[1, 2]"], "outputs": ["3"]})
    assert (call.kind, call.fn_name, call.tests) == ("call", "f", (([1, 2], 3),))


@pytest.mark.parametrize(
    "bad, message",
    [
        ("assert f(1) ==", "does not parse"),
        ([], "no tests"),
        (["assert f(1) == 1", "def ("], "test 1"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, "identifier"),
        ({"fn_name": "f", "inputs": ["1"], "outputs": [1]}, "JSON list of arguments"),
        ({"tset_cases": []}, "none of test_cases"),
        ([{"input": "1"}], "input and output"),
        (7, "must be test code"),
    ],
)
def test_bad_ground_truth_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_code_tests(bad)


def test_bad_ground_truth_stops_before_training_naming_the_row():
    rows = [
        {"verifier": "code", "ground_truth": ADD, "row": 0},
        {"verifier": "code", "ground_truth": ["assert add(1, 2) =="], "row": 1},
    ]
    with pytest.raises(DataError, match=r"train row 1: code: test 0: test code does not parse"):
        rewards.check_verifiers(rows, "train")


def test_program_extraction_and_output_matching():
    assert extract_program("no fence here") == "no fence here"
    assert extract_program("```python\na\n```\ntext\n```\nb\n```") == "b\n"
    assert outputs_match("7  \n\n", "7") and outputs_match("1 2\n3", "1 2 3")
    assert outputs_match("0.3333333333", "0.333333") and not outputs_match("0.33", "0.333333")
    assert not outputs_match("7", "8") and not outputs_match("7 7", "7")


def test_settings_are_checked():
    with pytest.raises(ValueError, match="code_reward"):
        CodeSettings(reward="most").validate()
    with pytest.raises(ValueError, match="sandbox_workers"):
        CodeSettings(workers=0).validate()


def test_plan_adds_verification_time_per_rollout(repo_root, capsys):
    """verification per rollout and process = episodes_per_rollout / processes * code_fraction * call_seconds /
    sandbox_workers, on the trainer's side of the rollout."""
    from open_instruct.plan import main as plan_main

    def plan(*flags):
        recipe = f"{repo_root}/configs/rlvr_8b.yaml"
        assert plan_main([recipe, "--num_processes", "7", "--json", "--sandbox_workers", "4", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    base = plan()
    with_code = plan("--code_fraction", "0.5", "--sandbox_call_seconds", "0.4")
    expected = with_code["episodes_per_rollout"] / 7 * 0.5 * 0.4 / 4
    assert with_code["verification_seconds_per_rollout"] == pytest.approx(expected)
    assert base["verification_seconds_per_rollout"] == 0.0
    gained = with_code["training_seconds_per_rollout"] - base["training_seconds_per_rollout"]
    assert gained == pytest.approx(expected)
    assert with_code["sandbox_call_seconds"] == 0.4


def test_a_machine_that_cannot_sandbox_stops_before_training(monkeypatch):
    from open_instruct import sandbox
    from open_instruct.errors import ConfigError

    def no_sandbox(mode="auto"):
        raise RuntimeError("no sandbox isolation works on this machine: rlimits: setrlimit failed")

    monkeypatch.setattr(sandbox, "isolation", no_sandbox)
    rows = [{"verifier": "code", "ground_truth": ADD, "row": 0}]
    refused = r"train rows use the code verifier \(run in the sandbox\), but: no sandbox isolation works"
    with pytest.raises(ConfigError, match=refused):
        rewards.check_verifiers(rows, "train")
    rewards.check_verifiers([{"verifier": "arithmetic", "ground_truth": "7", "row": 0}], "train")  # no probe needed


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--code_reward", "most"], "code_reward"),
        (["--sandbox_workers", "0"], "sandbox_workers must be > 0"),
        (["--code_test_seconds", "0"], "code_test_seconds must be > 0"),
        (["--code_memory_mb", "16"], "code_memory_mb must be >= 64"),
        (["--sandbox_batch_timeout", "-1"], "sandbox_batch_timeout must be > 0"),
    ],
)
def test_bad_code_settings_name_the_key(repo_root, flags, message):
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config(RLVRConfig, [f"{repo_root}/configs/rlvr_tiny.yaml", *flags])
