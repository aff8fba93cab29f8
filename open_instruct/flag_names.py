"""Option names researchers bring from other libraries, and what to write here instead: the tables are data
(flag_names.yaml beside this file, read once at import), read by the config parser's unknown-key message (`hint`)
and shown in docs/porting.md (`markdown_table`, `unsupported_table`, `differences_table`; tests/test_flag_names.py
checks that the page holds exactly these tables, so the two cannot drift).

    python -m open_instruct.flag_names      # prints the porting tables

This module imports only batch_math from the project (the config module imports it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import yaml

from open_instruct import batch_math


@dataclass(frozen=True)
class ForeignName:
    """One option name from another library: where it comes from, what to write here, and which of our keys that
    uses (`keys`: every one must be an option of some script here; tests/test_flag_names.py checks)."""

    name: str
    libraries: tuple[str, ...]
    here: str
    keys: tuple[str, ...] = ()
    note: str = ""


def _load() -> dict:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_names.yaml")) as f:
        return yaml.safe_load(f)


_DATA = _load()
TRL = _DATA["libraries"]["TRL"]
FOREIGN_NAMES: tuple[ForeignName, ...] = tuple(
    ForeignName(
        e["name"],
        tuple(_DATA["libraries"][lib] for lib in e["from"]),
        e["here"],
        tuple(e.get("keys", ())),
        e.get("note", ""),
    )
    for e in _DATA["foreign_names"]
)
_BY_NAME = {f.name: f for f in FOREIGN_NAMES}
assert len(_BY_NAME) == len(FOREIGN_NAMES), "a name is listed twice"
# Options of TRL's GRPOConfig (and the HF TrainingArguments it extends) with no counterpart here -> why.
UNSUPPORTED: dict[str, str] = {name: group["why"] for group in _DATA["unsupported"] for name in group["names"]}
_overlap = set(UNSUPPORTED) & set(_BY_NAME)
assert not _overlap, f"names both mapped and unsupported: {_overlap}"
# TRL GRPOConfig's defaults where ours differ: (name here, ours, TRL's, what to write for TRL's behaviour).
TRL_GRPO_DIFFERENCES: tuple[tuple[str, str, str, str], ...] = tuple(tuple(row) for row in _DATA["trl_grpo_differences"])


def lookup(key: str) -> Optional[ForeignName]:
    """The table's entry for an option name (as typed, dashes read as underscores), or None."""
    return _BY_NAME.get(key.replace("-", "_"))


def hint(key: str, script_keys: Iterable[str], script: str, given: Optional[dict] = None) -> Optional[str]:
    """What to write instead of another library's option `key`, or None when the table does not know it. Says so
    when the replacement is not an option of this script (`script_keys`: its option names). `given`: every unknown
    key of the run with its value, for hints that depend on another of them (TRL's max_steps and num_iterations)."""
    entry = lookup(key)
    if entry is None:
        reason = UNSUPPORTED.get(key.replace("-", "_"))
        return f"{key!r} is TRL / HF TrainingArguments' name, not supported here: {reason}" if reason else None
    if entry.name == "max_steps" and script == "rlvr_ppo":
        return _max_steps_hint(given or {})
    text = f"{key!r} is {' / '.join(entry.libraries)}'s name; here: {entry.here.replace('`', '')}"
    if entry.note:
        text += f" ({entry.note.replace('`', '')})"
    keys = set(script_keys)
    if entry.keys and not any(k in keys for k in entry.keys):
        text += f"; {' / '.join(entry.keys)} is not an option of {script}.py"
    return text


def _number(value: object) -> Optional[float]:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _max_steps_hint(given: dict) -> str:
    """TRL's max_steps counts optimizer steps; each generated completion is trained on num_iterations times, so the
    completions generated (our total_episodes) = max_steps x global batch / num_iterations."""
    steps, iterations = _number(given.get("max_steps")), _number(given.get("num_iterations", 1)) or 1.0
    formula = (
        "total_episodes = max_steps x per_device_train_batch_size x gradient_accumulation_steps x processes / "
        "num_iterations (completions generated; each is trained on num_epochs = num_iterations times)"
    )
    text = f"'max_steps' is HF TrainingArguments / TRL's name; here: --total_episodes N, {formula}"
    per_device, accumulation = (
        _number(given.get("per_device_train_batch_size")),
        _number(given.get("gradient_accumulation_steps", 1)),
    )
    if steps and per_device and accumulation:
        episodes = steps * per_device * accumulation / iterations
        text += f"; here {steps:g} x {per_device:g} x {accumulation:g} x processes / {iterations:g} = "
        text += f"{episodes:g} x processes"
    return text


TRL_DEFAULT_EPOCHS = 3.0  # HF TrainingArguments' num_train_epochs, TRL's run length when max_steps is unset


def epochs_as_total_episodes(epochs: float, prompts: Optional[int], completions_per_prompt: int) -> str:
    """TRL's / HF's run length in passes over the prompts (num_train_epochs), as the completions RL counts here: one
    pass generates num_samples_per_prompt (TRL: num_generations) completions for every prompt."""
    if prompts is None:
        return (
            f"{epochs:g} epochs x (the prompts in the dataset) x {completions_per_prompt} completions = "
            f"--total_episodes {epochs:g} x prompts x {completions_per_prompt}"
        )
    total = epochs * prompts * completions_per_prompt
    return (
        f"{epochs:g} epochs x {prompts} prompts x {completions_per_prompt} completions = --total_episodes "
        f"{int(total) if total == int(total) else math.floor(total)}"
    )


# Our keys that make TRL's batch shape (batch_math.trl_grpo_shape computes their values from the recipe's numbers)
TRL_SHAPE_KEYS = ("num_samples_per_prompt", "local_rollout_batch_size", "num_epochs")
# TRL's names whose value is ours as it is: the hint's rename is enough, the shape line does not repeat them
_RENAMED_AS_IS = {"num_epochs": "num_iterations", "num_samples_per_prompt": "num_generations"}


def _set_here(key: str, given: dict) -> bool:
    """Whether the recipe sets our `key`, under our name or a foreign name the table maps to it."""
    return key in given or any(lookup(k) is not None and key in lookup(k).keys for k in given)  # type: ignore[union-attr]


def _int_of(given: dict, name: str, default: Optional[int]) -> Optional[int]:
    """The recipe's positive whole number for `name`, else `default` (a bad value gets its own error later)."""
    value = _number(given.get(name))
    return int(value) if value is not None and value >= 1 and value == int(value) else default


def trl_shape_line(given: dict) -> str:
    """TRL's batch shape for the recipe's numbers (TRL's defaults where it sets none) and the settings here that train
    the same run, those the recipe does not already write; or what cannot match."""
    shape = batch_math.trl_grpo_shape(
        per_device_train_batch_size=_int_of(given, "per_device_train_batch_size", 8),
        gradient_accumulation_steps=_int_of(given, "gradient_accumulation_steps", 1),
        num_generations=_int_of(given, "num_generations", 8),
        num_iterations=_int_of(given, "num_iterations", 1),
        steps_per_generation=_int_of(given, "steps_per_generation", None),
        generation_batch_size=_int_of(given, "generation_batch_size", None),
        max_steps=_int_of(given, "max_steps", None),
    )
    per_generation = shape.optimizer_steps_per_generation
    text = (
        "TRL's batch shape on 1 process (P processes: completions and total_episodes x P): "
        f"{shape.completions_per_generation} completions per generation (per_device_train_batch_size "
        f"{shape.per_device_train_batch_size} x steps_per_generation {shape.steps_per_generation}), "
        f"{per_generation:g} optimizer steps per generation (steps_per_generation x num_iterations "
        f"{shape.num_iterations} / gradient_accumulation_steps {shape.gradient_accumulation_steps})"
    )
    if shape.max_steps is not None:
        text += f", {shape.max_steps} optimizer steps in all"
    else:  # TRL's run length in passes over the prompts: num_train_epochs (its default 3)
        epochs = _number(given.get("num_train_epochs")) or TRL_DEFAULT_EPOCHS
        which = "num_train_epochs" if "num_train_epochs" in given else "TRL's default num_train_epochs"
        text += f"; {which} here: {epochs_as_total_episodes(epochs, None, shape.num_generations)}"
    write = {
        k: v for k, v in shape.ours.items() if not (k in given or (k in _RENAMED_AS_IS and _RENAMED_AS_IS[k] in given))
    }
    if write:
        label = "the closest here" if shape.mismatch else "the same run here"
        text += f"\n    {label}: " + " ".join(f"--{k} {v}" for k, v in write.items())
    if shape.mismatch:
        text += f"\n    not the same run here: {shape.mismatch}"
    return text


def trl_port_notice(foreign: Iterable[str], script: str, given: Optional[dict] = None) -> Optional[str]:
    """For an RL run given TRL's GRPO names: which algorithm the recipe gets here, TRL's defaults that differ from
    ours for the settings the recipe does not set, and TRL's batch shape with the values that give it here; None
    when no TRL name was given. `given`: every key of the run (ours and foreign) with its value."""
    given = given or {}
    trl_names = [k for k in foreign if (lookup(k) and TRL in lookup(k).libraries) or k in UNSUPPORTED]  # type: ignore[union-attr]
    if script != "rlvr_ppo" or not trl_names:
        return None
    lines = [
        f"these look like TRL GRPOConfig names ({', '.join(trl_names[:4])}{', ...' if len(trl_names) > 4 else ''}): "
        "note that the default here is algo ppo (a value model), not GRPO, and these defaults differ from TRL's "
        "(configs/grpo_trl_defaults.yaml sets TRL's values in our keys):"
    ]
    for key, ours, theirs, write in TRL_GRPO_DIFFERENCES:
        if write != "(the same)" and key not in TRL_SHAPE_KEYS and not _set_here(key, given):
            lines.append(f"    {key}: here {ours}; TRL {theirs} -> {write}")
    lines.append(trl_shape_line(given))
    return "\n".join(lines)


def markdown_table() -> str:
    """docs/porting.md's table of these names (tests/test_flag_names.py checks the page holds it verbatim)."""
    lines = ["| their name | where | here | note |", "|---|---|---|---|"]
    for f in FOREIGN_NAMES:
        lines.append(f"| `{f.name}` | {', '.join(f.libraries)} | {f.here} | {f.note} |")
    return "\n".join(lines)


def differences_table() -> str:
    """The porting page's table of TRL GRPO's defaults that differ from ours (TRL_GRPO_DIFFERENCES)."""
    lines = ["| here | our default | TRL GRPOConfig | to get TRL's |", "|---|---|---|---|"]
    for key, ours, theirs, write in TRL_GRPO_DIFFERENCES:
        lines.append(f"| `{key}` | {ours} | {theirs} | {write.replace('(the same)', 'the same')} |")
    return "\n".join(lines)


def unsupported_table() -> str:
    """The porting page's table of the names with no counterpart here, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in UNSUPPORTED.items():
        by_reason.setdefault(reason, []).append(name)
    lines = ["| their names | why not here |", "|---|---|"]
    for reason, names in by_reason.items():
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {reason} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
    print()
    print(unsupported_table())
