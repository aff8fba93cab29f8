"""On-policy distillation on the tiny demo, beside plain RLVR on the same budget (CPU).

    python -m demo                                   # first: the pipeline, output/demo (its RLVR policy: the teacher)
    python -m demo.distill                           # then: output/demo_distill/summary.md
    python -m demo.distill --demo_dir D --output_dir O --total_episodes 15360 --distill_loss reverse_kl

The student starts from the demo's SFT model; the teacher is the demo's RLVR policy (SFT -> DPO -> GRPO). Two runs of
configs/demo/rlvr.yaml from the SFT model, each `--total_episodes` completions:
    distill   --teacher_model_name_or_path <demo>/rlvr/final_model --beta 0   (advantage_estimator distill)
    rlvr      the recipe as it is (GRPO on the verifier's reward)
Both final policies, the student before (SFT) and the teacher are scored greedily on the demo's held-out test problems
(eval.verifiable); each run is compared with the SFT model problem by problem (paired sign test, demo.pipeline).
CPU-minutes are the runs' user + system CPU time (the stages run one at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from demo.pipeline import DemoError, fmt_acc, held_out_accuracy, paired_change, read_metrics, run_script, script_env


def run_command(demo_dir: str, out: str, total_episodes: int, extra: Sequence[str]) -> list[str]:
    data = os.path.join(demo_dir, "data")
    return [
        sys.executable,
        os.path.join("open_instruct", "rlvr_ppo.py"),
        os.path.join("configs", "demo", "rlvr.yaml"),
        "--model_name_or_path",
        os.path.join(demo_dir, "sft", "final_model"),
        "--dataset_name_or_path",
        os.path.join(data, "rl_train.jsonl"),
        "--eval_dataset_name_or_path",
        os.path.join(data, "rl_valid.jsonl"),
        "--output_dir",
        out,
        "--total_episodes",
        str(total_episodes),
        *extra,
    ]


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo_dir", default="output/demo", help="a finished `python -m demo` output folder")
    parser.add_argument("--output_dir", default="output/demo_distill")
    parser.add_argument(
        "--total_episodes", type=int, default=15360, help="completions per run, both runs (the recipe's: 60 rollouts)"
    )
    parser.add_argument("--distill_loss", default="reverse_kl", choices=["reverse_kl", "jsd"])
    parser.add_argument("--num_threads", type=int, default=1)
    args = parser.parse_args(argv)
    demo, out = os.path.abspath(args.demo_dir), os.path.abspath(args.output_dir)
    teacher = os.path.join(demo, "rlvr", "final_model")
    for path in (os.path.join(demo, "sft", "final_model"), teacher, os.path.join(demo, "data", "test.jsonl")):
        if not os.path.exists(path):
            raise DemoError(f"{path} is missing: run `python -m demo --output_dir {args.demo_dir}` first")
    os.makedirs(out, exist_ok=True)
    env = script_env(args.num_threads)
    runs = {
        "distill": ["--teacher_model_name_or_path", teacher, "--beta", "0", "--distill_loss", args.distill_loss],
        "rlvr": [],
    }
    cpu: dict[str, float] = {}
    for name, extra in runs.items():
        print(f"== {name}: {args.total_episodes} completions from the SFT model", flush=True)
        cmd = run_command(demo, os.path.join(out, name), args.total_episodes, extra)
        _, cpu[name] = run_script(cmd, os.path.join(out, "logs", f"{name}.log"), env, echo=False)
        print(f"   CPU time {cpu[name] / 60:.1f} min", flush=True)

    test = os.path.join(demo, "data", "test.jsonl")
    models = {
        "student before (SFT)": os.path.join(demo, "sft", "final_model"),
        "distilled": os.path.join(out, "distill", "final_model"),
        "RLVR, same budget": os.path.join(out, "rlvr", "final_model"),
        "teacher (demo RLVR)": teacher,
    }
    accuracy, evals = {}, {}
    for label, path in models.items():
        evals[label] = os.path.join(out, "eval", label.split(" ")[0].lower())
        accuracy[label] = held_out_accuracy(path, test, evals[label], max_new_tokens=16, batch_size=100)
        print(f"   {label:<22} {fmt_acc(accuracy[label])}", flush=True)
    before = evals["student before (SFT)"]
    changes = {label: paired_change(before, evals[label]) for label in ("distilled", "RLVR, same budget")}
    kl = [r["train/teacher_kl"] for r in read_metrics(os.path.join(out, "distill")) if "train/teacher_kl" in r]

    lines = [
        f"# Distillation vs RLVR on the tiny demo ({args.total_episodes} completions each, from the SFT model)",
        "",
        f"Held-out: {accuracy['distilled']['total']} test problems, greedy. Teacher: {teacher}. "
        f"distill_loss {args.distill_loss}, beta 0.",
        "",
        "| model | held-out accuracy | vs SFT: fixed / broken (sign-test p) | training CPU-min |",
        "|---|---|---|---|",
    ]
    for label in models:
        change = changes.get(label)
        paired = f"{change['fixed']} / {change['broken']} (p={change['p_value']:.2g})" if change else ""
        minutes = {"distilled": cpu["distill"], "RLVR, same budget": cpu["rlvr"]}.get(label)
        lines.append(
            f"| {label} | {fmt_acc(accuracy[label]).strip()} | {paired} | "
            f"{'' if minutes is None else f'{minutes / 60:.1f}'} |"
        )
    if kl:
        lines += ["", f"train/teacher_kl by rollout (distill): first {kl[0]:.3f}, last {kl[-1]:.3f}"]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(report)
    summary = {"accuracy": accuracy, "paired": changes, "cpu_seconds": cpu, "teacher_kl": kl, "report": report}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print("\n" + report)
    return summary


if __name__ == "__main__":
    main()
