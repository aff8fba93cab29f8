"""The tokenized-data cache: a run's tokenized train and held-out examples, saved once (Arrow files written with
pyarrow) and read back by later runs and resumes with the same data, tokenizer, template, lengths and code.

    <cache root>/<key>/train.arrow, eval.arrow   Arrow IPC files (memory-mapped when read; token ids as int32 lists)
    <cache root>/<key>/meta.json                 the data summary and the key's ingredients (readable: why a key missed)

The key is a hash of: each local source's absolute path, size and modification time (a hub dataset: its name and
split), the tokenizer (its full serialized form and chat template), every config field that changes the examples,
and the source code of the modules that make them. An entry is written to a temporary folder and renamed, so a
killed run leaves no half entry; an unwritable cache folder only costs the reuse (a warning). This module imports
no torch, and pyarrow only (not `datasets`, whose import alone costs about a second) when it reads or writes.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import warnings
from typing import Any, Optional

from open_instruct import integrations

CACHE_ENV = "OPEN_INSTRUCT_DATA_CACHE"
DEFAULT_ROOT = "~/.cache/open_instruct/tokenized"
META = "meta.json"


def cache_root(setting: Optional[str]) -> Optional[str]:
    """The cache folder from `dataset_cache_dir`: None when it is 'none'; unset: $OPEN_INSTRUCT_DATA_CACHE, else
    ~/.cache/open_instruct/tokenized."""
    value = setting if setting else os.environ.get(CACHE_ENV) or DEFAULT_ROOT
    if value.strip().lower() == "none":
        return None
    return os.path.abspath(os.path.expanduser(value))


def source_identity(name: str) -> Any:
    """What identifies one source's content cheaply: for a local file its path, size and mtime; for a folder the
    same for every file in it; an integration's source what it names (integrations.Source.identity: the spec, the
    package's version, the code that makes the rows); otherwise (a hub dataset name, a mixture amount) the text."""
    integration = integrations.find(name)
    if integration is not None:
        return integration.identity(name)
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        st = os.stat(path)
        return [os.path.abspath(path), st.st_size, st.st_mtime_ns]
    if os.path.isdir(path):
        files = []
        for folder, _, names in sorted(os.walk(path)):
            for n in sorted(names):
                st = os.stat(os.path.join(folder, n))
                files.append([os.path.relpath(os.path.join(folder, n), path), st.st_size, st.st_mtime_ns])
        return [os.path.abspath(path), files]
    return name


def tokenizer_identity(tokenizer: Any) -> str:
    """A hash of everything in the tokenizer that changes token ids: the fast tokenizer's serialized form (else its
    vocabulary), its chat template and special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None), state.pop("padding", None)  # call settings, not the tokenization
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extras = [type(tokenizer).__name__, tokenizer.chat_template, str(tokenizer.special_tokens_map)]
    h.update(json.dumps(extras).encode())
    return h.hexdigest()


def code_identity(paths: list[str]) -> str:
    """A hash of the source files that turn rows into examples: editing them invalidates every entry."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def entry_key(ingredients: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _to_columns(examples: list[dict[str, Any]]) -> tuple[dict[str, list], list[str]]:
    """Column lists for Arrow; a column whose values are not all ints/floats/strings/int lists (a ground truth can be
    anything JSON) is stored as JSON text, and named in the returned list."""
    keys = list(examples[0]) if examples else []
    columns, as_json = {}, []
    for key in keys:
        values = [e.get(key) for e in examples]
        kinds = {type(v) for v in values}
        plain = kinds <= {int} or kinds <= {int, float} or kinds <= {str} or kinds <= {bool}
        if kinds == {list}:  # token ids (checked on the first rows: every list column here is one)
            plain = all(type(x) is int for v in values[:100] for x in v)
        if plain:
            columns[key] = values
        else:
            columns[key] = [json.dumps(v) for v in values]
            as_json.append(key)
    return columns, as_json


def _arrow_array(values: list) -> Any:
    """An Arrow column. Token-id lists become int32 lists (half the bytes of int64; ids are < 2**31), built from
    one flat array and the offsets (4x faster than pyarrow's conversion of nested Python lists)."""
    import numpy as np
    import pyarrow as pa

    if not values or not isinstance(values[0], list):
        return pa.array(values)
    flat = array.array("i", itertools.chain.from_iterable(values))
    offsets = array.array("i", itertools.accumulate(map(len, values), initial=0))
    return pa.ListArray.from_arrays(np.frombuffer(offsets, dtype=np.int32), np.frombuffer(flat, dtype=np.int32))


def _from_columns(columns: dict[str, list], as_json: list[str]) -> list[dict[str, Any]]:
    for key in as_json:
        columns[key] = [json.loads(v) for v in columns[key]]
    keys = list(columns)
    return [dict(zip(keys, values)) for values in zip(*(columns[k] for k in keys))]


def load(folder: str) -> Optional[tuple[list[dict], list[dict], dict]]:
    """(train, eval, meta) of a complete entry, or None when there is none (or it cannot be read)."""
    if not os.path.isfile(os.path.join(folder, META)):
        return None
    import pyarrow as pa

    try:
        with open(os.path.join(folder, META)) as f:
            meta = json.load(f)
        parts = []
        for split in ("train", "eval"):
            if split not in meta["json_columns"]:  # no examples (a run without a held-out set)
                parts.append([])
                continue
            with pa.memory_map(os.path.join(folder, f"{split}.arrow")) as source:
                table = pa.ipc.open_file(source).read_all()
            parts.append(_from_columns(table.to_pydict(), meta["json_columns"][split]))
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        warnings.warn(f"tokenized-data cache entry {folder} is unreadable ({e}); tokenizing again", stacklevel=2)
        return None
    return parts[0], parts[1], meta


def save(folder: str, train: list[dict], evals: list[dict], meta: dict[str, Any]) -> bool:
    """Write an entry atomically (temporary folder, then rename). False (and a warning) when it cannot be written;
    an entry another process wrote first is kept."""
    import pyarrow as pa

    parent = os.path.dirname(folder)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp_", dir=parent)
        meta = {**meta, "json_columns": {}}
        for split, examples in (("train", train), ("eval", evals)):
            if not examples:
                continue
            columns, as_json = _to_columns(examples)
            table = pa.table({k: _arrow_array(v) for k, v in columns.items()})
            with pa.OSFile(os.path.join(tmp, f"{split}.arrow"), "wb") as sink:
                with pa.ipc.new_file(sink, table.schema) as writer:
                    writer.write_table(table)
            meta["json_columns"][split] = as_json
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isfile(os.path.join(folder, META)):
                raise
        return True
    except OSError as e:
        warnings.warn(f"could not write the tokenized-data cache to {folder}: {e}", stacklevel=2)
        return False
    finally:
        if tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
