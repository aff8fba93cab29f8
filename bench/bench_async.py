"""Synchronous vs async RL (async_steps N): episodes/s, staleness and overlap on the same workload.

    .venv-vllm/bin/python bench/bench_async.py [--async_steps 1 2 4] [--backend vllm_server|hf] [--hidden_size 256]
        [--layers 4] [--rollouts 10] [--repeats 2] [--mixed_precision bf16 --vllm_engine_devices 0 ...: other options
        go to rlvr_ppo.py]

Runs open_instruct/rlvr_ppo.py once per mode per repeat, alternating: async_steps 0, then each N of --async_steps,
on the same prompts, seeds and model (a Llama built from a config, random weights, no hub): GRPO, 16 prompts x 8
completions per rollout, `--response_length` new tokens (random weights rarely stop, so every completion is about
that long and all runs generate the same amount). `--backend vllm_server` (default): one dedicated engine, weights
updated in flight; `hf`: the trainer's process generates with a frozen copy of the policy in a background thread.

Measured from each run's own metrics.jsonl, rollouts after the first (the first cannot overlap):
  episodes/s          episodes / (wall seconds of the rollout's phases the trainer spent: waiting for generation,
                      weight sync, scoring, inference, training)
  generation_engine   the engine's wall time per rollout's generation
  generation waited   what the trainer waited for it (async: only what training did not cover)
  hidden fraction     1 - waited / engine time: the share of generation overlapped with training
  engine idle         1 - engine time / the trainer's time: the share of it the generator had nothing to do
  version lag         per sampled token, trainer version - the version that sampled it: mean and max (bound: N)
Speedup = async N / sync episodes/s, per repeat (the runs alternate, so they see the same machine load), median shown.

What this shows on CPU and what it cannot: the engine and the trainer here share the machine's cores, so an
overlapped generation slows the training beside it (and vice versa); the speedup is the overlap minus that
contention. On GPUs the engine has its own device and the overlap is close to free: the step time goes from
generation + training to max(generation, training) + weight sync. How much that buys depends on the split (verl and
NeMo-RL report 1.5-2.7x at scale where generation dominates); measuring it needs a GPU node (pending here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from demo import synthetic
from demo.tiny import build_tokenizer, tiny_llama_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
PHASES = ("time/weight_sync", "time/generation", "time/scoring", "time/inference", "time/training")


def build_model(path: str, hidden: int, layers: int) -> str:
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = tiny_llama_config(len(tokenizer), hidden, layers, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_once(model: str, data: dict, out_dir: str, async_steps: int, args: argparse.Namespace) -> dict:
    """One run of rlvr_ppo.py; its per-rollout means, rollouts after the first."""
    cmd = [
        sys.executable, os.path.join(REPO, "open_instruct", "rlvr_ppo.py"),
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", model, "--dataset_name_or_path", data["rl_train"],
        "--eval_dataset_name_or_path", data["rl_eval"], "--output_dir", out_dir, "--overwrite_output_dir", "true",
        "--algo", "grpo", "--num_samples_per_prompt", "8", "--local_rollout_batch_size", "16",
        "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "4", "--num_epochs", "1",
        "--response_length", str(args.response_length), "--total_episodes", str(128 * args.rollouts),
        "--eval_steps", "1000", "--checkpointing_steps", "1000", "--save_final_model", "false",
        "--generation_backend", args.backend, "--async_steps", str(async_steps), *args.rlvr_args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed (async_steps {async_steps}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/training" in r][1:]  # the first rollout cannot overlap
    busy = [sum(r[k] for k in PHASES) for r in rows]
    return {
        "episodes_per_second": 128 * len(rows) / sum(busy),
        "generation_engine_s": statistics.mean(r["time/generation_engine"] for r in rows),
        "generation_waited_s": statistics.mean(r["time/generation"] for r in rows),
        "training_s": statistics.mean(r["time/training"] + r["time/inference"] for r in rows),
        "weight_sync_s": statistics.mean(r["time/weight_sync"] for r in rows),
        "weight_sync_bytes": statistics.mean(r["perf/weight_sync_bytes"] for r in rows),
        "hidden_fraction": statistics.mean(r["perf/generation_hidden_fraction"] for r in rows),
        "engine_idle": statistics.mean(r["perf/engine_idle_fraction"] for r in rows),
        "version_lag_mean": statistics.mean(r["train/version_lag_mean"] for r in rows),
        "version_lag_max": max(r["train/version_lag_max"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--response_length", type=int, default=32)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--async_steps", type=int, nargs="+", default=[1, 2], help="the async modes besides sync")
    parser.add_argument("--backend", choices=["vllm_server", "hf"], default="vllm_server")
    parser.add_argument("--out", default=None, help="results.json goes here (default: a temporary folder)")
    args, args.rlvr_args = parser.parse_known_args()  # the rest goes to rlvr_ppo.py (--vllm_engine_devices 0 ...)
    root = args.out or tempfile.mkdtemp(prefix="bench_async_")
    os.makedirs(root, exist_ok=True)
    model = build_model(os.path.join(root, "model"), args.hidden_size, args.layers)
    data = synthetic.write_task_files(os.path.join(root, "data"), n_train=2000, n_eval=16)
    modes = {"sync": 0, **{f"async {n}": n for n in args.async_steps}}
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for r in range(args.repeats):
        for name, steps in modes.items():
            out_dir = os.path.join(root, f"{name.replace(' ', '_')}_{r}")
            results[name].append(run_once(model, data, out_dir, steps, args))
            print(name, r, {k: round(v, 3) for k, v in results[name][-1].items()}, flush=True)
    speedups = {
        name: [a["episodes_per_second"] / s["episodes_per_second"] for s, a in zip(results["sync"], results[name])]
        for name in modes
        if name != "sync"
    }
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "speedups": speedups}, f, indent=1)
    print(f"\n{args.backend}: hidden {args.hidden_size} x {args.layers} layers, {args.rollouts} rollouts of 128 x "
          f"{args.response_length} tokens, {args.repeats} repeat(s); {root}/results.json\n")  # fmt: skip
    print(
        "| mode | episodes/s | vs sync | engine generation s | trainer waited s | training s | weight sync s | hidden "
        "| engine idle | version lag mean / max |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in modes:
        rows = results[name]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        ratio = f"{statistics.median(speedups[name]):.2f}x" if name in speedups else "1"
        print(
            f"| {name} | {med['episodes_per_second']:.1f} | {ratio} | {med['generation_engine_s']:.2f} | "
            f"{med['generation_waited_s']:.2f} | {med['training_s']:.2f} | {med['weight_sync_s']:.3f} | "
            f"{med['hidden_fraction']:.0%} | {med['engine_idle']:.0%} | {med['version_lag_mean']:.2f} / "
            f"{max(r['version_lag_max'] for r in rows):.0f} |"
        )
    for name, values in speedups.items():
        print(f"{name} / sync episodes/s: median {statistics.median(values):.2f}x (per repeat {values})")


if __name__ == "__main__":
    main()
