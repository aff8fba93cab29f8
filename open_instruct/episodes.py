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

The trainer's side (`environment:` set in the recipe), below `EpisodeOutput`: the run's environment resources,
built once from the config; one rollout's episodes played turn by turn through the Generator contract; their scores,
metrics and samples.jsonl rows.

    run = EnvironmentRun(cfg, tokenizer, verify)           # verify(text, ground_truth, verifier) -> (score, timed out)
    row["prompt_ids"] = run.prompt_ids(row)                 # at load time: the environment renders the prompt
    out = run.play(generator, rows, sampling_config)        # a GenerationOutput-shaped EpisodeOutput

An `EpisodeOutput` has one row per episode, `n` contiguous episodes per prompt row (a group), like
GenerationOutput: `response_ids` are everything after the prompt (policy + observation tokens), `loss_masks` 1 on
the policy's tokens, `logprobs` (0.0) and `weight_versions` (-1) on observation tokens. Every backend plays: each
round of `episodes.rollout_episodes` is one `generator.generate(ids so far, config, max_new_tokens=caps)` call with
n=1 (episodes of one prompt are separate requests; the backends seed each request apart) and a seed derived from
(the rollout's seed, round), so a re-run of the rollout regenerates it identically on HF.

Rewards: an environment's turn rewards are in verifier units (1 = a verified answer, as the built-in environments
give); the episode's score is `verification_reward` x episode_score (turn_reward_aggregation), as a single-turn
completion's is verification_reward x its verifier's score.
"""

from __future__ import annotations

import collections
import functools
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch

from open_instruct.distributed import global_sums_any_keys
from open_instruct.environments import Environment, Observation, StepResult, guarded_environment_for_row
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


def episode_snapshot(episode: Episode, env: Environment) -> dict[str, Any]:
    """An episode in play as JSON-able state: its tokens and turns so far and its environment's state_dict."""
    return {"episode": episode_state(episode), "environment": env.state_dict()}


def resume_environment(snapshot: dict[str, Any], env: Environment) -> Episode:
    """The episode of an episode_snapshot, with `env` (a fresh one of the same class) given its state back."""
    env.load_state_dict(snapshot["environment"])
    return episode_from_state(snapshot["episode"])


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


def take_turn(
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
    started: Optional[Sequence[Optional[Episode]]] = None,
    on_round: Optional[Callable[[list[Episode]], None]] = None,
) -> list[Episode]:
    """Play one episode per (env, example) to its end. Each round sends every unfinished episode's ids (prompt +
    response so far) in one `generate_fn(ids_lists, max_new_tokens)` call, so episodes at different turns share
    a batch; an episode leaves the batch as soon as it ends (done, or a budget). generate_fn returns, per request,
    (ids, logprobs) or (ids, logprobs, per-token weight versions); without versions every token of the call gets
    `weight_version` (an int, or a callable read once per call). Environment steps run on `step_workers` threads
    (tools such as the sandbox wait on subprocesses). `started[i]`, when given, is an episode in progress (from an
    episode_snapshot) whose environment took its state back (resume_environment): it continues instead of starting.
    `on_round(episodes)` is called after each round's steps (where a snapshot of the episodes in play is taken).
    Returns the episodes in input order."""
    if len(envs) != len(examples):
        raise ValueError(f"{len(envs)} environments for {len(examples)} examples")
    started = started or [None] * len(envs)
    episodes = [e if e is not None else start_episode(env, x, tokens) for env, x, e in zip(envs, examples, started)]
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
                take_turn(episodes[i], envs[i], r, cap, version, tokens, budget)
                for i, r, cap in zip(active, results, caps)
            ]
            steps = (
                pool.map(lambda ia: envs[ia[0]].step(ia[1]), zip(active, actions))
                if pool
                else (envs[i].step(a) for i, a in zip(active, actions))
            )
            for i, step in zip(active, steps):
                _finish_turn(episodes[i], envs[i], StepResult(*step), tokens, budget)
            if on_round is not None:
                on_round(episodes)
    finally:
        if pool is not None:
            pool.shutdown()
    return episodes


# -----------------------------------------------------------------------------------------------------------------
# Logging and sample rows


def episode_stat_sums(episodes: Sequence[Episode]) -> dict[str, float]:
    """Additive counts over a batch (sum them over ranks before `episode_stats`): episodes, turns, tool_calls,
    episodes_with_tool_calls, done, policy_tokens, observation_tokens, tool_errors/<reason>, truncated/<budget>, and
    metric_sum/<name>, metric_count/<name> of the numbers an episode's last turn reports in info["metrics"]."""
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
        reported = (e.turns[-1].info.get("metrics") if e.turns else None) or {}
        for name, value in reported.items():
            sums[f"metric_sum/{name}"] += float(value)
            sums[f"metric_count/{name}"] += 1
    return {k: float(v) for k, v in sums.items()}


def episode_stats(sums: dict[str, float]) -> dict[str, float]:
    """The log row's env/ metrics from (rank-summed) `episode_stat_sums`: turns and tool calls per episode, the
    share of episodes that called a tool, of episodes the environment ended, of response tokens that are
    observations; tool errors and truncations as counts, by reason/budget; each info["metrics"] name's mean over
    the episodes that report it (env/metric/<name>)."""
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
    for key, count in sums.items():  # the environment's own per-episode metrics, averaged over those reporting them
        if key.startswith("metric_count/") and count:
            name = key.removeprefix("metric_count/")
            out[f"env/metric/{name}"] = sums[f"metric_sum/{name}"] / count
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


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's side: one rollout's episodes against the run's environments (rollouts.py and rlvr_ppo.py call these)

# verify(completion text, ground truth, verifier name) -> (score in [0, 1], timed out) (rollouts.py binds the row
# verifiers); an episode counts its verifier timeouts (Episode.verifier_timeouts, train/verifier_timeouts)
VerifyFn = Callable[[str, Any, str], tuple[float, bool]]


@dataclass
class EpisodeOutput:
    """One rollout's episodes in GenerationOutput's shape (see the module docstring)."""

    prompt_ids: list[list[int]]  # one row per prompt, as the environment rendered it
    response_ids: list[list[int]] = field(default_factory=list)  # policy + observation tokens after the prompt
    texts: list[str] = field(default_factory=list)  # the decoded response (special tokens skipped)
    stopped: list[bool] = field(default_factory=list)  # episode_stopped
    prompt_index: list[int] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # 0.0 on observation tokens
    weight_versions: list[list[int]] = field(default_factory=list)  # -1 on observation tokens
    loss_masks: list[list[int]] = field(default_factory=list)  # 1 on policy tokens
    episodes: list[Episode] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    def to_state(self) -> dict[str, Any]:
        """Every field as JSON-able state, the episodes included (rollouts.output_state: the rollout buffer)."""
        return {**vars(self), "episodes": [episode_state(e) for e in self.episodes]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpisodeOutput:
        return cls(**{**state, "episodes": [episode_from_state(e) for e in state["episodes"]]})


def turn_seed(seed: int, turn_round: int) -> int:
    """The seed of one generation round of a rollout whose sampling seed is `seed` (63 bits, deterministic)."""
    return random.Random(f"{seed}:turn:{turn_round}").getrandbits(63)


def environment_example(row: dict[str, Any]) -> dict[str, Any]:
    """What `env.reset` gets: the dataset row's own columns (data.py keeps them for environment runs), with the
    prompt `messages` (a string prompt as one user message), `ground_truth` and `verifier` normalised."""
    return row["example"]


def episode_stopped(episode: Episode) -> bool:
    """The single-turn `stopped` of an episode: the environment ended it, and its last turn was not cut by a token
    budget (what non_stop_penalty punishes)."""
    return episode.end_reason == "done" and bool(episode.turns) and episode.turns[-1].stopped


def episode_correct(episode: Episode) -> bool:
    """The last turn's `correct` (info), else whether its reward reached 1 (a verified answer); False when a
    budget ended the episode before the environment did."""
    if episode.end_reason != "done" or not episode.turns:
        return False
    last = episode.turns[-1]
    return bool(last.info.get("correct", last.reward >= 1.0))


class EnvironmentRun:
    """The run's environment resources, built once: the episode tokenizer, the budgets and the constructor
    arguments every episode's environment receives (those its class names: tools, tool format, python runtime =
    the sandbox, tool budgets and timeouts, tokenizer, the row's verifier)."""

    def __init__(self, cfg: Any, tokenizer: Any, verify: VerifyFn, step_workers: int = 1):
        self.cfg, self.verify, self.step_workers = cfg, verify, step_workers
        self.timeout_s = getattr(cfg, "environment_timeout", 300.0)  # each reset / step / constructor call
        self.tokens = EpisodeTokenizer(tokenizer)
        self.budget = self.budget_for(cfg.response_length)
        self.resources: dict[str, Any] = {
            "tools": list(cfg.tools),
            "tool_format": cfg.tool_call_format,
            "tokenizer": tokenizer,
            "max_tool_calls": cfg.max_tool_calls,
            "tool_output_max_tokens": cfg.tool_output_max_tokens,
            "tool_timeout_s": cfg.tool_timeout,
            "verifier_timeout_s": cfg.verifier_timeout,
        }
        if "python" in cfg.tools:
            from open_instruct.sandbox import tool_runtime

            self.resources["python_runtime"] = tool_runtime(cfg)  # hides what the `code` verifier hides

    def budget_for(self, response_length: int) -> EpisodeBudget:
        """response_length is the whole response's budget (observations included); max_turn_tokens per turn."""
        per_turn = min(self.cfg.max_turn_tokens or response_length, response_length)
        return EpisodeBudget(self.cfg.max_turns, per_turn, response_length)

    def environment(self, row: dict[str, Any], count_timeout: Callable[[], None] = lambda: None) -> Environment:
        """A fresh environment for one episode of `row` (the row's `environment` column wins over the recipe's);
        each verifier call that times out calls `count_timeout`."""
        example = environment_example(row)
        verifier_name = example.get("verifier")

        def verifier(text: str, ground_truth: Any) -> float:
            score, timed_out = self.verify(text, ground_truth, verifier_name)
            if timed_out:
                count_timeout()
            return score

        where = row.get("where") or f"row {row.get('row')}"
        resources = {**self.resources, "verifier": verifier}
        return guarded_environment_for_row(example, self.cfg.environment, resources, where, self.timeout_s)

    def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        """The prompt ids the row's environment starts its episodes with (reset, then the chat template with the
        environment's tool schemas)."""
        env = self.environment(row)
        return self.tokens.prompt_ids(env.reset(environment_example(row)), env.tools)

    def probe_step(self, row: dict[str, Any]) -> None:
        """One step of a fresh environment of `row` with an empty action (a policy may answer with nothing), before
        any model loads: a step that raises, hangs or returns the wrong types stops the run now (GuardedEnvironment)."""
        env = self.environment(row)
        env.reset(environment_example(row))
        env.step("")

    def play(
        self, generator: Any, rows: Sequence[dict[str, Any]], config: Any, budget: Optional[EpisodeBudget] = None
    ) -> EpisodeOutput:
        """`config.n` episodes per row, played to their ends through `generator` (the Generator contract); each
        round's seed derives from config.seed (None: the backend's own draw)."""
        n, budget = config.n, budget or self.budget
        examples = [row for row in rows for _ in range(n)]
        timeouts: collections.Counter = collections.Counter()  # verifier timeouts by episode index
        envs = [self.environment(row, functools.partial(timeouts.update, [i])) for i, row in enumerate(examples)]
        rounds = [0]
        stop_strings = shared_stop_strings(envs, config.stop_strings)  # a call turn stops at its end marker

        def generate_fn(requests: list[list[int]], caps: list[int]) -> list[tuple]:
            seed = None if config.seed is None else turn_seed(config.seed, rounds[0])
            rounds[0] += 1
            turn_config = replace(
                config, n=1, max_new_tokens=budget.max_turn_tokens, seed=seed, stop_strings=stop_strings
            )
            out = generator.generate(requests, turn_config, max_new_tokens=caps)
            return list(zip(out.response_ids, out.logprobs, out.weight_versions))

        episodes = rollout_episodes(
            envs,
            [environment_example(row) for row in examples],
            generate_fn,
            self.tokens,
            budget,
            step_workers=self.step_workers,
        )
        for i, episode in enumerate(episodes):
            episode.verifier_timeouts = timeouts[i]
        score_groups(envs, episodes, n)
        return episode_output(episodes, n, self.tokens)

    def sample_rows(self, episodes: Sequence[Episode], k: int) -> list[dict[str, Any]]:
        """samples.jsonl rows of the first k episodes: the whole conversation, tool outputs marked."""
        return [episode_sample_row(e, self.tokens, self.cfg.turn_reward_aggregation) for e in episodes[:k]]


def episode_output(episodes: list[Episode], n: int, tokens: EpisodeTokenizer) -> EpisodeOutput:
    """A rollout's played episodes (n contiguous per row, sharing the row's prompt) as an EpisodeOutput."""
    return EpisodeOutput(
        prompt_ids=[list(e.prompt_ids) for e in episodes[::n]],
        response_ids=[e.response_ids for e in episodes],
        texts=[tokens.decode(e.response_ids) for e in episodes],
        stopped=[episode_stopped(e) for e in episodes],
        prompt_index=[i // n for i in range(len(episodes))],
        logprobs=[e.sampler_logprobs for e in episodes],
        weight_versions=[e.weight_versions for e in episodes],
        loss_masks=[e.loss_mask for e in episodes],
        episodes=episodes,
    )


def score_groups(envs: Sequence[Environment], episodes: Sequence[Episode], n: int) -> None:
    """Each group's (the n episodes of one row) Environment.score_group, once all of them ended: its rewards are
    added to each episode's last turn (so its score, under either turn_reward_aggregation) and its info merged
    into that turn's."""
    for start in range(0, len(envs), n):
        scored = envs[start].score_group(list(envs[start : start + n]))
        for episode, (reward, info) in zip(episodes[start : start + n], scored or []):
            last = episode.turns[-1]
            last.reward += reward
            last.info.update(info)


def is_episode_output(out: Any) -> bool:
    """True for a rollout played as episodes (it carries a loss mask)."""
    return getattr(out, "loss_masks", None) is not None and getattr(out, "episodes", None) is not None


def episode_metrics(accelerator: Any, episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """episodes.episode_stats over every rank, named `<prefix>turns_per_episode`, `<prefix>tool_calls_per_episode`,
    `<prefix>tool_call_rate`, `<prefix>done_rate`, `<prefix>observation_token_share`, `<prefix>tool_errors` and
    per reason `<prefix>tool_errors_<reason>`, per budget `<prefix>truncated_<budget>`, per metric an environment
    reports `<prefix>metric_<name>` (e.g. a rubric's functions). Collective."""
    stats = episode_stats(global_sums_any_keys(accelerator, episode_stat_sums(episodes)))
    return {prefix + key.removeprefix("env/").replace("/", "_"): value for key, value in stats.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The hooks (rlvr_ppo.Feature): what multi-turn episodes add to a rollout step (the sampler plays them: rollouts.py)


def turn_reward_tensor(cfg: Any, out: Any, n: int, width: int) -> dict[str, Any]:
    """score_rollout: each turn's reward on its turn's last policy token (episodes.token_rewards), in the score's
    units (x verification_reward), as an [n, width] tensor (turn_rewards: the estimators' kl_rewards read it)."""
    import torch

    played = list(getattr(out, "episodes", None) or [])
    if not played:
        return {}
    turn_rewards = torch.zeros(n, width)
    for i, e in enumerate(played):
        per_token = token_rewards(e, cfg.turn_reward_aggregation)
        turn_rewards[i, : len(per_token)] = cfg.verification_reward * torch.tensor(per_token, dtype=torch.float32)
    return {"turn_rewards": turn_rewards}


def metrics(cfg: Any, rollout: Any, sums: Any, train: Any, updates: float, accelerator: Any) -> dict[str, float]:
    """metrics: turns, tool calls, tool errors by reason, observation share, truncations (over every rank)."""
    return episode_metrics(accelerator, rollout.played, "train/")
