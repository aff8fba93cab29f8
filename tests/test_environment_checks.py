"""The user's environment fails loudly and early (issue 34, item 7): a constructor, reset or step that raises, hangs
or returns the wrong types, and messages with an unknown role, each exit 2 naming the class, the method and the
row; reset and one step of a fresh environment are tried on real rows before any model loads."""

import os

import pytest

from open_instruct import rlvr_ppo, runtime
from open_instruct.environments import GuardedEnvironment, guarded_environment_for_row
from open_instruct.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENVS = """
import math, threading
from open_instruct.environments import Environment, StepResult


class Good(Environment):
    def reset(self, example):
        return example["messages"]

    def step(self, action):
        return StepResult(None, 1.0, True, {})


class InitRaises(Good):
    def __init__(self):
        raise RuntimeError("no license server")


class ResetRaises(Good):
    def reset(self, example):
        return example["no_such_column"]


class ResetNumber(Good):
    def reset(self, example):
        return 42


class ResetRobot(Good):
    def reset(self, example):
        return [{"role": "robot", "content": "hi"}]


class StepRaises(Good):
    def step(self, action):
        raise ValueError("cannot parse " + repr(action))


class StepText(Good):
    def step(self, action):
        return "done"


class StepNaN(Good):
    def step(self, action):
        return StepResult(None, math.nan, True, {})


class StepNotDoneNoObservation(Good):
    def step(self, action):
        return StepResult(None, 0.0, False, {})


class StepBadMessage(Good):
    def step(self, action):
        return StepResult([{"role": "tool", "content": 7}], 0.0, False, {})


class StepHangs(Good):
    def step(self, action):
        threading.Event().wait()
"""

EXAMPLE = {"messages": [{"role": "user", "content": "2+2?"}], "ground_truth": "4", "verifier": "arithmetic"}
WHERE = "train.jsonl line 5"


@pytest.fixture
def envs_file(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(ENVS)
    return str(path)


def guarded(envs_file, name, timeout=5.0):
    return guarded_environment_for_row(EXAMPLE, f"{envs_file}:{name}", {}, WHERE, timeout)


@pytest.mark.parametrize(
    "name,call,message",
    [
        ("InitRaises", None, "InitRaises.__init__ raised RuntimeError: no license server on train.jsonl line 5"),
        ("ResetRaises", "reset", "ResetRaises.reset raised KeyError: 'no_such_column' on train.jsonl line 5"),
        ("ResetNumber", "reset", "ResetNumber.reset returned int 42 (a string or a non-empty list of messages)"),
        ("ResetRobot", "reset", "message 0 has role 'robot', not one of ['system', 'user', 'assistant', 'tool']"),
        ("StepRaises", "step", "StepRaises.step raised ValueError: cannot parse 'x' on train.jsonl line 5"),
        ("StepText", "step", "StepText.step returned 'done', not (observation, reward, done, info)"),
        ("StepNaN", "step", "StepNaN.step returned reward nan, not a finite number, on train.jsonl line 5"),
        ("StepNotDoneNoObservation", "step", "returned observation None (only a step may return None, and only when"),
        ("StepBadMessage", "step", "message 0 (tool) has content 7, not a string on train.jsonl line 5"),
        ("StepHangs", "step", "StepHangs.step did not return within 0.2 s (environment_timeout) on train.jsonl line 5"),
    ],
)
def test_bad_environment_is_named_with_its_method_and_row(envs_file, name, call, message):
    with pytest.raises(ConfigError) as e:
        env = guarded(envs_file, name, timeout=0.2 if name == "StepHangs" else 5.0)
        env.reset(EXAMPLE)
        env.step("x")
    assert message in str(e.value), str(e.value)
    assert call is None or f"{name}.{call}" in str(e.value)


def test_a_good_environment_passes_through_unchanged(envs_file):
    env = guarded(envs_file, "Good")
    assert isinstance(env, GuardedEnvironment)
    assert env.reset(EXAMPLE) == EXAMPLE["messages"]
    assert tuple(env.step("4")) == (None, 1.0, True, {})


@pytest.mark.parametrize("name,method", [("StepRaises", "step"), ("ResetRobot", "reset")])
def test_bad_environment_exits_2_before_any_model_loads(
    name, method, envs_file, tiny_models, tmp_path, capsys, no_model_loads
):
    from demo import synthetic

    data = synthetic.write_jsonl(str(tmp_path / "train.jsonl"), synthetic.rl_rows(8, 0))
    argv = [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
            "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data, "--output_dir", str(tmp_path / "o"),
            "--environment", f"{envs_file}:{name}", "--total_episodes", "256"]  # fmt: skip
    try:
        runtime.run(rlvr_ppo.main, argv)
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert f"environment {name}.{method} " in err and f"on {data} line 1" in err, err
