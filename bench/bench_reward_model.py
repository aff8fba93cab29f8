"""Reward-model training speed and memory: open_instruct/reward_model.py vs trl.RewardTrainer, side by side.

    python bench/bench_reward_model.py [--hidden_sizes 64 256] [--steps 40] [--batch_size 8] [--repeats 2]

Both trainers get the SAME model folder, the SAME pre-tokenized pairs (tokenized once by open_instruct.data,
handed to TRL as chosen_ids/rejected_ids), the same batch (pairs per optimizer step, no accumulation), AdamW with
the same learning rate, linear schedule, grad-norm clipping at 1.0, fp32 and no activation checkpointing (TRL
defaults to bf16 and gradient checkpointing: both are turned off).

Data: random-letter prompts and replies of FIXED lengths (--prompt_chars, --reply_chars), so every batch has the
same shape whatever order a trainer draws it in: time and activation memory then compare like for like.

Speed: pairs per second over the optimizer steps after `--warmup` steps (the first steps pay one-off costs), in
wall-clock time and per CPU-second of the process (the latter barely moves when other jobs load the machine).
Both are taken at the same step boundaries: for ours at the script's own throughput reports (logging every `warmup`
steps; its logged perf/episodes_per_second is printed next to the bench's figure as a cross-check), for TRL in a
callback at the end of steps `warmup` and `steps`.

Memory: each trainer runs in its own fresh process, so peak RSS (the kernel's high-water mark, VmHWM) is that
trainer's alone. tracemalloc would miss torch's CPU tensors (they are not allocated through Python's allocator),
and sampling RSS could miss short peaks; the high-water mark cannot. Just before the first optimizer step the
worker notes its RSS and resets the high-water mark (/proc/self/clear_refs); at the end it reads the training
loop's own peak (free heap is handed back with malloc_trim first). Reported: the process peak (start-up or
training, whichever is higher; TRL imports more) and the training growth = training peak - RSS before training
(activations, gradients, Adam state). Memory comes from separate short runs with a fixed glibc mmap threshold so
that RSS follows live tensors (see `spawn`).

Runs alternate (ours, TRL, ours, TRL, ...) so both see the same machine load; ratios are per adjacent pair and
the median is reported. Identical runs on this shared 2-core machine differ by up to ~25%: compare ratios.
Workers use ONE torch thread by default (--threads): on a 2-core machine that other jobs also load, two
intra-op threads spin-wait on each other and a tiny model's forward+backward took 17x longer (1.58 s vs 91 ms),
which measures the scheduler, not the trainers. --threads 0 keeps torch's default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import preference_bench as shared


def mark_train_start(marks: dict) -> None:
    """RSS now, the peak so far, then reset the kernel's high-water mark (clear_refs 5, Linux >= 4.0) so that the
    peak read at the end is the training loop's own."""
    marks["startup_peak_mb"] = shared.rss_mb("VmHWM")
    try:  # hand free heap back to the OS first: else start-up garbage (TRL's is larger) hides training growth
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    marks["rss_before_train_mb"] = shared.rss_mb()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # no reset: the end-of-run peak then also covers start-up (reported as such)


# ---------------------------------------------------------------------------------------------------------------------
# Workers (one fresh process each)


def run_ours(args: argparse.Namespace) -> dict:
    from open_instruct import reward_model, runtime
    from open_instruct.tracking import read_jsonl

    marks: dict[str, Any] = {"reports": []}

    class MarkedThroughput(runtime.Throughput):
        """The script's throughput meter, also noting RSS when built (right before the training loop: model and
        optimizer exist) and the clocks at each report (end of every `warmup`-th optimizer step)."""

        def __init__(self) -> None:
            if "rss_before_train_mb" not in marks:
                mark_train_start(marks)
            super().__init__()

        def report(self, accelerator: Any) -> dict[str, float]:
            marks["reports"].append((time.perf_counter(), time.process_time()))
            return super().report(accelerator)

    runtime.Throughput = MarkedThroughput
    out = tempfile.mkdtemp(prefix="bench_rm_ours_")
    reward_model.main(shared.our_training_flags(args, out))
    rows = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "train/loss" in r]
    shutil.rmtree(out, ignore_errors=True)
    (w0, c0), (w1, c1) = marks["reports"][0], marks["reports"][-1]
    pairs = (args.steps - args.warmup) * args.batch_size
    logged = pairs / sum(args.warmup * args.batch_size / r["perf/episodes_per_second"] for r in rows[1:])
    return {
        "pairs_per_second": pairs / (w1 - w0),
        "pairs_per_cpu_second": pairs / (c1 - c0),
        "logged_pairs_per_second": logged,
        "final_loss": rows[-1]["train/loss"],
        **{k: marks[k] for k in ("rss_before_train_mb", "startup_peak_mb")},
    }


def run_trl(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    from open_instruct.data import load_rows, tokenize_preferences
    from open_instruct.models import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    examples, _ = tokenize_preferences(load_rows(args.data), tokenizer, shared.preference_columns(args.data))
    train = datasets.Dataset.from_list(
        [{"chosen_ids": e["chosen_ids"], "rejected_ids": e["rejected_ids"]} for e in examples]
    )
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)

    marks: dict[Any, Any] = {}
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            mark_train_start(marks)

        def on_step_end(self, a, state, control, **kw):
            if state.global_step in (args.warmup, args.steps):
                marks[state.global_step] = (time.perf_counter(), time.process_time())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    config = RewardConfig(
        **shared.trl_training_fields(args, tempfile.mkdtemp(prefix="bench_rm_trl_")), disable_tqdm=False
    )
    trainer = RewardTrainer(
        model=model, args=config, train_dataset=train, processing_class=tokenizer, callbacks=[Timer()]
    )
    trainer.train()
    shutil.rmtree(config.output_dir, ignore_errors=True)
    (w0, c0), (w1, c1) = marks[args.warmup], marks[args.steps]
    pairs = (args.steps - args.warmup) * args.batch_size
    return {
        "pairs_per_second": pairs / (w1 - w0),
        "pairs_per_cpu_second": pairs / (c1 - c0),
        "final_loss": losses[-1] if losses else float("nan"),
        **{k: marks[k] for k in ("rss_before_train_mb", "startup_peak_mb")},
    }


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_ours(args) if args.worker == "ours" else run_trl(args)
    train_peak = shared.rss_mb("VmHWM")  # since mark_train_start's reset
    result["peak_rss_mb"] = max(train_peak, result["startup_peak_mb"])
    result["train_growth_mb"] = train_peak - result["rss_before_train_mb"]
    shared.print_result(result)


# ---------------------------------------------------------------------------------------------------------------------
# Driver


def fixed_length_pairs(n: int, prompt_chars: int, reply_chars: int, seed: int = 0) -> list[dict]:
    """prompt/chosen/rejected strings of random letters; the tiny models' tokenizer has one token per character."""
    import random

    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(k))  # noqa: E731
    return [
        {"id": i, "prompt": text(prompt_chars), "chosen": text(reply_chars), "rejected": text(reply_chars)}
        for i in range(n)
    ]


def spawn(kind: str, model: str, data: str, args: argparse.Namespace, memory: bool = False) -> dict:
    """One worker process. memory=True: a short run (2 x warmup steps) for the memory figures only, with a fixed
    glibc mmap threshold so tensors over 64 KiB are mapped and unmapped on free and RSS follows live memory. With
    the default (dynamic) threshold freed blocks linger in the heap and allocation history decided ~40% of the
    measured growth (the same loop: 226-232 MB vs 142 MB). It also slows every step (page faults), hence separate
    runs for speed (default malloc) and memory."""
    steps = 2 * args.warmup if memory else args.steps
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"} if memory else {}
    return shared.spawn_worker(__file__, kind, model, data, args, steps, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared.add_arguments(parser, ("ours", "trl"), "torch threads per worker (0: torch default; see the module doc)")
    parser.add_argument("--prompt_chars", type=int, default=120, help="prompt length in tokens (one per character)")
    parser.add_argument("--reply_chars", type=int, default=60, help="chosen/rejected reply length in tokens")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    shared.check_steps(parser, args)

    from demo.synthetic import write_jsonl

    work = args.workdir or tempfile.mkdtemp(prefix="bench_rm_")
    rows = fixed_length_pairs(args.steps * args.batch_size, args.prompt_chars, args.reply_chars)
    data = write_jsonl(os.path.join(work, "prefs.jsonl"), rows)
    print(
        f"{args.steps} steps x {args.batch_size} pairs, every sequence {args.prompt_chars + args.reply_chars + 8} "
        "tokens "
        f"({args.prompt_chars}-token prompt, {args.reply_chars}-token reply, chat markup); timed after {args.warmup} "
        f"warm-up steps; fp32, no activation checkpointing, {args.threads or 'default'} torch thread(s); "
        f"{args.repeats} alternating repeats"
    )
    summary = []
    for hidden in args.hidden_sizes:
        model = shared.tiny_model(work, hidden, args, "seq_cls")
        runs: dict[str, list[dict]] = {"ours": [], "trl": []}
        for _ in range(args.repeats):
            for kind in ("ours", "trl"):
                r = spawn(kind, model, data, args)
                runs[kind].append(r)
                own = f" (its own meter: {r['logged_pairs_per_second']:.1f})" if "logged_pairs_per_second" in r else ""
                print(
                    f"  hidden {hidden:>4} {kind:>4}: {r['pairs_per_second']:6.1f} pairs/s{own}, "
                    f"{r['pairs_per_cpu_second']:6.1f} pairs/CPU-s, final loss {r['final_loss']:.4f}",
                    flush=True,
                )
        mem = {kind: spawn(kind, model, data, args, memory=True) for kind in ("ours", "trl")}
        for kind, r in mem.items():
            print(
                f"  hidden {hidden:>4} {kind:>4}: peak RSS {r['peak_rss_mb']:5.0f} MB, RSS before training "
                f"{r['rss_before_train_mb']:5.0f} MB, growth in training {r['train_growth_mb']:.0f} MB",
                flush=True,
            )
        row: dict[str, Any] = {"hidden": hidden, "mem": mem}
        for key in ("pairs_per_second", "pairs_per_cpu_second"):
            ratios = [o[key] / t[key] for o, t in zip(runs["ours"], runs["trl"])]
            row[key] = (statistics.median(ratios), ratios)
        summary.append(row)

    print("\nours / TRL (speed: median ratio over repeats, each repeat in brackets)")
    for row in summary:
        wall, cpu, mem = row["pairs_per_second"], row["pairs_per_cpu_second"], row["mem"]
        print(
            f"  hidden {row['hidden']:>4}: speed {wall[0]:.2f}x wall ({', '.join(f'{x:.2f}' for x in wall[1])}), "
            f"{cpu[0]:.2f}x per CPU-second ({', '.join(f'{x:.2f}' for x in cpu[1])}); "
            f"peak RSS {mem['ours']['peak_rss_mb']:.0f} / {mem['trl']['peak_rss_mb']:.0f} MB, "
            f"growth in training {mem['ours']['train_growth_mb']:.0f} / {mem['trl']['train_growth_mb']:.0f} MB"
        )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
