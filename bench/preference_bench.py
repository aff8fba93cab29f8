"""What bench/bench_dpo.py and bench/bench_reward_model.py share: both time one of our preference scripts against
its TRL trainer on the same tiny model and pairs, each run in a fresh worker process. Here: the command-line flags,
the training settings both sides get (ours as script flags, TRL's as config fields), the worker process, and RSS.

The benches run as `python bench/bench_<name>.py`, so this folder is on sys.path and they import this module by name.
"""

from __future__ import annotations

import argparse
import os
import sys

from worker_process import print_result, run_worker  # noqa: F401  (print_result: the workers' side, shared.print_result)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LENGTH = 1024  # longer than any synthetic pair: nothing is truncated or dropped on either side


def rss_mb(field: str = "VmRSS") -> float:
    """Current (VmRSS) or peak (VmHWM) resident memory of this process in MB, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # fallback: peak only (KiB on Linux)


def add_arguments(parser: argparse.ArgumentParser, workers: tuple[str, ...], threads_help: str) -> None:
    """The flags both benches take; `workers` are the kinds of run a worker process can be (hidden flag)."""
    parser.add_argument("--hidden_sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (a multiple of --warmup)")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the timing")
    parser.add_argument("--batch_size", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help=threads_help)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)


def check_steps(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps % args.warmup or args.steps <= args.warmup:
        parser.error("--steps must be a multiple of --warmup and larger than it")


def tiny_model(work: str, hidden: int, args: argparse.Namespace, kind: str) -> str:
    """The folder of a tiny model (demo/tiny.py) of width `hidden` and --num_layers: "causal_lm" or "seq_cls"."""
    from demo.tiny import save_tiny_models

    return save_tiny_models(os.path.join(work, f"h{hidden}"), hidden_size=hidden, num_layers=args.num_layers)[kind]


def our_training_flags(args: argparse.Namespace, output_dir: str) -> list[str]:
    """Our script's flags for the shared workload: one optimizer step per batch of pairs, linear schedule, clipping at
    1.0, a log row every `warmup` steps, no final save."""
    return [
        "--model_name_or_path",
        args.model,
        "--dataset_name_or_path",
        args.data,
        "--output_dir",
        output_dir,
        "--max_seq_length",
        str(MAX_LENGTH),
        "--per_device_train_batch_size",
        str(args.batch_size),
        "--gradient_accumulation_steps",
        "1",
        "--total_episodes",
        str(args.steps * args.batch_size),
        "--learning_rate",
        str(args.learning_rate),
        "--lr_scheduler_type",
        "linear",
        "--max_grad_norm",
        "1.0",
        "--logging_steps",
        str(args.warmup),
        "--save_final_model",
        "false",
        "--seed",
        "1",
    ]


def trl_training_fields(args: argparse.Namespace, output_dir: str) -> dict:
    """The same workload as TRL config fields: fp32 and no gradient checkpointing (TRL's defaults are bf16 and
    checkpointing), no warmup or weight decay, no saves or evals."""
    import torch

    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        max_length=MAX_LENGTH,
        logging_steps=args.warmup,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=1,
    )


def preference_columns(data: str) -> argparse.Namespace:
    """The settings open_instruct.data.tokenize_preferences reads, as our scripts' defaults give them."""
    return argparse.Namespace(
        chosen_column="chosen",
        rejected_column="rejected",
        prompt_column="prompt",
        max_seq_length=MAX_LENGTH,
        overlong="drop",
        skip_bad_rows=False,
        dataset_name_or_path=data,
    )


def spawn_worker(
    script: str, kind: str, model: str, data: str, args: argparse.Namespace, steps: int, env: dict | None = None
) -> dict:
    """Run `script` as a fresh `--worker kind` process and return the dict it prints on its `RESULT ` line."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", kind, "--model", model, "--data", data]
    cmd += ["--steps", str(steps), "--warmup", str(args.warmup), "--batch_size", str(args.batch_size)]
    cmd += ["--learning_rate", str(args.learning_rate), "--threads", str(args.threads)]
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    return run_worker(cmd, env, f"{kind} worker")
