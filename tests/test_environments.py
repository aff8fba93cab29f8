"""Environments: the calculator, the tool environment (Hermes and fenced formats, budgets, failing tools), the
final-answer multi-turn environment, and loading an environment from a user's file by import path. CPU, no model."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from demo.tiny import build_tokenizer
from open_instruct.environments import (
    ENVIRONMENTS,
    MultiTurnEnvironment,
    ToolEnvironment,
    ToolError,
    calculate,
    environment_class,
    environment_for_row,
    make_environment,
)
from open_instruct.errors import ConfigError, DataError


def subprocess_runtime(code: str, timeout_s: float) -> tuple[str, str, str]:
    """A plain python tool runtime for the tests (the sandbox's runtime has the same signature)."""
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "", "", "timeout"
    return done.stdout, done.stderr, "ok" if done.returncode == 0 else "error"


ROW = {
    "messages": [{"role": "user", "content": "What is 1234 * 5678?"}],
    "ground_truth": "7006652",
    "verifier": "arithmetic",
}


def hermes(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1234 * 5678", "7006652"),
        ("(2 + 3) ** 2 - 1", "24"),
        ("7 / 2", "3.5"),
        ("8 / 4", "2"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("-3 + +4", "1"),
        ("2 ** 100", str(2**100)),
        ("0.1 + 0.2", str(0.1 + 0.2)),
    ],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 5000", "too large"),
        ("__import__('os').system('true')", "Call"),
        ("x + 1", "Name"),
        ("[1, 2]", "List"),
        ("2 +", "syntax"),
        ("(-8) ** 0.5", "not a real number"),
        ("'a' * 3", "Constant"),
        ("1" * 3000, "longer than"),
    ],
)
def test_calculator_refuses_without_evaluating(expression, message):
    with pytest.raises(ToolError, match=message) as e:
        calculate(expression)
    assert e.value.reason == "calculator_error"


def test_hermes_tool_call_then_verified_answer():
    env = ToolEnvironment(tools=["calculator"], tool_output_max_tokens=None)
    first = env.reset(ROW)
    assert first == ROW["messages"] and env.tools[0]["function"]["name"] == "calculator"
    obs, reward, done, info = env.step("I will compute it. " + hermes("calculator", expression="1234 * 5678"))
    assert obs == [{"role": "tool", "content": "7006652"}] and reward == 0.0 and not done
    assert info == {"tool_calls": 1, "tool_errors": [], "truncated": []}
    obs, reward, done, info = env.step("The answer is 7006652.")
    assert (obs, reward, done, info["correct"]) == (None, 1.0, True, True)
    env.reset(ROW)
    assert env.step("The answer is 7006653.")[1:3] == (0.0, True)


def test_hermes_several_calls_errors_counted_and_penalised():
    env = ToolEnvironment(tools=["calculator"], tool_output_max_tokens=None, tool_error_reward=-0.25)
    env.reset(ROW)
    action = (
        hermes("calculator", expression="2+2")
        + "<tool_call>{not json}</tool_call>"
        + hermes("search", query="x")
        + hermes("calculator", expr="2+2")
        + hermes("calculator", expression="1/0")
    )
    obs, reward, done, info = env.step(action)
    assert [m["content"] for m in obs][0] == "4"
    assert [m["content"].split(")")[0] for m in obs[1:]] == [
        "Error (bad_tool_call",
        "Error (unknown_tool",
        "Error (bad_tool_call",
        "Error (calculator_error",
    ]
    assert info["tool_errors"] == ["bad_tool_call", "unknown_tool", "bad_tool_call", "calculator_error"]
    assert info["tool_calls"] == 5 and reward == -1.0 and not done


def test_max_tool_calls_budget_answers_with_an_error_and_does_not_run():
    env = ToolEnvironment(tools=["calculator"], tool_output_max_tokens=None, max_tool_calls=2)
    env.reset(ROW)
    obs, _, _, info = env.step(hermes("calculator", expression="1+1"))
    assert obs[0]["content"] == "2" and info["truncated"] == []
    obs, _, _, info = env.step(hermes("calculator", expression="2+2") + hermes("calculator", expression="3+3"))
    assert obs[0]["content"] == "4" and "budget exhausted (max_tool_calls=2)" in obs[1]["content"]
    assert info["tool_calls"] == 1 and info["truncated"] == ["max_tool_calls"]


def test_tool_output_truncated_to_a_token_budget():
    tokenizer = build_tokenizer()  # one token per character
    env = ToolEnvironment(
        tools=["python"],
        python_runtime=lambda code, t: ("x" * 50, "", "ok"),
        tokenizer=tokenizer,
        tool_output_max_tokens=10,
    )
    env.reset(ROW)
    obs, _, _, info = env.step(hermes("python", code="print('x' * 50)"))
    assert obs[0]["content"] == "x" * 10 + "\n[output truncated: 50 tokens, first 10 shown]"
    assert info["truncated"] == ["tool_output_max_tokens"]


def test_python_tool_through_a_subprocess_runtime():
    env = ToolEnvironment(
        tools=["python"], python_runtime=subprocess_runtime, tool_output_max_tokens=None, tool_timeout_s=60.0
    )
    env.reset(ROW)
    obs, _, _, info = env.step(hermes("python", code="print(1234 * 5678)"))
    assert obs[0]["content"] == "7006652\n" and info["tool_errors"] == []
    obs, _, _, info = env.step(hermes("python", code="raise ValueError('boom')"))
    assert info["tool_errors"] == ["python_error"] and "ValueError: boom" in obs[0]["content"]


def test_python_tool_that_loops_forever_times_out_in_the_runtime():
    env = ToolEnvironment(
        tools=["python"], python_runtime=subprocess_runtime, tool_output_max_tokens=None, tool_timeout_s=0.5
    )
    env.reset(ROW)
    obs, _, done, info = env.step(hermes("python", code="while True: pass"))
    assert info["tool_errors"] == ["python_timeout"] and obs[0]["content"].startswith("Error (python_timeout)")
    assert not done


def test_python_tool_defaults_to_the_sandbox():
    """Without a runtime of its own the python tool runs in open_instruct.sandbox: output back, a non-zero exit and a
    loop that outlives its time both become error observations named by reason, and the episode goes on."""
    env = ToolEnvironment(tools=["python"], tool_output_max_tokens=None, tool_timeout_s=2.0)
    env.reset(ROW)
    obs, _, _, info = env.step(hermes("python", code="print(1234 * 5678)"))
    assert obs[0]["content"] == "7006652\n" and info["tool_errors"] == []
    obs, _, _, info = env.step(hermes("python", code="import sys; sys.exit(3)"))
    assert info["tool_errors"] == ["python_exit_3"]
    obs, _, done, info = env.step(hermes("python", code="while True: pass"))
    assert info["tool_errors"] in (["python_cpu_time"], ["python_wall_time"]) and not done


def test_a_runtime_that_hangs_or_crashes_gives_an_error_observation_and_the_episode_goes_on():
    release = threading.Event()

    def hanging(code, timeout_s):
        release.wait()  # never returns on its own: ignores its timeout
        return "", "", "ok"

    def crashing(code, timeout_s):
        raise RuntimeError("sandbox pool is gone")

    try:
        env = ToolEnvironment(
            tools=["python"],
            python_runtime=hanging,
            tool_output_max_tokens=None,
            tool_timeout_s=0.05,
            tool_deadline_grace_s=0.05,
        )
        env.reset(ROW)
        obs, _, done, info = env.step(hermes("python", code="print(1)"))
        assert (
            info["tool_errors"] == ["python_hung"] and "did not return within 0.1s (timeout 0.05s)" in obs[0]["content"]
        )
        env.python_runtime = crashing
        obs, _, done, info = env.step(hermes("python", code="print(1)"))
        assert info["tool_errors"] == ["python_crash"] and "sandbox pool is gone" in obs[0]["content"]
        assert env.step("The answer is 7006652")[1:3] == (1.0, True)
    finally:
        release.set()


def test_fenced_python_blocks_retool_style():
    env = ToolEnvironment(
        tools=["python"],
        tool_format="fenced",
        python_runtime=lambda c, t: ("5\n", "", "ok"),
        tool_output_max_tokens=None,
    )
    assert env.tools == []  # no tool schemas in the prompt: the system prompt describes the format
    env.reset(ROW)
    text = "Let me compute.\n```python\nprint(2 + 3)\n```"
    assert env.action_end(text + "\nand more") == len(text) and env.action_end("```python\nprint(1)") is None
    obs, reward, done, info = env.step(text + "\n")
    assert obs == "\n<output>\n5\n\n</output>\n" and (reward, done, info["tool_calls"]) == (0.0, False, 1)
    # a block followed by prose is part of a final answer, not a call
    assert env.step("```python\nprint(1)\n```\nSo the answer is 7006652")[1:3] == (1.0, True)


def test_tool_environment_configuration_errors():
    with pytest.raises(ConfigError, match="unknown"):
        ToolEnvironment(tools=["browser"])
    with pytest.raises(ConfigError, match="fenced"):
        ToolEnvironment(tools=["calculator"], tool_format="fenced")
    with pytest.raises(ConfigError, match="tool_format"):
        ToolEnvironment(tool_format="xml")
    with pytest.raises(ConfigError, match="tokenizer"):
        ToolEnvironment(tools=["calculator"], tool_output_max_tokens=64)


def test_rows_choose_among_the_tools():
    env = ToolEnvironment(
        tools=["calculator", "python"], python_runtime=subprocess_runtime, tool_output_max_tokens=None
    )
    env.reset({**ROW, "tools": ["calculator"]})
    assert [t["function"]["name"] for t in env.tools] == ["calculator"]
    _, _, _, info = env.step(hermes("python", code="print(1)"))
    assert info["tool_errors"] == ["unknown_tool"]
    with pytest.raises(DataError, match="browser"):
        env.reset({**ROW, "tools": ["browser"]})
    with pytest.raises(DataError, match="messages"):
        env.reset({"ground_truth": "1", "verifier": "arithmetic"})


def test_multi_turn_environment_verifies_only_the_final_answer():
    env = MultiTurnEnvironment()
    row = {**ROW, "follow_ups": ["Think again, step by step.", "Now give only the number."]}
    assert env.reset(row) == ROW["messages"]
    assert env.step("7006652") == ([{"role": "user", "content": "Think again, step by step."}], 0.0, False, {})
    assert env.step("7006652")[:3] == ([{"role": "user", "content": "Now give only the number."}], 0.0, False)
    assert env.step("7006652")[1:3] == (1.0, True)
    retry = MultiTurnEnvironment(max_attempts=2, verifier=lambda text, gt: float(text.strip() == gt))
    retry.reset(ROW)
    obs, reward, done, info = retry.step("7")
    assert obs[0]["role"] == "user" and (reward, done, info["correct"]) == (0.0, False, False)
    assert retry.step("7")[1:3] == (0.0, True)  # out of attempts


def test_registry_and_import_paths(tmp_path, monkeypatch):
    assert environment_class("tool") is ToolEnvironment and environment_class("Multi_Turn") is MultiTurnEnvironment
    assert set(ENVIRONMENTS) >= {"tool", "multi_turn"}
    user_file = tmp_path / "my_envs.py"
    user_file.write_text(
        "from open_instruct.environments import Environment, StepResult\n"
        "class Countdown(Environment):\n"
        "    def __init__(self, start=3):\n"
        "        self.start = start\n"
        "    def reset(self, example):\n"
        "        self.left = self.start\n"
        "        return example['prompt']\n"
        "    def step(self, action):\n"
        "        self.left -= 1\n"
        "        done = self.left == 0\n"
        "        return StepResult(None if done else f' {self.left}', float(done), done, {})\n"
    )
    by_file = make_environment(f"{user_file}:Countdown", start=2)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = make_environment("my_envs:Countdown", start=2)
    for env in (by_file, by_module):
        assert env.reset({"prompt": "count"}) == "count"
        assert env.step("x") == (" 1", 0.0, False, {}) and env.step("x") == (None, 1.0, True, {})
    with pytest.raises(ConfigError, match="registered are"):
        environment_class("browser")
    with pytest.raises(ConfigError, match="no class 'Nope'"):
        environment_class(f"{user_file}:Nope")
    with pytest.raises(ConfigError, match="importing 'no_such_module_xyz' failed"):
        environment_class("no_such_module_xyz:Env")
    with pytest.raises(ConfigError, match="missing.py' does not exist"):
        environment_class(str(tmp_path / "missing.py") + ":Env")
    with pytest.raises(ConfigError, match="no reset or step"):
        environment_class("collections:OrderedDict")


def test_rows_name_their_environment_and_get_the_resources_it_takes():
    resources = {"tools": ["calculator"], "tool_output_max_tokens": None, "max_attempts": 2}
    tool_env = environment_for_row(ROW, "tool", resources)
    multi = environment_for_row({**ROW, "environment": "multi_turn"}, "tool", resources)
    assert isinstance(tool_env, ToolEnvironment) and tool_env.all_tools == ("calculator",)
    assert isinstance(multi, MultiTurnEnvironment) and multi.max_attempts == 2
    with pytest.raises(ConfigError, match="unknown environment 'browser'"):
        environment_for_row({**ROW, "environment": "browser"}, "tool", resources)
