"""DPO's reference log-probs, computed once and cached on disk: the speed plumbing of dpo.py, kept out of its loop.

Reference log-probs are computed once, before training, by a no-grad pass of the initial policy over the train and
eval sets (in batches of per_device_eval_batch_size, or packed rows of max_tokens_per_micro_batch tokens, sorted by
length and shared out over the processes), and cached
(safetensors) keyed by example position. The reference model is never held in memory during training. The cache lives
in `reference_cache_dir` (default: `<output_dir>/ref_cache`, inside the run's own folder so a run writes nowhere else;
point the runs of a sweep over beta, lr or loss type at one shared folder to compute it once) under a hash of what
determines the numbers:
  - the model: name/path, revision, gguf file, config, and a fingerprint of the loaded weights (shapes, dtypes and
    the bytes of up to 4,096 evenly spaced elements of every tensor; training moves every weight, so any trained
    model differs in the sample);
  - the data as the model sees it: sha256 of the tokenized train and eval examples in order (chosen ids, rejected
    ids, prompt length), which covers the files' content, the split, max_seq_length, overlong, the columns and the
    chat template; the data sources are recorded as well;
  - how the forward computes: the precision (mixed_precision), FSDP2 (its parameter casts) or autocast (its per-op
    casts), padded batches of per_device_eval_batch_size or packed rows of max_tokens_per_micro_batch, the attention
    kernel the model runs (attn_implementation: sdpa, sdpa_varlen, flash_attention_2, ...) and the torch version
    (its kernels). Each changes the low bits of the log-probs, so runs that share a `reference_cache_dir` reuse a
    file only when they would have computed the same numbers.
Only summed log-probs and token counts are stored, so every loss type reuses the same cache. A rerun with the same
settings prints "reused"; any change computes a new file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from array import array
from typing import TYPE_CHECKING, Any, Optional

from open_instruct import run_dir
from open_instruct.distributed import global_sum

if TYPE_CHECKING:  # torch is imported inside functions: dpo.py imports this module before its config is checked
    import torch

    from open_instruct.models import PairLogps

CACHE_FORMAT = 2  # 2: the forward's layout (FSDP, packing, attention kernel, torch) joined the key


def weights_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """sha256 over every tensor's name, shape, dtype and the bytes of up to `samples` evenly spaced elements."""
    import torch

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples].cpu().contiguous()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.hexdigest()


def tokens_fingerprint(examples: list[dict[str, Any]]) -> str:
    """sha256 of the tokenized pairs in order: the data exactly as the model sees it."""
    h = hashlib.sha256()
    for e in examples:
        h.update(array("q", [e["prompt_len"], len(e["chosen_ids"]), len(e["rejected_ids"])]).tobytes())
        h.update(array("q", e["chosen_ids"]).tobytes())
        h.update(array("q", e["rejected_ids"]).tobytes())
    return h.hexdigest()


def forward_identity(cfg: Any, model: Any, fsdp: bool) -> dict[str, Any]:
    """How the reference forward computes (see the module doc)."""
    import torch

    return {
        "mixed_precision": cfg.mixed_precision,
        "fsdp": fsdp,
        "packed_tokens": cfg.max_tokens_per_micro_batch or None,
        "batch_size": None if cfg.max_tokens_per_micro_batch else cfg.per_device_eval_batch_size,
        "attention": getattr(model.config, "_attn_implementation", None),
        "torch": torch.__version__,
    }


def reference_cache_identity(
    cfg: Any, model: Any, train: list[dict], evals: list[dict], fsdp: bool = False
) -> dict[str, Any]:
    """Everything the cached numbers depend on (hashed into the file name; stored in the file's metadata)."""
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    return {
        "format": CACHE_FORMAT,
        "model": {
            "name_or_path": cfg.model_name_or_path,
            "revision": cfg.model_revision,
            "gguf_file": cfg.gguf_file,
            "config": config,
            "weights_sha256": weights_fingerprint(model),
        },
        "data": {
            "train": {
                "sources": cfg.dataset_name_or_path or cfg.dataset_mixer_list,
                "split": cfg.dataset_split,
                "pairs": len(train),
                "tokens_sha256": tokens_fingerprint(train),
            },
            "eval": {
                "sources": cfg.eval_dataset_name_or_path or cfg.eval_dataset_mixer_list,
                "split": cfg.eval_dataset_split,
                "pairs": len(evals),
                "tokens_sha256": tokens_fingerprint(evals),
            },
        },
        "forward": forward_identity(cfg, model, fsdp),
    }


def shared_identity(cfg: Any, model: Any, train: list[dict], evals: list[dict], accelerator: Any) -> dict[str, Any]:
    """`reference_cache_identity` from the main process's weights as loaded (FSDP loading always fills that copy),
    broadcast so every rank names the same file. Call it before the model is prepared."""
    from open_instruct.distributed import is_fsdp

    fsdp = is_fsdp(accelerator)
    box = [reference_cache_identity(cfg, model, train, evals, fsdp) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(box, from_process=0)
    return box[0]


def reference_cache_path(cfg: Any, identity: dict[str, Any]) -> str:
    folder = cfg.reference_cache_dir or os.path.join(cfg.output_dir, "ref_cache")
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return os.path.join(folder, f"ref_logps_{key}.safetensors")


def length_order(examples: list[dict]) -> list[int]:
    """Example positions sorted by padded pair length (less padding per micro-batch), ties by position."""
    return sorted(
        range(len(examples)), key=lambda i: (max(len(examples[i]["chosen_ids"]), len(examples[i]["rejected_ids"])), i)
    )


def reference_batches(
    examples: list[dict], batch_size: int, max_tokens: Optional[int], rank: int, world: int
) -> list[tuple[list[int], bool]]:
    """This rank's batches of the reference pass, as example positions: sorted by length (less padding), cut into
    batch_size pairs or packed rows of at most max_tokens tokens (max_tokens_per_micro_batch), dealt round-robin
    (data.dealt_micro_batches: the same batches on 1 or N ranks). DPO's eval uses these batches too, so at step 0 the
    policy reproduces the cached numbers bit for bit."""
    from open_instruct import data

    order = length_order(examples)
    lengths = [data.packed_length(examples[i]) for i in order]
    return data.dealt_micro_batches(order, batch_size, rank, world, lengths, max_tokens)


def compute_reference(
    model: Any, examples: list[dict], accelerator: Any, batch_size: int, pad_id: int, max_tokens: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """One no-grad pass of `model` over `examples`: summed response log-probs of chosen and rejected, by position.

    Batches: reference_batches (padded, or packed with max_tokens). Each rank fills the rows of its batches and the
    tables are summed over ranks (each row is filled by exactly one rank, the others add 0), so every rank returns
    the full table."""
    import torch

    from open_instruct import data, runtime
    from open_instruct.models import pair_logps

    rank, world = accelerator.process_index, accelerator.num_processes
    preemption = runtime.preemption()
    table, filled = torch.zeros(len(examples), 2), torch.zeros(len(examples))
    rows: list[torch.Tensor] = []  # each real batch's [n, 2] log-probs, kept on the device until the pass ends
    positions: list[int] = []
    model.eval()
    with torch.no_grad():
        for group, real in reference_batches(examples, batch_size, max_tokens, rank, world):
            preemption.stop_if_requested(accelerator, "the DPO reference pass")  # the pass is redone on resume
            collated = data.collate_preferences([examples[i] for i in group], pad_id, bool(max_tokens))
            batch = data.to_device(collated, accelerator.device)
            with accelerator.autocast():
                lp = pair_logps(model, batch)
            if real:
                rows.append(torch.stack([lp.chosen, lp.rejected], dim=1).float())
                positions += group
    if rows:
        table[positions] = torch.cat(rows).cpu()  # one copy to the host for the whole pass
        filled[positions] += 1
    model.train()
    if world > 1:
        table = accelerator.reduce(table.to(accelerator.device), reduction="sum").cpu()
        filled = accelerator.reduce(filled.to(accelerator.device), reduction="sum").cpu()
    assert bool((filled == 1).all()), "reference pass missed examples"
    return {
        "chosen_logps": table[:, 0].contiguous(),
        "rejected_logps": table[:, 1].contiguous(),
        **expected_counts(examples),
    }


def expected_counts(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Response token counts and source rows per example (stored with the cache, checked when it is read)."""
    import torch

    return {
        "chosen_tokens": torch.tensor([len(e["chosen_ids"]) - e["prompt_len"] for e in examples], dtype=torch.long),
        "rejected_tokens": torch.tensor([len(e["rejected_ids"]) - e["prompt_len"] for e in examples], dtype=torch.long),
        "row": torch.tensor([e["row"] for e in examples], dtype=torch.long),
    }


def read_reference_cache(
    path: str, splits: dict[str, list[dict]], log: Any = print
) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """The cached tables, or None when the file is missing or does not fit these examples (then it is rebuilt)."""
    if not os.path.isfile(path):
        return None
    import torch
    from safetensors.torch import load_file

    try:
        flat = load_file(path)
    except Exception as e:  # a damaged file is rebuilt, not trusted
        log(f"reference cache {path} is unreadable ({e}); recomputing")
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for split, examples in splits.items():
        table = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(f"{split}/")}
        expected = expected_counts(examples)
        if not examples:
            out[split] = {}
            continue
        if set(table) != {"chosen_logps", "rejected_logps", *expected} or any(
            not torch.equal(table[k], v) for k, v in expected.items()
        ):
            log(f"reference cache {path} does not match the {split} examples; recomputing")
            return None
        out[split] = table
    return out


def write_reference_cache(path: str, tables: dict[str, dict[str, torch.Tensor]], identity: dict[str, Any]) -> None:
    """Atomic write: a temp file in the same folder, renamed into place."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    flat = {f"{split}/{k}": v.contiguous() for split, table in tables.items() for k, v in table.items()}
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".safetensors", dir=os.path.dirname(path))
    os.close(fd)
    try:
        save_file(flat, tmp, metadata={"identity": json.dumps(identity, sort_keys=True, default=str)})
        run_dir.apply_umask(tmp)  # mkstemp makes it 0600 whatever the umask
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def reference_tables(
    cfg: Any,
    model: Any,
    train: list[dict],
    evals: list[dict],
    identity: dict[str, Any],
    accelerator: Any,
    pad_id: int,
    log: Any,
) -> dict[str, dict[str, torch.Tensor]]:
    """Read the cache if every rank has a valid copy; otherwise run the reference pass and write it.

    `model` must hold the initial weights. Each node's local main process writes the file (nodes need not share
    a filesystem)."""
    path = reference_cache_path(cfg, identity)
    splits = {"train": train, "eval": evals}
    tables = read_reference_cache(path, splits, log)
    if global_sum(accelerator, tables is not None) == accelerator.num_processes:
        log(f"reference log-probs: reused {path}")
        return tables  # type: ignore[return-value]
    t0 = time.perf_counter()
    tables = {
        split: compute_reference(
            model, ex, accelerator, cfg.per_device_eval_batch_size, pad_id, cfg.max_tokens_per_micro_batch
        )
        if ex
        else {}
        for split, ex in splits.items()
    }
    if accelerator.is_local_main_process:
        write_reference_cache(path, tables, identity)
    accelerator.wait_for_everyone()
    log(
        f"reference log-probs: computed for {len(train)} train + {len(evals)} eval pairs in "
        f"{time.perf_counter() - t0:.1f}s, saved to {path}"
    )
    return tables


def reference_logps(table: dict[str, torch.Tensor], indices: list[int], device: Any) -> PairLogps:
    import torch

    from open_instruct.data import host_to_device
    from open_instruct.models import PairLogps

    idx = torch.tensor(indices)
    keys = ("chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")
    return PairLogps(*(host_to_device(table[k][idx], device) for k in keys))  # pinned, non-blocking on a GPU
