"""How public code benchmarks' tests are judged by the `code` verifier (the value path, or unmodified in lock-step), and
whether every reference solution scores 1, from local copies of the datasets (nothing is downloaded):

    python bench/bench_code_datasets.py --humaneval HumanEval.jsonl.gz --mbpp_sanitized sanitized-mbpp.json \
        --mbpp_plus MbppPlus-OriginFmt.jsonl.gz --humaneval_plus HumanEvalPlus-OriginFmt.jsonl.gz [--score] \
        [--workers 2] [--limit N]

    HumanEval       openai/human-eval data/HumanEval.jsonl.gz: ground truth {"test", "entry_point"} as stored (the
                    `check(candidate)` without its call); reference = prompt + canonical_solution
    sanitized MBPP  google-research mbpp/sanitized-mbpp.json: {"test_list", "test_imports"}; reference = code
    HumanEval+      evalplus/humanevalplus_release HumanEvalPlus-OriginFmt.jsonl.gz: ground truth {"test",
                    "entry_point"} as stored (the EvalPlus `assertion()` harness inside `check(candidate)`); reference =
                    prompt + canonical_solution (read as HumanEval's)
    MBPP+           evalplus/mbppplus_release MbppPlus-OriginFmt.jsonl.gz (the Hugging Face evalplus/mbppplus rows):
                    {"test"}, the EvalPlus `assertion()` harness over inputs/results; reference = code

Reported per dataset (one JSON line each): rows, tests, tests on the value path and their share, tests run whole in
lock-step, rows with script tests (none since lock-step), rows that are bad ground truth (with the first reasons), and
with --score the reference solutions scoring 1 and the rows that do not.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import time
from typing import Any, Iterator

from open_instruct.code_verifier import CodeSettings, count_test_paths, parse_code_tests, score_programs


def _lines(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from f


def humaneval(path: str) -> list[tuple[str, Any, str]]:
    rows = [json.loads(line) for line in _lines(path) if line.strip()]
    return [
        (r["task_id"], {"test": r["test"], "entry_point": r["entry_point"]}, r["prompt"] + r["canonical_solution"])
        for r in rows
    ]


def mbpp_sanitized(path: str) -> list[tuple[str, Any, str]]:
    rows = json.loads("".join(_lines(path)))
    return [
        (str(r["task_id"]), {"test_list": r["test_list"], "test_imports": r.get("test_imports") or []}, r["code"])
        for r in rows
    ]


def mbpp_plus(path: str) -> list[tuple[str, Any, str]]:
    rows = [json.loads(line) for line in _lines(path) if line.strip()]
    return [(str(r["task_id"]), {"test": r["test"]}, r["code"]) for r in rows]


def measure(name: str, rows: list[tuple[str, Any, str]], score: bool, workers: int) -> dict:
    paths, bad, script_rows, parsed = collections.Counter(), {}, 0, []
    for task, truth, reference in rows:
        try:
            tests = parse_code_tests(truth)
        except ValueError as e:
            bad[task] = str(e)[:160]
            continue
        paths += count_test_paths(tests)
        script_rows += bool(tests.scripts)
        parsed.append((task, truth, reference))
    total = sum(paths.values())
    report = {
        "dataset": name,
        "rows": len(rows),
        "tests": total,
        "value_tests": paths["value"],
        "whole_tests": paths["whole"],  # run unmodified in lock-step
        "value_share": round(paths["value"] / total, 4) if total else 0.0,
        "rows_with_script_tests": script_rows,
        "bad_rows": len(bad),
        "bad_examples": dict(list(bad.items())[:5]),
    }
    if score:
        settings = CodeSettings(workers=workers, allow_script_tests=True, batch_timeout=None, max_tests=10_000)
        start, failing = time.monotonic(), {}
        for first in range(0, len(parsed), 20):  # in chunks, with progress on stderr (MBPP+ has ~40k tests)
            chunk = parsed[first : first + 20]
            outcomes = score_programs([f"```python\n{r}\n```" for _, _, r in chunk], [t for _, t, _ in chunk], settings)
            for (task, _, _), outcome in zip(chunk, outcomes):
                if set(outcome.statuses) != {"pass"}:
                    failing[task] = dict(collections.Counter(outcome.statuses))
            done = first + len(chunk)
            print(
                f"{name}: {done} of {len(parsed)} scored, {len(failing)} not 1: {failing}", file=sys.stderr, flush=True
            )
        report.update(
            references_scored=len(parsed),
            references_scoring_1=len(parsed) - len(failing),
            references_failing=dict(list(failing.items())[:10]),
            score_seconds=round(time.monotonic() - start, 1),
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--humaneval")
    parser.add_argument("--mbpp_sanitized")
    parser.add_argument("--mbpp_plus")
    parser.add_argument("--humaneval_plus")
    parser.add_argument("--score", action="store_true", help="also run every reference solution")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="first N rows of each dataset")
    args = parser.parse_args()
    for name, path, reader in (
        ("HumanEval", args.humaneval, humaneval),
        ("sanitized MBPP", args.mbpp_sanitized, mbpp_sanitized),
        ("MBPP+", args.mbpp_plus, mbpp_plus),
        ("HumanEval+", args.humaneval_plus, humaneval),
    ):
        if path:
            rows = reader(path)[: args.limit]
            print(json.dumps(measure(name, rows, args.score, args.workers)), flush=True)


if __name__ == "__main__":
    main()
