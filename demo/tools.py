"""Tool-use RL on a tiny model built locally, on CPU: SFT on calculator traces, then RLVR with the calculator vs
RLVR without tools, from the same SFT model with the same prompts, steps and seeds.

    python -m demo.tools                    # everything under output/demo_tools (make demo-tools)
    python -m demo.tools --quick            # fewer RL steps and held-out problems (what the test suite runs)

The task: arithmetic on operands too large to do in one's head (4-digit sums and differences, 3-digit products;
demo.synthetic.tool_problem), checked by the `arithmetic` verifier (the last number of the final answer).

1. SFT (`open_instruct/sft.py configs/demo/sft_tools.yaml`) of the randomly initialised 4-layer tiny Llama on
   multi-turn traces (demo.synthetic.tool_sft_rows): the user's question, an assistant turn calling the calculator
   (`<tool_call>{"name": "calculator", "arguments": {"expression": "7890-1663"}}</tool_call>`, the tiny chat
   template's rendering of `tool_calls`), a `tool` message with the result, and the final answer. Products and
   differences always use the tool; 70% of the sums are answered at once, half of those wrongly (--direct_fraction,
   --direct_ops), so the SFT model skips the tool on most sums. Loss on assistant tokens only.
2. RLVR (`open_instruct/rlvr_ppo.py configs/demo/rlvr_tools.yaml`) twice from the SFT model: with the `tool`
   environment (the calculator runs, its result comes back as a `tool` turn, the final answer is verified) and with
   `--environment null` (single turn: a tool call is not run, so only an answer written at once can score).
3. Held-out evaluation of the SFT model and both RL models (greedy episodes, `held_out_episodes`): problems no
   stage trained on, of the training ranges and of larger operands (one digit more: "out of range"); per problem
   right/wrong, tool calls, the conversation. Paired changes (problems fixed / broken, exact sign test) against the
   SFT model under the same rules. The trainer's own eval rows (eval/correct_rate, eval/tool_calls_per_episode at
   rollout step 0 and at the end) are reported beside them.

<output_dir>/summary.md and summary.json hold the table, the CPU minutes and the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional, Sequence

from demo.pipeline import (
    DemoError,
    fmt_seconds,
    paired_change,
    read_metrics,
    run_demo,
    run_script,
    script_env,
    write_summary_files,
)
from demo.synthetic import direct_answer_error

SFT_RECIPE = os.path.join("configs", "demo", "sft_tools.yaml")
RL_RECIPE = os.path.join("configs", "demo", "rlvr_tools.yaml")
ARMS = {"tools": [], "no_tools": ["--environment", "null"]}  # RL runs: extra arguments beyond the recipe's
HELD_OUT = {"in_range": "train", "out_of_range": "out_of_range"}  # held-out set -> demo.synthetic TOOL_RANGES key


# ---------------------------------------------------------------------------------------------------------------------
# Held-out evaluation by greedy episodes (shared with demo/smollm2_tools.py)


def held_out_episodes(
    model_path: str,
    data_path: str,
    out_dir: str,
    tools: bool,
    gguf_file: Optional[str] = None,
    max_turns: int = 3,
    max_turn_tokens: int = 96,
    max_response_tokens: int = 160,
    batch_size: int = 64,
    system_prompt: Optional[str] = None,
) -> dict[str, Any]:
    """Greedy held-out accuracy of one model playing episodes: with `tools` the `tool` environment (calculator,
    Hermes calls), else one turn whose text is the answer (a tool call is then just text). Each row's verifier is
    its `dataset` column. Writes <out_dir>/predictions.jsonl (row, correct, tool_calls, actions: the turns' texts,
    conversation) and summary.json; returns the summary: accuracy, correct, total, ci95, tool_calls_per_episode,
    tool_call_rate, seconds, cpu_seconds."""
    import torch

    from eval.verifiable import wilson_interval, write_results
    from open_instruct.data import load_rows
    from open_instruct.environments import MultiTurnEnvironment, ToolEnvironment
    from open_instruct.episodes import (
        EpisodeBudget,
        EpisodeTokenizer,
        render_episode,
        rollout_episodes,
        shared_stop_strings,
    )
    from open_instruct.generation import GenerationConfig, HFGenerator
    from open_instruct.models import load_causal_lm, load_tokenizer

    start, cpu_start = time.time(), time.process_time()
    tokenizer = load_tokenizer(model_path, gguf_file)
    model = load_causal_lm(model_path, torch.float32, gguf_file).eval()
    generator = HFGenerator(model, tokenizer, batch_size=batch_size)
    examples = []
    for row in load_rows(data_path, "test"):
        example = dict(row.data)
        example["verifier"] = example.get("dataset")
        examples.append(example)
    if tools:
        envs: list[Any] = [
            ToolEnvironment(tools=("calculator",), tokenizer=tokenizer, tool_output_max_tokens=32, max_tool_calls=2,
                            system_prompt=system_prompt)
            for _ in examples
        ]  # fmt: skip
    else:
        envs = [MultiTurnEnvironment(system_prompt=system_prompt) for _ in examples]
    # a call turn stops at the end of its call, as in RL (episodes.EnvironmentRun.play)
    greedy = GenerationConfig(max_new_tokens=max_turn_tokens, temperature=0.0, stop_strings=shared_stop_strings(envs))

    def generate_fn(prompts: list[list[int]], caps: list[int]) -> list[tuple]:
        out = generator.generate(prompts, greedy, caps)
        return [(ids, lp) for ids, lp in zip(out.response_ids, out.logprobs)]

    tokens = EpisodeTokenizer(tokenizer)
    budget = EpisodeBudget(max_turns, max_turn_tokens, max_response_tokens)
    with torch.no_grad():
        episodes = rollout_episodes(envs, examples, generate_fn, tokens, budget)
    predictions = []
    for i, e in enumerate(episodes):
        correct = e.end_reason == "done" and bool(e.turns[-1].info.get("correct"))
        predictions.append(
            {"row": i, "correct": correct, "tool_calls": e.tool_calls, "ground_truth": e.example.get("ground_truth"),
             "end_reason": e.end_reason, "actions": [t.action for t in e.turns],
             "conversation": render_episode(e, tokens)}
        )  # fmt: skip
    n = len(predictions)
    n_correct = sum(p["correct"] for p in predictions)
    summary = {
        "accuracy": n_correct / n,
        "correct": n_correct,
        "total": n,
        "ci95": list(wilson_interval(n_correct, n)),
        "tool_calls_per_episode": sum(p["tool_calls"] for p in predictions) / n,
        "tool_call_rate": sum(p["tool_calls"] > 0 for p in predictions) / n,
        "tools": tools,
        "model": model_path if not gguf_file else os.path.join(model_path, gguf_file),
        "seconds": time.time() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }
    write_results(out_dir, predictions, summary)
    return summary


def trainer_eval_rows(run_dir: str) -> dict[str, Any]:
    """The RL run's own evaluation rows: the first (rollout step 0, the SFT start) and the last, with the keys
    eval/correct_rate, eval/<source>/correct_rate and eval/tool_calls_per_episode (environment runs only)."""
    rows = [r for r in read_metrics(run_dir) if "eval/correct_rate" in r]
    if not rows:
        return {}
    keep = lambda r: {k: v for k, v in r.items() if k.startswith("eval/") or k == "rollout_step"}  # noqa: E731
    return {"first": keep(rows[0]), "last": keep(rows[-1])}


# ---------------------------------------------------------------------------------------------------------------------
# The demo


def write_data(
    data_dir: str,
    seed: int,
    n_sft: int,
    n_rl: int,
    n_valid: int,
    n_test: int,
    direct_fraction: float = 0.7,
    direct_ops: str = "+",
) -> dict[str, str]:
    """Task files, every split with its own seed; the test sets are used by no stage. `direct_fraction` of the
    SFT traces whose operation is in `direct_ops` answer without the tool (half of those wrongly)."""
    from demo.synthetic import tool_rl_rows, tool_sft_rows, write_jsonl

    j = lambda name: os.path.join(data_dir, f"{name}.jsonl")  # noqa: E731
    files = {
        "sft_train": write_jsonl(j("sft_train"), tool_sft_rows(n_sft, seed, direct_fraction, direct_ops=direct_ops)),
        "sft_eval": write_jsonl(j("sft_eval"), tool_sft_rows(200, seed + 1, direct_fraction, direct_ops=direct_ops)),
        "rl_train": write_jsonl(j("rl_train"), tool_rl_rows(n_rl, seed + 2)),
        "valid_in_range": write_jsonl(j("valid_in_range"), tool_rl_rows(n_valid, seed + 3)),
        "valid_out_of_range": write_jsonl(j("valid_out_of_range"), tool_rl_rows(n_valid, seed + 4, "out_of_range")),
    }
    for k, (name, ranges) in enumerate(HELD_OUT.items()):
        files[f"test_{name}"] = write_jsonl(j(f"test_{name}"), tool_rl_rows(n_test, seed + 5 + k, ranges))
    return files


def rl_command(init: str, files: dict[str, str], out_dir: str, arm: str, seed: int, extra: Sequence[str]) -> list[str]:
    valid = ",".join(files[f"valid_{name}"] for name in HELD_OUT)
    return [
        sys.executable, os.path.join("open_instruct", "rlvr_ppo.py"), RL_RECIPE,
        "--model_name_or_path", init, "--dataset_name_or_path", files["rl_train"],
        "--eval_dataset_name_or_path", valid, "--output_dir", out_dir, "--seed", str(seed),
        *ARMS[arm], *extra,
    ]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/demo_tools", help="everything goes here (replaced)")
    parser.add_argument("--quick", action="store_true", help="fewer RL steps and held-out problems (the tests)")
    parser.add_argument("--seed", type=int, default=0, help="data and model initialisation seed")
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--n_test", type=int, default=None, help="problems per held-out set (default 500, quick 100)")
    parser.add_argument("--num_threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument(
        "--direct_fraction",
        type=float,
        default=0.7,
        help="of the SFT traces whose operation is in --direct_ops: those answering without the tool",
    )
    parser.add_argument("--direct_ops", default="+", help="operations answered at once in --direct_fraction of traces")
    parser.add_argument("--sft_total_episodes", type=int, default=None, help="SFT traces seen (default: the recipe's)")
    parser.add_argument("--sft_model", default=None, help="skip SFT: start both RL runs from this model folder")
    parser.add_argument("--quiet", action="store_true", help="do not stream the stages' output (it is still logged)")
    args, rl_overrides = parser.parse_known_args(argv)
    n_test = args.n_test or (100 if args.quick else 500)
    if args.hidden_size < 8 or args.hidden_size % 4 or args.num_layers < 1 or n_test < 1 or args.num_threads < 1:
        parser.error("--hidden_size must be a multiple of 4 and >= 8; --num_layers, --n_test, --num_threads >= 1")
    direct_error = direct_answer_error(args.direct_fraction, args.direct_ops)
    if direct_error:
        parser.error(f"--{direct_error}")
    if args.sft_model and not os.path.isfile(os.path.join(args.sft_model, "config.json")):
        parser.error(f"--sft_model {args.sft_model}: no model there (config.json missing)")
    if any(not a.startswith("--") for a in rl_overrides[::2]) or len(rl_overrides) % 2:
        parser.error(f"extra arguments go to the RL runs as --key value pairs, got {rl_overrides}")
    if args.quick:
        rl_overrides = ["--total_episodes", "1280", "--eval_steps", "5", *rl_overrides]
    out = os.path.abspath(args.output_dir)
    marker = os.path.join(out, ".demo_output")
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(marker):
        raise DemoError(f"--output_dir {out} exists and was not written by the demo: choose another folder")
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.errors import ConfigError

    try:  # a typo in an override fails now, not after SFT
        for arm in ARMS:
            cmd = rl_command("MODEL", {k: "x.jsonl" for k in ("rl_train", "valid_in_range", "valid_out_of_range")},
                             "OUT", arm, args.seed + 1, rl_overrides)  # fmt: skip
            parse_config(RLVRConfig, cmd[2:]).batch_plan(1, None)
    except ConfigError as e:
        parser.error(f"RLVR settings: {e}")

    import shutil

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    open(marker, "w").close()
    torch.set_num_threads(args.num_threads)
    env = script_env(args.num_threads)
    t_start = time.time()
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    print(f"tool-use demo ({'quick' if args.quick else 'full'}): tiny Llama, SFT on calculator traces, RLVR with "
          f"and without tools\noutput: {out}\n", flush=True)  # fmt: skip
    files = write_data(
        os.path.join(out, "data"), args.seed, 8000, 4000, 100, n_test, args.direct_fraction, args.direct_ops
    )
    commands = {}
    if args.sft_model:
        sft_model = os.path.abspath(args.sft_model)
    else:
        from demo.tiny import save_tiny_models

        base = save_tiny_models(os.path.join(out, "models"), args.hidden_size, args.num_layers, args.seed)
        cmd = [
            sys.executable, os.path.join("open_instruct", "sft.py"), SFT_RECIPE,
            "--model_name_or_path", base["causal_lm"], "--dataset_name_or_path", files["sft_train"],
            "--eval_dataset_name_or_path", files["sft_eval"], "--output_dir", os.path.join(out, "sft"),
        ]  # fmt: skip
        if args.sft_total_episodes:
            cmd += ["--total_episodes", str(args.sft_total_episodes)]
        print(f"== SFT: open_instruct/sft.py {SFT_RECIPE}", flush=True)
        timings["sft"], cpu["sft"] = run_script(cmd, os.path.join(out, "logs", "sft.log"), env, echo=not args.quiet)
        commands["sft"] = " ".join(cmd)
        sft_model = os.path.join(out, "sft", "final_model")
    finals = {"sft": sft_model}
    for arm in ARMS:
        cmd = rl_command(sft_model, files, os.path.join(out, f"rlvr_{arm}"), arm, args.seed + 1, rl_overrides)
        print(f"\n== RLVR {arm.replace('_', ' ')}: open_instruct/rlvr_ppo.py {RL_RECIPE} {' '.join(ARMS[arm])}",
              flush=True)  # fmt: skip
        name = f"rlvr_{arm}"
        timings[name], cpu[name] = run_script(cmd, os.path.join(out, "logs", f"{name}.log"), env, echo=not args.quiet)
        commands[name] = " ".join(cmd)
        finals[name] = os.path.join(out, name, "final_model")
        if not os.path.isdir(finals[name]):
            raise DemoError(f"RLVR {arm} finished without writing {finals[name]}")

    print(f"\n== held-out evaluation (greedy episodes, {n_test} problems per set)", flush=True)
    # (policy, evaluated with tools): each RL model under its own rules, the SFT model under both
    evaluations = [("sft", True), ("sft", False), ("rlvr_tools", True), ("rlvr_no_tools", False)]
    results: dict[str, dict[str, Any]] = {}
    for policy, tools in evaluations:
        for held_out in HELD_OUT:
            key = f"{policy}|{'tools' if tools else 'no_tools'}|{held_out}"
            results[key] = held_out_episodes(finals[policy], files[f"test_{held_out}"],
                                             os.path.join(out, "eval", key.replace("|", "-")), tools)  # fmt: skip
            timings["evaluation"] = timings.get("evaluation", 0.0) + results[key]["seconds"]
            cpu["evaluation"] = cpu.get("evaluation", 0.0) + results[key]["cpu_seconds"]
            r = results[key]
            print(f"   {key:<40} {r['accuracy']:6.1%} ({r['correct']}/{r['total']}), "
                  f"tool calls/episode {r['tool_calls_per_episode']:.2f}", flush=True)  # fmt: skip
    timings["total"] = time.time() - t_start
    cpu["total"] = sum(cpu.values())
    summary = write_summary(out, args, results, finals, timings, cpu, commands, n_test)
    print("\n" + summary["report"])
    return summary


def write_summary(
    out: str,
    args: Any,
    results: dict[str, dict[str, Any]],
    finals: dict[str, str],
    timings: dict[str, float],
    cpu: dict[str, float],
    commands: dict[str, str],
    n_test: int,
) -> dict[str, Any]:
    def eval_dir(key: str) -> str:
        return os.path.join(out, "eval", key.replace("|", "-"))

    paired = {}
    for arm in ARMS:
        for held_out in HELD_OUT:
            before, after = f"sft|{arm}|{held_out}", f"rlvr_{arm}|{arm}|{held_out}"
            paired[f"{arm}|{held_out}"] = paired_change(eval_dir(before), eval_dir(after))
    trainer = {arm: trainer_eval_rows(os.path.join(out, f"rlvr_{arm}")) for arm in ARMS}
    lines = [
        f"held-out accuracy, greedy episodes ({n_test} problems per set; in range: 4-digit +/-, 3-digit x as in "
        "training; out of range: one digit more), from the same SFT model:",
        "",
        "| RL run | held-out set | SFT start | after RLVR | fixed / broken (sign-test p) | tool calls per episode, "
        "SFT -> RL |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        for held_out in HELD_OUT:
            b, a = results[f"sft|{arm}|{held_out}"], results[f"rlvr_{arm}|{arm}|{held_out}"]
            c = paired[f"{arm}|{held_out}"]
            lines.append(
                f"| {'with calculator' if arm == 'tools' else 'without tools'} | {held_out.replace('_', ' ')} | "
                f"{b['accuracy']:.1%} | **{a['accuracy']:.1%}** ({a['ci95'][0]:.1%}-{a['ci95'][1]:.1%}) | "
                f"+{c['fixed']} / -{c['broken']} (p={c['p_value']:.2g}) | "
                f"{b['tool_calls_per_episode']:.2f} -> {a['tool_calls_per_episode']:.2f} |"
            )
    lines += ["", "the trainer's eval rows (validation sets, greedy; first = rollout step 0, the SFT start):", ""]
    for arm, rows in trainer.items():
        if rows:
            f_, l_ = rows["first"], rows["last"]
            tc = ""
            if "eval/tool_calls_per_episode" in l_:
                tc = (f", eval/tool_calls_per_episode {f_.get('eval/tool_calls_per_episode', 0.0):.2f} -> "
                      f"{l_['eval/tool_calls_per_episode']:.2f}")  # fmt: skip
            lines.append(
                f"  {arm:<9} eval/correct_rate {f_['eval/correct_rate']:.1%} (step {f_.get('rollout_step')}) -> "
                f"{l_['eval/correct_rate']:.1%} (step {l_.get('rollout_step')}){tc}"
            )
    lines += [
        "",
        "wall time: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in timings.items()),
        "CPU time:  "
        + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in cpu.items())
        + f"  ({cpu['total'] / 60:.1f} CPU-minutes)",
    ]
    report = "\n".join(lines)
    summary = {
        "quick": args.quick,
        "seed": args.seed,
        "direct_fraction": args.direct_fraction,
        "direct_ops": args.direct_ops,
        "n_test": n_test,
        "held_out": results,
        "paired_vs_sft": paired,
        "trainer_eval": trainer,
        "models": finals,
        "commands": commands,
        "seconds": timings,
        "cpu_seconds": cpu,
        "report": report,
    }
    title = "# Tool-use RL demo: RLVR with a calculator vs without tools, from the same SFT model"
    write_summary_files(out, summary, f"{title}\n\n{report}\n")
    return summary


if __name__ == "__main__":
    run_demo(main)
