"""The whole pipeline on a tiny model built locally, on CPU: SFT -> reward model -> DPO -> RLVR, then a report.

    python -m demo                      # everything under output/demo (a few CPU-minutes; the summary has each stage's)
    python -m demo --quick              # the same pipeline with fewer steps (the test suite runs it)
    python -m demo --output_dir D --seed 0 --hidden_size 128 --num_layers 2

The task: arithmetic word problems ("Ann has 3 apples and gets 4 more. How many apples now?" -> "3+4=7") written by
demo.synthetic, checked by the `arithmetic` verifier. The model: a Llama with a character-level tokenizer,
built from random weights by demo.tiny, so the base model knows nothing.

Every stage is a real run of a real script with a recipe from configs/demo/, exactly what you would type:

    python open_instruct/sft.py          configs/demo/sft.yaml  --model_name_or_path <base>      --output_dir <out>/sft
    python open_instruct/reward_model.py configs/demo/rm.yaml   --model_name_or_path <out>/sft/final_model ...
    python open_instruct/dpo.py          configs/demo/dpo.yaml  --model_name_or_path <out>/sft/final_model ...
    python open_instruct/rlvr_ppo.py     configs/demo/rlvr.yaml --model_name_or_path <out>/dpo/final_model ...

(the reward model starts from the SFT model: a sequence classifier loaded from a causal-LM folder keeps the backbone
and gets a fresh scalar head). Then every policy (base, SFT, DPO, RLVR) is scored on the SAME held-out problems
with eval.verifiable (greedy), the reward model on held-out preference pairs with eval.reward_model, and the
metrics.jsonl of each stage is drawn with matplotlib. <output_dir>/summary.md and summary.json hold the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DemoError(RuntimeError):
    """A stage failed or produced no result: the message names the stage and its log file."""


# ---------------------------------------------------------------------------------------------------------------------
# Helpers shared with demo/smollm2.py


def write_summary_files(out: str, summary: dict[str, Any], markdown: str) -> None:
    """<out>/summary.json (every number of the run) and <out>/summary.md (its report)."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(markdown)


# What a SmolLM2 demo's missing model package (eval.offline_models) or optional extra (reasoning-gym) raises
MISSING_PACKAGE = (FileNotFoundError, ModuleNotFoundError)


def run_demo(main: Callable[[], Any], expected: tuple[type[Exception], ...] = ()) -> None:
    """A demo's command line: a failed stage (DemoError), or one of the `expected` errors (MISSING_PACKAGE for the
    demos that need one), ends it with its one-line message and exit 1, no traceback."""
    try:
        main()
    except (DemoError, *expected) as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
        sys.exit(1)


def script_env(num_threads: Optional[int]) -> dict[str, str]:
    """Environment for a stage's subprocess: this repo importable, no hub access, and the torch thread count."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


def children_cpu_seconds() -> float:
    """User + system CPU time of every finished child process so far (stages run one at a time, so a difference
    is one stage's). Unlike wall time it hardly depends on what else the machine is running."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_script(cmd: Sequence[str], log_path: str, env: dict[str, str], echo: bool = True) -> tuple[float, float]:
    """Run one stage, streaming its output (progress bars included) to the terminal and to `log_path`.

    Returns (wall seconds, CPU seconds); raises DemoError naming the log when the script exits non-zero."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    start, cpu_start = time.time(), children_cpu_seconds()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(list(cmd), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        out = getattr(sys.stdout, "buffer", None)
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            log.write(chunk)
            if echo:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:  # a captured stdout (pytest) has no byte buffer
                    sys.stdout.write(chunk.decode(errors="replace"))
        rc = proc.wait()
    if rc != 0:
        with open(log_path, errors="replace") as f:
            tail = "".join(f.read().replace("\r", "\n").splitlines(keepends=True)[-25:])
        raise DemoError(f"`{' '.join(cmd[:3])} ...` exited with status {rc}; full log: {log_path}\n{tail}")
    return time.time() - start, children_cpu_seconds() - cpu_start


def read_metrics(output_dir: str) -> list[dict[str, Any]]:
    from open_instruct.tracking import read_jsonl

    return read_jsonl(os.path.join(output_dir, "metrics.jsonl"))


def held_out_accuracy(
    model_path: str,
    data_path: str,
    out_dir: str,
    gguf_file: Optional[str] = None,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    stop_strings: Optional[list[str]] = None,
) -> dict[str, Any]:
    """Greedy verifiable accuracy of one model on held-out prompts (eval.verifiable), written to out_dir.

    Returns eval.verifiable's summary plus "seconds"; predictions go to <out_dir>/predictions.jsonl."""
    import torch

    from eval.verifiable import evaluate_verifiable, load_prompts, write_results
    from open_instruct.models import load_causal_lm, load_tokenizer

    start, cpu_start = time.time(), time.process_time()
    tokenizer = load_tokenizer(model_path, gguf_file)
    tokenizer.padding_side = "left"
    model = load_causal_lm(model_path, torch.float32, gguf_file)
    examples = load_prompts(data_path, tokenizer)
    summary, predictions = evaluate_verifiable(
        model,
        tokenizer,
        examples,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        stop_strings=stop_strings,
        batch_size=batch_size,
    )
    summary["seconds"] = time.time() - start
    summary["cpu_seconds"] = time.process_time() - cpu_start
    summary["model"] = model_path if not gguf_file else os.path.join(model_path, gguf_file)
    write_results(out_dir, predictions, summary)
    return summary


def paired_change(before_dir: str, after_dir: str) -> dict[str, Any]:
    """Per-problem comparison of two evaluations of the same prompts: how many were fixed (wrong -> right) and
    broken (right -> wrong), with the exact two-sided sign-test p-value on those discordant problems (McNemar).

    A gain is only worth reporting when fixed clearly outnumbers broken; the p-value says how clearly."""

    def load(d: str) -> dict[int, bool]:
        with open(os.path.join(d, "predictions.jsonl")) as f:
            return {r["row"]: bool(r["correct"]) for r in map(json.loads, f)}

    a, b = load(before_dir), load(after_dir)
    if a.keys() != b.keys():
        raise DemoError(f"{before_dir} and {after_dir} scored different prompts")
    fixed = sum(1 for k in a if not a[k] and b[k])
    broken = sum(1 for k in a if a[k] and not b[k])
    n = fixed + broken
    tail = sum(math.comb(n, k) for k in range(min(fixed, broken) + 1)) / 2**n if n else 1.0
    return {"fixed": fixed, "broken": broken, "p_value": min(1.0, 2 * tail)}


def cost_lines(timings: dict[str, float], cpu: dict[str, float], training: Sequence[str]) -> list[str]:
    """The report's wall-time and CPU-time lines (`timings` with its total), CPU-minutes of the `training` stages."""
    training_cpu = sum(cpu.get(name, 0.0) for name in training)
    return [
        "Wall time: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in timings.items()),
        "CPU time (all threads): " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in cpu.items())
        + f"; training ({' + '.join(training)}) {training_cpu / 60:.1f} CPU-minutes, all {sum(cpu.values()) / 60:.1f}",
    ]  # fmt: skip


def fmt_acc(s: dict[str, Any]) -> str:
    lo, hi = s["ci95"]
    return f"{s['accuracy']:6.1%}  ({s['correct']:>3}/{s['total']}, 95% CI {lo:5.1%}-{hi:5.1%})"


def fmt_seconds(sec: float) -> str:
    return f"{sec / 60:.1f} min" if sec >= 90 else f"{sec:.0f} s"


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline


@dataclass
class Stage:
    name: str  # output sub-folder and table row
    title: str
    script: str  # under open_instruct/
    recipe: str  # under configs/demo/
    init: str  # the stage whose final model it starts from ("base" = the randomly initialised tiny model)
    train: str  # data file keys (see write_data)
    eval: str
    quick: dict[str, Any] = field(default_factory=dict)  # overrides for --quick: fewer steps, same recipe otherwise
    note: str = ""  # printed before the stage runs


STAGES = [
    Stage("sft", "SFT", "sft.py", "sft.yaml", "base", "sft_train", "sft_eval"),
    Stage(
        "rm",
        "reward model",
        "reward_model.py",
        "rm.yaml",
        "sft",
        "pref_train",
        "pref_eval",
        {"total_episodes": 8000},
        note="transformers' load report below is expected: the SFT model's lm_head is dropped, "
        "a new `score` head is added",
    ),
    Stage("dpo", "DPO", "dpo.py", "dpo.yaml", "sft", "pref_train", "pref_eval"),
    Stage(
        "rlvr",
        "RLVR",
        "rlvr_ppo.py",
        "rlvr.yaml",
        "dpo",
        "rl_train",
        "rl_valid",
        {"total_episodes": 7680, "eval_steps": 5},
    ),
]
POLICIES = ["base", "sft", "dpo", "rlvr"]  # the rows of the accuracy table, in pipeline order


def write_data(data_dir: str, seed: int, n_train: int, n_valid: int, n_test: int) -> dict[str, str]:
    """Task files. Every split has its own seed; `test` (the accuracy table's problems) is used by no stage."""
    from demo.synthetic import preference_rows, rl_rows, sft_rows, write_jsonl

    j = lambda name: os.path.join(data_dir, f"{name}.jsonl")  # noqa: E731
    return {
        "sft_train": write_jsonl(j("sft_train"), sft_rows(n_train, seed)),
        "sft_eval": write_jsonl(j("sft_eval"), sft_rows(n_valid, seed + 1)),
        "pref_train": write_jsonl(j("pref_train"), preference_rows(n_train, seed + 2)),
        "pref_eval": write_jsonl(j("pref_eval"), preference_rows(n_valid, seed + 3)),
        "rl_train": write_jsonl(j("rl_train"), rl_rows(n_train, seed + 4)),
        "rl_valid": write_jsonl(j("rl_valid"), rl_rows(n_valid, seed + 5)),
        "test": write_jsonl(j("test"), rl_rows(n_test, seed + 6)),
        "pref_test": write_jsonl(j("pref_test"), preference_rows(n_test, seed + 7)),
    }


def stage_command(stage: Stage, init_path: str, files: dict[str, str], out: str, quick: bool) -> list[str]:
    cmd = [
        sys.executable,
        os.path.join("open_instruct", stage.script),
        os.path.join("configs", "demo", stage.recipe),
        "--model_name_or_path",
        init_path,
        "--dataset_name_or_path",
        files[stage.train],
        "--eval_dataset_name_or_path",
        files[stage.eval],
        "--output_dir",
        os.path.join(out, stage.name),
    ]
    if quick:
        for k, v in stage.quick.items():
            cmd += [f"--{k}", str(v)]
    return cmd


def reward_model_accuracy(model_path: str, data_path: str, out_dir: str) -> dict[str, Any]:
    """Held-out pair accuracy of the reward model (eval.reward_model), read exactly as the trainer reads rewards."""
    from types import SimpleNamespace

    import torch

    from eval.reward_model import score_pairs, summarize_scores
    from open_instruct.data import load_rows, tokenize_preferences
    from open_instruct.models import load_sequence_classifier, load_tokenizer

    tokenizer = load_tokenizer(model_path)
    cfg = SimpleNamespace(
        chosen_column="chosen",
        rejected_column="rejected",
        prompt_column="prompt",
        max_seq_length=128,
        overlong="drop",
        skip_bad_rows=False,
        dataset_name_or_path=data_path,
    )
    examples, _ = tokenize_preferences(load_rows(data_path, "test"), tokenizer, cfg)
    model = load_sequence_classifier(model_path, torch.float32, pad_token_id=tokenizer.pad_token_id)
    model.config.pad_token_id = tokenizer.pad_token_id
    scores = score_pairs(model, examples, tokenizer.pad_token_id, batch_size=100)
    summary = summarize_scores(scores)
    summary["ci95"] = list(summary["ci95"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/demo", help="everything goes here (replaced if it exists)")
    parser.add_argument("--quick", action="store_true", help="fewer steps per stage (what the test suite runs)")
    parser.add_argument("--seed", type=int, default=0, help="data and model initialisation seed")
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--n_test", type=int, default=1000, help="held-out problems in the accuracy table")
    parser.add_argument(
        "--num_threads",
        type=int,
        default=1,
        help="torch threads per stage (tiny models are overhead-bound: 1 is fastest on a busy machine)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not stream the stages' output (it is still logged)")
    args = parser.parse_args(argv)
    if args.hidden_size < 8 or args.hidden_size % 4 or args.num_layers < 1 or args.n_test < 1 or args.num_threads < 1:
        parser.error(
            "--hidden_size must be a multiple of 4 (4 attention heads) and >= 8; --num_layers, --n_test and "
            "--num_threads must be >= 1"
        )
    out = os.path.abspath(args.output_dir)
    marker = os.path.join(out, ".demo_output")
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(marker):
        raise DemoError(
            f"--output_dir {out} exists and was not written by the demo: it would be replaced; choose another folder"
        )

    import shutil

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # this process only loads small files: no bars for those
    t_start = time.time()
    if os.path.isdir(out):
        shutil.rmtree(out)  # a previous demo's stage folders would be mixed with this run's
    os.makedirs(out)
    open(marker, "w").close()
    torch.set_num_threads(args.num_threads)
    env = script_env(args.num_threads)
    mode = "quick" if args.quick else "full"
    print(
        f"demo ({mode}): SFT -> reward model -> DPO -> RLVR on a tiny Llama (hidden {args.hidden_size}, "
        f"{args.num_layers} layers)"
        f"\noutput: {out}\n",
        flush=True,
    )

    from demo.tiny import save_tiny_models

    base = save_tiny_models(os.path.join(out, "models"), args.hidden_size, args.num_layers, args.seed)["causal_lm"]
    files = write_data(os.path.join(out, "data"), args.seed, 4000, 200, args.n_test)
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds: what each stage costs whatever else the machine is doing
    finals = {"base": base}

    for i, stage in enumerate(STAGES, 1):
        print(
            f"\n== [{i}/{len(STAGES)}] {stage.title}: open_instruct/{stage.script} configs/demo/{stage.recipe} "
            f"(from {stage.init})",
            flush=True,
        )
        if stage.note:
            print(f"   ({stage.note})", flush=True)
        cmd = stage_command(stage, finals[stage.init], files, out, args.quick)
        timings[stage.name], cpu[stage.name] = run_script(
            cmd, os.path.join(out, "logs", f"{stage.name}.log"), env, echo=not args.quiet
        )
        finals[stage.name] = os.path.join(out, stage.name, "final_model")
        if not os.path.isdir(finals[stage.name]):
            raise DemoError(f"{stage.title} finished without writing {finals[stage.name]}")
        print(
            f"   {stage.title} done in {fmt_seconds(timings[stage.name])} (CPU time {fmt_seconds(cpu[stage.name])})",
            flush=True,
        )

    print(f"\n== held-out evaluation: {args.n_test} problems no stage trained or validated on (greedy)", flush=True)
    t_eval, cpu_eval = time.time(), time.process_time()
    accuracy = {}
    for name in POLICIES:
        accuracy[name] = held_out_accuracy(
            finals[name], files["test"], os.path.join(out, "eval", name), max_new_tokens=16, batch_size=100
        )
        print(f"   {name:<5} {fmt_acc(accuracy[name])}", flush=True)
    rm = reward_model_accuracy(finals["rm"], files["pref_test"], os.path.join(out, "eval", "rm"))
    print(f"   reward model: {rm['accuracy']:.1%} of {rm['total']} held-out pairs ranked right", flush=True)
    timings["evaluation"], cpu["evaluation"] = time.time() - t_eval, time.process_time() - cpu_eval

    plots = make_plots(out, accuracy)
    timings["total"] = time.time() - t_start
    cpu["total"] = sum(cpu.values())
    summary = write_summary(out, args, accuracy, rm, timings, cpu, plots, finals)
    print("\n" + summary["report"])
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Report: plots from each stage's metrics.jsonl, the table, the artifacts


def _series(rows: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def make_plots(out: str, accuracy: dict[str, dict[str, Any]]) -> dict[str, str]:
    """PNG files under <out>/plots drawn from the stages' metrics.jsonl (and the held-out accuracy table)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    plot_dir = os.path.join(out, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    m = {s.name: read_metrics(os.path.join(out, s.name)) for s in STAGES}
    paths = {}

    def draw(
        ax: Any, rows: list[dict[str, Any]], keys: Sequence[tuple[str, str]], x: str, title: str, ylabel: str = ""
    ) -> None:
        for key, label in keys:
            xs, ys = _series(rows, key, x)
            if xs:
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, markersize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x.replace("_", " "))
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)

    def save(fig: Any, key: str, name: str) -> None:
        fig.tight_layout()
        paths[key] = os.path.join(plot_dir, name)
        fig.savefig(paths[key], dpi=110)
        plt.close(fig)

    def train_and_held_out(metric: str) -> list[tuple[str, str]]:
        return [(f"train/{metric}", "train"), (f"eval/{metric}", "held-out")]

    rlvr_losses = [("loss/policy", "policy (clipped surrogate)"), ("loss/kl", "KL term"), ("loss/value", "value")]
    correct = [("train/correct_rate", "rollouts (sampled)"), ("eval/correct_rate", "validation (greedy)")]
    score = [("train/score_mean", "mean score"), ("train/non_stop_rate", "no-stop rate")]
    kl = [("train/kl", "KL(policy || start), per sequence")]
    step, rollout = "optimizer_step", "rollout_step"
    figures = {  # paths key: (file, width, its panels left to right: (stage, series, x axis, title[, y label]))
        "losses": (
            "losses.png",
            16,
            [
                ("sft", train_and_held_out("loss"), step, "SFT: token cross-entropy", "loss"),
                ("rm", train_and_held_out("loss"), step, "reward model: Bradley-Terry loss"),
                ("dpo", train_and_held_out("loss"), step, "DPO: loss"),
                ("rlvr", rlvr_losses, rollout, "RLVR: losses"),
            ],
        ),
        "preferences": (
            "reward_model_and_dpo.png",
            16,
            [
                ("rm", train_and_held_out("accuracy"), step, "reward model: pair accuracy"),
                ("rm", train_and_held_out("margin"), step, "reward model: r(chosen) - r(rejected)"),
                ("dpo", train_and_held_out("rewards/accuracy"), step, "DPO: implicit reward accuracy"),
                ("dpo", train_and_held_out("rewards/margin"), step, "DPO: implicit reward margin"),
            ],
        ),
        "rlvr": (
            "rlvr.png",
            13,
            [
                ("rlvr", correct, rollout, "RLVR: correct rate"),
                ("rlvr", score, rollout, "RLVR: score"),
                ("rlvr", kl, rollout, "RLVR: KL to the starting policy"),
            ],
        ),
    }
    for key, (name, width, panels) in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.6))
        for ax, (stage, series, x, title, *ylabel) in zip(axes, panels):
            draw(ax, m[stage], series, x, title, *ylabel)
        save(fig, key, name)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    names = [n for n in POLICIES if n in accuracy]
    acc = [accuracy[n]["accuracy"] for n in names]
    err = [
        [a - accuracy[n]["ci95"][0] for n, a in zip(names, acc)],
        [accuracy[n]["ci95"][1] - a for n, a in zip(names, acc)],
    ]
    ax.bar([n.upper() if n != "base" else "base" for n in names], acc, yerr=err, capsize=4, color="#4c72b0")
    for i, n in enumerate(names):
        ax.text(i, accuracy[n]["ci95"][1] + 0.02, f"{acc[i]:.1%}", ha="center", fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"{accuracy[names[0]]['total']} held-out problems, 95% Wilson intervals", fontsize=10)
    save(fig, "accuracy", "accuracy.png")
    return paths


def write_summary(
    out: str,
    args: Any,
    accuracy: dict[str, dict[str, Any]],
    rm: dict[str, Any],
    timings: dict[str, float],
    cpu: dict[str, float],
    plots: dict[str, str],
    finals: dict[str, str],
) -> dict[str, Any]:
    titles = {"base": "base (random init)", "sft": "SFT", "dpo": "DPO (from SFT)", "rlvr": "RLVR (from DPO)"}
    changes = {}
    lines = [
        (
            f"held-out verifiable accuracy: {accuracy['base']['total']} arithmetic problems that no stage trained or "
            "validated on, greedy decoding (eval.verifiable)"
        ),
        "",
        f"  {'policy':<18}{'accuracy':>9}   {'95% CI':<13}  vs the row above (problems fixed / broken, sign-test p)",
    ]
    for prev, name in zip([None] + POLICIES[:-1], POLICIES):
        s = accuracy[name]
        vs = ""
        if prev:
            c = changes[name] = paired_change(os.path.join(out, "eval", prev), os.path.join(out, "eval", name))
            gain = s["accuracy"] - accuracy[prev]["accuracy"]
            vs = f"{gain:+.1%}  (+{c['fixed']} / -{c['broken']}, p={c['p_value']:.2g})"
        lines.append(f"  {titles[name]:<18}{s['accuracy']:>9.1%}   {s['ci95'][0]:.1%}-{s['ci95'][1]:.1%}   {vs}")
    lines += [
        "",
        (
            f"reward model (from SFT): {rm['accuracy']:.1%} of {rm['total']} held-out pairs ranked right "
            f"(95% CI {rm['ci95'][0]:.1%}-{rm['ci95'][1]:.1%}; chance 50%), mean margin {rm['mean_margin']:.3f}"
        ),
        "",
    ]
    lines.append("wall time: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in timings.items()))
    lines.append(
        "CPU time:  "
        + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in cpu.items())
        + f"  ({os.cpu_count()} cores; wall time grows when other work shares them)"
    )
    lines += ["", "artifacts:"]
    artifacts = {
        **{f"{n} model": p for n, p in finals.items() if n != "base"},
        "base model": finals["base"],
        "data": os.path.join(out, "data"),
        "metrics": os.path.join(out, "<stage>", "metrics.jsonl"),
        "logs": os.path.join(out, "logs"),
        "predictions": os.path.join(out, "eval", "<policy>", "predictions.jsonl"),
        **{f"plot: {k}": v for k, v in plots.items()},
        "summary": os.path.join(out, "summary.md"),
    }
    lines += [f"  {k:<20}{v}" for k, v in artifacts.items()]
    report = "\n".join(lines)
    summary = {
        "quick": args.quick,
        "seed": args.seed,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "accuracy": accuracy,
        "paired_vs_previous": changes,
        "reward_model": rm,
        "seconds": timings,
        "cpu_seconds": cpu,
        "artifacts": artifacts,
        "report": report,
    }
    images = "\n".join(f"![{k}](plots/{os.path.basename(v)})" for k, v in plots.items())
    title = "# Demo: SFT -> reward model -> DPO -> RLVR on a tiny model"
    write_summary_files(out, summary, f"{title}\n\n```\n{report}\n```\n\n{images}\n")
    return summary


if __name__ == "__main__":
    run_demo(main)
