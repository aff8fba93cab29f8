"""Dry-run planner: every batch quantity, step count and an estimated wall-clock time, without loading a model.

    python -m open_instruct.plan configs/rlvr_8b.yaml --num_processes 7
    python -m open_instruct.plan configs/dpo_8b.yaml --num_processes 8 --num_examples 60000 --json

Planner flags (`--num_processes`, `--num_examples`, `--json`, `--gpu`, `--model_params`, `--mfu`,
`--tokens_per_sample`) are read here; every other `--key value` is a recipe override. Invalid plans exit 2.
Imports neither torch nor model code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from open_instruct.batch_math import BatchPlan, count_eval_points, count_multiples
from open_instruct.config import CONFIG_CLASSES, BaseConfig, RLVRConfig, load_recipe, parse_config
from open_instruct.errors import ConfigError
from open_instruct.preflight import DATASET_EXTENSIONS, looks_local


@dataclass(frozen=True)
class GPUSpec:
    """A device's published peaks, for the time model (not accelerate's Accelerator)."""

    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_gb: float


# Published dense bf16 peaks and HBM bandwidth. "cpu" is this repo's 2-core test machine (measured bf16 matmul).
GPU_SPECS: dict[str, GPUSpec] = {
    "H100": GPUSpec(989e12, 3.35e12, 80),
    "H200": GPUSpec(989e12, 4.8e12, 141),
    "B200": GPUSpec(2250e12, 8.0e12, 180),
    "A100": GPUSpec(312e12, 2.04e12, 80),
    "A100-40GB": GPUSpec(312e12, 1.56e12, 40),
    "L40S": GPUSpec(362e12, 0.864e12, 48),
    "A10G": GPUSpec(125e12, 0.6e12, 24),
    "cpu": GPUSpec(1.84e12, 20e9, 24),
}

# Row counts of the published datasets (from their dataset cards), so recipes plan offline.
# A local file is counted exactly; pass --num_examples to override.
KNOWN_DATASET_SIZES: dict[str, int] = {
    "allenai/tulu-3-sft-mixture": 939_343,
    "allenai/llama-3.1-tulu-3-8b-preference-mixture": 272_898,
    "allenai/llama-3.1-tulu-3-70b-preference-mixture": 337_186,
    "allenai/RLVR-GSM-MATH-IF-Mixed-Constraints": 29_946,
    "allenai/RLVR-GSM": 7_473,
}


def count_local_rows(path: str) -> int:
    """Rows in local .jsonl/.json/.parquet file(s) (comma separated), without loading the data."""
    total = 0
    for part in path.split(","):
        part = part.strip()
        if part.endswith(".jsonl"):
            with open(part, "rb") as f:
                total += sum(1 for line in f if line.strip())
        elif part.endswith(".json"):
            with open(part) as f:
                data = json.load(f)
            total += len(data if isinstance(data, list) else next(iter(data.values())))
        elif part.endswith(".parquet"):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(part).metadata.num_rows
        else:
            raise ConfigError(f"dataset_name_or_path {part!r}: cannot count rows of this file type")
    return total


def dataset_size(name: str, split: str) -> tuple[Optional[int], str]:
    """(rows, where the number came from); (None, reason) if it cannot be had offline."""
    first = name.split(",")[0].strip()
    if os.path.exists(first):
        return count_local_rows(name), "counted in the local file(s)"
    if first.endswith(DATASET_EXTENSIONS) or looks_local(first):
        return None, f"local file {first!r} does not exist"
    if name in KNOWN_DATASET_SIZES:
        return KNOWN_DATASET_SIZES[name], "published size from the dataset card"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None, "hub dataset unknown offline"
    try:
        from datasets import load_dataset_builder

        info = load_dataset_builder(name).info
        return info.splits[split].num_examples, "hub dataset metadata"
    except Exception as e:  # noqa: BLE001 - any failure means "unknown", reported to the user
        return None, f"could not read hub metadata ({type(e).__name__})"


def llama_like_params(config: dict[str, Any]) -> int:
    """Parameter count of a decoder-only transformer from its HF config (Llama/Qwen/Mistral shape)."""
    h = config["hidden_size"]
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    inter = config.get("intermediate_size", 4 * h)
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    embed = vocab * h * (1 if config.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + h


def model_params(name: str, override: Optional[float]) -> tuple[Optional[float], str]:
    if override:
        return override, "--model_params"
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            return float(llama_like_params(json.load(f))), "counted from the local config.json"
    match = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([BbMm])(?![a-z])", name.split("/")[-1])
    if match:
        scale = 1e9 if match.group(2).lower() == "b" else 1e6
        return float(match.group(1)) * scale, f"read from the model name ({match.group(0)})"
    return None, "unknown: pass --model_params"


def estimate(
    cfg: BaseConfig, plan: BatchPlan, params: float, gpu: GPUSpec, mfu: float, tokens_per_sample: int, fill: float
) -> dict[str, Any]:
    """Tokens per phase and hours. Training is compute bound (6 FLOPs/param/token, 8 with activation
    checkpointing); generation is memory-bandwidth bound (weights read once per decode step)."""
    train_flops_per_token = (8 if cfg.activation_checkpointing else 6) * params
    cluster_flops = plan.world_size * gpu.peak_flops * mfu
    out: dict[str, Any] = {}
    if not plan.is_rl:
        seqs_per_sample = 1 if cfg.script == "sft" else 2  # RM and DPO: chosen + rejected
        train_tokens = plan.optimizer_steps * plan.mini_batch_size * seqs_per_sample * tokens_per_sample
        seconds = train_tokens * train_flops_per_token / cluster_flops
        out["train_tokens"] = train_tokens
        if cfg.script == "dpo" and getattr(cfg, "loss_type", "") != "simpo":
            ref_tokens = (plan.num_examples or plan.total_episodes) * seqs_per_sample * tokens_per_sample
            out["reference_cache_tokens"] = ref_tokens
            out["reference_cache_hours"] = ref_tokens * 2 * params / cluster_flops / 3600
            seconds += ref_tokens * 2 * params / cluster_flops
        step_seconds = seconds / plan.optimizer_steps
    else:
        assert isinstance(cfg, RLVRConfig)
        prompt_tokens = int(cfg.max_prompt_length * fill)
        resp = int(cfg.response_length * fill)
        seq = prompt_tokens + resp
        n_rollouts = plan.num_training_steps
        gen_tokens = n_rollouts * plan.episodes_per_rollout * resp
        # Tensor-parallel degree so the bf16 weights take at most half of one device's memory.
        tp = max(1, 2 ** math.ceil(math.log2(max(1.0, 2 * params / (0.5 * gpu.memory_gb * 1e9)))))
        decode_seconds = resp * (2 * params) / (tp * gpu.memory_bandwidth * 0.6)
        prefill_seconds = plan.episodes_per_rollout * prompt_tokens * 2 * params / cluster_flops
        gen_seconds_per_rollout = decode_seconds + prefill_seconds
        value_params = 0 if cfg.algo == "grpo" else params
        score_flops = plan.episodes_per_rollout * seq * 2 * (params + params + value_params)  # old logp, ref, value
        train_flops = plan.episodes_per_rollout * seq * cfg.num_epochs * (train_flops_per_token + value_params * 6)
        train_seconds_per_rollout = (score_flops + train_flops) / cluster_flops
        step_seconds = gen_seconds_per_rollout + train_seconds_per_rollout
        seconds = n_rollouts * step_seconds
        out.update(
            generation_tokens=gen_tokens,
            train_tokens=n_rollouts * plan.episodes_per_rollout * seq * cfg.num_epochs,
            generation_hours=n_rollouts * gen_seconds_per_rollout / 3600,
            training_hours=n_rollouts * train_seconds_per_rollout / 3600,
            generation_tensor_parallel=tp,
        )
    load_seconds = 2 * params / 1e9  # bf16 weights at ~1 GB/s from disk or network
    first_step_extra = 2 * step_seconds  # first step ~3x: allocator warm-up, kernel autotuning, cache fills
    out["seconds_per_step"] = step_seconds
    out["estimated_hours"] = (seconds + load_seconds + first_step_extra) / 3600
    return out


def build_plan(
    recipe_path: str,
    overrides: Sequence[str],
    num_processes: int,
    num_examples: Optional[int],
    gpu_name: str = "H100",
    model_params_override: Optional[float] = None,
    mfu: float = 0.4,
    tokens_per_sample: Optional[int] = None,
    fill: float = 0.5,
) -> dict[str, Any]:
    recipe = load_recipe(recipe_path)
    script = recipe.get("script")
    if script not in CONFIG_CLASSES:
        raise ConfigError(f"recipe {recipe_path}: key 'script' must be one of {sorted(CONFIG_CLASSES)}, got {script!r}")
    cfg = parse_config(CONFIG_CLASSES[script], [recipe_path, *overrides])
    return plan_from_config(
        cfg, num_processes, num_examples, gpu_name, model_params_override, mfu, tokens_per_sample, fill
    )


def plan_from_config(
    cfg: BaseConfig,
    num_processes: int,
    num_examples: Optional[int] = None,
    gpu_name: str = "H100",
    model_params_override: Optional[float] = None,
    mfu: float = 0.4,
    tokens_per_sample: Optional[int] = None,
    fill: float = 0.5,
) -> dict[str, Any]:
    """The plan as one flat dict (also what --json prints). Raises ConfigError on an invalid plan."""
    if gpu_name not in GPU_SPECS:
        raise ConfigError(f"--gpu {gpu_name!r} is not in the table; choose from {sorted(GPU_SPECS)}")
    if not (0 < fill <= 1):
        raise ConfigError(f"--fill must be in (0, 1], got {fill}")
    if not (0 < mfu <= 1):
        raise ConfigError(f"--mfu must be in (0, 1], got {mfu}")
    source = "--num_examples"
    if num_examples is None:
        num_examples, source = dataset_size(cfg.dataset_name_or_path, cfg.dataset_split)
        if num_examples is not None and cfg.max_train_samples:
            num_examples = min(num_examples, cfg.max_train_samples)
    if num_examples is None and not isinstance(cfg, RLVRConfig) and cfg.total_episodes is None:
        raise ConfigError(
            f"cannot size dataset {cfg.dataset_name_or_path!r} ({source}): pass --num_examples N or set total_episodes"
        )
    plan = cfg.batch_plan(num_processes, num_examples)
    steps_for_events = plan.num_training_steps
    params, params_source = model_params(cfg.model_name_or_path, model_params_override)
    if tokens_per_sample is None:
        tokens_per_sample = max(1, int(cfg.max_seq_length * fill))
    result: dict[str, Any] = {"script": cfg.script, "recipe_model": cfg.model_name_or_path, **plan.to_dict()}
    result.update(
        num_examples=num_examples,
        num_examples_source=source,
        logging_steps=cfg.logging_steps,
        log_rows=plan.log_rows(cfg.logging_steps),
        log_counter="rollout_step" if plan.is_rl else "optimizer_step",
        eval_points=count_eval_points(steps_for_events, cfg.eval_steps or 0, cfg.script in ("dpo", "rlvr_ppo")),
        checkpoint_points=count_multiples(steps_for_events, cfg.checkpointing_steps or 0),
        warmup_steps=int(cfg.warmup_ratio * plan.optimizer_steps),
        learning_rate=cfg.learning_rate,
        model_params=params,
        model_params_source=params_source,
        gpu=gpu_name,
        mfu=mfu,
        tokens_per_sample=tokens_per_sample,
        fill=fill,
    )
    if params is None:
        result["estimated_hours"] = None
    else:
        result.update(estimate(cfg, plan, params, GPU_SPECS[gpu_name], mfu, tokens_per_sample, fill))
    return result


def format_plan(p: dict[str, Any]) -> str:
    rl = "episodes_per_rollout" in p
    lines = [f"Plan for {p['script']} ({p['recipe_model']})", ""]
    rows = [
        ("world_size", p["world_size"], "training processes"),
        ("per_device_train_batch_size", p["per_device_train_batch_size"], "micro batch per device"),
        ("gradient_accumulation_steps", p["gradient_accumulation_steps"], "micro batches per update per device"),
        ("local_mini_batch_size", p["local_mini_batch_size"], "= micro x accumulation (per device, per update)"),
        ("mini_batch_size", p["mini_batch_size"], "= local_mini x world_size (global samples per update)"),
    ]
    if rl:
        rows += [
            ("local_rollout_batch_size", p["local_rollout_batch_size"], "prompts per device per rollout"),
            ("rollout_batch_size", p["rollout_batch_size"], "= local_rollout x world_size (prompts per rollout)"),
            ("num_samples_per_prompt", p["num_samples_per_prompt"], "completions per prompt"),
            ("episodes_per_rollout", p["episodes_per_rollout"], "= rollout_batch x samples per prompt"),
            ("num_mini_batches", p["num_mini_batches"], "= episodes_per_rollout / mini_batch_size"),
            ("num_epochs", p["num_epochs"], "passes over each rollout"),
        ]
    rows += [
        ("num_examples", p["num_examples"], p["num_examples_source"]),
        ("total_episodes", p["total_episodes"], "completions" if rl else "examples/pairs"),
        ("num_train_epochs", _fmt(p.get("num_train_epochs")), "passes over the data"),
        ("num_training_steps", p["num_training_steps"], "rollouts" if rl else "optimizer steps"),
        (
            "optimizer_steps",
            p["optimizer_steps"],
            "= rollouts x num_epochs x num_mini_batches" if rl else "parameter updates",
        ),
        ("warmup_steps", p["warmup_steps"], "optimizer steps"),
        ("log_rows", p["log_rows"], f"one per {p['logging_steps']} {p['log_counter']}"),
        ("eval_points", p["eval_points"], ""),
        ("checkpoint_points", p["checkpoint_points"], ""),
    ]
    width = max(len(r[0]) for r in rows)
    lines += [f"  {k:<{width}}  {_fmt(v):>14}  {note}" for k, v, note in rows]
    lines.append("")
    if p.get("estimated_hours") is None:
        lines.append(f"Time estimate: unavailable, model size {p['model_params_source']}")
        return "\n".join(lines)
    lines.append("Tokens")
    for key in ("train_tokens", "generation_tokens", "reference_cache_tokens"):
        if key in p:
            lines.append(f"  {key:<24} {p[key]:>18,}")
    lines.append("")
    lines.append(f"Estimated wall clock: {p['estimated_hours']:.1f} h  ({p['seconds_per_step']:.2f} s per step)")
    if rl:
        lines.append(f"  generation {p['generation_hours']:.1f} h, scoring + training {p['training_hours']:.1f} h")
    lines.append("Assumptions:")
    lines.append(f"  model parameters {p['model_params'] / 1e9:.2f} B ({p['model_params_source']})")
    lines.append(
        f"  {p['world_size']} x {p['gpu']}, training at {p['mfu']:.0%} of peak bf16 FLOP/s (6 FLOPs/param/token)"
    )
    if rl:
        lines.append(
            f"  generation memory-bandwidth bound at 60% of peak, tensor parallel {p['generation_tensor_parallel']}, "
            f"prompts and responses at {p['fill']:.0%} of their max lengths on average"
        )
    else:
        lines.append(
            f"  {p['tokens_per_sample']} tokens per sequence (--fill {p['fill']} of the max length; "
            "--tokens_per_sample to set)"
        )
    lines.append("  plus weight loading at ~1 GB/s and a first step ~3x slower; eval time not included")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_dry_run(cfg: BaseConfig, world_size: int, num_examples: Optional[int] = None) -> None:
    """What every script's --dry_run prints (same numbers as `python -m open_instruct.plan`)."""
    print(format_plan(plan_from_config(cfg, world_size, num_examples)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--num_processes", type=int, default=1, help="training processes (world_size)")
    parser.add_argument("--num_examples", type=int, default=None, help="dataset rows; skips reading the dataset")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--gpu", default="H100", help=f"one of {sorted(GPU_SPECS)}")
    parser.add_argument("--model_params", type=float, default=None, help="parameter count, e.g. 8e9")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of peak FLOP/s reached in training")
    parser.add_argument("--tokens_per_sample", type=int, default=None, help="average tokens per sequence")
    parser.add_argument("--fill", type=float, default=0.5, help="average sequence length as a fraction of the max")
    args, overrides = parser.parse_known_args(argv)
    try:
        plan = build_plan(
            args.recipe,
            overrides,
            args.num_processes,
            args.num_examples,
            args.gpu,
            args.model_params,
            args.mfu,
            args.tokens_per_sample,
            args.fill,
        )
    except ConfigError as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
