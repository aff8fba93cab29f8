"""Reward model training on preference pairs (Bradley-Terry): one loop, read top to bottom.

    python open_instruct/reward_model.py configs/rm_tiny.yaml [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml open_instruct/reward_model.py configs/rm_8b.yaml

The model is a sequence classifier with one output. A conversation's reward is read at its last non-pad token.
Chosen and rejected conversations go through ONE forward (chosen rows first, then rejected rows). The per-pair loss
is -log sigmoid(r_chosen - r_rejected - margin) + center_rewards_coefficient * (r_chosen + r_rejected)^2, averaged
over every pair of the global mini-batch (the same number whatever the split into devices and micro-batches).
`margin` is the optional per-pair column named by `margin_column` (0 without it); both terms are TRL
RewardTrainer's definitions. Accuracy counts a pair as right when r_chosen > r_rejected (ties are wrong; the
margin does not enter it).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from open_instruct import console, distributed, runtime
from open_instruct.config import RM_METRICS, RewardModelConfig

# Summed over pairs, see pair_sums. "loss" is the total (Bradley-Terry + centering), "center_loss" its centering term.
STAT_KEYS = ("loss", "correct", "chosen_reward", "rejected_reward", "center_loss", "target_margin")


def bradley_terry(chosen: Any, rejected: Any, margin: Any = None) -> Any:
    """Per-pair loss -log sigmoid(r_chosen - r_rejected - margin) (logsigmoid is stable for large margins).

    `margin` (per pair, or None for 0) asks the chosen reward to exceed the rejected one by at least that much
    before the loss flattens out (Llama 2's margin loss, TRL's `margin` column)."""
    import torch.nn.functional as F

    diff = chosen - rejected
    return -F.logsigmoid(diff if margin is None else diff - margin)


def center_penalty(chosen: Any, rejected: Any, coefficient: float) -> Any:
    """Per-pair coefficient * (r_chosen + r_rejected)^2: pulls each pair's mean reward to 0 so rewards stay on a
    common scale (Eisenstein et al. 2023). Averaged over pairs it is TRL's coef * mean((r_c + r_r)^2)."""
    return coefficient * (chosen + rejected) ** 2


def pair_losses(chosen: Any, rejected: Any, margin: Any, center_coefficient: float) -> tuple[Any, Any]:
    """(total per-pair loss, its centering term): the one loss that training and evaluation both use."""
    center = center_penalty(chosen, rejected, center_coefficient)
    return bradley_terry(chosen, rejected, margin) + center, center


def pair_sums(losses: Any, chosen: Any, rejected: Any, center: Any = None, margin: Any = None) -> Any:
    """Sums over the pairs of a batch, in STAT_KEYS order, as one detached tensor (one sync per step, not per stat)."""
    import torch

    zero = losses.sum() * 0
    return (
        torch.stack(
            [
                losses.sum(),
                (chosen > rejected).float().sum(),
                chosen.sum(),
                rejected.sum(),
                zero if center is None else center.sum(),
                zero if margin is None else margin.sum(),
            ]
        )
        .detach()
        .double()
    )


def summarize(totals: dict[str, float], pairs: float, prefix: str) -> dict[str, float]:
    """Means per pair from summed statistics: each of config.RM_METRICS (what best_metric may name), in its order."""
    n = max(pairs, 1.0)
    chosen, rejected = totals["chosen_reward"] / n, totals["rejected_reward"] / n
    means = {
        "loss": totals["loss"] / n,
        "accuracy": totals["correct"] / n,
        "chosen_reward": chosen,
        "rejected_reward": rejected,
        "margin": chosen - rejected,
        "center_loss": totals["center_loss"] / n,
        "target_margin": totals["target_margin"] / n,
    }
    return {f"{prefix}/{k}": means[k] for k in RM_METRICS}


def evaluate(cfg: RewardModelConfig, model: Any, evals: list[dict], accelerator: Any, pad_id: int) -> dict[str, float]:
    """Held-out means per pair (eval/loss, accuracy, rewards, margin), and the same per source as
    eval/<source>/... when the held-out set mixes sources."""
    import torch

    from open_instruct import data
    from open_instruct.models import pair_rewards

    rank, world = accelerator.process_index, accelerator.num_processes
    sources = data.mixed_sources(evals)
    groups = {"": torch.zeros(len(STAT_KEYS), dtype=torch.float64)}
    groups.update({s: torch.zeros(len(STAT_KEYS), dtype=torch.float64) for s in sources})
    pairs = dict.fromkeys(groups, 0.0)
    model.eval()
    with torch.no_grad():
        # Same number of forwards on every rank (FSDP forwards are collective); padding batches are not counted.
        lengths = [data.packed_length(e) for e in evals]
        mine = data.dealt_micro_batches(
            evals, cfg.per_device_eval_batch_size, rank, world, lengths, cfg.max_tokens_per_micro_batch
        )
        for mb, real in mine:
            batch = data.to_device(data.collate_preferences(mb, pad_id, cfg.packing), accelerator.device)
            with accelerator.autocast():
                chosen, rejected = pair_rewards(model, batch)
            if not real:
                continue
            margin = batch.get("margin")
            losses, center = pair_losses(chosen, rejected, margin, cfg.center_rewards_coefficient)
            for name in groups:
                keep = torch.tensor([not name or e["source"] == name for e in mb], device=chosen.device)
                picked = [t[keep] if t is not None else None for t in (losses, chosen, rejected, center, margin)]
                groups[name] += pair_sums(*picked).cpu()
                pairs[name] += float(keep.sum())
    model.train()
    sums = {name: {**dict(zip(STAT_KEYS, t.tolist())), "pairs": pairs[name]} for name, t in groups.items()}
    out = {}
    for name, t in distributed.global_sums_by_source(accelerator, sums).items():
        out.update(summarize(t, t["pairs"], f"eval/{name}" if name else "eval"))
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(RewardModelConfig, argv)

    from open_instruct import data
    from open_instruct.batch_math import should_log
    from open_instruct.lora import apply_lora
    from open_instruct.models import (
        DTYPES,
        load_sequence_classifier,
        load_tokenizer,
        make_optimizer_and_scheduler,
        pair_rewards,
    )

    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template
    )
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_preferences)
    plan = cfg.batch_plan(world, len(train))  # validated before the model loads
    if accelerator.is_main_process:
        print(console.startup_summary(cfg, plan, stats.summary(), len(evals)), flush=True)

    pad_id = tokenizer.pad_token_id
    model = load_sequence_classifier(
        cfg.model_name_or_path,
        DTYPES["no"],
        cfg.gguf_file,
        cfg.trust_remote_code,
        cfg.model_revision,
        pad_id,
        attn_implementation=cfg.attention_kernel,
    )
    # HF pools the score at the rightmost token that is not config.pad_token_id: it must be the id we pad with.
    model.config.pad_token_id = pad_id
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model = apply_lora(model, cfg, "SEQ_CLS")  # use_lora: adapters + the score head are trained
    optimizer, scheduler = make_optimizer_and_scheduler(model, cfg, plan.optimizer_steps)
    model, optimizer = accelerator.prepare(model, optimizer)

    run = runtime.RunContext.for_model(cfg, accelerator, model, optimizer, scheduler, tokenizer, plan.optimizer_steps)
    counters = run.counters
    stream = data.episode_stream(train, cfg)

    def evaluate_model() -> dict[str, float]:
        return evaluate(cfg, model, evals, accelerator, pad_id)

    model.train()
    while counters.optimizer_step < plan.optimizer_steps:
        # This step's pairs: a slice of the global order, by episode position (world-size independent).
        global_idx = stream.take(counters.episode, plan.mini_batch_size)
        local = [train[i] for i in stream.local_slice(global_idx, rank, world)]
        # Micro-batches of per_device_train_batch_size pairs, or packed rows of max_tokens_per_micro_batch tokens.
        groups = distributed.step_micro_batches(accelerator, local, [data.packed_length(e) for e in local], cfg)
        batches = [(data.collate_preferences(mb, pad_id, cfg.packing), real) for mb, real in groups]

        sums = distributed.StepSums(STAT_KEYS, accelerator.device)  # read once, after the micro-batches
        for i, (batch, real) in enumerate(batches):
            if real:  # counted on the CPU batch: no device sync
                run.throughput.add(data.batch_tokens(batch), data.batch_sequences(batch) // 2)
            batch = data.to_device(batch, accelerator.device)
            sync = i == len(batches) - 1
            with distributed.grad_sync(accelerator, model, sync):  # DDP: all-reduce on the last micro-batch only
                with accelerator.autocast():
                    chosen, rejected = pair_rewards(model, batch)
                losses, center = pair_losses(chosen, rejected, batch.get("margin"), cfg.center_rewards_coefficient)
                # Mean over the global mini-batch; DDP/FSDP average gradients over ranks, hence the world factor. A
                # dummy micro-batch (packing: this rank has fewer than another) counts 0.
                accelerator.backward(losses.sum() * (world / plan.mini_batch_size if real else 0.0))
            if real:
                sums.add_vector(pair_sums(losses, chosen, rejected, center, batch.get("margin")))

        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        totals = distributed.global_sums(accelerator, sums.read())
        metrics = summarize(totals, plan.mini_batch_size, "train")
        # optimizer and scheduler step; not finite: exit 3, or skip (on_nonfinite)
        step_ok = run.apply_update(metrics["train/loss"], grad_norm, plan.mini_batch_size, len(train))

        if should_log(counters.optimizer_step, cfg.logging_steps):
            run.log(
                {
                    **metrics,
                    "train/grad_norm": float(grad_norm),
                    "train/skipped_update": int(not step_ok),
                    "lr": scheduler.get_last_lr()[0],
                    **run.throughput.report(accelerator),
                }
            )
        if run.end_of_step(evaluate_model if evals else None):  # eval, best model, checkpoint; True on SIGTERM
            return

    run.finish()


if __name__ == "__main__":
    runtime.run(main)
