"""The training correct rate per group of prompts (`correct_rate_by`): train/correct_rate/<group> and
train/completions/<group> in every log row, beside the overall train/correct_rate.

A group is a prompt's value of one column (a dotted path reaches into a nested one: `problem.shape`), or `source`,
the dataset a prompt came from (a mixture's sources). The overall rate can hide one group collapsing while the others
rise; the per-group rates show the rollout it happens. The groups are every value the training prompts hold, fixed
at start, so every rank sums the same keys (distributed.global_sums); a group the rollout did not draw has no rate
in that row (its completions count is 0). Training prompts without the column form the group `(missing)`; held-out
prompts need none.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from open_instruct.errors import ConfigError

SOURCE = "source"  # the group of a prompt by the dataset it came from (data.tokenize_prompts' row label)
MISSING = "(missing)"  # the group of the training prompts that lack the column (a mixture's other sources)


def group_of(data: dict, label: str, path: str) -> Optional[str]:
    """The prompt row's group: its value at the dotted `path` (as a string), or its dataset label for `source`;
    None when a step of the path is missing."""
    if path == SOURCE:
        return label
    value: Any = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return str(value)


class CorrectRateByGroup:
    """rollout_sums and metrics hooks (rlvr_ppo.Feature) over the groups the training prompts hold; a ConfigError
    when none holds the column (a misspelt name), before any model loads."""

    def __init__(self, cfg: Any, train: Sequence[dict]):
        found = {e["rate_group"] for e in train if "rate_group" in e}
        if not found:
            where = f" (the first: {train[0]['where']})" if train else ""
            raise ConfigError(f"correct_rate_by {cfg.correct_rate_by!r}: no training prompt has it{where}")
        self.groups = sorted(found) + ([MISSING] if any("rate_group" not in e for e in train) else [])

    def rollout_sums(self, rollout: Any) -> dict[str, float]:
        sums = {f"correct_by/{g}": 0.0 for g in self.groups} | {f"count_by/{g}": 0.0 for g in self.groups}
        for episode, correct in zip(rollout.episodes, rollout.correct):
            group = episode.get("rate_group", MISSING)
            sums[f"correct_by/{group}"] += float(correct)
            sums[f"count_by/{group}"] += 1.0
        return sums

    def metrics(self, cfg: Any, rollout: Any, sums: dict, train: dict, updates: float, _: Any) -> dict[str, float]:
        row = {}
        for g in self.groups:
            n = sums[f"count_by/{g}"]
            row[f"train/completions/{g}"] = n
            if n:
                row[f"train/correct_rate/{g}"] = sums[f"correct_by/{g}"] / n
        return row
