"""The RL plumbing a forker of `rlvr_ppo.py` should not need to touch: where each rollout's prompts and completions
come from (`RolloutSampler`, with the seeds that make a resumed run re-draw the same samples), the verifier call, the
per-phase clock behind the time/ and perf/ metrics, greedy evaluation on the held-out prompts, the samples.jsonl
rows, and loading the prompts (checked before any model loads); how episodes become micro-batch rows
(`EpisodeLayout`, decided once per run) and the rollout's no-grad forwards in micro-batches (`no_grad_forwards`: the
old and reference log-probs, LoRA's reference as the policy without its adapters, values, reward-model scores, the
features' score_batch hooks). With an environment each of these plays or scores multi-turn episodes (episodes.py)
instead of single completions.

The phases of a rollout step and `main` stay in `rlvr_ppo.py`, the estimators and losses with their math in
`rl_algorithms.py`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from transformers import AutoConfig

from open_instruct import console, data, integrations, rewards
from open_instruct.config import RLVRConfig, is_teacher_server
from open_instruct.distributed import (
    global_sum,
    global_sums_by_source,
    is_fsdp,
    prepare_frozen,
    step_micro_batches,
    zero_sums_by_source,
)
from open_instruct.errors import ConfigError, DataError
from open_instruct.generation import GenerationConfig
from open_instruct.models import SamplingTruncation, TokenScores, response_scores, sequence_scores, token_values
from open_instruct.run_dir import fault_point

if TYPE_CHECKING:  # multi-turn episodes and the code verifier are imported only by a run that uses them
    from open_instruct.code_verifier import CodeSettings
    from open_instruct.episodes import EnvironmentRun


def derived_seed(seed: int, *parts: int) -> int:
    """A deterministic 63-bit seed from (seed, rollout_step, rank, ...): resuming at a rollout re-draws its samples."""
    return random.Random(":".join(str(p) for p in (seed, *parts))).getrandbits(63)


def sampling_config(cfg: RLVRConfig, step: int, rank: int) -> Any:
    """The rollout's sampling: num_samples_per_prompt completions per prompt, a seed per (step, rank)."""
    return GenerationConfig(
        max_new_tokens=cfg.response_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        stop_strings=cfg.stop_strings,
        n=cfg.num_samples_per_prompt,
        seed=derived_seed(cfg.seed, step, rank),
    )


def sampling_truncation(cfg: RLVRConfig) -> Optional[SamplingTruncation]:
    """The rollouts' top-k / top-p / min-p, which the trainer's log-probs of the sampled tokens apply too (the ratio,
    TIS and mismatch/ then compare one distribution); None when sampling truncates nothing."""
    truncation = SamplingTruncation(cfg.top_k, cfg.top_p, cfg.min_p)
    return truncation if truncation.active else None


def output_state(out: Any) -> dict[str, Any]:
    """A generation output as JSON-able state: its class (an open_instruct one) and every field it carries, per-token
    lists included (response_ids, logprobs, weight_versions, and e.g. a multi-turn episode's loss_masks)."""
    cls = type(out)
    fields = out.to_state() if hasattr(out, "to_state") else dict(vars(out))  # e.g. multi-turn episodes' own
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}


def output_from_state(state: dict[str, Any]) -> Any:
    """The generation output `output_state` saved (floats round-trip exactly through JSON)."""
    module, _, name = state["class"].partition(":")
    if not module.startswith("open_instruct."):  # a checkpoint names a class to build: only the project's own
        raise ValueError(f"a saved rollout names the class {state['class']!r}, not one of open_instruct's")
    cls = getattr(importlib.import_module(module), name)
    if hasattr(cls, "from_state"):
        return cls.from_state(state["fields"])
    output = object.__new__(cls)
    output.__dict__.update(state["fields"])  # every field as saved, whichever the class's constructor takes
    return output


def token_version_lags(out: Any, step: int) -> list[list[int]]:
    """Per completion, the version lag of each token the policy sampled: the trainer's version when it trains on
    rollout `step` (= step, rollouts trained on) minus the version that sampled the token. Tokens an episode's
    environment wrote (loss_masks 0) are not sampled and carry no lag."""
    masks = getattr(out, "loss_masks", None) or [None] * len(out.weight_versions)
    return [
        [step - v for t, v in enumerate(versions) if mask is None or mask[t]]
        for versions, mask in zip(out.weight_versions, masks)
    ]


@dataclass
class InFlight:
    """A rollout submitted ahead of training: its prompts, and its generation (a future, or the output itself when
    it was restored from a checkpoint)."""

    step: int
    prompts: list[dict]
    future: Optional[Future] = None
    output: Any = None
    engine_seconds: float = 0.0

    def result(self) -> tuple[Any, float]:
        if self.future is not None:
            self.output, self.engine_seconds = self.future.result()
            self.future = None
        return self.output, self.engine_seconds


class RolloutSampler:
    """Where each rollout's completions come from.

    async_steps 0: at rollout k, sync the generator to the policy (version k = rollouts trained on), then generate.

    async_steps N > 0: up to N rollouts are in flight ahead of training. When rollout k is taken (before the trainer
    trains on it) the generator is synced to version k and rollouts k+1 .. k+N are in flight: rollout k+N is submitted
    then, so its first token is sampled by version k or later and it is trained on by version k+N. The staleness
    bound is on the version lag of every token, time queued included: lag = (trainer version when the token is trained
    on) - (version that sampled it) <= N. A rollout with a token beyond the bound (restored from a checkpoint of a
    deeper pipeline) is regenerated, never trained on stale.
      - Generators that update in flight (dedicated engines): the sync happens with rollouts k+1 .. k+N-1 generating;
        the engines pause with their requests kept, take version k and resume, so a response spans versions and each
        token's version is kept.
      - The others (hf): the generator holds its own frozen copy of the policy per version, taken at the sync and
        handed over between generate calls in order (rollout j is generated entirely by version max(j - N, 0));
        a background thread generates, so the run is as deterministic as a synchronous one.
    At a checkpoint the rollouts in flight are completed (drained) and saved with it (`state_dict`): after a resume
    they are trained on as they are, then the pipeline refills, so no prompt is lost or trained twice."""

    def __init__(
        self,
        cfg: RLVRConfig,
        generator: Any,
        policy: Any,
        accelerator: Any,
        prompts_for: Callable,
        num_rollouts: int,
        environments: Optional[EnvironmentRun] = None,
        checker: Optional[Any] = None,
    ) -> None:
        self.cfg, self.generator, self.policy, self.accelerator = cfg, generator, policy, accelerator
        self.checker = checker  # generation_check.GenerationChecker: each sync under a deadline, then checked
        self.environments = environments  # set: each rollout plays multi-turn episodes (episodes.py)
        self.num_rollouts, self.depth = num_rollouts, cfg.async_steps
        self.prompts_for = prompts_for  # rollout step -> this rank's prompt rows
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if self.depth else None
        # weights go over to a generator that cannot take them in flight as a frozen copy, queued in order
        self.copies = bool(self.depth) and not generator.in_flight_weight_updates
        self.in_flight: dict[int, InFlight] = {}
        self.synced: Optional[int] = None
        self.bytes_sent = 0  # weight bytes sent to the engines over a transport, read by the log row
        self.regenerated = 0  # rollouts regenerated because a token was beyond the staleness bound

    def sync(self, version: int) -> float:
        """Send the policy's weights (labelled `version`) unless the generator has them; seconds taken. Collective.
        With rollouts in flight on engines that update in flight, they keep generating across it."""
        if version == self.synced:
            return 0.0
        t0 = time.perf_counter()
        fault_point("weight_sync", version)
        if self.copies:  # a frozen copy, handed over in order between the generations queued around it
            if self.checker is not None:  # an in-process deep copy cannot miss a tensor: only the launch check
                self.checker.launch_only()
            with torch.no_grad():
                frozen = copy.deepcopy(self.accelerator.unwrap_model(self.policy)).eval()
            frozen.requires_grad_(False)
            self.pool.submit(self.generator.sync_weights, frozen, version)
        else:  # checked: under a deadline, then the probe (generation_check.py)
            send = self.checker.sync if self.checker is not None else self.generator.sync_weights
            send(self.accelerator.unwrap_model(self.policy), version)
            self.bytes_sent += self.generator.last_sync_bytes
        self.synced = version
        return time.perf_counter() - t0

    def _generate(self, step: int, prompts: list[dict]) -> tuple[Any, float]:
        t0 = time.perf_counter()
        config = sampling_config(self.cfg, step, self.accelerator.process_index)
        if self.environments is not None:  # num_samples_per_prompt episodes per prompt, turn by turn
            return self.environments.play(self.generator, prompts, config), time.perf_counter() - t0
        return self.generator.generate([p["prompt_ids"] for p in prompts], config), time.perf_counter() - t0

    def _submit(self, step: int) -> None:
        prompts = self.prompts_for(step)
        self.in_flight[step] = InFlight(step, prompts, self.pool.submit(self._generate, step, prompts))

    def within_bound(self, out: Any, step: int) -> bool:
        """Every token of rollout `step` at most async_steps versions older than the trainer that trains on it."""
        return all(lag <= self.depth for lags in token_version_lags(out, step) for lag in lags)

    def take(self, step: int) -> tuple[list[dict], Any, dict[str, float], int]:
        """This rank's prompts of rollout `step`, their completions, the seconds spent: weight_sync, generation
        (what the trainer waited for) and generation_engine (the engines' wall time for it), and the weight bytes
        sent meanwhile."""
        seconds, bytes_before = {"weight_sync": 0.0}, self.bytes_sent
        if not self.depth:  # synchronous
            seconds["weight_sync"] += self.sync(step)
            t0 = time.perf_counter()
            prompts = self.prompts_for(step)
            with self.generator.generation_context(self.policy):
                out, engine_seconds = self._generate(step, prompts)
            seconds["generation"], seconds["generation_engine"] = time.perf_counter() - t0, engine_seconds
            return prompts, out, seconds, self.bytes_sent - bytes_before
        if step not in self.in_flight:  # the first rollout, or one a resume did not bring back
            seconds["weight_sync"] += self.sync(step)
            self._submit(step)
        t0 = time.perf_counter()
        entry = self.in_flight.pop(step)
        out, engine_seconds = entry.result()
        if not self.within_bound(out, step):  # restored from a deeper pipeline: regenerated, not trained on stale
            self.regenerated += 1
            seconds["weight_sync"] += self.sync(step)
            self._submit(step)
            entry = self.in_flight.pop(step)
            out, engine_seconds = entry.result()
        seconds["generation"], seconds["generation_engine"] = time.perf_counter() - t0, engine_seconds
        # version `step` to the generator (in flight on engines), then refill: rollouts step+1 .. step+N in flight
        seconds["weight_sync"] += self.sync(step)
        for ahead in range(step + 1, min(step + self.depth, self.num_rollouts - 1) + 1):
            if ahead not in self.in_flight:
                self._submit(ahead)
        return entry.prompts, out, seconds, self.bytes_sent - bytes_before

    def idle(self) -> None:
        """Wait for the rollouts in flight (before anything else uses the generator, e.g. an evaluation)."""
        for entry in self.in_flight.values():
            entry.result()
        if self.pool is not None:  # and for a weight copy queued behind them
            self.pool.submit(lambda: None).result()

    def close(self) -> None:
        """Stop the background thread (a rollout still in flight at the end of a run is not needed)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def state_dict(self) -> dict[str, Any]:
        """The rollouts in flight, completed first (drained) so their outputs are whole: per rank, each one's step,
        prompt ids and generation output (every per-token list it carries). Collective: every rank calls it."""
        from accelerate.utils import gather_object

        self.idle()
        mine = [
            {
                "step": e.step,
                "prompt_ids": [p["prompt_ids"] for p in e.prompts],
                "output": output_state(e.output),
                "engine_seconds": e.engine_seconds,
            }
            for e in sorted(self.in_flight.values(), key=lambda e: e.step)
        ]
        ranks = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        return {"async_steps": self.depth, "world_size": self.accelerator.num_processes, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any], next_step: int) -> list[int]:
        """Put the rollouts a checkpoint saved in flight back (those a resume can use as they are): the same world
        size (each rank's share), the same prompts as the data stream gives now, not yet trained on, and within this
        run's pipeline depth. The others are generated again when their turn comes (their prompts are positional, so
        none is lost). Returns the steps restored."""
        if not self.depth or state.get("world_size") != self.accelerator.num_processes:
            return []
        for saved in state["ranks"][self.accelerator.process_index]:
            step = saved["step"]
            if not next_step <= step < min(next_step + self.depth, self.num_rollouts):
                continue
            prompts = self.prompts_for(step)
            if [p["prompt_ids"] for p in prompts] != saved["prompt_ids"]:
                continue
            output = output_from_state(saved["output"])
            self.in_flight[step] = InFlight(step, prompts, None, output, saved["engine_seconds"])
        return sorted(self.in_flight)


@dataclass(frozen=True)
class EpisodeLayout:
    """How a rollout's episodes become micro-batch rows, decided once per run (`main`, episode_layout) and read by
    every phase: the pad id, padding-free packing (config.packing: one row of whole sequences) and the columns after
    each response (1 under score_placement after_last_token: the score's value position)."""

    pad_id: int
    packed: bool = False
    value_column: int = 0

    def batch(self, episodes: list[dict], response_ids: list[list[int]], rows: list[int], device: Any) -> tuple:
        """The micro-batch of `rows` (data.collate_episodes): its host batch, its batch on `device` (keeping the
        host's input_ids as host_input_ids: whether rows share their prompt, models.shared_prompt_groups, is then
        decided without a host sync) and its response width."""
        prompts_mb, responses_mb = [episodes[j]["prompt_ids"] for j in rows], [response_ids[j] for j in rows]
        host_batch = data.collate_episodes(prompts_mb, responses_mb, self.pad_id, self.value_column, self.packed)
        batch = {**data.to_device(host_batch, device), "host_input_ids": host_batch["input_ids"]}
        return host_batch, batch, batch["responses"].shape[1]


def episode_layout(cfg: RLVRConfig, pad_id: int) -> EpisodeLayout:
    """The run's EpisodeLayout, from its config (set-up: the step's phases read the layout, not the config)."""
    return EpisodeLayout(pad_id, cfg.packing, int(cfg.score_placement == "after_last_token"))


def output_rows(out: Any, prompts: list[dict]) -> tuple[list, list[list[int]], list[dict]]:
    """A generator output's played episodes (multi-turn: episodes.EpisodeOutput; else none), each
    completion's loss mask (all 1 for a single-turn completion) and its prompt row (multi-turn: with the prompt as
    its environment rendered it)."""
    played = list(getattr(out, "episodes", None) or [])
    loss_masks = getattr(out, "loss_masks", None) or [[1] * len(r) for r in out.response_ids]
    episodes = [prompts[i] for i in out.prompt_index]
    if played:
        episodes = [{**row, "prompt_ids": e.prompt_ids} for row, e in zip(episodes, played)]
    return played, loss_masks, episodes


def padded(rows: Sequence[Sequence[float]], width: int, fill: float = 0.0) -> torch.Tensor:
    """Per-token values of each row, right-padded with `fill` to `width`, as [len(rows), width] float32."""
    out = torch.full((len(rows), width), fill)
    for i, values in enumerate(rows):
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def episode_lengths(episodes: list[dict], response_ids: list[list[int]]) -> list[int]:
    """Tokens of each episode (prompt + response): what it takes in a packed row."""
    return [len(e["prompt_ids"]) + len(r) for e, r in zip(episodes, response_ids)]


def call_timed(feature: Any, hook: Callable[..., Any], *args: Any) -> Any:
    """hook(*args), its seconds added to the feature's clock (`feature`: an rlvr_ppo.Feature, as below)."""
    t0 = time.perf_counter()
    result = hook(*args)
    feature.seconds += time.perf_counter() - t0
    return result


def feature_scores(cfg: RLVRConfig, features: Sequence[Any], models: Any, batch: dict, loss_mask: Any,
                   episodes: Sequence[dict]) -> dict:  # fmt: skip
    """The features' score_batch tensors of one micro-batch, by name (each hook on its feature's clock), given the
    batch's padding mask times its host `loss_mask` (policy tokens) and the micro-batch's prompt rows."""
    hooks = [f for f in features if f.score_batch is not None]
    if not hooks:
        return {}
    mask = batch["mask"] * data.host_to_device(loss_mask, batch["mask"].device)
    scores = {}
    for f in hooks:
        scores.update(call_timed(f, f.score_batch, cfg, models, batch, mask, episodes))
    return scores


def clock_seconds(features: Sequence[Any]) -> dict[str, float]:
    """{clock: seconds} the features' clocked hooks took since the last call (their clocks reset to 0)."""
    clocks: dict[str, float] = {}
    for f in features:
        if f.clock is not None:
            clocks[f.clock] = clocks.get(f.clock, 0.0) + f.seconds
        f.seconds = 0.0
    return clocks


def shared_group(cfg: RLVRConfig) -> int:
    """The group over which the forwards may share a prompt's computation (models.shared_prompt_groups then checks
    that the micro-batch's rows do share it): num_samples_per_prompt, or 1 under shared_prompt_forward false."""
    return cfg.num_samples_per_prompt if cfg.shared_prompt_forward else 1


def no_grad_forwards(cfg: RLVRConfig, models: RLModels, accelerator: Any, episodes: list[dict],
                     response_ids: list[list[int]], lengths: list[int], mask: torch.Tensor, on_policy: bool,
                     ref_rows: Optional[list[int]], layout: EpisodeLayout,
                     features: Sequence[Any]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The no-grad forwards of the rollout in micro-batches (per_device_train_batch_size episodes, or packed rows of
    max_tokens_per_micro_batch tokens; a rank with fewer runs dummies, copies of its first that write the same rows
    again, as FSDP forwards are collectives), on the host: logp_values [3, n, R] (the policy's log-probs, off-policy
    only; the reference's, of `ref_rows` when not None; the value model's values), rm_scores [n] (0 without a reward
    model) and the features' score_batch tensors by name."""
    n, width = mask.shape
    batch_of = functools.partial(layout.batch, episodes, response_ids, device=accelerator.device)
    # Filled on the device and copied to the host once after the micro-batches (a copy per micro-batch would make the
    # host wait for each forward before it can queue the next).
    device_out = torch.zeros(3, n, width, device=accelerator.device)  # old_logp, ref_logp, old_values
    device_rm = torch.zeros(n, device=accelerator.device)
    device_extra: dict[str, torch.Tensor] = {}  # the features' score_batch tensors
    group, truncation = shared_group(cfg), sampling_truncation(cfg)
    parts = {"old_logprobs": 0.0, "reference": 0.0}  # host seconds of these two passes (PhaseClock.PARTS)
    with torch.no_grad():
        if ref_rows is not None:
            t0 = time.perf_counter()
            reference_logp_of_rows(device_out[1], cfg, models, accelerator, ref_rows, lengths, batch_of)
            parts["reference"] += time.perf_counter() - t0
        for rows, _ in step_micro_batches(accelerator, list(range(n)), lengths, cfg):
            _, batch, r = batch_of(rows)
            at = data.host_to_device(torch.tensor(rows), accelerator.device)
            with accelerator.autocast():
                if not on_policy:
                    t0 = time.perf_counter()
                    device_out[0][at, :r] = response_scores(
                        models.policy, batch, cfg.temperature, group, truncation=truncation
                    ).logp
                    parts["old_logprobs"] += time.perf_counter() - t0
                if models.reference is not None and ref_rows is None:
                    t0 = time.perf_counter()
                    device_out[1][at, :r] = reference_scores(models, batch, cfg.temperature, group, truncation).logp
                    parts["reference"] += time.perf_counter() - t0
                if models.value is not None:
                    device_out[2][at, :r] = token_values(models.value, batch, group)
                if models.reward is not None:
                    device_rm[at] = sequence_scores(models.reward, batch, group)
                rows_of = [episodes[j] for j in rows]
                for name, x in feature_scores(cfg, features, models, batch, mask[rows, :r], rows_of).items():
                    device_extra.setdefault(name, torch.zeros(n, width, device=accelerator.device))[at, :r] = x
    return {"logp_values": device_out.cpu(), "rm_scores": device_rm.cpu(), "part_seconds": parts,
            **{name: x.cpu() for name, x in device_extra.items()}}  # fmt: skip


def reference_logp_of_rows(into: torch.Tensor, cfg: RLVRConfig, models: RLModels, accelerator: Any, rows: list[int],
                           lengths: list[int], batch_of: Callable[[list], tuple]) -> None:  # fmt: skip
    """The reference's log-probs of `rows` written into their rows of `into`; a rank left with fewer micro-batches
    runs dummies up to the most (FSDP forwards are collectives)."""
    for mb, real in step_micro_batches(accelerator, rows, [lengths[j] for j in rows], cfg, 0):
        _, batch, r = batch_of(mb)
        with accelerator.autocast():
            logp = reference_scores(models, batch, cfg.temperature, shared_group(cfg), sampling_truncation(cfg)).logp
        if real:
            into[data.host_to_device(torch.tensor(mb), accelerator.device), :r] = logp


def reference_scores(
    models: RLModels,
    batch: dict[str, torch.Tensor],
    temperature: float,
    group: int,
    truncation: Optional[SamplingTruncation] = None,
) -> TokenScores:
    """The reference's response log-probs, under the sampler's truncation like the policy's (so the KL compares the
    two as samplers, 0 for identical weights); under LoRA the reference is the policy with its adapters disabled."""
    if models.reference is not models.policy:
        return response_scores(models.reference, batch, temperature, group, truncation=truncation)
    from open_instruct.lora import adapter_disabled

    with adapter_disabled(models.reference):
        return response_scores(models.reference, batch, temperature, group, truncation=truncation)


def start_reward_function_models(cfg: RLVRConfig, generator: Any, accelerator: Any) -> list:
    """The reward functions' models that start with the run, once the generator is up (rewards.run_hooks: e.g. a
    model on the run's own engines, or on engines started for it); what was started, to close at the end."""
    return [started for hook in rewards.run_hooks(cfg.reward_functions or ()) for started in
            hook.start_run(cfg, generator, accelerator)]  # fmt: skip


def reward_function_scores(
    cfg: RLVRConfig, examples: list[dict], texts: list[str], response_ids: list[list[int]]
) -> tuple[list[float], dict[str, list[Optional[float]]]]:
    """The weighted sum of the reward functions per completion and each one's values (rewards.custom_reward_values),
    called as TRL calls reward_funcs (every column of the row, TRL's completion shape), each call under
    reward_function_timeout."""
    inputs = rewards.reward_function_inputs(examples, texts, response_ids)
    where = [e.get("where", f"row {e.get('row')}") for e in examples]
    return rewards.custom_reward_values(
        cfg.reward_functions, cfg.reward_function_weights, inputs, where, cfg.reward_function_timeout
    )


def score_texts(
    cfg: RLVRConfig, texts: list[str], examples: list[dict], tokenizer: Any, response_ids: list[list[int]]
) -> Any:
    """Verifier rewards of completions (each row's verifier, under the time limit), plus the weighted custom reward
    functions (reward_functions; `correct` stays the verifiers' verdict)."""
    verifiers = [e["verifier"] for e in examples]
    scored = rewards.score_batch(
        texts,
        [e["ground_truth"] for e in examples],
        verifiers,
        verification_reward=cfg.verification_reward,
        timeout=cfg.verifier_timeout,
        code=code_settings(cfg) if "code" in verifiers else None,  # the sandbox only for `code` rows
    )
    if not cfg.reward_functions:
        return scored
    extra, values = reward_function_scores(cfg, examples, texts, response_ids)
    return scored._replace(rewards=[r + x for r, x in zip(scored.rewards, extra)], function_values=values)


def score_rollout(cfg: RLVRConfig, out: Any, examples: list[dict], tokenizer: Any) -> Any:
    """score_texts of the completions, or for episodes (episodes.EnvironmentRun.play) their environments'
    rewards: verification_reward x episode_score per episode (the verifier ran inside the environment) plus the
    custom reward functions of the whole response text; `correct` from the last turn."""
    if getattr(out, "episodes", None) is None:  # single-turn completions
        return score_texts(cfg, out.texts, examples, tokenizer, out.response_ids)
    from open_instruct.episodes import episode_correct, episode_score

    aggregation, scale = cfg.turn_reward_aggregation, cfg.verification_reward
    scores, values = [scale * episode_score(e, aggregation) for e in out.episodes], None
    if cfg.reward_functions:
        extra, values = reward_function_scores(cfg, examples, out.texts, out.response_ids)
        scores = [r + x for r, x in zip(scores, extra)]
    timeouts = sum(e.verifier_timeouts for e in out.episodes)
    return rewards.BatchScores(scores, [episode_correct(e) for e in out.episodes], timeouts, 0.0, {}, values)


def environment_run(cfg: RLVRConfig, tokenizer: Any) -> Optional[EnvironmentRun]:
    """The run's environment resources (None: single-turn); the built-in environments verify a final answer with
    the row's verifier (its `dataset` column) as score_texts does, the score in [0, 1]."""
    if cfg.environment is None:
        return None
    from open_instruct.episodes import EnvironmentRun

    code: list[CodeSettings] = []  # the sandbox's settings, made when an episode first ends on a `code` row

    def verify(text: str, ground_truth: Any, verifier: str) -> tuple[float, bool]:
        if not code and rewards.normalize_verifier_name(verifier) == "code":
            code.append(code_settings(cfg))
        scored = rewards.score_batch(
            [text], [ground_truth], [verifier], verification_reward=1.0, timeout=cfg.verifier_timeout,
            code=code[0] if code else None,
        )  # fmt: skip
        return float(scored.rewards[0]), scored.num_timeouts > 0

    integration = integrations.find(cfg.environment)  # an integration may play its episodes its own way
    run_class = integration.environment_run(cfg.environment) if integration and integration.environment_run else None
    return (run_class or EnvironmentRun)(cfg, tokenizer, verify, step_workers=cfg.sandbox_workers)


def render_environment_prompts(cfg: RLVRConfig, examples: list[dict], environments: EnvironmentRun) -> list[dict]:
    """Each row's prompt as its environment renders it (reset + the chat template with the tool schemas): what
    the episodes start from, measured against max_prompt_length here, before any model loads (a row the
    environment refuses fails here too). Longer prompts: dropped (overlong drop) or refused."""
    kept = []
    for example in examples:
        try:
            ids = environments.prompt_ids(example)
        except (DataError, ValueError, KeyError) as e:
            raise DataError(f"{example['where']}: the environment refused the row: {e}") from e
        if len(ids) > cfg.max_prompt_length:
            if cfg.overlong == "drop":
                continue
            raise DataError(
                f"{example['where']}: the environment's prompt is {len(ids)} tokens (tool schemas included), over "
                f"max_prompt_length {cfg.max_prompt_length}; raise it or set overlong: drop"
            )
        kept.append({**example, "prompt_ids": ids})
    if examples and not kept:
        raise DataError(f"every prompt is longer than max_prompt_length {cfg.max_prompt_length} once rendered")
    return kept


def code_settings(cfg: RLVRConfig) -> CodeSettings:
    """The `code` verifier's sandbox settings from the config (the run's paths hidden: sandbox.run_hidden_paths)."""
    from open_instruct.code_verifier import CodeSettings
    from open_instruct.sandbox import run_hidden_paths

    return CodeSettings(
        reward=cfg.code_reward,
        test_seconds=cfg.code_test_seconds,
        memory_mb=cfg.code_memory_mb,
        workers=cfg.sandbox_workers,
        batch_timeout=cfg.sandbox_batch_timeout,
        hide_paths=run_hidden_paths(cfg),
        max_tests=cfg.code_max_tests,
        allow_script_tests=cfg.code_allow_script_tests,
    )


class PhaseClock:
    """Seconds per phase and response tokens over the rollouts since the last log row (eval and checkpoint time
    excluded; rank 0's clock), turned into time/<phase> per rollout and throughput. `feature_clocks`: the features'
    own phases (rlvr_ppo.Feature.clock, e.g. distillation's teacher_forward), reported beside the fixed ones."""

    PHASES = ("weight_sync", "generation", "scoring", "inference", "training")
    # parts of a phase, reported as time/<part> beside it and not counted twice in the rates: the no-grad passes'
    # old log-probs and reference (inside inference), the optimizer step with its gradient clipping (inside
    # training). Host clocks: exact on CPU; on a GPU a part ends when its kernels are queued.
    PARTS = ("old_logprobs", "reference", "optimizer")

    def __init__(self, feature_clocks: Sequence[str] = ()) -> None:
        self.feature_clocks = tuple(feature_clocks)
        self.seconds = dict.fromkeys((*self.PHASES, *self.feature_clocks), 0.0)
        self.parts = dict.fromkeys(self.PARTS, 0.0)
        self.rollouts, self.tokens, self.engine_seconds, self.sync_bytes = 0, 0, 0.0, 0

    def add(self, seconds: dict[str, float], tokens: int, sync_bytes: int) -> None:
        for k, v in seconds.items():
            if k in self.seconds:
                self.seconds[k] += v
            elif k in self.parts:
                self.parts[k] += v
        # the engines' wall time per rollout: more than `generation` (what the trainer waited) when it overlapped
        self.engine_seconds += seconds.get("generation_engine", seconds.get("generation", 0.0))
        self.sync_bytes += sync_bytes
        self.rollouts += 1
        self.tokens += tokens

    def report(self, accelerator: Any, episodes_per_rollout: int) -> dict[str, float]:
        k, tokens = max(self.rollouts, 1), global_sum(accelerator, self.tokens)
        busy = max(sum(self.seconds.values()), 1e-9)
        row = {f"time/{name}": v / k for name, v in (*self.seconds.items(), *self.parts.items())}
        row["time/generation_engine"] = self.engine_seconds / k
        row["perf/weight_sync_bytes"] = self.sync_bytes / k  # per rollout, to every engine (0: in-process)
        # async: the share of the engines' generation time hidden behind training (0 when synchronous)
        waited = self.seconds["generation"]
        row["perf/generation_hidden_fraction"] = max(0.0, 1.0 - waited / max(self.engine_seconds, 1e-9))
        # the share of the trainer's time the generator had nothing to generate (its thread or engines idle)
        row["perf/engine_idle_fraction"] = max(0.0, 1.0 - self.engine_seconds / busy)
        row["perf/episodes_per_second"] = k * episodes_per_rollout / busy
        row["perf/response_tokens_per_second"] = tokens / busy
        # this process's CPU time since it started (all threads): the cost axis of a learning curve on CPU
        row["perf/process_cpu_minutes"] = time.process_time() / 60
        self.__init__(self.feature_clocks)
        return row


def evaluate(
    cfg: RLVRConfig,
    evals: list[dict],
    policy: Any,
    generator: Any,
    tokenizer: Any,
    accelerator: Any,
    environments: Optional[EnvironmentRun] = None,
) -> dict[str, float]:
    """Greedy verifiable accuracy on the held-out prompts (each evaluated once across ranks); per source too
    (eval/<source>/correct_rate) when the held-out set mixes sources. With an environment: one greedy episode
    per prompt, plus eval/turns_per_episode and eval/tool_calls_per_episode."""
    local = data.shard_for_eval(evals, accelerator.process_index, accelerator.num_processes)
    length = cfg.eval_response_length or cfg.response_length
    greedy = GenerationConfig(
        max_new_tokens=length,
        temperature=0.0,
        stop_strings=cfg.stop_strings,
        max_batch_size=cfg.per_device_eval_batch_size,
    )
    with generator.generation_context(policy):  # collective under FSDP: every rank joins, even one without prompts
        if not local:
            out = None
        elif environments is not None:
            out = environments.play(generator, local, greedy, environments.budget_for(length))
        else:
            out = generator.generate([e["prompt_ids"] for e in local], greedy)
    sources = data.mixed_sources(evals)
    sums = zero_sums_by_source(sources, ("correct", "score", "length", "non_stop", "n"))
    if out is not None:
        scored = score_rollout(cfg, out, local, tokenizer)
        for i, example in enumerate(local):  # one response per prompt (greedy, n = 1)
            for name in ["", example["source"]] if sources else [""]:
                sums[name]["correct"] += float(scored.correct[i])
                sums[name]["score"] += float(scored.rewards[i])
                sums[name]["length"] += float(len(out.response_ids[i]))
                sums[name]["non_stop"] += float(not out.stopped[i])
                sums[name]["n"] += 1.0
    totals = global_sums_by_source(accelerator, sums)
    t, n = totals[""], max(totals[""]["n"], 1.0)
    played = {}
    if environments is not None:  # collective: every rank joins
        from open_instruct.episodes import episode_metrics

        stats = episode_metrics(accelerator, out.episodes if out is not None else [], "eval/")
        played = {k: stats[k] for k in ("eval/turns_per_episode", "eval/tool_calls_per_episode")}
    return {
        **played,
        "eval/correct_rate": t["correct"] / n,
        "eval/score_mean": t["score"] / n,
        "eval/response_length": t["length"] / n,
        "eval/non_stop_rate": t["non_stop"] / n,
        **{f"eval/{s}/correct_rate": totals[s]["correct"] / max(totals[s]["n"], 1.0) for s in sources},
    }


def sample_rows(
    rollout: Any,
    tokenizer: Any,
    k: int,
    environments: Optional[EnvironmentRun] = None,
    reward_functions: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The first k completions of this rollout, for samples.jsonl (episodes: the whole conversation, each tool
    output between [[observation]] markers). With reward functions: each one's value (`rewards`) and the row's
    columns they take (`columns`), instead of a ground truth the row may not have."""
    if environments is not None and rollout.played:
        return environments.sample_rows(rollout.played, k)
    values = getattr(rollout, "reward_function_values", None) or {}
    rows = []
    for j, e in enumerate(rollout.episodes[:k]):
        row = {"prompt": tokenizer.decode(e["prompt_ids"]), "response": rollout.texts[j]}
        row["score"] = float(rollout.scores[j])
        if e.get("verifier") is not None or not reward_functions:
            row["ground_truth"] = str(e["ground_truth"])
        if reward_functions:
            row["rewards"] = {label: v[j] for label, v in values.items()}
            row["columns"] = rewards.columns_used(reward_functions, e.get("columns", {}))
        rows.append({**row, "stopped": bool(rollout.stopped[j])})
    return rows


def load_prompts(
    cfg: RLVRConfig, tokenizer: Any, accelerator: Any, environments: Optional[EnvironmentRun] = None
) -> tuple[list[dict], list[dict], Any, int]:
    """Train and held-out prompts, checked (verifiers, lengths, batch math) before any model loads; with an
    environment, as it renders them (render_environment_prompts). Returns them, the batch plan, and the longest
    prompt + response a generator must hold."""
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_prompts)
    # the sandbox's settings only for `code` rows (the code verifier is imported only by a run that has some)
    code = code_settings(cfg) if any(e.get("verifier") == "code" for e in train + evals) else None
    rewards.check_verifiers(train, "train", code)
    rewards.check_verifiers(evals, "eval", code)
    if cfg.reward_functions and not data.first_rows_checked(cfg):  # a hub dataset: probed on its rows now
        if accelerator.is_main_process:
            print(rewards.probe_line(cfg.reward_functions, len(train)), flush=True)
        rewards.probe_reward_functions(cfg.reward_functions, train, cfg.reward_function_timeout)
    if environments is not None:
        train = render_environment_prompts(cfg, train, environments)
        evals = render_environment_prompts(cfg, evals, environments)
        environments.probe_step(train[0])  # one step of the user's environment, before any model loads
    plan = cfg.batch_plan(accelerator.num_processes, len(train))
    model_config = AutoConfig.from_pretrained(
        cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code, gguf_file=cfg.gguf_file
    )
    max_positions = getattr(model_config, "max_position_embeddings", None)
    longest_prompt = max(len(e["prompt_ids"]) for e in train + evals)
    longest_response = max(cfg.response_length, cfg.eval_response_length or cfg.response_length)
    if max_positions and longest_prompt + longest_response > max_positions:
        raise ConfigError(
            f"longest prompt {longest_prompt} tokens + response_length {longest_response} exceeds the "
            f"model's max_position_embeddings {max_positions}: lower max_prompt_length or response_length"
        )
    if accelerator.is_main_process:
        print(console.startup_summary(cfg, plan, stats.summary(), len(evals)), flush=True)
    return train, evals, plan, longest_prompt + longest_response


@dataclass
class RLModels:
    """The policy (trained), the value model (PPO, trained), the frozen reference (None when beta is 0) and the
    optional frozen reward model. All prepared by accelerate (FSDP-sharded under FSDP)."""

    policy: Any
    value: Optional[Any] = None
    reference: Optional[Any] = None
    reward: Optional[Any] = None
    teacher: Optional[Any] = None  # on-policy distillation: frozen like the reference (no checkpoint state)
    teachers: dict[str, Any] = field(default_factory=dict)  # multi-teacher distillation: teacher_models by name

    def trained(self) -> dict[str, Any]:
        return {"policy": self.policy, **({"value": self.value} if self.value is not None else {})}


def load_models(
    cfg: RLVRConfig, tokenizer: Any, accelerator: Any, plan: Any
) -> tuple[RLModels, dict[str, Any], dict[str, Any]]:
    """The trained policy (+ value model for PPO) with their optimizers and schedules, the frozen reference (the
    initial policy; only when beta > 0) and the optional frozen reward model, all prepared by accelerate.
    (The model loaders are looked up when called, so a test can stand in for them.)"""
    from open_instruct.models import (
        DTYPES,
        TokenValueModel,
        disable_dropout,
        hold_frozen_in_compute_dtype,
        load_causal_lm,
        load_policy,
        load_sequence_classifier,
        make_optimizer_and_scheduler,
    )

    def adapted(model: Any, task_type: str) -> Any:  # LoRA adapters (lora.py is imported only by a LoRA run)
        if not cfg.use_lora:
            return model
        from open_instruct.lora import apply_lora

        return apply_lora(model, cfg, task_type, dropout=False)

    def causal_lm() -> Any:
        model = load_policy(cfg)
        disable_dropout(model)
        return model

    def scalar_model(path: str, gguf_file: Optional[str], trained: bool) -> TokenValueModel:
        classifier = load_sequence_classifier(
            path,
            DTYPES["no"],
            gguf_file,
            cfg.trust_remote_code,
            pad_token_id=tokenizer.pad_token_id,
            require_trained_head=not trained,  # a frozen reward model's head must be trained; a value head may be fresh
            attn_implementation=cfg.attention_kernel,
        )
        return TokenValueModel(adapted(classifier, "SEQ_CLS") if trained else classifier)

    # LoRA: the policy gets adapters and the reference is that same model with them disabled (no second copy).
    models = RLModels(
        policy=adapted(causal_lm(), "CAUSAL_LM"), reference=causal_lm() if cfg.beta > 0 and not cfg.use_lora else None
    )
    if cfg.uses_value_model:
        # A fresh scalar head (value model from the policy) is initialised the same way every run.
        torch.manual_seed(cfg.seed)
        models.value = scalar_model(
            cfg.value_model_path or cfg.model_name_or_path, None if cfg.value_model_path else cfg.gguf_file, True
        )
        disable_dropout(models.value.seq_cls)
    if cfg.reward_model_path:
        models.reward = scalar_model(cfg.reward_model_path, None, False)
    if cfg.activation_checkpointing:
        models.policy.gradient_checkpointing_enable()
        if models.value is not None:
            models.value.seq_cls.gradient_checkpointing_enable()
    optimizers, schedulers = {}, {}
    for name, model in models.trained().items():
        optimizer, schedulers[name] = make_optimizer_and_scheduler(model, cfg, plan.optimizer_steps)
        prepared, optimizers[name] = accelerator.prepare(model, optimizer)
        setattr(models, name, prepared)
    sharded = is_fsdp(accelerator)
    if models.reference is not None:  # frozen models: half the memory under bf16, the same numbers
        models.reference = hold_frozen_in_compute_dtype(models.reference, cfg.mixed_precision, sharded)
        models.reference = prepare_frozen(accelerator, models.reference)
    elif cfg.use_lora and cfg.beta > 0:
        models.reference = models.policy  # collect_rollout runs it with the adapters disabled
    if models.reward is not None:
        hold_frozen_in_compute_dtype(models.reward.seq_cls, cfg.mixed_precision, sharded)
        models.reward = prepare_frozen(accelerator, models.reward)
    # distillation.check_teacher compared the vocabularies before any load; every loaded teacher stays resident, a
    # teacher server is asked over HTTP (teacher_server.py)
    for key, path in cfg.teacher_settings():
        name = key.removeprefix("teacher_models ")
        if is_teacher_server(path):
            from open_instruct.teacher_server import TeacherServer

            teacher = TeacherServer(name, path)
        else:
            teacher = load_causal_lm(
                path, DTYPES["no"], None, cfg.trust_remote_code, attn_implementation=cfg.attention_kernel
            )
            disable_dropout(teacher)
            teacher = prepare_frozen(accelerator, hold_frozen_in_compute_dtype(teacher, cfg.mixed_precision, sharded))
        if cfg.teacher_models:
            models.teachers[name] = teacher
        else:
            models.teacher = teacher
    return models, optimizers, schedulers
