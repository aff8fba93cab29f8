"""RL with verifiable rewards: PPO with a value model (default) or GRPO (`--algo grpo`). Read top to bottom.

    python open_instruct/rlvr_ppo.py configs/rlvr_tiny.yaml [--algo grpo] [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml

The file is the math (pure functions with their formulas), then one function per phase of a rollout step, then
`main`, which loads everything and runs the phases in a loop:

    collect_rollout     prompts -> generate `num_samples_per_prompt` completions each -> score them (verifiers, plus a
                        reward model and the non-stop penalty when configured) -> no-grad log-probs of the sampling
                        policy and the frozen reference, values (PPO)                              -> Rollout
    compute_advantages  the one place that branches on the algorithm                               -> Advantages
    update              num_epochs passes x num_mini_batches optimizer steps x micro-batches, the optimizer step in
                        sight; losses are token means over the *global* mini-batch, so 1 or N processes give the
                        same update
    log_row             the metrics row of the rollout

Per-token tensors of a rollout are *response-aligned*: column t is response token t of the row (prompt tokens are
not stored), and `mask` marks real tokens (right padding after the response's stop).

PPO (Tulu 3): reward_t = -beta * KL_t, plus the score at the last response token; GAE(gamma, lam) with a value model
(a scalar head on the backbone's hidden states, initialised from `value_model_path` or the policy); whitened
advantages; clipped policy and value losses.
GRPO: advantages are the group-normalised scores (r - mean_group) / (std_group + eps), no value model; the KL to the
reference is a loss term beta * KL_t (k3 typical). A prompt's group never spans two devices or two mini-batches.

Speed (in `models.py`, not here): completions of one prompt share its forward (the prompt runs once, its key/value
cache is repeated for the responses; single process). GRPO with one pass over one mini-batch trains on exactly the
weights that sampled, so the training forward's own log-probs serve as the old ones (no separate pass).
"""

from __future__ import annotations

from open_instruct import runtime
from open_instruct.config import RLVRConfig

if __name__ == "__main__":  # the math below needs torch at import: check the config first, so a bad one exits 2 fast
    runtime.start_before_imports(RLVRConfig)

import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------------
# The math: pure functions of [batch, response_len] tensors (response-aligned, `mask` 1 on real tokens).


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all elements when None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all elements when None)."""
    return (
        masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)
        if dim is not None
        else masked_sum(x, mask) / mask.sum().clamp(min=1)
    )


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked elements: sum(mask * (x - mean)^2) / (n - 1), n = sum(mask)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    return masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    mean: Optional[torch.Tensor] = None,
    var: Optional[torch.Tensor] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked elements, 0 elsewhere.

    mean/var default to the masked mean and unbiased variance of x; the training loop passes statistics summed over
    all processes so every rank whitens with the same numbers."""
    if mean is None:
        mean = masked_mean(x, mask)
    if var is None:
        var = masked_var(x, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from a token sampled from pi (Schulman's k1/k2/k3):

    k1 = logp - ref_logp                       unbiased, can be negative
    k2 = 0.5 * (logp - ref_logp)^2             biased, >= 0
    k3 = (r - 1) - log r,  r = exp(ref_logp - logp)   unbiased, >= 0 (GRPO's choice)
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r with log r = -log_ratio
    raise ValueError(f"unknown kl_estimator {estimator!r}; choose k1, k2 or k3")


def last_token_indices(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row of a right-padded response mask (0 for an empty row)."""
    return (mask.sum(1).long() - 1).clamp(min=0)


def per_token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO rewards: reward_t = -beta * KL_t on every response token, and the sequence score added at the last one:

    reward[b, t] = -beta * kl[b, t] * mask[b, t]  +  scores[b] * [t == last(b)]
    """
    rewards = -beta * kl * mask
    rows = torch.arange(len(scores), device=scores.device)
    rewards[rows, last_token_indices(mask)] += scores.to(rewards.dtype)
    return rewards


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, backwards in t:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        return_t = A_t + V_t

    with V_{t+1} = A_{t+1} = 0 after the last real token (the episode ends there; padding never leaks in).
    Returns (advantages, returns), both 0 on padding."""
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    width = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(width)):
        alive_next = mask[:, t + 1] if t + 1 < width else torch.zeros_like(carry)
        next_value = values[:, t + 1] * alive_next if t + 1 < width else torch.zeros_like(carry)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        carry = delta + gamma * lam * carry * alive_next
        advantages[:, t] = carry
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each completion's score against its prompt's group of `group_size` contiguous completions:

        A_i = (r_i - mean(group)) / (std(group) + eps)     (std with Bessel's correction, n - 1)

    A group whose completions all score the same gets advantage 0 (no signal)."""
    if scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    groups = scores.float().view(-1, group_size)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


def clipped_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (to minimise) and where the clipped branch is the one taken:

    ratio = exp(logp - old_logp)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - cliprange, 1 + cliprange))
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss per token and where the clipped branch is the one taken:

    V_clip = old_V + clip(V - old_V, -cliprange_value, cliprange_value)
    loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)
    """
    v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped, clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits): H = logsumexp(z) - sum(softmax(z) * z)."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (F.softmax(logits, -1) * logits).sum(-1)


def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(old || new) between the sampling policy and the current one: 0.5 * (logp - old)^2."""
    return 0.5 * (logp - old_logp) ** 2


def episode_score(
    verifiable: float, stopped: bool, non_stop_penalty: float, rm_score: Optional[float], rm_multiplier: float
) -> float:
    """score = verifiable reward + rm_multiplier * rm_score (if a reward model is used) + non_stop_penalty if the
    response hit response_length without a stop (the recipe gives the penalty signed: Tulu 3 uses -10)."""
    from open_instruct.rewards import combine_rewards

    return combine_rewards(verifiable, stopped, non_stop_penalty, rm_score, rm_multiplier)


def derived_seed(seed: int, *parts: int) -> int:
    """A deterministic 63-bit seed from (seed, rollout_step, rank, ...): resuming at a rollout re-draws its samples."""
    return random.Random(":".join(str(p) for p in (seed, *parts))).getrandbits(63)


# ---------------------------------------------------------------------------------------------------------------------
# The phases of one rollout step


@dataclass
class RLModels:
    """The policy (trained), the value model (PPO, trained), the frozen reference (None when beta is 0) and the
    optional frozen reward model. All prepared by accelerate (FSDP-sharded under FSDP)."""

    policy: Any
    value: Optional[Any] = None
    reference: Optional[Any] = None
    reward: Optional[Any] = None

    def trained(self) -> dict[str, Any]:
        return {"policy": self.policy, **({"value": self.value} if self.value is not None else {})}


@dataclass
class Rollout:
    """This rank's share of one rollout: `num_samples_per_prompt` contiguous completions per prompt (a GRPO group).
    Per-token tensors are response-aligned [n, R] float32 on the CPU, 0 on padding."""

    episodes: list[dict]  # the prompt row (prompt_ids, ground_truth, verifier, ...) of each completion
    response_ids: list[list[int]]
    texts: list[str]
    stopped: list[bool]  # False: ran into response_length without a stop
    correct: list[float]  # verifier said right
    verifier_timeouts: int
    scores: torch.Tensor  # [n] the sequence score: verifiers (+ reward model) (+ non-stop penalty)
    rm_scores: torch.Tensor  # [n] reward-model scores (0 without one)
    mask: torch.Tensor  # [n, R] 1 on real response tokens
    old_logp: Optional[torch.Tensor]  # the sampling policy's log-probs; None on-policy (the update's forward is exact)
    ref_logp: Optional[torch.Tensor]  # the reference's; None without a reference
    old_values: Optional[torch.Tensor]  # the value model's (PPO)
    kl: Optional[torch.Tensor]  # kl_estimator(sampling policy, reference) per token; None without old_logp or ref
    seconds: dict[str, float] = field(default_factory=dict)  # weight_sync, generation, scoring, inference


@dataclass
class Advantages:
    advantages: torch.Tensor  # [n, R]
    returns: Optional[torch.Tensor]  # [n, R] value targets (PPO)
    kl_loss_coef: float  # beta when the KL to the reference is a loss term (GRPO), 0 when it is in the reward (PPO)


def collect_rollout(
    cfg: RLVRConfig,
    models: RLModels,
    generator: Any,
    prompts: list[dict],
    step: int,
    run: runtime.RunContext,
    gather_for_generation: Callable[[Any], Any],
    on_policy: bool,
    pad_id: int,
) -> Rollout:
    """Sample `num_samples_per_prompt` completions per prompt, score them, and compute the no-grad per-token
    log-probs of the sampling policy (skipped on-policy) and of the reference, the values and the reward-model
    scores, in micro-batches of per_device_train_batch_size."""
    from open_instruct.data import collate_episodes
    from open_instruct.generation import GenerationConfig
    from open_instruct.models import response_logits, sequence_scores, token_logprobs, token_values

    accelerator, group = run.accelerator, cfg.num_samples_per_prompt
    t_sync = time.perf_counter()
    generator.sync_weights(accelerator.unwrap_model(models.policy))  # vLLM: load the weights of the last updates
    t0 = time.perf_counter()
    sampling = GenerationConfig(
        max_new_tokens=cfg.response_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        stop_strings=cfg.stop_strings,
        n=group,
        seed=derived_seed(cfg.seed, step, accelerator.process_index),
    )
    with gather_for_generation(models.policy):
        out = generator.generate([p["prompt_ids"] for p in prompts], sampling)
    episodes = [prompts[i] for i in out.prompt_index]
    t1 = time.perf_counter()
    scored = score_texts(cfg, out.texts, episodes)
    t2 = time.perf_counter()

    n, width = len(episodes), max(len(r) for r in out.response_ids)
    old_logp, ref_logp, old_values, mask = (torch.zeros(n, width) for _ in range(4))
    rm_scores = torch.zeros(n)
    with torch.no_grad():
        for s in range(0, n, cfg.per_device_train_batch_size):
            rows = slice(s, s + cfg.per_device_train_batch_size)
            batch = collate_episodes([e["prompt_ids"] for e in episodes[rows]], out.response_ids[rows], pad_id)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            r = batch["responses"].shape[1]
            with accelerator.autocast():
                if not on_policy:
                    logits = response_logits(models.policy, batch, cfg.temperature, group)
                    old_logp[rows, :r] = token_logprobs(logits, batch["responses"]).cpu()
                if models.reference is not None:
                    logits = response_logits(models.reference, batch, cfg.temperature, group)
                    ref_logp[rows, :r] = token_logprobs(logits, batch["responses"]).cpu()
                if models.value is not None:
                    old_values[rows, :r] = token_values(models.value, batch, group).cpu()
                if models.reward is not None:
                    rm_scores[rows] = sequence_scores(models.reward, batch, group).cpu()
            mask[rows, :r] = batch["mask"].cpu()
    old_logp, ref_logp, old_values = old_logp * mask, ref_logp * mask, old_values * mask
    rm_multiplier = cfg.reward_model_multiplier
    scores = torch.tensor(
        [
            episode_score(v, s, cfg.non_stop_penalty, float(rm) if models.reward is not None else None, rm_multiplier)
            for v, s, rm in zip(scored.rewards, out.stopped, rm_scores.tolist())
        ]
    )
    has_ref = models.reference is not None
    kl = kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask if has_ref and not on_policy else None
    return Rollout(
        episodes=episodes,
        response_ids=out.response_ids,
        texts=out.texts,
        stopped=out.stopped,
        correct=list(scored.correct),
        verifier_timeouts=scored.num_timeouts,
        scores=scores,
        rm_scores=rm_scores,
        mask=mask,
        old_logp=None if on_policy else old_logp,
        ref_logp=ref_logp if has_ref else None,
        old_values=old_values if models.value is not None else None,
        kl=kl,
        seconds={
            "weight_sync": t0 - t_sync,
            "generation": t1 - t0,
            "scoring": t2 - t1,
            "inference": time.perf_counter() - t2,
        },
    )


def score_texts(cfg: RLVRConfig, texts: list[str], examples: list[dict]) -> Any:
    """Verifier rewards of completions (each row's verifier, under the time limit)."""
    from open_instruct import rewards

    return rewards.score_batch(
        texts,
        [e["ground_truth"] for e in examples],
        [e["verifier"] for e in examples],
        verification_reward=cfg.verification_reward,
        timeout=cfg.verifier_timeout,
    )


def compute_advantages(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """GRPO: group-normalised scores on every token, KL as a loss term. PPO: per-token rewards (score at the last
    token, -beta * KL on every token) -> GAE with the value model -> whitened with statistics over every rank."""
    from open_instruct.distributed import global_sums

    mask = rollout.mask
    if cfg.algo == "grpo":
        advantages = group_advantages(rollout.scores, cfg.num_samples_per_prompt).unsqueeze(1) * mask
        return Advantages(advantages, None, kl_loss_coef=cfg.beta if rollout.ref_logp is not None else 0.0)
    kl = rollout.kl if rollout.kl is not None else torch.zeros_like(mask)
    rewards_t = per_token_rewards(rollout.scores, kl, mask, cfg.beta)
    advantages, returns = gae_advantages(rewards_t, rollout.old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        m = global_sums(
            accelerator,
            {
                "s": float(masked_sum(advantages, mask)),
                "ss": float(masked_sum(advantages**2, mask)),
                "n": float(mask.sum()),
            },
        )
        mean = m["s"] / m["n"]
        var = (m["ss"] - m["n"] * mean**2) / max(m["n"] - 1, 1)
        advantages = masked_whiten(advantages, mask, torch.tensor(mean), torch.tensor(var))
    return Advantages(advantages, returns, kl_loss_coef=0.0)


TRAIN_STATS = ("policy_loss", "value_loss", "pg_clipfrac", "vf_clipfrac", "approx_kl", "entropy", "kl_loss")


def micro_batch_loss(
    cfg: RLVRConfig,
    models: RLModels,
    rollout: Rollout,
    adv: Advantages,
    rows: list[int],
    pad_id: int,
    device: Any,
    autocast: Callable[[], Any],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed (not yet normalised) loss of one micro-batch and its summed statistics:

    loss = sum_t pg_t  +  kl_loss_coef * sum_t KL_t  +  vf_coef * sum_t vf_t        over real tokens t
    """
    from open_instruct.data import collate_episodes
    from open_instruct.models import response_logits, token_logprobs, token_values

    batch = collate_episodes(
        [rollout.episodes[j]["prompt_ids"] for j in rows], [rollout.response_ids[j] for j in rows], pad_id
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    r, mask = batch["responses"].shape[1], batch["mask"]

    def take(x: torch.Tensor) -> torch.Tensor:  # this micro-batch's slice of a rollout tensor
        return x[rows, :r].to(device)

    stats = dict.fromkeys(TRAIN_STATS, 0.0)
    with autocast():
        logits = response_logits(models.policy, batch, cfg.temperature, cfg.num_samples_per_prompt)
        logp = token_logprobs(logits, batch["responses"])
        old_logp = logp.detach() if rollout.old_logp is None else take(rollout.old_logp)  # on-policy: they sampled
        pg, pg_clipped = clipped_policy_loss(logp, old_logp, take(adv.advantages), cfg.cliprange)
        loss_sum = masked_sum(pg, mask)
        if adv.kl_loss_coef > 0:
            kl = kl_penalty(logp, take(rollout.ref_logp), cfg.kl_estimator)
            loss_sum = loss_sum + adv.kl_loss_coef * masked_sum(kl, mask)
        if models.value is not None:
            values = token_values(models.value, batch, cfg.num_samples_per_prompt)
            vf, vf_clipped = clipped_value_loss(
                values, take(rollout.old_values), take(adv.returns), cfg.cliprange_value
            )
            loss_sum = loss_sum + cfg.vf_coef * masked_sum(vf, mask)
    with torch.no_grad():
        if adv.kl_loss_coef > 0:
            stats["kl_loss"] = float(masked_sum(kl.detach(), mask))
        if models.value is not None:
            stats["value_loss"], stats["vf_clipfrac"] = (
                float(masked_sum(vf.detach(), mask)),
                float(masked_sum(vf_clipped, mask)),
            )
        stats["policy_loss"] = float(masked_sum(pg.detach(), mask))
        stats["pg_clipfrac"] = float(masked_sum(pg_clipped, mask))
        stats["approx_kl"] = float(masked_sum(approx_kl(logp.detach(), old_logp), mask))
        stats["entropy"] = float(masked_sum(entropy_from_logits(logits.detach()), mask))
    return loss_sum, stats


def update(
    cfg: RLVRConfig,
    models: RLModels,
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    rollout: Rollout,
    adv: Advantages,
    plan: Any,
    run: runtime.RunContext,
    pad_id: int,
) -> dict[str, float]:
    """num_epochs passes over the rollout, each num_mini_batches optimizer steps on a shuffled order of whole groups
    (GRPO: required; PPO: when they fit, so micro-batches can share prompt forwards). Returns the statistics summed
    over the updates (each a token mean over its global mini-batch) and `local_kl_sum`, this rank's summed KL term."""
    from open_instruct.data import micro_batches
    from open_instruct.distributed import clip_grad_norm_, global_sum, global_sums, grad_sync_all

    accelerator, counters = run.accelerator, run.counters
    world, group, step = accelerator.num_processes, cfg.num_samples_per_prompt, run.counters.rollout_step
    unit = group if plan.local_mini_batch_size % group == 0 else 1
    totals = dict.fromkeys((*TRAIN_STATS, "grad_norm", "value_grad_norm", "skipped", "local_kl_sum"), 0.0)
    for epoch in range(cfg.num_epochs):
        units = list(range(len(rollout.episodes) // unit))
        random.Random(derived_seed(cfg.seed, step, accelerator.process_index, epoch)).shuffle(units)
        order = [u * unit + j for u in units for j in range(unit)]
        for mb in range(plan.num_mini_batches):
            mb_rows = order[mb * plan.local_mini_batch_size : (mb + 1) * plan.local_mini_batch_size]
            global_tokens = global_sum(accelerator, float(rollout.mask[mb_rows].sum()))
            sums = dict.fromkeys(TRAIN_STATS, 0.0)
            micro_rows = list(micro_batches(mb_rows, cfg.per_device_train_batch_size))
            for i, rows in enumerate(micro_rows):
                with grad_sync_all(accelerator, models.trained().values(), sync=i == len(micro_rows) - 1):
                    loss_sum, stats = micro_batch_loss(
                        cfg, models, rollout, adv, rows, pad_id, accelerator.device, accelerator.autocast
                    )
                    # Token mean over the global mini-batch; DDP/FSDP average gradients over ranks, hence x world.
                    accelerator.backward(loss_sum * world / global_tokens)
                for k, v in stats.items():
                    sums[k] += v
            totals["local_kl_sum"] += sums["kl_loss"]
            sums = global_sums(accelerator, sums)
            grad_norm = clip_grad_norm_(accelerator, models.policy, cfg.max_grad_norm)
            value_grad_norm = (
                clip_grad_norm_(accelerator, models.value, cfg.max_grad_norm)
                if models.value is not None
                else torch.tensor(0.0)
            )
            loss = (
                sums["policy_loss"] + cfg.vf_coef * sums["value_loss"] + adv.kl_loss_coef * sums["kl_loss"]
            ) / global_tokens
            step_ok = run.update_is_finite(loss, grad_norm=grad_norm, value_grad_norm=value_grad_norm)  # else stop/skip
            for name in optimizers:
                if step_ok:
                    optimizers[name].step()
                schedulers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            counters.optimizer_step += 1
            for k in TRAIN_STATS:
                totals[k] += sums[k] / global_tokens
            totals["grad_norm"] += float(grad_norm)
            totals["value_grad_norm"] += float(value_grad_norm)
            totals["skipped"] += int(not step_ok)
    return totals


def log_row(
    cfg: RLVRConfig, rollout: Rollout, train: dict[str, float], plan: Any, run: runtime.RunContext
) -> dict[str, Any]:
    """The rollout's metrics: episode statistics summed over ranks, and the update statistics averaged over the
    rollout's num_epochs x num_mini_batches optimizer steps."""
    from open_instruct.distributed import global_sums

    # On-policy, the KL of the sampling policy is the training forward's KL term (the weights had not moved yet).
    kl_sum = float(rollout.kl.sum()) if rollout.kl is not None else train["local_kl_sum"]
    ep = global_sums(
        run.accelerator,
        {
            "n": len(rollout.episodes),
            "score": float(rollout.scores.sum()),
            "score_sq": float((rollout.scores**2).sum()),
            "correct": float(sum(rollout.correct)),
            "non_stop": float(sum(not s for s in rollout.stopped)),
            "length": float(rollout.mask.sum()),
            "kl": kl_sum,
            "timeouts": float(rollout.verifier_timeouts),
            "rm": float(rollout.rm_scores.sum()),
        },
    )
    n, updates = ep["n"], cfg.num_epochs * plan.num_mini_batches
    score_mean = ep["score"] / n
    row = {
        "train/correct_rate": ep["correct"] / n,
        "train/score_mean": score_mean,
        "train/score_std": max(ep["score_sq"] / n - score_mean**2, 0.0) ** 0.5,
        "train/non_stop_rate": ep["non_stop"] / n,
        "train/response_length": ep["length"] / n,
        "train/entropy": train["entropy"] / updates,
        "train/approx_kl": train["approx_kl"] / updates,
        "train/verifier_timeouts": ep["timeouts"],
        "loss/policy": train["policy_loss"] / updates,
        "clipfrac/policy": train["pg_clipfrac"] / updates,
        "train/grad_norm": train["grad_norm"] / updates,
        "train/skipped_updates": train["skipped"],
        "lr": run.schedulers["policy"].get_last_lr()[0],
    }
    if rollout.ref_logp is not None:  # per sequence: the sum over its tokens of kl_estimator(sampling policy, ref)
        row["train/kl"] = ep["kl"] / n
    if "value" in run.models:
        row["loss/value"] = train["value_loss"] / updates
        row["clipfrac/value"] = train["vf_clipfrac"] / updates
        row["train/value_grad_norm"] = train["value_grad_norm"] / updates
    if cfg.algo == "grpo":
        row["loss/kl"] = train["kl_loss"] / updates
    if cfg.reward_model_path:
        row["train/rm_score_mean"] = ep["rm"] / n
    return row


class PhaseClock:
    """Seconds per phase and response tokens over the rollouts since the last log row (eval and checkpoint time
    excluded; rank 0's clock), turned into time/<phase> per rollout and throughput."""

    PHASES = ("weight_sync", "generation", "scoring", "inference", "training")

    def __init__(self) -> None:
        self.seconds, self.rollouts, self.tokens = dict.fromkeys(self.PHASES, 0.0), 0, 0

    def add(self, seconds: dict[str, float], tokens: int) -> None:
        for k, v in seconds.items():
            self.seconds[k] += v
        self.rollouts += 1
        self.tokens += tokens

    def report(self, accelerator: Any, episodes_per_rollout: int) -> dict[str, float]:
        from open_instruct.distributed import global_sum

        k, tokens = max(self.rollouts, 1), global_sum(accelerator, self.tokens)
        busy = max(sum(self.seconds.values()), 1e-9)
        row = {f"time/{name}": v / k for name, v in self.seconds.items()}
        row["perf/episodes_per_second"] = k * episodes_per_rollout / busy
        row["perf/response_tokens_per_second"] = tokens / busy
        self.__init__()
        return row


def evaluate(
    cfg: RLVRConfig,
    evals: list[dict],
    policy: Any,
    generator: Any,
    tokenizer: Any,
    accelerator: Any,
    gather_for_generation: Callable[[Any], Any],
) -> dict[str, float]:
    """Greedy verifiable accuracy on the held-out prompts (each evaluated once across ranks)."""
    from open_instruct import data
    from open_instruct.distributed import global_sums
    from open_instruct.generation import GenerationConfig
    from open_instruct.generation_backends import make_generator

    local = data.shard_for_eval(evals, accelerator.process_index, accelerator.num_processes)
    sums = {"correct": 0.0, "score": 0.0, "length": 0.0, "non_stop": 0.0, "n": 0.0}
    if cfg.generation_backend == "vllm":
        generator.sync_weights(accelerator.unwrap_model(policy))  # collective under FSDP: every rank, before `if local`
    else:
        generator = make_generator(
            "hf", accelerator.unwrap_model(policy), tokenizer, batch_size=cfg.per_device_eval_batch_size
        )
    greedy = GenerationConfig(
        max_new_tokens=cfg.eval_response_length or cfg.response_length, temperature=0.0, stop_strings=cfg.stop_strings
    )
    with gather_for_generation(policy):  # collective under FSDP: every rank joins, even one without prompts
        out = generator.generate([e["prompt_ids"] for e in local], greedy) if local else None
    if out is not None:
        scored = score_texts(cfg, out.texts, local)
        sums = {
            "correct": float(sum(scored.correct)),
            "score": float(sum(scored.rewards)),
            "length": float(sum(len(r) for r in out.response_ids)),
            "non_stop": float(sum(not s for s in out.stopped)),
            "n": float(len(local)),
        }
    t = global_sums(accelerator, sums)
    n = max(t["n"], 1.0)
    return {
        "eval/correct_rate": t["correct"] / n,
        "eval/score_mean": t["score"] / n,
        "eval/response_length": t["length"] / n,
        "eval/non_stop_rate": t["non_stop"] / n,
    }


def sample_rows(rollout: Rollout, tokenizer: Any, k: int) -> list[dict[str, Any]]:
    """The first k completions of this rollout, for samples.jsonl."""
    return [
        {
            "prompt": tokenizer.decode(e["prompt_ids"]),
            "response": rollout.texts[j],
            "score": float(rollout.scores[j]),
            "ground_truth": str(e["ground_truth"]),
            "stopped": bool(rollout.stopped[j]),
        }
        for j, e in enumerate(rollout.episodes[:k])
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Set-up and the loop


def load_prompts(cfg: RLVRConfig, tokenizer: Any, accelerator: Any) -> tuple[list[dict], list[dict], Any, int]:
    """Train and held-out prompts, checked (verifiers, lengths, batch math) before any model loads. Returns them,
    the batch plan, and the longest prompt + response a generator must hold."""
    from transformers import AutoConfig

    from open_instruct import data
    from open_instruct.errors import ConfigError
    from open_instruct.rewards import check_verifiers

    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_prompts)
    check_verifiers(train, "train")
    check_verifiers(evals, "eval")
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
        print(
            f"data: {stats.summary()}; {len(evals)} held-out prompts; world_size {accelerator.num_processes}; plan "
            f"{plan.to_dict()}"
        )
    return train, evals, plan, longest_prompt + longest_response


def load_models(
    cfg: RLVRConfig, tokenizer: Any, accelerator: Any, plan: Any
) -> tuple[RLModels, dict[str, Any], dict[str, Any]]:
    """The trained policy (+ value model for PPO) with their optimizers and schedules, the frozen reference (the
    initial policy; only when beta > 0) and the optional frozen reward model, all prepared by accelerate."""
    from open_instruct.distributed import prepare_frozen
    from open_instruct.models import (
        DTYPES,
        TokenValueModel,
        disable_dropout,
        load_causal_lm,
        load_sequence_classifier,
        make_optimizer_and_scheduler,
    )

    def causal_lm() -> Any:
        model = load_causal_lm(
            cfg.model_name_or_path, DTYPES["no"], cfg.gguf_file, cfg.trust_remote_code, cfg.model_revision
        )
        disable_dropout(model)
        return model

    def scalar_model(path: str, gguf_file: Optional[str], trained_head: bool = False) -> TokenValueModel:
        classifier = load_sequence_classifier(
            path,
            DTYPES["no"],
            gguf_file,
            cfg.trust_remote_code,
            pad_token_id=tokenizer.pad_token_id,
            require_trained_head=trained_head,  # a reward model's head must be trained; a value head starts fresh
        )
        return TokenValueModel(classifier)

    models = RLModels(policy=causal_lm(), reference=causal_lm() if cfg.beta > 0 else None)
    if cfg.algo != "grpo":
        torch.manual_seed(
            cfg.seed
        )  # a fresh scalar head (value model from the policy) is initialised the same way every run
        models.value = scalar_model(
            cfg.value_model_path or cfg.model_name_or_path, None if cfg.value_model_path else cfg.gguf_file
        )
        disable_dropout(models.value.seq_cls)
    if cfg.reward_model_path:
        models.reward = scalar_model(cfg.reward_model_path, None, trained_head=True)
    if cfg.activation_checkpointing:
        models.policy.gradient_checkpointing_enable()
        if models.value is not None:
            models.value.seq_cls.gradient_checkpointing_enable()
    optimizers, schedulers = {}, {}
    for name, model in models.trained().items():
        optimizer, schedulers[name] = make_optimizer_and_scheduler(model, cfg, plan.optimizer_steps)
        prepared, optimizers[name] = accelerator.prepare(model, optimizer)
        setattr(models, name, prepared)
    if models.reference is not None:
        models.reference = prepare_frozen(accelerator, models.reference)
    if models.reward is not None:
        models.reward = prepare_frozen(accelerator, models.reward)
    return models, optimizers, schedulers


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(RLVRConfig, argv)

    from open_instruct import data
    from open_instruct.batch_math import should_log
    from open_instruct.distributed import full_params
    from open_instruct.generation_backends import check_backend, make_generator
    from open_instruct.models import DTYPES, load_tokenizer

    check_backend(cfg.generation_backend)  # a missing or unsupported vLLM fails before any model loads
    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template
    )
    train, evals, plan, max_model_len = load_prompts(cfg, tokenizer, accelerator)
    models, optimizers, schedulers = load_models(cfg, tokenizer, accelerator, plan)

    generator_kwargs: dict[str, Any] = {"batch_size": plan.local_rollout_batch_size * cfg.num_samples_per_prompt}
    if cfg.generation_backend == "vllm":  # one colocated engine per rank for rollouts and evals (optional extra)
        generator_kwargs.update(
            max_model_len=max_model_len,
            dtype=DTYPES[cfg.mixed_precision],
            seed=cfg.seed,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep=cfg.vllm_enable_sleep,
        )
    generator = make_generator(
        cfg.generation_backend, accelerator.unwrap_model(models.policy), tokenizer, **generator_kwargs
    )
    # HF generates with the live (FSDP-gathered) policy; vLLM holds its own copy, synced by sync_weights.
    gather_for_generation = full_params if cfg.generation_backend == "hf" else (lambda model: contextlib.nullcontext())

    run = runtime.RunContext(
        cfg, accelerator, models.trained(), optimizers, schedulers, tokenizer, plan.num_training_steps, "rollout_step"
    )
    counters = run.counters
    stream = data.EpisodeStream(len(train), cfg.seed)
    # GRPO with one pass in one mini-batch trains on exactly the weights that sampled: no separate old-log-prob pass.
    on_policy = cfg.algo == "grpo" and cfg.num_epochs == 1 and plan.num_mini_batches == 1

    def evaluate_policy() -> dict[str, float]:
        return evaluate(cfg, evals, models.policy, generator, tokenizer, accelerator, gather_for_generation)

    if evals and cfg.eval_steps and not run.resumed:  # the starting point: a baseline row at rollout_step 0
        run.evaluate(evaluate_policy)
    for model in models.trained().values():
        model.train()
    clock = PhaseClock()
    while counters.rollout_step < plan.num_training_steps:
        # Prompts: a slice of the global prompt order, by prompt position (world-size independent).
        global_idx = stream.take(counters.rollout_step * plan.rollout_batch_size, plan.rollout_batch_size)
        prompts = [train[i] for i in stream.local_slice(global_idx, rank, world)]
        rollout = collect_rollout(
            cfg,
            models,
            generator,
            prompts,
            counters.rollout_step,
            run,
            gather_for_generation,
            on_policy,
            tokenizer.pad_token_id,
        )
        t0 = time.perf_counter()
        advantages = compute_advantages(cfg, rollout, accelerator)
        t1 = time.perf_counter()
        train_stats = update(
            cfg, models, optimizers, schedulers, rollout, advantages, plan, run, tokenizer.pad_token_id
        )
        rollout.seconds["inference"] += t1 - t0
        rollout.seconds["training"] = time.perf_counter() - t1

        counters.rollout_step += 1
        counters.episode += plan.episodes_per_rollout
        counters.epoch = counters.rollout_step * plan.rollout_batch_size / len(train)
        run.logger.advance()
        clock.add(rollout.seconds, int(rollout.mask.sum()))
        if should_log(counters.rollout_step, cfg.logging_steps):
            run.log(
                {
                    **log_row(cfg, rollout, train_stats, plan, run),
                    **clock.report(accelerator, plan.episodes_per_rollout),
                }
            )
            if cfg.num_samples_logged and accelerator.is_main_process:
                run.logger.log_samples(sample_rows(rollout, tokenizer, cfg.num_samples_logged), counters.as_log())
        if run.end_of_step(evaluate_policy if evals else None):  # eval, best model, checkpoint; True on SIGTERM
            return

    run.finish()


if __name__ == "__main__":
    runtime.run(main)
