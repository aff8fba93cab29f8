"""RL with verifiable rewards: PPO with a value model (default), GRPO (`--algo grpo`) and their 2025 variants.

    python open_instruct/rlvr_ppo.py configs/rlvr_tiny.yaml [--algo grpo] [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_7gpu.yaml open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml
                        (7 training GPUs; the trainer starts the vLLM engine on GPU 7: scripts/rlvr_8b.sh)

The file is the math (pure functions with their formulas), then one function per phase of a rollout step, then
`main`, which loads everything and runs the phases in a loop. Lines marked ALGO LOGIC are the ones a new variant
edits; the plumbing around them (sampling, model loading, evaluation, timing) is in `rollouts.py`, the generation
backends behind `generation.py`'s contract, the algorithm names and traits in `rl_algorithms.py`.

    RolloutSampler      prompts -> `num_samples_per_prompt` completions each, with the sampler's own log-probs:
    (rollouts.py)       generated now after a weight sync, or (async_steps 1, dedicated engines) taken from the
                        generation submitted one rollout earlier                                   -> completions
    collect_rollout     completions -> score them (verifiers, plus a reward model, the non-stop penalty and the
                        overlong punishment when configured) -> no-grad log-probs of the policy and the frozen
                        reference, values (gae)                                                   -> Rollout
    compute_advantages  the estimator's row of rl_algorithms.ADVANTAGE_ESTIMATORS: one function per estimator,
                        bound here with @advantage_estimator(name)                                -> Advantages
    update              num_epochs passes x num_mini_batches optimizer steps x micro-batches, the optimizer step in
                        sight; each step's loss is aggregated over the *global* mini-batch, so 1 or N processes
                        give the same update
    log_row             the metrics row of the rollout

Per-token tensors of a rollout are *response-aligned*: column t is response token t of the row (prompt tokens are
not stored), and `mask` marks real tokens (right padding after the response's stop). Multi-turn episodes
(`environment:`, episode_rollouts.py): the response holds the policy's turns and the observations between them, and
`mask` is the loss mask, 1 on policy tokens only: observations are context for every forward and never trained
(no policy, KL, entropy or value term, no count); the score sits on the last policy token, each turn's reward on its
turn's last policy token, and GAE / returns run over policy tokens only (episodes.multi_turn_gae).

advantage_estimator: gae (PPO, Tulu 3: reward_t = -beta * KL_t plus the score at the last token; GAE(gamma, lam)
with a value model, a scalar head on the backbone initialised from `value_model_path` or the policy; whitened),
grpo (group-normalised scores), dr_grpo (group-centred), rloo (leave-one-out baseline), reinforce_pp (discounted
per-token rewards, globally whitened), distill (on-policy distillation toward a frozen teacher: docs/distillation.md).
policy_loss: ppo (clip, clip-higher, dual clip), gspo (sequence ratio), cispo (clipped detached IS weight).
loss_aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm.
The group estimators add the KL to the reference as a loss term beta * KL_t (k3 typical); a prompt's group never
spans two devices or two mini-batches.

Speed (in `models.py`, not here): completions of one prompt share its forward (the prompt runs once, its key/value
cache is repeated for the responses; single process). One pass over one mini-batch trains on exactly the weights
that sampled, so the training forward's own log-probs serve as the old ones (no separate pass).
"""

from __future__ import annotations

from open_instruct import runtime
from open_instruct.config import RLVRConfig

if __name__ == "__main__":  # the math below needs torch at import: check the config first, so a bad one exits 2 fast
    runtime.start_before_imports(RLVRConfig)

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from open_instruct import data
from open_instruct.batch_math import should_log
from open_instruct.code_verifier import TEST_STATUSES
from open_instruct.distillation import (
    jsd_to_teacher,
    output_layer_inputs,
    teacher_advantages,
    teacher_hidden,
    teacher_token_logprobs,
)
from open_instruct.distributed import (
    clip_grad_norm_,
    equal_micro_batch_count,
    global_max,
    global_sum,
    global_sums,
    grad_sync_all,
)
from open_instruct.episode_rollouts import episode_metrics
from open_instruct.episodes import multi_turn_gae, token_rewards
from open_instruct.generation_backends import check_before_loading, make_generator
from open_instruct.generation_check import (
    GenerationChecker,
    mismatch_metrics,
    mismatch_sum_keys,
    mismatch_token_sums,
    mismatch_warnings,
)
from open_instruct.lora import adapter_disabled
from open_instruct.models import (
    TokenScores,
    entropy_from_logits,
    load_tokenizer,
    response_logits,
    response_scores,
    sequence_scores,
    token_logprobs,
    token_values,
)
from open_instruct.rewards import combine_rewards, reward_function_metrics, reward_function_sums
from open_instruct.rl_algorithms import KL_ESTIMATORS, POLICY_LOSSES, advantage_estimator, policy_loss
from open_instruct.rollouts import (
    PhaseClock,
    RLModels,
    RolloutSampler,
    derived_seed,
    environment_run,
    evaluate,
    load_models,
    load_prompts,
    sample_rows,
    score_rollout,
    token_version_lags,
)
from open_instruct.step_sums import StepSums

# ---------------------------------------------------------------------------------------------------------------------
# ALGO LOGIC, the math: pure functions of [batch, response_len] tensors (response-aligned, `mask` 1 on real tokens).


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

    mean/var default to the masked mean and unbiased variance of x, taken in float64 (float32 sums of equal values
    miss their mean by a rounding step, which rsqrt(var + eps) would blow up to ~1e-3 instead of 0); the training
    loop passes statistics summed over all processes so every rank whitens with the same numbers."""
    if mean is None:
        mean = masked_mean(x.double(), mask.double())
    if var is None:
        var = masked_var(x.double(), mask.double())
    return ((x.double() - mean) * torch.rsqrt(var + eps) * mask).to(x.dtype)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, **algo_kwargs: Any) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from a token sampled from pi (Schulman's k1/k2/k3; another name: its
    row of rl_algorithms.KL_ESTIMATORS, a function of the user's, called with its algo_kwargs):

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
    row = KL_ESTIMATORS.get(estimator)
    if row is None or row.function is None:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose k1, k2 or k3")
    return row.function(logp, ref_logp, **algo_kwargs)


def last_response_token(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last masked token of each row (0 for an empty row): the last real token of a right-padded
    response, the last policy token of an episode whose loss mask has observation holes.

    index_b = max { t : mask[b, t] > 0 }"""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).max(1).values


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float, score_index: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """PPO rewards: reward_t = -beta * KL_t on every response token, and the sequence score added at one position,
    by default the last real token:

    reward[b, t] = -beta * kl[b, t] * mask[b, t]  +  scores[b] * [t == score_index(b)]
    """
    rewards = -beta * kl * mask
    rows = torch.arange(len(scores), device=scores.device)
    index = last_response_token(mask) if score_index is None else score_index
    rewards[rows, index] += scores.to(rewards.dtype)
    return rewards


def after_last_token(mask: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tulu 3's score placement: one position after the last real token (the last one itself when the response ran
    to max_length), with a value kept there so GAE carries the score back. Returns (score index, value mask =
    mask plus that position). `mask` needs a spare column after the longest response.

    L_b = sum_t mask[b, t];   index_b = L_b if L_b < max_length else L_b - 1
    """
    lengths = mask.sum(1).long()
    index = torch.where(lengths < max_length, lengths, lengths - 1).clamp(min=0)
    value_mask = mask.clone()
    value_mask[torch.arange(len(mask)), index] = 1.0
    return index, value_mask


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


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO (scale=True) and Dr. GRPO (scale=False): each completion's score against its prompt's group of
    `group_size` contiguous completions:

        grpo:     A_i = (r_i - mean(group)) / (std(group) + eps)     (std with Bessel's correction, n - 1)
        dr_grpo:  A_i =  r_i - mean(group)                           (no std: no bias towards easy/hard prompts)

    A group whose completions all score the same gets exactly 0 (no signal), whatever the value: float32 means of
    equal scores can miss them by a rounding step, which / (std + eps) would turn into a push of up to ~0.06, so the
    math runs in float64 and a group of equal scores (zero_std_groups, an exact test) is set to 0 outright."""
    if scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    groups = scores.double().view(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    advantages = centred / (groups.std(1, keepdim=True) + eps) if scale else centred
    return torch.where(zero_std_groups(scores, group_size).view_as(groups), 0.0, advantages).float().view(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each completion's score against the mean of the *other* completions of its group (leave one out):

    A_i = r_i - (sum_j r_j - r_i) / (k - 1)  =  k / (k - 1) * (r_i - mean(group)),   k = group_size >= 2

    In float64, and exactly 0 for a group of equal scores (as group_advantages)."""
    if group_size < 2 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size} >= 2")
    groups = scores.double().view(-1, group_size)
    others_mean = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    flat = zero_std_groups(scores, group_size).view_as(groups)
    return torch.where(flat, 0.0, groups - others_mean).float().view(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns over the masked tokens, backwards in t (no value model, no bootstrap). With
    p_1 < ... < p_n the masked positions of a row (an episode's policy tokens: observation tokens are skipped, as
    in episodes.multi_turn_gae):

    G[p_k] = r[p_k] + gamma * G[p_{k+1}],   G[p_{n+1}] = 0;   G = 0 where mask is 0
    """
    rewards, mask = rewards.float(), mask.float()
    returns = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        step = (rewards[:, t] + gamma * carry) * mask[:, t]
        carry = torch.where(mask[:, t] > 0, step, carry)  # an observation token passes the return through
        returns[:, t] = step
    return returns


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score of a response of L tokens (L_max = response_length,
    B = buffer_length):

    penalty = 0                                   if L <= L_max - B
            = factor * (L_max - B - L) / B        if L_max - B < L <= L_max      (0 down to -factor)
    """
    over = (lengths.float() - (max_length - buffer_length)).clamp(min=0)
    return -factor * over / buffer_length


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (to minimise), with asymmetric clipping (clip-higher: clip_high > clip_low
    keeps low-probability tokens able to grow) and optional dual clip, and where a clipped branch is the one taken:

    ratio = exp(logp - old_logp)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    dual clip (c > 1), tokens with A < 0:  loss = min(loss, -c * A)   (bounds the loss of a huge ratio)
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss, was_clipped = torch.maximum(unclipped, clipped), (clipped > unclipped)
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        dual = (advantages < 0) & (loss > bound)
        loss, was_clipped = torch.where(dual, bound, loss), was_clipped | dual
    return loss, was_clipped.float()


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the importance ratio of a whole sequence (geometric mean of its token ratios), clipped per sequence,
    in its token form so it aggregates like the other losses:

    s_i    = exp( sum_t m_it (logp_it - old_it) / sum_t m_it )
    s_it   = sg[s_i] * exp(logp_it - sg[logp_it])          (value s_i; gradient s_i * grad logp_it)
    loss_it = max(-A_i * s_it, -A_i * clip(s_it, 1 - clip_low, 1 + clip_high))
    dual clip (c > 1), A_i < 0:  loss_it = min(loss_it, -c * A_i)   (as in ppo_policy_loss, on the sequence ratio)
    """
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=1).unsqueeze(1)
    log_ratio = seq_log_ratio.detach() + logp - logp.detach()
    return ppo_policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip_low, clip_high, dual_clip_c)


def cispo_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: REINFORCE with a clipped, detached importance weight, so every token keeps a gradient (PPO's clip
    zeroes the gradient of clipped tokens):

    loss = -sg[min(exp(logp - old_logp), 1 + clip_high)] * A * logp
    """
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, max=1.0 + clip_high).detach()
    return -weight * advantages * logp, (ratio > 1.0 + clip_high).float()


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: the sampling engine's log-probs differ from the trainer's (another kernel,
    bf16, another engine), so each token's loss is re-weighted towards the trainer's policy, capped:

    w_t = min(exp(old_logp_t - sampler_logp_t), cap)       (no gradient)
    """
    return torch.clamp(torch.exp(old_logp - sampler_logp), max=cap).detach()


def off_policy_mask(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    sequence_lag: Optional[torch.Tensor],
    low: Optional[float],
    high: Optional[float],
    max_sequence_lag: Optional[int],
) -> torch.Tensor:
    """Which tokens keep their policy-gradient term (1) or lose it (0), for tokens too far off-policy to correct:

    IcePop (token):   keep_t = [low <= exp(old_logp_t - sampler_logp_t) <= high]      (a bound left None: no limit)
    staleness (seq):  keep_it = [lag_i <= max_sequence_lag]   (lag_i: versions since the oldest weights of row i)

    All ones when every knob is None. A masked token still counts in the aggregation's denominator (its term is 0)."""
    keep = torch.ones_like(old_logp)
    ratio = torch.exp(old_logp - sampler_logp)
    if low is not None:
        keep = keep * (ratio >= low).to(keep.dtype)
    if high is not None:
        keep = keep * (ratio <= high).to(keep.dtype)
    if max_sequence_lag is not None and sequence_lag is not None:
        keep = keep * (sequence_lag <= max_sequence_lag).to(keep.dtype).unsqueeze(1)
    return keep.detach()


def version_lag_stats(token_lags: list[list[int]], bound: int) -> dict[str, float]:
    """Sums for the version-lag metrics of a rollout: tokens, sum of lags, and per lag k in 0..bound the tokens with
    that lag (lag_<k>); a lag beyond the bound (never trained on: rollouts.RolloutSampler) counts in lag_<bound+1>."""
    sums = {"lag_tokens": 0.0, "lag_sum": 0.0, **{f"lag_{k}": 0.0 for k in range(bound + 2)}}
    for lags in token_lags:
        for lag in lags:
            sums["lag_tokens"] += 1
            sums["lag_sum"] += lag
            sums[f"lag_{min(max(lag, 0), bound + 1)}"] += 1
    return sums


def aggregation_weights(
    mask: torch.Tensor, aggregation: str, loss_norm_length: float, rows: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How per-token losses l_it of a mini-batch become one number: per-token weights w and per-row units u, so that

    loss = sum_it w_it * l_it / U,     U = sum of u_i over the *global* mini-batch (all ranks, all micro-batches)

    token_mean:               w_it = m_it,          u_i = sum_t m_it    ->  sum_it l_it / (number of tokens)
    seq_mean_token_mean:      w_it = m_it / L_i,    u_i = 1             ->  mean over sequences of their token mean
    seq_mean_token_sum_norm:  w_it = m_it / C,      u_i = 1             ->  mean over sequences of sum_t l_it / C
                                                                            (Dr. GRPO; C = loss_norm_length)
    A row with no tokens (u_i = 0 in every form) adds nothing, unless `rows` ([n] bool) says which rows a sequence mean
    counts: TRL counts a completion mask_truncated_completions left out (u_i = 1, no weight). The split into ranks
    and micro-batches does not change the result: each rank backpropagates sum(w * l) * world / U and DDP/FSDP
    average the gradients."""
    mask = mask.float()
    lengths = mask.sum(1, keepdim=True)
    if aggregation == "token_mean":
        return mask, lengths.squeeze(1)
    alive = (lengths > 0).float() if rows is None else rows.float().unsqueeze(1)
    if aggregation == "seq_mean_token_mean":
        return mask / lengths.clamp(min=1), alive.squeeze(1)
    if aggregation == "seq_mean_token_sum_norm":
        return mask / loss_norm_length, alive.squeeze(1)
    raise ValueError(f"unknown loss_aggregation {aggregation!r}")


def zero_std_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per completion, True when every completion of its group scored the same (no learning signal for any group
    estimator): DAPO's dynamic-sampling filter drops these groups from the update."""
    groups = scores.view(-1, group_size)
    same = (groups == groups[:, :1]).all(1, keepdim=True)
    return same.expand_as(groups).reshape(-1)


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


def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(old || new) between the sampling policy and the current one: 0.5 * (logp - old)^2."""
    return 0.5 * (logp - old_logp) ** 2


def episode_score(
    verifiable: float,
    stopped: bool,
    non_stop_penalty: float,
    rm_score: Optional[float],
    rm_multiplier: float,
    non_stop_penalty_mode: str = "add",
) -> float:
    """score = verifiable reward + rm_multiplier * rm_score (if a reward model is used), and for a response that hit
    response_length without a stop: + non_stop_penalty (mode add), or the penalty alone (mode replace, Tulu 3's
    where(stopped, score, penalty)). The recipe gives the penalty signed: Tulu 3 uses -10."""
    return combine_rewards(verifiable, stopped, non_stop_penalty, rm_score, rm_multiplier, non_stop_penalty_mode)


# ---------------------------------------------------------------------------------------------------------------------
# The phases of one rollout step


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
    value_mask: torch.Tensor  # [n, R] where values are kept: mask, plus the score position after_last_token
    score_index: Optional[torch.Tensor]  # [n] where the score goes (after_last_token); None: the last real token
    old_logp: Optional[torch.Tensor]  # the trainer's log-probs before the update; None on-policy (the update's forward)
    sampler_logp: torch.Tensor  # [n, R] the generator's log-probs of what it sampled (vLLM/HF sampling kernels)
    ref_logp: Optional[torch.Tensor]  # the reference's; None without a reference
    old_values: Optional[torch.Tensor]  # the value model's (PPO)
    kl: Optional[torch.Tensor]  # kl_estimator(sampling policy, reference) per token; None without old_logp or ref
    policy_lag: list[int] = field(default_factory=list)  # per completion: updates since the weights that sampled it
    # per completion, the version lag of each token the policy sampled (rollouts.token_version_lags)
    token_lags: list[list[int]] = field(default_factory=list)
    # weight_sync, generation (waited for), generation_engine (engine wall time), scoring, inference
    seconds: dict[str, float] = field(default_factory=dict)
    code_statuses: dict[str, int] = field(default_factory=dict)  # `code` rows: tests per status (pass, timeout, ...)
    # multi-turn (an environment): `mask` is the loss mask (policy tokens; observation tokens are 0 inside the
    # row), turn_rewards [n, R] each turn's reward x verification_reward on its last policy token, `played` the
    # episodes (turns, tool calls, for the log row and samples)
    turn_rewards: Optional[torch.Tensor] = None
    played: list = field(default_factory=list)
    teacher_logp: Optional[torch.Tensor] = None  # [n, R] the teacher's log-probs of the sampled tokens (distill)
    reward_function_values: dict = field(default_factory=dict)  # label -> each completion's value (None: n/a)


@dataclass
class Advantages:
    advantages: torch.Tensor  # [n, R]
    returns: Optional[torch.Tensor]  # [n, R] value targets (gae)
    kl_loss_coef: float  # beta when the KL to the reference is a loss term (group estimators), 0 when in the reward
    keep: torch.Tensor  # [n] bool: rows the update trains on (filter_zero_std_groups drops flat groups)


def device_batch(host_batch: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    """A collate_episodes batch moved to `device`, keeping the host's input_ids (host_input_ids): whether rows share
    their prompt (models.shared_prompt_groups) is then decided without a host sync."""
    return {**data.to_device(host_batch, device), "host_input_ids": host_batch["input_ids"]}


def collect_rollout(
    cfg: RLVRConfig,
    models: RLModels,
    prompts: list[dict],
    out: Any,
    seconds: dict[str, float],
    step: int,
    run: runtime.RunContext,
    on_policy: bool,
    pad_id: int,
) -> Rollout:
    """Score the completions `out` of `prompts` and compute the no-grad per-token log-probs of the sampling
    policy (skipped on-policy) and of the reference, the values and the reward-model scores, in micro-batches of
    per_device_train_batch_size (or packed rows of max_tokens_per_micro_batch tokens)."""
    accelerator, group = run.accelerator, cfg.num_samples_per_prompt
    played = list(getattr(out, "episodes", None) or [])  # multi-turn episodes (episode_rollouts.EpisodeOutput)
    loss_masks = getattr(out, "loss_masks", None) or [[1] * len(r) for r in out.response_ids]
    episodes = [prompts[i] for i in out.prompt_index]
    if played:  # the prompt each episode started from, as its environment rendered it
        episodes = [{**row, "prompt_ids": e.prompt_ids} for row, e in zip(episodes, played)]
    t1 = time.perf_counter()
    scored = score_rollout(cfg, out, episodes, run.tokenizer)
    t2 = time.perf_counter()
    # version lag of each sampled token: rollouts trained on since the weights that sampled it (0 when synchronous);
    # a completion's policy lag is its largest
    token_lags = token_version_lags(out, step)
    lags = [max(t, default=0) for t in token_lags]

    extra = 1 if cfg.score_placement == "after_last_token" else 0  # a column for the value after the last token
    n, width = len(episodes), max(len(r) for r in out.response_ids) + extra
    packed_lengths = episode_lengths(episodes, out.response_ids)
    mask, sampler_logp = torch.zeros(n, width), torch.zeros(n, width)
    teacher_seconds = 0.0
    device_teacher = torch.zeros(n, width, device=accelerator.device)  # distill
    loss_mask = torch.zeros(n, width)
    for i, (logprobs, lm) in enumerate(zip(out.logprobs, loss_masks)):
        sampler_logp[i, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
        loss_mask[i, : len(lm)] = torch.tensor(lm, dtype=torch.float32)
    if cfg.mask_truncated_completions:  # TRL's: a completion cut at response_length gets no loss (its score counts)
        loss_mask[~torch.tensor(out.stopped, dtype=torch.bool)] = 0.0
    # Micro-batches of per_device_train_batch_size episodes, or packed rows of max_tokens_per_micro_batch tokens;
    # under packing a rank with fewer runs dummies (a copy of its first, which writes the same rows again), so every
    # rank makes as many forwards (FSDP forwards are collectives).
    groups = data.micro_batches(
        list(range(n)), cfg.per_device_train_batch_size, packed_lengths, cfg.max_tokens_per_micro_batch
    )
    # Filled on the device and copied to the host once after the micro-batches (a copy per micro-batch would make the
    # host wait for each forward before it can queue the next).
    device_out = torch.zeros(3, n, width, device=accelerator.device)  # old_logp, ref_logp, old_values
    device_rm = torch.zeros(n, device=accelerator.device)
    with torch.no_grad():
        for rows, _ in equal_micro_batch_count(accelerator, groups, cfg.packing):
            prompts_mb, responses_mb = [episodes[j]["prompt_ids"] for j in rows], [out.response_ids[j] for j in rows]
            host_batch = data.collate_episodes(prompts_mb, responses_mb, pad_id, extra, cfg.packing)
            batch = device_batch(host_batch, accelerator.device)
            r, at = batch["responses"].shape[1], data.host_to_device(torch.tensor(rows), accelerator.device)
            with accelerator.autocast():
                if not on_policy:
                    device_out[0][at, :r] = response_scores(models.policy, batch, cfg.temperature, group).logp
                if models.reference is not None:
                    device_out[1][at, :r] = reference_scores(models.reference, batch, cfg.temperature, group).logp
                if models.value is not None:
                    device_out[2][at, :r] = token_values(models.value, batch, group)
                if models.reward is not None:
                    device_rm[at] = sequence_scores(models.reward, batch, group)
                if models.teacher is not None:  # distill: the teacher's log-prob of every sampled token
                    t_teacher = time.perf_counter()
                    batch_mask = batch["mask"] * data.host_to_device(loss_mask[rows, :r], batch["mask"].device)
                    device_teacher[at, :r] = teacher_token_logprobs(models.teacher, batch, batch_mask, cfg.temperature)
                    teacher_seconds += time.perf_counter() - t_teacher
            mask[rows, :r] = host_batch["mask"] * loss_mask[rows, :r]  # observation tokens: context, never trained
    old_logp, ref_logp, old_values = device_out.cpu()
    rm_scores = device_rm.cpu()
    teacher_logp = device_teacher.cpu() if models.teacher is not None else None
    score_index, value_mask = after_last_token(mask, cfg.response_length) if extra else (None, mask)
    old_logp, ref_logp, old_values = old_logp * mask, ref_logp * mask, old_values * value_mask
    # ALGO LOGIC: the sequence score of each completion, and the KL of the sampling policy to the reference
    rm_multiplier, mode = cfg.reward_model_multiplier, cfg.non_stop_penalty_mode
    scores = torch.tensor(
        [
            episode_score(v, s, cfg.non_stop_penalty, rm if models.reward is not None else None, rm_multiplier, mode)
            for v, s, rm in zip(scored.rewards, out.stopped, rm_scores.tolist())
        ]
    )
    if cfg.overlong_buffer_length:  # over the whole response (observations count against response_length)
        lengths = torch.tensor([float(len(r)) for r in out.response_ids])
        scores = scores + overlong_penalty(
            lengths, cfg.response_length, cfg.overlong_buffer_length, cfg.overlong_penalty_factor
        )
    turn_rewards = None
    if played:  # each turn's reward on its last policy token (episodes.token_rewards), in the score's units
        turn_rewards = torch.zeros(n, width)
        for i, e in enumerate(played):
            per_token = token_rewards(e, cfg.turn_reward_aggregation)
            turn_rewards[i, : len(per_token)] = cfg.verification_reward * torch.tensor(per_token, dtype=torch.float32)
    has_ref = models.reference is not None
    kl = None
    if has_ref and not on_policy:
        kl = kl_penalty(old_logp, ref_logp, cfg.kl_estimator, **cfg.variant_kwargs("kl_estimator")) * mask
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
        value_mask=value_mask,
        score_index=score_index,
        old_logp=None if on_policy else old_logp,
        sampler_logp=sampler_logp * mask,
        ref_logp=ref_logp if has_ref else None,
        old_values=old_values if models.value is not None else None,
        kl=kl,
        policy_lag=lags,
        token_lags=token_lags,
        seconds={
            **seconds,
            "scoring": t2 - t1,
            "inference": time.perf_counter() - t2 - teacher_seconds,
            **({"teacher_forward": teacher_seconds} if models.teacher is not None else {}),
        },
        code_statuses=scored.code_statuses or {},
        reward_function_values=scored.function_values or {},
        turn_rewards=turn_rewards,
        played=played,
        teacher_logp=teacher_logp * mask if models.teacher is not None else None,
    )


def episode_lengths(episodes: list[dict], response_ids: list[list[int]]) -> list[int]:
    """Tokens of each episode (prompt + response): what it takes in a packed row."""
    return [len(e["prompt_ids"]) + len(r) for e, r in zip(episodes, response_ids)]


# ALGO LOGIC: the advantage estimators, one function per row of rl_algorithms.ADVANTAGE_ESTIMATORS (its traits
# there: uses_value_model, uses_groups, kl_in_reward). Each maps a Rollout to the Advantages `update` trains on.


def compute_advantages(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """The advantages of the estimator cfg names: its row's function (rl_algorithms.ADVANTAGE_ESTIMATORS)."""
    return cfg.estimator.function(cfg, rollout, accelerator, **cfg.variant_kwargs("advantage_estimator"))


def group_baseline(cfg: RLVRConfig, rollout: Rollout, advantages: torch.Tensor) -> Advantages:
    """A group baseline's per-completion advantages on every token of the completion; the KL to the reference is a
    loss term (beta); flat groups dropped from the update under filter_zero_std_groups."""
    keep = torch.ones(len(rollout.scores), dtype=torch.bool)
    if cfg.filter_zero_std_groups:
        keep = ~zero_std_groups(rollout.scores, cfg.num_samples_per_prompt)
    kl_loss_coef = cfg.beta if rollout.ref_logp is not None else 0.0
    return Advantages(advantages.unsqueeze(1) * rollout.mask, None, kl_loss_coef, keep)


@advantage_estimator("grpo")
def grpo(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """Group-normalised scores (group_advantages, scale=True)."""
    return group_baseline(cfg, rollout, group_advantages(rollout.scores, cfg.num_samples_per_prompt, scale=True))


@advantage_estimator("dr_grpo")
def dr_grpo(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """Group-centred scores (group_advantages, scale=False)."""
    return group_baseline(cfg, rollout, group_advantages(rollout.scores, cfg.num_samples_per_prompt, scale=False))


@advantage_estimator("rloo")
def rloo(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """Leave-one-out baseline (rloo_advantages)."""
    return group_baseline(cfg, rollout, rloo_advantages(rollout.scores, cfg.num_samples_per_prompt))


def kl_rewards(cfg: RLVRConfig, rollout: Rollout) -> torch.Tensor:
    """Per-token rewards: the score at its position (last token, or after it), -beta * KL_t on every token.
    Multi-turn: each turn's reward on that turn's last policy token (turn_rewards) and the rest of the score
    (penalties, reward model, custom functions: score - sum of turn rewards) on the episode's last policy token;
    KL on policy tokens only (the mask)."""
    kl = rollout.kl if rollout.kl is not None else torch.zeros_like(rollout.mask)
    if rollout.turn_rewards is None:
        return per_token_rewards(rollout.scores, kl, rollout.mask, cfg.beta, rollout.score_index)
    rest = rollout.scores - rollout.turn_rewards.sum(1)
    return per_token_rewards(rest, kl, rollout.mask, cfg.beta) + rollout.turn_rewards


@advantage_estimator("distill")
def distill(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """On-policy distillation (distillation.py): per token, the teacher term and the weighted score,

        A_it = teacher_kl_weight * (teacher_logp_it - old_logp_it)      (distill_loss reverse_kl; jsd: a loss term)
             + distill_reward_weight * (s_i - mean of s over i's group)  (group mean 0 without distill_group_baseline)

    on policy tokens (the mask), no discount; the KL to the reference, when beta > 0, is a loss term."""
    mask, group = rollout.mask, cfg.num_samples_per_prompt
    scores = group_advantages(rollout.scores, group, scale=False) if cfg.distill_group_baseline else rollout.scores
    advantages = cfg.distill_reward_weight * scores.unsqueeze(1) * mask
    if cfg.distill_loss == "reverse_kl":
        advantages = advantages + cfg.teacher_kl_weight * teacher_advantages(
            rollout.old_logp, rollout.teacher_logp, mask
        )
    kl_loss_coef = cfg.beta if rollout.ref_logp is not None else 0.0
    return Advantages(advantages, None, kl_loss_coef, torch.ones(len(rollout.scores), dtype=torch.bool))


@advantage_estimator("reinforce_pp")
def reinforce_pp(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """The per-token rewards -> discounted returns -> whitened over the global batch."""
    mask, keep = rollout.mask, torch.ones(len(rollout.scores), dtype=torch.bool)
    returns = discounted_returns(kl_rewards(cfg, rollout), mask, cfg.gamma)
    return Advantages(whiten_over_ranks(returns, mask, accelerator), None, 0.0, keep)


@advantage_estimator("gae")
def gae(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """The per-token rewards -> GAE with the value model -> whitened with statistics over every rank
    (whiten_advantages); the value targets are the returns."""
    mask, keep = rollout.mask, torch.ones(len(rollout.scores), dtype=torch.bool)
    # The episode runs over the value mask (one position longer with after_last_token); the policy trains on `mask`.
    # Multi-turn: GAE over the policy tokens only, observation tokens skipped (episodes.multi_turn_gae).
    advantage_fn = gae_advantages if rollout.turn_rewards is None else multi_turn_gae
    advantages, returns = advantage_fn(
        kl_rewards(cfg, rollout), rollout.old_values, rollout.value_mask, cfg.gamma, cfg.lam
    )
    advantages = advantages * mask
    if cfg.whiten_advantages:
        advantages = whiten_over_ranks(advantages, mask, accelerator)
    return Advantages(advantages, returns, 0.0, keep)


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, accelerator: Any) -> torch.Tensor:
    """masked_whiten with the mean and unbiased variance of the real tokens of every rank, so all ranks agree.

    Two passes in float64 (the mean, then sum (x - mean)^2), not E[x^2] - E[x]^2: equal values then whiten to exactly
    0, where the one-pass form leaves a variance of rounding noise that rsqrt(var + eps) blows up to ~1e-4."""
    x64, mask64 = x.double(), mask.double()
    m = global_sums(accelerator, {"s": float(masked_sum(x64, mask64)), "n": float(mask64.sum())})
    mean = m["s"] / max(m["n"], 1.0)
    ss = global_sums(accelerator, {"ss": float(masked_sum((x64 - mean) ** 2, mask64))})["ss"]
    var = ss / max(m["n"] - 1, 1)
    return masked_whiten(x, mask, torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64))


# ALGO LOGIC: the policy losses, one function per row of rl_algorithms.POLICY_LOSSES. Each gives the per-token loss
# and where a clip was the branch taken; `micro_batch_loss` weights and aggregates it.


def token_policy_loss(
    cfg: RLVRConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token policy loss and clip indicator of cfg.policy_loss: its row's function."""
    return POLICY_LOSSES[cfg.policy_loss].function(
        cfg, logp, old_logp, advantages, mask, **cfg.variant_kwargs("policy_loss")
    )


@policy_loss("ppo")
def ppo(
    cfg: RLVRConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo_policy_loss(logp, old_logp, advantages, cfg.cliprange_low, cfg.cliprange_high, cfg.dual_clip_c)


@policy_loss("gspo")
def gspo(
    cfg: RLVRConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return gspo_policy_loss(logp, old_logp, advantages, mask, cfg.cliprange_low, cfg.cliprange_high, cfg.dual_clip_c)


@policy_loss("cispo")
def cispo(
    cfg: RLVRConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return cispo_policy_loss(logp, old_logp, advantages, cfg.cliprange_high)


# Aggregated like the loss (weights w, divided by the global units U): what each optimizer step saw.
TRAIN_STATS = ("policy_loss", "value_loss", "pg_clipfrac", "vf_clipfrac", "approx_kl", "entropy", "kl_loss", "jsd_loss")
# Plain sums over this rank's real tokens (and one maximum), for the rollout-level logs.
TOKEN_SUMS = ("tokens", "kl_sum", "sampler_abs_diff", "masked_tokens")
TOKEN_MAXES = ("sampler_ratio_max", "mismatch_abs_max")


def micro_batch_loss(
    cfg: RLVRConfig,
    models: RLModels,
    rollout: Rollout,
    adv: Advantages,
    rows: list[int],
    pad_id: int,
    device: Any,
    autocast: Callable[[], Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum (divided by the global units U in `update`) of one micro-batch's loss, and its statistics
    (0-dim device tensors; a statistic the configuration does not compute is absent):

    loss = sum_t w_t * (keep_t * tis_t * pg_t  +  kl_loss_coef * KL_t  +  vf_coef * vf_t)

    w: aggregation_weights of the rows the update keeps; tis_t: truncated_is_weights (1 when off); keep_t:
    off_policy_mask (1 when no mask is set)."""
    prompts, responses = [rollout.episodes[j]["prompt_ids"] for j in rows], [rollout.response_ids[j] for j in rows]
    extra = 1 if cfg.score_placement == "after_last_token" else 0
    batch = device_batch(data.collate_episodes(prompts, responses, pad_id, extra, cfg.packing), device)
    r = batch["responses"].shape[1]

    def take(x: torch.Tensor) -> torch.Tensor:  # this micro-batch's slice of a rollout tensor
        return data.host_to_device(x[rows, :r], device)

    mask = take(rollout.mask)  # the loss mask: real tokens, less an episode's observation tokens

    kept = mask * data.host_to_device(adv.keep[rows], device).unsqueeze(1)
    w, _ = aggregation_weights(kept, cfg.loss_aggregation, cfg.loss_norm_length)
    jsd = cfg.uses_teacher and cfg.distill_loss == "jsd"  # the student's last hidden states feed the JSD
    with autocast():  # ALGO LOGIC: the loss terms
        if (
            jsd
        ):  # the JSD needs the student's last hidden states: one full-logits output-layer call (docs/distillation.md)
            with output_layer_inputs(models.policy, skip_output_layer=False) as hidden:
                logits = response_logits(models.policy, batch, cfg.temperature, 1)
            scores = TokenScores(token_logprobs(logits, batch["responses"]), entropy_from_logits(logits.detach()), None)
        else:
            scores = response_scores(models.policy, batch, cfg.temperature, cfg.num_samples_per_prompt, entropy=True)
        logp = scores.logp
        old_logp = logp.detach() if rollout.old_logp is None else take(rollout.old_logp)  # on-policy: they sampled
        pg, pg_clipped = token_policy_loss(cfg, logp, old_logp, take(adv.advantages), mask)
        if cfg.truncated_importance_sampling:
            pg = pg * truncated_is_weights(old_logp, take(rollout.sampler_logp), cfg.tis_cap)
        lags = (
            data.host_to_device(torch.tensor([rollout.policy_lag[j] for j in rows]), device)
            if rollout.policy_lag
            else None
        )
        pg_kept = off_policy_mask(
            old_logp, take(rollout.sampler_logp), lags, cfg.is_mask_low, cfg.is_mask_high, cfg.max_sequence_lag
        )
        pg = pg * pg_kept
        loss_sum = masked_sum(pg, w)
        if adv.kl_loss_coef > 0:
            kl = kl_penalty(logp, take(rollout.ref_logp), cfg.kl_estimator, **cfg.variant_kwargs("kl_estimator"))
            loss_sum = loss_sum + adv.kl_loss_coef * masked_sum(kl, w)
        if models.value is not None:
            values = token_values(models.value, batch, cfg.num_samples_per_prompt)
            vf, vf_clipped = clipped_value_loss(
                values, take(rollout.old_values), take(adv.returns), cfg.cliprange_value
            )
            # over the value mask (after_last_token: one position more per row), normalised like the other terms
            value_rows = take(rollout.value_mask) * data.host_to_device(adv.keep[rows], device).unsqueeze(1)
            w_value, _ = aggregation_weights(value_rows, cfg.loss_aggregation, cfg.loss_norm_length)
            loss_sum = loss_sum + cfg.vf_coef * masked_sum(vf, w_value)
        if jsd:  # distill_loss jsd: teacher_kl_weight * JSD_beta(student, teacher) per policy token
            t_teacher = time.perf_counter()
            t_hidden = teacher_hidden(models.teacher, batch)
            teacher_seconds = time.perf_counter() - t_teacher
            divergence = jsd_to_teacher(
                models.policy,
                hidden,
                models.teacher,
                t_hidden,
                batch,
                mask,
                cfg.distill_jsd_beta,
                cfg.temperature,
                cfg.distill_top_k,
            )
            loss_sum = loss_sum + cfg.teacher_kl_weight * masked_sum(divergence, w)
    stats: dict[str, torch.Tensor] = {}  # 0-dim tensors on the device, read once per optimizer step (StepSums)
    if jsd:
        stats["jsd_loss"] = masked_sum(divergence.detach(), w)
        stats["teacher_seconds"] = teacher_seconds  # a host clock reading, summed on the host
    with torch.no_grad():
        if adv.kl_loss_coef > 0:
            stats["kl_loss"], stats["kl_sum"] = masked_sum(kl, w), masked_sum(kl, mask)
        if models.value is not None:
            stats["value_loss"] = masked_sum(vf, w_value)
            stats["vf_clipfrac"] = masked_sum(vf_clipped, w_value)
        stats["policy_loss"] = masked_sum(pg.detach(), w)
        stats["pg_clipfrac"] = masked_sum(pg_clipped, w)
        stats["approx_kl"] = masked_sum(approx_kl(logp.detach(), old_logp), w)
        stats["entropy"] = masked_sum(scores.entropy.detach(), w)
        # How far the sampling engine's log-probs are from the trainer's (what truncated IS corrects).
        log_ratio = (old_logp - take(rollout.sampler_logp)) * mask
        stats["tokens"], stats["sampler_abs_diff"] = mask.sum(), log_ratio.abs().sum()
        stats["masked_tokens"] = ((1.0 - pg_kept) * mask).sum()
        # max over real tokens; none: exp(-inf) = 0 (a masked max, not a boolean index: no host sync)
        stats["sampler_ratio_max"] = torch.exp(log_ratio.masked_fill(mask <= 0, float("-inf")).max())
        token_lags = [rollout.token_lags[j] for j in rows] if rollout.token_lags else None
        stats.update(mismatch_token_sums(log_ratio, mask, cfg.tis_cap, token_lags, cfg.async_steps))  # mismatch/
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
    (group estimators: required; gae: when they fit, so micro-batches can share prompt forwards). Each step's loss is
    sum(w * loss) / U over its global mini-batch (aggregation_weights). Returns the TRAIN_STATS summed over the
    steps, this rank's TOKEN_SUMS over the first epoch, and sampler_ratio_max."""
    accelerator, counters = run.accelerator, run.counters
    world, group, step = accelerator.num_processes, cfg.num_samples_per_prompt, run.counters.rollout_step
    unit = group if plan.local_mini_batch_size % group == 0 else 1
    counted = adv.keep if cfg.mask_truncated_completions else None  # a masked truncated row counts (TRL)
    kept = rollout.mask * adv.keep.unsqueeze(1)
    _, row_units = aggregation_weights(kept, cfg.loss_aggregation, cfg.loss_norm_length, counted)
    lengths = episode_lengths(rollout.episodes, rollout.response_ids)  # packing: micro-batches by tokens
    names = (
        *TRAIN_STATS,
        "grad_norm",
        "value_grad_norm",
        "skipped",
        "empty",
        "teacher_seconds",
    )  # teacher_seconds: distill jsd's teacher forwards in the update
    totals = dict.fromkeys(names, 0.0)
    token_sums = StepSums(  # read after the epochs
        (*TOKEN_SUMS, *mismatch_sum_keys(cfg.async_steps)), accelerator.device, maxima=TOKEN_MAXES
    )
    for epoch in range(cfg.num_epochs):
        units = list(range(len(rollout.episodes) // unit))
        random.Random(derived_seed(cfg.seed, step, accelerator.process_index, epoch)).shuffle(units)
        order = [u * unit + j for u in units for j in range(unit)]
        for mb in range(plan.num_mini_batches):
            mb_rows = order[mb * plan.local_mini_batch_size : (mb + 1) * plan.local_mini_batch_size]
            global_units = global_sum(accelerator, float(row_units[mb_rows].sum()))
            if global_units == 0:  # every group of this mini-batch was filtered out on every rank: nothing to learn
                for name in schedulers:
                    schedulers[name].step()
                counters.optimizer_step += 1
                totals["empty"] += 1
                continue
            step_sums = StepSums(TRAIN_STATS, accelerator.device)  # read once per optimizer step
            micro_rows = data.micro_batches(
                mb_rows, cfg.per_device_train_batch_size, [lengths[j] for j in mb_rows], cfg.max_tokens_per_micro_batch
            )
            micro_rows = equal_micro_batch_count(accelerator, micro_rows, cfg.packing)
            for i, (rows, real) in enumerate(micro_rows):
                with grad_sync_all(accelerator, models.trained().values(), sync=i == len(micro_rows) - 1):
                    loss_sum, stats = micro_batch_loss(
                        cfg, models, rollout, adv, rows, pad_id, accelerator.device, accelerator.autocast
                    )
                    # sum(w * loss) / U over the global mini-batch; DDP/FSDP average gradients, hence x world. A dummy
                    # micro-batch (packing: this rank has fewer than another) counts 0.
                    accelerator.backward(loss_sum * (world / global_units if real else 0.0))
                if not real:
                    continue
                step_sums.add(stats)
                token_sums.add(stats if epoch == 0 else {k: stats[k] for k in TOKEN_MAXES})
                totals["teacher_seconds"] += stats.get("teacher_seconds", 0.0)
            sums = global_sums(accelerator, step_sums.read())
            grad_norm = clip_grad_norm_(accelerator, models.policy, cfg.max_grad_norm)
            value_grad_norm = torch.tensor(0.0)
            if models.value is not None:
                value_grad_norm = clip_grad_norm_(accelerator, models.value, cfg.max_grad_norm)
            loss_terms = sums["policy_loss"] + cfg.vf_coef * sums["value_loss"] + adv.kl_loss_coef * sums["kl_loss"]
            step_ok = run.update_is_finite(
                loss_terms / global_units, grad_norm=grad_norm, value_grad_norm=value_grad_norm
            )
            for name in optimizers:
                if step_ok:
                    optimizers[name].step()
                schedulers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            counters.optimizer_step += 1
            for k in TRAIN_STATS:
                totals[k] += sums[k] / global_units
            totals["grad_norm"] += float(grad_norm)
            totals["value_grad_norm"] += float(value_grad_norm)
            totals["skipped"] += int(not step_ok)
    return {**totals, **token_sums.read()}


def teacher_kl_sums(rollout: Rollout) -> dict[str, float]:
    """Sums for train/teacher_kl: sum over policy tokens of old_logp - teacher_logp (the sampled-token estimate of
    KL(pi_student || pi_teacher) per token), and those tokens; zeros without a teacher."""
    if rollout.teacher_logp is None or rollout.old_logp is None:
        return {"teacher_kl": 0.0, "teacher_tokens": 0.0}
    gap = masked_sum(rollout.old_logp - rollout.teacher_logp, rollout.mask)
    return {"teacher_kl": float(gap), "teacher_tokens": float(rollout.mask.sum())}


def log_row(
    cfg: RLVRConfig, rollout: Rollout, adv: Advantages, train: dict[str, float], plan: Any, run: runtime.RunContext
) -> dict[str, Any]:
    """The rollout's metrics: episode statistics summed over ranks, and the update statistics averaged over the
    rollout's num_epochs x num_mini_batches optimizer steps (those that had data)."""
    # On-policy, the KL of the sampling policy is the training forward's KL term (the weights had not moved yet).
    kl_sum = float(rollout.kl.sum()) if rollout.kl is not None else train["kl_sum"]
    ep = global_sums(
        run.accelerator,
        {
            "n": len(rollout.episodes),
            "score": float(rollout.scores.sum()),
            "score_sq": float((rollout.scores**2).sum()),
            "correct": float(sum(rollout.correct)),
            "non_stop": float(sum(not s for s in rollout.stopped)),
            "length": float(sum(len(r) for r in rollout.response_ids)),
            "kl": kl_sum,
            "timeouts": float(rollout.verifier_timeouts),
            "rm": float(rollout.rm_scores.sum()),
            "dropped": float((~adv.keep).sum()),
            "tokens": train["tokens"],
            "sampler_abs_diff": train["sampler_abs_diff"],
            "lag": float(sum(rollout.policy_lag)),
            "masked_tokens": train["masked_tokens"],
            **{k: train[k] for k in mismatch_sum_keys(cfg.async_steps)},
            **version_lag_stats(rollout.token_lags, cfg.async_steps),
            **teacher_kl_sums(rollout),
            **{f"code_{s}": float(rollout.code_statuses.get(s, 0)) for s in TEST_STATUSES},
            **reward_function_sums(rollout.reward_function_values),
        },
    )
    n, updates = ep["n"], max(cfg.num_epochs * plan.num_mini_batches - train["empty"], 1)
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
        **reward_function_metrics(ep),  # reward/<function>/mean and /std
        "loss/policy": train["policy_loss"] / updates,
        "clipfrac/policy": train["pg_clipfrac"] / updates,
        "train/grad_norm": train["grad_norm"] / updates,
        "train/skipped_updates": train["skipped"],
        "lr": run.schedulers["policy"].get_last_lr()[0],
        # the sampling engine vs the trainer: mean |old_logp - sampler_logp| per token and max exp(old - sampler)
        "train/sampler_logp_abs_diff": ep["sampler_abs_diff"] / max(ep["tokens"], 1.0),
        "train/sampler_ratio_max": global_max(run.accelerator, train["sampler_ratio_max"]),
        # updates between the weights that sampled a completion and the update that trains on it
        "train/policy_lag_mean": ep["lag"] / n,
        "train/policy_lag_max": global_max(run.accelerator, float(max(rollout.policy_lag, default=0))),
        # per sampled token: versions between the weights that sampled it and the trainer's (bound: async_steps)
        "train/version_lag_mean": ep["lag_sum"] / max(ep["lag_tokens"], 1.0),
        "train/version_lag_max": global_max(
            run.accelerator, float(max((max(t, default=0) for t in rollout.token_lags), default=0))
        ),
        **{f"train/version_lag_{k}": ep[f"lag_{k}"] / max(ep["lag_tokens"], 1.0) for k in range(cfg.async_steps + 1)},
    }
    # sampler vs trainer per sampled token (docs/trusted-generation.md), with a warning line past the levels
    row.update(mismatch_metrics(ep, global_max(run.accelerator, train["mismatch_abs_max"]), cfg.async_steps))
    if run.accelerator.is_main_process:
        for line in mismatch_warnings(row, cfg.mismatch_warn_kl, cfg.mismatch_warn_beyond_cap):
            print(f"warning: rollout {run.counters.rollout_step}: {line}", flush=True)
    if cfg.is_mask_low is not None or cfg.is_mask_high is not None or cfg.max_sequence_lag is not None:
        row["train/masked_token_fraction"] = ep["masked_tokens"] / max(ep["tokens"], 1.0)
    if cfg.filter_zero_std_groups:  # groups whose completions all scored the same, dropped from the update
        row["train/filtered_groups_fraction"] = ep["dropped"] / n
        row["train/empty_updates"] = train["empty"]
    if rollout.ref_logp is not None:  # per sequence: the sum over its tokens of kl_estimator(sampling policy, ref)
        row["train/kl"] = ep["kl"] / n
    if "value" in run.models:
        row["loss/value"] = train["value_loss"] / updates
        row["clipfrac/value"] = train["vf_clipfrac"] / updates
        row["train/value_grad_norm"] = train["value_grad_norm"] / updates
    if not cfg.kl_in_reward:
        row["loss/kl"] = train["kl_loss"] / updates
    if cfg.reward_model_path:
        row["train/rm_score_mean"] = ep["rm"] / n
    if rollout.teacher_logp is not None:  # log pi_student - log pi_teacher per sampled policy token (reverse KL)
        row["train/teacher_kl"] = ep["teacher_kl"] / max(ep["teacher_tokens"], 1.0)
    if cfg.uses_teacher and cfg.distill_loss == "jsd":
        row["loss/jsd"] = train["jsd_loss"] / updates
    if any(ep[f"code_{s}"] for s in TEST_STATUSES):  # the code verifier's tests by outcome, over every rank
        row.update({f"train/code_tests_{s}": ep[f"code_{s}"] for s in TEST_STATUSES})
    if cfg.environment is not None:  # turns, tool calls, tool errors by reason, observation share, truncations
        row.update(episode_metrics(run.accelerator, rollout.played, "train/"))
    return row


# ---------------------------------------------------------------------------------------------------------------------
# Set-up (plumbing: rollouts.py, generation_backends.py) and the loop


def reference_scores(reference: Any, batch: dict[str, torch.Tensor], temperature: float, group: int) -> TokenScores:
    """The reference's response log-probs; under LoRA the reference is the policy with its adapters disabled."""
    with adapter_disabled(reference):
        return response_scores(reference, batch, temperature, group)


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(RLVRConfig, argv)  # every check that needs no model (the backend, the teacher) first
    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template
    )
    environments = environment_run(cfg, tokenizer)  # None: single-turn completions; else multi-turn episodes
    train, evals, plan, max_model_len = load_prompts(cfg, tokenizer, accelerator, environments)
    check_before_loading(cfg, max_model_len)  # engines started apart answer and fit the run
    models, optimizers, schedulers = load_models(cfg, tokenizer, accelerator, plan)
    # the backend the config names (generation.py's contract): started or reached here, synced by the sampler
    generator = make_generator(cfg, models.policy, tokenizer, accelerator, max_model_len)
    # every sync under a deadline; the first checks the generator against the trainer, the others the weights it got
    checker = GenerationChecker.from_config(cfg, generator, models.policy, tokenizer, accelerator, max_model_len)

    run = runtime.RunContext(
        cfg, accelerator, models.trained(), optimizers, schedulers, tokenizer, plan.num_training_steps, "rollout_step"
    )
    counters = run.counters
    stream = data.episode_stream(train, cfg)
    # One pass in one mini-batch trains on exactly the weights that sampled: the training forward gives the old
    # log-probs, no separate pass (unless the KL to the reference must go into the rewards before the update).
    on_policy = cfg.num_epochs == 1 and plan.num_mini_batches == 1 and not (cfg.kl_in_reward and cfg.beta > 0)
    on_policy = on_policy and not cfg.uses_teacher  # distill: the advantages need log pi_student before the update

    def prompts_for(step: int) -> list[dict]:  # a slice of the global prompt order, by position (world-size free)
        global_idx = stream.take(step * plan.rollout_batch_size, plan.rollout_batch_size)
        return [train[i] for i in stream.local_slice(global_idx, rank, world)]

    sampler = RolloutSampler(
        cfg, generator, models.policy, accelerator, prompts_for, plan.num_training_steps, environments, checker
    )
    if cfg.async_steps:  # the rollouts in flight are drained into every checkpoint and taken back on resume
        run.checkpoint_state["rollout_buffer"] = sampler.state_dict
        if "rollout_buffer" in run.restored_state:
            sampler.load_state_dict(run.restored_state["rollout_buffer"], counters.rollout_step)

    def evaluate_policy() -> dict[str, float]:
        sampler.idle()  # the generator evaluates the current weights once no rollout is in flight
        sampler.sync(counters.rollout_step)
        sampler.idle()  # (a weight copy handed over in order is in place)
        return evaluate(cfg, evals, models.policy, generator, tokenizer, accelerator, environments)

    if evals and cfg.eval_steps and not run.resumed:  # the starting point: a baseline row at rollout_step 0
        run.evaluate(evaluate_policy)
    for model in models.trained().values():
        model.train()
    clock = PhaseClock()
    while counters.rollout_step < plan.num_training_steps:  # one rollout step: sample, score, advantages, update
        prompts, out, seconds, sync_bytes = sampler.take(counters.rollout_step)
        rollout = collect_rollout(
            cfg, models, prompts, out, seconds, counters.rollout_step, run, on_policy, tokenizer.pad_token_id
        )
        t0 = time.perf_counter()
        advantages = compute_advantages(cfg, rollout, accelerator)
        t1 = time.perf_counter()
        train_stats = update(
            cfg, models, optimizers, schedulers, rollout, advantages, plan, run, tokenizer.pad_token_id
        )
        rollout.seconds["inference"] += t1 - t0
        rollout.seconds["training"] = time.perf_counter() - t1 - train_stats["teacher_seconds"]
        if models.teacher is not None:  # its scoring pass (collect_rollout) and, under jsd, its update forwards
            rollout.seconds["teacher_forward"] += train_stats["teacher_seconds"]

        counters.rollout_step += 1
        counters.episode += plan.episodes_per_rollout
        counters.epoch = counters.rollout_step * plan.rollout_batch_size / len(train)
        run.logger.advance()
        clock.add(rollout.seconds, int(rollout.mask.sum()), sync_bytes)
        run.throughput.add(int(rollout.mask.sum()), len(rollout.episodes))  # for the end-of-run summary
        if should_log(counters.rollout_step, cfg.logging_steps):
            # the update phase's tokens/s (prompt + response, num_epochs passes): MFU's numerator on a GPU
            trained = global_sum(accelerator, sum(episode_lengths(rollout.episodes, rollout.response_ids)))
            run.log(
                {
                    **log_row(cfg, rollout, advantages, train_stats, plan, run),
                    **clock.report(accelerator, plan.episodes_per_rollout),
                    "perf/train_tokens_per_second": trained * cfg.num_epochs / max(rollout.seconds["training"], 1e-9),
                    **checker.last,
                }
            )
            if cfg.num_samples_logged and accelerator.is_main_process:
                samples = sample_rows(
                    rollout, tokenizer, cfg.num_samples_logged, environments, cfg.reward_functions or ()
                )
                run.logger.log_samples(samples, counters.as_log())
        if run.end_of_step(evaluate_policy if evals else None):  # eval, best model, checkpoint; True on SIGTERM
            break
    else:
        run.finish()
    sampler.close()
    generator.close()  # stops what it started, e.g. the engines


if __name__ == "__main__":
    runtime.run(main)
