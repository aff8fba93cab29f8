"""Counting host syncs on a CPU: which reads of a value off the "device" the training code makes.

On CPU every tensor is on the host, so the device is modelled: a tensor counts as on the device when it was moved
there (`.to(<device>)`), made there (a factory given `device=`), is a parameter, or was computed from one of those
(followed through every torch function, in-place writes included). Reading such a tensor on the host is a sync: on a
GPU the host would wait for the device there. The reads counted are the ones that force that wait: `.item()`,
`.tolist()`, `.cpu()`, `.numpy()`, `bool()`/`float()`/`int()` (an `if t.any():`
too), and the ops whose output size depends on the values (`nonzero`, `masked_select`, a boolean index, `unique`).

Blocking copies are counted too: moving host data to the device (`.to(<device>)`, or `torch.tensor(..., device=)`)
makes the host wait on a GPU unless the copy is non-blocking from pinned memory. Pinned memory is modelled like the
device: `pin_memory()` returns a copy marked pinned (a CPU-only torch cannot pin), and `is_pinned()` reads the mark.

Each sync is attributed to the first caller outside torch: code of this repository (open_instruct/) or a library."""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

REPO_CODE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "open_instruct") + os.sep
TORCH_CODE = os.path.dirname(torch.__file__) + os.sep
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"}
VALUE_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "nonzero_static"}
FACTORIES = {"zeros", "ones", "full", "empty", "tensor", "as_tensor", "arange", "zeros_like", "ones_like", "full_like"}


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


class HostSyncCounter(TorchFunctionMode):
    """While active, counts host syncs on device tensors: `events` holds (caller "file:line", op name) per sync."""

    def __init__(self) -> None:
        super().__init__()
        self._on_device: dict[int, weakref.ref] = {}  # by id (a WeakSet would compare tensors with ==)
        self.events: list[tuple[str, str]] = []
        self.copies: list[tuple[str, str]] = []  # blocking host-to-device copies: (caller, op)
        self._pinned: dict[int, weakref.ref] = {}
        self.active = False

    def __enter__(self) -> HostSyncCounter:
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)

    def _is_device(self, t: Any) -> bool:
        if isinstance(t, torch.nn.Parameter):
            return True
        ref = self._on_device.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, t: Any, table: dict[int, weakref.ref] | None = None) -> None:
        if not isinstance(t, torch.Tensor):  # e.g. the list of a _foreach_ op
            return
        table = self._on_device if table is None else table
        key = id(t)
        table[key] = weakref.ref(t, lambda _, key=key, table=table: table.pop(key, None))

    def _is_pinned(self, t: Any) -> bool:
        ref = self._pinned.get(id(t))
        return ref is not None and ref() is t

    def _caller(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename.startswith(TORCH_CODE) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back
        return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name == "pin_memory":  # modelled: a host copy marked pinned
            out = args[0].clone()
            self._mark(out, self._pinned)
            return out
        if name == "is_pinned":
            return self._is_pinned(args[0])
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_device = any(self._is_device(t) for t in inputs)
        # .to(<device>) moves host data to the device (on a device tensor: a no-op); .cpu() brings it to the host
        moves = name == "to" and (any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs)
        if from_device and (
            name in READS
            or name in VALUE_SHAPED
            or (name == "__getitem__" and any(t.dtype == torch.bool for t in inputs[1:]))
        ):
            self.events.append((self._caller(), name))
        if moves and not from_device:
            if not (kwargs.get("non_blocking") and self._is_pinned(args[0])):
                self.copies.append((self._caller(), "to"))
            kwargs = {**kwargs, "copy": True}  # on CPU .to(cpu) returns its input: the host copy must stay a host one
        out = func(*args, **kwargs)
        if name == "cpu" and out is args[0]:
            out = out.clone()  # on CPU .cpu() returns its input: the host copy must not stay a device one
        made_there = name in FACTORIES and kwargs.get("device") is not None
        if made_there and name in ("tensor", "as_tensor"):
            self.copies.append((self._caller(), name))  # host data copied to the device, from pageable memory
        if (from_device and name not in ("cpu", "numpy")) or moves or made_there:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
            if from_device and (name.endswith("_") and not name.startswith("__") or name in ("__setitem__",)):
                self._mark(args[0])  # an in-place write of device data
        elif name == "__setitem__" and any(self._is_device(t) for t in inputs[1:]):
            self._mark(args[0])
        return out

    def ours(self) -> Counter:
        """Syncs made by this repository's code, by "file:line op"."""
        return Counter(
            f"{os.path.relpath(c, os.path.dirname(REPO_CODE))} {op}" for c, op in self.events if c.startswith(REPO_CODE)
        )

    def our_copies(self) -> Counter:
        """Blocking host-to-device copies made by this repository's code, by "file:line op"."""
        return Counter(
            f"{os.path.relpath(c, os.path.dirname(REPO_CODE))} {op}" for c, op in self.copies if c.startswith(REPO_CODE)
        )

    def theirs(self) -> Counter:
        """Syncs made inside libraries (transformers, accelerate) on our behalf."""
        return Counter(f"{c} {op}" for c, op in self.events if not c.startswith(REPO_CODE))


def model_gpu_copies(monkeypatch: Any, counter: HostSyncCounter) -> None:
    """While the counter is active, host batches take the GPU path (pinned memory, non-blocking copies), whose
    pinning the counter models: its blocking copies are then what a GPU run would make."""
    from open_instruct import data

    monkeypatch.setattr(data, "pins_host_batches", lambda device: counter.active)


def count_during(monkeypatch: Any, owner: Any, name: str, counter: HostSyncCounter) -> None:
    """Run owner.name (a function) with the counter active."""
    original: Callable = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with counter:
            return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def count_between(monkeypatch: Any, start: tuple[Any, str], end: tuple[Any, str], counter: HostSyncCounter) -> None:
    """Activate the counter when start (owner, function name) returns and deactivate it when end is called: one
    optimizer step of the supervised loops, from its micro-batch split to its counters' update."""
    (start_owner, start_name), (end_owner, end_name) = start, end
    original_start, original_end = getattr(start_owner, start_name), getattr(end_owner, end_name)
    active = {"on": False}

    def started(*args: Any, **kwargs: Any) -> Any:
        out = original_start(*args, **kwargs)
        counter.__enter__()
        active["on"] = True
        return out

    def ended(*args: Any, **kwargs: Any) -> Any:
        if active["on"]:
            counter.__exit__(None, None, None)
            active["on"] = False
        return original_end(*args, **kwargs)

    monkeypatch.setattr(start_owner, start_name, started)
    monkeypatch.setattr(end_owner, end_name, ended)
