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
from typing import Any

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
