"""Multi-turn rollouts for the RLVR trainer (`environment:` set in the recipe): the run's environment resources,
built once from the config; one rollout's episodes played turn by turn through the Generator contract; their
scores, metrics and samples.jsonl rows. The episode mechanics (token-in/token-out, the loss mask, per-turn rewards,
GAE across turns) are `episodes.py`; the environments are `environments.py`.

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
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from open_instruct.distributed import global_sums_any_keys
from open_instruct.environments import Environment, guarded_environment_for_row
from open_instruct.episodes import (
    Episode,
    EpisodeBudget,
    EpisodeTokenizer,
    episode_from_state,
    episode_sample_row,
    episode_stat_sums,
    episode_state,
    episode_stats,
    rollout_episodes,
    shared_stop_strings,
    token_rewards,
)

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
        return EpisodeOutput(
            prompt_ids=[list(e.prompt_ids) for e in episodes[::n]],
            response_ids=[e.response_ids for e in episodes],
            texts=[self.tokens.decode(e.response_ids) for e in episodes],
            stopped=[episode_stopped(e) for e in episodes],
            prompt_index=[i // n for i in range(len(episodes))],
            logprobs=[e.sampler_logprobs for e in episodes],
            weight_versions=[e.weight_versions for e in episodes],
            loss_masks=[e.loss_mask for e in episodes],
            episodes=episodes,
        )

    def sample_rows(self, episodes: Sequence[Episode], k: int) -> list[dict[str, Any]]:
        """samples.jsonl rows of the first k episodes: the whole conversation, tool outputs marked."""
        return [episode_sample_row(e, self.tokens, self.cfg.turn_reward_aggregation) for e in episodes[:k]]


def is_episode_output(out: Any) -> bool:
    """True for a rollout played as episodes (it carries a loss mask)."""
    return getattr(out, "loss_masks", None) is not None and getattr(out, "episodes", None) is not None


def episode_metrics(accelerator: Any, episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """episodes.episode_stats over every rank, named `<prefix>turns_per_episode`, `<prefix>tool_calls_per_episode`,
    `<prefix>tool_call_rate`, `<prefix>done_rate`, `<prefix>observation_token_share`, `<prefix>tool_errors` and
    per reason `<prefix>tool_errors_<reason>`, per budget `<prefix>truncated_<budget>`. Collective."""
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
