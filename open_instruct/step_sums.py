"""Training statistics summed on the device and read once per optimizer step.

Reading a number off an accelerator (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, `if t.any()`, a boolean index)
makes the host wait until the device has finished everything queued so far: done once per micro-batch, the host can
no longer queue the next micro-batch's copies and FSDP prefetches while the device computes. So each micro-batch adds
its statistics into a float64 vector on the device, and the step reads that vector once.

Float64 keeps the sums exactly what the host-side `total += float(t)` (Python floats are float64) gave, addition for
addition in the same order, so the logged numbers do not change."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


class StepSums:
    """Named sums (and maxima) kept on `device` as float64; `read()` returns them as Python floats in one transfer.

    Statistics missing from an `add` count 0 (sums) or leave the maximum as it is; maxima start at `floor`."""

    def __init__(
        self, names: Sequence[str], device: torch.device, maxima: Sequence[str] = (), floor: float = 0.0
    ) -> None:
        self.names, self.maxima = tuple(names), tuple(maxima)
        self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self._max = torch.full((len(self.maxima),), floor, dtype=torch.float64, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, values: Mapping[str, torch.Tensor]) -> None:
        """Add each named 0-dim tensor to its sum, and raise each named maximum to its value (no host sync)."""
        if self.names:
            parts = [values[n].detach().to(torch.float64) if n in values else self._zero for n in self.names]
            self._sums += torch.stack(parts)
        if self.maxima:
            parts = [
                values[n].detach().to(torch.float64) if n in values else self._max[i] for i, n in enumerate(self.maxima)
            ]
            self._max = torch.maximum(self._max, torch.stack(parts))

    def add_vector(self, values: torch.Tensor) -> None:
        """Add a vector of all the sums at once, in `names` order."""
        self._sums += values.detach().to(torch.float64)

    def read(self) -> dict[str, float]:
        """Every sum and maximum as a Python float: the one device-to-host transfer."""
        return dict(zip(self.names + self.maxima, torch.cat([self._sums, self._max]).tolist()))
