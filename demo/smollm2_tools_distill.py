"""On-policy distillation of the calculator skill on SmolLM2, against RL's learning curve from the same start (CPU).

    python -m demo.smollm2_tools --output_dir D --checkpointing_steps 2 --keep_last_n_checkpoints 20 \\
        --delete_finished_run false                      # first: the tool demo, its RL run keeping its checkpoints
    python -m demo.smollm2_tools_distill --demo_dir D    # then: D/distill/summary.md, curve.png, curve.json

The student is the demo's SFT model, the teacher its RLVR model. Each `--distill_loss` (reverse_kl, jsd) is one run
of configs/demo/rlvr_smollm2_tools.yaml from the SFT model with `--teacher_model_name_or_path <D>/rlvr/final_model
--advantage_estimator distill` and no reward (distill_reward_weight 0), on the same prompts, the same multi-turn
calculator episodes (tool output masked: only the student's own tokens get the teacher's signal) and the same batch
shape as RL (the prompts in RL's `train_order`), for `--rollouts` rollouts, checkpointed every `--every`.
Zero-variance groups are kept: the teacher's signal does not need a reward spread. The demo's RL run keeps the SFT
traces' loss beside its own (`--ptx_coef`, 0.3 by default) and the distillation runs do not, so the curve compares RL
with that loss against distillation without it; extra `--key value` arguments go to every distillation run
(`--ptx_dataset <D>/data/sft_train.jsonl --ptx_coef 0.3` gives the students the same term).

The curve: every checkpoint of the RL run and of each distillation run (exported to an HF folder) is played greedily
on the first `--n_eval` problems of the held-out one-step and two-step sets (the demo's own problems), and placed at
the CPU-minutes its run's trainer process had used when it wrote that checkpoint (`perf/process_cpu_minutes`, the
trainer's user + system time since it started, model loads included). The start (the SFT model) is at 0; the
teacher's final accuracy on the same problems is the level to reach. A run reaches the teacher's level at its first
checkpoint whose accuracy (mean of the two sets) is at least the teacher's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

from demo.pipeline import DemoError, paired_change, read_metrics, run_demo, run_script, script_env
from demo.smollm2_tools import HELD_OUT, RL_RECIPE, evaluate
from open_instruct.run_dir import write_text_atomic

CURVE_SETS = ("one-step", "two-step")
EPISODES_PER_ROLLOUT = 48  # the recipe's 6 prompts x 8 completions


def rl_train_order(rl_dir: str) -> str:
    """The RL run's `train_order` (its resolved config.yaml): a distillation run reads the prompts in the same order
    (a curriculum's one-step block first, `demo.smollm2_tools --one_step_first`)."""
    import yaml

    with open(os.path.join(rl_dir, "config.yaml")) as f:
        return yaml.safe_load(f).get("train_order", "shuffled")


def checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(rollout step, path) of every complete checkpoint of a run, in order."""
    from open_instruct.checkpoint import STATE, validate

    root, found = os.path.join(run_dir, "checkpoints"), []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if validate(path) is None:
            with open(os.path.join(path, STATE)) as f:
                found.append((json.load(f)["counters"]["rollout_step"], path))
    return sorted(found)


def cpu_minutes_at(run_dir: str, rollout: int) -> float:
    """The trainer's CPU-minutes when it finished rollout `rollout` (its log row of that rollout)."""
    for row in read_metrics(run_dir):
        if row.get("rollout_step") == rollout and "perf/process_cpu_minutes" in row:
            return row["perf/process_cpu_minutes"]
    raise DemoError(f"{run_dir}/metrics.jsonl: no perf/process_cpu_minutes for rollout {rollout} (log every rollout)")


def curve_files(demo: str, out: str, n_eval: int) -> dict[str, str]:
    """The first `n_eval` problems of each curve set, as files of their own (the evaluation plays whole files)."""
    files = {}
    for name in CURVE_SETS:
        with open(os.path.join(demo, "data", f"eval_{HELD_OUT[name]}.jsonl")) as f:
            rows = f.readlines()
        if len(rows) < n_eval:
            raise DemoError(f"--n_eval {n_eval}: the demo's {name} set has {len(rows)} problems")
        files[name] = os.path.join(out, "data", f"eval_{HELD_OUT[name]}.jsonl")
        os.makedirs(os.path.dirname(files[name]), exist_ok=True)
        write_text_atomic(files[name], "".join(rows[:n_eval]))
    return files


def point(model: str, out: str, label: str, files: dict[str, str], cpu_minutes: float) -> dict[str, Any]:
    """One point of a curve: the model's accuracy on each curve set (kept if already played) at `cpu_minutes`."""
    res = evaluate(model, None, out, label, files, CURVE_SETS, False, resume=True)
    accuracy = {name: res[name]["accuracy"] for name in CURVE_SETS}
    return {"cpu_minutes": cpu_minutes, "accuracy": accuracy, "mean": sum(accuracy.values()) / len(accuracy)}


def run_curve(run_dir: str, name: str, out: str, files: dict[str, str], start: dict[str, Any]) -> list[dict]:
    """The curve of one run: the start, then each checkpoint exported and evaluated."""
    from open_instruct.export import export_checkpoint

    curve = [dict(start, rollout=0)]
    for rollout, path in checkpoints(run_dir):
        label, minutes = f"{name}_rollout{rollout:03d}", cpu_minutes_at(run_dir, rollout)
        with tempfile.TemporaryDirectory(dir=out) as model:
            if not all(os.path.isfile(os.path.join(out, "eval", label, HELD_OUT[s], "problems.sha256"))
                       for s in CURVE_SETS):  # fmt: skip
                export_checkpoint(path, model)  # else every set is kept (evaluate's resume) and no model is read
            p = point(model, out, label, files, minutes)
        curve.append(dict(p, rollout=rollout))
        print(f"   {name} rollout {rollout}: {p['cpu_minutes']:.1f} CPU-min, "
              + ", ".join(f"{k} {v:.0%}" for k, v in p["accuracy"].items()), flush=True)  # fmt: skip
    return curve


def first_at(curve: list[dict[str, Any]], level: float) -> Optional[dict[str, Any]]:
    return next((p for p in curve if p["mean"] >= level), None)


def plot(curves: dict[str, list[dict[str, Any]]], teacher: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_SETS) + 1, figsize=(5 * (len(CURVE_SETS) + 1), 4), sharey=True)
    for ax, key in zip(axes, [*CURVE_SETS, "mean"]):
        for name, curve in curves.items():
            ys = [p["mean"] if key == "mean" else p["accuracy"][key] for p in curve]
            ax.plot([p["cpu_minutes"] for p in curve], ys, marker="o", label=name)
        ax.axhline(teacher["mean"] if key == "mean" else teacher["accuracy"][key], color="gray", ls="--",
                   label="teacher (RLVR, final)")  # fmt: skip
        ax.set_title(f"held-out {key}" if key != "mean" else "mean of the two sets")
        ax.set_xlabel("trainer CPU-minutes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy with the calculator (greedy)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo_dir", default="output/demo_smollm2_tools", help="a finished tool demo's folder")
    parser.add_argument("--distill_loss", default="reverse_kl,jsd", help="comma-separated: reverse_kl, jsd")
    parser.add_argument("--rollouts", type=int, default=6, help="rollouts of each distillation run")
    parser.add_argument("--every", type=int, default=2, help="a distillation checkpoint every N rollouts")
    parser.add_argument("--n_eval", type=int, default=100, help="problems per curve set (the first N of the demo's)")
    parser.add_argument("--num_threads", type=int, default=1)
    parser.add_argument("--train_only", action="store_true",
                        help="run the distillation runs, not the curves (RL's checkpoints not needed)")  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    losses = [s.strip() for s in args.distill_loss.split(",") if s.strip()]
    if not losses or set(losses) - {"reverse_kl", "jsd"}:
        parser.error(f"--distill_loss: {args.distill_loss!r}; each one of reverse_kl, jsd")
    if min(args.rollouts, args.every, args.n_eval) < 1:
        parser.error("--rollouts, --every and --n_eval must be >= 1")
    demo = os.path.abspath(args.demo_dir)
    out = os.path.join(demo, "distill")
    student, teacher = os.path.join(demo, "sft", "final_model"), os.path.join(demo, "rlvr", "final_model")
    for path in (student, teacher, os.path.join(demo, "data", "rl_train.jsonl")):
        if not os.path.exists(path):
            raise DemoError(f"{path} is missing: run `python -m demo.smollm2_tools --output_dir {args.demo_dir}` first")
    if not args.train_only and not checkpoints(os.path.join(demo, "rlvr")):
        raise DemoError(f"{demo}/rlvr has no checkpoints: run the demo with --checkpointing_steps 2 "
                        "--keep_last_n_checkpoints 20 --delete_finished_run false for RL's curve")  # fmt: skip
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    env = script_env(args.num_threads)
    os.makedirs(out, exist_ok=True)

    cpu: dict[str, float] = {}
    for loss in losses:
        run_dir = os.path.join(out, loss)
        if os.path.isdir(os.path.join(run_dir, "final_model")):
            print(f"== distill ({loss}): kept {run_dir}", flush=True)
            continue
        print(f"== distill ({loss}): {args.rollouts} rollouts from the SFT model, teacher {teacher}", flush=True)
        cmd = [sys.executable, os.path.join("open_instruct", "rlvr_ppo.py"), RL_RECIPE, "--model_name_or_path",
               student, "--teacher_model_name_or_path", teacher, "--advantage_estimator", "distill",
               "--distill_loss", loss, "--filter_zero_std_groups", "false", "--dataset_name_or_path",
               os.path.join(demo, "data", "rl_train.jsonl"), "--output_dir", run_dir, "--overwrite_output_dir",
               "true", "--total_episodes", str(args.rollouts * EPISODES_PER_ROLLOUT), "--checkpointing_steps",
               str(args.every), "--keep_last_n_checkpoints", str(args.rollouts), "--delete_finished_run", "false",
               "--train_order", rl_train_order(os.path.join(demo, "rlvr")), *overrides]  # fmt: skip
        _, cpu[loss] = run_script(cmd, os.path.join(out, "logs", f"{loss}.log"), env, echo=False)
        print(f"   CPU time {cpu[loss] / 60:.1f} min", flush=True)

    if args.train_only:
        return {"cpu_seconds": cpu}
    print("== the curves (held-out, greedy)", flush=True)
    files = curve_files(demo, out, args.n_eval)
    start = point(student, out, "sft", files, 0.0)
    teacher_point = point(teacher, out, "teacher", files, float("nan"))
    curves = {"RLVR": run_curve(os.path.join(demo, "rlvr"), "rlvr", out, files, start)}
    for loss in losses:
        curves[f"distill ({loss})"] = run_curve(os.path.join(out, loss), loss, out, files, start)
    final = {name: curve[-1] for name, curve in curves.items()}
    paired = {
        f"{name}|{s}": paired_change(os.path.join(out, "eval", "sft", HELD_OUT[s]),
                                     os.path.join(out, "eval", f"{key}_rollout{final[name]['rollout']:03d}",
                                                  HELD_OUT[s]))
        for name, key in [("RLVR", "rlvr"), *((f"distill ({loss})", loss) for loss in losses)]
        for s in CURVE_SETS
    }  # fmt: skip
    reached = {name: first_at(curve, teacher_point["mean"]) for name, curve in curves.items()}
    plot(curves, teacher_point, os.path.join(out, "curve.png"))

    lines = [
        f"# Distillation vs RLVR on the SmolLM2 calculator task (from {student})",
        "",
        f"Teacher: {teacher}. Held-out: the first {args.n_eval} problems of the one-step and two-step sets, greedy, "
        "with the calculator. CPU-minutes: the trainer process's, when it wrote the checkpoint.",
        "",
        "| run | rollout | CPU-min | one-step | two-step | mean |",
        "|---|---|---|---|---|---|",
        f"| teacher | | | {teacher_point['accuracy']['one-step']:.0%} | {teacher_point['accuracy']['two-step']:.0%} "
        f"| {teacher_point['mean']:.0%} |",
    ]
    for name, curve in curves.items():
        for p in curve:
            lines.append(f"| {name} | {p['rollout']} | {p['cpu_minutes']:.1f} | {p['accuracy']['one-step']:.0%} "
                         f"| {p['accuracy']['two-step']:.0%} | {p['mean']:.0%} |")  # fmt: skip
    lines += ["", "Paired against the SFT start at each run's last checkpoint (fixed / broken, sign-test p):", ""]
    lines += [f"- {k.replace('|', ', ')}: +{c['fixed']} / -{c['broken']}, p = {c['p_value']:.2g}"
              for k, c in paired.items()]  # fmt: skip
    lines += ["", "The teacher's level (mean accuracy), first reached:", ""]
    lines += [f"- {name}: " + (f"rollout {p['rollout']}, {p['cpu_minutes']:.1f} CPU-minutes" if p else "not reached")
              for name, p in reached.items()]  # fmt: skip
    report = "\n".join(lines) + "\n"
    summary = {"teacher": teacher_point, "curves": curves, "paired": paired, "reached": reached,
               "cpu_seconds": cpu, "n_eval": args.n_eval}  # fmt: skip
    write_text_atomic(os.path.join(out, "summary.md"), report)
    write_text_atomic(os.path.join(out, "curve.json"), json.dumps(summary, indent=1, default=str))
    print("\n" + report)
    return summary


if __name__ == "__main__":
    run_demo(main)
