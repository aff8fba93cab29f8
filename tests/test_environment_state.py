"""Environment state (Environment.state_dict / load_state_dict): a tool episode with a python session (a variable
set by one call, read by the next) is snapshotted after its first round (episodes.episode_snapshot, through JSON as
a checkpoint holds it), the process's environment dropped, and resumed in a fresh environment: the resumed episode
ends equal to the uninterrupted one, token for token, and the second call sees the first call's variable."""

from __future__ import annotations

import json

import pytest
from test_multiturn_rlvr import ScriptedGenerator

from open_instruct.environments import ToolEnvironment
from open_instruct.episodes import (
    EpisodeBudget,
    EpisodeTokenizer,
    episode_snapshot,
    episode_state,
    resume_environment,
    rollout_episodes,
)
from open_instruct.sandbox import python_runtime


def python_call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


SCRIPTS = [[python_call("x = 6 * 7")], [python_call("print(x)")], ["42"]]
EXAMPLE = {"messages": [{"role": "user", "content": "6*7="}], "ground_truth": "42", "verifier": "arithmetic"}


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def tokens(tiny_models):
    from open_instruct.models import load_tokenizer

    return EpisodeTokenizer(load_tokenizer(tiny_models["causal_lm"]))


def environment(tokens):
    return ToolEnvironment(tools=["python"], python_runtime=python_runtime, tokenizer=tokens.tokenizer,
                           python_session=True, verifier=lambda text, gt: float(text.strip() == gt))  # fmt: skip


def play(tokens, generator, envs, started=None, on_round=None):
    def generate_fn(requests, caps):
        out = generator.generate(requests, _config(), caps)
        return list(zip(out.response_ids, out.logprobs, out.weight_versions))

    budget = EpisodeBudget(max_turns=3, max_turn_tokens=120, max_response_tokens=400)
    return rollout_episodes(envs, [EXAMPLE], generate_fn, tokens, budget, started=started, on_round=on_round)


def _config():
    from open_instruct.generation import GenerationConfig

    return GenerationConfig(n=1)


def test_a_python_session_episode_resumes_from_its_snapshot(tokens):
    (reference,) = play(tokens, ScriptedGenerator(tokens.tokenizer, SCRIPTS), [environment(tokens)])
    assert len(reference.turns) == 3 and reference.tool_calls == 2 and reference.turns[-1].reward == 1.0
    assert "42" in tokens.decode(
        reference.response_ids[reference.turns[1].policy_end : reference.turns[1].observation_end]
    )

    saved = []

    def snapshot_then_die(episodes):  # the kill: after round 1's step, with the episode in play
        saved.append(json.dumps(episode_snapshot(episodes[0], env)))
        raise Stop

    env = environment(tokens)
    with pytest.raises(Stop):
        play(tokens, ScriptedGenerator(tokens.tokenizer, SCRIPTS), [env], on_round=snapshot_then_die)
    snapshot = json.loads(saved[0])
    assert snapshot["environment"]["python_cells"] == ["x = 6 * 7"] and snapshot["environment"]["calls_made"] == 1

    fresh = environment(tokens)
    episode = resume_environment(snapshot, fresh)
    (resumed,) = play(tokens, ScriptedGenerator(tokens.tokenizer, SCRIPTS[1:]), [fresh], started=[episode])
    assert episode_state(resumed) == episode_state(reference)


def test_the_guard_passes_the_state_through(tokens):
    """The driver's GuardedEnvironment saves and restores the wrapped environment's state, not its own."""
    from open_instruct.environments import GuardedEnvironment

    guarded = GuardedEnvironment(environment(tokens), "row 0", 5.0)
    guarded.reset({**EXAMPLE, "tools": ["python"]})
    state = guarded.state_dict()
    assert state == {"example": {**EXAMPLE, "tools": ["python"]}, "enabled": ["python"], "calls_made": 0,
                     "python_cells": []}  # fmt: skip
    other = GuardedEnvironment(environment(tokens), "row 0", 5.0)
    other.load_state_dict({**state, "calls_made": 3, "python_cells": ["y = 1"]})
    assert other.env.calls_made == 3 and other.env.python_cells == ["y = 1"] and other.tools == guarded.tools
