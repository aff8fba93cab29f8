"""RL with verifiable rewards: PPO with a value model (default) or GRPO (`--algo grpo`). One loop, top to bottom.

    python open_instruct/rlvr_ppo.py configs/rlvr_tiny.yaml [--algo grpo] [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml

Each rollout step: take `rollout_batch_size` prompts (by prompt position, the same whatever the world size), sample
`num_samples_per_prompt` completions each with the generator, score them with the verifiers (plus a reward model and
the non-stop penalty when configured), compute log-probs of the policy and of the frozen reference policy (and values
for PPO), turn scores into advantages, then make `num_epochs` passes over the rollout in `num_mini_batches`
optimizer steps. Losses are token means over the *global* mini-batch, so 1 or N processes give the same update.

Per-token tensors of a rollout are *response-aligned*: column t is response token t of the row (prompt tokens are
not stored), and `mask` marks real tokens (right padding after the response's stop).

PPO (Tulu 3): reward_t = -beta * KL_t, plus the score at the last response token; GAE(gamma, lam) with a value model
(a scalar head on the backbone's hidden states, initialised from `value_model_path` or the policy); whitened
advantages; clipped policy and value losses.
GRPO: advantages are the group-normalised scores (r - mean_group) / (std_group + eps), no value model; the KL to the
reference is a loss term beta * KL_t (k3 typical). A prompt's group never spans two devices or two mini-batches.

Speed: completions of one prompt share its forward (the prompt runs once, its key/value cache is repeated for the
responses; single process); GRPO with one pass over one mini-batch reuses the training forward as the old log-probs.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file or a module

import torch
import torch.nn.functional as F

from open_instruct import runtime
from open_instruct.config import RLVRConfig

# ---------------------------------------------------------------------------------------------------------------------
# The math: pure functions of [batch, response_len] tensors (response-aligned, `mask` 1 on real tokens).


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all elements when None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all elements when None)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1) if dim is not None else masked_sum(x, mask) / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked elements: sum(mask * (x - mean)^2) / (n - 1), n = sum(mask)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    return masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, mean: Optional[torch.Tensor] = None, var: Optional[torch.Tensor] = None, eps: float = 1e-8
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


def episode_score(verifiable: float, stopped: bool, non_stop_penalty: float, rm_score: Optional[float], rm_multiplier: float) -> float:
    """score = verifiable reward + rm_multiplier * rm_score (if a reward model is used) + non_stop_penalty if the
    response hit response_length without a stop (the recipe gives the penalty signed: Tulu 3 uses -10)."""
    from open_instruct.rewards import combine_rewards

    return combine_rewards(verifiable, stopped, non_stop_penalty, rm_score, rm_multiplier)


# ---------------------------------------------------------------------------------------------------------------------
# Models and batches


class TokenValueModel(torch.nn.Module):
    """A value (or reward) model giving one scalar per token: a sequence classifier's backbone hidden states passed
    through its scalar head at every position (the classifier's own forward only pools the last token).

    Wrapping it in a module keeps DDP/FSDP gradient hooks on the call that computes values."""

    def __init__(self, seq_cls: Any) -> None:
        super().__init__()
        self.seq_cls = seq_cls
        self.config = seq_cls.config
        self._no_split_modules = getattr(seq_cls, "_no_split_modules", None)  # FSDP auto-wrap reads it
        if not isinstance(getattr(seq_cls, "score", None), torch.nn.Module):
            raise ValueError(f"{type(seq_cls).__name__} has no `score` head: cannot read per-token values from it")

    def forward(self, batch: dict[str, torch.Tensor], num_positions: int, group: int = 1) -> torch.Tensor:
        """Scalar outputs of the last `num_positions` (<= R+1) positions of a collate_episodes batch, float32
        [batch, num_positions]. group > 1: runs of `group` rows share their prompt (see shared_prompt_groups)."""
        backbone = getattr(self.seq_cls, self.seq_cls.base_model_prefix)
        parts = shared_prefix_forward(backbone, batch, group, feed_last=True) if group > 1 else None
        if parts is not None:
            first, rest = parts
            hidden = first.last_hidden_state[:, -1:].repeat_interleave(group, 0)
            if rest is not None:
                hidden = torch.cat([hidden, rest.last_hidden_state], 1)
        else:
            hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).last_hidden_state
        return self.seq_cls.score(hidden[:, -num_positions:]).squeeze(-1).float()


def collate_episodes(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts followed by right-padded responses, so every response starts at the same column and the
    logits of all response tokens are the last R+1 positions. Positions count real tokens only (as in generation).

    Returns input_ids/attention_mask/position_ids [B, P+R], responses [B, R] (pad 0) and mask [B, R]."""
    width_p, width_r = max(len(p) for p in prompts), max(len(r) for r in responses)
    n = len(prompts)
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, width_p - len(p) : width_p] = torch.as_tensor(list(p), dtype=torch.long)
        input_ids[i, width_p : width_p + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        attention_mask[i, width_p - len(p) : width_p + len(r)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    response_mask = attention_mask[:, width_p:].float()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, width_p:] * attention_mask[:, width_p:],
        "mask": response_mask,
    }


def shared_prompt_groups(model: Any, batch: dict[str, torch.Tensor], group: int) -> int:
    """`group` if the batch's rows come in runs of `group` identical (padded) prompts, so each prompt can be run once
    and its key/value cache reused by its `group` responses; else 1. With 8 samples per prompt this skips most of
    the tokens of every forward and backward. Single process only: DDP allows one forward per backward, and FSDP
    (which works) would then round differently from DDP, whose runs it is checked against bit for bit."""
    n, width = batch["input_ids"].shape
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if group <= 1 or n % group or distributed or isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 1
    prompts = batch["input_ids"][:, : width - batch["responses"].shape[1]].view(n // group, group, -1)
    return group if bool((prompts == prompts[:, :1]).all()) else 1


def shared_prefix_forward(module: Any, batch: dict[str, torch.Tensor], group: int, feed_last: bool) -> Optional[tuple[Any, Any]]:
    """Run each shared prompt once (rows 0, group, 2*group, ...) with a cache, repeat the cache `group` times and run
    the responses on it. Returns (prompt output, response output or None), or None when the module returns no cache
    (Hugging Face turns the cache off under activation checkpointing): callers then run the plain forward.
    feed_last: also feed the last response column (needed for hidden states, not for next-token logits)."""
    width = batch["input_ids"].shape[1]
    width_p = width - batch["responses"].shape[1]
    end = width if feed_last else width - 1
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    kwargs = {} if feed_last else {"logits_to_keep": 1}
    first = module(input_ids=ids[::group, :width_p], attention_mask=mask[::group, :width_p], position_ids=pos[::group, :width_p], use_cache=True, **kwargs)
    cache = getattr(first, "past_key_values", None)
    if cache is None:
        return None
    if end == width_p:
        return first, None
    cache.batch_repeat_interleave(group)
    rest = module(input_ids=ids[:, width_p:end], attention_mask=mask[:, :end], position_ids=pos[:, width_p:end], past_key_values=cache, use_cache=True)
    return first, rest


def response_logits(model: Any, batch: dict[str, torch.Tensor], temperature: float, group: int = 1) -> torch.Tensor:
    """Logits (divided by the sampling temperature) predicting each response token: [B, R, vocab].

    group > 1: rows may come in runs of `group` sharing a prompt, whose forward is then shared (same numbers)."""
    width_r = batch["responses"].shape[1]
    group = shared_prompt_groups(model, batch, group)
    parts = shared_prefix_forward(model, batch, group, feed_last=False) if group > 1 else None
    if parts is not None:
        first, rest = parts
        logits = first.logits[:, -1:].repeat_interleave(group, 0)
        if rest is not None:
            logits = torch.cat([logits, rest.logits], 1)
        logits = logits.float()
    else:
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
            logits_to_keep=width_r + 1,
        )
        logits = out.logits[:, :-1].float()
    return logits / temperature if temperature != 1.0 else logits


def token_values(value_model: Any, batch: dict[str, torch.Tensor], group: int = 1) -> torch.Tensor:
    """V(state before response token t) for every t: the scalar head at the position whose logits predict token t."""
    width_r = batch["responses"].shape[1]
    out = value_model(batch, width_r + 1, shared_prompt_groups(value_model, batch, group))
    return out[:, :-1]


def sequence_scores(reward_model: Any, batch: dict[str, torch.Tensor], group: int = 1) -> torch.Tensor:
    """Reward-model score of each prompt+response, read at the last response token."""
    width_r = batch["responses"].shape[1]
    out = reward_model(batch, width_r + 1, shared_prompt_groups(reward_model, batch, group))[:, 1:]
    return out.gather(1, last_token_indices(batch["mask"]).unsqueeze(1)).squeeze(1)


def derived_seed(seed: int, *parts: int) -> int:
    """A deterministic 63-bit seed from (seed, rollout_step, rank, ...): resuming at a rollout re-draws its samples."""
    return random.Random(":".join(str(p) for p in (seed, *parts))).getrandbits(63)


def check_verifiers(examples: list[dict], what: str) -> None:
    """Every row's verifier must exist and accept the row's ground truth, checked before any model loads.

    Ground truths are checked by scoring an empty completion (verifiers validate the ground truth first), except for
    `math`, whose check would start sympy for every row; a bad math ground truth is reported when first scored."""
    from open_instruct import rewards
    from open_instruct.data import DataError

    names: dict[str, str] = {}
    for ex in examples:
        try:
            if ex["verifier"] not in names:
                names[ex["verifier"]] = rewards.normalize_verifier_name(ex["verifier"])
            name = names[ex["verifier"]]
            if name != "math":
                rewards.VERIFIERS[name]("", ex["ground_truth"])
        except ValueError as e:  # unknown verifier, or GroundTruthError
            where = ex.get("where") or f"{what} row {ex['row']}"
            raise DataError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------------------------------
# The script


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(RLVRConfig, argv)

    from transformers import AutoConfig

    from open_instruct import data, rewards
    from open_instruct.checkpoint import BestTracker, restore_training_state, save_training_state
    from open_instruct.distributed import clip_grad_norm_, full_params, grad_sync, prepare_frozen
    from open_instruct.generation import GenerationConfig, make_generator
    from open_instruct.models import DTYPES, disable_dropout, load_causal_lm, load_sequence_classifier, load_tokenizer, make_optimizer_and_scheduler, token_logprobs
    from open_instruct.tracking import MetricsLogger
    from open_instruct.utils import ConfigError, Counters, should_log

    if cfg.generation_backend == "vllm":  # optional extra: a missing or unsupported vLLM fails before any model loads
        from open_instruct.vllm_generator import check_vllm_version

        try:
            check_vllm_version()
        except (ImportError, RuntimeError) as e:
            raise ConfigError(f"generation_backend vllm: {e}") from None

    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    is_grpo = cfg.algo == "grpo"
    log = print if accelerator.is_main_process else (lambda *a, **k: None)
    tokenizer = load_tokenizer(cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template)
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_prompts)
    check_verifiers(train, "train")
    check_verifiers(evals, "eval")
    plan = cfg.batch_plan(world, len(train))  # validated before any model loads
    if cfg.best_metric and not cfg.best_metric.startswith("eval/"):
        raise ConfigError(f"best_metric {cfg.best_metric!r}: RLVR eval metrics are eval/correct_rate, eval/score_mean, eval/response_length")
    model_config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code, gguf_file=cfg.gguf_file)
    max_positions = getattr(model_config, "max_position_embeddings", None)
    longest_prompt = max(len(e["prompt_ids"]) for e in train + evals)
    eval_length = cfg.eval_response_length or cfg.response_length
    if max_positions and longest_prompt + max(cfg.response_length, eval_length) > max_positions:
        raise ConfigError(
            f"longest prompt {longest_prompt} tokens + response_length {max(cfg.response_length, eval_length)} exceeds the "
            f"model's max_position_embeddings {max_positions}: lower max_prompt_length or response_length"
        )
    log(f"data: {stats.summary()}; {len(evals)} held-out prompts; world_size {world}; plan {plan.to_dict()}")

    # Models: trained policy (+ value model for PPO), frozen reference = the initial policy (+ optional reward model).
    dtype = DTYPES["no"]
    policy = load_causal_lm(cfg.model_name_or_path, dtype, cfg.gguf_file, cfg.trust_remote_code, cfg.model_revision)
    disable_dropout(policy)
    ref_policy = None  # beta 0: no KL term anywhere, so the reference is never needed
    if cfg.beta > 0:
        ref_policy = load_causal_lm(cfg.model_name_or_path, dtype, cfg.gguf_file, cfg.trust_remote_code, cfg.model_revision)
        disable_dropout(ref_policy)
    value_model = None
    if not is_grpo:
        torch.manual_seed(cfg.seed)  # a fresh scalar head (value model from the policy) is initialised the same way every run
        value_path = cfg.value_model_path or cfg.model_name_or_path
        value_model = TokenValueModel(load_sequence_classifier(
            value_path, dtype, None if cfg.value_model_path else cfg.gguf_file, cfg.trust_remote_code,
            pad_token_id=tokenizer.pad_token_id,
        ))
        disable_dropout(value_model.seq_cls)
    reward_model = None
    if cfg.reward_model_path:
        reward_model = TokenValueModel(load_sequence_classifier(cfg.reward_model_path, dtype, trust_remote_code=cfg.trust_remote_code, pad_token_id=tokenizer.pad_token_id))
    if cfg.activation_checkpointing:
        policy.gradient_checkpointing_enable()
        if value_model is not None:
            value_model.seq_cls.gradient_checkpointing_enable()

    optimizer, scheduler = make_optimizer_and_scheduler(policy, cfg, plan.optimizer_steps)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    models, optimizers, schedulers = {"policy": policy}, {"policy": optimizer}, {"policy": scheduler}
    if value_model is not None:
        v_optimizer, v_scheduler = make_optimizer_and_scheduler(value_model, cfg, plan.optimizer_steps)
        value_model, v_optimizer = accelerator.prepare(value_model, v_optimizer)
        models["value"], optimizers["value"], schedulers["value"] = value_model, v_optimizer, v_scheduler
    if ref_policy is not None:
        ref_policy = prepare_frozen(accelerator, ref_policy)
    if reward_model is not None:
        reward_model = prepare_frozen(accelerator, reward_model)
    gen_kwargs: dict[str, Any] = {"batch_size": plan.local_rollout_batch_size * cfg.num_samples_per_prompt}
    if cfg.generation_backend == "vllm":  # one colocated engine per rank for rollouts and evals (optional extra)
        gen_kwargs.update(
            max_model_len=longest_prompt + max(cfg.response_length, eval_length), dtype=DTYPES[cfg.mixed_precision],
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep=cfg.vllm_enable_sleep, seed=cfg.seed,
        )
    generator = make_generator(cfg.generation_backend, accelerator.unwrap_model(policy), tokenizer, **gen_kwargs)
    # HF generates with the live (FSDP-gathered) policy; vLLM holds its own copy, synced by sync_weights.
    gather_for_generation = full_params if cfg.generation_backend == "hf" else (lambda m: contextlib.nullcontext())

    counters = Counters()
    state = restore_training_state(cfg, accelerator, models, optimizers, schedulers, counters, log)
    best = BestTracker(cfg, state)
    logger = MetricsLogger(cfg, accelerator.is_main_process, plan.num_training_steps, "rollout_step", counters.rollout_step if state else None)
    stream = data.EpisodeStream(len(train), cfg.seed)
    preemption = runtime.Preemption()
    pad_id = tokenizer.pad_token_id
    device = accelerator.device
    group = cfg.num_samples_per_prompt
    # GRPO with one pass in one mini-batch trains on exactly the weights that sampled: skip a separate old-log-prob pass.
    on_policy = is_grpo and cfg.num_epochs == 1 and plan.num_mini_batches == 1
    sample_config = dict(max_new_tokens=cfg.response_length, temperature=cfg.temperature, top_p=cfg.top_p, stop_strings=cfg.stop_strings)

    def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in batch.items()}

    def verify(texts: list[str], examples: list[dict]) -> Any:
        return rewards.score_batch(
            texts, [e["ground_truth"] for e in examples], [e["verifier"] for e in examples],
            verification_reward=cfg.verification_reward, timeout=cfg.verifier_timeout,
        )

    def evaluate() -> dict[str, float]:
        """Greedy verifiable accuracy on the held-out prompts (each evaluated once across ranks)."""
        local = data.shard_for_eval(evals, rank, world)
        sums = {"correct": 0.0, "score": 0.0, "length": 0.0, "non_stop": 0.0, "n": 0.0}
        if cfg.generation_backend == "vllm":
            generator.sync_weights(accelerator.unwrap_model(policy))  # collective under FSDP: every rank, before `if local`
        out = None
        with gather_for_generation(policy):  # collective under FSDP: every rank joins, even one without prompts
            if local:
                gen = generator if cfg.generation_backend == "vllm" else make_generator("hf", accelerator.unwrap_model(policy), tokenizer, batch_size=cfg.per_device_eval_batch_size)
                out = gen.generate([e["prompt_ids"] for e in local], GenerationConfig(max_new_tokens=eval_length, temperature=0.0, stop_strings=cfg.stop_strings))
        if out is not None:
            scored = verify(out.texts, local)
            sums = {
                "correct": float(sum(scored.correct)),
                "score": float(sum(scored.rewards)),
                "length": float(sum(len(r) for r in out.response_ids)),
                "non_stop": float(sum(not s for s in out.stopped)),
                "n": float(len(local)),
            }
        t = runtime.global_sums(accelerator, sums)
        n = max(t["n"], 1.0)
        return {"eval/correct_rate": t["correct"] / n, "eval/score_mean": t["score"] / n, "eval/response_length": t["length"] / n, "eval/non_stop_rate": t["non_stop"] / n}

    def checkpoint() -> None:
        save_training_state(cfg, accelerator, models, optimizers, schedulers, counters, tokenizer, best.state())

    if evals and cfg.eval_steps and state is None:  # the starting point: a baseline row at rollout_step 0
        metrics = evaluate()
        logger.log({**counters.as_log(), **metrics})
        best.update(metrics, policy, tokenizer, accelerator, counters)

    policy.train()
    if value_model is not None:
        value_model.train()
    interval = {"weight_sync": 0.0, "generation": 0.0, "scoring": 0.0, "inference": 0.0, "training": 0.0, "rollouts": 0, "tokens": 0}
    while counters.rollout_step < plan.num_training_steps:
        step = counters.rollout_step
        # 1. Prompts: a slice of the global prompt order, by prompt position (world-size independent).
        global_idx = stream.take(step * plan.rollout_batch_size, plan.rollout_batch_size)
        prompts = [train[i] for i in stream.local_slice(global_idx, rank, world)]

        # 2. Sample. Rows come prompt by prompt, `group` contiguous completions each (a GRPO group).
        t_sync = time.perf_counter()
        generator.sync_weights(accelerator.unwrap_model(policy))  # vLLM: load the weights of the last optimizer steps
        t0 = time.perf_counter()
        with gather_for_generation(policy):
            out = generator.generate([p["prompt_ids"] for p in prompts], GenerationConfig(n=group, seed=derived_seed(cfg.seed, step, rank), **sample_config))
        episodes = [prompts[i] for i in out.prompt_index]
        t1 = time.perf_counter()

        # 3. Scores: verifiers (+ reward model) (+ non-stop penalty).
        scored = verify(out.texts, episodes)
        t2 = time.perf_counter()

        # 4. Log-probs of the sampling policy and the reference, values, reward-model scores: no gradients.
        n_local = len(episodes)
        width_r = max(len(r) for r in out.response_ids)
        old_logp, ref_logp, old_values = (torch.zeros(n_local, width_r) for _ in range(3))
        mask = torch.zeros(n_local, width_r)
        rm_scores = torch.zeros(n_local)
        micro = cfg.per_device_train_batch_size
        with torch.no_grad():
            for s in range(0, n_local, micro):
                rows = slice(s, s + micro)
                batch = on_device(collate_episodes([e["prompt_ids"] for e in episodes[rows]], out.response_ids[rows], pad_id))
                r = batch["responses"].shape[1]
                with accelerator.autocast():
                    if not on_policy:
                        old_logp[rows, :r] = token_logprobs(response_logits(policy, batch, cfg.temperature, group), batch["responses"]).cpu()
                    if ref_policy is not None:
                        ref_logp[rows, :r] = token_logprobs(response_logits(ref_policy, batch, cfg.temperature, group), batch["responses"]).cpu()
                    if value_model is not None:
                        old_values[rows, :r] = token_values(value_model, batch, group).cpu()
                    if reward_model is not None:
                        rm_scores[rows] = sequence_scores(reward_model, batch, group).cpu()
                mask[rows, :r] = batch["mask"].cpu()
        old_logp, ref_logp, old_values = old_logp * mask, ref_logp * mask, old_values * mask
        scores = torch.tensor([
            episode_score(v, s, cfg.non_stop_penalty, float(rm) if reward_model is not None else None, cfg.reward_model_multiplier)
            for v, s, rm in zip(scored.rewards, out.stopped, rm_scores.tolist())
        ])

        # 5. Advantages.
        if is_grpo:
            advantages = group_advantages(scores, group).unsqueeze(1) * mask
            returns = torch.zeros_like(advantages)
        else:
            kl = kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask if ref_policy is not None else torch.zeros_like(mask)
            rewards_t = per_token_rewards(scores, kl, mask, cfg.beta)
            advantages, returns = gae_advantages(rewards_t, old_values, mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:  # with statistics over every rank's tokens
                m = runtime.global_sums(accelerator, {"s": float(masked_sum(advantages, mask)), "ss": float(masked_sum(advantages**2, mask)), "n": float(mask.sum())})
                mean = m["s"] / m["n"]
                var = (m["ss"] - m["n"] * mean**2) / max(m["n"] - 1, 1)
                advantages = masked_whiten(advantages, mask, torch.tensor(mean), torch.tensor(var))
        t3 = time.perf_counter()

        # 6. num_epochs passes x num_mini_batches optimizer steps, on a shuffled order.
        # Whole groups (GRPO: required; PPO: when they fit) keep micro-batches able to share prompt forwards.
        unit = group if plan.local_mini_batch_size % group == 0 else 1
        train_sums = {k: 0.0 for k in ("policy_loss", "value_loss", "pg_clipfrac", "vf_clipfrac", "approx_kl", "entropy", "kl_loss", "tokens", "grad_norm", "value_grad_norm", "skipped")}
        for ppo_epoch in range(cfg.num_epochs):
            units = list(range(n_local // unit))
            random.Random(derived_seed(cfg.seed, step, rank, ppo_epoch)).shuffle(units)
            order = [u * unit + j for u in units for j in range(unit)]
            for mb in range(plan.num_mini_batches):
                mb_rows = order[mb * plan.local_mini_batch_size : (mb + 1) * plan.local_mini_batch_size]
                global_tokens = runtime.global_sum(accelerator, float(mask[mb_rows].sum()))
                sums = dict.fromkeys(train_sums, 0.0)
                micro_rows = list(data.micro_batches(mb_rows, micro))
                for i, rows in enumerate(micro_rows):
                    batch = on_device(collate_episodes([episodes[j]["prompt_ids"] for j in rows], [out.response_ids[j] for j in rows], pad_id))
                    r = batch["responses"].shape[1]
                    m_ = batch["mask"]
                    take = lambda x: x[rows, :r].to(device)  # noqa: E731 - this micro-batch's slice of a rollout tensor
                    sync = i == len(micro_rows) - 1
                    with contextlib.ExitStack() as stack:
                        for model in models.values():
                            stack.enter_context(grad_sync(accelerator, model, sync))
                        with accelerator.autocast():
                            logits = response_logits(policy, batch, cfg.temperature, group)
                            logp = token_logprobs(logits, batch["responses"])
                            if on_policy:  # the weights have not moved since sampling: the old log-probs are these
                                old_logp[rows, :r] = logp.detach().cpu() * m_.cpu()
                            pg, pg_clipped = clipped_policy_loss(logp, take(old_logp), take(advantages), cfg.cliprange)
                            loss_sum = masked_sum(pg, m_)
                            if is_grpo and cfg.beta > 0:
                                kl_term = kl_penalty(logp, take(ref_logp), cfg.kl_estimator)
                                loss_sum = loss_sum + cfg.beta * masked_sum(kl_term, m_)
                            if value_model is not None:
                                vf, vf_clipped = clipped_value_loss(token_values(value_model, batch, group), take(old_values), take(returns), cfg.cliprange_value)
                                loss_sum = loss_sum + cfg.vf_coef * masked_sum(vf, m_)
                        # Token mean over the global mini-batch; DDP/FSDP average gradients over ranks, hence x world.
                        accelerator.backward(loss_sum * world / global_tokens)
                    with torch.no_grad():
                        if is_grpo and cfg.beta > 0:
                            sums["kl_loss"] += float(masked_sum(kl_term.detach(), m_))
                        if value_model is not None:
                            sums["value_loss"] += float(masked_sum(vf.detach(), m_))
                            sums["vf_clipfrac"] += float(masked_sum(vf_clipped, m_))
                        sums["policy_loss"] += float(masked_sum(pg.detach(), m_))
                        sums["pg_clipfrac"] += float(masked_sum(pg_clipped, m_))
                        sums["approx_kl"] += float(masked_sum(approx_kl(logp.detach(), take(old_logp)), m_))
                        sums["entropy"] += float(masked_sum(entropy_from_logits(logits.detach()), m_))
                    del logits
                sums = runtime.global_sums(accelerator, sums)
                grad_norm = clip_grad_norm_(accelerator, policy, cfg.max_grad_norm)
                value_grad_norm = clip_grad_norm_(accelerator, value_model, cfg.max_grad_norm) if value_model is not None else torch.tensor(0.0)
                loss = (sums["policy_loss"] + cfg.vf_coef * sums["value_loss"] + cfg.beta * sums["kl_loss"]) / global_tokens
                step_ok = runtime.is_finite(accelerator, loss, grad_norm, value_grad_norm)
                if not step_ok:
                    runtime.handle_nonfinite(cfg, counters.optimizer_step + 1, f"loss/gradient (loss={loss}, grad_norm={float(grad_norm)}, value_grad_norm={float(value_grad_norm)})", logger.write)
                for name in models:
                    if step_ok:
                        optimizers[name].step()
                    schedulers[name].step()
                    optimizers[name].zero_grad(set_to_none=True)
                counters.optimizer_step += 1
                for k in ("policy_loss", "value_loss", "pg_clipfrac", "vf_clipfrac", "approx_kl", "entropy", "kl_loss"):
                    train_sums[k] += sums[k] / global_tokens
                train_sums["grad_norm"] += float(grad_norm)
                train_sums["value_grad_norm"] += float(value_grad_norm)
                train_sums["skipped"] += int(not step_ok)
        if is_grpo:  # KL to the reference, for the logs only
            kl = kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask if ref_policy is not None else torch.zeros_like(mask)
        t4 = time.perf_counter()

        # 7. Counters, logs, eval, checkpoint.
        counters.rollout_step += 1
        counters.episode += plan.episodes_per_rollout
        counters.epoch = counters.rollout_step * plan.rollout_batch_size / len(train)
        logger.advance()
        for k, dt in (("weight_sync", t0 - t_sync), ("generation", t1 - t0), ("scoring", t2 - t1), ("inference", t3 - t2), ("training", t4 - t3)):
            interval[k] += dt
        interval["rollouts"] += 1
        interval["tokens"] += int(mask.sum())

        if should_log(counters.rollout_step, cfg.logging_steps):
            lengths = mask.sum(1)
            ep = runtime.global_sums(accelerator, {
                "n": n_local, "score": float(scores.sum()), "score_sq": float((scores**2).sum()),
                "correct": float(sum(scored.correct)), "non_stop": float(sum(not s for s in out.stopped)),
                "length": float(lengths.sum()), "kl": float(kl.sum()), "timeouts": float(scored.num_timeouts),
                "rm": float(rm_scores.sum()),
            })
            n = ep["n"]
            score_mean = ep["score"] / n
            updates = cfg.num_epochs * plan.num_mini_batches
            row = {
                **counters.as_log(),
                "train/correct_rate": ep["correct"] / n,
                "train/score_mean": score_mean,
                "train/score_std": max(ep["score_sq"] / n - score_mean**2, 0.0) ** 0.5,
                "train/non_stop_rate": ep["non_stop"] / n,
                "train/response_length": ep["length"] / n,
                **({"train/kl": ep["kl"] / n} if ref_policy is not None else {}),  # per sequence: sum over tokens of kl_estimator(rollout policy, ref)
                "train/entropy": train_sums["entropy"] / updates,
                "train/approx_kl": train_sums["approx_kl"] / updates,
                "train/verifier_timeouts": ep["timeouts"],
                "loss/policy": train_sums["policy_loss"] / updates,
                "clipfrac/policy": train_sums["pg_clipfrac"] / updates,
                "train/grad_norm": train_sums["grad_norm"] / updates,
                "train/skipped_updates": train_sums["skipped"],
                "lr": schedulers["policy"].get_last_lr()[0],
            }
            if value_model is not None:
                row.update({
                    "loss/value": train_sums["value_loss"] / updates,
                    "clipfrac/value": train_sums["vf_clipfrac"] / updates,
                    "train/value_grad_norm": train_sums["value_grad_norm"] / updates,
                })
            if is_grpo:
                row["loss/kl"] = train_sums["kl_loss"] / updates
            if reward_model is not None:
                row["train/rm_score_mean"] = ep["rm"] / n
            # Rates over the rollouts since the last row, eval and checkpoint time excluded (rank 0's clock).
            k, tokens = max(interval.pop("rollouts"), 1), runtime.global_sum(accelerator, interval.pop("tokens"))
            busy = max(sum(interval.values()), 1e-9)
            row.update({f"time/{name}": v / k for name, v in interval.items()})
            row["perf/episodes_per_second"] = k * plan.episodes_per_rollout / busy
            row["perf/response_tokens_per_second"] = tokens / busy
            interval = {"weight_sync": 0.0, "generation": 0.0, "scoring": 0.0, "inference": 0.0, "training": 0.0, "rollouts": 0, "tokens": 0}
            logger.log(row)
            if cfg.num_samples_logged and accelerator.is_main_process:
                logger.log_samples([
                    {"prompt": tokenizer.decode(episodes[j]["prompt_ids"]), "response": out.texts[j], "score": float(scores[j]),
                     "ground_truth": str(episodes[j]["ground_truth"]), "stopped": bool(out.stopped[j])}
                    for j in range(min(cfg.num_samples_logged, n_local))
                ], counters.as_log())
        if runtime.step_boundary(cfg, counters.rollout_step, plan.num_training_steps, "rollout step", evaluate if evals else None, checkpoint,
                                 accelerator, counters, logger, best, policy, tokenizer, preemption):
            logger.close()
            return

    runtime.finish(cfg, policy, tokenizer, accelerator, counters, logger)


if __name__ == "__main__":
    runtime.run(main)
