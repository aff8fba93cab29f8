"""Integrations with other packages, registered at the edge: data sources and environments named by a spec prefix
(`reasoning_gym:leg_counting`, `verifiers:my_env.py`) and verifiers named by a row's `dataset` column.

Each integration module registers its prefix and its handlers when it is imported (`register_source`, and
rewards.register_verifier for a verifier), like the estimators of rl_algorithms.py; the core modules (data,
data_cache, mixture, preflight, plan, rewards, rollouts, environments) ask this registry and never name one. A
module is imported only when a run names it: `BUILT_IN` and `BUILT_IN_VERIFIERS` say which module registers which
built-in prefix or verifier name. A third-party integration is named by its import path, `my_pkg.my_tasks:rest`:
the module is imported, and it registers `Source(prefix=__name__, ...)`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from typing import Any, Callable, Optional

from open_instruct.errors import ConfigError

# prefix (the spec's text before its first ':') -> the module that registers it
BUILT_IN = {
    "reasoning_gym": "open_instruct.reasoning_gym_tasks",
    "verifiers": "open_instruct.verifiers_v1_play",
    "agent": "open_instruct.agent_gateway",
}
# verifier name (a row's `dataset` column) -> the module that registers it
BUILT_IN_VERIFIERS = {
    "reasoning_gym": "open_instruct.reasoning_gym_verifier",
    "verifiers_env": "open_instruct.verifiers_env",
}


def spec_forms() -> str:
    """The spec forms of the built-in prefixes and of a package's own, as --help shows them beside the options that
    take a spec (dataset_name_or_path, environment)."""
    built_in = ", ".join(f"{prefix}:<spec>[?key=value&...]" for prefix in BUILT_IN)
    return f"Other packages' specs: {built_in} (docs/environments.md), or my_pkg.module:<spec> for your own."


_MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _no_size(spec: str, split: str) -> tuple[Optional[int], str]:
    return None, f"{spec.partition(':')[0]} sources are counted when the run loads them"


@dataclasses.dataclass(frozen=True)
class Source:
    """One integration's handlers for the specs `<prefix>:...`. `generate(spec, split)` -> the rows (dicts);
    `check(spec, where)` before any model loads (ConfigError naming `where`); `identity(spec)` what the tokenized-data
    cache keys on (the spec, the package's version, the code that makes the rows); optional: `size(spec, split)` ->
    (rows or None, how it was had) for the planner, `label(spec)` the short name metrics use, `continues(part)`
    whether a bare comma-separated part after one of these specs is another (`reasoning_gym:a,b`),
    `check_held_out(train_specs, eval_specs, train_split, eval_split)`, `needs_environment` (its rows are played by
    the environment of the same prefix), `environment_class(spec)` and `environment_run(spec)` (the
    episodes.EnvironmentRun subclass that plays them, or None for the default)."""

    prefix: str
    generate: Callable[[str, str], list[dict[str, Any]]]
    check: Callable[[str, str], Any]
    identity: Callable[[str], Any]
    size: Callable[[str, str], tuple[Optional[int], str]] = _no_size
    label: Optional[Callable[[str], str]] = None
    continues: Optional[Callable[[str], bool]] = None
    check_held_out: Optional[Callable[[list[str], list[str], str, str], None]] = None
    needs_environment: bool = False
    environment_class: Optional[Callable[[str], type]] = None
    environment_run: Optional[Callable[[str], Optional[type]]] = None


SOURCES: dict[str, Source] = {}


def register_source(source: Source) -> Source:
    """Called at the integration module's import: specs `<source.prefix>:...` are its."""
    if source.prefix in SOURCES and SOURCES[source.prefix] != source:
        raise ValueError(f"integration prefix {source.prefix!r} is already registered")
    SOURCES[source.prefix] = source
    return source


def prefix_of(spec: Any) -> Optional[str]:
    """The text before the spec's first ':' when it could name an integration (a module path), else None: a file
    path or a hub name has none."""
    head, colon, _ = str(spec).strip().partition(":")
    return head if colon and _MODULE_PATH.match(head) and not head.endswith(".py") else None  # file.py:Class: a file


def find(spec: Any, what: str = "") -> Optional[Source]:
    """The integration `spec` belongs to (its module imported now, the first time), or None for a plain file, folder
    or hub dataset. A module that fails to import is a ConfigError naming `what` (default: the spec)."""
    prefix = prefix_of(spec)
    if prefix is None:
        return None
    if prefix not in SOURCES:
        module = BUILT_IN.get(prefix)
        if module is None:  # a third-party integration by its import path, if it is one
            try:
                module = prefix if importlib.util.find_spec(prefix) is not None else None
            except (ImportError, ValueError):
                module = None
        if module is None:
            return None
        try:
            importlib.import_module(module)
        except Exception as e:  # the module failed to import (ImportError, SyntaxError, its own errors)
            raise ConfigError(f"{what or repr(spec)}: importing {module!r} failed: {type(e).__name__}: {e}") from None
    return SOURCES.get(prefix)


def expand_sources(name_or_path: str) -> list[str]:
    """The comma-separated parts of a dataset option; a bare part after an integration's spec that the integration
    `continues` gets its prefix (`reasoning_gym:a,b` is `reasoning_gym:a` and `reasoning_gym:b`)."""
    parts: list[str] = []
    current: Optional[Source] = None
    for part in (p.strip() for p in str(name_or_path).split(",")):
        if not part:
            continue
        found = find(part)
        if found is not None:
            current = found
        elif current is not None and current.continues is not None and current.continues(part):
            part = f"{current.prefix}:{part}"
        else:
            current = None
        parts.append(part)
    return parts


def label(spec: str) -> Optional[str]:
    """The integration's short name for a source (metric keys), or None for a plain source."""
    found = find(spec)
    return found.label(spec) if found is not None and found.label is not None else None


def load_verifier_module(name: str) -> bool:
    """Import the module that registers verifier `name` (or the one whose name begins `name`: `reasoning_gym_x`),
    when it is a built-in integration's; whether one was imported."""
    for verifier, module in sorted(BUILT_IN_VERIFIERS.items(), key=lambda kv: -len(kv[0])):
        if name == verifier or (name.startswith(verifier) and not name[len(verifier)].isalpha()):
            importlib.import_module(module)
            return True
    return False
