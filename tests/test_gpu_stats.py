"""GPU observability (open_instruct/gpu_stats.py): one FLOPs count for scripts and benches (tied output layers
included), the GPU's published peak told apart by name and memory, and no GPU keys on CPU."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from open_instruct.gpu_stats import StepGPUStats, device_peak_flops, flops_per_token, gpu_kind, matmul_params


def _tiny(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(config)


def test_matmul_params_count_the_output_layer_tied_or_not():
    untied, tied = _tiny(False), _tiny(True)
    total_untied = sum(p.numel() for p in untied.parameters())
    total_tied = sum(p.numel() for p in tied.parameters())  # the shared [100, 32] weight counted once
    assert total_untied - total_tied == 100 * 32
    # untied: every parameter but the input embedding; tied: the shared weight is the output layer's matmul
    assert matmul_params(untied) == total_untied - 100 * 32
    assert matmul_params(tied) == total_tied == matmul_params(untied)
    assert flops_per_token([tied, untied]) == 6 * 2 * matmul_params(tied)


@pytest.mark.parametrize(
    "name,memory_gb,kind,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 80, "H100 SXM", 989),
        ("NVIDIA H100 PCIe", 80, "H100 PCIe", 756),
        ("NVIDIA H100 NVL", 94, "H100 NVL", 835),
        ("NVIDIA H100", 94, "H100 NVL", 835),  # a bare name: only the NVL has more than 90 GB
        ("NVIDIA H200", 141, "H200", 989),
        ("NVIDIA A100-SXM4-80GB", 80, "A100", 312),
        ("NVIDIA A100-PCIE-40GB", 40, "A100", 312),
    ],
)
def test_published_peak_by_name_and_memory(name, memory_gb, kind, tflops):
    assert gpu_kind(name, memory_gb * 1e9) == kind
    assert device_peak_flops(name, memory_gb * 1e9) == tflops * 1e12


def test_unknown_gpu_has_no_peak_unless_given():
    assert device_peak_flops("Some Accelerator", 64e9) is None
    assert device_peak_flops("Some Accelerator", 64e9, override_tflops=400) == 400e12
    assert device_peak_flops("NVIDIA H100 PCIe", 80e9, override_tflops=500) == 500e12  # the flag wins


def test_no_gpu_keys_on_cpu():
    stats = StepGPUStats(torch.device("cpu"), [_tiny(True)], peak_tflops=100)
    assert stats.metrics({"perf/tokens_per_second": 1000.0}) == {}


def test_gpu_row_reads_and_resets_the_peaks_and_divides_tokens_by_the_world(monkeypatch):
    """On a CUDA device (the allocator's counters stubbed here): the row carries the peaks in GB, resets them, and
    MFU = 6 N x (global tokens/s / world) / peak."""
    stats = StepGPUStats(torch.device("cpu"), [_tiny(True)], peak_tflops=100, world=4)
    stats.cuda, stats.peak_flops = True, 100e12  # what __init__ sets on a GPU
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3.5e9)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4.25e9)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    row = stats.metrics({"perf/tokens_per_second": 8e9})
    n = matmul_params(_tiny(True))
    assert row["gpu/peak_allocated_gb"] == 3.5 and row["gpu/peak_reserved_gb"] == 4.25 and len(resets) == 1
    assert row["perf/mfu"] == pytest.approx(6 * n * 8e9 / 4 / 100e12, rel=1e-12)
    assert row["perf/peak_tflops"] == 100
    assert "perf/mfu" not in stats.metrics({"perf/response_tokens_per_second": 1.0})  # not a training rate
