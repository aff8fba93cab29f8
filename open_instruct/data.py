"""Datasets: loading (hub or local files), row validation, chat-template tokenization, batching, and the
episode stream that makes data order independent of world size.

Row errors name the file and row (line number for .jsonl) and stop the run before training, unless
`skip_bad_rows` is set, in which case the bad rows are skipped and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import itertools
import json
import math
import multiprocessing
import os
import random
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from open_instruct import data_cache, encode, formats, integrations
from open_instruct.errors import ConfigError, DataError
from open_instruct.mixture import LOCAL_FILE_SUFFIXES, mixture_summary, parse_mixer_list, select_rows, source_labels


@dataclass
class Row:
    source: str  # file path or hub name
    index: int  # 0-based row index in the source
    line: Optional[int]  # 1-based line number for .jsonl files
    data: dict[str, Any]
    label: str = ""  # the source's short name (mixture.source_labels): examples carry it as "source"

    def where(self) -> str:
        return f"{self.source} line {self.line}" if self.line is not None else f"{self.source} row {self.index}"


@dataclass
class DataStats:
    rows: int = 0
    kept: int = 0
    bad_rows: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    duplicate_ids: int = 0
    first_errors: list[str] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)  # per source: label, amount, available, rows, kept
    format: str = ""  # the format recognised (formats.py)
    raw_string_rows: int = 0  # string rows tokenized as written (TRL's convention, string_rows raw)
    answer_turns_dropped: int = 0  # RL prompts that ended with an assistant turn, which was dropped
    processes: int = 1  # processes that tokenized the rows (dataset_num_proc)
    inputs: str = ""  # format, string convention and cache use, for the start-up line (load_train_eval)

    def as_log(self, prefix: str = "data/") -> dict[str, int]:
        keys = ("rows", "kept", "bad_rows", "dropped_overlong", "truncated", "duplicate_ids")
        return {f"{prefix}{k}": getattr(self, k) for k in keys}

    def summary(self) -> str:
        text = (
            f"{self.kept}/{self.rows} rows kept: {self.bad_rows} bad, {self.dropped_overlong} dropped as over-long, "
            f"{self.truncated} truncated, {self.duplicate_ids} duplicate ids"
        )
        if len(self.sources) > 1:
            text += "; per source: " + ", ".join(
                f"{s['label']} {s['kept']} kept of {s['rows']} taken ({s['amount']} of {s['available']})"
                for s in self.sources
            )
        return f"{text}; {self.inputs}" if self.inputs else text

    def count_kept_per_source(self, examples: list[dict[str, Any]]) -> None:
        for s in self.sources:
            s["kept"] = sum(1 for e in examples if e["source"] == s["label"])

    def require_every_source(self, key: str) -> None:
        """A mixture source none of whose rows survived (all over-long, or bad with skip_bad_rows) would silently
        leave the mixture: DataError naming it."""
        for s in self.sources:
            if not s["kept"]:
                raise DataError(
                    f"{key}: source {s['source']!r} has no usable rows: all {s['rows']} rows taken from it were "
                    f"dropped (over-long for max_seq_length / max_prompt_length, or bad); overall {self.summary()}"
                )


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def _read_jsonl(path: str) -> list[Row]:
    rows: list[Row] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {line_no}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path} line {line_no}: expected a JSON object, got {type(obj).__name__}")
            if _SURROGATE_ESCAPE.search(text):
                _refuse_lone_surrogates(obj, f"{path} line {line_no}")
            rows.append(Row(path, len(rows), line_no, obj))
    return rows


def _read_json(path: str) -> list[Row]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"train": [...]} style
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects")
    for i, obj in enumerate(data):
        if not isinstance(obj, dict):
            raise DataError(f"{path} row {i}: expected a JSON object, got {type(obj).__name__}")
        if _SURROGATE_ESCAPE.search(text):
            _refuse_lone_surrogates(obj, f"{path} row {i}")
    return [Row(path, i, None, obj) for i, obj in enumerate(data)]


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # only JSON's \uXXXX escapes can make a surrogate


def _refuse_lone_surrogates(value: Any, where: str, at: str = "") -> None:
    """JSON accepts a `\\ud800` escape that is not half of a pair; the result is no character (UTF-8 cannot encode it,
    so the tokenizer fails on it): DataError naming the row and the field."""
    if isinstance(value, str):
        match = re.search(r"[\ud800-\udfff]", value)
        if match:
            raise DataError(
                f"{where}: {at or 'a string'} holds the escape \\u{ord(match.group()):04x}, a lone UTF-16 surrogate "
                "(not a character): fix the file's encoding"
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            _refuse_lone_surrogates(v, where, f"{at}.{k}" if at else str(k))
    elif isinstance(value, list):
        for j, v in enumerate(value):
            _refuse_lone_surrogates(v, where, f"{at}[{j}]")


def _read_with_datasets(name: str, split: str, **kwargs: Any) -> list[Row]:
    import datasets

    ds = datasets.load_dataset(name, split=split, **kwargs)
    return [Row(name, i, None, r) for i, r in enumerate(ds.to_list())]


def is_saved_dataset(path: str) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _read_saved_dataset(path: str, split: str) -> list[Row]:
    """A save_to_disk folder: a Dataset's rows, or the `split` of a DatasetDict."""
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"saved DatasetDict {path!r} has no split {split!r} (splits: {sorted(loaded)})")
        loaded = loaded[split]
    return [Row(path, i, None, r) for i, r in enumerate(loaded.to_list())]


def load_source(name: str, split: str, label: str = "") -> list[Row]:
    """Every row of one source: a local .jsonl/.json/.parquet/.csv file, a `save_to_disk` folder (a Dataset, or a
    DatasetDict's split), another local dataset folder or a hub dataset split."""
    if name.endswith(LOCAL_FILE_SUFFIXES) and not os.path.exists(name):
        raise DataError(f"dataset file {name!r} does not exist")
    integration = integrations.find(name)
    if integration is not None:  # rows an integration makes (generated, or an environment's own dataset)
        rows = [Row(name, i, None, r) for i, r in enumerate(integration.generate(name, split))]
    elif name.endswith(".jsonl"):
        rows = _read_jsonl(name)
    elif name.endswith(".json"):
        rows = _read_json(name)
    elif name.endswith((".parquet", ".csv")):
        builder = "parquet" if name.endswith(".parquet") else "csv"
        try:
            rows = [Row(name, r.index, None, r.data) for r in _read_with_datasets(builder, "train", data_files=name)]
        except ValueError as e:  # datasets on a header-only CSV: 'Instruction "train" corresponds to no data!'
            if "corresponds to no data" not in str(e):
                raise
            rows = []
    elif os.path.isdir(name) and is_saved_dataset(name):
        rows = _read_saved_dataset(name, split)
    else:
        rows = _read_with_datasets(name, split)
    if not rows:
        raise DataError(f"dataset {name!r} (split {split!r}) is empty")
    for row in rows:
        row.label = label or source_labels([name])[0]
    return rows


def load_rows(name_or_path: str, split: str = "train", max_samples: Optional[int] = None) -> list[Row]:
    """Rows from local .jsonl/.json/.parquet/.csv file(s) or folders (comma separated) or a hub dataset split: all
    rows of each."""
    parts = integrations.expand_sources(name_or_path)
    rows = [row for part, label in zip(parts, source_labels(parts)) for row in load_source(part, split, label)]
    return rows if max_samples is None else rows[:max_samples]


def load_mixture(mixer_list: Sequence[str], split: str, seed: int, key: str) -> tuple[list[Row], list[dict]]:
    """The rows a `dataset_mixer_list` asks for (mixture.select_rows: seeded, world-size independent), in list order,
    and the rows per source (label, amount, available, rows) for the summary."""
    rows: list[Row] = []
    per_source = []
    entries = parse_mixer_list(mixer_list, key)
    for entry in entries:
        source_rows = load_source(entry.source, split, entry.label)
        rows.extend(source_rows[i] for i in select_rows(entry, len(source_rows), seed))
        per_source += mixture_summary([entry], [len(source_rows)])
    return rows, per_source


DATA_KIND = {"sft": formats.SFT, "reward_model": formats.PREFERENCE, "dpo": formats.PREFERENCE}
DATA_KIND["rlvr_ppo"] = formats.PROMPT
FIRST_ROWS = 4  # rows of each local source parsed before any model or tokenizer loads (and the reward probe's rows)


def _checked_sources(name_or_path: Optional[str], mixer_list: Optional[Sequence[str]]) -> list[str]:
    """The sources whose first rows are read at start: local files and folders, and the rows an integration makes
    (a hub dataset: its loader reports)."""
    parts = integrations.expand_sources(name_or_path) if name_or_path else []
    parts += [str(source) for source in (mixer_list or [])[0::2]]
    return [p for p in parts if os.path.exists(p) or integrations.find(p) is not None]


def first_rows_checked(cfg: Any) -> bool:
    """Whether check_first_rows (run at start) read the first training source: it is a local file or folder, or rows
    an integration makes (a hub dataset is read by the loader, and its rows checked there)."""
    train = integrations.expand_sources(cfg.dataset_name_or_path) if cfg.dataset_name_or_path else []
    first = train[0] if train else str((cfg.dataset_mixer_list or [""])[0])
    return bool(first) and (os.path.exists(first) or integrations.find(first) is not None)


def check_first_rows(cfg: Any) -> tuple[list[dict[str, Any]], list[list[Row]]]:
    """Before any model loads: the first FIRST_ROWS rows of every local or integration-made (reasoning-gym,
    `verifiers`) training and held-out source read and parse in the script's data format (formats.py; RL's
    ptx_dataset: an SFT format), as the loader will parse them (DataError naming the file and row; a bad row is
    skipped with skip_bad_rows). Returns the RL probe examples of the first training source (reward_function_fields,
    ground truth, verifier, where), for rewards.probe_reward_functions, and the first rows of each training and
    held-out source, for check_first_rows_tokenized."""
    script_kind = DATA_KIND[cfg.script]
    parsers = {formats.SFT: sft_parts, formats.PREFERENCE: preference_parts, formats.PROMPT: prompt_parts}
    probe: list[dict[str, Any]] = []
    first_rows: list[list[Row]] = []  # the script-format sources' first rows, to tokenize
    train = _checked_sources(cfg.dataset_name_or_path, cfg.dataset_mixer_list)
    held_out = _checked_sources(cfg.eval_dataset_name_or_path, cfg.eval_dataset_mixer_list)
    ptx = _checked_sources(getattr(cfg, "ptx_dataset", None), None)  # RL: PPO-ptx's demonstrations, SFT rows
    # (source, split, kind, is a training source, is the first training source: the reward probe's rows)
    sources = [(s, cfg.dataset_split, script_kind, True, i == 0) for i, s in enumerate(train)]
    sources += [(s, cfg.eval_dataset_split, script_kind, False, False) for s in held_out]
    for source, split, kind, training, probed in sources + [(s, "train", formats.SFT, False, False) for s in ptx]:
        rows = check_duplicate_ids(load_source(source, split)[:FIRST_ROWS], DataStats(), cfg.skip_bad_rows)
        fmt = formats.detect_format(kind, rows[0].data, cfg, rows[0].where())
        parts_of = parsers[kind]
        # the loader's column checks of the training rows (tokenize_prompts, tokenize_preferences), its messages
        if training and kind == formats.PROMPT and not getattr(cfg, "reward_functions", None):
            check_columns(rows, [cfg.ground_truth_column], "RL prompt")
        if training and kind == formats.PREFERENCE and getattr(cfg, "margin_column", None):
            check_columns(rows, [cfg.margin_column], "margin")
        if kind == script_kind:
            first_rows.append(rows)
        for row in rows:
            try:
                parts = parts_of(row, fmt, cfg)
            except DataError:
                if cfg.skip_bad_rows:
                    continue
                raise
            if kind == formats.PROMPT and probed:
                (chat, ground_truth, verifier) = parts
                fields = reward_function_fields(row, fmt, chat)
                probe.append({**fields, "ground_truth": ground_truth, "verifier": verifier, "where": row.where(),
                              "row": row.index})  # fmt: skip
    return probe, first_rows


class NoUsableRows(DataError):
    """Every row given to a tokenize function was dropped (over-long, or bad with skip_bad_rows)."""


def check_first_rows_tokenized(cfg: Any, tokenizer: Any, first_rows: list[list[Row]]) -> None:
    """Each source's first rows tokenized by the loader's own function with the run's limits and drops
    (max_seq_length / max_prompt_length, overlong, skip_bad_rows): a bad row raises the loader's DataError. A source
    none of whose first rows is kept is not yet a verdict (a later row may be): the loader's whole path then runs
    (build_train_eval, every row), which refuses exactly when, and with the message that, a real start would."""
    tokenize = TOKENIZERS[cfg.script]
    for rows in first_rows:
        try:
            tokenize(rows, tokenizer, cfg)
        except NoUsableRows:
            build_train_eval(cfg, tokenizer, tokenize)
            return


def check_duplicate_ids(rows: list[Row], stats: DataStats, skip_bad_rows: bool, id_column: str = "id") -> list[Row]:
    """Rows sharing an `id` usually mean a file was concatenated twice: an error, or skip the repeats. A mixture's
    upsampling repeats the same row of its source on purpose: those repeats are kept."""
    seen: dict[Any, Row] = {}
    kept = []
    for row in rows:
        rid = row.data.get(id_column)
        if rid is None or isinstance(rid, (list, dict)):
            kept.append(row)
            continue
        if rid in seen and (seen[rid].source, seen[rid].index) == (row.source, row.index):  # upsampled: same row
            kept.append(row)
            continue
        if rid in seen:
            if not skip_bad_rows:
                raise DataError(
                    f"{row.where()}: duplicate id {rid!r} (first at {seen[rid].where()}); set skip_bad_rows to skip "
                    "repeats"
                )
            stats.duplicate_ids += 1
            continue
        seen[rid] = row
        kept.append(row)
    return kept


def split_train_eval(items: list[Any], eval_fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Deterministic held-out split (the same items whatever the world size). Copies of one source row (a mixture's
    upsampling) go to the same side: no held-out example is also trained on."""
    if eval_fraction <= 0:
        return items, []
    copies: dict[Any, list[int]] = {}
    for i, x in enumerate(items):
        copies.setdefault((x.get("source"), x["row"]) if isinstance(x, dict) and "row" in x else i, []).append(i)
    groups = list(copies.values())
    order = list(range(len(groups)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, int(round(eval_fraction * len(groups))))
    eval_idx = {i for g in order[:n_eval] for i in groups[g]}
    return [x for i, x in enumerate(items) if i not in eval_idx], [items[i] for i in sorted(eval_idx)]


# ---------------------------------------------------------------------------------------------------------------------
# Validation of chat messages


# The roles chat templates know: OpenAI's (developer, tool, the older function) and Llama 3.1's ipython.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
TOOL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")


def _validate_tool_calls(calls: Any, at: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI-style `tool_calls` ([{"type": "function", "function": {"name": ...,
    "arguments": {...}}}], or the flat {"name", "arguments"}), normalised to the OpenAI form with `arguments` an
    object: a JSON-string `arguments` (OpenAI's wire form) is parsed, so every template renders the same call."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{at}: 'tool_calls' must be a non-empty list of calls, got {calls!r:.120}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise DataError(
                f"{at}: tool_calls[{k}] needs a string 'name' and object 'arguments' (optionally under 'function'), "
                f"got {call!r:.120}"
            )
        normalised: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            normalised["id"] = call["id"]
        out.append(normalised)
    return out


def _validate_messages(
    value: Any, column: str, where: str, need_final_assistant: bool, tool_keys: bool = False
) -> list[dict[str, Any]]:
    """The messages checked, as {role, content} (plus tool_calls / tool_call_id / name where set, with tool_keys:
    SFT traces of tool use, RL prompts with earlier tool turns; `tool_calls` checked and normalised,
    _validate_tool_calls)."""
    if not isinstance(value, list):
        raise DataError(f"{where}: column {column!r} must be a list of messages, got {type(value).__name__}")
    if not value:
        raise DataError(f"{where}: column {column!r} is an empty conversation")
    value = [  # an assistant turn of tool calls only may have content null
        {**m, "content": ""}
        if tool_keys and isinstance(m, dict) and m.get("content") is None and m.get("tool_calls")
        else m
        for m in value
    ]
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: {column}[{j}] must be an object with string 'role' and 'content', got {m!r:.120}"
            )
        if m["role"] not in CHAT_ROLES:  # a misspelt role renders as some other turn, and is never trained
            close = difflib.get_close_matches(m["role"], CHAT_ROLES, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise DataError(f"{where}: {column}[{j}] has role {m['role']!r}{hint} (roles: {', '.join(CHAT_ROLES)})")
    if need_final_assistant and value[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message of {column!r} must be from the assistant, got {value[-1]['role']!r}"
        )
    keys = ("role", "content", *TOOL_MESSAGE_KEYS) if tool_keys else ("role", "content")
    out = [{k: m[k] for k in keys if m.get(k) is not None} for m in value]
    for j, m in enumerate(out):
        if "tool_calls" in m:
            m["tool_calls"] = _validate_tool_calls(m["tool_calls"], f"{where}: {column}[{j}]")
    return out


def _require_column(row: Row, column: str) -> Any:
    if column not in row.data:
        raise DataError(f"{row.where()}: missing column {column!r} (columns: {sorted(row.data)})")
    return row.data[column]


def check_columns(rows: list[Row], columns: Sequence[str], what: str) -> None:
    """A column missing from the first row is a configuration error (name the recipe key to set)."""
    if rows:
        missing = [c for c in columns if c not in rows[0].data]
        if missing:
            raise DataError(
                f"{rows[0].where()}: {what} column(s) {missing} not found; columns are {sorted(rows[0].data)}. "
                f"Set the matching *_column key in the recipe."
            )


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _prefix_checked(prefix: list[int], full: list[int], where: str) -> None:
    if full[: len(prefix)] != prefix:
        raise DataError(
            f"{where}: the chat template does not render the conversation prefix as a prefix of the full "
            f"conversation, so response tokens cannot be located"
        )


def tokenize_sft_messages(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    """input_ids and labels where only assistant turns are trained (others are -100).

    Each assistant turn's tokens are those the template adds between the conversation up to the turn (with the
    generation prompt) and the conversation including the turn: this works for any prefix-stable template."""
    full = chat_ids(tokenizer, messages)
    labels = [-100] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_ids = chat_ids(tokenizer, messages[:i], add_generation_prompt=True) if i > 0 else []
        end_ids = chat_ids(tokenizer, messages[: i + 1])
        _prefix_checked(start_ids, end_ids, where)
        _prefix_checked(end_ids, full, where)
        labels[len(start_ids) : len(end_ids)] = full[len(start_ids) : len(end_ids)]
    return full, labels


def tokenize_sft(rows: list[Row], tokenizer: Any, cfg: Any) -> tuple[list[dict[str, Any]], DataStats]:
    """SFT examples (input_ids, labels: -100 where not trained) from any SFT format (formats.py)."""
    stats = DataStats(rows=len(rows))
    rows = check_duplicate_ids(rows, stats, cfg.skip_bad_rows)
    examples = []
    for row, out in zip(rows, encode_rows(rows, tokenizer, cfg, formats.SFT, stats)):
        if isinstance(out, DataError):
            _bad_row(stats, out, cfg.skip_bad_rows)
            continue
        ids, labels = out["input_ids"], out["labels"]
        if len(ids) > cfg.max_seq_length:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            ids, labels = ids[: cfg.max_seq_length], labels[: cfg.max_seq_length]
            stats.truncated += 1
        if not labels or labels.count(-100) - (labels[0] == -100) == len(labels) - 1:  # labels[1:] all -100
            stats.dropped_overlong += 1  # truncation removed every trained token
            continue
        examples.append({"input_ids": ids, "labels": labels, "row": row.index, "source": row.label})
    stats.kept = len(examples)
    _require_some(examples, stats, rows)
    return examples, stats


def _bad_row(stats: DataStats, error: DataError, skip: bool) -> None:
    if not skip:
        raise error
    stats.bad_rows += 1
    if len(stats.first_errors) < 5:
        stats.first_errors.append(str(error))


def _require_some(examples: list[Any], stats: DataStats, rows: list[Row]) -> None:
    if not examples:
        names = ", ".join(repr(n) for n in dict.fromkeys(r.source for r in rows)) or "(no rows)"
        raise NoUsableRows(f"dataset {names}: no usable rows ({stats.summary()})")


def pair_margin(row: Row, column: str) -> float:
    """The row's target margin (reward model `margin_column`): a number finite in float32 (the loss's dtype)."""
    value = _require_column(row, column)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{row.where()}: column {column!r} must be a finite number (the target margin), got {value!r}")
    if abs(value) > torch.finfo(torch.float32).max:  # 1e300 is finite here but inf in the loss
        raise DataError(
            f"{row.where()}: column {column!r} holds {value!r}, beyond float32's range (the target margin becomes "
            f"inf in the loss; |margin| <= {torch.finfo(torch.float32).max:.4g})"
        )
    return float(value)


def tokenize_preferences(rows: list[Row], tokenizer: Any, cfg: Any) -> tuple[list[dict[str, Any]], DataStats]:
    """Each pair (any preference format, formats.py) -> chosen_ids, rejected_ids and prompt_len (response tokens are
    ids[prompt_len:]), plus `margin` when the config names a margin column (reward model only)."""
    stats = DataStats(rows=len(rows))
    rows = check_duplicate_ids(rows, stats, cfg.skip_bad_rows)
    margin_column = getattr(cfg, "margin_column", None)
    if margin_column:
        check_columns(rows, [margin_column], "margin")
    examples = []
    for row, out in zip(rows, encode_rows(rows, tokenizer, cfg, formats.PREFERENCE, stats)):
        if isinstance(out, DataError):
            _bad_row(stats, out, cfg.skip_bad_rows)
            continue
        chosen_ids, rejected_ids, prompt_len = out["chosen_ids"], out["rejected_ids"], out["prompt_len"]
        if max(len(chosen_ids), len(rejected_ids)) > cfg.max_seq_length:
            if cfg.overlong == "drop" or prompt_len >= cfg.max_seq_length:
                stats.dropped_overlong += 1
                continue
            chosen_ids, rejected_ids = chosen_ids[: cfg.max_seq_length], rejected_ids[: cfg.max_seq_length]
            stats.truncated += 1
        example = {"chosen_ids": chosen_ids, "rejected_ids": rejected_ids, "prompt_len": prompt_len}
        margin = out.get("margin")
        examples.append(
            {**example, "row": row.index, "source": row.label, **({} if margin is None else {"margin": margin})}
        )
    stats.kept = len(examples)
    _require_some(examples, stats, rows)
    return examples, stats


def tokenize_prompts(rows: list[Row], tokenizer: Any, cfg: Any) -> tuple[list[dict[str, Any]], DataStats]:
    """RL prompts (messages or prompt rows, formats.py): the conversation (which must not end with an assistant turn)
    or the prompt string, its ground truth and verifier name."""
    stats = DataStats(rows=len(rows))
    rows = check_duplicate_ids(rows, stats, cfg.skip_bad_rows)
    if rows:
        formats.detect_format(formats.PROMPT, rows[0].data, cfg, rows[0].where())
    if not getattr(cfg, "reward_functions", None):  # reward functions need no verifier or ground truth
        check_columns(rows, [cfg.ground_truth_column], "RL prompt")
    rate_by = getattr(cfg, "correct_rate_by", None)  # RL: each prompt's group (correct_rates.py)
    # RL multi-teacher distillation: the teacher each prompt names (distillation.TeacherRoutes checks the names)
    teacher_by = getattr(cfg, "teacher_column", None) if len(getattr(cfg, "teacher_models", None) or {}) > 1 else None
    if rate_by or teacher_by:
        from open_instruct.correct_rates import group_of
    examples = []
    for row, out in zip(rows, encode_rows(rows, tokenizer, cfg, formats.PROMPT, stats)):
        if isinstance(out, DataError):
            _bad_row(stats, out, cfg.skip_bad_rows)
            continue
        ids = out["prompt_ids"]
        if len(ids) > cfg.max_prompt_length:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            ids = ids[-cfg.max_prompt_length :]  # keep the end: the question and the generation prompt
            stats.truncated += 1
        group = {}  # RL's correct_rate_by: the prompt's group for train/correct_rate/<group>
        if rate_by:
            value = group_of(row.data, row.label, rate_by)
            if value is not None:
                group["rate_group"] = value
        if teacher_by:
            group["teacher"] = group_of(row.data, row.label, teacher_by)
        examples.append(
            {
                "prompt_ids": ids,
                "ground_truth": out["ground_truth"],
                "verifier": out["verifier"],
                "row": row.index,
                "source": row.label,
                "where": row.where(),
                **({"example": out["example"]} if "example" in out else {}),
                **({k: out[k] for k in ("prompt", "columns") if k in out}),
                **group,
            }
        )
    stats.kept = len(examples)
    _require_some(examples, stats, rows)
    return examples, stats


# each script's tokenize function (its load_train_eval's), for the start checks
TOKENIZERS: dict[str, Tokenizer] = {
    "sft": tokenize_sft, "reward_model": tokenize_preferences, "dpo": tokenize_preferences, "rlvr_ppo": tokenize_prompts
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Formats: every row of a recognised format (formats.py) becomes one shape: ("chat", message lists...) rendered
# with the chat template, or ("raw", strings...) tokenized as written (string rows, TRL's convention, unless
# string_rows is chat_template).


def _string_rows_as_chat(cfg: Any) -> bool:
    return getattr(cfg, "string_rows", "raw") == "chat_template"


def _nonempty_strings(row: Row, columns: Sequence[str], what: str) -> list[str]:
    values = [_require_column(row, c) for c in columns]
    for name, value in zip(columns, values):
        if not isinstance(value, str):
            raise DataError(
                f"{row.where()}: column {name!r} must be a string in {what} rows, got {type(value).__name__}"
            )
        if not value.strip():
            raise DataError(f"{row.where()}: column {name!r} is empty")
    return values


def row_tool_schemas(row: Row) -> Optional[list[dict[str, Any]]]:
    """The row's `tools` column for the chat template (apply_chat_template's `tools`, as TRL's SFT reads it): a list
    of tool schemas (JSON objects, e.g. {"type": "function", "function": {"name", "description", "parameters"}}),
    or that list as a JSON string; None when the column is absent, null or empty."""
    value = row.data.get("tools")
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{row.where()}: column 'tools' is a string but not JSON ({e.msg} at char {e.pos})")
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) and t for t in value):
        raise DataError(
            f"{row.where()}: column 'tools' must be a list of tool schemas (JSON objects, as the chat template "
            f"takes them), got {str(value)[:120]!r}"
        )
    return value


def sft_parts(row: Row, fmt: formats.Format, cfg: Any) -> tuple:
    """("chat", messages, first trained turn, tool schemas or None) or ("raw", prompt, completion) for one SFT
    row."""
    where = row.where()
    if fmt.name == "messages":
        messages = _validate_messages(_require_column(row, cfg.messages_column), cfg.messages_column, where, True,
                                      tool_keys=True)  # fmt: skip
        return "chat", messages, 0, row_tool_schemas(row)
    if fmt.name == "text":
        (text,) = _nonempty_strings(row, ["text"], "text")
        return "raw", "", text
    prompt, completion = _require_column(row, "prompt"), _require_column(row, "completion")
    if formats.is_conversation(prompt) and formats.is_conversation(completion):
        p = _validate_messages(prompt, "prompt", where, False, tool_keys=True)
        c = _validate_messages(completion, "completion", where, True, tool_keys=True)
        return "chat", p + c, len(p), row_tool_schemas(row)  # only the completion's turns are trained
    prompt, completion = _nonempty_strings(row, ["prompt", "completion"], "prompt/completion")
    if _string_rows_as_chat(cfg):
        return "chat", [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], 1, None
    return "raw", prompt, completion


def preference_parts(row: Row, fmt: formats.Format, cfg: Any) -> tuple:
    """("chat", prompt, chosen conversation, rejected conversation) or ("raw", prompt, chosen, rejected) for one
    preference row: chosen/rejected conversations sharing a prompt (a string prompt column is then ignored), a
    prompt message list with the replies (TRL's explicit prompt), or strings."""
    chosen = _require_column(row, cfg.chosen_column)
    rejected = _require_column(row, cfg.rejected_column)
    where = row.where()
    if isinstance(chosen, str) or isinstance(rejected, str):
        if fmt.name == "explicit_prompt":
            columns = [cfg.prompt_column, cfg.chosen_column, cfg.rejected_column]
            prompt, chosen, rejected = _nonempty_strings(row, columns, "prompt/chosen/rejected")
        else:
            chosen, rejected = _nonempty_strings(row, [cfg.chosen_column, cfg.rejected_column], "chosen/rejected")
            prompt, chosen, rejected = formats.common_prefix_split(chosen, rejected)
            if not prompt.strip():
                raise DataError(
                    f"{where}: {cfg.chosen_column!r} and {cfg.rejected_column!r} share no prompt (no common prefix); "
                    f"add a {cfg.prompt_column!r} column"
                )
        if _string_rows_as_chat(cfg):
            p = [{"role": "user", "content": prompt}]
            return (
                "chat",
                p,
                p + [{"role": "assistant", "content": chosen}],
                p + [{"role": "assistant", "content": rejected}],
            )
        return "raw", prompt, chosen, rejected
    prompt = row.data.get(cfg.prompt_column) if fmt.name == "explicit_prompt" else None
    if formats.is_conversation(prompt):  # TRL's explicit prompt: the replies continue the prompt's turns
        p = _validate_messages(prompt, cfg.prompt_column, where, False)
        chosen = _validate_messages(chosen, cfg.chosen_column, where, True)
        rejected = _validate_messages(rejected, cfg.rejected_column, where, True)
        chosen = chosen if chosen[: len(p)] == p and len(chosen) > len(p) else p + chosen
        rejected = rejected if rejected[: len(p)] == p and len(rejected) > len(p) else p + rejected
    chosen = _validate_messages(chosen, cfg.chosen_column, where, True)
    rejected = _validate_messages(rejected, cfg.rejected_column, where, True)
    if chosen[:-1] != rejected[:-1]:
        raise DataError(f"{where}: {cfg.chosen_column!r} and {cfg.rejected_column!r} must share the same prompt turns")
    if len(chosen) < 2:
        raise DataError(f"{where}: {cfg.chosen_column!r} has no prompt before the assistant reply")
    return "chat", chosen[:-1], chosen, rejected


def prompt_parts(row: Row, fmt: formats.Format, cfg: Any) -> tuple[tuple, Any, str]:
    """(("chat", messages) or ("raw", prompt), ground truth, verifier name) for one RL row. A conversation that ends
    with an assistant turn loses that turn (open-instruct's RLVR rows carry the answer there; it stays only as ground
    truth): parts[0] is then "chat_answer_dropped", counted and said in the start-up data line."""
    where = row.where()
    column = cfg.messages_column if fmt.name == "messages" else "prompt"
    value = _require_column(row, column)
    if isinstance(value, str) and fmt.name == "prompt":
        (text,) = _nonempty_strings(row, [column], "prompt")
        parts: tuple = ("chat", [{"role": "user", "content": text}]) if _string_rows_as_chat(cfg) else ("raw", text)
    else:
        msgs = _validate_messages(value, column, where, False, tool_keys=True)
        answer_dropped = msgs[-1]["role"] == "assistant"
        msgs = msgs[:-1] if answer_dropped else msgs
        if not msgs:
            raise DataError(f"{where}: column {column!r} has no prompt turn")
        parts = ("chat_answer_dropped" if answer_dropped else "chat", msgs)
    if getattr(cfg, "reward_functions", None) and row.data.get(cfg.verifier_column) is None:
        return parts, row.data.get(cfg.ground_truth_column), None  # scored by the reward functions alone
    ground_truth = _require_column(row, cfg.ground_truth_column)
    verifier, ground_truth = formats.single_verifier(
        row.data.get(cfg.verifier_column), ground_truth, cfg.verifier_column, where
    )
    if not isinstance(verifier, str) or not verifier:
        raise DataError(f"{where}: column {cfg.verifier_column!r} must name a verifier, got {verifier!r}")
    return parts, ground_truth, verifier


# ---------------------------------------------------------------------------------------------------------------------
# Batched tokenization (encode.py), in parallel processes for large datasets (forked workers)


def _encode_sft(rows: list[Row], tokenizer: Any, cfg: Any, fmt: formats.Format) -> list[Any]:
    out: list[Any] = [None] * len(rows)
    chats, raws = [], []
    for k, row in enumerate(rows):
        try:
            parts = sft_parts(row, fmt, cfg)
        except DataError as e:
            out[k] = e
            continue
        (chats if parts[0] == "chat" else raws).append((k, parts[1:]))
    encoded = encode.encode_chats(tokenizer, [p[:2] for _, p in chats], [p[2] for _, p in chats])
    for (k, _), res in zip(chats, encoded):
        out[k] = DataError(f"{rows[k].where()}: {res}") if isinstance(res, str) else res
    for (k, _), res in zip(raws, encode.encode_raw_completions(tokenizer, [p for _, p in raws])):
        out[k] = res
    raw_rows = {k for k, _ in raws}
    return [
        o if isinstance(o, DataError) else {"input_ids": o[0], "labels": o[1], "raw": k in raw_rows}
        for k, o in enumerate(out)
    ]


def _encode_preference(rows: list[Row], tokenizer: Any, cfg: Any, fmt: formats.Format) -> list[Any]:
    out: list[Any] = [None] * len(rows)
    margins: dict[int, Optional[float]] = {}
    chats, raws = [], []
    margin_column = getattr(cfg, "margin_column", None)
    for k, row in enumerate(rows):
        try:
            margins[k] = pair_margin(row, margin_column) if margin_column else None
            parts = preference_parts(row, fmt, cfg)
        except DataError as e:
            out[k] = e
            continue
        (chats if parts[0] == "chat" else raws).append((k, parts[1:]))
    results = list(zip(chats, encode.encode_chat_pairs(tokenizer, [p for _, p in chats])))
    results += zip(raws, encode.encode_raw_pairs(tokenizer, [p for _, p in raws]))
    raw_rows = {k for k, _ in raws}
    for (k, _), res in results:
        where = rows[k].where()
        if isinstance(res, str):
            out[k] = DataError(f"{where}: {res}")
        elif res[0] == res[1]:  # its loss gradient is ~0, which Adam would blow up to an lr-sized step
            out[k] = DataError(f"{where}: chosen and rejected are identical (a pair that prefers nothing)")
        else:
            out[k] = {"chosen_ids": res[0], "rejected_ids": res[1], "prompt_len": res[2], "margin": margins[k]}
            out[k]["raw"] = k in raw_rows
    return out


def _encode_prompts(rows: list[Row], tokenizer: Any, cfg: Any, fmt: formats.Format) -> list[Any]:
    out: list[Any] = [None] * len(rows)
    chats, raws = [], []
    for k, row in enumerate(rows):
        try:
            parts, ground_truth, verifier = prompt_parts(row, fmt, cfg)
        except DataError as e:
            out[k] = e
            continue
        out[k] = {"ground_truth": ground_truth, "verifier": verifier, "raw": parts[0] == "raw"}
        out[k]["answer_dropped"] = parts[0] == "chat_answer_dropped"
        if getattr(cfg, "reward_functions", None):
            out[k].update(reward_function_fields(row, fmt, parts))
        if getattr(cfg, "environment", None):  # what the environment's reset(example) reads: the row's columns
            messages = [{"role": "user", "content": parts[1]}] if parts[0] == "raw" else parts[1]
            out[k]["example"] = {**row.data, "messages": messages, "ground_truth": ground_truth, "verifier": verifier}
        (raws if parts[0] == "raw" else chats).append((k, parts[1]))
    for (k, _), ids in zip(chats, encode.encode_chat_prompts(tokenizer, [p for _, p in chats])):
        out[k]["prompt_ids"] = ids
    for (k, _), ids in zip(raws, encode.encode_raw_prompts(tokenizer, [p for _, p in raws])):
        out[k]["prompt_ids"] = ids
    return out


def reward_function_fields(row: Row, fmt: formats.Format, parts: tuple) -> dict[str, Any]:
    """What TRL's reward_funcs get of a row: the prompt as given (a string, or the messages) and every column."""
    given = row.data.get("prompt") if fmt.name == "prompt" else None
    return {"prompt": given if isinstance(given, str) else parts[1], "columns": dict(row.data)}


_ENCODERS = {formats.SFT: _encode_sft, formats.PREFERENCE: _encode_preference, formats.PROMPT: _encode_prompts}
PARALLEL_FROM_ROWS = 10_000  # below this, worker start-up costs more than it saves
MAP_BATCH_ROWS = 1000


def tokenize_processes(cfg: Any, num_rows: int) -> int:
    """dataset_num_proc, or unset: the CPUs this process may use (at most 16) for PARALLEL_FROM_ROWS rows and
    more, else 1."""
    configured = getattr(cfg, "dataset_num_proc", None)
    if configured:
        return max(1, min(configured, num_rows))
    if num_rows < PARALLEL_FROM_ROWS:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), 16))


def _encode_span(rows: list[Row], tokenizer: Any, cfg: Any, kind: str, fmt: formats.Format, span: range) -> list[Any]:
    """Rows [span.start, span.stop), encoded in batches of MAP_BATCH_ROWS."""
    out: list[Any] = []
    for start in range(span.start, span.stop, MAP_BATCH_ROWS):
        out += _ENCODERS[kind](rows[start : min(start + MAP_BATCH_ROWS, span.stop)], tokenizer, cfg, fmt)
    return out


_JOB: tuple = ()  # in a tokenizing worker process: (rows, tokenizer, cfg, kind, format)


def _start_worker(*job: Any) -> None:
    """Pool initializer: the job, inherited through fork (never pickled)."""
    global _JOB
    _JOB = job


def _encode_job_span(span: range) -> list[Any]:
    return _encode_span(*_JOB, span)


def encode_rows(rows: list[Row], tokenizer: Any, cfg: Any, kind: str, stats: DataStats) -> list[Any]:
    """Per row (in order): its encoded fields (a dict) or the DataError that names its file and row. The format is
    recognised from the first row (formats.detect_format: exit 2 naming the columns when none fits); with more
    than one process (tokenize_processes) the rows are encoded by that many forked processes."""
    if not rows:
        return []
    fmt = formats.detect_format(kind, rows[0].data, cfg, rows[0].where())
    num_proc = tokenize_processes(cfg, len(rows))
    if num_proc == 1 or "fork" not in multiprocessing.get_all_start_methods():
        num_proc = 1  # in batches too: the rendered texts of a whole large dataset need not sit in memory at once
        results = _encode_span(rows, tokenizer, cfg, kind, fmt, range(len(rows)))
    else:
        # Forked workers inherit the rows and the tokenizer (nothing is serialized on the way in); each encodes
        # spans of rows and sends back the results. The processes are the parallelism: tokenizers' own threads
        # would be turned off after the fork anyway (with a warning per process).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        span = max(MAP_BATCH_ROWS, -(-len(rows) // (4 * num_proc)))  # a few spans a process: even finish
        spans = [range(start, min(start + span, len(rows))) for start in range(0, len(rows), span)]
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(num_proc, context, _start_worker, (rows, tokenizer, cfg, kind, fmt)) as pool:
            results = [r for part in pool.map(_encode_job_span, spans) for r in part]
    stats.format, stats.processes = fmt.name, num_proc
    stats.raw_string_rows = sum(1 for r in results if isinstance(r, dict) and r.get("raw"))
    stats.answer_turns_dropped = sum(1 for r in results if isinstance(r, dict) and r.get("answer_dropped"))
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Batching


def pad(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right") -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if side == "right":
            out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        else:
            out[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
    return out


def packed_row(seqs: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Sequences concatenated into ONE row of T = sum of their lengths tokens (no padding at all):

    input_ids [1, T]; position_ids [1, T] restarting at 0 at every sequence start (transformers reads the restarts
    to keep attention inside each sequence, see models.forward_inputs); sequence_ids [1, T], the index of the
    sequence each token belongs to; sequence_lengths [n]."""
    lengths = [len(s) for s in seqs]
    return {
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.long).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
        "sequence_ids": torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths)).unsqueeze(0),
        "sequence_lengths": torch.tensor(lengths, dtype=torch.long),
    }


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    """True for a packed row (packed_row), False for a padded batch."""
    return "sequence_ids" in batch


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens of a batch, for throughput."""
    return batch["input_ids"].numel() if is_packed(batch) else int(batch["attention_mask"].sum())


def batch_sequences(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a batch: a padded batch's rows, a packed row's sequences."""
    return len(batch["sequence_lengths"]) if is_packed(batch) else len(batch["input_ids"])


def _sequence_starts(lengths: Sequence[int]) -> list[int]:
    """Where each sequence of a packed row starts."""
    return [0, *itertools.accumulate(lengths)][:-1]


def pins_host_batches(device: Any) -> bool:
    """Whether host data go to `device` through pinned memory with non-blocking copies: on a CUDA device (a
    `.to(device)` from ordinary pageable memory makes the host wait until the copy is done)."""
    return torch.device(device).type == "cuda"


def host_to_device(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """`tensor` on `device`; from the host through pinned (page-locked) memory with a non-blocking copy where
    `pins_host_batches`: the host goes on preparing the next micro-batch while the copy runs in stream order, and the
    caching host allocator keeps the pinned buffer alive until its copy has run."""
    if tensor.device.type != "cpu" or not pins_host_batches(device):
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def to_device(batch: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    """A host batch on `device` (`host_to_device` for each tensor)."""
    return {k: host_to_device(v, device) for k, v in batch.items()}


def collate_sft(examples: Sequence[dict[str, Any]], pad_id: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded rows (input_ids, labels -100 on padding, attention_mask), or with `packed` one packed_row whose
    labels are -100 at every sequence start: the shifted loss then never predicts a sequence's first token from the
    sequence before it (a padded row never predicts its first token either)."""
    if packed:
        batch = packed_row([e["input_ids"] for e in examples])
        labels = torch.tensor([t for e in examples for t in e["labels"]], dtype=torch.long)
        labels[_sequence_starts([len(e["input_ids"]) for e in examples])] = -100
        return {**batch, "labels": labels.unsqueeze(0)}
    input_ids = pad([e["input_ids"] for e in examples], pad_id)
    labels = pad([e["labels"] for e in examples], -100)
    attention_mask = pad([[1] * len(e["input_ids"]) for e in examples], 0)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def collate_preferences(
    examples: Sequence[dict[str, Any]], pad_id: int, packed: bool = False
) -> dict[str, torch.Tensor]:
    """Chosen sequences first, then rejected ones, in one right-padded batch (one forward for both), or with `packed`
    in one packed_row (sequence i < n: chosen of pair i; n + i: rejected of pair i).

    loss_mask marks response tokens (after the prompt, before padding); `margin` [pairs] when the pairs carry one."""
    seqs = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    prompt_lens = [e["prompt_len"] for e in examples] * 2
    loss_mask = [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, prompt_lens)]
    if packed:
        batch = packed_row(seqs)
        flat = torch.tensor([m for row in loss_mask for m in row], dtype=torch.long)
        flat[_sequence_starts([len(s) for s in seqs])] = 0  # never scored from the sequence before (see collate_sft)
        batch["loss_mask"] = flat.unsqueeze(0)
    else:
        batch = {"input_ids": pad(seqs, pad_id), "attention_mask": pad([[1] * len(s) for s in seqs], 0)}
        batch["loss_mask"] = pad(loss_mask, 0)
    if "margin" in examples[0]:
        batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float32)
    return batch


def collate_episodes(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    extra_columns: int = 0,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """Left-padded prompts followed by right-padded responses, so every response starts at the same column and the
    logits of all response tokens are the last R+1 positions. Positions count real tokens only (as in generation).
    `extra_columns` pad columns after the longest response give a value for the state after its last token.

    Returns input_ids/attention_mask/position_ids [B, P+R], responses [B, R] (pad 0) and mask [B, R].

    packed: prompt+response of every episode in one packed_row, and the same responses and mask, plus
    window_index [B, R+1]: where in the row sit the R+1 positions the padded layout ends with (column j: the token
    before response token j, i.e. the last prompt token for j = 0), repeating the episode's last token past its end
    (those columns are masked, as padding is)."""
    if not packed:
        return _padded_episodes(prompts, responses, pad_id, extra_columns)
    width_r = max(len(r) for r in responses) + extra_columns
    batch = packed_row([list(p) + list(r) for p, r in zip(prompts, responses)])
    starts = _sequence_starts(batch["sequence_lengths"].tolist())
    columns = torch.arange(width_r + 1)
    window, resp = [], torch.zeros(len(prompts), width_r, dtype=torch.long)
    for i, (start, p, r) in enumerate(zip(starts, prompts, responses)):
        window.append(start + len(p) - 1 + columns.clamp(max=len(r)))
        resp[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    lengths = torch.tensor([len(r) for r in responses]).unsqueeze(1)
    return {**batch, "window_index": torch.stack(window), "responses": resp, "mask": (columns[:-1] < lengths).float()}


def _padded_episodes(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, extra_columns: int
) -> dict[str, torch.Tensor]:
    width_p, width_r = max(len(p) for p in prompts), max(len(r) for r in responses) + extra_columns
    n = len(prompts)
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, width_p - len(p) : width_p] = torch.as_tensor(list(p), dtype=torch.long)
        input_ids[i, width_p : width_p + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        attention_mask[i, width_p - len(p) : width_p + len(r)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    response_mask = attention_mask[:, width_p:].float()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, width_p:] * attention_mask[:, width_p:],
        "mask": response_mask,
    }


class EpisodeStream:
    """The global order in which examples are consumed: epoch e is a permutation seeded by (seed, e).

    Position is counted in episodes (examples consumed, summed over processes), so a run checkpointed on N
    processes continues on M with no example skipped or repeated: step k of any run with global batch B reads
    stream[k*B : (k+1)*B], and rank r takes its contiguous slice of that.

    With `strata` (a mixture: each example's source id), each source is shuffled on its own and the sources are
    interleaved evenly: the j-th of a source's n rows in an epoch sits at fraction (j + 0.5) / n of the epoch (ties
    by source id). Each source then holds its share of every stretch of the stream, not only of whole epochs: with
    two sources, the first N episodes of an epoch hold N x share of each, rounded up or down (tests/test_mixture.py).
    """

    def __init__(self, num_examples: int, seed: int, shuffle: bool = True, strata: Optional[Sequence[int]] = None):
        if num_examples <= 0:
            raise ConfigError("the dataset has no examples")
        if strata is not None and len(strata) != num_examples:
            raise ValueError(f"strata has {len(strata)} entries for {num_examples} examples")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.strata = list(strata) if strata is not None else None
        self._cache: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._cache:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            if self.strata is None:
                order = list(range(self.num_examples))
                if self.shuffle:
                    rng.shuffle(order)
            else:
                order = self._interleaved(rng)
            self._cache = {epoch: order}  # keep only the current epoch
        return self._cache[epoch]

    def _interleaved(self, rng: random.Random) -> list[int]:
        members: dict[int, list[int]] = {}
        for i, stratum in enumerate(self.strata or []):
            members.setdefault(stratum, []).append(i)
        keyed = []
        for stratum in sorted(members):
            rows = members[stratum]
            if self.shuffle:
                rng.shuffle(rows)
            keyed += [((j + 0.5) / len(rows), stratum, i) for j, i in enumerate(rows)]
        return [i for _, _, i in sorted(keyed)]

    def take(self, start_episode: int, count: int) -> list[int]:
        out: list[int] = []
        pos = start_episode
        while len(out) < count:
            epoch, offset = divmod(pos, self.num_examples)
            chunk = self._epoch_order(epoch)[offset : offset + count - len(out)]
            out.extend(chunk)
            pos += len(chunk)
        return out

    @staticmethod
    def local_slice(global_indices: list[int], rank: int, world_size: int) -> list[int]:
        per_rank = len(global_indices) // world_size
        return global_indices[rank * per_rank : (rank + 1) * per_rank]


# ---------------------------------------------------------------------------------------------------------------------
# Micro-batches: a fixed number of rows (padded), or a token budget (packed: max_tokens_per_micro_batch)


def packed_length(example: dict[str, Any]) -> int:
    """Tokens an SFT example or a preference pair takes in a packed row: a pair counts both its sequences, which
    always share a micro-batch (the pair's loss needs both)."""
    if "input_ids" in example:
        return len(example["input_ids"])
    return len(example["chosen_ids"]) + len(example["rejected_ids"])


def pack_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into as few packs as best-fit decreasing finds, each summing to at most `budget`:
    the longest item first, each into the fullest pack that still has room (a new pack when none has). Deterministic
    (ties by index); each pack lists its indices in increasing order. O(n log n): it also packs whole datasets (the
    DPO reference pass)."""
    import bisect

    too_long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"item {i} has {n} tokens, more than the token budget {budget}")
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, pack index), sorted: the first with room >= n fits best
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        k = bisect.bisect_left(rooms, (lengths[i], -1))
        if k == len(rooms):
            packs.append([])
            room, pack = budget, len(packs) - 1
        else:
            room, pack = rooms.pop(k)
        packs[pack].append(i)
        bisect.insort(rooms, (room - lengths[i], pack))
    return [sorted(p) for p in packs]


def micro_batches(
    items: list[Any], size: int, lengths: Optional[Sequence[int]] = None, max_tokens: Optional[int] = None
) -> list[list[Any]]:
    """One device's micro-batches of `items`: consecutive runs of `size` items, or, with a token budget
    `max_tokens` (and each item's length), packs of items holding at most that many tokens (pack_by_token_budget)."""
    if max_tokens:
        assert lengths is not None and len(lengths) == len(items)
        return [[items[i] for i in pack] for pack in pack_by_token_budget(lengths, max_tokens)]
    return [items[i : i + size] for i in range(0, len(items), size)]


def shard_for_eval(items: list[Any], rank: int, world_size: int) -> list[Any]:
    """Strided eval shard: every item is evaluated exactly once across ranks (sums are all-reduced)."""
    return items[rank::world_size]


def dealt_micro_batches(
    items: list[Any],
    batch_size: int,
    rank: int,
    world_size: int,
    lengths: Optional[Sequence[int]] = None,
    max_tokens: Optional[int] = None,
) -> list[tuple[list[Any], bool]]:
    """This rank's eval micro-batches as (batch, is_real): micro_batches of `items` (consecutive runs of batch_size,
    or packs of at most max_tokens tokens) dealt round-robin.

    Every rank gets the same number of batches, because an FSDP forward is collective (each layer all-gathers its
    shards): a rank with fewer batches would leave the others waiting forever. A rank with none left repeats the
    first batch with is_real False (run the forward, drop the result). The batches themselves do not depend on the
    world size, so each item is scored with the same batch-mates and padding on 1 or N processes."""
    groups = micro_batches(items, batch_size, lengths, max_tokens)
    rounds = -(-len(groups) // world_size)
    out = []
    for k in range(rounds):
        g = k * world_size + rank
        out.append((groups[g], True) if g < len(groups) else (groups[0], False))
    return out


def maybe_limit(items: list[Any], limit: Optional[int]) -> list[Any]:
    return items if limit is None else items[:limit]


Tokenizer = Callable[[list[Row], Any, Any], tuple[list[dict[str, Any]], DataStats]]


# Config fields that change the examples (with every *_column field): part of the tokenized-data cache key.
DATA_FIELDS = (
    "dataset_name_or_path",
    "dataset_mixer_list",
    "dataset_split",
    "eval_dataset_name_or_path",
    "eval_dataset_mixer_list",
    "eval_dataset_split",
    "eval_fraction",
    "max_train_samples",
    "max_eval_samples",
    "max_seq_length",
    "max_prompt_length",
    "overlong",
    "skip_bad_rows",
    "seed",
    "string_rows",
    "environment",  # environment runs keep each row's columns for the environment's reset
    "reward_functions",  # runs with reward functions keep each row's columns and prompt for them
    "correct_rate_by",  # RL: each prompt keeps its group
)
# The modules that turn rows into examples: editing one invalidates the cache.
DATA_CODE = (
    "data.py",
    "encode.py",
    "chat_render.py",
    "formats.py",
    "mixture.py",
    "data_cache.py",
)  # an integration's own code is in its sources' identity (integrations.Source.identity)


def cache_ingredients(cfg: Any, tokenizer: Any, tokenize: Tokenizer) -> dict[str, Any]:
    """What the tokenized-data cache key hashes: the sources' identities, the tokenizer, the data fields of the
    config and the code version (data_cache module docstring)."""
    fields = {k: getattr(cfg, k, None) for k in DATA_FIELDS}
    fields.update({k: v for k, v in sorted(vars(cfg).items()) if k.endswith("_column")})
    sources = {}
    for key in ("dataset_name_or_path", "eval_dataset_name_or_path"):
        value = getattr(cfg, key, None)
        if value:
            sources[key] = [data_cache.source_identity(p) for p in integrations.expand_sources(value)]
    for key in ("dataset_mixer_list", "eval_dataset_mixer_list"):
        value = getattr(cfg, key, None)
        if value:
            sources[key] = [data_cache.source_identity(str(x)) for x in value]
    here = os.path.dirname(os.path.abspath(__file__))
    return {
        "tokenize": tokenize.__name__,
        "tokenizer": data_cache.tokenizer_identity(tokenizer),
        "fields": fields,
        "sources": sources,
        "code": data_cache.code_identity([os.path.join(here, name) for name in DATA_CODE]),
    }


def _describe_inputs(stats: DataStats, cfg: Any, cache: str) -> str:
    """The start-up summary's words on the format, the string-row convention and the cache."""
    text = f"format {stats.format or '-'}"
    if stats.raw_string_rows:
        text += (
            f", {stats.raw_string_rows} string rows tokenized raw (TRL's convention, no chat template; "
            "string_rows chat_template applies it)"
        )
    elif getattr(cfg, "string_rows", "raw") == "chat_template":
        text += ", string rows rendered with the chat template"
    if stats.answer_turns_dropped:
        text += (
            f", {stats.answer_turns_dropped} RL prompts ended with an assistant turn: that turn dropped "
            "(open-instruct's convention; the answer stays only as ground truth)"
        )
    return f"{text}; {cache}"


@contextlib.contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while: loading builds millions of small dicts and lists (rows,
    token ids) that hold no reference cycles, which it would traverse again and again as they pile up (a quarter
    of the tokenizing time, and of reading the cache); reference counting frees them all the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_train_eval(cfg: Any, tokenizer: Any, tokenize: Tokenizer) -> tuple[list[dict], list[dict], DataStats]:
    """Load, validate and tokenize the train set and the held-out set (given, or split off by eval_fraction), or
    read them from the tokenized-data cache (data_cache.py) when an earlier run or a resume made them.

    The main process goes first (accelerate's main_process_first pattern): it tokenizes and writes the entry, the
    other processes then read it. A data error on the main process releases the others, which meet it too."""
    with cycle_collection_paused():
        return _load_train_eval(cfg, tokenizer, tokenize)


def _load_train_eval(cfg: Any, tokenizer: Any, tokenize: Tokenizer) -> tuple[list[dict], list[dict], DataStats]:
    root = data_cache.cache_root(getattr(cfg, "dataset_cache_dir", None))
    if root is None:
        train, evals, stats = build_train_eval(cfg, tokenizer, tokenize)
        stats.inputs = _describe_inputs(stats, cfg, "tokenized-data cache off")
        return train, evals, stats
    from accelerate import PartialState

    state = PartialState()
    ingredients = cache_ingredients(cfg, tokenizer, tokenize)
    folder = os.path.join(root, data_cache.entry_key(ingredients))
    if not state.is_main_process:
        state.wait_for_everyone()  # the main process tokenizes and writes the entry first
    try:
        cached = data_cache.load(folder)
        if cached is not None:
            train, evals, meta = cached
            stats = DataStats(**meta["stats"])
            stats.inputs = _describe_inputs(stats, cfg, f"tokenized data read from the cache {folder}")
        else:
            train, evals, stats = build_train_eval(cfg, tokenizer, tokenize)
            meta = {"stats": dataclasses.asdict(stats), "ingredients": ingredients}
            written = state.is_main_process and data_cache.save(folder, train, evals, meta)
            cache = f"tokenized data written to the cache {folder}" if written else "tokenized (cache not written)"
            cache = f"{stats.processes} tokenizing processes; {cache}" if stats.processes > 1 else cache
            stats.inputs = _describe_inputs(stats, cfg, cache)
    finally:
        if state.is_main_process:
            state.wait_for_everyone()
    return train, evals, stats


def build_train_eval(cfg: Any, tokenizer: Any, tokenize: Tokenizer) -> tuple[list[dict], list[dict], DataStats]:
    """Load, validate and tokenize the train set and the held-out set (given, or split off by eval_fraction).
    Either set may be a mixture (`dataset_mixer_list`); every example carries its source's label as "source"."""
    sources: list[dict] = []
    if cfg.dataset_mixer_list is not None:
        train_rows, sources = load_mixture(cfg.dataset_mixer_list, cfg.dataset_split, cfg.seed, "dataset_mixer_list")
    else:
        train_rows = load_rows(cfg.dataset_name_or_path, cfg.dataset_split, cfg.max_train_samples)
    train, stats = tokenize(train_rows, tokenizer, cfg)
    stats.sources = sources
    stats.count_kept_per_source(train)
    stats.require_every_source("dataset_mixer_list")
    eval_examples: list[dict] = []
    if cfg.eval_dataset_mixer_list is not None:
        eval_rows, eval_sources = load_mixture(
            cfg.eval_dataset_mixer_list, cfg.eval_dataset_split, cfg.seed, "eval_dataset_mixer_list"
        )
        _refuse_repeated_tasks(train_rows, eval_rows, cfg)
        eval_examples, eval_stats = tokenize(eval_rows, tokenizer, cfg)
        eval_stats.sources = eval_sources
        eval_stats.count_kept_per_source(eval_examples)
        eval_stats.require_every_source("eval_dataset_mixer_list")
    elif cfg.eval_dataset_name_or_path:
        eval_rows = load_rows(cfg.eval_dataset_name_or_path, cfg.eval_dataset_split, cfg.max_eval_samples)
        _refuse_repeated_tasks(train_rows, eval_rows, cfg)
        eval_examples, _ = tokenize(eval_rows, tokenizer, cfg)
    elif cfg.eval_fraction > 0:
        train, eval_examples = split_train_eval(train, cfg.eval_fraction, cfg.seed)
        eval_examples = maybe_limit(eval_examples, cfg.max_eval_samples)
    return train, eval_examples, stats


def _refuse_repeated_tasks(train_rows: list[Row], eval_rows: list[Row], cfg: Any) -> None:
    """A held-out source an integration generates the way it generated a training source would repeat its rows
    (Source.check_held_out)."""
    train, held_out = [sorted({r.source for r in rows}) for rows in (train_rows, eval_rows)]
    for integration in {integrations.find(s) for s in train + held_out} - {None}:
        if integration.check_held_out is not None:
            integration.check_held_out(train, held_out, cfg.dataset_split, cfg.eval_dataset_split)


def episode_stream(train: list[dict], cfg: Any) -> "EpisodeStream":
    """The train order of a script: shuffled or as written (`train_order`); a mixture's sources are interleaved
    evenly (see EpisodeStream)."""
    if cfg.dataset_mixer_list is None:
        return EpisodeStream(len(train), cfg.seed, shuffle=cfg.train_order == "shuffled")
    labels = sorted({e["source"] for e in train})
    return EpisodeStream(len(train), cfg.seed, strata=[labels.index(e["source"]) for e in train])


def mixed_sources(examples: list[dict]) -> list[str]:
    """The source labels of a held-out set drawn from several sources (sorted; [] for one source). Every rank
    holds the whole set, so every rank gets the same list: per-source sums can be all-reduced key by key."""
    labels = sorted({e.get("source", "") for e in examples})
    return labels if len(labels) > 1 else []
