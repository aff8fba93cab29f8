"""Supervised fine-tuning on chat data: one loop, read top to bottom.

    python open_instruct/sft.py configs/sft_tiny.yaml [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml open_instruct/sft.py configs/sft_8b.yaml

Trains only on assistant tokens. The loss is the mean over every trained token of the global mini-batch
(the same number whatever the split into devices and micro-batches).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from open_instruct import console, distributed, runtime
from open_instruct.config import SFTConfig


def token_loss_sum(model: Any, batch: dict[str, Any], per_row: bool = False) -> tuple[Any, Any]:
    """Sum of next-token cross-entropy (fp32) over trained (label != -100) tokens, and how many there are; with
    per_row, both per sequence of the batch ([B] each: per-source eval sums), padded or packed. Only trained
    positions reach the output layer (models.scored_logprobs)."""
    from open_instruct.models import owner_sums, scored_logprobs, sequence_sums

    logps, owner, n = scored_logprobs(model, batch, batch["labels"])
    if per_row:  # per sequence: a padded batch's rows, a packed row's sequences
        trained = (batch["labels"][:, 1:] != -100).long()
        return -owner_sums(logps, owner, n), sequence_sums(trained, batch)
    return -logps.sum(), (batch["labels"][:, 1:] != -100).sum()


def evaluate(cfg: SFTConfig, model: Any, evals: list[dict], accelerator: Any, pad_id: int) -> dict[str, float]:
    """Held-out loss per trained token and perplexity; eval/<source>/loss too when the set mixes sources."""
    import math

    import torch

    from open_instruct import data

    rank, world = accelerator.process_index, accelerator.num_processes
    sources = data.mixed_sources(evals)
    sums = distributed.zero_sums_by_source(sources, ("loss", "tokens"))
    model.eval()
    with torch.no_grad():
        # Same number of forwards on every rank (FSDP forwards are collective); padding batches are not counted.
        lengths = [data.packed_length(e) for e in evals]
        mine = data.dealt_micro_batches(
            evals, cfg.per_device_eval_batch_size, rank, world, lengths, cfg.max_tokens_per_micro_batch
        )
        for mb, real in mine:
            batch = data.to_device(data.collate_sft(mb, pad_id, cfg.packing), accelerator.device)
            with accelerator.autocast():
                row_losses, row_tokens = token_loss_sum(model, batch, per_row=True)
            if not real:
                continue
            for example, loss, tokens in zip(mb, row_losses.tolist(), row_tokens.tolist()):
                for name in ["", example["source"]] if sources else [""]:
                    sums[name]["loss"] += loss
                    sums[name]["tokens"] += tokens
    model.train()
    totals = distributed.global_sums_by_source(accelerator, sums)
    losses = {name: t["loss"] / max(t["tokens"], 1) for name, t in totals.items()}
    return {
        "eval/loss": losses[""],
        "eval/perplexity": math.exp(losses[""]),
        **{f"eval/{name}/loss": losses[name] for name in sources},
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    cfg = runtime.start(SFTConfig, argv)

    from open_instruct import data
    from open_instruct.batch_math import should_log
    from open_instruct.lora import apply_lora
    from open_instruct.models import load_policy, load_tokenizer, make_optimizer_and_scheduler, with_scored_index

    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(
        cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template
    )
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_sft)
    plan = cfg.batch_plan(world, len(train))  # validated before the model loads
    if accelerator.is_main_process:
        print(console.startup_summary(cfg, plan, stats.summary(), len(evals)), flush=True)

    model = load_policy(cfg)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model = apply_lora(model, cfg, "CAUSAL_LM")  # use_lora: adapters only are trained (else the model as is)
    optimizer, scheduler = make_optimizer_and_scheduler(model, cfg, plan.optimizer_steps)
    model, optimizer = accelerator.prepare(model, optimizer)

    run = runtime.RunContext.for_model(cfg, accelerator, model, optimizer, scheduler, tokenizer, plan.optimizer_steps)
    counters = run.counters
    stream = data.episode_stream(train, cfg)
    pad_id = tokenizer.pad_token_id

    def evaluate_model() -> dict[str, float]:
        return evaluate(cfg, model, evals, accelerator, pad_id)

    model.train()
    while counters.optimizer_step < plan.optimizer_steps:
        # This step's examples: a slice of the global order, by episode position (world-size independent).
        global_idx = stream.take(counters.episode, plan.mini_batch_size)
        local = [train[i] for i in stream.local_slice(global_idx, rank, world)]
        # Micro-batches of per_device_train_batch_size rows, or packed rows of max_tokens_per_micro_batch tokens.
        groups = distributed.step_micro_batches(accelerator, local, [data.packed_length(e) for e in local], cfg)
        batches = [(data.collate_sft(mb, pad_id, cfg.packing), real) for mb, real in groups]
        local_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b, real in batches if real)
        global_tokens = distributed.global_sum(accelerator, local_tokens)

        sums = distributed.StepSums(("loss",), accelerator.device)  # read once, after the micro-batches
        for i, (batch, real) in enumerate(batches):
            if real:  # counted on the CPU batch: no device sync
                run.throughput.add(data.batch_tokens(batch), data.batch_sequences(batch))
            # scored positions found on the host: no host sync per micro-batch
            batch = data.to_device(with_scored_index(batch), accelerator.device)
            sync = i == len(batches) - 1
            with distributed.grad_sync(accelerator, model, sync):  # DDP: all-reduce on the last micro-batch only
                with accelerator.autocast():
                    loss_sum, _ = token_loss_sum(model, batch)
                # DDP/FSDP average gradients over ranks, so scale by world size to get the global token mean; a
                # dummy micro-batch (packing: this rank has fewer than another) counts 0.
                accelerator.backward(loss_sum * (world / global_tokens if real else 0.0))
            if real:
                sums.add({"loss": loss_sum})

        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        loss = distributed.global_sum(accelerator, sums.read()["loss"]) / global_tokens
        step_ok = run.apply_update(loss, grad_norm, plan.mini_batch_size, len(train))  # not finite: exit 3, or skip

        if should_log(counters.optimizer_step, cfg.logging_steps):
            run.log(
                {
                    "train/loss": loss,
                    "train/grad_norm": float(grad_norm),
                    "train/skipped_update": int(not step_ok),
                    "lr": scheduler.get_last_lr()[0],
                    "train/tokens_trained": global_tokens,
                    **run.throughput.report(accelerator),
                }
            )
        if run.end_of_step(evaluate_model if evals else None):  # eval, best model, checkpoint; True on SIGTERM
            return

    run.finish()


if __name__ == "__main__":
    runtime.run(main)
