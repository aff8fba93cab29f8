"""DPO training speed and memory: open_instruct/dpo.py vs trl.DPOTrainer (trl 1.16), side by side.

    python bench/bench_dpo.py [--hidden_sizes 64 256] [--steps 40] [--batch_size 8] [--repeats 2] [--threads 1]

Same workload for every trainer: the same model folder, the same conversational preference pairs (TRL tokenizes
them with the same chat template; the worker checks its token ids equal ours), sigmoid DPO with beta 0.1, the same
batch (pairs per optimizer step, no accumulation), AdamW at the same learning rate, linear schedule, grad-norm
clipping at 1.0, fp32, no activation checkpointing (TRL defaults to bf16 and gradient checkpointing: both off),
dropout off in both, no eval, no checkpoints.

What is fair about the reference model. Our script always computes the reference log-probs once, before training,
and caches them on disk; the training loop then runs one forward+backward per step. TRL by default keeps a
reference model and runs an extra forward per step; `precompute_ref_log_probs=True` is its equivalent of our cache.
Both are measured:
  trl      TRL's default (live reference model): what a TRL user gets out of the box;
  trl_pre  TRL with precompute_ref_log_probs=True: the same algorithmic work as ours.
The one-off reference pass (ours: the cache pass; trl_pre: its precompute) is timed separately and printed on its own
line; it is not in the pairs/s. Ours is measured with an empty cache (the pass really runs in every repeat).

Speed: pairs per second over the optimizer steps after `--warmup` steps. Ours from the script's own
perf/pairs_per_second rows (logging every `warmup` steps, first row dropped); TRL's from a callback timing the same
window. Also per CPU-second of the (single-threaded) process over the same window, which a loaded machine disturbs
far less than wall time. Memory: each run is its own fresh process; peak RSS is the kernel's high-water mark
(VmHWM), which catches torch's CPU tensors and short peaks. Runs alternate (ours, trl, trl_pre, ours, ...) so
they see the same machine load; ratios are per repeat, median reported. Identical runs on this shared 2-core
machine differ by up to ~25%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import preference_bench as shared

KINDS = ("ours", "trl", "trl_pre")
BETA = 0.1


# ---------------------------------------------------------------------------------------------------------------------
# Workers (one fresh process each)


def run_ours(args: argparse.Namespace) -> dict:
    from open_instruct import dpo, reference_cache, runtime
    from open_instruct.tracking import read_jsonl

    marks: dict[str, float] = {}
    original = reference_cache.reference_tables

    def timed_reference_tables(*a, **k):
        t0 = time.perf_counter()
        out = original(*a, **k)
        marks["reference_pass_s"] = time.perf_counter() - t0
        return out

    cpu_at_reports: list[float] = []

    class MarkedThroughput(runtime.Throughput):  # built right before the loop: model + optimizer + cache in memory
        def __init__(self) -> None:
            marks.setdefault("rss_before_train_mb", shared.rss_mb())
            super().__init__()

        def report(self, accelerator):  # called at each log row, i.e. every `warmup` steps
            cpu_at_reports.append(time.process_time())
            return super().report(accelerator)

    reference_cache.reference_tables = timed_reference_tables
    runtime.Throughput = MarkedThroughput
    out = tempfile.mkdtemp(prefix="bench_dpo_ours_")
    dpo.main(
        [
            *shared.our_training_flags(args, os.path.join(out, "run")),
            "--reference_cache_dir",
            os.path.join(out, "cache"),
            "--loss_type",
            "dpo",
            "--beta",
            str(BETA),
            "--per_device_eval_batch_size",
            str(args.batch_size),
        ]
    )
    rows = [r for r in read_jsonl(os.path.join(out, "run", "metrics.jsonl")) if "perf/pairs_per_second" in r][1:]
    pairs = len(rows) * args.warmup * args.batch_size
    seconds = sum(args.warmup * args.batch_size / r["perf/pairs_per_second"] for r in rows)
    cpu_pairs_per_second = pairs / (cpu_at_reports[-1] - cpu_at_reports[0])  # the same window: steps warmup..steps
    return {
        "pairs_per_second": pairs / seconds,
        "cpu_pairs_per_second": cpu_pairs_per_second,
        "final_loss": rows[-1]["train/loss"],
        **marks,
    }


def run_trl(args: argparse.Namespace, precompute: bool) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from open_instruct.data import load_rows, tokenize_preferences
    from open_instruct.models import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    rows = load_rows(args.data)
    train = datasets.Dataset.from_list([{"chosen": r.data["chosen"], "rejected": r.data["rejected"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    marks: dict[str, float] = {}
    losses: list[float] = []
    original = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **k):
        t0 = time.perf_counter()
        out = original(self, *a, **k)
        marks["reference_pass_s"] = marks.get("reference_pass_s", 0.0) + time.perf_counter() - t0
        return out

    DPOTrainer._precompute_ref_logps = timed_precompute

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks["rss_before_train_mb"] = shared.rss_mb()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == args.warmup:
                marks["t0"], marks["cpu0"] = time.perf_counter(), time.process_time()
            if state.global_step == args.steps:
                marks["t1"], marks["cpu1"] = time.perf_counter(), time.process_time()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    config = DPOConfig(
        **shared.trl_training_fields(args, tempfile.mkdtemp(prefix="bench_dpo_trl_")),
        beta=BETA,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=precompute,
        precompute_ref_batch_size=args.batch_size,
        disable_dropout=True,
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer, callbacks=[Timer()])

    # Same token ids as ours: TRL's prompt + completion equal our chosen/rejected sequences, pair for pair.
    ours, _ = tokenize_preferences(rows, tokenizer, shared.preference_columns(args.data))
    for e, t in zip(ours, trainer.train_dataset):
        assert (
            t["prompt_ids"] + t["chosen_ids"] == e["chosen_ids"]
            and t["prompt_ids"] + t["rejected_ids"] == e["rejected_ids"]
        )
        assert len(t["prompt_ids"]) == e["prompt_len"]
    trainer.train()
    pairs = (args.steps - args.warmup) * args.batch_size
    return {
        "pairs_per_second": pairs / (marks["t1"] - marks["t0"]),
        "cpu_pairs_per_second": pairs / (marks["cpu1"] - marks["cpu0"]),
        "final_loss": losses[-1] if losses else float("nan"),
        "rss_before_train_mb": marks["rss_before_train_mb"],
        **({"reference_pass_s": marks["reference_pass_s"]} if precompute else {}),
    }


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_ours(args) if args.worker == "ours" else run_trl(args, precompute=args.worker == "trl_pre")
    result["peak_rss_mb"] = shared.rss_mb("VmHWM")
    shared.print_result(result)


# ---------------------------------------------------------------------------------------------------------------------
# Driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared.add_arguments(parser, KINDS, "torch threads per worker, same for all (0: torch default)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    shared.check_steps(parser, args)

    from demo.synthetic import preference_rows, write_jsonl

    work = args.workdir or tempfile.mkdtemp(prefix="bench_dpo_")
    data = write_jsonl(os.path.join(work, "prefs.jsonl"), preference_rows(args.steps * args.batch_size, seed=0))
    print(
        f"{args.steps} steps x {args.batch_size} pairs (synthetic arithmetic preferences, ~70 tokens per sequence), "
        f"timed after {args.warmup} warm-up steps; sigmoid DPO beta {BETA}, fp32, no activation checkpointing, "
        f"{args.threads or 'default'} torch thread(s) per run; {args.repeats} alternating repeats"
    )
    summary = []
    for hidden in args.hidden_sizes:
        model = shared.tiny_model(work, hidden, args, "causal_lm")
        runs: dict[str, list[dict]] = {k: [] for k in KINDS}
        for _ in range(args.repeats):
            for kind in KINDS:
                r = shared.spawn_worker(__file__, kind, model, data, args, args.steps)
                runs[kind].append(r)
                print(
                    f"  hidden {hidden:>4} {kind:>7}: {r['pairs_per_second']:7.1f} pairs/s wall, "
                    f"{r['cpu_pairs_per_second']:7.1f} per "
                    f"CPU-second, peak RSS {r['peak_rss_mb']:6.0f} MB, final loss {r['final_loss']:.4f}",
                    flush=True,
                )
        med = lambda kind, key: statistics.median(r[key] for r in runs[kind])  # noqa: E731
        ratio = lambda t, key: [o[key] / x[key] for o, x in zip(runs["ours"], runs[t])]  # noqa: E731
        summary.append(
            (
                hidden,
                {(k, m): med(k, m) for k in KINDS for m in ("pairs_per_second", "cpu_pairs_per_second", "peak_rss_mb")},
                {(t, m): ratio(t, m) for t in ("trl", "trl_pre") for m in ("pairs_per_second", "cpu_pairs_per_second")},
                {k: med(k, "reference_pass_s") for k in ("ours", "trl_pre")},
            )
        )

    print(
        "\nSpeed ratio ours:TRL = pairs/s of open_instruct/dpo.py over TRL's (median; per repeat in brackets). "
        "'wall' is "
        "elapsed time, 'cpu' the process's CPU time over the same steps (single-threaded runs: robust when the "
        "machine is shared)."
    )
    print(
        "hidden  measure  pairs/s ours / trl / trl_pre    ours:trl              ours:trl_pre          peak RSS MB "
        "ours / trl / trl_pre"
    )
    for hidden, med_, ratios, _ in summary:
        for m, label in (("pairs_per_second", "wall"), ("cpu_pairs_per_second", "cpu")):
            r1, r2 = ratios[("trl", m)], ratios[("trl_pre", m)]
            mem = (
                f"{med_[('ours', 'peak_rss_mb')]:6.0f} / {med_[('trl', 'peak_rss_mb')]:6.0f} / "
                f"{med_[('trl_pre', 'peak_rss_mb')]:6.0f}"
                if label == "wall"
                else ""
            )
            print(
                f"{hidden:>6}  {label:>7}  {med_[('ours', m)]:6.1f} / {med_[('trl', m)]:6.1f} / "
                f"{med_[('trl_pre', m)]:6.1f}    "
                f"{statistics.median(r1):5.2f}x ({', '.join(f'{x:.2f}' for x in r1):<12}) "
                f"{statistics.median(r2):5.2f}x ({', '.join(f'{x:.2f}' for x in r2):<12}) {mem}"
            )
    for hidden, _, _, ref in summary:
        print(
            f"one-off reference pass over {args.steps * args.batch_size} pairs, hidden {hidden}: ours "
            f"{ref['ours']:.2f}s "
            f"(computed and cached on disk), trl_pre {ref['trl_pre']:.2f}s (precompute_ref_log_probs)"
        )


if __name__ == "__main__":
    main()
