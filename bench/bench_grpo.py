"""GRPO throughput: open_instruct/rlvr_ppo.py (--algo grpo) vs TRL's GRPOTrainer on the same workload, in one run.

    python bench/bench_grpo.py [--steps 10] [--repeats 1] [--min_ratio 1.5]

Same tiny Llama (built locally), same arithmetic prompts, same group size (8), prompts per step (16, so 128
completions per optimizer step), completion length (12 tokens), sampling (temperature 1, no top-k/top-p), reward (the
`arithmetic` verifier, 1 if correct), KL (beta 0.01, k3 estimator, reference model loaded by both), loss aggregation
(token mean over the global batch: TRL's "dapo"), one optimizer step per generation, fp32, no gradient checkpointing,
one process each. TRL 1.16 defaults that differ from that are set explicitly (beta 0, bf16 and gradient checkpointing
on). Each trainer runs in its own subprocess (clean peak-memory numbers) with the same environment.

episodes/s = completions trained per second between the end of optimizer step 1 and the end of the last step (the first
step pays one-time costs in both). Peak memory = the subprocess's peak resident set size. Prints a table and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

from worker_process import print_result, run_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROUP = 8
PROMPTS_PER_STEP = 16
COMPLETION_TOKENS = 12
BETA = 0.01
LR = 1e-5
SEED = 1


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_ours(model: str, data: str, out_dir: str, steps: int) -> dict:
    from open_instruct import rlvr_ppo, tracking

    stamps: list[float] = []
    original = tracking.MetricsLogger.log

    def log(self, row):  # time each rollout's row (written after its optimizer step)
        original(self, row)
        if "train/correct_rate" in row:
            stamps.append(time.perf_counter())

    tracking.MetricsLogger.log = log
    rlvr_ppo.main(
        [
            os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
            "--algo",
            "grpo",
            "--model_name_or_path",
            model,
            "--dataset_name_or_path",
            data,
            "--eval_dataset_name_or_path",
            data,
            "--output_dir",
            out_dir,
            "--eval_steps",
            "100000",
            "--max_eval_samples",
            "8",
            "--checkpointing_steps",
            "100000",  # eval: before/after the timed steps
            "--save_final_model",
            "false",
            "--num_samples_logged",
            "0",
            "--logging_steps",
            "1",
            "--num_samples_per_prompt",
            str(GROUP),
            "--local_rollout_batch_size",
            str(PROMPTS_PER_STEP),
            "--per_device_train_batch_size",
            str(GROUP * PROMPTS_PER_STEP // 2),
            "--gradient_accumulation_steps",
            "2",
            "--num_epochs",
            "1",
            "--total_episodes",
            str(steps * GROUP * PROMPTS_PER_STEP),
            "--response_length",
            str(COMPLETION_TOKENS),
            "--temperature",
            "1.0",
            "--top_p",
            "1.0",
            "--beta",
            str(BETA),
            "--kl_estimator",
            "k3",
            "--learning_rate",
            str(LR),
            "--lr_scheduler_type",
            "constant",
            "--verification_reward",
            "1.0",
            "--non_stop_penalty",
            "0",
            "--seed",
            str(SEED),
        ]
    )
    return {"stamps": stamps}


def run_trl(model: str, data: str, out_dir: str, steps: int) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from open_instruct.rewards import verify_arithmetic

    rows = [json.loads(line) for line in open(data)]
    dataset = datasets.Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])

    def arithmetic_reward(completions, ground_truth, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [verify_arithmetic(t, g) for t, g in zip(texts, ground_truth)]

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=out_dir,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=steps,
        seed=SEED,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        per_device_train_batch_size=GROUP * PROMPTS_PER_STEP // 2,
        gradient_accumulation_steps=2,
        num_generations=GROUP,
        num_iterations=1,
        max_completion_length=COMPLETION_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=BETA,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        disable_dropout=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Stamp()],
    )
    trainer.train()
    return {"stamps": stamps}


def child(which: str, model: str, data: str, out_dir: str, steps: int) -> None:
    result = (run_ours if which == "ours" else run_trl)(model, data, out_dir, steps)
    stamps = result["stamps"]
    if len(stamps) != steps:
        raise SystemExit(f"{which}: expected {steps} step timestamps, got {len(stamps)}")
    episodes = (steps - 1) * GROUP * PROMPTS_PER_STEP
    print_result(
        {
            "which": which,
            "episodes_per_second": episodes / (stamps[-1] - stamps[0]),
            "seconds_per_step": (stamps[-1] - stamps[0]) / (steps - 1),
            "peak_rss_mb": peak_rss_mb(),
        }
    )


def spawn(which: str, model: str, data: str, root: str, steps: int, env: dict) -> dict:
    out_dir = os.path.join(root, f"{which}_{time.time_ns()}")
    return run_worker(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            which,
            "--model",
            model,
            "--data",
            data,
            "--out_dir",
            out_dir,
            "--steps",
            str(steps),
        ],
        env,
        which,
        cwd=REPO,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per trainer (the first is not timed)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="alternate runs per trainer; the best of each is reported"
    )
    parser.add_argument("--min_ratio", type=float, default=None, help="exit 1 if ours/TRL episodes/s is below this")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP threads per trainer (tiny models are overhead-bound)"
    )
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.data, args.out_dir, args.steps)
        return
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is not timed)")

    from demo import synthetic
    from demo.tiny import save_tiny_models

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": REPO,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as root:
        model = save_tiny_models(os.path.join(root, "models"))["causal_lm"]
        data = synthetic.write_jsonl(
            os.path.join(root, "rl.jsonl"), synthetic.rl_rows(PROMPTS_PER_STEP * args.steps * 2, seed=4)
        )
        results: dict[str, list[dict]] = {"ours": [], "trl": []}
        for _ in range(args.repeats):
            for which in ("ours", "trl"):
                results[which].append(spawn(which, model, data, root, args.steps, env))
                print(f"  {which}: {results[which][-1]['episodes_per_second']:.1f} episodes/s", flush=True)
    best = {w: max(rs, key=lambda r: r["episodes_per_second"]) for w, rs in results.items()}
    ratio = best["ours"]["episodes_per_second"] / best["trl"]["episodes_per_second"]
    print(
        f"\nGRPO, tiny Llama, {PROMPTS_PER_STEP} prompts x {GROUP} completions x {COMPLETION_TOKENS} tokens per "
        f"step, {args.steps} steps, {args.threads} thread(s)"
    )
    print(f"{'trainer':<10}{'episodes/s':>12}{'s/step':>10}{'peak RSS MB':>14}")
    for which, name in (("ours", "ours"), ("trl", "TRL 1.16")):
        r = best[which]
        print(f"{name:<10}{r['episodes_per_second']:>12.1f}{r['seconds_per_step']:>10.3f}{r['peak_rss_mb']:>14.0f}")
    print(f"ratio (ours / TRL episodes/s): {ratio:.2f}x")
    if args.min_ratio is not None and ratio < args.min_ratio:
        raise SystemExit(f"ratio {ratio:.2f} is below --min_ratio {args.min_ratio}")


if __name__ == "__main__":
    main()
