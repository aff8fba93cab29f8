"""Direct preference optimisation (DPO and its common variants): one loop, read top to bottom.

    python open_instruct/dpo.py configs/dpo_tiny.yaml [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml open_instruct/dpo.py configs/dpo_8b.yaml

Each pair's chosen and rejected responses go through the policy in one concatenated forward; log-probs are summed
over response tokens only (prompt and padding masked). `--loss_type` picks the loss (formulas in the docstrings of
the loss functions below): dpo, dpo_norm (Tulu 3), ipo, simpo (reference-free), wpo; `label_smoothing` gives
conservative DPO. The loss is the mean over the pairs of the global mini-batch, whatever the split into devices
and micro-batches.

Reference log-probs come from one no-grad pass of the initial policy before training, cached on disk under a hash
of the model, the tokenized data and the precision (`reference_cache.py`; a rerun with the same settings reuses the
file). The reference model is never held in memory during training. simpo needs no reference and skips the pass.

Logged per optimizer step (means over the pairs of the global mini-batch), and with the eval/ prefix on the held-out
set (at step 0, then every eval_steps): train/loss; train/rewards/chosen, rejected, margin (beta times what the loss
compares, see preference_loss); train/rewards/accuracy (chosen reward above rejected, a tie counting half: 0.5 at
step 0 where policy == reference); train/logps/chosen, rejected (summed response log-probs of the policy); lr,
perf/tokens_per_second, perf/pairs_per_second, and the four counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from open_instruct import console, distributed, runtime
from open_instruct.config import DPO_STATS, DPOConfig

if TYPE_CHECKING:  # torch is imported inside functions so a bad config exits before the slow import
    import torch

    from open_instruct.models import PairLogps

REFERENCE_FREE = ("simpo",)
STAT_KEYS = DPO_STATS  # summed per pair; logged as train/ and eval/ means


# ---------------------------------------------------------------------------------------------------------------------
# Losses: pure functions of per-pair tensors. "logratio" = log pi(y|x) - log pi_ref(y|x); each returns one loss per
# pair.


def dpo_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Sigmoid DPO (Rafailov et al. 2023), with conservative-DPO label smoothing eps (Mitchell 2023):

        h    = chosen_logratio - rejected_logratio
        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    eps is the assumed probability that a pair's label is flipped (0 gives plain DPO)."""
    import torch.nn.functional as F

    h = beta * (chosen_logratios - rejected_logratios)
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def ipo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17), beta playing the paper's tau:

        loss = (chosen_logratio - rejected_logratio - 1 / (2 * beta))^2

    The script feeds it per-token mean log-ratios, so the target margin does not scale with response length (TRL's
    reading of the paper, which its authors report the IPO authors confirmed)."""
    return (chosen_logratios - rejected_logratios - 1 / (2 * beta)) ** 2


def simpo_loss(
    chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float, gamma_beta_ratio: float
) -> torch.Tensor:
    """SimPO (Meng et al. 2024): reference-free, on per-token mean log-probs, with target margin gamma:

    loss = -log sigmoid(beta * (chosen_avg_logp - rejected_avg_logp) - gamma),   gamma = gamma_beta_ratio * beta"""
    import torch.nn.functional as F

    return -F.logsigmoid(beta * (chosen_avg_logps - rejected_avg_logps) - gamma_beta_ratio * beta)


def wpo_weights(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor) -> torch.Tensor:
    """WPO pair weights (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization",
    arXiv:2406.11827):

        w = exp(chosen_avg_logp + rejected_avg_logp)      (detached; in (0, 1])

    the product of the policy's length-normalised probabilities of the two responses, so pairs the current policy
    is likely to produce weigh more (off-policy data is re-weighted towards on-policy). The paper's optional "weight
    alignment" (dividing each token probability by sum_v p(v)^2) is not applied."""
    return (chosen_avg_logps + rejected_avg_logps).exp().detach()


def preference_loss(
    cfg: DPOConfig, policy: PairLogps, ref: Optional[PairLogps]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) for cfg.loss_type.

    A reward is beta times what the loss compares: the log-ratio (summed for dpo/wpo, per-token mean for dpo_norm
    and ipo) or, for simpo, the per-token mean log-prob."""
    if cfg.loss_type == "simpo":
        chosen, rejected = policy.averages()
        return (
            simpo_loss(chosen, rejected, cfg.beta, cfg.gamma_beta_ratio),
            cfg.beta * chosen.detach(),
            cfg.beta * rejected.detach(),
        )
    assert ref is not None
    if cfg.loss_type in ("dpo_norm", "ipo"):
        (pc, pr), (rc, rr) = policy.averages(), ref.averages()
        chosen, rejected = pc - rc, pr - rr
    else:
        chosen, rejected = policy.chosen - ref.chosen, policy.rejected - ref.rejected
    if cfg.loss_type == "ipo":
        losses = ipo_loss(chosen, rejected, cfg.beta)
    else:
        losses = dpo_loss(chosen, rejected, cfg.beta, cfg.label_smoothing)
        if cfg.loss_type == "wpo":
            losses = losses * wpo_weights(*policy.averages())
    return losses, cfg.beta * chosen.detach(), cfg.beta * rejected.detach()


def pair_stat_sums(
    losses: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy: PairLogps,
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sums over pairs of the logged statistics, in STAT_KEYS order, as one float32 vector on the batch's device (the
    step adds it up there and reads it once: no host sync per micro-batch); divided by the global pair count after
    the all-reduce. With `keep` (a 0/1 weight per pair), over the kept pairs only (per-source eval).

    Accuracy counts a tie as half a win: before the first update the policy equals the reference, every reward is
    0 and the accuracy is 0.5 (chance), not 0."""
    import torch

    wins = (chosen_rewards > rejected_rewards).float() + 0.5 * (chosen_rewards == rejected_rewards).float()
    values = [
        losses.detach(),
        chosen_rewards,
        rejected_rewards,
        chosen_rewards - rejected_rewards,
        wins,
        policy.chosen.detach(),
        policy.rejected.detach(),
    ]
    weights = [v.float() if keep is None else v.float() * keep for v in values]
    return torch.stack([w.sum() for w in weights])


# ---------------------------------------------------------------------------------------------------------------------


def evaluate(
    cfg: DPOConfig, model: Any, evals: list[dict], ref_table: Optional[dict], accelerator: Any, pad_id: int
) -> dict[str, float]:
    """Held-out statistics (eval/loss, rewards, accuracy, log-probs), means over the pairs. The batches are the
    reference pass's, so at step 0 the policy reproduces the cached numbers bit for bit."""
    import torch

    from open_instruct import data
    from open_instruct.models import pair_logps
    from open_instruct.reference_cache import reference_batches, reference_logps

    rank, world = accelerator.process_index, accelerator.num_processes
    sources = data.mixed_sources(evals)
    sums = distributed.zero_sums_by_source(sources, (*STAT_KEYS, "pairs"))
    model.eval()
    with torch.no_grad():
        # Same number of forwards on every rank (FSDP forwards are collective); padding batches are not counted.
        mine = reference_batches(evals, cfg.per_device_eval_batch_size, cfg.max_tokens_per_micro_batch, rank, world)
        for group, real in mine:
            batch = data.collate_preferences([evals[i] for i in group], pad_id, cfg.packing)
            with accelerator.autocast():
                policy = pair_logps(model, data.to_device(batch, accelerator.device))
            if not real:
                continue
            ref = reference_logps(ref_table, group, accelerator.device) if ref_table else None
            stats = preference_loss(cfg, policy, ref)
            for name in ["", *sources]:
                keep = torch.tensor(
                    [float(not name or evals[i]["source"] == name) for i in group], device=policy.chosen.device
                )
                for k, v in zip(STAT_KEYS, pair_stat_sums(*stats, policy, keep if name else None).tolist()):
                    sums[name][k] += v
                sums[name]["pairs"] += float(keep.sum())
    model.train()
    out = {}
    for name, t in distributed.global_sums_by_source(accelerator, sums).items():
        prefix = f"eval/{name}/" if name else "eval/"
        out.update({f"{prefix}{k}": t[k] / max(t["pairs"], 1.0) for k in STAT_KEYS})
    return out


def backward_step(
    cfg: DPOConfig,
    accelerator: Any,
    model: Any,
    train: list[dict],
    groups: list[tuple[list[int], bool]],
    ref: Optional[dict[str, Any]],
    run: runtime.RunContext,
    mini_batch_size: int,
) -> dict[str, float]:
    """One optimizer step's forward and backward passes over this rank's micro-batches (`groups`: pair indices, and
    whether the micro-batch is real or a packing dummy); returns the step's train/ statistics, means over the global
    mini-batch (summed on the device, read once)."""
    from open_instruct import data
    from open_instruct.models import pair_logps, with_scored_index
    from open_instruct.reference_cache import reference_logps

    pad_id = run.tokenizer.pad_token_id
    sums = distributed.StepSums(STAT_KEYS, accelerator.device)  # read once, after the micro-batches (no per-batch sync)
    for i, (group, real) in enumerate(groups):
        batch = data.collate_preferences([train[j] for j in group], pad_id, cfg.packing)
        if real:  # counted on the CPU batch: no device sync
            run.throughput.add(data.batch_tokens(batch), len(group))
        # scored positions found on the host: no host sync per micro-batch
        batch = data.to_device(with_scored_index(batch), accelerator.device)
        sync = i == len(groups) - 1
        with distributed.grad_sync(accelerator, model, sync):  # DDP: all-reduce on the last micro-batch only
            with accelerator.autocast():
                policy = pair_logps(model, batch)
            losses, chosen_r, rejected_r = preference_loss(
                cfg, policy, reference_logps(ref["train"], group, accelerator.device) if ref else None
            )
            # The mean over the global mini-batch; DDP/FSDP average gradients over ranks, hence x world. A dummy
            # micro-batch (packing: this rank has fewer than another) counts 0.
            accelerator.backward(losses.sum() * (accelerator.num_processes / mini_batch_size if real else 0.0))
        if real:
            sums.add_vector(pair_stat_sums(losses, chosen_r, rejected_r, policy))
    return {f"train/{k}": v / mini_batch_size for k, v in distributed.global_sums(accelerator, sums.read()).items()}


def warn_if_reference_stale(cfg: DPOConfig, metrics: dict[str, float], run: runtime.RunContext) -> None:
    """At step 0 the policy is the reference: the same batches as the cached pass give rewards of exactly 0."""
    drift = (abs(metrics["eval/rewards/chosen"]) + abs(metrics["eval/rewards/rejected"])) / cfg.beta
    if drift > 1e-3:
        run.logger.write(
            "WARNING: at step 0 the policy's log-probs differ from the cached reference (|mean chosen log-ratio| "
            f"+ |mean rejected log-ratio| = {drift:.3g}); is the cache stale?"
        )


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(DPOConfig, argv)  # best_metric is checked there against DPOConfig.eval_metrics

    from open_instruct import data, reference_cache
    from open_instruct.batch_math import should_log
    from open_instruct.lora import adapter_disabled, apply_lora
    from open_instruct.models import disable_dropout, load_policy, load_tokenizer, make_optimizer_and_scheduler

    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template
    )
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_preferences)
    plan = cfg.batch_plan(world, len(train))  # validated before the model loads
    if not cfg.eval_steps:
        evals = []  # never evaluated: no reference pass over it either
    if accelerator.is_main_process:
        print(console.startup_summary(cfg, plan, stats.summary(), len(evals)), flush=True)

    model = load_policy(cfg)
    disable_dropout(model)
    use_reference = cfg.loss_type not in REFERENCE_FREE
    identity = reference_cache.shared_identity(cfg, model, train, evals, accelerator) if use_reference else None
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model = apply_lora(model, cfg, "CAUSAL_LM", dropout=False)  # use_lora: adapters only are trained
    optimizer, scheduler = make_optimizer_and_scheduler(model, cfg, plan.optimizer_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    log = print if accelerator.is_main_process else (lambda *a, **k: None)

    # The reference pass runs on the initial weights, so it comes before any checkpoint is restored.
    ref = None
    if use_reference:
        with adapter_disabled(model):  # LoRA: the reference is the adapter-disabled policy (= the initial weights)
            ref = reference_cache.reference_tables(
                cfg, model, train, evals, identity, accelerator, tokenizer.pad_token_id, log
            )

    run = runtime.RunContext.for_model(cfg, accelerator, model, optimizer, scheduler, tokenizer, plan.optimizer_steps)
    counters = run.counters
    stream = data.episode_stream(train, cfg)

    def evaluate_policy() -> dict[str, float]:
        return evaluate(cfg, model, evals, ref["eval"] if ref else None, accelerator, tokenizer.pad_token_id)

    if evals and cfg.eval_steps and not run.resumed:  # the starting point: a baseline row at optimizer_step 0
        metrics = evaluate_policy()
        run.log(metrics)
        if ref is not None:
            warn_if_reference_stale(cfg, metrics, run)
    run.throughput.restart()  # the baseline eval is not training time
    model.train()
    while counters.optimizer_step < plan.optimizer_steps:
        # This step's pairs: a slice of the global order, by episode position (world-size independent).
        local_idx = data.EpisodeStream.local_slice(stream.take(counters.episode, plan.mini_batch_size), rank, world)
        lengths = [data.packed_length(train[j]) for j in local_idx]  # packing: micro-batches by tokens
        groups = distributed.step_micro_batches(accelerator, local_idx, lengths, cfg)

        stats_step = backward_step(cfg, accelerator, model, train, groups, ref, run, plan.mini_batch_size)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        # optimizer and scheduler step; not finite: exit 3, or skip (on_nonfinite)
        step_ok = run.apply_update(stats_step["train/loss"], grad_norm, plan.mini_batch_size, len(train))

        if should_log(counters.optimizer_step, cfg.logging_steps):
            perf = run.throughput.report(accelerator)
            run.log(
                {
                    **stats_step,
                    "train/grad_norm": float(grad_norm),
                    "train/skipped_update": int(not step_ok),
                    "lr": scheduler.get_last_lr()[0],
                    **perf,
                    "perf/pairs_per_second": perf["perf/episodes_per_second"],
                }
            )
        if run.end_of_step(evaluate_policy if evals else None):  # eval, best model, checkpoint; True on SIGTERM
            return

    run.finish()


if __name__ == "__main__":
    runtime.run(main)
