"""RL with verifiable rewards: PPO with a value model (default), GRPO (`--algo grpo`) and their 2025 variants.

    python open_instruct/rlvr_ppo.py configs/rlvr_tiny.yaml [--algo grpo] [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_7gpu.yaml open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml
                        (7 training GPUs; the trainer starts the vLLM engine on GPU 7: scripts/rlvr_8b.sh)

The file is the optional features' extension points (`Feature`, `features_of`: where each feature can act), then
one function per phase of a rollout step, then `main`, which loads everything and runs the phases in a loop. Lines
marked ALGO LOGIC are the ones a new variant edits; the estimators, policy losses and KL estimators, each one
function with its registration, and their math (pure functions with their formulas) are `rl_algorithms.py`; the
plumbing around them (sampling, model loading, evaluation, timing) is in `rollouts.py`, the generation backends
behind `generation.py`'s contract, the step statistics in `distributed.StepSums`.

    RolloutSampler      prompts -> `num_samples_per_prompt` completions each, with the sampler's own log-probs:
    (rollouts.py)       generated now after a weight sync, or (async_steps 1, dedicated engines) taken from the
                        generation submitted one rollout earlier                                   -> completions
    collect_rollout     completions -> score them (verifiers, plus a reward model, the non-stop penalty and the
                        overlong punishment when configured) -> no-grad log-probs of the policy and the frozen
                        reference, values (gae)                                                   -> Rollout
    compute_advantages  the estimator's row of rl_algorithms.ADVANTAGE_ESTIMATORS, called with the rollout's
                        AdvantageInputs (the narrow input: docs/extending.md)                     -> Advantages
    update              num_epochs passes x num_mini_batches optimizer steps x micro-batches, the optimizer step in
                        sight; each step's loss is aggregated over the *global* mini-batch, so 1 or N processes
                        give the same update
    log_row             the metrics row of the rollout

Per-token tensors of a rollout are *response-aligned*: column t is response token t of the row (prompt tokens are
not stored), and `mask` marks real tokens (right padding after the response's stop). Multi-turn episodes
(`environment:`, episodes.py): the response holds the policy's turns and the observations between them, and
`mask` is the loss mask, 1 on policy tokens only: observations are context for every forward and never trained
(no policy, KL, entropy or value term, no count); the score sits on the last policy token, each turn's reward on its
turn's last policy token, and GAE / returns run over policy tokens only (rl_algorithms.multi_turn_gae).

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
from open_instruct.distributed import (
    StepSums,
    check_update_finite,
    clip_grad_norm_,
    global_max,
    global_sum,
    global_sums,
    grad_sync_all,
    step_micro_batches,
)
from open_instruct.generation_backends import check_before_loading, make_checker, make_generator
from open_instruct.models import TokenScores, load_tokenizer, response_scores, token_values
from open_instruct.rewards import combine_rewards, reward_function_metrics, reward_function_sums
from open_instruct.rl_algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    Advantages,
    LossInputs,
    after_last_token,
    aggregation_weights,
    approx_kl,
    chosen_kwargs,
    clipped_value_loss,
    kl_penalty,
    masked_sum,
    mismatch_metrics,
    mismatch_sum_keys,
    mismatch_token_sums,
    mismatch_warnings,
    off_policy_mask,
    overlong_penalty,
    truncated_is_weights,
    version_lag_stats,
    zero_std_groups,
)
from open_instruct.rollouts import (
    EpisodeLayout,
    PhaseClock,
    RLModels,
    RolloutSampler,
    call_timed,
    clock_seconds,
    derived_seed,
    environment_run,
    episode_layout,
    episode_lengths,
    evaluate,
    load_models,
    load_prompts,
    no_grad_forwards,
    output_rows,
    padded,
    sample_rows,
    sampling_truncation,
    score_rollout,
    shared_group,
    start_reward_function_models,
    token_version_lags,
)

# ---------------------------------------------------------------------------------------------------------------------
# Optional features and where they act: every extension point of the loop, and every feature the config can turn on


@dataclass
class Feature:
    """An optional feature's hooks into one rollout step (None: it does not act there). Hooks take the config first.

    score_rollout  collect_rollout, once: (cfg, out, n, width) -> {Rollout field: [n, width] tensor}
    score_batch    collect_rollout, each no-grad micro-batch: (cfg, models, batch, mask, its prompt rows) ->
                   {Rollout field: [b, r] tensor}, masked (the fields: Rollout's per-token tensors of the features,
                   e.g. teacher_logp; an estimator reads them through AdvantageInputs)
    policy_forward micro_batch_loss: replaces the policy's forward, (cfg, models, batch) -> (TokenScores, state)
    loss_term      micro_batch_loss: (cfg, models, batch, mask, w, state from policy_forward) -> (term added to
                   the loss sum, {loss_stats name: 0-dim tensor}), the statistics aggregated like the loss
    rollout_sums   log_row: (rollout) -> {name: float}, summed over ranks with the rollout's own sums
    metrics        log_row: (cfg, rollout, sums over ranks, update stats, updates, accelerator) -> metrics of the row
    clock          time/<clock>: the seconds spent in its score_batch and loss_term hooks"""

    name: str
    score_rollout: Optional[Callable[..., dict[str, torch.Tensor]]] = None
    score_batch: Optional[Callable[..., dict[str, torch.Tensor]]] = None
    policy_forward: Optional[Callable[..., tuple[TokenScores, Any]]] = None
    loss_term: Optional[Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = None
    loss_stats: tuple[str, ...] = ()
    rollout_sums: Optional[Callable[..., dict[str, float]]] = None
    metrics: Optional[Callable[..., dict[str, float]]] = None
    clock: Optional[str] = None
    seconds: float = 0.0  # host clock, summed since the last read (clock_seconds)


def features_of(cfg: RLVRConfig, train: Sequence[dict] = (), tokenizer: Any = None) -> list[Feature]:
    """The features this run turns on, each imported only then (`train`: the training rows, for the code verifier's
    and correct_rate_by's metrics, which a call without them leaves out; `tokenizer`: the policy's, for ptx_dataset's
    rows, loaded when not given). The generator and its vLLM engines, the generation check and async sampling plug in
    at set-up instead: make_generator, make_checker and RolloutSampler in `main`."""
    features = []
    if cfg.uses_teacher:  # on-policy distillation: the teacher scores, and under jsd adds a loss term
        from open_instruct import distillation

        jsd = cfg.distill_loss == "jsd"
        routes = distillation.TeacherRoutes(cfg, train) if cfg.teacher_models else None  # the rows' names checked
        features.append(
            Feature(
                "distillation",
                score_batch=distillation.teacher_scores,
                policy_forward=distillation.student_forward if jsd else None,
                loss_term=distillation.jsd_loss_term if jsd else None,
                loss_stats=("jsd_loss",) if jsd else (),
                rollout_sums=routes.rollout_sums if routes else distillation.teacher_kl_sums,
                metrics=routes.metrics if routes else distillation.metrics,
                clock="teacher_forward",
            )
        )
    if cfg.environment is not None:  # multi-turn episodes: turn rewards, turns and tool calls in the log
        from open_instruct import episodes

        features.append(Feature("episodes", score_rollout=episodes.turn_reward_tensor, metrics=episodes.metrics))
    if any(row.get("verifier") == "code" for row in train):  # the code verifier's tests by outcome
        from open_instruct import code_verifier

        features.append(Feature("code", rollout_sums=code_verifier.status_sums, metrics=code_verifier.status_metrics))
    if cfg.correct_rate_by and train:  # train/correct_rate/<group>: each group of prompts' own rate
        from open_instruct.correct_rates import CorrectRateByGroup

        by = CorrectRateByGroup(cfg, train)
        features.append(Feature("correct_rate_by", rollout_sums=by.rollout_sums, metrics=by.metrics))
    if cfg.ptx_dataset:  # PPO-ptx: the demonstrations' NLL beside the RL loss
        from open_instruct import ptx

        term = ptx.DemonstrationLoss(cfg, tokenizer)  # the rows read and checked now, before any model loads
        features.append(Feature("ptx", loss_term=term, loss_stats=("ptx_loss",), metrics=ptx.metrics, clock="ptx"))
    return features


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
    mask: torch.Tensor  # [n, R] the loss mask: 1 on the policy's real response tokens
    value_mask: torch.Tensor  # [n, R] where values are kept: mask, plus the score position after_last_token
    score_index: Optional[torch.Tensor]  # [n] where the score goes (after_last_token); None: the last real token
    # on-policy: the update's first forward runs on the weights that sampled, so it gives the old log-probs, and the
    # rollout computes none (old_logp None); off-policy: old_logp holds the trainer's log-probs before the update
    on_policy: bool
    old_logp: Optional[torch.Tensor]
    sampler_logp: torch.Tensor  # [n, R] the generator's log-probs of what it sampled (vLLM/HF sampling kernels)
    ref_logp: Optional[torch.Tensor]  # the reference's; None without a reference
    old_values: Optional[torch.Tensor]  # the value model's (PPO)
    kl: Optional[torch.Tensor]  # kl_estimator(sampling policy, reference) per token; None on-policy or without ref
    ref_scored: Optional[torch.Tensor] = None  # [n] bool: the rows ref_logp holds (None: every row)
    policy_lag: list[int] = field(default_factory=list)  # per completion: updates since the weights that sampled it
    # per completion, the version lag of each token the policy sampled (rollouts.token_version_lags)
    token_lags: list[list[int]] = field(default_factory=list)
    # weight_sync, generation (waited for), generation_engine (engine wall time), scoring, inference
    seconds: dict[str, float] = field(default_factory=dict)
    code_statuses: dict[str, int] = field(default_factory=dict)  # `code` rows: tests per status (pass, timeout, ...)
    reward_function_values: dict = field(default_factory=dict)  # label -> each completion's value (None: n/a)
    # multi-turn (an environment): `mask` is the loss mask (policy tokens; observation tokens are 0 inside the
    # row), `played` the episodes (turns, tool calls, for the log row and samples)
    played: list = field(default_factory=list)
    # the features' per-token tensors (Feature.score_rollout / score_batch), None when no feature gives them:
    turn_rewards: Optional[torch.Tensor] = None  # [n, R] multi-turn: each turn's reward x verification_reward
    teacher_logp: Optional[torch.Tensor] = None  # [n, R] distillation: the teacher's log-probs of the sampled tokens


def collect_rollout(
    cfg: RLVRConfig,
    models: RLModels,
    prompts: list[dict],
    out: Any,
    seconds: dict[str, float],
    step: int,
    run: runtime.RunContext,
    on_policy: bool,
    layout: EpisodeLayout,
    features: Optional[Sequence[Feature]] = None,
) -> Rollout:
    """Score the completions `out` of `prompts` (score_rollout, sequence_scores_of), then the per-token tensors of
    the update (rollout_tensors: the no-grad forwards, the loss mask, the KL); `features`: those of cfg when None."""
    features = features_of(cfg) if features is None else features
    played, loss_masks, episodes = output_rows(out, prompts)
    t1 = time.perf_counter()
    scored = score_rollout(cfg, out, episodes, run.tokenizer)
    t2 = time.perf_counter()
    ref_rows = reference_rows(cfg, models, on_policy, scored, out)  # None: every row
    tensors = rollout_tensors(cfg, models, run.accelerator, out, episodes, loss_masks, on_policy, ref_rows, layout,
                              features)  # fmt: skip
    rm_scores, part_seconds = tensors.pop("rm_scores"), tensors.pop("part_seconds")
    # version lag of each sampled token: rollouts trained on since the weights that sampled it (0 when synchronous);
    # a completion's policy lag is its largest
    token_lags = token_version_lags(out, step)
    clocks = clock_seconds(features)
    return Rollout(
        episodes=episodes,
        response_ids=out.response_ids,
        texts=out.texts,
        stopped=out.stopped,
        correct=list(scored.correct),
        verifier_timeouts=scored.num_timeouts,
        scores=sequence_scores_of(cfg, scored.rewards, out, rm_scores if models.reward is not None else None),
        rm_scores=rm_scores,
        on_policy=on_policy,
        policy_lag=[max(t, default=0) for t in token_lags],
        token_lags=token_lags,
        seconds={
            **seconds,
            "scoring": t2 - t1,
            "inference": time.perf_counter() - t2 - sum(clocks.values()),
            **clocks,
            **part_seconds,
        },
        code_statuses=scored.code_statuses or {},
        reward_function_values=scored.function_values or {},
        played=played,
        **tensors,
    )


def rollout_tensors(cfg: RLVRConfig, models: RLModels, accelerator: Any, out: Any, episodes: list[dict],
                    loss_masks: list[list[int]], on_policy: bool, ref_rows: Optional[list[int]], layout: EpisodeLayout,
                    features: Sequence[Feature]) -> dict[str, Any]:  # fmt: skip
    """The rollout's per-token tensors, response-aligned [n, R] (R: the longest response, + 1 under after_last_token)
    and 0 off the loss mask: the loss mask (policy tokens; under mask_truncated_completions none of a completion cut
    at response_length), the no-grad forwards' log-probs, values and reward-model scores (no_grad_forwards), the KL of
    the sampling policy to the reference (off-policy) and the features' tensors."""
    n, width = len(episodes), max(len(r) for r in out.response_ids) + layout.value_column
    mask = padded(loss_masks, width)  # multi-turn: observation tokens are context, never trained
    if cfg.mask_truncated_completions:  # TRL's: a completion cut at response_length gets no loss (its score counts)
        mask[~torch.tensor(out.stopped, dtype=torch.bool)] = 0.0
    lengths = episode_lengths(episodes, out.response_ids)
    forwards = no_grad_forwards(cfg, models, accelerator, episodes, out.response_ids, lengths, mask, on_policy,
                                ref_rows, layout, features)  # fmt: skip
    (old_logp, ref_logp, old_values), rm_scores = forwards.pop("logp_values"), forwards.pop("rm_scores")
    part_seconds = forwards.pop("part_seconds")
    score_index, value_mask = after_last_token(mask, cfg.response_length) if layout.value_column else (None, mask)
    old_logp, ref_logp, old_values = old_logp * mask, ref_logp * mask, old_values * value_mask
    kl, has_ref, rows = None, models.reference is not None, torch.arange(n)
    if has_ref and not on_policy:  # ALGO LOGIC: the KL of the sampling policy to the reference
        kl = kl_penalty(old_logp, ref_logp, cfg.kl_estimator, **chosen_kwargs(cfg, "kl_estimator")) * mask
    tensors = {name: x * mask for name, x in forwards.items()}  # the features' score_batch tensors
    for f in (f for f in features if f.score_rollout is not None):
        tensors.update(f.score_rollout(cfg, out, n, width))
    return {
        **tensors,
        "rm_scores": rm_scores,
        "part_seconds": part_seconds,
        "mask": mask,
        "value_mask": value_mask,
        "score_index": score_index,
        "old_logp": None if on_policy else old_logp,
        "sampler_logp": padded(out.logprobs, width) * mask,
        "ref_logp": ref_logp if has_ref else None,
        "ref_scored": None if ref_rows is None else torch.isin(rows, torch.tensor(ref_rows, dtype=torch.long)),
        "old_values": old_values if models.value is not None else None,
        "kl": kl,
    }


def reference_rows(cfg: RLVRConfig, models: RLModels, on_policy: bool, scored: Any, out: Any) -> Optional[list[int]]:
    """The rows the reference must score when not every row: on-policy its log-probs serve only the KL loss term of
    the rows the update trains on, so the groups filter_zero_std_groups drops need none; without a reward model their
    scores, and so the drop, are known before any forward. None: every row."""
    if not (on_policy and models.reference is not None and models.reward is None and skips_dropped_rows(cfg)):
        return None
    flat = zero_std_groups(sequence_scores_of(cfg, scored.rewards, out, None), cfg.num_samples_per_prompt)
    return [j for j in range(len(flat)) if not flat[j]]


def sequence_scores_of(
    cfg: RLVRConfig, verifiable: list[float], out: Any, rm_scores: Optional[torch.Tensor]
) -> torch.Tensor:
    """ALGO LOGIC: the sequence score of each completion: its verifiable reward + reward_model_multiplier x the reward
    model's score (if one is used), and for a response that hit response_length without a stop + non_stop_penalty
    (mode add) or the penalty alone (mode replace, Tulu 3's where(stopped, score, penalty); the recipe gives it signed:
    Tulu 3 uses -10); less DAPO's overlong punishment (estimators, losses and their math: rl_algorithms.py)."""
    rm = rm_scores.tolist() if rm_scores is not None else [None] * len(verifiable)
    scores = torch.tensor(
        [
            combine_rewards(v, s, cfg.non_stop_penalty, r, cfg.reward_model_multiplier, cfg.non_stop_penalty_mode)
            for v, s, r in zip(verifiable, out.stopped, rm)
        ]
    )
    if cfg.overlong_buffer_length:  # over the whole response (observations count against response_length)
        lengths = torch.tensor([float(len(r)) for r in out.response_ids])
        scores = scores + overlong_penalty(
            lengths, cfg.response_length, cfg.overlong_buffer_length, cfg.overlong_penalty_factor
        )
    return scores


# ALGO LOGIC: the advantages and the policy loss of the variants the config names: their rows' functions
# (rl_algorithms.py), each called with its narrow input and its keyword arguments.


def compute_advantages(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> Advantages:
    """The advantages of the estimator cfg names: its row's function (rl_algorithms.ADVANTAGE_ESTIMATORS) on the
    rollout's AdvantageInputs, with the run settings its row names and its algo_kwargs."""
    x = advantage_inputs(cfg, rollout, accelerator)
    estimator = ADVANTAGE_ESTIMATORS[cfg.advantage_estimator]
    settings = {name: getattr(cfg, name) for name in estimator.settings}
    return estimator.function(x, **settings, **chosen_kwargs(cfg, "advantage_estimator"))


def advantage_inputs(cfg: RLVRConfig, rollout: Rollout, accelerator: Any) -> AdvantageInputs:
    """What an estimator reads of the rollout and the config (the narrow input: docs/extending.md)."""
    return AdvantageInputs(
        scores=rollout.scores,
        mask=rollout.mask,
        group_size=cfg.num_samples_per_prompt,
        beta=cfg.beta,
        gamma=cfg.gamma,
        lam=cfg.lam,
        whiten_advantages=cfg.whiten_advantages,
        filter_zero_std_groups=cfg.filter_zero_std_groups,
        old_logp=rollout.old_logp,
        ref_logp=rollout.ref_logp,
        kl=rollout.kl,
        values=rollout.old_values,
        value_mask=rollout.value_mask,
        score_index=rollout.score_index,
        turn_rewards=rollout.turn_rewards,
        teacher_logp=rollout.teacher_logp,
        sum_over_ranks=lambda sums: global_sums(accelerator, sums),
    )


def token_policy_loss(
    cfg: RLVRConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token policy loss and clip indicator of cfg.policy_loss: its row's function on the LossInputs."""
    x = LossInputs(logp, old_logp, advantages, mask, cfg.cliprange_low, cfg.cliprange_high, cfg.dual_clip_c, entropy,
                   ref_logp)  # fmt: skip
    return POLICY_LOSSES[cfg.policy_loss].function(x, **chosen_kwargs(cfg, "policy_loss"))


# Aggregated like the loss (weights w, divided by the global units U): what each optimizer step saw.
TRAIN_STATS = ("policy_loss", "value_loss", "pg_clipfrac", "vf_clipfrac", "approx_kl", "entropy", "kl_loss")
# Plain sums over this rank's real tokens (and one maximum), for the rollout-level logs.
TOKEN_SUMS = ("tokens", "kl_sum", "sampler_abs_diff", "masked_tokens")
TOKEN_MAXES = ("sampler_ratio_max", "mismatch_abs_max")


def micro_batch_loss(
    cfg: RLVRConfig,
    models: RLModels,
    rollout: Rollout,
    adv: Advantages,
    rows: list[int],
    layout: EpisodeLayout,
    device: Any,
    autocast: Callable[[], Any],
    features: Optional[Sequence[Feature]] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum (divided by the global units U in `update`) of one micro-batch's loss, and its statistics
    (0-dim device tensors; a statistic the configuration does not compute is absent):

    loss = sum_t w_t * (keep_t * tis_t * pg_t  +  kl_loss_coef * KL_t  +  vf_coef * vf_t)

    w: aggregation_weights of the rows the update keeps; tis_t: truncated_is_weights (1 when off); keep_t:
    off_policy_mask (1 when no mask is set); plus the features' loss terms (`features`: those of cfg when None)."""
    features = features_of(cfg) if features is None else features
    _, batch, r = layout.batch(rollout.episodes, rollout.response_ids, rows, device)

    def take(x: torch.Tensor) -> torch.Tensor:  # this micro-batch's slice of a rollout tensor
        return data.host_to_device(x[rows, :r], device)

    mask = take(rollout.mask)  # the loss mask: real tokens, less an episode's observation tokens

    kept = mask * data.host_to_device(adv.keep[rows], device).unsqueeze(1)
    w, _ = aggregation_weights(kept, cfg.loss_aggregation, cfg.loss_norm_length)
    forward = next((f.policy_forward for f in features if f.policy_forward is not None), None)
    stats: dict[str, torch.Tensor] = {}  # 0-dim tensors on the device, read once per optimizer step (StepSums)
    with autocast():  # ALGO LOGIC: the loss terms
        if forward is not None:  # a feature's own forward of the policy (distillation's jsd keeps hidden states)
            scores, state = forward(cfg, models, batch)
        else:
            scores = response_scores(models.policy, batch, cfg.temperature, shared_group(cfg), entropy=True,
                                     truncation=sampling_truncation(cfg))  # fmt: skip
            state = None
        logp = scores.logp
        old_logp = logp.detach() if rollout.on_policy else take(rollout.old_logp)  # on-policy: these weights sampled
        ref_logp = take(rollout.ref_logp) if rollout.ref_logp is not None else None
        pg, pg_clipped = token_policy_loss(cfg, logp, old_logp, take(adv.advantages), mask, scores.entropy, ref_logp)
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
            kl = kl_penalty(logp, ref_logp, cfg.kl_estimator, **chosen_kwargs(cfg, "kl_estimator"))
            loss_sum = loss_sum + adv.kl_loss_coef * masked_sum(kl, w)
        if models.value is not None:
            values = token_values(models.value, batch, shared_group(cfg))
            vf, vf_clipped = clipped_value_loss(
                values, take(rollout.old_values), take(adv.returns), cfg.cliprange_value
            )
            # over the value mask (after_last_token: one position more per row), normalised like the other terms
            value_rows = take(rollout.value_mask) * data.host_to_device(adv.keep[rows], device).unsqueeze(1)
            w_value, _ = aggregation_weights(value_rows, cfg.loss_aggregation, cfg.loss_norm_length)
            loss_sum = loss_sum + cfg.vf_coef * masked_sum(vf, w_value)
        for f in (f for f in features if f.loss_term is not None):  # e.g. distillation's jsd term
            term, term_stats = call_timed(f, f.loss_term, cfg, models, batch, mask, w, state)
            loss_sum = loss_sum + term
            stats.update(term_stats)
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
        lags = None  # async: each policy token's version lag, in order (-1 after a row's last)
        if rollout.token_lags:
            lags = data.host_to_device(padded([rollout.token_lags[j] for j in rows], r, fill=-1).long(), device)
        stats.update(mismatch_token_sums(log_ratio, mask, cfg.tis_cap, lags, cfg.async_steps))  # mismatch/
    return loss_sum, stats


def skips_dropped_rows(cfg: RLVRConfig) -> bool:
    """Whether the update leaves out the rows of the groups filter_zero_std_groups dropped: they weigh 0 in every loss
    term, so their forwards and backwards change nothing (on-policy with a reference, the logged KL of the sampling
    policy, which those forwards give, then covers the rows trained on)."""
    return cfg.filter_zero_std_groups


def update(
    cfg: RLVRConfig,
    models: RLModels,
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    rollout: Rollout,
    adv: Advantages,
    plan: Any,
    run: runtime.RunContext,
    layout: EpisodeLayout,
    features: Optional[Sequence[Feature]] = None,
) -> dict[str, float]:
    """num_epochs passes over the rollout, each num_mini_batches optimizer steps on a shuffled order of whole groups
    (group estimators: required; gae: when they fit, so micro-batches can share prompt forwards). Each step's loss is
    sum(w * loss) / U over its global mini-batch (aggregation_weights). Returns the TRAIN_STATS summed over the
    steps (and the features' loss_stats), this rank's TOKEN_SUMS over the first epoch, and sampler_ratio_max."""
    features = features_of(cfg) if features is None else features
    loss_stats = (*TRAIN_STATS, *(name for f in features for name in f.loss_stats))
    accelerator, counters = run.accelerator, run.counters
    world, group, step = accelerator.num_processes, cfg.num_samples_per_prompt, run.counters.rollout_step
    unit = group if plan.local_mini_batch_size % group == 0 else 1
    counted = adv.keep if cfg.mask_truncated_completions else None  # a masked truncated row counts (TRL)
    kept = rollout.mask * adv.keep.unsqueeze(1)
    _, row_units = aggregation_weights(kept, cfg.loss_aggregation, cfg.loss_norm_length, counted)
    lengths = episode_lengths(rollout.episodes, rollout.response_ids)  # packing: micro-batches by tokens
    skip_dropped = skips_dropped_rows(cfg)
    if rollout.ref_scored is not None and bool((adv.keep & ~rollout.ref_scored).any()):
        raise RuntimeError(f"advantage_estimator {cfg.advantage_estimator!r} kept rows of flat groups under "
                           "filter_zero_std_groups: on-policy the rollout gave them no reference log-probs; drop them "
                           "in Advantages.keep, or set filter_zero_std_groups false")  # fmt: skip
    totals = dict.fromkeys((*loss_stats, "grad_norm", "value_grad_norm", "skipped", "empty", "optimizer_seconds"), 0.0)
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
            step_sums = StepSums(loss_stats, accelerator.device)  # read once per optimizer step
            trained = [j for j in mb_rows if adv.keep[j]] if skip_dropped else mb_rows
            spare = mb_rows[0] if skip_dropped else None  # a rank left with no rows runs it as a dummy
            micro_rows = step_micro_batches(accelerator, trained, [lengths[j] for j in trained], cfg, spare)
            for i, (rows, real) in enumerate(micro_rows):
                with grad_sync_all(accelerator, models.trained().values(), sync=i == len(micro_rows) - 1):
                    loss_sum, stats = micro_batch_loss(
                        cfg, models, rollout, adv, rows, layout, accelerator.device, accelerator.autocast, features
                    )
                    # sum(w * loss) / U over the global mini-batch; DDP/FSDP average gradients, hence x world. A dummy
                    # micro-batch (packing: this rank has fewer than another) counts 0.
                    accelerator.backward(loss_sum * (world / global_units if real else 0.0))
                if not real:
                    continue
                step_sums.add(stats)
                token_sums.add(stats if epoch == 0 else {k: stats[k] for k in TOKEN_MAXES})
            sums = global_sums(accelerator, step_sums.read())  # waits for the backward: the optimizer's clock starts
            t_optimizer = time.perf_counter()
            grad_norm = clip_grad_norm_(accelerator, models.policy, cfg.max_grad_norm)
            value_grad_norm = torch.tensor(0.0)
            if models.value is not None:
                value_grad_norm = clip_grad_norm_(accelerator, models.value, cfg.max_grad_norm)
            loss_terms = sums["policy_loss"] + cfg.vf_coef * sums["value_loss"] + adv.kl_loss_coef * sums["kl_loss"]
            step_ok = check_update_finite(
                run, loss_terms / global_units, grad_norm=grad_norm, value_grad_norm=value_grad_norm
            )
            for name in optimizers:
                if step_ok:
                    optimizers[name].step()
                schedulers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            totals["optimizer_seconds"] += time.perf_counter() - t_optimizer
            counters.optimizer_step += 1
            for k in loss_stats:
                totals[k] += sums[k] / global_units
            totals["grad_norm"] += float(grad_norm)
            totals["value_grad_norm"] += float(value_grad_norm)
            totals["skipped"] += int(not step_ok)
    return {**totals, **token_sums.read()}


def log_row(
    cfg: RLVRConfig,
    rollout: Rollout,
    adv: Advantages,
    train: dict[str, float],
    plan: Any,
    run: runtime.RunContext,
    features: Optional[Sequence[Feature]] = None,
) -> dict[str, Any]:
    """The rollout's metrics: episode statistics summed over ranks, and the update statistics averaged over the
    rollout's num_epochs x num_mini_batches optimizer steps (those that had data); then the features' metrics."""
    features = features_of(cfg) if features is None else features
    # On-policy, the KL of the sampling policy is the training forward's KL term (the weights had not moved yet), over
    # the rows that forward saw: every row, or the kept ones when the update skips the dropped groups.
    kl_sum = float(rollout.kl.sum()) if rollout.kl is not None else train["kl_sum"]
    kl_rows = int(adv.keep.sum()) if rollout.kl is None and skips_dropped_rows(cfg) else len(rollout.episodes)
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
            "kl_rows": float(kl_rows),
            "timeouts": float(rollout.verifier_timeouts),
            "rm": float(rollout.rm_scores.sum()),
            "dropped": float((~adv.keep).sum()),
            "tokens": train["tokens"],
            "sampler_abs_diff": train["sampler_abs_diff"],
            "lag": float(sum(rollout.policy_lag)),
            "masked_tokens": train["masked_tokens"],
            **{k: train[k] for k in mismatch_sum_keys(cfg.async_steps)},
            **version_lag_stats(rollout.token_lags, cfg.async_steps),
            **reward_function_sums(rollout.reward_function_values),
            **{k: v for f in features if f.rollout_sums is not None for k, v in f.rollout_sums(rollout).items()},
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
    if cfg.filter_zero_std_groups or ep["dropped"]:  # rows the estimator dropped from the update (Advantages.keep)
        row["train/filtered_fraction"] = ep["dropped"] / n
    if cfg.filter_zero_std_groups:  # groups whose completions all scored the same, dropped from the update
        row["train/filtered_groups_fraction"] = ep["dropped"] / n
        row["train/empty_updates"] = train["empty"]
        if ep["dropped"] == n and run.accelerator.is_main_process:  # a run stuck here spends its compute on nothing
            print(f"warning: rollout {run.counters.rollout_step}: every group's completions scored the same, so "
                  "filter_zero_std_groups dropped them all: no update from this rollout", flush=True)  # fmt: skip
    if rollout.ref_logp is not None:  # per sequence: the sum over its tokens of kl_estimator(sampling policy, ref)
        row["train/kl"] = ep["kl"] / max(ep["kl_rows"], 1.0)  # 0 when every group was dropped and none forwarded
    if "value" in run.models:
        row["loss/value"] = train["value_loss"] / updates
        row["clipfrac/value"] = train["vf_clipfrac"] / updates
        row["train/value_grad_norm"] = train["value_grad_norm"] / updates
    if not cfg.kl_in_reward:
        row["loss/kl"] = train["kl_loss"] / updates
    if cfg.reward_model_path:
        row["train/rm_score_mean"] = ep["rm"] / n
    for f in (f for f in features if f.metrics is not None):
        row.update(f.metrics(cfg, rollout, ep, train, updates, run.accelerator))
    return row


# ---------------------------------------------------------------------------------------------------------------------
# Set-up (plumbing: rollouts.py, generation_backends.py) and the loop


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(RLVRConfig, argv)  # every check that needs no model (the backend, the teacher) first
    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template
    )
    environments = environment_run(cfg, tokenizer)  # None: single-turn completions; else multi-turn episodes
    train, evals, plan, max_model_len = load_prompts(cfg, tokenizer, accelerator, environments)
    features = features_of(cfg, train, tokenizer)  # the optional features this run turns on, and where each acts
    check_before_loading(cfg, max_model_len)  # engines started apart answer and fit the run
    models, optimizers, schedulers = load_models(cfg, tokenizer, accelerator, plan)
    # the backend the config names (generation.py's contract): started or reached here, synced by the sampler
    generator = make_generator(cfg, models.policy, tokenizer, accelerator, max_model_len)
    # every sync under a deadline and checked (generation_check.py); None: it samples with the trainer's own module
    checker = make_checker(cfg, generator, models.policy, tokenizer, accelerator, max_model_len)
    started = start_reward_function_models(cfg, generator, accelerator)  # reward models on engines started now

    run = runtime.RunContext(
        cfg, accelerator, models.trained(), optimizers, schedulers, tokenizer, plan.num_training_steps, "rollout_step"
    )
    counters = run.counters
    stream = data.episode_stream(train, cfg)
    # One pass in one mini-batch trains on exactly the weights that sampled: the training forward gives the old
    # log-probs, no separate pass (unless the KL to the reference must go into the rewards before the update).
    on_policy = cfg.num_epochs == 1 and plan.num_mini_batches == 1 and not (cfg.kl_in_reward and cfg.beta > 0)
    on_policy = on_policy and not cfg.uses_teacher  # distill: the advantages need log pi_student before the update
    layout = episode_layout(cfg, tokenizer.pad_token_id)  # padded or packed rows, the score's value column

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
    clock = PhaseClock([f.clock for f in features if f.clock is not None])
    while counters.rollout_step < plan.num_training_steps:  # one rollout step: sample, score, advantages, update
        prompts, out, seconds, sync_bytes = sampler.take(counters.rollout_step)
        rollout = collect_rollout(
            cfg, models, prompts, out, seconds, counters.rollout_step, run, on_policy, layout, features
        )
        t0 = time.perf_counter()
        advantages = compute_advantages(cfg, rollout, accelerator)
        t1 = time.perf_counter()
        train_stats = update(cfg, models, optimizers, schedulers, rollout, advantages, plan, run, layout, features)
        rollout.seconds["inference"] += t1 - t0
        clocks = clock_seconds(features)  # the features' own time in the update (e.g. the teacher's forwards)
        rollout.seconds["training"] = time.perf_counter() - t1 - sum(clocks.values())
        rollout.seconds["optimizer"] = train_stats.pop("optimizer_seconds")  # a part of training (PhaseClock.PARTS)
        for name, seconds in clocks.items():
            rollout.seconds[name] += seconds

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
                    **log_row(cfg, rollout, advantages, train_stats, plan, run, features),
                    **clock.report(accelerator, plan.episodes_per_rollout),
                    "perf/train_tokens_per_second": trained * cfg.num_epochs / max(rollout.seconds["training"], 1e-9),
                    **(checker.last if checker is not None else {}),
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
    for model in started:  # the engines started for them
        model.close()


if __name__ == "__main__":
    runtime.run(main)
