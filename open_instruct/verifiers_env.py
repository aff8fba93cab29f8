"""Prime Intellect `verifiers` environments (the earlier API: a module's `load_environment()` returning a
`SingleTurnEnv`, `MultiTurnEnv` or `ToolEnv` with a `Rubric`; verifiers 0.1.x-0.2.x, and 0.3.x's `verifiers.legacy`)
played as this repo's multi-turn environments (environments.py), scored by their own rubric.

    --dataset_name_or_path 'verifiers:my_env.py?n=200' --environment 'verifiers:my_env.py?n=200'

`verifiers:<module or path/to/file.py>[?key=value&...]`: the module is imported (user_code.load_module) and its
`load_environment(**kwargs)` called once per process (values read as JSON, else as text). As a dataset source it
gives the environment's `dataset` (split `train`) or `eval_dataset` (any other split) as rows; as the environment it
plays each row's episode. The policy's turns come from the run's own generator, token-in/token-out (episodes.py):
the adapter never asks a model client for a turn. It drives the environment's own protocol:

    reset:  init_state(row) + setup_state -> the prompt messages (and tool schemas) the policy sees
    step:   the turn's text -> an assistant message (Hermes `<tool_call>{...}</tool_call>` blocks -> its tool_calls
            when the environment has tools) -> add_model_response -> is_completed (the environment's own stop
            conditions: max_turns, no tool called, final_env_response, ...) -> else get_prompt_messages (its
            env_response: tool results, a user turn) -> the new messages are the observation
    group:  when a prompt's episodes have all ended (Environment.score_group), the rubric's score_group over them:
            individual and group reward functions with their weights; the reward is added to each episode's last
            turn, each function's value logged (`train/metric_<name>`), `correct` = reward >= pass_threshold.

The environment's code (tools, reward functions, env_response) runs in the trainer's process on one event loop
thread, each call under `environment_timeout` (environments.GuardedEnvironment).

Under verifiers 0.4.x (verifiers.v1 only) the same spec is a v1 taskset module instead: verifiers_v1.py loads it and
verifiers_v1_play.py plays its episodes (`v1_installed` picks: verifiers_v1_play.py registers the `verifiers:`
prefix for both APIs, open_instruct/integrations.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import threading
import time
import urllib.parse
from typing import Any, Optional

from open_instruct.errors import ConfigError, DataError
from open_instruct.rewards import GroundTruthError, register_verifier
from open_instruct.user_code import load_module

PREFIX = "verifiers:"
VERIFIER = "verifiers_env"  # the rows' `dataset` column: scored by the environment's rubric, never by a verifier
INSTALL_HINT = "verifiers environments need verifiers: pip install verifiers==0.4.0 (verifiers.v1) or ==0.3.1"
MODEL_NAME = "policy"  # what the environment's state records as the model
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # the tool environment's call format

_ENVS: dict[str, Any] = {}
_CLASSES: dict[str, type] = {}
_LOCK = threading.Lock()
_LOOP: Optional[asyncio.AbstractEventLoop] = None


def verifiers_env_row(ground_truth: Any) -> dict[str, Any]:
    """The environment's dataset row a verifiers_env ground truth holds (its JSON), or GroundTruthError."""
    try:
        row = json.loads(ground_truth) if isinstance(ground_truth, str) else None
    except ValueError:
        row = None
    if not isinstance(row, dict):
        raise GroundTruthError(f"a verifiers_env ground truth is its environment row's JSON, got {ground_truth!r:.80}")
    return row


@register_verifier(VERIFIER)
def verify_verifiers_env(completion: str, ground_truth: Any) -> float:
    """Rows of a verifiers environment are scored by its rubric inside the episode; this name only marks them. The
    load-time check (an empty completion) reads the ground truth; a completion scored here means the run plays no
    environment, which is a configuration error."""
    verifiers_env_row(ground_truth)
    if completion:
        raise ValueError("verifiers_env rows are scored by their environment: run with --environment verifiers:...")
    return 0.0


def parse(spec: str, where: str = "environment") -> tuple[str, dict[str, Any]]:
    """(module or file, load_environment's keyword arguments) of `verifiers:<target>[?key=value&...]`."""
    target, _, query = spec.strip()[len(PREFIX) :].partition("?")
    if not target:
        raise ConfigError(f"{where} {spec!r}: name a module or a .py file after 'verifiers:'")
    kwargs: dict[str, Any] = {}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise ConfigError(f"{where} {spec!r}: arguments after '?' must be key=value&key=value ({e})") from None
    for key, value in pairs:
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value
    return target, kwargs


def v1_installed() -> bool:
    """Whether the installed verifiers is 0.4.x, which has only verifiers.v1: a `verifiers:` spec then runs through
    verifiers_v1.py (its episodes driven by the env's harness), not this module's reset/step adapter."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - the standard library has it
        return False
    try:
        return version("verifiers").startswith("0.4")
    except PackageNotFoundError:
        return False


class PlayedByItsHarness:
    """The environment class a `verifiers:` spec resolves to under verifiers 0.4: v1 episodes are driven by their
    harness (verifiers_v1.V1Run plays them), so the reset/step contract refuses, saying so."""

    def __init__(self, **_: Any) -> None:
        raise ConfigError(
            "a verifiers.v1 environment is played by its own harness: mix it with no other environment "
            "in one run (the recipe's environment and every row's must be the same verifiers: spec)"
        )

    reset = step = __init__


def _verifiers(where: str) -> Any:
    """The earlier API's package (`import verifiers as vf`: 0.1.x and 0.2.x at the top level, 0.3.x in
    verifiers.legacy answering at the same names); ConfigError when it is missing or has only verifiers.v1."""
    try:
        import verifiers
    except ImportError:
        raise ConfigError(f"{where}: {INSTALL_HINT}") from None
    try:
        from verifiers import MultiTurnEnv  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{where}: verifiers {getattr(verifiers, '__version__', '?')} ships only verifiers.v1 (Env, Taskset, "
            f"Harness) and is not 0.4.x, the v1 release supported here (docs/environments.md); {INSTALL_HINT}"
        ) from None
    return verifiers


def load(spec: str, where: str = "environment") -> Any:
    """The spec's verifiers environment, loaded once per process (its module imported, load_environment called)."""
    spec = spec.strip()
    with _LOCK:
        if spec in _ENVS:
            return _ENVS[spec]
        vf = _verifiers(f"{where} {spec!r}")
        target, kwargs = parse(spec, where)
        module = load_module(target, f"{where} {spec!r}")
        loader = getattr(module, "load_environment", None)
        if not callable(loader):
            raise ConfigError(f"{where} {spec!r}: {target} has no load_environment() function")
        try:
            env = loader(**kwargs)
        except Exception as e:
            raise ConfigError(f"{where} {spec!r}: load_environment({kwargs}) raised {type(e).__name__}: {e}") from None
        if not isinstance(env, vf.MultiTurnEnv):  # SingleTurnEnv and ToolEnv are MultiTurnEnvs
            raise ConfigError(
                f"{where} {spec!r}: load_environment() returned a {type(env).__name__}; supported are SingleTurnEnv, "
                "MultiTurnEnv, ToolEnv and their subclasses (an EnvGroup is not)"
            )
        _ENVS[spec] = env
        return env


# -----------------------------------------------------------------------------------------------------------------
# The environment's dataset as RL rows


def generate(source: str, split: str) -> list[dict[str, Any]]:
    """The rows of `source`: its environment's `dataset` (split `train`) or `eval_dataset` (any other split). Each
    row: `messages` (the environment's formatted prompt: system prompt and few-shot included), `ground_truth` (the
    rest of the dataset row, JSON: answer, info, example_id, task, other columns; the rubric receives them),
    `dataset` verifiers_env and `environment` the source (so each row is played by its own environment)."""
    env = load(source, "dataset_name_or_path")
    data = env.build_dataset() if split == "train" else env.build_eval_dataset()
    if data is None:
        which = "dataset" if split == "train" else "eval_dataset"
        raise DataError(f"verifiers environment {source!r} has no {which} (split {split!r})")
    rows = []
    for index, row in enumerate(data.to_list()):
        where = f"verifiers environment {source!r} row {index}"
        messages = _prompt_messages(row.get("prompt"), where)
        rest = {k: v for k, v in row.items() if k != "prompt"}
        try:
            truth = json.dumps(rest, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: its columns are not JSON ({e})") from None
        rows.append({"messages": messages, "ground_truth": truth, "dataset": VERIFIER, "environment": source.strip(),
                     "id": f"{source.strip()}-{row.get('example_id', index)}"})  # fmt: skip
    return rows


def _prompt_messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: prompt {prompt!r:.80} is not a list of chat messages (completion-style "
                        "environments are not supported)")  # fmt: skip
    return [{"role": m["role"], "content": _text(m.get("content"), where)} for m in prompt]


# -----------------------------------------------------------------------------------------------------------------
# Messages between this repo (dicts, token ids) and verifiers (pydantic messages)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the text of a list of text parts (images are not supported)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise DataError(f"{where}: a message part of type {kind!r} (only text is supported)")
        parts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(parts)


def message_dicts(messages: list[Any], where: str) -> list[dict[str, str]]:
    """verifiers messages as the chat-template messages an observation is (role and text)."""
    out = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{where}: a {role!r} message (text-completion messages are not supported)")
        out.append({"role": role, "content": _text(m.get("content"), where)})
    return out


def tool_schemas(tool_defs: list[Any]) -> list[dict[str, Any]]:
    """verifiers' provider-agnostic tool definitions as the OpenAI function schemas chat templates take."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tool_defs
    ]


def assistant_message(text: str, with_tools: bool, turn: int) -> Any:
    """The policy's turn as verifiers' ResponseMessage: with tools, each `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>` block becomes a tool call (ids call_<turn>_<i>; a block that does not parse is passed on
    with its raw text as arguments, so the environment's own error handling answers it) and the text outside the
    blocks the content, as an OpenAI-compatible server's Hermes parser returns them."""
    from verifiers.types import ResponseMessage, ToolCall

    calls = []
    if with_tools:
        for i, body in enumerate(HERMES_CALL.findall(text)):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            except (ValueError, TypeError, KeyError):
                name, arguments = "", body.strip()
            calls.append(ToolCall(id=f"call_{turn}_{i}", name=str(name), arguments=arguments))
        if calls:
            text = HERMES_CALL.sub("", text).strip()
    return ResponseMessage(
        content=text, tool_calls=calls or None, finish_reason="tool_calls" if calls else "stop", is_truncated=False
    )


# -----------------------------------------------------------------------------------------------------------------
# The episode


def run(coroutine: Any) -> Any:
    """A verifiers coroutine run to its end on the adapter's one event loop (a daemon thread), from any thread."""
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, daemon=True, name="verifiers-env").start()
    return asyncio.run_coroutine_threadsafe(coroutine, _LOOP).result()


class ModelCallRefused(RuntimeError):
    """An environment asked its model client for a response (module docstring: the generator samples every turn)."""


@functools.lru_cache(maxsize=1)
def _generator_owned_client_class() -> type:
    from verifiers.clients.client import Client

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ModelCallRefused(
            "this verifiers environment called its model client itself (get_model_response from its own hooks); "
            "the policy's turns come from the run's generator (token-in/token-out), so that is not supported"
        )

    methods = ("setup_client", "to_native_tool", "to_native_prompt", "get_native_response",
               "raise_from_native_response", "from_native_response", "close")  # fmt: skip
    return type("GeneratorOwnedClient", (Client,), dict.fromkeys(methods, refuse))


def generator_owned_client() -> Any:
    """The model client the environment's state holds: every method refuses, since the run's generator samples each
    turn; an environment that asks the model itself stops the run saying so, instead of training on text sampled
    elsewhere."""
    return _generator_owned_client_class()(None)


def _recorded(error: BaseException, state: Any) -> None:
    """A verifiers error of the environment's own hooks, recorded as its rollout loop records it (its has_error stop
    ends the episode); a refused model call, which verifiers wraps in its ModelError, stops the run instead."""
    cause: Optional[BaseException] = error
    while cause is not None:
        if isinstance(cause, ModelCallRefused):
            raise ModelCallRefused(str(cause)) from None
        cause = cause.__cause__ or cause.__context__
    state["error"] = error


class VerifiersEnvironment:
    """One episode of a verifiers environment (module docstring). `environment_class` makes a subclass per spec. It
    has environments.Environment's interface (reset, step, tools, action_end, score_group) without importing it:
    environments.py imports this module when a spec names verifiers, and the module graph stays acyclic."""

    source: str = ""
    tools: list[dict[str, Any]] = []

    def __init__(self) -> None:
        self.vf_env = load(self.source)
        self.state: Any = None
        self.prompt: list[Any] = []  # the messages the policy's current turn answers (verifiers objects)
        self.finished = False

    def action_end(self, text: str) -> Optional[int]:
        return None  # a turn runs to its end token (tool calls are read from the whole turn, as verifiers does)

    def reset(self, example: dict[str, Any]) -> list[dict[str, str]]:
        row = verifiers_env_row(example.get("ground_truth"))
        row["prompt"] = [dict(m) for m in example["messages"]]
        self.state = run(self.vf_env.init_state(row, generator_owned_client(), MODEL_NAME, None))
        self.finished = False
        self.state["timing"].generation.start = time.time()
        setup = run(self._setup())
        self.state = setup if setup is not None else self.state
        self.prompt = list(self.state["prompt"])
        self.tools = tool_schemas(self.state["tool_defs"])
        return message_dicts(self.prompt, f"{self.source} reset")

    async def _setup(self) -> Any:
        import verifiers as vf

        try:
            return await self.vf_env.setup_state(self.state)
        except vf.Error as e:
            _recorded(e, self.state)
            return None

    def step(self, action: str) -> tuple[Optional[list[dict[str, str]]], float, bool, dict[str, Any]]:
        if self.state is None or self.finished:
            raise RuntimeError(f"{type(self).__name__}.step {'before reset' if self.state is None else 'after done'}")
        import verifiers as vf
        from verifiers.types import Response
        from verifiers.utils.message_utils import maybe_normalize_messages

        turn = len(self.state["trajectory"])
        message = assistant_message(action, bool(self.tools), turn)
        response = Response(id=f"turn-{turn}", created=int(time.time()), model=MODEL_NAME, message=message)
        run(self.vf_env.add_model_response(self.state, self.prompt, response))
        info = {"tool_calls": len(message.tool_calls or [])}
        if run(self.vf_env.is_completed(self.state)):
            return self._finish(info)
        seen = len(self.prompt) + len(self.state["trajectory"][-1]["completion"])
        try:
            prompt = maybe_normalize_messages(run(self.vf_env.get_prompt_messages(self.state)), field_name="prompt")
        except vf.Error as e:  # e.g. a tool error the environment stops on (ToolEnv's stop_errors)
            _recorded(e, self.state)
            return self._finish(info)
        if self.state.get("final_env_response") is not None:
            return self._finish(info)  # the final response ends the rollout unseen by the policy, as in verifiers
        observation = message_dicts(list(prompt[seen:]), f"{self.source} env_response")
        self.prompt = list(prompt)
        if not observation:
            raise RuntimeError(f"{self.source}: env_response returned no messages for an episode that goes on")
        return observation, 0.0, False, info

    def _finish(self, info: dict[str, Any]) -> tuple[None, float, bool, dict[str, Any]]:
        self.end(truncated=False)
        return None, 0.0, True, info  # the reward comes with the group's scores (score_group)

    def end(self, truncated: bool) -> None:
        """The rollout's end as verifiers renders it (cleanup: the completion, the environment's handlers); a run
        budget that cut the episode marks it truncated, as a max_tokens cut does in verifiers."""
        if self.finished:
            return
        self.finished = True
        if truncated:
            self.state["is_truncated"] = True
            self.state["is_completed"] = True
            self.state["stop_condition"] = "run_budget"
        run(self.vf_env.cleanup(self.state))

    def score_group(self, group: list[Any]) -> list[tuple[float, dict[str, Any]]]:
        """The rubric over the group's rollouts (score_group: individual and group reward functions, weighted), as
        verifiers scores a group; per episode (reward, {"metrics": each function's value, "correct": ...})."""
        envs = [e for e in group if isinstance(e, VerifiersEnvironment)]
        if len(envs) != len(group) or any(e.state is None for e in envs):
            raise RuntimeError(f"{self.source}: score_group needs the group's reset verifiers environments")
        for env in envs:
            env.end(truncated=True)  # no-op for those the environment ended
        states = [e.state for e in envs]
        rubric = self.vf_env.rubric
        run(rubric.score_group(states) if self.vf_env.score_rollouts else rubric.dummy_score_group(states))
        for state in states:
            run(rubric.cleanup(state))
        out = []
        for state in states:
            reward = float(state["reward"])
            metrics = {str(k): float(v) for k, v in (state["metrics"] or {}).items()}
            if not math.isfinite(reward) or not all(map(math.isfinite, metrics.values())):
                raise RuntimeError(f"{self.source}: the rubric gave a reward that is not finite ({reward}, {metrics})")
            out.append((reward, {"metrics": metrics, "correct": reward >= self.vf_env.pass_threshold}))
        return out


def environment_class(spec: str) -> type:
    """The environment class of `verifiers:<target>[?...]`, one per spec (its environment loaded now, so a bad spec
    or a failing load_environment stops the run before any model loads)."""
    spec = spec.strip()
    if v1_installed():
        return PlayedByItsHarness
    load(spec)
    with _LOCK:
        if spec not in _CLASSES:
            _CLASSES[spec] = type(f"Verifiers[{parse(spec)[0]}]", (VerifiersEnvironment,), {"source": spec})
        return _CLASSES[spec]
