"""The RL step's statistics in one place: sums kept on the device and read once per optimizer step (StepSums), the
sampler-vs-trainer mismatch sums and metrics (mismatch/), and the version-lag sums (train/version_lag_*).

Reading a number off an accelerator (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, `if t.any()`, a boolean index)
makes the host wait until the device has finished everything queued so far: done once per micro-batch, the host can
no longer queue the next micro-batch's copies and FSDP prefetches while the device computes. So each micro-batch adds
its statistics into a float64 vector on the device, and the step reads that vector once.

Float64 keeps the sums exactly what the host-side `total += float(t)` (Python floats are float64) gave, addition for
addition in the same order, so the logged numbers do not change."""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

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


# ---------------------------------------------------------------------------------------------------- mismatch/
# How far the sampler's log-probs are from the trainer's, per sampled token (docs/trusted-generation.md)
def mismatch_sum_keys(async_steps: int) -> tuple[str, ...]:
    """The per-rollout sums behind the mismatch/ metrics (besides the loop's tokens and sampler_abs_diff): k3 and
    tokens beyond the TIS cap; under async also |dlogp| and tokens per version lag 0..async_steps."""
    per_lag = [f"mismatch_{what}_lag_{k}" for k in range(async_steps + 1) for what in ("abs", "tokens")]
    return ("mismatch_k3_sum", "mismatch_beyond_cap", *(per_lag if async_steps else ()))


def mismatch_token_sums(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float,
    token_lags: Optional[Sequence[Sequence[int]]] = None,
    async_steps: int = 0,
) -> dict[str, torch.Tensor]:
    """Per micro-batch sums behind the mismatch/ metrics, r = trainer logp - sampler logp on the loss-mask tokens
    (policy tokens only in multi-turn episodes): k3 = exp(r) - 1 - r (an unbiased per-token estimate of
    KL(sampler || trainer) on the sampled tokens), tokens whose TIS ratio exp(r) exceeds tis_cap, max |r|, and under
    async (`token_lags`: per row, the version lag of each policy token in order) |r| and tokens per lag.

    0-dim tensors on log_ratio's device, computed with masks rather than boolean indexing: no host sync (the update
    reads them once per rollout)."""
    on = mask > 0
    r = log_ratio.float().masked_fill(~on, 0.0)
    sums = {
        "mismatch_k3_sum": (torch.expm1(r) - r).sum(),  # 0 where masked: expm1(0) - 0
        "mismatch_beyond_cap": ((r > math.log(tis_cap)) & on).sum().float(),
        "mismatch_abs_max": r.abs().max() if r.numel() else r.new_zeros(()),
    }
    if async_steps and token_lags is not None:
        # lags listed per policy token in order: the i-th policy token of a row (cumsum of the mask) takes lags[i];
        # built on the host from the lists, so only a host-to-device copy (pinned, non-blocking on a GPU)
        from open_instruct.data import host_to_device

        width = max(mask.shape[1], max((len(lags) for lags in token_lags), default=0))
        padded = torch.full((len(token_lags), width), -1, dtype=torch.long)
        for i, lags in enumerate(token_lags):
            padded[i, : len(lags)] = torch.tensor(list(lags), dtype=torch.long)
        nth = (on.long().cumsum(dim=1) - 1).clamp(min=0)
        lag = torch.where(on, host_to_device(padded, log_ratio.device).gather(1, nth), -1)
        for k in range(async_steps + 1):
            at = lag == k
            sums[f"mismatch_abs_lag_{k}"] = (r.abs() * at).sum()
            sums[f"mismatch_tokens_lag_{k}"] = at.sum().float()
    return sums


def mismatch_metrics(sums: dict[str, float], abs_max: float, async_steps: int = 0) -> dict[str, float]:
    """The mismatch/ row from rollout-wide sums (tokens, sampler_abs_diff, mismatch_sum_keys) and the max |dlogp|."""
    tokens = max(sums["tokens"], 1.0)
    row = {
        "mismatch/abs_mean": sums["sampler_abs_diff"] / tokens,
        "mismatch/abs_max": abs_max,
        "mismatch/k3_kl": sums["mismatch_k3_sum"] / tokens,
        "mismatch/beyond_tis_cap": sums["mismatch_beyond_cap"] / tokens,
    }
    for k in range(async_steps + 1) if async_steps else ():
        n = sums[f"mismatch_tokens_lag_{k}"]
        row[f"mismatch/abs_mean_lag_{k}"] = sums[f"mismatch_abs_lag_{k}"] / n if n else 0.0
    return row


def mismatch_warnings(row: dict[str, float], warn_kl: float, warn_beyond_cap: float) -> list[str]:
    """Warning lines for a rollout whose mismatch crosses the documented levels."""
    lines = []
    if row["mismatch/k3_kl"] > warn_kl:
        lines.append(f"mismatch/k3_kl {row['mismatch/k3_kl']:.3g} > mismatch_warn_kl {warn_kl:g}")
    if row["mismatch/beyond_tis_cap"] > warn_beyond_cap:
        lines.append(
            f"mismatch/beyond_tis_cap {row['mismatch/beyond_tis_cap']:.3g} > mismatch_warn_beyond_cap "
            f"{warn_beyond_cap:g}"
        )
    return lines


def version_lag_stats(token_lags: list[list[int]], bound: int) -> dict[str, float]:
    """Sums for the version-lag metrics of a rollout: tokens, sum of lags, and per lag k in 0..bound the tokens with
    that lag (lag_<k>); a lag beyond the bound (never trained on: rollouts.RolloutSampler) counts in lag_<bound+1>."""
    sums = {"lag_tokens": 0.0, "lag_sum": 0.0, **{f"lag_{k}": 0.0 for k in range(bound + 2)}}
    for lags in token_lags:
        for lag in lags:
            sums["lag_tokens"] += 1
            sums["lag_sum"] += lag
            sums[f"lag_{min(max(lag, 0), bound + 1)}"] += 1
    return sums
