"""Checkpoints: full training state written atomically, validated on load, last K kept; HF-format exports.

Layout under <output_dir>:
    checkpoints/step_<N>/          model(s) + optimizer(s) (torch.distributed.checkpoint: sharded under FSDP,
                                   re-shardable to another world size), trainer_state.json (counters, scheduler,
                                   data position in episodes, best metric), rollout_buffer.{json,ints.npy,
                                   floats.npy} (async RL's rollouts in flight: ARRAY_STATE_KEYS), manifest.json
                                   (file sizes + sha256 of the small files) and COMPLETE, written last.
    checkpoints/.tmp_step_<N>_*/   a checkpoint being written; renamed into place when complete, never read.
    best_model/                    HF-format model of the best eval metric so far (atomic).
    final_model/                   HF-format model at the end of training (atomic).

Randomness in the scripts is derived from (seed, counters), so no RNG pickles are needed to resume exactly.
trainer_state.json records the run_id of <output_dir>/run.json (run_dir.py): `auto` resumes only this run's
checkpoints, and `check_resume_compatible` compares a checkpoint with the config before any model loads.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Union

from open_instruct import run_dir, user_code
from open_instruct.config import CONFIG_CLASSES, declared_settings
from open_instruct.distributed import global_sum, maybe_dump_shard_report
from open_instruct.errors import ConfigError, NonFiniteError
from open_instruct.file_digests import file_digest, source_files
from open_instruct.preflight import looks_local, weight_files
from open_instruct.rl_algorithms import ALGO_ESTIMATORS
from open_instruct.run_dir import FAULT_ENV, fault_point  # noqa: F401 (FAULT_ENV: the tests' name for it)

if TYPE_CHECKING:  # torch is imported where tensors are touched: start-up reads checkpoints before the slow import
    import torch

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_HASH_LIMIT = 64 * 1024 * 1024  # hash files up to this size; larger ones are checked by size


class CheckpointError(RuntimeError):
    pass


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_manifest(folder: str) -> None:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name in (MANIFEST, COMPLETE):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            size = os.path.getsize(path)
            files[rel] = {"size": size, **({"sha256": _sha256(path)} if size <= _HASH_LIMIT else {})}
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": files, "written_at": time.time()}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(folder, COMPLETE), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())


def validate(folder: str, deep: bool = True) -> Optional[str]:
    """None if the folder is a complete checkpoint, else the reason it is not."""
    if not os.path.isfile(os.path.join(folder, COMPLETE)):
        return "no COMPLETE marker (the save was interrupted)"
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, info in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"missing file {rel}"
        if os.path.getsize(path) != info["size"]:
            return f"file {rel} has {os.path.getsize(path)} bytes, manifest says {info['size']}"
        if deep and "sha256" in info and _sha256(path) != info["sha256"]:
            return f"file {rel} fails its checksum"
    return None


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def valid_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """The complete checkpoints of `output_dir` (manifest and COMPLETE marker present), oldest first."""
    return [(step, path) for step, path in list_checkpoints(output_dir) if validate(path, deep=False) is None]


def read_state(path: str) -> dict[str, Any]:
    """A checkpoint's trainer_state.json (counters, config, run_id, model classes): plain JSON, no torch. An entry
    kept in files of its own (ARRAY_STATE_KEYS) reads as {"in_files": key}; load_checkpoint reads it whole."""
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


# Trainer-state entries that hold per-token lists (the async rollout buffer: millions of numbers on a large run) are
# written beside trainer_state.json, not in it: <key>.json holds the structure, every long list of ints or floats
# replaced by a reference into <key>.ints.npy / <key>.floats.npy (int64 / float64, so every value comes back exactly,
# as the same Python type). A JSON line per number would cost ~45 bytes and ~4 us per token to write.
ARRAY_STATE_KEYS = ("rollout_buffer",)
_MIN_ARRAY_LENGTH = 16  # shorter lists stay in the JSON
_ARRAY_KINDS = {"__ints__": (int, "int64"), "__floats__": (float, "float64")}
_ESCAPE = "__dict__"  # wraps a one-key dict of the state whose key is one of these (so it is not read as a reference)


def split_arrays(value: Any, flats: dict[str, list]) -> Any:
    """`value` with each list of >= _MIN_ARRAY_LENGTH ints (floats) appended to flats["__ints__"]
    (flats["__floats__"]) and replaced by {"__ints__": [start, length]} (start in the concatenation). Lists mixing
    types, and bools, stay as they are; a one-key dict of the state keyed like a reference is escaped."""
    if isinstance(value, dict):
        out = {k: split_arrays(v, flats) for k, v in value.items()}
        return {_ESCAPE: out} if len(out) == 1 and next(iter(out)) in (*_ARRAY_KINDS, _ESCAPE) else out
    if isinstance(value, (list, tuple)):
        kinds = {type(x) for x in value} if len(value) >= _MIN_ARRAY_LENGTH else set()
        for name, (kind, _) in _ARRAY_KINDS.items():
            if kinds == {kind}:
                flat = flats.setdefault(name, [])
                start = len(flat)
                flat.extend(value)
                return {name: [start, len(value)]}
        return [split_arrays(v, flats) for v in value]
    return value


def join_arrays(value: Any, arrays: dict[str, Any]) -> Any:
    """The value split_arrays split, from its structure and the flat arrays (numpy, by name)."""
    if isinstance(value, dict):
        ((name, inner),) = value.items() if len(value) == 1 else ((None, None),)
        if name in _ARRAY_KINDS:
            start, length = inner
            return arrays[name][start : start + length].tolist()
        if name == _ESCAPE:  # the state's own one-key dict whose key looks like a reference
            return {k: join_arrays(v, arrays) for k, v in inner.items()}
        return {k: join_arrays(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [join_arrays(v, arrays) for v in value]
    return value


def write_array_state(folder: str, key: str, value: Any) -> None:
    """<folder>/<key>.json (the structure) and one .npy per kind of number (split_arrays)."""
    import numpy as np

    flats: dict[str, list] = {}
    structure = split_arrays(value, flats)
    for name, (_, dtype) in _ARRAY_KINDS.items():
        np.save(os.path.join(folder, f"{key}.{name.strip('_')}.npy"), np.asarray(flats.get(name, []), dtype=dtype))
    with open(os.path.join(folder, f"{key}.json"), "w") as f:
        json.dump(structure, f, separators=(",", ":"))


def read_array_state(folder: str, key: str) -> Any:
    import numpy as np

    arrays = {name: np.load(os.path.join(folder, f"{key}.{name.strip('_')}.npy")) for name in _ARRAY_KINDS}
    with open(os.path.join(folder, f"{key}.json")) as f:
        return join_arrays(json.load(f), arrays)


def find_resume_checkpoint(output_dir: str, log: Any = print, run_id: Optional[str] = None) -> Optional[str]:
    """The newest valid checkpoint (of run `run_id`, when given); invalid ones and other runs' are reported and
    skipped (falling back to older ones)."""
    for step, path in reversed(list_checkpoints(output_dir)):
        reason = validate(path)
        if reason is None and run_id is not None:
            written_by = read_state(path).get("run_id")
            writer = f"run {written_by}" if written_by else "a run that recorded no run_id"
            reason = None if written_by == run_id else f"written by {writer}, not this run {run_id}"
        if reason is None:
            return path
        log(f"skipping checkpoint {path}: {reason}")
    return None


def resolve_resume(resume_from_checkpoint: Optional[str], output_dir: str, log: Any = print) -> Optional[str]:
    """The checkpoint to resume from: `auto` -> the newest valid one of this folder's run (run.json), a path -> that
    path (CheckpointError if it is not complete and intact), unset -> None."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "auto":
        return find_resume_checkpoint(output_dir, log, run_dir.run_id_of(output_dir))
    reason = validate(resume_from_checkpoint)
    if reason is not None:
        raise CheckpointError(f"resume_from_checkpoint {resume_from_checkpoint}: {reason}")
    return resume_from_checkpoint


def _state_dicts(models: dict[str, Any], optimizers: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for name, model in models.items():
        msd, osd = get_state_dict(model, optimizers[name] if name in optimizers else [])
        out[f"model.{name}"] = msd
        if name in optimizers:
            out[f"optim.{name}"] = osd
    return out


def save_checkpoint(
    output_dir: str,
    step: int,
    models: dict[str, Any],
    optimizers: dict[str, Any],
    trainer_state: dict[str, Any],
    accelerator: Any,
    keep_last: int,
    tokenizer: Any = None,
) -> str:
    """Write checkpoints/step_<step> atomically on all ranks; returns its path. Old ones beyond keep_last go.

    If anything fails, the temp folder is removed and earlier checkpoints are untouched."""
    import torch.distributed.checkpoint as dcp

    root = checkpoints_dir(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = None
    if accelerator.is_main_process:
        os.makedirs(root, exist_ok=True)
        tmp = run_dir.make_temp_dir(f".tmp_step_{step}_", root)
    tmp = _broadcast_str(tmp, accelerator)
    try:
        dcp.save(_state_dicts(models, optimizers), checkpoint_id=os.path.join(tmp, "state"))
        fault_point("checkpoint_state", step)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            # Configs and tokenizer make the checkpoint self-contained for `open_instruct.export`.
            classes = {}
            for name, model in models.items():
                unwrapped = accelerator.unwrap_model(model)
                unwrapped.config.save_pretrained(os.path.join(tmp, "hf", name))
                classes[name] = _auto_class_name(unwrapped)
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, "hf", "tokenizer"))
            trainer_state = {**trainer_state, "model_classes": classes}
            for key in ARRAY_STATE_KEYS:
                if key in trainer_state:
                    write_array_state(tmp, key, trainer_state[key])
                    trainer_state[key] = {"in_files": key}
            with open(os.path.join(tmp, STATE), "w") as f:
                json.dump(trainer_state, f, indent=1)
            write_manifest(tmp)
            run_dir.apply_umask_tree(tmp)  # what rank 0 can see; shard files of other nodes keep their writers' modes
            fault_point("checkpoint_write", step)
            if os.path.exists(final):  # re-saving a step after a resume: replace the older copy
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
            fault_point("checkpoint_prune", step)
            prune_checkpoints(output_dir, keep_last)
    except BaseException as e:
        if accelerator.is_main_process and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise_plainly_if_disk_full(e, root)
        raise
    accelerator.wait_for_everyone()
    return final


def raise_plainly_if_disk_full(error: BaseException, folder: str) -> None:
    """Torch reports a full disk as e.g. "PytorchStreamWriter failed writing file ... inline_container": when the
    failure was a full disk (ENOSPC anywhere in the chain, or under 1 MiB left), say so in those words."""
    chain, seen = [], error
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if isinstance(error, OSError) and error.errno == errno.ENOSPC and "No space left" in str(error):
        return  # already plain
    if enospc or (free is not None and free < (1 << 20)):
        free_text = f"{free} bytes free" if free is not None else "free space unknown"
        message = f"No space left on device while writing {folder} ({free_text}): {type(error).__name__}: {error}"
        raise OSError(errno.ENOSPC, message) from error


def prune_checkpoints(output_dir: str, keep_last: int) -> None:
    root = checkpoints_dir(output_dir)
    for _, path in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):  # temp folders of crashed saves
        if name.startswith(".tmp_step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_checkpoint(path: str, models: dict[str, Any], optimizers: dict[str, Any]) -> dict[str, Any]:
    """Load model and optimizer states in place (re-sharding as needed); returns trainer_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state_dicts(models, optimizers)
    dcp.load(state, checkpoint_id=os.path.join(path, "state"))
    for name, model in models.items():
        set_state_dict(
            model,
            optimizers[name] if name in optimizers else [],
            model_state_dict=state[f"model.{name}"],
            optim_state_dict=state.get(f"optim.{name}", {}),
        )
    trainer_state = read_state(path)
    for key in ARRAY_STATE_KEYS:
        if trainer_state.get(key) == {"in_files": key}:
            trainer_state[key] = read_array_state(path, key)
    return trainer_state


def _auto_class_name(model: Any) -> str:
    """The transformers Auto class that rebuilds `model` (a TokenValueModel is its wrapped sequence classifier)."""
    inner = getattr(model, "seq_cls", model)
    return (
        "AutoModelForSequenceClassification"
        if "SequenceClassification" in type(inner).__name__
        else "AutoModelForCausalLM"
    )


def _broadcast_str(value: Optional[str], accelerator: Any) -> str:
    if accelerator.num_processes == 1:
        assert value is not None
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face format exports


def check_finite_weights(models: dict[str, Any], accelerator: Any, step: Optional[int]) -> None:
    """Refuse to save weights holding NaN/inf (e.g. after an infinite learning rate: the loss and gradients of that
    step were finite, the update was not). A saved copy would be picked up by `--resume_from_checkpoint auto`."""
    import torch

    for name, model in models.items():
        # This rank's shard of each parameter (FSDP2 DTensor), checked in place (no float copy); agreed over ranks.
        local = (p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters())
        bad = any(not bool(torch.isfinite(t).all()) for t in local)
        if global_sum(accelerator, float(bad)) > 0:
            raise NonFiniteError(
                f"non-finite weights in {name} after optimizer step {step}; not saving them (is the learning rate "
                "too high?)"
            )


def save_hf_model(
    model: Any, tokenizer: Any, out_dir: str, accelerator: Any, extra: Optional[dict] = None, lora_save: str = "merged"
) -> None:
    """Gather the full state dict (rank 0 under FSDP) and write an HF-format folder atomically.

    A LoRA (peft) model is written merged (a plain HF model: W + B @ A * scaling, loadable without peft) or, with
    lora_save="adapter", as its adapter (adapter_config.json + adapter_model.safetensors, loaded with peft)."""
    check_finite_weights(
        {os.path.basename(os.path.normpath(out_dir)): model}, accelerator, (extra or {}).get("optimizer_step")
    )
    unwrapped = accelerator.unwrap_model(model)
    if not hasattr(unwrapped, "peft_config"):  # no LoRA adapters: lora.py (and peft) are left unimported
        # Streamed: one full tensor at a time (under FSDP2 gathered by every rank), written in shards by rank 0, in
        # the compute dtype of a bf16/fp16 run (as published checkpoints are): the host never holds the whole model.
        import torch

        dtype = getattr(torch, EXPORT_DTYPES.get(str(accelerator.mixed_precision), "float32"))
        weights = full_weights(unwrapped, dtype)
        if accelerator.is_main_process:
            write_hf_folder(unwrapped, weights, tokenizer, out_dir, extra, dtype)
        else:
            for _ in weights:  # the gathers are collectives: every rank takes part
                pass
        accelerator.wait_for_everyone()
        return
    from open_instruct import lora

    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        if lora_save == "merged":
            state_dict = lora.merged_state_dict(unwrapped, state_dict)
            unwrapped = lora.plain_model(unwrapped)
        write_hf_folder(unwrapped, state_dict, tokenizer, out_dir, extra)
    accelerator.wait_for_everyone()


EXPORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # mixed_precision -> the saved weights' dtype (torch's name)
MAX_SHARD_BYTES = 2 * 1024**3  # safetensors shard size of a streamed save: what rank 0's host holds at once


def full_weights(model: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor on the host) for every entry of the model's state dict, one at a time, floating-point
    ones in `dtype`; a weight tied to an earlier one (the output layer to the embedding) is left out, as
    save_pretrained leaves it out. An FSDP2 DTensor is all-gathered on the device first (every rank must iterate)."""
    from torch.distributed.tensor import DTensor

    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = every - {name for name, _ in model.named_parameters()}  # FSDP2's state dict holds each tied name apart
    for name, tensor in model.state_dict().items():
        if name in tied:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach().to("cpu", dtype) if full.is_floating_point() else full.detach().cpu()
        yield name, full
        del full


def model_class(model: Any) -> type:
    """The model's own class: FSDP2 swaps a sharded module's class for a subclass FSDP<name> of (FSDPModule, it)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    return next(b for b in cls.__bases__ if b is not FSDPModule) if issubclass(cls, FSDPModule) else cls


def write_streamed_weights(weights: Iterable[tuple[str, torch.Tensor]], folder: str, max_bytes: int) -> None:
    """safetensors shards of at most `max_bytes` (one tensor may exceed it) named as save_pretrained names them,
    with model.safetensors.index.json when there is more than one."""
    from safetensors.torch import save_file

    current: dict[str, torch.Tensor] = {}
    size, total, names = 0, 0, []

    def flush() -> None:
        nonlocal current, size
        if current:
            save_file(current, os.path.join(folder, f".shard_{len(names)}.safetensors"), metadata={"format": "pt"})
            names.append(list(current))
            current, size = {}, 0

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            flush()
        current[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(names) == 1:
        os.replace(os.path.join(folder, ".shard_0.safetensors"), os.path.join(folder, "model.safetensors"))
        return
    weight_map = {}
    for i, keys in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        os.replace(os.path.join(folder, f".shard_{i}.safetensors"), os.path.join(folder, file))
        weight_map.update({k: file for k in keys})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _clear_hf_debris(out_dir: str) -> None:
    """Undo what a process killed inside write_hf_folder left: its temp folder (a whole model, never read) and, if
    it died between the two renames of a replacement, the previous copy set aside (put back in place)."""
    parent, base = os.path.split(os.path.abspath(out_dir))
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(f".old_{base}_"):
            if not os.path.exists(out_dir) and os.path.isdir(os.path.join(path, "x")):
                os.replace(os.path.join(path, "x"), out_dir)
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f".tmp_{base}_"):
            shutil.rmtree(path, ignore_errors=True)


def write_hf_folder(
    model: Any,
    state_dict: Union[dict[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]],
    tokenizer: Any,
    out_dir: str,
    extra: Optional[dict] = None,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """An HF folder, atomically: from a state dict (save_pretrained), or from a stream of (name, tensor) in `dtype`
    (full_weights: shards written as they fill, the config saying that dtype)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    _clear_hf_debris(out_dir)
    tmp = run_dir.make_temp_dir(f".tmp_{os.path.basename(out_dir)}_", parent)
    try:
        if isinstance(state_dict, dict):
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        else:
            write_streamed_weights(state_dict, tmp, MAX_SHARD_BYTES)
            config = copy.deepcopy(model.config)
            config.dtype = dtype
            config.architectures = [model_class(model).__name__]  # what save_pretrained writes (a reward model's head)
            config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra:
            with open(os.path.join(tmp, "training_info.json"), "w") as f:
                json.dump(extra, f, indent=1)
        write_manifest(tmp)
        run_dir.apply_umask_tree(tmp)
        fault_point(f"{os.path.basename(os.path.normpath(out_dir))}_write", (extra or {}).get("optimizer_step"))
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".old_{os.path.basename(out_dir)}_", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
        os.replace(tmp, out_dir)
        _fsync_dir(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_plainly_if_disk_full(e, out_dir)
        raise


# ---------------------------------------------------------------------------------------------------------------------
# What the training scripts call


def save_training_state(
    cfg: Any,
    accelerator: Any,
    models: dict[str, Any],
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    counters: Any,
    tokenizer: Any = None,
    extra: Optional[dict[str, Any]] = None,
) -> str:
    state = {
        "counters": counters.state_dict(),
        "schedulers": {name: s.state_dict() for name, s in schedulers.items()},
        "world_size": accelerator.num_processes,
        "config": {k: v for k, v in vars(cfg).items()},
        "run_id": run_dir.run_id_of(cfg.output_dir),
        # the training files' identity, for a resume to refuse changed data (the main process writes the state)
        "data_identity": data_identity(vars(cfg)) if accelerator.is_main_process else [],
        "input_identity": input_identity(vars(cfg)) if accelerator.is_main_process else [],
        **(extra or {}),
    }
    check_finite_weights(models, accelerator, counters.optimizer_step)
    maybe_dump_shard_report(
        accelerator, models, optimizers, f"step_{counters.optimizer_step}"
    )  # only when asked (tests)
    return save_checkpoint(
        cfg.output_dir,
        counters.optimizer_step,
        models,
        optimizers,
        state,
        accelerator,
        cfg.keep_last_n_checkpoints,
        tokenizer,
    )


def restore_training_state(
    cfg: Any,
    accelerator: Any,
    models: dict[str, Any],
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    counters: Any,
    log: Any = print,
) -> Optional[dict[str, Any]]:
    """Resume per `resume_from_checkpoint` (auto|PATH); returns the trainer state, or None for a fresh start. The
    main process picks the checkpoint (it owns run.json and the folder's lock) and tells the others."""
    path = None
    if accelerator.is_main_process:
        path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir, log)
    path = _broadcast_str(path or "", accelerator) or None
    if path is None:
        if cfg.resume_from_checkpoint == "auto":
            log("resume_from_checkpoint=auto: no valid checkpoint yet, starting fresh")
        return None
    state = load_checkpoint(path, models, optimizers)
    counters.load_state_dict(state["counters"])
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(state["schedulers"][name])
    log(f"resumed from {path} at {counters.as_log()} (saved with world_size {state['world_size']})")
    return state


# ---------------------------------------------------------------------------------------------------------------------
# Resume compatibility: read from the checkpoint's JSON before any model loads

# Config keys that fix the model's shape: a checkpoint of another shape cannot be loaded into this model.
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


DATA_CONTENT = "dataset_content"  # the bytes of the local training files (data_identity), not a config key


def _settings_class(config: dict[str, Any]) -> Optional[type]:
    """The dataclass of the script a config (a checkpoint's or this run's) is for: its fields declare what a resume
    compares (config.RESUME_KINDS) and what it loads again (config.LOADS); None for an unknown script."""
    return CONFIG_CLASSES.get(config.get("script"))  # type: ignore[arg-type]


def content_keys(cls: type) -> set[str]:
    """The resume keys of the content of what cls's settings load (`content_key` of each `loads` setting)."""
    return {f.metadata["content_key"] for f in dataclasses.fields(cls) if f.metadata.get("loads")}


def resume_layout(config: dict[str, Any], world_size: int) -> dict[str, tuple[Any, str]]:
    """What a resumed run must share with its checkpoint: every setting its script declares `structural` or
    `must_match` (what the saved state is, the data stream and order, the run's length and schedule, what is
    trained and towards what), and the global batch the `batch_layout` settings make (the data position is counted in
    episodes/prompts, so a new world size with the same global batch resumes exactly): name -> (value, how it is
    made). A setting the checkpoint's config lacks (one from before the knob existed) reads as its default, the value
    that run had: resuming it with the default goes through, with another value is refused. The content of the files
    the run loads is compared apart (data_identity, input_identity)."""
    per_device, accumulation = config["per_device_train_batch_size"], config["gradient_accumulation_steps"]
    layout: dict[str, tuple[Any, str]] = {
        "script": (config.get("script"), ""),
        "mini_batch_size": (
            per_device * accumulation * world_size,
            f"per_device_train_batch_size {per_device} x gradient_accumulation_steps {accumulation} x world_size "
            f"{world_size}",
        ),
    }
    cls = _settings_class(config)
    for f in dataclasses.fields(cls) if cls else ():
        if f.metadata.get("resume") in ("structural", "must_match"):
            if f.name in config:
                layout[f.name] = (config[f.name], f.metadata["note"])
            elif f.default is not dataclasses.MISSING:  # a checkpoint from before the knob: it ran with the default
                layout[f.name] = (f.default, f.metadata["note"])
    if "local_rollout_batch_size" in config:  # RL
        local = config["local_rollout_batch_size"]
        layout["rollout_batch_size"] = (
            local * world_size,
            f"local_rollout_batch_size {local} x world_size {world_size}",
        )
    if "algo" in config:  # gae trains a value model, the other estimators none (a checkpoint from before the knob)
        layout["advantage_estimator"] = (config.get("advantage_estimator") or ALGO_ESTIMATORS.get(config["algo"]), "")
    return layout


def _model_config(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def train_sources(config: dict[str, Any]) -> list[str]:
    """The training sources as written: dataset_name_or_path's comma-separated parts or dataset_mixer_list's."""
    from open_instruct.mixture import parse_mixer_list

    if config.get("dataset_mixer_list"):
        return [entry.source for entry in parse_mixer_list(config["dataset_mixer_list"])]
    return [p.strip() for p in (config.get("dataset_name_or_path") or "").split(",") if p.strip()]


def train_data_files(config: dict[str, Any]) -> list[str]:
    """The local files the training rows are read from, in source order (a folder: every file under it). Hub
    datasets have none here."""
    return [path for source in train_sources(config) for path in source_files(source)]


def data_identity(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The identity of the training data files, recorded in each checkpoint: [{path, size, mtime_ns, blake2b}]."""
    identity = []
    for path in train_data_files(config):
        st = os.stat(path)
        identity.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "blake2b": file_digest(path)})
    return identity


def input_identity(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The identity of every file a run loads by name besides its data, recorded in each checkpoint: what the
    settings its script declares with `loads` name (config.setting): the local weight files of a "weights" setting
    (a teacher, a reward model, the starting model a reference is loaded from), the user's code file of a "code"
    setting's `file.py:name` / `module:name` spec (and of the specs the training rows name in a column of the
    setting's name, where its declaration says they may: a row's environment), and the weight files of the folders
    that code's object declares it loads (`weight_folders`, e.g. a judge's local_model). [{key, what, path, blake2b}]:
    `key` the resume key that accepts a change, `what` the setting that named the file. Each file is hashed once per
    process (file_digest); hub models are known by name (and revision) only."""
    cls = _settings_class(config)
    entries: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls) if cls else ():
        loads, key, value = f.metadata.get("loads"), f.metadata.get("content_key"), config.get(f.name)
        if loads == "weights":  # one folder, or named folders (teacher_models: name -> folder)
            named = value.items() if isinstance(value, dict) else [(None, value)]
            for name, folder in named:
                entries += _weight_entries(key, f"{f.name} {value}" if name is None else f"{f.name} {name}={folder}",
                                           folder)  # fmt: skip
            continue
        if loads != "code":
            continue
        named = [(f.name, v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        if f.metadata.get("per_row"):
            named += [(f"the rows' {f.name} column", v) for v in row_column_specs(config, f.name)]
        for option, spec in named:
            path = user_code.spec_file(spec) if isinstance(spec, str) else None
            if path:
                entries.append((key, f"{option} {spec}", path))
            for folder in _declared_weight_folders(spec, option):
                entries += _weight_entries(key, f"{option} {spec} loads {folder}", folder)
    return [{"key": k, "what": w, "path": p, "blake2b": file_digest(p)} for k, w, p in entries]


def _weight_entries(key: str, what: str, folder: Any) -> list[tuple[str, str, str]]:
    """(key, what, path) of each weight file of a local model folder; none for a hub name or nothing."""
    if not (isinstance(folder, str) and folder and looks_local(folder) and os.path.isdir(folder)):
        return []
    return [(key, what, os.path.abspath(path)) for path in weight_files(folder)]


def _declared_weight_folders(spec: Any, option: str) -> list[str]:
    """The model folders the object a user's spec names says it loads (its `weight_folders`: a Judge's local_model
    or served folder). The run imported the spec already; one that does not import has none here (its own check
    reports it)."""
    if not user_code.is_spec(spec):
        return []
    try:
        obj = user_code.load_object(spec, option, "file.py:name")
    except ConfigError:
        return []
    return [str(folder) for folder in getattr(obj, "weight_folders", ()) or ()]


# (column, source, split, its files' (size, mtime_ns)) -> specs: one read per process
_row_specs: dict[tuple, list[str]] = {}


def row_column_specs(config: dict[str, Any], column: str) -> list[str]:
    """The distinct specs the training rows name in their own `column` (a row's wins over the recipe's, e.g. its
    `environment`, episodes.py), sorted: their code is the run's too, so a resume compares its bytes. Each local source
    (a file or a folder, a `save_to_disk` one included) is read as training reads it, once per process while its
    files' sizes and mtimes stay the same; hub datasets are not read."""
    from open_instruct.data import load_source

    specs: set[str] = set()
    split = config.get("dataset_split") or "train"
    for source in train_sources(config):
        files = source_files(source)
        if not files:
            continue
        stats = [os.stat(f) for f in files]
        key = (column, os.path.abspath(source), split, tuple((st.st_size, st.st_mtime_ns) for st in stats))
        if key not in _row_specs:
            found = {row.data.get(column) for row in load_source(source, split)}
            _row_specs[key] = sorted(v for v in found if isinstance(v, str) and v)
        specs.update(_row_specs[key])
    return sorted(specs)


def input_content_changes(saved: list[dict[str, Any]], config: dict[str, Any]) -> list[tuple[str, str]]:
    """(resume key, message) for each setting whose files differ from the checkpoint's input_identity. Only settings
    named the same way on both sides are compared: another spec or path is a config difference already."""

    def by_setting(entries: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
        grouped: dict[tuple[str, str], dict[str, str]] = {}
        for entry in entries:
            grouped.setdefault((entry["key"], entry["what"]), {})[entry["path"]] = entry["blake2b"]
        return grouped

    before, now = by_setting(saved), by_setting(input_identity(config))
    changes = []
    for (key, what), files in before.items():
        current = now.get((key, what))
        if current is None or current == files:
            continue
        changed = [
            f"{os.path.basename(p)} blake2b {files[p][:12]} -> {current[p][:12]}" if p in current else f"{p} is gone"
            for p in files
            if current.get(p) != files[p]
        ] + [f"{p} is new" for p in current if p not in files]
        changes.append((key, f"{key}: {what}: {'; '.join(changed)} (the file's content changed since the checkpoint)"))
    return changes


def data_content_changes(saved: list[dict[str, Any]], config: dict[str, Any]) -> list[str]:
    """How the training files differ from a checkpoint's data_identity, file by file in source order ([] when
    the same). Cheap when nothing changed: same path, size and mtime is the same file; a file of the same size
    touched or copied since is read and its bytes compared by digest."""
    now = train_data_files(config)
    if len(now) != len(saved):
        return [f"{len(saved)} local file(s) -> {len(now)}: {[e['path'] for e in saved]} -> {now}"]
    changes = []
    for old, path in zip(saved, now):
        st = os.stat(path)
        if st.st_size != old["size"]:
            change = f"{old['size']:,} -> {st.st_size:,} bytes"
        elif (path == old["path"] and st.st_mtime_ns == old["mtime_ns"]) or file_digest(path) == old["blake2b"]:
            continue
        else:
            change = f"{st.st_size:,} bytes both, blake2b {old['blake2b'][:12]} -> {file_digest(path)[:12]}"
        changes.append(f"{old['path']}" + (f" (now {path})" if path != old["path"] else "") + f": {change}")
    return changes


def check_allowed_resume_changes(cfg: Any, world_size: int) -> set[str]:
    """The names in cfg.allow_resume_changes must be resume keys a resume may accept, checked on every start (also
    when `auto` finds nothing to resume): a misspelt name would otherwise pass until the one resume that needs it.
    Returns the acceptable keys: the compared settings but the structural ones, the global batch, and the content
    of the data and of what the settings load."""
    structural_keys = set(declared_settings(type(cfg), resume="structural")) | {"script"}
    acceptable = set(resume_layout(vars(cfg), world_size)) | {DATA_CONTENT} | content_keys(type(cfg))
    acceptable -= structural_keys
    allowed = set(getattr(cfg, "allow_resume_changes", None) or [])
    structural = sorted(allowed & structural_keys)
    unknown = sorted(allowed - acceptable - structural_keys)
    if structural or unknown:
        problems = []
        if structural:
            problems.append(f"{structural} cannot be accepted (the saved state would not load into this run)")
        if unknown:
            problems.append(f"{unknown} are not resume keys")
        raise ConfigError(
            f"allow_resume_changes: {'; '.join(problems)}; the keys a resume compares and may accept: "
            f"{sorted(acceptable)}"
        )
    return acceptable


def check_resume_compatible(checkpoint: str, cfg: Any, world_size: int) -> None:
    """Exit-2 error (ConfigError) naming every difference between the checkpoint and this run that would make the
    resume wrong: another script or algorithm, another batch layout, data stream (its files' content too), run
    length, learning-rate schedule or LoRA scale, another model shape. Differences whose key is listed in
    cfg.allow_resume_changes are accepted (and printed); structural ones never are."""
    state = read_state(checkpoint)
    saved, now = resume_layout(state["config"], state["world_size"]), resume_layout(vars(cfg), world_size)
    differences: list[tuple[str, str]] = []
    for key, (value, made_of) in saved.items():
        current, current_made_of = now.get(key, (None, ""))
        if value != current:
            differences.append(
                (key, f"{key}: checkpoint {_explained(value, made_of)}, now {_explained(current, current_made_of)}")
            )
    if "data_identity" in state:
        differences += [
            (DATA_CONTENT, f"{DATA_CONTENT}: {c}") for c in data_content_changes(state["data_identity"], vars(cfg))
        ]
    if "input_identity" in state:
        differences += input_content_changes(state["input_identity"], vars(cfg))
    if saved["script"] == now["script"]:
        checkpoint_model = _model_config(os.path.join(checkpoint, "hf", "policy"))
        model = _model_config(cfg.model_name_or_path) if os.path.isdir(cfg.model_name_or_path) else None
        if checkpoint_model and model:
            differences += [
                (
                    "model",
                    f"model {key}: checkpoint {checkpoint_model.get(key)!r}, now {model.get(key)!r} "
                    f"(model_name_or_path {cfg.model_name_or_path})",
                )
                for key in ARCHITECTURE_KEYS
                if checkpoint_model.get(key) != model.get(key)
            ]
    acceptable = check_allowed_resume_changes(cfg, world_size)
    allowed = set(getattr(cfg, "allow_resume_changes", None) or [])
    for key, message in differences:
        if key in allowed:
            print(f"resume from {checkpoint}: accepting a change (allow_resume_changes): {message}")
    refused = [message for key, message in differences if key not in allowed]
    if refused:
        overridable = [key for key, _ in differences if key in acceptable and key not in allowed]
        accept = f" --allow_resume_changes {' '.join(dict.fromkeys(overridable))}" if overridable else ""
        raise ConfigError(
            f"cannot resume from {checkpoint}: it does not match this run:\n  "
            + "\n  ".join(refused)
            + "\nResume with the checkpoint's settings, start a new run (another --output_dir, or "
            "--overwrite_output_dir true)" + (f", or accept the change knowingly:{accept}" if accept else "")
        )


def _explained(value: Any, made_of: str) -> str:
    return f"{value!r} ({made_of})" if made_of else repr(value)


class BestTracker:
    """Keeps <output_dir>/best_model as the HF-format model with the best value of cfg.best_metric."""

    def __init__(self, cfg: Any, state: Optional[dict[str, Any]] = None):
        self.metric = cfg.best_metric
        self.mode = cfg.best_metric_mode
        self.best: Optional[float] = (state or {}).get("best_metric_value")
        self.path = os.path.join(cfg.output_dir, "best_model")
        self.lora_save = getattr(cfg, "lora_save", "merged")

    def update(self, metrics: dict[str, Any], model: Any, tokenizer: Any, accelerator: Any, counters: Any) -> bool:
        if not self.metric:
            return False
        if self.metric not in metrics:
            raise KeyError(f"best_metric {self.metric!r} is not among the eval metrics {sorted(metrics)}")
        value = float(metrics[self.metric])
        better = self.best is None or (value > self.best if self.mode == "max" else value < self.best)
        if better:
            self.best = value
            save_hf_model(
                model, tokenizer, self.path, accelerator, {self.metric: value, **counters.as_log()}, self.lora_save
            )
        return better

    def state(self) -> dict[str, Any]:
        return {"best_metric_value": self.best}
