"""reasoning-gym tasks as RL data and verifier: `dataset_name_or_path: reasoning_gym:<task>[?key=value&...]`.

A source `reasoning_gym:leg_counting?size=500&seed=1&max_animals=5` is generated on the spot by the
`reasoning-gym` package (`pip install .[envs]`; imported only when such a source is named):

    size     rows to generate (default 500, the package's own default)
    seed     the generator's seed (default: derived from the task and the split, so the train split and the
             held-out split of one task are different rows unless both name a seed)
    system_prompt  one of reasoning_gym.utils.SYSTEM_PROMPTS (default `default`: asks for <answer>...</answer>),
             or `none` for a bare user turn
    any other key  a field of the task's config dataclass (values read as JSON: 3, 0.5, true, [1, 2]; else text)

Comma-separated tasks share the prefix: `reasoning_gym:leg_counting,basic_arithmetic?size=100` is two sources (a
bare `name` or `name?...` after a reasoning_gym part, that is not a local path, is another task). Each task is its
own source (label = the task name), so mixtures weight tasks like any other datasets.

Rows are RLVR prompt rows: `messages` (the system prompt, then the question), `dataset: reasoning_gym` and a
`ground_truth` that names the task, its config, seed, size and row index (and the answer, for reading). The
`reasoning_gym` verifier (registered below) regenerates that row and scores the text inside the
completion's last <answer>...</answer> (reasoning_gym.utils.extract_answer; after the last </think>) with the
task's own `score_answer`. Several tasks' `score_answer` evaluate the answer text (sympy's parse_expr, eval), so
scoring never runs in the trainer: a batch's answers are scored (reasoning_gym_scoring.score_many) in calls of the
code verifier's sandbox (open_instruct/sandbox.py: its seccomp filter, namespaces, limits and hidden paths), each
answer in a run of its own (a fresh fork), under the run's verifier timeout as its CPU limit;
open_instruct/reasoning_gym_scoring.py says what runs inside and why its verdict is the package's. The trainer
regenerates each row's entry (trusted data), hands it in, and reads back one plain number per answer, which it clips
(`clipped`); the package's extract_answer runs inside too.
"""

from __future__ import annotations

import base64
import dataclasses
import difflib
import functools
import json
import os
import pickle
import re
import zlib
from typing import Any

from open_instruct.data_cache import code_identity
from open_instruct.errors import ConfigError, DataError
from open_instruct.integrations import Source, register_source

PREFIX = "reasoning_gym:"
VERIFIER = "reasoning_gym"
DEFAULT_SIZE = 500
_BARE_TASK = re.compile(r"^[A-Za-z0-9_]+(\?.*)?$")
_RESERVED = ("size", "seed", "system_prompt")
INSTALL_HINT = "reasoning_gym sources need the reasoning-gym package: pip install '.[envs]' (or reasoning-gym)"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    task: str
    size: int
    seed: int
    config: dict[str, Any]  # the task config's other fields, as given
    system_prompt: str

    def source(self) -> str:
        return PREFIX + self.task


def is_source(name: str) -> bool:
    return str(name).strip().startswith(PREFIX)


def expand_sources(name_or_path: str) -> list[str]:
    """The comma-separated parts of a dataset option, each reasoning-gym task with its own prefix."""
    parts, in_gym = [], False
    for part in (p.strip() for p in str(name_or_path).split(",")):
        if not part:
            continue
        if is_source(part):
            in_gym = True
        elif in_gym and _BARE_TASK.match(part) and not os.path.exists(part):
            part = PREFIX + part
        else:
            in_gym = False
        parts.append(part)
    return parts


def label(source: str) -> str:
    """A source's short name for metrics (eval/<task>/correct_rate): the task name."""
    return source.strip()[len(PREFIX) :].split("?", 1)[0]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _gym(where: str):
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"{where}: {INSTALL_HINT}") from None
    return reasoning_gym


def installed_version() -> str:
    """The installed distribution's version (its metadata): the package's own `__version__` lags its releases
    (0.1.19 inside 0.1.25)."""
    from importlib.metadata import version

    return version("reasoning-gym")


def parse(source: str, split: str, where: str = "dataset_name_or_path") -> TaskSpec:
    """`reasoning_gym:<task>?k=v&...` -> TaskSpec, checked against the package's registry and the task's config
    dataclass (ConfigError naming the source and what is wrong)."""
    _gym(where)  # the install hint when it is missing
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    body = source.strip()[len(PREFIX) :]
    task, _, query = body.partition("?")
    here = f"{where} {source!r}"
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(DATASETS)} tasks, e.g. leg_counting)"
        raise ConfigError(f"{here}: {task!r} is not a reasoning-gym {installed_version()} task{hint}")
    settings: dict[str, Any] = {}
    for item in (q for q in query.split("&") if q):
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"{here}: {item!r} is not key=value")
        if key in settings:
            raise ConfigError(f"{here}: {key!r} given twice")
        settings[key] = text if key == "system_prompt" else _value(text)
    fields = {f.name for f in dataclasses.fields(DATASETS[task][1])} - set(_RESERVED)
    unknown = sorted(set(settings) - fields - set(_RESERVED))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(fields | set(_RESERVED)), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{here}: unknown setting {unknown[0]!r}{hint}; {task} takes size, seed, system_prompt "
            f"and its config fields {sorted(fields)}"
        )
    for key in ("size", "seed"):
        if key in settings and (not isinstance(settings[key], int) or isinstance(settings[key], bool)):
            raise ConfigError(f"{here}: {key} must be an integer, got {settings[key]!r}")
    size = settings.pop("size", DEFAULT_SIZE)
    if size < 1:
        raise ConfigError(f"{here}: size must be >= 1, got {size}")
    default_seed = zlib.crc32(f"{task}:{split}".encode()) % (2**31)  # train and held-out splits differ
    seed = settings.pop("seed", default_seed)
    system_prompt = settings.pop("system_prompt", "default")
    if system_prompt != "none" and system_prompt not in SYSTEM_PROMPTS:
        raise ConfigError(f"{here}: system_prompt {system_prompt!r} is not one of {sorted(SYSTEM_PROMPTS)} or none")
    spec = TaskSpec(task, size, seed, settings, system_prompt)
    try:
        _dataset(task, json.dumps(settings, sort_keys=True), seed, size)
    except (TypeError, ValueError, AssertionError) as e:  # the config's own validate()
        raise ConfigError(f"{here}: the task's config refused these settings: {e}") from None
    return spec


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def dataset_for(spec: TaskSpec) -> Any:
    return _dataset(spec.task, json.dumps(spec.config, sort_keys=True), spec.seed, spec.size)


def generate(source: str, split: str) -> list[dict[str, Any]]:
    """The rows of one task source, in index order (RLVR prompt rows; module docstring)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    spec = parse(source, split)
    data = dataset_for(spec)
    system = [] if spec.system_prompt == "none" else [{"role": "system", "content": SYSTEM_PROMPTS[spec.system_prompt]}]
    rows = []
    for index in range(spec.size):
        entry = data[index]
        truth = {"task": spec.task, "config": spec.config, "seed": spec.seed, "size": spec.size, "index": index}
        truth["answer"] = entry["answer"]
        rows.append(
            {
                "messages": system + [{"role": "user", "content": entry["question"]}],
                "ground_truth": json.dumps(truth, sort_keys=True),
                "dataset": VERIFIER,
                "id": f"{spec.task}-{spec.seed}-{index}",
            }
        )
    return rows


class BadGroundTruth(ValueError):
    """A ground truth that names no row (the verifier reports it as rewards.GroundTruthError)."""


def entry_of(ground_truth: Any) -> tuple[Any, dict[str, Any]]:
    """(the task's dataset object, the row's entry) regenerated from a row's ground truth; BadGroundTruth when
    it does not name a row this package version generates with that answer."""
    try:
        truth = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
        task, config, seed, size, index = (truth[k] for k in ("task", "config", "seed", "size", "index"))
        data = _dataset(task, json.dumps(config, sort_keys=True), seed, size)
        entry = data[index]
    except ImportError:
        raise BadGroundTruth(INSTALL_HINT) from None
    except Exception as e:
        raise BadGroundTruth(f"reasoning_gym ground truth {str(ground_truth)[:200]!r} names no row: {e!r}") from None
    if entry["answer"] != truth.get("answer", entry["answer"]):
        raise BadGroundTruth(
            f"reasoning_gym row {task}[{index}] (seed {seed}) now has answer {entry['answer']!r}, not the "
            f"{truth['answer']!r} it was generated with: another reasoning-gym version made the data"
        )
    return data, entry


@functools.lru_cache(maxsize=4096)
def entry_payload(ground_truth: str) -> tuple[tuple, str]:
    """(dataset key, the row's entry pickled, base64) of a ground truth string, what a scoring call is handed
    (reasoning_gym_scoring.score_many); cached: GRPO scores each row many times."""
    data, entry = entry_of(ground_truth)
    truth = json.loads(ground_truth)
    key = (truth["task"], json.dumps(truth["config"], sort_keys=True), truth["seed"], truth["size"])
    return key, base64.b64encode(pickle.dumps(entry)).decode()


def check_ground_truth(ground_truth: Any) -> None:
    """BadGroundTruth unless the ground truth names a row this package version generates (no model text involved)."""
    entry_payload(ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth, sort_keys=True))


def clipped(package_score: Any) -> float:
    """The package's score in [0, 1]: some scorers sum 1/n n times and return 1.0000000000000002 (spell_backward,
    for an answer that extends the right one); that is >= 1, what the package itself counts as solved."""
    value = float(package_score)
    return 0.0 if value != value else min(max(value, 0.0), 1.0)  # NaN: 0


def check_held_out(train_sources: list[str], eval_sources: list[str], train_split: str, eval_split: str) -> None:
    """A held-out task generated with the train set's seed and settings would repeat training rows: refused."""
    train = [parse(s, train_split) for s in train_sources if is_source(s)]
    for source in (s for s in eval_sources if is_source(s)):
        spec = parse(source, eval_split, "eval dataset")
        if any((t.task, t.seed, t.config) == (spec.task, spec.seed, spec.config) for t in train):
            raise DataError(
                f"held-out reasoning_gym source {source!r} uses the training source's seed {spec.seed} and settings: "
                "its rows would repeat training rows. Give the held-out source another seed (or leave both seeds "
                "out: the train and held-out splits then get different seeds)"
            )


# ---- registration (open_instruct/integrations.py): the `reasoning_gym:` sources and the `reasoning_gym` verifier ----
def _identity(source: str) -> list[Any]:
    """What the tokenized-data cache keys on: the spec, the generating package's version, this module's code."""
    return [source, installed_version(), code_identity([__file__])]


def _size(source: str, split: str) -> tuple[int, str]:
    return parse(source, split).size, "the reasoning_gym sources' sizes"


def _continues(part: str) -> bool:
    return bool(_BARE_TASK.match(part)) and not os.path.exists(part)


register_source(
    Source(
        prefix=PREFIX.rstrip(":"),
        generate=generate,
        check=lambda source, where: parse(source, "train", where),
        identity=_identity,
        size=_size,
        label=label,
        continues=_continues,
        check_held_out=check_held_out,
    )
)
