"""A synthetic verifiable task (small arithmetic word problems) for tests, the demo and the benchmarks.

    python -m demo.synthetic output/tiny     # tiny models + sft/preference/rl jsonl files

Every problem has an exact integer answer that the `arithmetic` verifier checks (the last integer in the
response). Responses are short ("3+4=7") so a character-level model of ~100k parameters can learn them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any, Optional

NAMES = ["Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal"]
ITEMS = ["apples", "pens", "cards", "shells", "coins", "books"]


def make_problem(rng: random.Random, max_operand: int = 9) -> dict[str, Any]:
    """One problem: question text, the worked answer line and the integer answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} now?"
        answer, work = a + b, f"{a}+{b}={a + b}"
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and gives away {b}. How many {item} now?"
        answer, work = a - b, f"{a}-{b}={a - b}"
    return {"question": question, "work": work, "answer": answer}


def wrong_work(problem: dict[str, Any], rng: random.Random) -> str:
    """The same working with a wrong final number (for rejected responses)."""
    lhs = problem["work"].split("=")[0]
    wrong = problem["answer"] + rng.choice([-3, -2, -1, 1, 2, 3])
    return f"{lhs}={wrong}"


def sft_rows(n: int, seed: int, max_operand: int = 9) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p = make_problem(rng, max_operand)
        rows.append(
            {
                "id": f"sft-{seed}-{i}",
                "messages": [{"role": "user", "content": p["question"]}, {"role": "assistant", "content": p["work"]}],
            }
        )
    return rows


def noisy_sft_rows(n: int, seed: int, off_by_one: float) -> list[dict[str, Any]]:
    """SFT rows of which a fraction `off_by_one` answers one too many ("3+4=8"): a model SFT'd on them copies the
    operands but puts only part of its mass on the right result, which RL can then fix (tests, RL comparisons)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p = make_problem(rng)
        work = p["work"]
        if rng.random() < off_by_one:
            work = f"{work.split('=')[0]}={p['answer'] + 1}"
        messages = [{"role": "user", "content": p["question"]}, {"role": "assistant", "content": work}]
        rows.append({"id": f"noisy-{i}", "messages": messages})
    return rows


def preference_rows(n: int, seed: int, max_operand: int = 9) -> list[dict[str, Any]]:
    """chosen = correct working, rejected = the same working with a wrong result."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p = make_problem(rng, max_operand)
        prompt = [{"role": "user", "content": p["question"]}]
        rows.append(
            {
                "id": f"pref-{seed}-{i}",
                "chosen": prompt + [{"role": "assistant", "content": p["work"]}],
                "rejected": prompt + [{"role": "assistant", "content": wrong_work(p, rng)}],
            }
        )
    return rows


def rl_row(row_id: str, problem: dict[str, Any]) -> dict[str, Any]:
    """An RL prompt row: the question as a user message, the answer as the `arithmetic` verifier's ground truth."""
    messages = [{"role": "user", "content": problem["question"]}]
    return {"id": row_id, "messages": messages, "ground_truth": str(problem["answer"]), "dataset": "arithmetic"}


def rl_rows(n: int, seed: int, max_operand: int = 9) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [rl_row(f"rl-{seed}-{i}", make_problem(rng, max_operand)) for i in range(n)]


def code_rl_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Synthetic programming tasks for the `code` verifier: "write f(x) returning x + k" (k in 0..3) with three
    assert tests (f(0) == k, f(1) == 1 + k, f(5) == 5 + k), or every other row a stdin/stdout version (print the
    number read plus k). The tiny model will not solve them; they exercise the verifier inside the RL loop."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(0, 3)
        if i % 2 == 0:
            question = f"Write a Python function f(x) that returns x + {k}."
            truth: Any = [f"assert f({x}) == {x + k}" for x in (0, 1, 5)]
        else:
            question = f"Write a Python program that reads an integer and prints it plus {k}."
            truth = [{"input": f"{x}\n", "output": f"{x + k}\n"} for x in (0, 1, 5)]
        rows.append(
            {
                "id": f"code-{seed}-{i}",
                "messages": [{"role": "user", "content": question}],
                "ground_truth": json.dumps(truth),
                "dataset": "code",
            }
        )
    return rows


# A broader family for generalisation (the SmolLM2 demo): training and held-out problems differ in phrasing and in
# operand ranges, so a held-out gain is not template fitting. {n} name, {i} item, {a} {b} operands.
BROAD_TEMPLATES = {
    "train": {
        "+": [
            "{n} has {a} {i} and gets {b} more. How many {i} now?",
            "{n} collected {a} {i} on Monday and {b} on Tuesday. How many {i} in total?",
            "What is {a} plus {b}?",
        ],
        "-": [
            "{n} has {a} {i} and gives away {b}. How many {i} now?",
            "A box held {a} {i}. {n} took {b} out. How many {i} are left in the box?",
            "What is {a} minus {b}?",
        ],
        "*": ["{n} has {a} bags with {b} {i} in each. How many {i} in all?", "What is {a} times {b}?"],
    },
    "held_out": {
        "+": ["After buying {b} more {i}, {n}, who started with {a}, owns how many {i}?", "Add {a} and {b}."],
        "-": ["{n} owed {a} {i} and paid back {b}. How many {i} does {n} still owe?", "Subtract {b} from {a}."],
        "*": ["There are {a} rows of chairs with {b} chairs per row. How many chairs?", "Multiply {a} by {b}."],
    },
}
# (low, high) operand ranges per operation: held-out sums and differences use larger numbers than training.
BROAD_RANGES = {
    "train": {"+": (1, 30), "-": (1, 30), "*": (2, 9)},
    "held_out": {"+": (31, 60), "-": (31, 60), "*": (11, 15)},
}


def broad_problem(rng: random.Random, split: str) -> dict[str, Any]:
    """A word problem of the broad family: split 'train' or 'held_out' picks the templates and operand ranges."""
    op = rng.choice(["+", "-", "*"])
    low, high = BROAD_RANGES[split][op]
    a = rng.randint(low, high)
    b = rng.randint(2, 9) if op == "*" else rng.randint(low, high)  # a product's second factor stays small
    if op == "-":
        a, b = max(a, b), min(a, b)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    template = rng.choice(BROAD_TEMPLATES[split][op])
    question = template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
    return {"question": question, "work": f"{a}{op}{b}={answer}", "answer": answer}


def broad_rl_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """RL prompt rows of the broad family (messages + ground truth + dataset=arithmetic)."""
    rng = random.Random(seed)
    return [rl_row(f"broad-{split}-{seed}-{i}", broad_problem(rng, split)) for i in range(n)]


# Tool use (demo/tools.py): arithmetic on operands too large for a small model to do in its head, answered through
# the `calculator` tool of environments.ToolEnvironment. Questions name the operation in words or symbols; held-out
# sets: unseen problems of the training templates and ranges, and problems with larger operands ("out of range").
TOOL_TEMPLATES = {
    "train": ["What is {a}{op}{b}?", "Compute {a}{op}{b}."],
    "held_out": ["Calculate {a} {op} {b}, please.", "How much is {a} {op} {b}?"],
}
# Operand ranges per operation: "train" for SFT, RL and the in-range held-out set; "out_of_range" one digit more.
# Training operands have a fixed width, so a question's digits sit at a fixed distance from where the tool call copies
# them: a 2-layer character-level model learns that copy (with 100..9999 it had not in the same steps).
TOOL_RANGES = {
    "train": {"+": (1000, 9999), "-": (1000, 9999), "*": (100, 999)},
    "out_of_range": {"+": (10000, 99999), "-": (10000, 99999), "*": (1000, 9999)},
}
CALCULATOR = "calculator"


def tool_problem(rng: random.Random, ranges: str = "train", templates: str = "train") -> dict[str, Any]:
    """One problem: question, the calculator expression ("1234*567") and the integer answer."""
    op = rng.choice(["+", "-", "*"])
    low, high = TOOL_RANGES[ranges][op]
    a, b = rng.randint(low, high), rng.randint(low, high)
    if op == "-":
        a, b = max(a, b), min(a, b)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = rng.choice(TOOL_TEMPLATES[templates]).format(a=a, b=b, op=op)
    expression = f"{a}{op}{b}"
    return {"question": question, "expression": expression, "answer": answer}


def calculator_call(expression: str) -> dict[str, Any]:
    """An OpenAI-style tool call of the calculator (what a chat template renders as `<tool_call>{json}</tool_call>`)."""
    return {"type": "function", "function": {"name": CALCULATOR, "arguments": {"expression": expression}}}


def head_answer(problem: dict[str, Any], rng: random.Random) -> int:
    """A wrong answer of the kind a model computing in its head gives: the right leading digits, the last one or
    two wrong."""
    answer = problem["answer"]
    wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 99 if abs(answer) >= 100 else 9)
    return wrong if wrong != answer else answer + 1


def tool_sft_rows(
    n: int, seed: int, direct_fraction: float = 0.25, wrong_fraction: float = 0.5, direct_ops: str = "+-*"
) -> list[dict]:
    """Multi-turn tool-call traces: user question -> assistant calls the calculator -> `tool` message with the
    result -> the assistant's final answer, the number ("699678"). For problems whose operation is in `direct_ops`,
    a fraction `direct_fraction` of the rows instead answers at once, without the tool, and `wrong_fraction` of
    those answers wrongly (head_answer): the SFT model then skips the tool on such problems (under greedy decoding
    when direct_fraction > 0.5), and RL has that to improve."""
    problem = direct_answer_error(direct_fraction, direct_ops, wrong_fraction)
    if problem:
        raise ValueError(problem)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p = tool_problem(rng)
        user = {"role": "user", "content": p["question"]}
        # the same draws on every row, so the problems do not depend on direct_ops or the fractions
        direct, wrong, guess = rng.random() < direct_fraction, rng.random() < wrong_fraction, head_answer(p, rng)
        if direct and problem_op(p) in direct_ops:
            answer = guess if wrong else p["answer"]
            messages = [user, {"role": "assistant", "content": str(answer)}]
        else:
            messages = [
                user,
                {"role": "assistant", "content": "", "tool_calls": [calculator_call(p["expression"])]},
                {"role": "tool", "content": str(p["answer"])},
                {"role": "assistant", "content": str(p["answer"])},
            ]
        rows.append({"id": f"tool-sft-{seed}-{i}", "messages": messages})
    return rows


def direct_answer_error(direct_fraction: float, direct_ops: str, wrong_fraction: float = 0.5) -> Optional[str]:
    """What is wrong with tool_sft_rows' direct-answer settings, or None."""
    if not 0.0 <= direct_fraction <= 1.0 or not 0.0 <= wrong_fraction <= 1.0:
        return f"direct_fraction and wrong_fraction must be in [0, 1], got {direct_fraction} and {wrong_fraction}"
    if not direct_ops or set(direct_ops) - set("+-*"):
        return f"direct_ops must be a non-empty string of the operations +, - and *, got {direct_ops!r}"
    return None


def problem_op(problem: dict[str, Any]) -> str:
    """The operation of a tool_problem ("+", "-" or "*"), read from its expression."""
    return next(c for c in problem["expression"] if c in "+-*")


def tool_rl_rows(n: int, seed: int, ranges: str = "train", templates: str = "train") -> list[dict[str, Any]]:
    """RL prompt rows (messages + ground_truth + dataset=arithmetic) of tool problems; the same rows serve the run
    with the calculator environment and the run without tools."""
    rng = random.Random(seed)
    return [rl_row(f"tool-{ranges}-{templates}-{seed}-{i}", tool_problem(rng, ranges, templates)) for i in range(n)]


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_task_files(out_dir: str, n_train: int = 2000, n_eval: int = 200, seed: int = 0) -> dict[str, str]:
    """Train/eval files for each stage. Eval problems use another seed (held out)."""
    files = {
        "sft_train": write_jsonl(os.path.join(out_dir, "sft_train.jsonl"), sft_rows(n_train, seed)),
        "sft_eval": write_jsonl(os.path.join(out_dir, "sft_eval.jsonl"), sft_rows(n_eval, seed + 1)),
        "pref_train": write_jsonl(os.path.join(out_dir, "pref_train.jsonl"), preference_rows(n_train, seed + 2)),
        "pref_eval": write_jsonl(os.path.join(out_dir, "pref_eval.jsonl"), preference_rows(n_eval, seed + 3)),
        "rl_train": write_jsonl(os.path.join(out_dir, "rl_train.jsonl"), rl_rows(n_train, seed + 4)),
        "rl_eval": write_jsonl(os.path.join(out_dir, "rl_eval.jsonl"), rl_rows(n_eval, seed + 5)),
    }
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--n_train", type=int, default=2000)
    parser.add_argument("--n_eval", type=int, default=200)
    args = parser.parse_args()
    from demo.tiny import save_tiny_models

    for name, path in save_tiny_models(os.path.join(args.out_dir, "models")).items():
        print(f"{name}: {path}")
    for name, path in write_task_files(os.path.join(args.out_dir, "data"), args.n_train, args.n_eval).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
