"""Multi-turn episodes kept as token ids from end to end (token-in/token-out), their rewards, GAE, and the driver
that plays a batch of them against their environments.

An episode is `prompt_ids` then a *response*: each turn's generated ids appended VERBATIM, then the observation's
ids, and so on. Generated ids are never decoded and re-encoded: decode->encode is not the identity (a BPE tokenizer
re-merges a sampled non-canonical split, "a"+"b" -> "ab"; templates strip or rewrite earlier turns), and training on
re-encoded ids scores tokens the sampler never produced. Per response token the episode keeps

    loss_mask         1 on policy (generated) tokens, 0 on observation tokens: observation tokens never enter the
                      policy loss, KL, entropy, value loss or the sampler log-prob comparison
    sampler_logprobs  the sampler's log-prob of each policy token (0.0 on observation tokens)
    weight_versions   the weight version that sampled each policy token (-1 on observation tokens)

Observation ids (`EpisodeTokenizer.observation_ids`), by PREFIX DIFFERENCE through the chat template: render a
fixed base conversation [user, assistant] with and without the new messages (the longer one with the generation
prompt), tokenize both, and keep the ids of the longer one after its k-th end-of-turn token, k being how many the
base render has (the assistant's end of turn). What is kept is exactly what the
template puts after an assistant turn: the separator after the end-of-turn token (ChatML's "\\n"), the tool/user
turn, and the next assistant header, so the next turn starts where the model expects. Why this way:
  * only the new message is tokenized; the policy's own ids are never re-rendered, so thinking-stripping templates
    (Qwen3 drops earlier <think> blocks on re-render) and BPE re-merges cannot change them;
  * a fixed short base makes each observation O(its length), not O(history) as re-rendering the conversation is;
  * the cut is located by counting end-of-turn tokens in the base render, not by requiring the shorter render to
    be a prefix of the longer one: templates that render the *last* assistant message differently (Qwen3 adds an
    empty think block to it) break the plain prefix test but not this count.
  * the ids come from tokenizing the whole render, so merges inside the observation are the template's own.
Limits: the template must render a message independently of the conversation before it (true for ChatML/Qwen,
Llama 3, the tiny template; a template that numbers turns or reorders messages breaks it), and must end an assistant
turn with `turn_end_id` (default: the tokenizer's EOS); a turn that stopped without it (a token budget, an action
end) is closed with one `turn_end_id` as an observation token. The ids after a prior turn can differ from what a
full re-render would give (e.g. Qwen3 at inference drops old <think> blocks); the policy is trained on exactly what
it was conditioned on, which is the token-in/token-out point. A text observation (ReTool's `<output>` block)
continues the same assistant message and is tokenized alone. Tool output is tokenized like any rendered text, so
a special token's text inside it (a printed "<|im_end|>") becomes that token, as in an inference server's chat API.

Rewards across turns (`token_rewards`): each turn's reward from `env.step` (the final step's is the outcome).
turn_reward_aggregation "sum": every turn's reward on that turn's last policy token (the episode score is the sum);
"last": only the last turn's reward, on the episode's last policy token (a budget-truncated episode's last turn is
then whatever that turn earned, usually 0). The per-token rewards of an episode sum to its score either way.

GAE across turns (`rl_algorithms.multi_turn_gae`, with the other estimators' math): observation tokens get no reward,
no advantage, no value target; the recursion runs over the policy tokens only, in order, as if the observations were
not there (gamma and lambda are applied per policy token, so a long tool output does not discount the answer that
follows it).
"""

from __future__ import annotations

import collections
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch

from open_instruct.environments import Environment, Observation, StepResult
from open_instruct.errors import ConfigError

# generate_fn(token id lists, max new tokens per request) -> per request (ids, logprobs) or (ids, logprobs, versions)
GenerateFn = Callable[[list[list[int]], list[int]], Sequence[tuple]]
TURN_REWARD_AGGREGATIONS = ("sum", "last")


# -----------------------------------------------------------------------------------------------------------------
# Tokenizing prompts and observations


class EpisodeTokenizer:
    """Prompt and observation ids through the chat template (prefix difference, module docstring), and decoding.
    `chat_template_kwargs` go to every apply_chat_template call (e.g. {"enable_thinking": False})."""

    BASE = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "0"}]

    def __init__(self, tokenizer: Any, turn_end_id: Optional[int] = None, chat_template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.turn_end_id = tokenizer.eos_token_id if turn_end_id is None else turn_end_id
        if self.turn_end_id is None:
            raise ConfigError("the tokenizer has no eos_token_id: pass turn_end_id (the token that ends a turn)")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._base_turn_ends: dict[str, int] = {}

    def render_ids(self, messages: list[dict], tools: Optional[list[dict]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, observation: Observation, tools: Optional[list[dict]] = None) -> list[int]:
        """The first observation: messages through the template with the generation prompt, or plain text."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation)["input_ids"])
        if not observation:
            raise ValueError(f"reset() must return messages or text, got {observation!r}")
        return self.render_ids(observation, tools, add_generation_prompt=True)

    def observation_ids(
        self, observation: Observation, turn_closed: bool, tools: Optional[list[dict]] = None
    ) -> list[int]:
        """Ids of an observation appended after a policy turn. Messages: the prefix difference (module docstring),
        preceded by `turn_end_id` when the turn did not close itself (`turn_closed` False). Text: its own ids,
        appended as they are (after a turn that closed itself too: the environment chose to continue it)."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"])
        if not observation:
            raise ValueError(f"step() returned no observation for an episode that is not done: {observation!r}")
        key = json.dumps(tools, sort_keys=True)
        if key not in self._base_turn_ends:
            count = self.render_ids(self.BASE, tools, add_generation_prompt=False).count(self.turn_end_id)
            if count == 0:
                raise ConfigError(f"the chat template never emits turn_end_id {self.turn_end_id} after a turn")
            self._base_turn_ends[key] = count
        full = self.render_ids(self.BASE + list(observation), tools, add_generation_prompt=True)
        cut, seen = None, 0
        for i, token in enumerate(full):
            seen += token == self.turn_end_id
            if seen == self._base_turn_ends[key]:
                cut = i + 1
                break
        suffix = full[cut:] if cut is not None else []
        rendered = self.tokenizer.decode(suffix)
        for message in observation:
            content = str(message.get("content") or "").strip()
            if content and content not in rendered:
                raise ValueError(
                    f"the chat template does not render the {message.get('role')!r} message after the assistant's "
                    f"end of turn (prefix difference gave {rendered!r}); this template is not supported"
                )
        return ([] if turn_closed else [self.turn_end_id]) + suffix

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


# -----------------------------------------------------------------------------------------------------------------
# The episode


@dataclass
class Turn:
    """One policy turn: response[policy_start:policy_end] generated, response[policy_end:observation_end] the
    observation that answered it (empty when the episode ended there)."""

    policy_start: int
    policy_end: int
    observation_end: int
    action: str
    closed: bool  # ended with turn_end_id (the turn closed itself)
    stopped: bool  # ended by the turn end or an action end, not by a token budget
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    prompt_ids: list[int]
    example: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    end_reason: Optional[str] = None  # "done" (the environment ended it) or the budget that did
    tool_calls: int = 0
    tool_errors: collections.Counter = field(default_factory=collections.Counter)
    truncations: collections.Counter = field(default_factory=collections.Counter)
    verifier_timeouts: int = 0  # verifier calls of this episode's environment that timed out (scored 0)

    @property
    def finished(self) -> bool:
        return self.end_reason is not None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append_policy(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.sampler_logprobs.extend(float(x) for x in logprobs)
        self.weight_versions.extend(int(v) for v in versions)

    def append_observation(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.sampler_logprobs.extend([0.0] * len(ids))
        self.weight_versions.extend([-1] * len(ids))

    def end(self, reason: str) -> None:
        self.end_reason = reason
        if reason != "done":
            self.truncations[reason] += 1


def episode_state(episode: Episode) -> dict[str, Any]:
    """An episode as JSON-able state (a checkpoint's rollout buffer keeps episodes played ahead of training): every
    field, turns as dicts, counters as dicts. A turn's `info` keeps what JSON can hold (an environment may put
    anything there; the rest is written as its repr, so a checkpoint never fails on it)."""
    state = {f.name: getattr(episode, f.name) for f in fields(Episode) if f.name != "turns"}
    state["tool_errors"], state["truncations"] = dict(episode.tool_errors), dict(episode.truncations)
    state["turns"] = [{**vars(t), "info": json.loads(json.dumps(t.info, default=repr))} for t in episode.turns]
    return state


def episode_from_state(state: dict[str, Any]) -> Episode:
    """The episode `episode_state` saved."""
    counters = {k: collections.Counter(state[k]) for k in ("tool_errors", "truncations")}
    turns = [Turn(**t) for t in state["turns"]]
    return Episode(**{**state, **counters, "turns": turns})


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in TURN_REWARD_AGGREGATIONS:
        raise ConfigError(f"turn_reward_aggregation must be one of {TURN_REWARD_AGGREGATIONS}, got {aggregation!r}")


def episode_score(episode: Episode, aggregation: str) -> float:
    """The episode's scalar reward: sum of its turns' rewards ("sum") or the last turn's ("last"); 0 with no turn."""
    _check_aggregation(aggregation)
    rewards = [t.reward for t in episode.turns]
    if not rewards:
        return 0.0
    return float(sum(rewards)) if aggregation == "sum" else float(rewards[-1])


def _last_policy_index(episode: Episode, before: int) -> Optional[int]:
    """The last policy token strictly before response position `before`, or None."""
    for i in range(min(before, len(episode.loss_mask)) - 1, -1, -1):
        if episode.loss_mask[i]:
            return i
    return None


def token_rewards(episode: Episode, aggregation: str) -> list[float]:
    """Per response token rewards (module docstring): "sum" puts each turn's reward on that turn's last policy
    token, "last" the last turn's reward on the episode's last policy token; 0 everywhere else, observation tokens
    included. A turn that generated nothing gives its reward to the policy token before it; an episode with no
    policy token at all has nothing to carry a reward (it trains nothing either)."""
    _check_aggregation(aggregation)
    out = [0.0] * len(episode.response_ids)
    turns = episode.turns if aggregation == "sum" else episode.turns[-1:]
    for turn in turns:
        index = _last_policy_index(episode, turn.policy_end)
        if index is not None:
            out[index] += float(turn.reward)
    return out


class EpisodeBatch(NamedTuple):
    """Response-aligned, right-padded tensors of a batch of episodes (column t = response token t)."""

    response_ids: torch.Tensor  # [B, T] long, pad_token_id after the response
    attention_mask: torch.Tensor  # [B, T] 1 on every real response token (policy and observation)
    loss_mask: torch.Tensor  # [B, T] float, 1 on policy tokens only
    sampler_logprobs: torch.Tensor  # [B, T] float, 0 off policy tokens
    weight_versions: torch.Tensor  # [B, T] long, -1 off policy tokens
    token_rewards: torch.Tensor  # [B, T] float (token_rewards)
    scores: torch.Tensor  # [B] float (episode_score)


def pad_episodes(episodes: Sequence[Episode], pad_token_id: int, aggregation: str) -> EpisodeBatch:
    width = max([len(e.response_ids) for e in episodes] + [1])

    def rows(values: Callable[[Episode], list], fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([values(e) + [fill] * (width - len(e.response_ids)) for e in episodes], dtype=dtype)

    return EpisodeBatch(
        response_ids=rows(lambda e: e.response_ids, pad_token_id, torch.long),
        attention_mask=rows(lambda e: [1] * len(e.response_ids), 0, torch.long),
        loss_mask=rows(lambda e: e.loss_mask, 0, torch.float),
        sampler_logprobs=rows(lambda e: e.sampler_logprobs, 0.0, torch.float),
        weight_versions=rows(lambda e: e.weight_versions, -1, torch.long),
        token_rewards=rows(lambda e: token_rewards(e, aggregation), 0.0, torch.float),
        scores=torch.tensor([episode_score(e, aggregation) for e in episodes], dtype=torch.float),
    )


# -----------------------------------------------------------------------------------------------------------------
# The batch driver


@dataclass(frozen=True)
class EpisodeBudget:
    """Generation budgets of one episode (the tool budgets belong to the environment):
    max_turns            policy turns (generation calls) at most
    max_turn_tokens      new tokens per turn at most
    max_response_tokens  response tokens at most (everything after the prompt, observations included: the
                         width of the episode's row; an observation that would reach it ends the episode)"""

    max_turns: int = 8
    max_turn_tokens: int = 512
    max_response_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_response_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def cut_at_action_end(ids: Sequence[int], decode: Callable[[Sequence[int]], str], action_end: Callable) -> int:
    """How many of `ids` to keep: all, unless the decoded text holds a complete action (`action_end` not None);
    then the fewest leading ids whose text already does (binary search; `action_end` is prefix-monotone). The ids
    kept are the sampler's own, unchanged; the ones dropped were sampled after the action and are discarded."""
    if not ids or action_end(decode(ids)) is None:
        return len(ids)
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if action_end(decode(ids[:mid])) is not None:
            high = mid
        else:
            low = mid + 1
    return low


def shared_stop_strings(envs: Sequence[Environment], base: Optional[Sequence[str]] = None) -> Optional[list[str]]:
    """The stop strings a generate_fn may pass its generator for a batch of `envs`' turns: `base` (the recipe's own)
    plus every action-end marker that all the environments share (`Environment.stop_strings`: a hermes call's
    `</tool_call>`). Only a shared one: a marker stops every request of the call, and one environment's marker is
    text to another. The driver cuts each turn at its environment's `action_end` whatever the generator did, so
    this saves the tokens sampled after the action and changes no episode's ids; None when there is none."""
    shared = [s for s in (envs[0].stop_strings if envs else ()) if all(s in env.stop_strings for env in envs[1:])]
    merged = list(base or []) + [s for s in shared if s not in (base or [])]
    return merged or None


def start_episode(env: Environment, example: dict[str, Any], tokens: EpisodeTokenizer) -> Episode:
    return Episode(prompt_ids=tokens.prompt_ids(env.reset(example), env.tools), example=example)


def _take_turn(
    episode: Episode,
    env: Environment,
    result: tuple,
    cap: int,
    version: int,
    tokens: EpisodeTokenizer,
    budget: EpisodeBudget,
) -> str:
    """Append one generation result (cut at the action end) as a policy turn; returns the turn's text."""
    ids, logprobs = list(result[0]), list(result[1])
    versions = list(result[2]) if len(result) > 2 else [version] * len(ids)
    if len(ids) > cap or not len(ids) == len(logprobs) == len(versions):
        raise ValueError(
            f"generate_fn returned {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions for a "
            f"request of at most {cap} new tokens"
        )
    keep = cut_at_action_end(ids, tokens.decode, env.action_end)
    ids, logprobs, versions = ids[:keep], logprobs[:keep], versions[:keep]
    action = tokens.decode(ids)
    closed = bool(ids) and ids[-1] == tokens.turn_end_id
    # Stopped by its end token, by a complete action, or by the backend below the cap (a stop string); else a
    # token budget cut it.
    stopped = closed or len(ids) < cap or env.action_end(action) is not None
    if not stopped:
        budget_name = "max_turn_tokens" if cap == budget.max_turn_tokens else "max_response_tokens"
        episode.truncations[budget_name] += 1
    start = len(episode.response_ids)
    episode.append_policy(ids, logprobs, versions)
    episode.turns.append(Turn(start, len(episode.response_ids), len(episode.response_ids), action, closed, stopped))
    return action


def _finish_turn(
    episode: Episode, env: Environment, result: StepResult, tokens: EpisodeTokenizer, budget: EpisodeBudget
) -> None:
    """Record the step's reward and counts, then end the episode or append the observation."""
    observation, reward, done, info = result
    turn = episode.turns[-1]
    turn.reward, turn.info = float(reward), dict(info or {})
    episode.tool_calls += int(turn.info.get("tool_calls", 0))
    episode.tool_errors.update(turn.info.get("tool_errors", []))
    episode.truncations.update(turn.info.get("truncated", []))
    if done:
        episode.end("done")
    elif len(episode.turns) >= budget.max_turns:
        episode.end("max_turns")
    else:
        obs_ids = tokens.observation_ids(observation, turn.closed, env.tools)
        if len(episode.response_ids) + len(obs_ids) >= budget.max_response_tokens:
            episode.end("max_response_tokens")  # no room for the observation and one more generated token
            return
        episode.append_observation(obs_ids)
        turn.observation_end = len(episode.response_ids)


def rollout_episodes(
    envs: Sequence[Environment],
    examples: Sequence[dict[str, Any]],
    generate_fn: GenerateFn,
    tokens: EpisodeTokenizer,
    budget: EpisodeBudget,
    weight_version: Union[int, Callable[[], int]] = 0,
    step_workers: int = 1,
) -> list[Episode]:
    """Play one episode per (env, example) to its end. Each round sends every unfinished episode's ids (prompt +
    response so far) in one `generate_fn(ids_lists, max_new_tokens)` call, so episodes at different turns share
    a batch; an episode leaves the batch as soon as it ends (done, or a budget). generate_fn returns, per request,
    (ids, logprobs) or (ids, logprobs, per-token weight versions); without versions every token of the call gets
    `weight_version` (an int, or a callable read once per call). Environment steps run on `step_workers` threads
    (tools such as the sandbox wait on subprocesses). Returns the episodes in input order."""
    if len(envs) != len(examples):
        raise ValueError(f"{len(envs)} environments for {len(examples)} examples")
    episodes = [start_episode(env, example, tokens) for env, example in zip(envs, examples)]
    pool = ThreadPoolExecutor(step_workers) if step_workers > 1 else None
    try:
        while any(not e.finished for e in episodes):
            active = [i for i, e in enumerate(episodes) if not e.finished]
            caps = [
                min(budget.max_turn_tokens, budget.max_response_tokens - len(episodes[i].response_ids)) for i in active
            ]
            version = weight_version() if callable(weight_version) else weight_version
            results = list(generate_fn([episodes[i].ids for i in active], caps))
            if len(results) != len(active):
                raise ValueError(f"generate_fn returned {len(results)} results for {len(active)} requests")
            actions = [
                _take_turn(episodes[i], envs[i], r, cap, version, tokens, budget)
                for i, r, cap in zip(active, results, caps)
            ]
            steps = (
                pool.map(lambda ia: envs[ia[0]].step(ia[1]), zip(active, actions))
                if pool
                else (envs[i].step(a) for i, a in zip(active, actions))
            )
            for i, step in zip(active, steps):
                _finish_turn(episodes[i], envs[i], StepResult(*step), tokens, budget)
    finally:
        if pool is not None:
            pool.shutdown()
    return episodes


# -----------------------------------------------------------------------------------------------------------------
# Logging and sample rows


def episode_stat_sums(episodes: Sequence[Episode]) -> dict[str, float]:
    """Additive counts over a batch (sum them over ranks before `episode_stats`): episodes, turns, tool_calls,
    episodes_with_tool_calls, done, policy_tokens, observation_tokens, tool_errors/<reason>, truncated/<budget>."""
    sums: collections.Counter = collections.Counter()
    for e in episodes:
        sums["episodes"] += 1
        sums["turns"] += len(e.turns)
        sums["tool_calls"] += e.tool_calls
        sums["episodes_with_tool_calls"] += e.tool_calls > 0
        sums["done"] += e.end_reason == "done"
        sums["policy_tokens"] += sum(e.loss_mask)
        sums["observation_tokens"] += len(e.loss_mask) - sum(e.loss_mask)
        for reason, n in e.tool_errors.items():
            sums[f"tool_errors/{reason}"] += n
        for budget, n in e.truncations.items():
            sums[f"truncated/{budget}"] += n
    return {k: float(v) for k, v in sums.items()}


def episode_stats(sums: dict[str, float]) -> dict[str, float]:
    """The log row's env/ metrics from (rank-summed) `episode_stat_sums`: turns and tool calls per episode, the
    share of episodes that called a tool, of episodes the environment ended, of response tokens that are
    observations; tool errors and truncations as counts, by reason/budget."""
    n = max(sums.get("episodes", 0.0), 1.0)
    tokens = sums.get("policy_tokens", 0.0) + sums.get("observation_tokens", 0.0)
    out = {
        "env/turns_per_episode": sums.get("turns", 0.0) / n,
        "env/tool_calls_per_episode": sums.get("tool_calls", 0.0) / n,
        "env/tool_call_rate": sums.get("episodes_with_tool_calls", 0.0) / n,
        "env/done_rate": sums.get("done", 0.0) / n,
        "env/observation_token_share": sums.get("observation_tokens", 0.0) / tokens if tokens else 0.0,
        "env/tool_errors": sum(v for k, v in sums.items() if k.startswith("tool_errors/")),
    }
    out.update({f"env/{k}": v for k, v in sums.items() if k.startswith(("tool_errors/", "truncated/"))})
    return out


OBSERVATION_OPEN, OBSERVATION_CLOSE = "[[observation]]", "[[/observation]]"


def render_episode(episode: Episode, tokens: EpisodeTokenizer) -> str:
    """The whole conversation as the model saw it (special tokens kept), each observation between
    [[observation]] and [[/observation]] so a reader tells the tools' words from the policy's."""
    parts = [tokens.decode(episode.prompt_ids, skip_special_tokens=False)]
    for turn in episode.turns:
        parts.append(
            tokens.decode(episode.response_ids[turn.policy_start : turn.policy_end], skip_special_tokens=False)
        )
        if turn.observation_end > turn.policy_end:
            observation = episode.response_ids[turn.policy_end : turn.observation_end]
            parts.append(OBSERVATION_OPEN + tokens.decode(observation, skip_special_tokens=False) + OBSERVATION_CLOSE)
    return "".join(parts)


def episode_sample_row(episode: Episode, tokens: EpisodeTokenizer, aggregation: str) -> dict[str, Any]:
    """One samples.jsonl row of a multi-turn episode."""
    return {
        "conversation": render_episode(episode, tokens),
        "score": episode_score(episode, aggregation),
        "turn_rewards": [t.reward for t in episode.turns],
        "turns": len(episode.turns),
        "tool_calls": episode.tool_calls,
        "tool_errors": dict(episode.tool_errors),
        "end_reason": episode.end_reason,
        "ground_truth": str(episode.example.get("ground_truth")),
    }
