"""Learning comparison of the RL variants on the tiny arithmetic task: same start, same budget, several seeds.

    python bench/compare_rl_variants.py [--seeds 1 2 3] [--total_episodes 1024] [--out output/rl_variants]

The start is the tiny local model SFT'd (sft.py) on arithmetic answers of which 60% are off by one, so greedy
held-out accuracy starts near 0.37 and RL has to move mass from the "+1" habit to the right result (the setting of
tests/test_rlvr.py). Every variant then runs open_instruct/rlvr_ppo.py with the same prompts per rollout (16 x 8
completions), the same number of completions, 2 passes of 2 mini-batches per rollout and the same learning rate;
only the knobs named in VARIANTS differ. Reported: held-out greedy accuracy (200 problems) at the end, mean and
per seed, and the mean over the run's evals (a steadier figure). Results go to <out>/results.json and a markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from demo import synthetic
from demo.tiny import save_tiny_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
GROUP = ["--num_samples_per_prompt", "8", "--local_rollout_batch_size", "16", "--kl_estimator", "k3"]
VARIANTS = {
    "gae (PPO)": ["--advantage_estimator", "gae", "--kl_estimator", "k1"],
    "grpo": ["--advantage_estimator", "grpo"],
    "dr_grpo": ["--advantage_estimator", "dr_grpo", "--loss_aggregation", "seq_mean_token_sum_norm"],
    "rloo": ["--advantage_estimator", "rloo"],
    "reinforce_pp": ["--advantage_estimator", "reinforce_pp", "--kl_estimator", "k1"],
    "grpo + clip-higher 0.28": ["--advantage_estimator", "grpo", "--cliprange_high", "0.28"],
    "grpo + zero-std filter": ["--advantage_estimator", "grpo", "--filter_zero_std_groups", "true"],
    "grpo + TIS (cap 2)": ["--advantage_estimator", "grpo", "--truncated_importance_sampling", "true"],
}


def run(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stderr[-3000:]}")


def start_policy(root: str) -> dict[str, str]:
    """The tiny model SFT'd on noisy arithmetic, and the RL prompt files."""
    files = synthetic.write_task_files(os.path.join(root, "data"), n_train=2000, n_eval=200)
    noisy = synthetic.write_jsonl(os.path.join(root, "data", "sft_noisy.jsonl"), synthetic.noisy_sft_rows(2000, 0, 0.6))
    base = save_tiny_models(os.path.join(root, "models"))["causal_lm"]
    sft = os.path.join(root, "sft")
    if not os.path.isdir(os.path.join(sft, "final_model")):
        run([os.path.join("open_instruct", "sft.py"), os.path.join("configs", "sft_tiny.yaml"), "--model_name_or_path",
             base, "--dataset_name_or_path", noisy, "--eval_dataset_name_or_path", files["sft_eval"], "--output_dir",
             sft, "--num_train_epochs", "4", "--eval_steps", "1000", "--checkpointing_steps", "1000"])  # fmt: skip
    return {"policy": os.path.join(sft, "final_model"), "train": files["rl_train"], "eval": files["rl_eval"]}


def one_run(task: dict[str, str], out_dir: str, seed: int, total_episodes: int, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    run([os.path.join("open_instruct", "rlvr_ppo.py"), os.path.join("configs", "rlvr_tiny.yaml"),
         "--model_name_or_path", task["policy"], "--dataset_name_or_path", task["train"],
         "--eval_dataset_name_or_path", task["eval"], "--output_dir", out_dir, "--seed", str(seed),
         "--total_episodes", str(total_episodes), "--eval_steps", "2", "--checkpointing_steps", "1000",
         "--save_final_model", "false", "--num_samples_logged", "0", *GROUP, *extra])  # fmt: skip
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r["eval/correct_rate"] for r in rows if "eval/correct_rate" in r]
    return {"evals": evals, "final": evals[-1], "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--total_episodes", type=int, default=1024)
    parser.add_argument("--out", default=os.path.join("output", "rl_variants"))
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    task = start_policy(out)
    results_path = os.path.join(out, "results.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else {}
    for name, extra in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        for seed in args.seeds:
            key = f"{name} | seed {seed}"
            if key in results:
                continue
            run_dir = os.path.join(out, "runs", f"{name.replace(' ', '_')}_s{seed}")
            results[key] = one_run(task, run_dir, seed, args.total_episodes, extra)
            print(f"{key}: {results[key]['evals']} ({results[key]['seconds']:.0f} s)", flush=True)
            with open(results_path, "w") as f:
                json.dump(results, f, indent=1)
    start = next(iter(results.values()))["evals"][0]
    print(f"\nheld-out greedy accuracy (200 problems), start {start:.3f}, {args.total_episodes} completions per run\n")
    print("| variant | final, mean over seeds | final per seed | mean over the run's evals |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        runs = [results[f"{name} | seed {s}"] for s in args.seeds if f"{name} | seed {s}" in results]
        if not runs:
            continue
        finals = [r["final"] for r in runs]
        curve = statistics.mean(statistics.mean(r["evals"][1:]) for r in runs)
        per_seed = " / ".join(f"{x:.3f}" for x in finals)
        print(f"| {name} | {statistics.mean(finals):.3f} | {per_seed} | {curve:.3f} |")


if __name__ == "__main__":
    main()
