"""GPU observability shared by every script and bench: the model FLOPs per token (one formula), the GPU's published
dense bf16 peak told apart by device name and memory, and the per-step peak memory and MFU a log row carries.

MFU = flops_per_token x tokens/s / peak, with flops_per_token = 6 x N (forward 2N + backward 4N; recomputation by
activation checkpointing and attention's own FLOPs are not counted: they show up as lost utilisation), N = the
parameters that take part in a matmul per token: every parameter but the input embedding (a lookup), plus the output
layer when it shares the embedding's weight (tied: the same tensor is a lookup and a [hidden x vocab] matmul).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

# Published dense (no sparsity) bf16 tensor-core peaks, FLOP/s. H100 SXM 989, H100 PCIe 756, H100 NVL 835; H200 SXM
# 989, H200 NVL 835; A100 (SXM and PCIe, 40 and 80 GB) 312.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "A100": 312e12,
    "B200": 2250e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


def gpu_kind(device_name: str, memory_bytes: float) -> Optional[str]:
    """The PEAK_BF16_FLOPS key of a device from torch.cuda.get_device_name and its total memory, or None.
    "NVIDIA H100 80GB HBM3" -> H100 SXM, "NVIDIA H100 PCIe" -> H100 PCIe, "NVIDIA H100 NVL" (94 GB) -> H100 NVL;
    an H100 whose name says neither is told by its memory: above 90 GB only the NVL exists."""
    name = device_name.upper().replace("-", " ")
    nvl = "NVL" in name
    if "H200" in name:
        return "H200 NVL" if nvl else "H200"
    if "H100" in name:
        if "PCIE" in name:
            return "H100 PCIe"
        return "H100 NVL" if nvl or memory_bytes > 90e9 else "H100 SXM"
    for key in ("A100", "B200", "L40S", "A10G"):
        if key in name:
            return key
    return None


def device_peak_flops(
    device_name: str, memory_bytes: float, override_tflops: Optional[float] = None
) -> Optional[float]:
    """Dense bf16 FLOP/s of the device: `override_tflops` x 1e12 when given (--peak_tflops), else the published
    figure of its kind, else None (MFU is then not reported)."""
    if override_tflops:
        return override_tflops * 1e12
    kind = gpu_kind(device_name, memory_bytes)
    return PEAK_BF16_FLOPS[kind] if kind else None


def matmul_params(model: Any) -> int:
    """N of 6N: every parameter but the embedding tables, plus a linear layer's weight tied to one (see the module
    docstring). Any module tree: a plain, peft-, DDP- or FSDP2-wrapped HF model, the RL value model (a DTensor's
    numel is the global one)."""
    import torch

    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in tables)  # parameters() yields a tied one once
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return n + sum(w.numel() for w in {id(w): w for w in linears if id(w) in tables}.values())


def flops_per_token(models: Iterable[Any]) -> int:
    """Training FLOPs per token through every model of `models` (forward and backward): 6 x sum of matmul_params."""
    return 6 * sum(matmul_params(m) for m in models)


def mfu(flops_per_token: float, tokens_per_second: float, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: flops_per_token x tokens/s / peak (None without a peak)."""
    return flops_per_token * tokens_per_second / peak_flops if peak_flops else None


# The keys of a log row whose tokens/s counts tokens through a training forward and backward: supervised scripts'
# perf/tokens_per_second; RL's perf/train_tokens_per_second (the update phase: prompt + response, x num_epochs).
TRAINING_TOKENS_KEYS = ("perf/tokens_per_second", "perf/train_tokens_per_second")


class StepGPUStats:
    """Per log row on a CUDA device: gpu/peak_allocated_gb and gpu/peak_reserved_gb of this process (rank 0's in the
    log) since the previous row (the allocator's peak is reset after each read), and perf/mfu per GPU: the row's
    tokens/s is the sum over the `world` processes, so MFU = flops_per_token x tokens/s / (world x peak). On another
    device it adds nothing: the keys are absent, not null (CPU memory and FLOP/s are not what they mean)."""

    def __init__(
        self, device: Any, trained_models: Iterable[Any], peak_tflops: Optional[float] = None, world: int = 1
    ) -> None:
        import torch

        self.world = world
        self.cuda = getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
        self.device = device
        self.flops_per_token = flops_per_token(trained_models)
        self.peak_flops: Optional[float] = None
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            self.peak_flops = device_peak_flops(props.name, props.total_memory, peak_tflops)
            torch.cuda.reset_peak_memory_stats(device)

    def metrics(self, row: dict[str, Any]) -> dict[str, float]:
        """The GPU keys for a train log row `row` (MFU when it carries a training tokens/s); resets the peaks."""
        if not self.cuda:
            return {}
        import torch

        out = {
            "gpu/peak_allocated_gb": torch.cuda.max_memory_allocated(self.device) / 1e9,
            "gpu/peak_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 1e9,
        }
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = next((row[k] for k in TRAINING_TOKENS_KEYS if k in row), None)
        if tokens is not None and self.peak_flops:
            out["perf/mfu"] = mfu(self.flops_per_token, tokens / self.world, self.peak_flops)
            out["perf/peak_tflops"] = self.peak_flops / 1e12
        return out
