"""Summarise a run's per-test times (conftest.py writes them with OPEN_INSTRUCT_TEST_TIMES=DIR):

    OPEN_INSTRUCT_TEST_TIMES=/tmp/times .venv/bin/python -m pytest -q tests
    .venv/bin/python tests/_test_times.py /tmp/times [--top 30]

CPU seconds are what a test costs whatever else runs on the machine; the per-file totals show which file bounds a
run split by file over the cores (pytest-xdist --dist loadfile)."""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    rows = [json.loads(line) for path in glob.glob(os.path.join(args.dir, "*.jsonl")) for line in open(path)]
    per_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = per_file[r["test"].split("::")[0]]
        f[0] += r["wall_s"]
        f[1] += r["cpu_s"]
        f[2] += 1
    wall, cpu = sum(r["wall_s"] for r in rows), sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests: wall {wall / 60:.1f} min summed over workers, CPU {cpu / 60:.1f} min")
    print(f"\nfiles by CPU time\n{'cpu_min':>8} {'wall_min':>8} {'tests':>5}  file")
    for name, (w, c, n) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
        print(f"{c / 60:8.2f} {w / 60:8.2f} {n:5d}  {name}")
    print(f"\nslowest {args.top} tests by CPU time\n{'cpu_s':>7} {'wall_s':>7}  test")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[: args.top]:
        print(f"{r['cpu_s']:7.1f} {r['wall_s']:7.1f}  {r['test']}")


if __name__ == "__main__":
    main()
