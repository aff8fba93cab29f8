"""Dataset mixtures: a recipe lists sources with an amount each, open-instruct's `dataset_mixer_list` convention.

    dataset_mixer_list: [allenai/tulu-3-sft-mixture, 0.5, data/extra.jsonl, 2000]

Each source (a hub name, a local folder or a .jsonl/.json/.parquet file) is followed by its amount:

- written with a decimal point or an exponent (`1.0`, `0.25`, `5e-1`): a **fraction** in (0, 1] of that source's
  rows, round(fraction x rows) rows (at least one); `1.0` = every row.
- written as an integer (`500`): a **row count** >= 2. A count above the source's size repeats the source: every
  row count // size times, plus a seeded sample of count % size rows (upsampling).
- `1` is refused as ambiguous (open-instruct reads it as the whole source, a count would read one row): write
  `1.0` for every row.

Which rows are taken depends on the seed and the source name only (never the world size, the rank or the order of
the list), so every process and every rerun builds the same mixture. This module imports neither torch nor
datasets: the config, the data loader and the planner all use it.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from open_instruct import integrations
from open_instruct.errors import ConfigError

LOCAL_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_INTEGER = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class MixtureEntry:
    """One source of a mixture: `amount` is a fraction when `is_fraction`, else a row count."""

    source: str  # as written: hub name, folder or file path
    amount: float
    is_fraction: bool
    label: str  # short name for logs and metrics (eval/<label>/...)

    def describe(self) -> str:
        return f"fraction {self.amount:g}" if self.is_fraction else f"count {int(self.amount):,}"


def _parse_amount(token: str, source: str, key: str) -> tuple[float, bool]:
    where = f"{key}: entry {source!r}"
    if _INTEGER.match(token.strip()):
        count = int(token)
        if count < 0:
            raise ConfigError(f"{where}: negative row count {count}")
        if count == 0:
            raise ConfigError(f"{where}: row count 0 takes nothing; remove the source instead")
        if count == 1:
            raise ConfigError(
                f"{where}: amount 1 is ambiguous (one row, or all rows as in open-instruct); write 1.0 for every "
                "row or a count >= 2"
            )
        return float(count), False
    try:
        fraction = float(token)
    except ValueError:
        raise ConfigError(f"{where}: amount {token!r} is neither a fraction (0.5) nor a row count (500)") from None
    if not (fraction == fraction) or fraction in (float("inf"), float("-inf")):
        raise ConfigError(f"{where}: amount {token!r} is not a finite number")
    if fraction <= 0:
        raise ConfigError(f"{where}: fraction {token} must be in (0, 1]")
    if fraction > 1:
        raise ConfigError(
            f"{where}: fraction {token} is above 1.0; write a row count as an integer (e.g. {int(fraction)})"
        )
    return fraction, True


def source_labels(sources: Sequence[str]) -> list[str]:
    """Short, distinct names: a file's or folder's name without its suffix, a hub dataset's last path part; where
    two would clash, the whole name (slashes -> '_'). Metric keys then read eval/<label>/loss."""

    def short(name: str) -> str:
        named = integrations.label(name)  # an integration's source: its own short name (a generated task's)
        if named is not None:
            return named
        base = os.path.basename(name.rstrip("/")) or name
        return os.path.splitext(base)[0] if base.endswith(LOCAL_FILE_SUFFIXES) else base

    shorts = [short(s) for s in sources]
    return [
        sh if shorts.count(sh) == 1 else src.strip("/").replace("/", "_").replace(".", "_")
        for sh, src in zip(shorts, sources)
    ]


def parse_mixer_list(tokens: Sequence[str], key: str = "dataset_mixer_list") -> list[MixtureEntry]:
    """`[source, amount, source, amount, ...]` -> entries. Raises ConfigError naming the entry at fault."""
    tokens = [str(t) for t in tokens]
    if not tokens:
        raise ConfigError(f"{key} is empty; list sources and amounts: [source_a, 1.0, source_b, 500]")
    if len(tokens) % 2:
        raise ConfigError(
            f"{key} must alternate source and amount, got an odd number of items ({len(tokens)}): the last "
            f"source {tokens[-1]!r} has no amount"
        )
    sources, amounts = tokens[0::2], tokens[1::2]
    for source, amount in zip(sources, amounts):
        if _INTEGER.match(source.strip()) or _looks_like_number(source):
            raise ConfigError(f"{key}: expected a source name before amount {amount!r}, got the number {source!r}")
    duplicates = sorted({s for s in sources if sources.count(s) > 1})
    if duplicates:
        raise ConfigError(f"{key}: source(s) {duplicates} listed twice; give each source one amount")
    entries = []
    for source, amount, label in zip(sources, amounts, source_labels(sources)):
        value, is_fraction = _parse_amount(amount, source, key)
        if source.endswith(LOCAL_FILE_SUFFIXES) and not os.path.exists(source):
            raise ConfigError(f"{key}: entry {source!r}: file does not exist")
        entries.append(MixtureEntry(source, value, is_fraction, label))
    return entries


def _looks_like_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def rows_to_take(entry: MixtureEntry, available: int) -> int:
    """How many rows the entry contributes from a source of `available` rows."""
    if entry.is_fraction:
        return max(1, int(round(entry.amount * available)))
    return int(entry.amount)


def select_rows(entry: MixtureEntry, available: int, seed: int) -> list[int]:
    """Row indices (in file order, repeats allowed when upsampling) the entry takes from its source.

    A fraction or a count below the size takes a seeded sample without replacement; a larger count takes every row
    count // size times plus a seeded sample of the remainder. Seeded by (seed, source name) only."""
    want = rows_to_take(entry, available)
    order = list(range(available))
    random.Random(f"mixture:{seed}:{entry.source}").shuffle(order)
    copies, rest = divmod(want, available)
    return sorted(list(range(available)) * copies + order[:rest])


def mixture_summary(entries: Sequence[MixtureEntry], available: Sequence[Optional[int]]) -> list[dict]:
    """Rows per source for the planner and the start-up summary: label, source, amount, available, rows."""
    out = []
    for entry, n in zip(entries, available):
        rows = rows_to_take(entry, n) if n is not None else (None if entry.is_fraction else int(entry.amount))
        out.append(
            {"source": entry.source, "label": entry.label, "amount": entry.describe(), "available": n, "rows": rows}
        )
    return out
