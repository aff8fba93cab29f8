"""`code` verifier throughput: responses verified per second with N sandbox workers (default 2, the 2-core machine).

    python bench/bench_code_verifier.py [--responses 256] [--workers 2] [--repeats 2] [--stdio_share 0.25] \
        [--check_share 0.0]

Workload: --responses synthetic responses to "f(x) = x + k" tasks (demo.synthetic.code_rl_rows' shapes, 3 tests
each): a --stdio_share of them stdin/stdout tasks, the rest assert tasks; half the programs right, a quarter wrong,
an eighth with a syntax error and an eighth that raise, as an early policy writes. A --check_share of the assert tasks
store their 3 asserts as HumanEval does (`check(candidate)` + entry_point): one test run unmodified in lock-step (a
test process and the program's process), where the plain asserts are 3 value tests. Each response is one sandbox start
(an isolated supervisor), which gives each of its 3 tests a clean interpreter of its own (a run: a fork of the
supervisor taken before the program ran). No program runs long, so the figure is the sandbox's per-response cost,
which is what bounds a batch of 256.

Reported (one JSON line): responses/s and processes/s for the whole batch through rewards.score_batch (the trainer's
path), the mean seconds of one trivial sandboxed call (the planner's --sandbox_call_seconds), the isolation mode, and
the CPU seconds per response (trainer side + sandboxes: what the rate would be bounded by on idle cores), and the
machine's load average (the wall-clock rate moves with other jobs on a shared machine; the CPU cost barely does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time

from open_instruct import rewards, sandbox
from open_instruct.code_verifier import CodeSettings

PROGRAMS = {
    "right_assert": "```python\ndef f(x):\n    return x + {k}\n```",
    "right_stdio": "```python\nprint(int(input()) + {k})\n```",
    "wrong_assert": "```python\ndef f(x):\n    return x - {k} - 1\n```",
    "wrong_stdio": "```python\nprint(int(input()) - {k} - 1)\n```",
    "syntax": "```python\ndef f(x)\n    return x + {k}\n```",
    "raises": "```python\ndef f(x):\n    raise ValueError({k})\nraise SystemExit(f(0))\n```",
}


def workload(n: int, stdio_share: float, seed: int = 0, check_share: float = 0.0) -> tuple[list[str], list[str], int]:
    """(responses, ground truths, test interpreters they need: one per test)."""
    rng = random.Random(seed)
    responses, truths, processes = [], [], 0
    for i in range(n):
        k = rng.randint(0, 3)
        stdio = rng.random() < stdio_share
        if stdio:
            truth = [{"input": f"{x}\n", "output": f"{x + k}\n"} for x in (0, 1, 5)]
        elif rng.random() < check_share:
            check = "def check(candidate):\n" + "".join(f"    assert candidate({x}) == {x + k}\n" for x in (0, 1, 5))
            truth = {"test": check, "entry_point": "f"}
        else:
            truth = [f"assert f({x}) == {x + k}" for x in (0, 1, 5)]
        kind = ["right", "right", "right", "right", "wrong", "wrong", "syntax", "raises"][i % 8]
        if kind in ("right", "wrong"):
            kind = f"{kind}_{'stdio' if stdio else 'assert'}"
        responses.append(PROGRAMS[kind].format(k=k))
        truths.append(json.dumps(truth))
        processes += 3
    return responses, truths, processes


def cpu_seconds() -> float:
    """CPU time of this process and of every child it has waited for (unshare waits for the supervisor, which waits
    for the program: their time adds up here), user + system."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stdio_share", type=float, default=0.25)
    parser.add_argument("--check_share", type=float, default=0.0, help="assert tasks stored as check(candidate)")
    args = parser.parse_args()

    iso = sandbox.isolation()
    call_seconds = sandbox.measure_call_seconds(8)
    responses, truths, processes = workload(args.responses, args.stdio_share, check_share=args.check_share)
    settings = CodeSettings(workers=args.workers)
    rates, cpu = [], []
    for _ in range(args.repeats):
        cpu_start = cpu_seconds()
        start = time.perf_counter()
        scored = rewards.score_batch(responses, truths, "code", verification_reward=1.0, code=settings)
        rates.append(len(responses) / (time.perf_counter() - start))
        cpu.append((cpu_seconds() - cpu_start) / len(responses))
    print(
        json.dumps(
            {
                "responses": len(responses),
                "sandbox_starts": len(responses),
                "test_interpreters": processes,
                "workers": args.workers,
                "responses_per_second": round(statistics.median(rates), 2),
                "tests_per_second": round(statistics.median(rates) * processes / len(responses), 2),
                "all_rates": [round(r, 2) for r in rates],
                "sandbox_call_seconds": round(call_seconds, 3),
                "cpu_seconds_per_response": round(statistics.median(cpu), 4),
                "correct_rate": sum(scored.correct) / len(responses),
                "statuses": scored.code_statuses,
                "isolation": iso.mode,
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
