"""Environments for multi-turn RL: what the policy's turns are answered with, and what they earn.

An environment holds the state of ONE episode. The episode driver (`episodes.rollout_episodes`) calls

    observation = env.reset(example)                       # the dataset row -> the first observation (the prompt)
    observation, reward, done, info = env.step(action)     # the policy's turn, as text -> what comes back

until `done` (or a budget ends the episode). An observation is either a list of chat messages (rendered through the
chat template, e.g. `[{"role": "tool", "content": "42"}]`), or a plain string that continues the current assistant
message token for token (ReTool's `<output>` block), or None when the episode is over. `reward` is the turn's reward
(the outcome reward is the reward of the step that returns done=True); `info` is a dict whose counted keys are

    "tool_calls": int                 tool calls run in this step
    "tool_errors": list[str]          one reason per failed call: bad_tool_call, unknown_tool, calculator_error,
                                      python_<status> (the runtime's own non-"ok" status, e.g. python_timeout),
                                      python_crash (the runtime raised), python_hung (it overran its deadline)
    "truncated": list[str]            budgets that cut something in this step: max_tool_calls, tool_output_max_tokens
    "correct": bool                   on the final step, whether the verifier accepted the answer
    "metrics": dict[str, float]       on the final step, the episode's own numbers (logged as metric_<name>, each
                                      the mean over the episodes that report it)

An environment may also set `tools` (JSON schemas passed to the chat template as `tools=`) and override
`action_end(text)`: the character index where a turn's action is complete (the driver cuts the generated ids at the
first token that completes it, so the tool runs there instead of after the model has written on; an action that ends
with a fixed marker also names it in `stop_strings`, so the generator stops there instead of sampling on to the
turn's token budget: `episodes.shared_stop_strings`), and `score_group(group)`: called once the episodes of a row's
group have all ended, per episode a reward added to its last turn and an info dict merged into that turn's
(rewards that need the whole group, such as a rubric's group functions).

Naming one in a recipe: a registered name ("tool", "multi_turn") or an import path "package.module:Class" or
"/path/to/file.py:Class" (`make_environment`; `environment_for_row` reads a row's own `environment` column), so a
researcher adds an environment in their own file:

    from open_instruct.environments import Environment, StepResult

    class Guess(Environment):
        def reset(self, example):
            self.answer = example["ground_truth"]
            return example["messages"]
        def step(self, action):
            right = action.strip() == self.answer
            return StepResult(None if right else [{"role": "user", "content": "no"}], float(right), right, {})

Built in:
    ToolEnvironment (`tool`)          tools `calculator` (arithmetic over an `ast` whitelist, sizes bounded; never
                                      eval) and `python` (a runtime callable, e.g. the sandbox's); calls written
                                      Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen
                                      templates; results come back in the template's tool turn) or as fenced
                                      ```python blocks (ReTool; output returned inline in an <output> block). A turn
                                      without a tool call is the final answer, scored by the verifier.
    MultiTurnEnvironment (`multi_turn`) no tools: scripted follow-up user turns from the row, then the final answer
                                      is verified (optionally with retries on a wrong answer).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from open_instruct import integrations, rewards
from open_instruct.errors import ConfigError, DataError
from open_instruct.rewards import call_with_deadline
from open_instruct.user_code import load_module

Message = dict[str, Any]
Observation = Union[str, list[Message], None]
VerifierFn = Callable[[str, Any], float]
# The sandbox's python tool: (code, timeout_s) -> (stdout, stderr, status); status "ok" on success, else a short
# reason word ("timeout", "memory", "error", ...) that is counted as tool error python_<status>.
PythonRuntime = Callable[[str, float], tuple[str, str, str]]


class StepResult(NamedTuple):
    observation: Observation
    reward: float
    done: bool
    info: dict[str, Any]


class Environment:
    """One episode's environment. Subclasses implement `reset` and `step` (see the module docstring)."""

    tools: list[dict[str, Any]] = []
    # Strings whose first occurrence completes an action (action_end cuts right after it): the generator may stop there
    stop_strings: tuple[str, ...] = ()

    def reset(self, example: dict[str, Any]) -> Observation:
        raise NotImplementedError(f"{type(self).__name__} must implement reset(example)")

    def step(self, action: str) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(action)")

    def action_end(self, text: str) -> Optional[int]:
        """Index in `text` just after a complete action (the turn stops there), or None: the turn runs to its end
        token. Must be prefix-monotone: once a prefix of the turn has an action end, every longer one has it."""
        return None

    def state_dict(self) -> Optional[dict[str, Any]]:
        """The environment's state in the middle of an episode, JSON-able, for a snapshot of the episode
        (episodes.episode_snapshot); None (the default): nothing beyond what reset(example) rebuilds. An environment
        that keeps state across steps (a tool session, counters) returns it here and takes it back in
        load_state_dict, so an episode resumed from a snapshot continues as the uninterrupted one does."""
        return None

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Take back what state_dict returned (instead of reset: the episode continues)."""
        if state is not None:
            raise NotImplementedError(f"{type(self).__name__} saved a state but has no load_state_dict")

    def score_group(self, group: list[Environment]) -> Optional[list[tuple[float, dict[str, Any]]]]:
        """Called on a group's first environment once every episode of the group (the `num_samples_per_prompt`
        episodes of one row, `group` in order, this one first) has ended: per episode, a reward added to its last
        turn's and a dict merged into that turn's info; None (the default): nothing to add. For rewards that need
        the whole group (a rubric's group reward functions)."""
        return None


# -----------------------------------------------------------------------------------------------------------------
# Registry and import paths

ENVIRONMENTS: dict[str, type] = {}


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator: `@register_environment("tool")` makes the class available as make_environment("tool")."""
    key = name.strip().lower()

    def decorator(cls: type) -> type:
        if key in ENVIRONMENTS and ENVIRONMENTS[key] is not cls:
            raise ValueError(f"environment {key!r} is already registered (by {ENVIRONMENTS[key].__name__})")
        ENVIRONMENTS[key] = cls
        return cls

    return decorator


def environment_class(spec: str) -> type:
    """The class named by `spec`: a registered name, "package.module:Class", or "/path/to/file.py:Class".
    Raises ConfigError naming the spec when it cannot be found or is not an environment."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"environment must be a registered name or 'module:Class', got {spec!r}")
    spec = spec.strip()
    if ":" not in spec:
        if spec.lower() not in ENVIRONMENTS:
            raise ConfigError(
                f"unknown environment {spec!r}: registered are {sorted(ENVIRONMENTS)}, or give an import path "
                "'package.module:Class' or '/path/to/file.py:Class'"
            )
        return ENVIRONMENTS[spec.lower()]
    integration = integrations.find(spec, f"environment {spec!r}")
    if integration is not None and integration.environment_class is not None:  # an integration's environment
        return integration.environment_class(spec)
    module_name, _, class_name = spec.rpartition(":")
    module = load_module(module_name, f"environment {spec!r}")
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"environment {spec!r}: {module_name} has no class {class_name!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"environment {spec!r}: class {class_name} has no {' or '.join(missing)} method")
    return cls


def check_environment_config(spec: str, tools: Sequence[str], tool_call_format: str) -> type:
    """The recipe's `environment` resolved (its module imported: a user file runs here, before any model loads) and
    the tool list checked against it; ConfigError naming the key otherwise. Returns the class."""
    cls = environment_class(spec)  # a user file that fails to import: ConfigError naming it (user_code.load_module)
    if issubclass(cls, ToolEnvironment):
        unknown = sorted(set(tools) - set(TOOL_SCHEMAS))
        if unknown:
            raise ConfigError(f"tools: unknown {unknown} for environment {spec!r} (known: {sorted(TOOL_SCHEMAS)})")
        if tool_call_format == "fenced" and "python" not in tools:
            raise ConfigError("tool_call_format fenced runs ```python blocks: add python to tools")
    return cls


def make_environment(spec: str, **kwargs: Any) -> Environment:
    """A fresh environment (one per episode) from a registered name or import path, constructed with kwargs."""
    return environment_class(spec)(**kwargs)


def environment_for_row(row: dict[str, Any], default_spec: str, resources: dict[str, Any]) -> Environment:
    """The environment of one dataset row: the row's `environment` column when it has one, else `default_spec`.
    `resources` are the run's shared constructor arguments (tokenizer, python_runtime, budgets, ...); each class
    receives those its constructor names (or all of them if it takes **kwargs), so rows may mix environments."""
    cls = environment_class(row.get("environment") or default_spec)
    parameters = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        resources = {k: v for k, v in resources.items() if k in parameters}
    return cls(**resources)


# -----------------------------------------------------------------------------------------------------------------
# The user's environment code, checked: every call under a deadline, every return value's type


MESSAGE_ROLES = ("system", "user", "assistant", "tool")


def check_observation(observation: Any, allow_none: bool) -> Optional[str]:
    """Why `observation` is not one (None when it is): a non-empty string, a non-empty list of messages (dicts with
    a role of MESSAGE_ROLES and string content), or None where allowed (a step that ends the episode)."""
    if observation is None:
        return None if allow_none else "None (only a step may return None, and only when done)"
    if isinstance(observation, str):
        return None
    if not isinstance(observation, list) or not observation:
        return f"{type(observation).__name__} {observation!r:.80} (a string or a non-empty list of messages)"
    for i, message in enumerate(observation):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not a dict with role and content"
        if message.get("role") not in MESSAGE_ROLES:
            return f"message {i} has role {message.get('role')!r}, not one of {list(MESSAGE_ROLES)}"
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message["role"] == "assistant"):
            return f"message {i} ({message['role']}) has content {content!r:.80}, not a string"
    return None


class GuardedEnvironment(Environment):
    """An episode's environment (the user's class too) as the driver sees it: `reset` and `step` run under a
    deadline (`timeout_s`), and what they raise or return of the wrong type becomes a ConfigError naming the class,
    the method and the row (exit 2), not a traceback from deep in the rollout or a hang."""

    def __init__(self, env: Environment, where: str, timeout_s: float):
        self.env, self.where, self.timeout_s = env, where, timeout_s

    @property
    def tools(self) -> list[dict[str, Any]]:  # type: ignore[override]  # read after reset (a row may narrow them)
        return self.env.tools

    def _call(self, method: str, fn: Callable[[], Any]) -> Any:
        finished, result = call_with_deadline(fn, self.timeout_s)
        name = f"{type(self.env).__name__}.{method}"
        if not finished:
            raise ConfigError(f"environment {name} did not return within {self.timeout_s:g} s (environment_timeout) "
                              f"on {self.where}")  # fmt: skip
        if isinstance(result, Exception):
            raise ConfigError(f"environment {name} raised {type(result).__name__}: {result} on {self.where}")
        return result

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self._call("state_dict", self.env.state_dict) if hasattr(self.env, "state_dict") else None

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if hasattr(self.env, "load_state_dict"):
            self._call("load_state_dict", lambda: self.env.load_state_dict(state))
        elif state is not None:
            raise ConfigError(f"environment {type(self.env).__name__} saved a state but has no load_state_dict")

    def reset(self, example: dict[str, Any]) -> Observation:
        observation = self._call("reset", lambda: self.env.reset(example))
        problem = check_observation(observation, allow_none=False)
        if problem:
            raise ConfigError(f"environment {type(self.env).__name__}.reset returned {problem} on {self.where}")
        return observation

    def step(self, action: str) -> StepResult:
        result = self._call("step", lambda: self.env.step(action))
        name = f"environment {type(self.env).__name__}.step"
        if not isinstance(result, tuple) or len(result) != 4:
            raise ConfigError(
                f"{name} returned {result!r:.80}, not (observation, reward, done, info) (a StepResult) on {self.where}"
            )
        observation, reward, done, info = result
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ConfigError(f"{name} returned reward {reward!r}, not a finite number, on {self.where}")
        if not isinstance(done, bool):
            raise ConfigError(f"{name} returned done {done!r}, not True or False, on {self.where}")
        if info is not None and not isinstance(info, dict):
            raise ConfigError(f"{name} returned info {info!r:.80}, not a dict, on {self.where}")
        problem = check_observation(observation, allow_none=done)
        if problem:
            raise ConfigError(f"{name} returned observation {problem} on {self.where}")
        return StepResult(observation, float(reward), done, info or {})

    def action_end(self, text: str) -> Optional[int]:
        return self.env.action_end(text)

    def score_group(self, group: list[Environment]) -> Optional[list[tuple[float, dict[str, Any]]]]:
        score = getattr(self.env, "score_group", None)  # an environment need not subclass Environment
        if score is None:
            return None
        inner = [e.env if isinstance(e, GuardedEnvironment) else e for e in group]
        result = self._call("score_group", lambda: score(inner))
        name = f"environment {type(self.env).__name__}.score_group"
        if result is None:
            return None
        if not isinstance(result, (list, tuple)) or len(result) != len(group):
            raise ConfigError(f"{name} returned {result!r:.80}, not one (reward, info) per episode, on {self.where}")
        for reward, info in result:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ConfigError(f"{name} returned reward {reward!r}, not a finite number, on {self.where}")
            if not isinstance(info, dict):
                raise ConfigError(f"{name} returned info {info!r:.80}, not a dict, on {self.where}")
        return [(float(reward), info) for reward, info in result]

    @property
    def stop_strings(self) -> tuple[str, ...]:  # type: ignore[override]  # a user's class need not declare any
        return tuple(getattr(self.env, "stop_strings", ()))

    def __getattr__(self, name: str) -> Any:  # the environment's own attributes (e.g. a tool environment's tools)
        return getattr(self.__dict__["env"], name)


def guarded_environment_for_row(
    row: dict[str, Any], default_spec: str, resources: dict[str, Any], where: str, timeout_s: float
) -> GuardedEnvironment:
    """environment_for_row, its constructor's failure a ConfigError naming the class and the row, the environment
    guarded (GuardedEnvironment)."""
    cls = environment_class(row.get("environment") or default_spec)
    finished, env = call_with_deadline(lambda: environment_for_row(row, default_spec, resources), timeout_s)
    if not finished:
        raise ConfigError(f"environment {cls.__name__}.__init__ did not return within {timeout_s:g} s on {where}")
    if isinstance(env, Exception):
        raise ConfigError(f"environment {cls.__name__}.__init__ raised {type(env).__name__}: {env} on {where}")
    return GuardedEnvironment(env, where, timeout_s)


# -----------------------------------------------------------------------------------------------------------------
# Tools

MAX_EXPRESSION_CHARS = 2_000
MAX_RESULT_BITS = 4_096  # integers up to ~1233 digits: far past any arithmetic task, small enough to stay instant

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(Exception):
    """A tool call that failed for a reason the model caused; `reason` is the counted error name."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _number_bits(x: Union[int, float]) -> int:
    return abs(int(x)).bit_length() if isinstance(x, int) or math.isfinite(x) else MAX_RESULT_BITS + 1


def _calc(node: ast.AST) -> Union[int, float]:
    if isinstance(node, ast.Expression):
        return _calc(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_calc(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _calc(node.left), _calc(node.right)
        if isinstance(node.op, ast.Pow):
            # Bound the result's size before computing it: 9**9**9 would otherwise run for hours.
            if isinstance(right, int) and _number_bits(left) * abs(right) > MAX_RESULT_BITS and abs(left) > 1:
                raise ToolError("calculator_error", "result too large")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or _number_bits(result) > MAX_RESULT_BITS:
            raise ToolError("calculator_error", "result too large or not a real number")
        return result
    raise ToolError("calculator_error", f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / // % ** and parentheses, via an `ast` whitelist (never eval).
    Integers stay exact; a float result that is whole prints as an integer ("7/1" -> "7"). Raises ToolError
    (reason calculator_error) on anything else, on division by zero, and on results over MAX_RESULT_BITS."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("bad_tool_call", "calculator needs a non-empty 'expression' string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError("calculator_error", f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError("calculator_error", f"syntax error: {e.msg}") from None
    try:
        value = _calc(tree)
    except (ZeroDivisionError, OverflowError, ValueError) as e:
        raise ToolError("calculator_error", str(e) or type(e).__name__) from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (1234 * 5678) - 9"}},
            "required": ["expression"],
        },
    },
}
PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints (stdout) and its errors (stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a complete Python program"}},
            "required": ["code"],
        },
    },
}
TOOL_SCHEMAS = {"calculator": CALCULATOR_SCHEMA, "python": PYTHON_SCHEMA}


def session_program(cells: Sequence[str], code: str) -> str:
    """The program that runs `code` in a python session whose earlier cells were `cells`: they run first, in one
    namespace, their output discarded (the runtime is stateless: the session is its cells, replayed inside the
    sandbox each call, so it is as deterministic as they are and fits in a checkpoint)."""
    lines = ["import contextlib as _c, io as _io", "with _c.redirect_stdout(_io.StringIO()):"]
    lines += [f"    exec(compile({cell!r}, '<cell {i}>', 'exec'), globals())" for i, cell in enumerate(cells)] or [
        "    pass"
    ]
    return "\n".join(lines) + f"\nexec(compile({code!r}, '<cell {len(cells)}>', 'exec'), globals())\n"


def run_with_deadline(fn: Callable[[], Any], deadline_s: float) -> tuple[bool, Any]:
    """(finished, result) of fn() on a daemon thread, waiting at most deadline_s. An exception inside fn is the
    result. A call still running at the deadline is abandoned (threads cannot be killed; a daemon thread does not
    hold the process at exit), so a runtime should enforce its own timeout and this is the guard behind it."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["result"] = fn()
        except Exception as e:  # the runtime's failure becomes an error observation, not a crashed rollout
            box["result"] = e
        done.set()

    threading.Thread(target=target, daemon=True, name="tool-call").start()
    if not done.wait(deadline_s):
        return False, None
    return True, box["result"]


# -----------------------------------------------------------------------------------------------------------------
# Built-in environments


def _verify(verifier: Optional[VerifierFn], example: dict[str, Any], text: str, timeout_s: float) -> float:
    """The verifier's score of `text`: the given callable, else the row's `verifier` by name (time-limited)."""
    if verifier is not None:
        return float(verifier(text, example.get("ground_truth")))
    if "verifier" not in example or "ground_truth" not in example:
        raise DataError(f"environment row needs 'verifier' and 'ground_truth' (or a verifier callable): {example!r}")
    return rewards.run_verifier(example["verifier"], text, example["ground_truth"], timeout=timeout_s)[0]


def _first_messages(example: dict[str, Any], system_prompt: Optional[str]) -> list[Message]:
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"environment row needs a non-empty 'messages' list, got {messages!r}")
    messages = [dict(m) for m in messages]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


HERMES_CALL_END = "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED_PYTHON = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


@register_environment("tool")
class ToolEnvironment(Environment):
    """Tool use with a verified final answer. Each step: parse the turn's tool calls; none -> the turn is the final
    answer (reward = verifier score, done); some -> run them (at most max_tool_calls per episode; a call over the
    budget is answered with an error and not run) and return their outputs (reward tool_error_reward per failed
    call, else 0). Outputs longer than tool_output_max_tokens tokens are cut there (needs `tokenizer`).

    tool_format "hermes": calls are `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>`;
    results come back as one `{"role": "tool"}` message per call, rendered by the chat template (Qwen: inside
    `<tool_response>` in a user turn). A played turn ends at its first `</tool_call>` (`action_end`, `stop_strings`):
    the call runs there, so a model does not write on (or repeat the call) to its token budget, and a second call,
    which may use the first one's result, is the next turn's. `step` itself runs every call in the text it gets.
    tool_format "fenced" (ReTool): a turn that ends with a complete ```python block runs it (`python` tool
    required) and the output continues the same assistant message as "\\n<output>\\n...\\n</output>\\n"; the turn
    is cut right after the closing fence (`action_end`).

    A row may restrict the tools with a `tools` list of names (a subset of this environment's tools)."""

    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        tool_format: str = "hermes",
        python_runtime: Optional[PythonRuntime] = None,
        tokenizer: Any = None,
        max_tool_calls: int = 8,
        tool_output_max_tokens: Optional[int] = 256,
        tool_timeout_s: float = 10.0,
        tool_deadline_grace_s: float = 5.0,
        tool_error_reward: float = 0.0,
        verifier: Optional[VerifierFn] = None,
        verifier_timeout_s: float = 2.0,
        system_prompt: Optional[str] = None,
        python_session: bool = False,
    ):
        unknown = sorted(set(tools) - set(TOOL_SCHEMAS))
        if unknown or not tools:
            raise ConfigError(f"tools: unknown {unknown} (known: {sorted(TOOL_SCHEMAS)})" if unknown else "tools: none")
        if tool_format not in ("hermes", "fenced"):
            raise ConfigError(f"tool_format must be 'hermes' or 'fenced', got {tool_format!r}")
        if tool_format == "fenced" and "python" not in tools:
            raise ConfigError("tool_format 'fenced' runs ```python blocks: add 'python' to tools")
        if "python" in tools and python_runtime is None:  # the default: the sandbox (no network, no run files)
            from open_instruct.sandbox import python_runtime
        if max_tool_calls < 0:
            raise ConfigError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        if tool_output_max_tokens is not None and (tool_output_max_tokens < 1 or tokenizer is None):
            raise ConfigError(f"tool_output_max_tokens={tool_output_max_tokens} needs a value >= 1 and a tokenizer")
        if tool_timeout_s <= 0 or tool_deadline_grace_s < 0:
            raise ConfigError(
                f"tool_timeout_s must be > 0 and tool_deadline_grace_s >= 0, got "
                f"{tool_timeout_s}, {tool_deadline_grace_s}"
            )
        self.all_tools = tuple(tools)
        self.tool_format = tool_format
        self.python_runtime = python_runtime
        self.tokenizer = tokenizer
        self.max_tool_calls = max_tool_calls
        self.tool_output_max_tokens = tool_output_max_tokens
        self.tool_timeout_s = tool_timeout_s
        self.tool_deadline_grace_s = tool_deadline_grace_s
        self.tool_error_reward = tool_error_reward
        self.verifier = verifier
        self.verifier_timeout_s = verifier_timeout_s
        self.system_prompt = system_prompt
        self.enabled = self.all_tools
        self.tools = [TOOL_SCHEMAS[t] for t in self.enabled] if tool_format == "hermes" else []
        self.stop_strings = (HERMES_CALL_END,) if tool_format == "hermes" else ()
        self.python_session = python_session
        self.example: dict[str, Any] = {}
        self.calls_made = 0
        self.python_cells: list[str] = []  # the session's earlier cells that ran without error (python_session)

    def reset(self, example: dict[str, Any]) -> Observation:
        self.example, self.calls_made, self.python_cells = example, 0, []
        row_tools = example.get("tools")
        if row_tools is not None:
            outside = sorted(set(row_tools) - set(self.all_tools))
            if outside:
                raise DataError(f"row asks for tools {outside} that this environment lacks ({list(self.all_tools)})")
            self.enabled = tuple(t for t in self.all_tools if t in row_tools)
        else:
            self.enabled = self.all_tools
        if self.tool_format == "hermes":
            self.tools = [TOOL_SCHEMAS[t] for t in self.enabled]
        return _first_messages(example, self.system_prompt)

    def state_dict(self) -> dict[str, Any]:
        """The episode's example, enabled tools, calls made and python session (its cells so far)."""
        return {"example": self.example, "enabled": list(self.enabled), "calls_made": self.calls_made,
                "python_cells": list(self.python_cells)}  # fmt: skip

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        self.example, self.calls_made = state["example"], int(state["calls_made"])
        self.enabled, self.python_cells = tuple(state["enabled"]), list(state["python_cells"])
        if self.tool_format == "hermes":
            self.tools = [TOOL_SCHEMAS[t] for t in self.enabled]

    def action_end(self, text: str) -> Optional[int]:
        if self.tool_format == "hermes":
            end = text.find(HERMES_CALL_END)
            return None if end < 0 else end + len(HERMES_CALL_END)
        match = _FENCED_PYTHON.search(text)
        return match.end() if match else None

    def step(self, action: str) -> StepResult:
        calls = self._parse_calls(action)
        if calls is None:
            score = _verify(self.verifier, self.example, action, self.verifier_timeout_s)
            return StepResult(
                None, score, True, {"tool_calls": 0, "tool_errors": [], "truncated": [], "correct": score >= 1.0}
            )
        outputs, errors, truncated, ran = [], [], [], 0
        for call in calls:
            if self.calls_made >= self.max_tool_calls:
                truncated.append("max_tool_calls")
                outputs.append(f"Error: tool call budget exhausted (max_tool_calls={self.max_tool_calls})")
                continue
            self.calls_made += 1
            ran += 1
            try:
                out = self._run(call)
            except ToolError as e:
                errors.append(e.reason)
                out = f"Error ({e.reason}): {e}"
            outputs.append(self._truncate(out, truncated))
        reward = self.tool_error_reward * len(errors)
        info = {"tool_calls": ran, "tool_errors": errors, "truncated": truncated}
        if self.tool_format == "fenced":
            return StepResult(f"\n<output>\n{outputs[0]}\n</output>\n", reward, False, info)
        return StepResult([{"role": "tool", "content": out} for out in outputs], reward, False, info)

    def _parse_calls(self, action: str) -> Optional[list[Union[dict[str, Any], ToolError]]]:
        """The turn's tool calls (a ToolError stands for an unparseable one), or None for a final answer."""
        if self.tool_format == "fenced":
            match = None
            for match in _FENCED_PYTHON.finditer(action):
                pass
            if match is None or action[match.end() :].strip():
                return None  # no block, or text after the last block: the model answered
            return [{"name": "python", "arguments": {"code": match.group(1)}}]
        bodies = HERMES_CALL.findall(action)
        if not bodies:
            return None
        calls: list[Union[dict[str, Any], ToolError]] = []
        for body in bodies:
            try:
                call = json.loads(body)
                args = call.get("arguments", {}) if isinstance(call, dict) else None
                args = json.loads(args) if isinstance(args, str) else args  # some models send a JSON string
                if not isinstance(call.get("name"), str) or not isinstance(args, dict):
                    raise ValueError("needs a string 'name' and an object 'arguments'")
                calls.append({"name": call["name"], "arguments": args})
            except (ValueError, AttributeError) as e:
                calls.append(ToolError("bad_tool_call", f"could not parse tool call: {e}"))
        return calls

    def _run(self, call: Union[dict[str, Any], ToolError]) -> str:
        if isinstance(call, ToolError):
            raise call
        name, args = call["name"], call["arguments"]
        if name not in self.enabled:
            raise ToolError("unknown_tool", f"no tool {name!r}; available: {list(self.enabled)}")
        expected = "expression" if name == "calculator" else "code"
        if set(args) != {expected} or not isinstance(args[expected], str):
            raise ToolError("bad_tool_call", f"{name} takes one string argument {expected!r}, got {sorted(args)}")
        if name == "calculator":
            return calculate(args["expression"])
        return self._run_python(args["code"])

    def _run_python(self, code: str) -> str:
        timeout = self.tool_timeout_s
        program = session_program(self.python_cells, code) if self.python_session else code
        finished, result = run_with_deadline(
            lambda: self.python_runtime(program, timeout), timeout + self.tool_deadline_grace_s
        )
        if not finished:
            waited = timeout + self.tool_deadline_grace_s
            raise ToolError(
                "python_hung", f"the python runtime did not return within {waited:g}s (timeout {timeout:g}s)"
            )
        if isinstance(result, Exception):
            raise ToolError("python_crash", f"the python runtime failed: {type(result).__name__}: {result}")
        stdout, stderr, status = result
        text = stdout + (("\n" if stdout and not stdout.endswith("\n") else "") + stderr if stderr else "")
        if status != "ok":
            raise ToolError(f"python_{status}", text.strip() or status)
        if self.python_session:
            self.python_cells.append(code)
        return text

    def _truncate(self, text: str, truncated: list[str]) -> str:
        if self.tool_output_max_tokens is None:
            return text
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.tool_output_max_tokens:
            return text
        truncated.append("tool_output_max_tokens")
        kept = self.tokenizer.decode(ids[: self.tool_output_max_tokens])
        return f"{kept}\n[output truncated: {len(ids)} tokens, first {self.tool_output_max_tokens} shown]"


@register_environment("multi_turn")
class MultiTurnEnvironment(Environment):
    """A conversation without tools in which only the final answer is verified. The row's `follow_ups` (a list of
    user messages, possibly empty) are sent after the first turns, one per turn (reward 0); the turn after the last
    follow-up is the answer: reward = verifier score. With max_attempts > 1 a wrong answer is answered with
    `retry_message` and the policy answers again (each wrong attempt rewards 0), until right or out of attempts."""

    def __init__(
        self,
        verifier: Optional[VerifierFn] = None,
        verifier_timeout_s: float = 2.0,
        max_attempts: int = 1,
        retry_message: str = "That is not correct. Please try again.",
        system_prompt: Optional[str] = None,
    ):
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
        self.verifier, self.verifier_timeout_s = verifier, verifier_timeout_s
        self.max_attempts, self.retry_message, self.system_prompt = max_attempts, retry_message, system_prompt
        self.example: dict[str, Any] = {}
        self.pending: list[str] = []
        self.attempts = 0

    def reset(self, example: dict[str, Any]) -> Observation:
        follow_ups = example.get("follow_ups") or []
        if not isinstance(follow_ups, list) or not all(isinstance(f, str) for f in follow_ups):
            raise DataError(f"'follow_ups' must be a list of strings, got {follow_ups!r}")
        self.example, self.pending, self.attempts = example, list(follow_ups), 0
        return _first_messages(example, self.system_prompt)

    def step(self, action: str) -> StepResult:
        if self.pending:
            return StepResult([{"role": "user", "content": self.pending.pop(0)}], 0.0, False, {})
        self.attempts += 1
        score = _verify(self.verifier, self.example, action, self.verifier_timeout_s)
        if score >= 1.0 or self.attempts >= self.max_attempts:
            return StepResult(None, score, True, {"correct": score >= 1.0})
        return StepResult([{"role": "user", "content": self.retry_message}], score, False, {"correct": False})
