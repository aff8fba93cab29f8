"""Batch math and training counters: the single source of truth every script imports.

All counts are in samples. One sample (an *episode*) is one prompt+completion in RL, and one example
(SFT) or one preference pair (RM, DPO) elsewhere. Glossary:

    local_mini_batch_size = per_device_train_batch_size x gradient_accumulation_steps   (per device, per update)
    mini_batch_size       = local_mini_batch_size x world_size                           (global, per update)
    rollout_batch_size    = local_rollout_batch_size x world_size                        (RL, prompts per rollout)
    episodes_per_rollout  = rollout_batch_size x num_samples_per_prompt                  (RL)
    num_mini_batches      = episodes_per_rollout / mini_batch_size                       (RL, must be exact)
    num_training_steps    = total_episodes // mini_batch_size        (SFT/RM/DPO: optimizer steps)
                          = total_episodes // episodes_per_rollout   (RL: rollouts)
    optimizer_steps       = num_training_steps x num_epochs x num_mini_batches           (RL)

Padding-free packing (`max_tokens_per_micro_batch`, off by default) changes how a device's local_mini_batch_size
samples are cut into forward/backward passes, not how many samples an optimizer step takes: instead of
gradient_accumulation_steps micro-batches of per_device_train_batch_size padded rows, as many packed rows of at
most max_tokens_per_micro_batch tokens as the samples need (the same count on every rank: the most any rank needs).
Losses are still normalised over the global mini-batch, so an optimizer step is the same update either way.

This module imports nothing heavy (no torch) so the planner can use it in a fraction of a second.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from open_instruct.errors import ConfigError


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


def _require_divisible(num_name: str, num: int, den_name: str, den: int) -> int:
    if num % den != 0:
        raise ConfigError(
            f"{num_name} {num} is not divisible by {den_name} {den} "
            f"({num} / {den} = {num / den:.4g}; {num} % {den} = {num % den})"
        )
    return num // den


@dataclass(frozen=True)
class BatchPlan:
    """Every derived batch quantity of one run. RL-only fields are None for supervised runs."""

    kind: str  # "supervised" or "rl"
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    local_mini_batch_size: int
    mini_batch_size: int
    total_episodes: int
    num_training_steps: int  # supervised: optimizer steps; RL: rollouts
    optimizer_steps: int
    num_examples: Optional[int] = None  # dataset rows (RL: prompts)
    num_train_epochs: Optional[float] = None  # passes over the data implied by total_episodes
    # RL only
    local_rollout_batch_size: Optional[int] = None
    rollout_batch_size: Optional[int] = None
    num_samples_per_prompt: Optional[int] = None
    episodes_per_rollout: Optional[int] = None
    num_mini_batches: Optional[int] = None
    num_epochs: Optional[int] = None
    local_episodes_per_rollout: Optional[int] = None
    # packing: micro-batches by tokens (None: padded micro-batches of per_device_train_batch_size rows)
    max_tokens_per_micro_batch: Optional[int] = None

    @property
    def is_rl(self) -> bool:
        return self.kind == "rl"

    @property
    def episodes_per_optimizer_step(self) -> int:
        return self.mini_batch_size

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def log_rows(self, logging_steps: int) -> int:
        """Rows the logging gate lets through: optimizer steps (RL: rollouts) that are multiples of logging_steps."""
        return count_multiples(self.num_training_steps if self.is_rl else self.optimizer_steps, logging_steps)


def count_multiples(last_step: int, every: int) -> int:
    """How many of the steps 1..last_step are multiples of `every` (0 when `every` <= 0, i.e. disabled)."""
    return last_step // every if every and every > 0 else 0


def count_eval_points(last_step: int, every: int, baseline: bool) -> int:
    """Evaluations a run makes (the gate is `should_fire(step, every, last_step)`): the multiples of `every`, the
    last step when it is not one, and the step-0 baseline the scripts that have one log first (DPO, RLVR)."""
    if not every or every <= 0 or last_step <= 0:
        return 0
    return int(baseline) + last_step // every + int(last_step % every != 0)


def check_token_budget(max_tokens: Optional[int], longest: int, longest_what: str) -> None:
    """max_tokens_per_micro_batch (None or 0: off) must hold the longest item a micro-batch may get in one piece:
    packing never splits a sequence (or a preference pair)."""
    if max_tokens is None or max_tokens == 0:
        return
    _require_positive_int("max_tokens_per_micro_batch", max_tokens)
    if max_tokens < longest:
        raise ConfigError(
            f"max_tokens_per_micro_batch {max_tokens} is smaller than the longest item a micro-batch must hold in "
            f"one piece: {longest_what} = {longest} tokens; set it to at least {longest}, or 0 to turn packing off"
        )


def supervised_batch_plan(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    num_examples: Optional[int] = None,
    num_train_epochs: Optional[float] = None,
    total_episodes: Optional[int] = None,
    max_tokens_per_micro_batch: Optional[int] = None,
) -> BatchPlan:
    """Batch math for SFT, RM and DPO. total_episodes defaults to num_train_epochs x num_examples."""
    _require_positive_int("per_device_train_batch_size", per_device_train_batch_size)
    _require_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    _require_positive_int("world_size", world_size)
    local_mini = per_device_train_batch_size * gradient_accumulation_steps
    mini = local_mini * world_size
    total_episodes = _resolve_total_episodes(total_episodes, num_examples, num_train_epochs, "examples")
    steps = total_episodes // mini
    if steps == 0:
        raise ConfigError(
            f"total_episodes {total_episodes} gives 0 optimizer steps: it is smaller than mini_batch_size {mini} "
            f"(= per_device_train_batch_size {per_device_train_batch_size} x gradient_accumulation_steps "
            f"{gradient_accumulation_steps} x world_size {world_size})"
        )
    return BatchPlan(
        kind="supervised",
        world_size=world_size,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        local_mini_batch_size=local_mini,
        mini_batch_size=mini,
        total_episodes=total_episodes,
        num_training_steps=steps,
        optimizer_steps=steps,
        num_examples=num_examples,
        num_train_epochs=(total_episodes / num_examples) if num_examples else None,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
    )


def rl_batch_plan(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    local_rollout_batch_size: int,
    num_samples_per_prompt: int,
    num_epochs: int,
    total_episodes: Optional[int],
    num_examples: Optional[int] = None,
    group_size: Optional[int] = None,
    max_tokens_per_micro_batch: Optional[int] = None,
) -> BatchPlan:
    """Batch math for RLVR. `group_size` (GRPO) must divide every batch a group could be split across."""
    for name, value in [
        ("per_device_train_batch_size", per_device_train_batch_size),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("world_size", world_size),
        ("local_rollout_batch_size", local_rollout_batch_size),
        ("num_samples_per_prompt", num_samples_per_prompt),
        ("num_epochs", num_epochs),
    ]:
        _require_positive_int(name, value)
    if total_episodes is None:
        raise ConfigError("total_episodes is required for RL (number of completions to train on)")
    _require_positive_int("total_episodes", total_episodes)
    local_mini = per_device_train_batch_size * gradient_accumulation_steps
    mini = local_mini * world_size
    rollout = local_rollout_batch_size * world_size
    local_episodes = local_rollout_batch_size * num_samples_per_prompt
    episodes_per_rollout = rollout * num_samples_per_prompt
    if episodes_per_rollout % mini != 0:
        raise ConfigError(
            f"episodes_per_rollout {episodes_per_rollout} (= local_rollout_batch_size {local_rollout_batch_size} x "
            f"world_size {world_size} x num_samples_per_prompt {num_samples_per_prompt}) is not divisible by "
            f"mini_batch_size {mini} (= local_mini_batch_size {local_mini} x world_size {world_size}); "
            f"{episodes_per_rollout} / {mini} = {episodes_per_rollout / mini:.4g}"
        )
    num_mini_batches = episodes_per_rollout // mini
    if group_size is not None:
        # Groups are laid out contiguously on one device: a device's mini-batch must hold whole groups.
        _require_divisible(
            f"local_mini_batch_size (= per_device_train_batch_size {per_device_train_batch_size} x "
            f"gradient_accumulation_steps {gradient_accumulation_steps})",
            local_mini,
            "group size num_samples_per_prompt",
            group_size,
        )
    steps = total_episodes // episodes_per_rollout
    if steps == 0:
        raise ConfigError(
            f"total_episodes {total_episodes} gives 0 rollouts: it is smaller than episodes_per_rollout "
            f"{episodes_per_rollout} (= rollout_batch_size {rollout} x num_samples_per_prompt {num_samples_per_prompt})"
        )
    return BatchPlan(
        kind="rl",
        world_size=world_size,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        local_mini_batch_size=local_mini,
        mini_batch_size=mini,
        total_episodes=total_episodes,
        num_training_steps=steps,
        optimizer_steps=steps * num_epochs * num_mini_batches,
        num_examples=num_examples,
        num_train_epochs=(steps * rollout / num_examples) if num_examples else None,
        local_rollout_batch_size=local_rollout_batch_size,
        rollout_batch_size=rollout,
        num_samples_per_prompt=num_samples_per_prompt,
        episodes_per_rollout=episodes_per_rollout,
        num_mini_batches=num_mini_batches,
        num_epochs=num_epochs,
        local_episodes_per_rollout=local_episodes,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
    )


def _resolve_total_episodes(
    total_episodes: Optional[int], num_examples: Optional[int], num_train_epochs: Optional[float], what: str
) -> int:
    if total_episodes is not None:
        _require_positive_int("total_episodes", total_episodes)
        return total_episodes
    if num_examples is None or num_train_epochs is None:
        raise ConfigError(f"set total_episodes, or num_train_epochs together with the number of {what}")
    _require_positive_int("num_examples (dataset rows)", num_examples)
    if not (isinstance(num_train_epochs, (int, float)) and not isinstance(num_train_epochs, bool)) or not (
        num_train_epochs > 0 and math.isfinite(num_train_epochs)
    ):
        raise ConfigError(f"num_train_epochs must be a positive number, got {num_train_epochs!r}")
    return int(num_train_epochs * num_examples)


# ---------------------------------------------------------------------------------------------------------------------
# Counters


@dataclass
class Counters:
    """The four training counters, never mixed.

    episode: samples consumed (completions in RL, examples/pairs otherwise), summed over all processes.
    optimizer_step: parameter updates (the `global_step`).
    rollout_step: RL generate -> score -> update iterations (0 outside RL).
    epoch: fractional passes over the dataset (RL: over the prompts).
    """

    episode: int = 0
    optimizer_step: int = 0
    rollout_step: int = 0
    epoch: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_log(self) -> dict[str, Any]:
        return {
            "episode": self.episode,
            "optimizer_step": self.optimizer_step,
            "rollout_step": self.rollout_step,
            "epoch": round(self.epoch, 6),
        }

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def should_log(step: int, logging_steps: int) -> bool:
    """The logging gate. `step` is optimizer_step (RL: rollout_step). No other condition gates a log row."""
    return logging_steps > 0 and step > 0 and step % logging_steps == 0


def should_fire(step: int, every: Optional[int], last_step: Optional[int] = None) -> bool:
    """Eval/checkpoint gate: every `every` steps, and also at the last step when given."""
    if step <= 0:
        return False
    if every and every > 0 and step % every == 0:
        return True
    return last_step is not None and step == last_step


GENERATION_TOKENS_PER_CALL = 131072  # default KV-cache bound of one HF generate call, in tokens (prompt + response)


def generation_sequences_per_call(cfg: Any, max_model_len: int) -> int:
    """Sequences per HF generate call in an RL run: `generation_micro_batch_size`, or as many as hold
    GENERATION_TOKENS_PER_CALL tokens at max_model_len each, never more than the rank's whole rollout
    (local_rollout_batch_size x num_samples_per_prompt). At Llama-3-8B shapes a token's KV cache is 2 x 32 layers x
    8 KV heads x 128 x 2 bytes (bf16) = 128 KiB, so the default bound is 16 GiB per call."""
    rollout = cfg.local_rollout_batch_size * cfg.num_samples_per_prompt
    chosen = cfg.generation_micro_batch_size or max(1, GENERATION_TOKENS_PER_CALL // max(1, max_model_len))
    return max(1, min(rollout, chosen))


# ---------------------------------------------------------------------------------------------------------------------
# TRL GRPO's batch shape in this repo's keys


@dataclass(frozen=True)
class TRLGRPOShape:
    """The batch shape of a TRL GRPOTrainer run (trl/trainer/grpo_config.py `__post_init__` and grpo_trainer.py
    `_prepare_inputs`, TRL 1.16), per process, and the keys that give the same shape here (`ours`), or why none
    does (`mismatch`).

        steps_per_generation  = gradient_accumulation_steps        (neither it nor generation_batch_size set)
                              = generation_batch_size / (per_device_train_batch_size x processes)
        generation_batch_size = per_device_train_batch_size x processes x steps_per_generation   (completions)
        optimizer steps per generation = steps_per_generation x num_iterations / gradient_accumulation_steps
        completions generated = max_steps x per_device_train_batch_size x gradient_accumulation_steps x processes
                                / num_iterations
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_generations: int
    num_iterations: int
    max_steps: Optional[int]
    processes: int = 1
    ours: dict[str, int] = field(default_factory=dict)
    mismatch: Optional[str] = None

    @property
    def completions_per_generation(self) -> int:
        return self.per_device_train_batch_size * self.processes * self.steps_per_generation

    @property
    def optimizer_steps_per_generation(self) -> float:
        return self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps


def trl_grpo_shape(
    *,
    per_device_train_batch_size: int = 8,
    gradient_accumulation_steps: int = 1,
    num_generations: int = 8,
    num_iterations: int = 1,
    steps_per_generation: Optional[int] = None,
    generation_batch_size: Optional[int] = None,
    max_steps: Optional[int] = None,
    processes: int = 1,
) -> TRLGRPOShape:
    """TRL's shape for these GRPOConfig values (TRL's defaults as the keyword defaults) and the keys that train the
    same run here: per_device_train_batch_size and gradient_accumulation_steps as they are, num_samples_per_prompt
    = num_generations, num_epochs = num_iterations, local_rollout_batch_size = per_device_train_batch_size x
    steps_per_generation / num_generations prompts per process, total_episodes = the completions TRL generates in
    max_steps optimizer steps. `mismatch` says why no setting here is the same run (a group split across
    processes, a generation that does not fill whole optimizer steps, max_steps mid-generation)."""
    pd, ga, n = per_device_train_batch_size, gradient_accumulation_steps, num_generations
    problems = []
    if steps_per_generation is None:
        if generation_batch_size is None:
            steps_per_generation = ga
        else:
            steps_per_generation = max(generation_batch_size // (pd * processes), 1)
            if generation_batch_size % (pd * processes):
                problems.append(
                    f"TRL refuses generation_batch_size {generation_batch_size}: not a multiple of "
                    f"per_device_train_batch_size {pd} x processes {processes}"
                )
    ours = {
        "per_device_train_batch_size": pd,
        "gradient_accumulation_steps": ga,
        "num_samples_per_prompt": n,
        "num_epochs": num_iterations,
    }
    local_completions = pd * steps_per_generation
    if local_completions % n:
        problems.append(
            f"a process generates per_device_train_batch_size {pd} x steps_per_generation {steps_per_generation} = "
            f"{local_completions} completions, not whole groups of num_generations (num_samples_per_prompt) {n} "
            "(here each process holds whole groups)"
        )
    else:
        ours["local_rollout_batch_size"] = local_completions // n
    if steps_per_generation % ga:
        problems.append(
            f"steps_per_generation {steps_per_generation} is not a multiple of gradient_accumulation_steps {ga} "
            "(TRL then mixes generations inside one optimizer step; here a rollout fills whole optimizer steps)"
        )
    if max_steps is not None:
        completions = max_steps * pd * ga * processes
        if completions % num_iterations:
            problems.append(
                f"max_steps {max_steps} ends inside a pass over a generation (num_iterations {num_iterations})"
            )
        ours["total_episodes"] = completions // num_iterations
        per_generation = steps_per_generation * num_iterations / ga
        if not problems and max_steps % per_generation:
            problems.append(
                f"max_steps {max_steps} is not a multiple of the {per_generation:g} optimizer steps per generation: "
                "TRL stops inside a generation, here the last partial rollout is not run"
            )
    return TRLGRPOShape(
        pd, ga, steps_per_generation, n, num_iterations, max_steps, processes, ours, "; ".join(problems) or None
    )


def trl_rollout_batch_size(per_device_train_batch_size: Any, gradient_accumulation_steps: Any, group: Any) -> Any:
    """local_rollout_batch_size null: TRL GRPO's default generation batch, per_device_train_batch_size x
    gradient_accumulation_steps completions per process (steps_per_generation = gradient_accumulation_steps), in
    prompts. Values that are not positive integers are returned as None for the field checks to name."""
    values = (per_device_train_batch_size, gradient_accumulation_steps, group)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    shape = trl_grpo_shape(
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_generations=group,
    )
    if shape.mismatch:
        raise ConfigError(
            f"local_rollout_batch_size null (TRL's generation batch) cannot be derived: {shape.mismatch}; set "
            "local_rollout_batch_size (prompts per process per rollout)"
        )
    return shape.ours["local_rollout_batch_size"]
