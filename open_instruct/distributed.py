"""FSDP2 set-up shared by every training script: the Accelerator from the launcher's FSDP settings plus the recipe's
flags, launch checks that catch a silent fallback to unsharded training, gradient-accumulation sync, frozen models
sharded like trained ones, full weights for generation, and a shard report the tests read.

How a run gets FSDP: `accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml ...` exports the config as
`ACCELERATE_USE_FSDP=true`, `FSDP_VERSION=2`, `FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP`, ... and
`build_accelerator` reads them into accelerate's FullyShardedDataParallelPlugin, then applies the recipe's knobs:
- `mixed_precision: bf16` -> bf16 compute with fp32 master weights and fp32 gradient reduction (without FSDP,
  accelerate's autocast does it: weights stay fp32 and are cast per matmul, on CPU as on GPU);
- `fsdp_cpu_offload: true` -> parameters, gradients and optimizer state live in host memory;
- `activation_checkpointing: true` -> the scripts enable Hugging Face's (non-reentrant) checkpointing, so the
  plugin's own is switched off to avoid recomputing every layer twice.
The wrapped unit is the model's transformer layer, from its `_no_split_modules` (e.g. LlamaDecoderLayer).

CPU runs (tests, laptops). accelerate 1.15 never forms an FSDP group on CPU: with an FSDP config and no CUDA every
process silently trains alone, and with `--cpu` it wraps the model in DDP. `OPEN_INSTRUCT_CPU_FSDP=1` asks for the one
documented work-around: the Accelerator is built for the gloo backend (cpu=True) and its state is switched to FSDP
before anything is prepared, so `accelerator.prepare` takes accelerate's real FSDP2 path (`fully_shard` per layer,
DTensor parameters, sharded optimizer state, DTensor-aware clipping, full-state gathering). It is refused when CUDA
is present: GPU runs always use accelerate unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from open_instruct.errors import ConfigError

CPU_FSDP_ENV = "OPEN_INSTRUCT_CPU_FSDP"
SHARD_REPORT_ENV = "OPEN_INSTRUCT_SHARD_REPORT"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def unwrap_model(model: Any) -> Any:
    """The module under DDP / accelerate / torch.compile wrappers (FSDP2 wraps in place): its parameter names are
    the HF checkpoint's."""
    import torch

    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def fsdp_requested() -> bool:
    """True when the launcher's accelerate config asks for FSDP."""
    return _env_flag("ACCELERATE_USE_FSDP")


def make_fsdp_plugin(cfg: Any) -> Any:
    """accelerate's FSDP plugin from the launcher's environment, with the recipe's precision/offload/AC flags."""
    import torch
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    version = int(os.environ.get("FSDP_VERSION", "1"))
    if version != 2:
        raise ConfigError(
            f"the accelerate config sets fsdp_version {version}: these scripts support FSDP2 only (fsdp_version: 2)"
        )
    kwargs: dict[str, Any] = {}
    if getattr(cfg, "fsdp_cpu_offload", False):
        kwargs["cpu_offload"] = True
    if cfg.mixed_precision == "bf16":
        # Compute in half precision, keep fp32 master weights (the optimizer's) and reduce gradients in fp32:
        # a bf16 reduce-scatter over 40+ ranks loses bits of every gradient.
        kwargs["mixed_precision_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)
    if plugin.activation_checkpointing and cfg.activation_checkpointing:
        plugin.activation_checkpointing = False  # the script enables HF checkpointing; once is enough
    return plugin


def build_accelerator(cfg: Any) -> Any:
    """The Accelerator for this launch (FSDP2 when the accelerate config asks for it), checked by `check_launch`."""
    import torch
    from accelerate import Accelerator

    check_supported_versions()
    use_fsdp = fsdp_requested()
    if getattr(cfg, "fsdp_cpu_offload", False) and not use_fsdp:
        raise ConfigError(
            "fsdp_cpu_offload is set but the run is not under FSDP: launch with an FSDP accelerate config "
            "(scripts/*.sh or accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml)"
        )
    plugin = make_fsdp_plugin(cfg) if use_fsdp else None
    if _env_flag(CPU_FSDP_ENV):
        if torch.cuda.is_available():
            raise ConfigError(
                f"{CPU_FSDP_ENV}=1 is for CPU-only machines; unset it (CUDA is available, accelerate's FSDP works as "
                "is)"
            )
        if plugin is None:
            raise ConfigError(f"{CPU_FSDP_ENV}=1 needs an FSDP accelerate config (ACCELERATE_USE_FSDP=true)")
        if getattr(cfg, "fsdp_cpu_offload", False):
            raise ConfigError(
                "fsdp_cpu_offload moves weights from an accelerator to host memory: there is no accelerator here "
                "(CPU run)"
            )
        accelerator = _cpu_fsdp_accelerator(cfg, plugin)
    else:
        accelerator = Accelerator(
            mixed_precision=cfg.mixed_precision, fsdp_plugin=plugin, kwargs_handlers=process_group_kwargs(cfg)
        )
    check_launch(accelerator)
    check_precision(cfg, accelerator)
    return accelerator


SUPPORTED_TORCH = ((2, 11), (2, 14))  # oldest and newest minor release, both included
MIN_TRANSFORMERS = (5, 17)


def version_problems(torch_version: str, transformers_version: str) -> list[str]:
    """What is wrong with these torch / transformers versions for this repo (empty: supported). Minor releases are
    compared, so local builds (2.11.0+cu130) and pre-releases of a supported minor count as that minor."""

    def minor(version: str) -> tuple[int, int]:
        major, rest = version.split(".", 1)
        return int(major), int("".join(c for c in rest.split(".")[0] if c.isdigit()) or 0)

    problems = []
    low, high = SUPPORTED_TORCH
    if not low <= minor(torch_version) <= high:
        problems.append(f"torch {torch_version} (supported: {low[0]}.{low[1]} to {high[0]}.{high[1]})")
    if minor(transformers_version) < MIN_TRANSFORMERS:
        problems.append(f"transformers {transformers_version} (supported: >= {'.'.join(map(str, MIN_TRANSFORMERS))})")
    return problems


def check_supported_versions() -> None:
    """Stop (exit 2) before any model loads when torch or transformers is outside the supported range: FSDP2's
    internals and transformers' generation API differ outside it (docs/gpu-support.md)."""
    import torch
    import transformers

    problems = version_problems(torch.__version__, transformers.__version__)
    if problems:
        raise ConfigError(
            "unsupported package versions: " + "; ".join(problems) + ". Install the ranges in requirements.txt"
        )


def process_group_kwargs(cfg: Any) -> list[Any]:
    """accelerate's handler that sets the process group's collective timeout (`distributed_timeout_minutes`; the
    config's default for a caller's namespace without it)."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    from open_instruct.config import BaseConfig

    minutes = getattr(cfg, "distributed_timeout_minutes", BaseConfig.distributed_timeout_minutes)
    return [InitProcessGroupKwargs(timeout=timedelta(minutes=float(minutes)))]


def _cpu_fsdp_accelerator(cfg: Any, plugin: Any) -> Any:
    """CPU work-around (see module doc): a gloo process group, then the state AcceleratorState would have set up
    on GPUs. Nothing has been prepared yet, so every later call sees an ordinary FSDP2 Accelerator."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    accelerator = Accelerator(
        cpu=True, mixed_precision=cfg.mixed_precision, fsdp_plugin=plugin, kwargs_handlers=process_group_kwargs(cfg)
    )
    # A torchrun launch of one process forms a gloo group of one (MULTI_CPU): FSDP2 over it is the one-process path
    # every single-GPU FSDP run takes, so it is switched too; a plain `python script.py` has no group and stays as is.
    if accelerator.num_processes > 1 or accelerator.distributed_type == DistributedType.MULTI_CPU:
        state = accelerator.state
        state.distributed_type = DistributedType.FSDP
        # AcceleratorState re-reads PartialState's fields whenever it is constructed again; on GPUs accelerate
        # writes FSDP there too (end of AcceleratorState.__init__).
        PartialState().distributed_type = DistributedType.FSDP  # a Borg: every instance shares one state
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)  # keeps a policy already set by make_fsdp_plugin
        state.fsdp_plugin = plugin
    return accelerator


def check_launch(accelerator: Any) -> None:
    """Stop before any model loads when the launcher and accelerate disagree (the silent fallbacks)."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"{launched} processes were launched (WORLD_SIZE) but accelerate formed a group of "
            f"{accelerator.num_processes}: "
            f"each process would train alone on the full data. No usable accelerator backend was found "
            f"(distributed_type {accelerator.distributed_type}); on a CPU-only machine set {CPU_FSDP_ENV}=1"
        )
    if fsdp_requested() and launched > 1 and accelerator.distributed_type != DistributedType.FSDP:
        raise ConfigError(
            f"the accelerate config asks for FSDP but accelerate chose {accelerator.distributed_type} (unsharded "
            f"replicas on every rank); on a CPU-only machine set {CPU_FSDP_ENV}=1, or drop --cpu"
        )


def launcher_process_count(launcher_argv: Sequence[str], script: str) -> Optional[int]:
    """The process count an `accelerate launch` command line asks for (`--num_processes N`, `--num-processes=N`, or
    the `num_processes` of its `--config_file`), reading only the launcher's own options (those before `script`);
    None when it names none."""
    argv = list(launcher_argv)
    ends = [i for i, token in enumerate(argv) if token == script or os.path.abspath(token) == os.path.abspath(script)]
    own = argv[: ends[0]] if ends else argv
    found: dict[str, str] = {}
    for i, token in enumerate(own):
        key, _, value = token.partition("=")
        key = key.replace("-", "_")
        if key in ("__num_processes", "__config_file"):
            if not value and i + 1 < len(own):
                value = own[i + 1]
            found[key] = value
    if "__num_processes" in found:
        try:
            return int(found["__num_processes"])
        except ValueError:
            return None
    if found.get("__config_file") and os.path.isfile(found["__config_file"]):
        import yaml

        with open(found["__config_file"]) as f:
            count = (yaml.safe_load(f) or {}).get("num_processes")
        return count if isinstance(count, int) else None
    return None


def check_cpu_launch(script: str) -> None:
    """`accelerate launch --num_processes N` on a machine without a GPU starts ONE process: with no GPU (and no FSDP
    or multi-GPU config) accelerate picks its simple launcher, which runs the script once, with no WORLD_SIZE, and
    only exports MASTER_ADDR. That process would train alone, on everything, under a world_size of 1. Such a
    launch is recognised by accelerate's variable ACCELERATE_USE_CPU without WORLD_SIZE, and the count is read from
    the launcher's command line (/proc/<parent>/cmdline; Linux): more than 1 stops here (exit 2) with the way to run
    N processes on CPU."""
    if "WORLD_SIZE" in os.environ or "ACCELERATE_USE_CPU" not in os.environ:
        return  # a real multi-process launch (torchrun sets WORLD_SIZE), or not started by accelerate launch
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            launcher = [t.decode(errors="replace") for t in f.read().split(b"\0") if t]
    except OSError:
        return
    if not any(os.path.basename(t) == "accelerate" for t in launcher[:3]) or "launch" not in launcher:
        return
    count = launcher_process_count(launcher, script)
    if count is not None and count > 1:
        raise ConfigError(
            f"accelerate launch was asked for {count} processes but started one: with no GPU (or one) and no FSDP "
            "config, its simple launcher runs the script once, which would train alone. To run "
            f"{count} processes on CPU: {CPU_FSDP_ENV}=1 accelerate launch --config_file "
            f"configs/accelerate/fsdp_cpu_2proc.yaml --num_processes {count} {script} ...  (FSDP2 on gloo, see "
            f"docs/fsdp-and-engines.md#multi-gpu-fsdp2-and-multi-node); on {count} GPUs: --config_file "
            "configs/accelerate/fsdp_8gpu.yaml; for one process drop --num_processes"
        )


def check_precision(cfg: Any, accelerator: Any) -> None:
    """`mixed_precision` must really change the compute: accelerate 1.15 autocasts bf16 on CPU and GPU (with fp32
    master weights: the scripts load fp32 and the optimizer steps fp32), but turns fp16 off on CPU without a word."""
    if cfg.mixed_precision != "no" and not accelerator.native_amp:
        raise ConfigError(
            f"mixed_precision {cfg.mixed_precision} does not autocast on {accelerator.device.type} here (accelerate "
            "would silently train in fp32): use bf16, or no"
        )


def is_fsdp(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def grad_sync(accelerator: Any, model: Any, sync: bool) -> Any:
    """Context for one micro-batch's backward. DDP: skip the all-reduce except on the last micro-batch. FSDP:
    always reduce-scatter, so gradients stay sharded; skipping it (accelerate's no_sync) would keep a full
    unsharded gradient on every rank during accumulation (280 GB for a 70B model in fp32). Same numbers either way."""
    if sync or accelerator.num_processes == 1 or is_fsdp(accelerator):
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


@contextlib.contextmanager
def grad_sync_all(accelerator: Any, models: Iterable[Any], sync: bool) -> Iterator[None]:
    """`grad_sync` for several models trained by one backward (a policy and its value model)."""
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(grad_sync(accelerator, model, sync))
        yield


def clip_grad_norm_(accelerator: Any, model: Any, max_norm: float) -> Any:
    """Clip `model`'s gradients to a total L2 norm of max_norm; returns the norm before clipping (a plain tensor).

    Under FSDP, accelerate 1.15's clip_grad_norm_ looks the model up by comparing parameter lists with `==`, which
    raises ("Boolean value of Tensor ... is ambiguous") as soon as two prepared models have as many parameters (a
    policy and its value model). torch's clip_grad_norm_ on the DTensor gradients is what accelerate would call:
    each rank's shard norms are reduced over the mesh, so every rank clips with the global norm."""
    if not is_fsdp(accelerator):
        return accelerator.clip_grad_norm_(model.parameters(), max_norm)
    import torch
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def prepare_frozen(accelerator: Any, model: Any) -> Any:
    """A model that is never trained (reference policy, reward model): sharded like the trained ones under FSDP
    (accelerate's FSDP2 prepare insists on an optimizer, so this calls its wrapper directly); elsewhere moved to
    the device without a DDP wrapper."""
    model.requires_grad_(False)
    model.eval()
    if is_fsdp(accelerator):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model)
    return accelerator.prepare_model(model, evaluation_mode=True)


def fsdp2_reshard_settings(model: Any, units: Sequence[Any]) -> Callable[[], None]:
    """The one adapter over FSDP2 internals (tests/test_private_api.py allows private torch access only here).

    FSDP2 has public setters for a module's reshard-after-forward behaviour (`set_reshard_after_forward`) but no
    getter, and no public way to run the root's lazy init outside a forward. This function runs that init on the root
    (so `unshard()` before any forward finds its streams and defaults settled), records each unit's setting, and
    returns a function that puts them back exactly (torch's automatic root/non-root choice included). The setting
    lives on the unit's parameter groups: torch 2.11 holds one as `FSDPState._fsdp_param_group` (None for a unit
    without parameters), torch 2.13 a list `FSDPState._fsdp_param_groups`; either is read, on any version."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    def groups(state: Any) -> list[Any]:
        if hasattr(state, "_fsdp_param_groups"):  # torch 2.13
            return list(state._fsdp_param_groups)
        if hasattr(state, "_fsdp_param_group"):  # torch 2.11
            group = state._fsdp_param_group
            return [] if group is None else [group]
        raise RuntimeError(
            f"this torch ({torch.__version__}) keeps FSDP2 parameter groups under neither _fsdp_param_groups nor "
            "_fsdp_param_group: supported torch versions are 2.11-2.14 (docs/gpu-support.md)"
        )

    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()  # settle the root's defaults first (normally done by the first forward)
    states = [unit._get_fsdp_state() for unit in units]
    saved = [(state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in groups(state)]) for state in states]

    def restore() -> None:
        for state, (auto, infos) in zip(states, saved):
            state._auto_reshard_after_forward = auto
            for group, info in zip(groups(state), infos):
                group.post_forward_mesh_info = info

    return restore


@contextlib.contextmanager
def full_params(model: Any) -> Iterator[Any]:
    """Gather FSDP2-sharded weights once and keep them whole inside the block (for `generate`): no collective runs
    per decoding step, so ranks may stop generating at different lengths without deadlocking. Re-sharded on exit.
    Memory: the whole model in its compute dtype on every rank. No-op for unsharded models. Uses FSDP2's public
    `unshard` / `set_reshard_after_forward` / `reshard`; only reading back the previous setting needs the adapter."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield model
        return
    restore_reshard_settings = fsdp2_reshard_settings(model, units)
    for unit in units:
        unit.unshard()  # all-gather, same order on every rank
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        restore_reshard_settings()
        for unit in units:
            unit.reshard()


# ---------------------------------------------------------------------------------------------------------------------
# Shard report: what each rank actually holds (read by tests/test_fsdp.py)


def shard_report(models: dict[str, Any], optimizers: dict[str, Any]) -> dict[str, Any]:
    """Per trainable parameter: DTensor or not, placements, local and global element counts; the same totals for
    the optimizer state."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, model in models.items():
        params = {}
        for pname, p in model.named_parameters():
            if not p.requires_grad:
                continue
            is_dt = isinstance(p, DTensor)
            params[pname] = {
                "dtensor": is_dt,
                "placements": [str(pl) for pl in p.placements] if is_dt else [],
                "local_numel": p.to_local().numel() if is_dt else p.numel(),
                "global_numel": p.numel(),
            }
        report: dict[str, Any] = {"params": params}
        optimizer = optimizers.get(name)
        if optimizer is not None:
            local = total = 0
            dtensors = plain = 0
            for state in optimizer.state.values():
                for value in state.values():
                    if getattr(value, "ndim", 0) == 0:
                        continue  # step counters
                    if isinstance(value, DTensor):
                        dtensors += 1
                        local += value.to_local().numel()
                    else:
                        plain += 1
                        local += value.numel()
                    total += value.numel()
            report["optimizer"] = {
                "local_numel": local,
                "global_numel": total,
                "dtensor_states": dtensors,
                "plain_states": plain,
            }
        out[name] = report
    return out


def maybe_dump_shard_report(accelerator: Any, models: dict[str, Any], optimizers: dict[str, Any], tag: str) -> None:
    """With OPEN_INSTRUCT_SHARD_REPORT=<dir>, each rank writes <dir>/<tag>_rank<r>.json (a debugging aid)."""
    folder = os.environ.get(SHARD_REPORT_ENV)
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "models": shard_report(models, optimizers),
    }
    path = os.path.join(folder, f"{tag}_rank{accelerator.process_index}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


# ---------------------------------------------------------------------------------------------------------------------
# The step's statistics: kept on the device and read once per optimizer step, then summed over ranks (global_sums).
#
# Reading a number off an accelerator (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, `if t.any()`, a boolean index)
# makes the host wait until the device has finished everything queued so far: done once per micro-batch, the host can
# no longer queue the next micro-batch's copies and FSDP prefetches while the device computes. So each micro-batch adds
# its statistics into a float64 vector on the device, and the step reads that vector once. Float64 keeps the sums
# exactly what the host-side `total += float(t)` (Python floats are float64) gave, addition for addition in the same
# order, so the logged numbers do not change.


class StepSums:
    """Named sums (and maxima) kept on `device` as float64; `read()` returns them as Python floats in one transfer.

    Statistics missing from an `add` count 0 (sums) or leave the maximum as it is; maxima start at `floor`."""

    def __init__(self, names: Sequence[str], device: Any, maxima: Sequence[str] = (), floor: float = 0.0) -> None:
        import torch

        self.names, self.maxima = tuple(names), tuple(maxima)
        self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self._max = torch.full((len(self.maxima),), floor, dtype=torch.float64, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, values: Mapping[str, Any]) -> None:
        """Add each named 0-dim tensor to its sum, and raise each named maximum to its value (no host sync)."""
        import torch

        if self.names:
            parts = [values[n].detach().to(torch.float64) if n in values else self._zero for n in self.names]
            self._sums += torch.stack(parts)
        if self.maxima:
            parts = [
                values[n].detach().to(torch.float64) if n in values else self._max[i] for i, n in enumerate(self.maxima)
            ]
            self._max = torch.maximum(self._max, torch.stack(parts))

    def add_vector(self, values: Any) -> None:
        """Add a vector of all the sums at once, in `names` order."""
        import torch

        self._sums += values.detach().to(torch.float64)

    def read(self) -> dict[str, float]:
        """Every sum and maximum as a Python float: the one device-to-host transfer."""
        import torch

        return dict(zip(self.names + self.maxima, torch.cat([self._sums, self._max]).tolist()))


# ---------------------------------------------------------------------------------------------------------------------
# Collectives on plain numbers: every script's metrics and token counts are summed over ranks with these.


def global_sum(accelerator: Any, value: float) -> float:
    """`value` summed over every rank (float64, so token counts stay exact)."""
    if accelerator.num_processes == 1:
        return float(value)
    import torch

    t = torch.tensor([float(value)], device=accelerator.device, dtype=torch.float64)
    return float(accelerator.reduce(t, reduction="sum").item())


def global_sums(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """Each value of a dict summed over ranks, in one collective."""
    if accelerator.num_processes == 1 or not values:
        return {k: float(v) for k, v in values.items()}
    import torch

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], device=accelerator.device, dtype=torch.float64)
    t = accelerator.reduce(t, reduction="sum")
    return {k: float(x) for k, x in zip(keys, t.tolist())}


def global_sums_any_keys(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """global_sums where ranks may hold different keys (counts by an open-ended reason): the union of every rank's
    keys, a missing key counting 0. Two collectives."""
    if accelerator.num_processes == 1:
        return {k: float(v) for k, v in values.items()}
    from accelerate.utils import gather_object

    keys = sorted(set().union(*gather_object([sorted(values)])))
    return global_sums(accelerator, {k: float(values.get(k, 0.0)) for k in keys})


def zero_sums_by_source(sources: Iterable[str], keys: Iterable[str]) -> dict[str, dict[str, float]]:
    """{"": {key: 0.0, ...}, source: {key: 0.0, ...}, ...}: sums over a whole held-out set ("") and over each of
    its sources, for `global_sums_by_source`."""
    keys = list(keys)
    return {name: dict.fromkeys(keys, 0.0) for name in ["", *sources]}


def global_sums_by_source(accelerator: Any, sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per-source sums ({source: {key: value}}, "" = the whole set) summed over ranks, in one collective."""
    flat = {(source, key): value for source, stats in sums.items() for key, value in stats.items()}
    names = {f"{i}": pair for i, pair in enumerate(flat)}  # global_sums takes string keys
    totals = global_sums(accelerator, {i: flat[pair] for i, pair in names.items()})
    out: dict[str, dict[str, float]] = {source: {} for source in sums}
    for i, (source, key) in names.items():
        out[source][key] = totals[i]
    return out


def global_max(accelerator: Any, value: float) -> float:
    """The largest `value` over ranks."""
    if accelerator.num_processes == 1:
        return float(value)
    import torch

    t = torch.tensor([float(value)], device=accelerator.device, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def equal_micro_batch_count(
    accelerator: Any, groups: list[Any], uneven: bool, spare: Optional[Any] = None
) -> list[tuple[Any, bool]]:
    """This rank's micro-batches as (group, True), then, when `uneven`, dummies as (group, False) until it has as
    many as the rank with the most: copies of its first, or `spare` (a micro-batch) when it has none.

    FSDP forwards and backwards are collectives (each layer gathers its shards) and DDP all-reduces on a rank's last
    backward, so every rank must run the same number per optimizer step. Padded micro-batches (a fixed row count)
    of equal item counts come out equal; packed ones (a token budget), or those of the items left after a filter,
    differ in number between ranks, and the dummies run and count at weight 0."""
    count = int(global_max(accelerator, len(groups))) if uneven else len(groups)
    dummy = groups[0] if groups else spare
    return [(g, True) for g in groups] + [(dummy, False)] * (count - len(groups))


def step_micro_batches(
    accelerator: Any, items: list[Any], lengths: list[int], cfg: Any, spare: Optional[Any] = None
) -> list[tuple[list, bool]]:
    """One optimizer step's micro-batches on this rank, as (items, real): `per_device_train_batch_size` items each,
    or packed rows of up to `max_tokens_per_micro_batch` tokens (`lengths`: each item's), then the same count on
    every rank (`equal_micro_batch_count`). `spare`: an item whose one-item micro-batch a rank left with none runs as
    its dummies; given, it says `items` were filtered, so ranks can hold different numbers of them."""
    from open_instruct.data import micro_batches

    groups = micro_batches(items, cfg.per_device_train_batch_size, lengths, cfg.max_tokens_per_micro_batch)
    uneven = bool(cfg.max_tokens_per_micro_batch) or spare is not None  # a token budget packs
    return equal_micro_batch_count(accelerator, groups, uneven, None if spare is None else [spare])


def all_finite(accelerator: Any, *values: Any) -> bool:
    """True when every value (tensor or float) is finite on every rank."""
    import torch

    bad = 0.0
    for v in values:
        t = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        if not torch.isfinite(t).all():
            bad = 1.0
    return global_sum(accelerator, bad) == 0


def check_update_finite(run: Any, loss: float, **grad_norms: Any) -> bool:
    """Whether the update about to be applied is finite on every rank (`run`: the script's runtime.RunContext). When
    it is not: stop with NonFiniteError (exit 3, before any checkpoint is written) or, with `on_nonfinite: skip`, say
    so and return False so the caller skips `optimizer.step()`."""
    from open_instruct.errors import NonFiniteError

    if all_finite(run.accelerator, loss, *grad_norms.values()):
        return True
    norms = "".join(f", {name}={float(v)}" for name, v in grad_norms.items())
    message = f"non-finite loss/gradient (loss={loss}{norms}) at optimizer step {run.counters.optimizer_step + 1}"
    if run.cfg.on_nonfinite == "stop":
        raise NonFiniteError(f"{message}; stopping without saving (set on_nonfinite: skip to skip such updates)")
    run.logger.write(f"{message}: update skipped (on_nonfinite=skip)")
    return False
