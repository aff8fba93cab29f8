"""Metrics: every log row to <output_dir>/metrics.jsonl (and wandb when tracking), a tqdm bar with the step's key
numbers and a line per evaluation (console.py), sample tables.

Rows carry the four counters (episode, optimizer_step, rollout_step, epoch). On resume the file is cut back
to the rows at or before the checkpoint, so a resumed run's file equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from open_instruct import console, run_dir


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a crash: everything before it is intact
    return rows


def rewrite_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    """Atomic rewrite (temp file + rename): a full disk leaves the original file untouched."""
    run_dir.write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


class MetricsLogger:
    def __init__(
        self,
        cfg: Any,
        is_main: bool,
        total_steps: int,
        counter: str = "optimizer_step",
        resume_step: Optional[int] = None,
        desc: str = "train",
    ):
        self.is_main = is_main
        self.counter = counter
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(cfg.output_dir, "samples.jsonl")
        self.wandb = None
        self.bar = None
        if not is_main:
            return
        os.makedirs(cfg.output_dir, exist_ok=True)
        start = resume_step or 0
        # Rows past the checkpoint were written by the run that died; they will be written again.
        for path in (self.path, self.samples_path):
            if os.path.exists(path):
                rewrite_jsonl(path, [r for r in read_jsonl(path) if r.get(counter, 0) <= start] if resume_step else [])
        if cfg.with_tracking:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project,
                entity=cfg.wandb_entity,
                name=cfg.exp_name,
                config=vars(cfg),
                dir=cfg.output_dir,
                resume="allow",
                id=_run_id(cfg.output_dir),
            )
            self.wandb.define_metric("*", step_metric=counter)
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start, desc=desc, unit="step", dynamic_ncols=True)

    def log(self, row: dict[str, Any]) -> None:
        if not self.is_main:
            return
        row = {k: _jsonable(v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        run_dir.fault_point("metrics_row", row.get(self.counter))
        if self.wandb is not None:
            self.wandb.log(row)
        if self.bar is not None:
            shown = console.bar_postfix(row)  # the step's key numbers (loss, DPO/RM accuracy and margin, RL correct/KL)
            if shown:
                self.bar.set_postfix(shown)
        line = console.eval_line(row, self.counter)
        if line is not None:
            self.write(line)

    def log_samples(self, samples: list[dict[str, Any]], counters: dict[str, Any]) -> None:
        if not self.is_main or not samples:
            return
        with open(self.samples_path, "a") as f:
            for s in samples:
                f.write(json.dumps({**counters, **{k: _jsonable(v) for k, v in s.items()}}) + "\n")
        if self.wandb is not None:
            import wandb

            columns = sorted(samples[0])
            table = wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])
            self.wandb.log({"samples": table, **counters})

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, message: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def _run_id(output_dir: str) -> str:
    """A wandb run id stored in the output folder, so a resumed run continues the same wandb run."""
    path = os.path.join(output_dir, ".wandb_run_id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        f.write(run_id)
    return run_id
