"""Numeric tolerances derived from the dtype, the magnitudes and the number of operations, never from what one machine
printed: torch's CPU kernels (default / AVX2 / AVX-512, oneDNN, MKL) sum in different orders, so two evaluations of
the same network that are equal in exact arithmetic differ by rounding that depends on the host.

The bound used is Higham's for a dot product of length n evaluated in any order (Accuracy and Stability of Numerical
Algorithms, 2nd ed., eq. 3.5): |fl(x.y) - x.y| <= gamma_n * sum|x_i y_i|, gamma_n = n*u / (1 - n*u), u = eps/2.
A forward pass is a chain of such reductions; to first order their relative errors add along the chain, so two
evaluation orders of one network differ by at most (sum of the chain's reduction lengths) * u * (the magnitude the
products sum to). Worst-case bounds, not typical ones: a test that exceeds one has found a real difference."""

from __future__ import annotations

from typing import Any

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n: the relative error bound of an n-term sum or dot product."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"{n} terms exceed what {dtype} can bound"
    return nu / (1 - nu)


def decoder_reduction_lengths(config: Any, seq_len: int) -> list[int]:
    """The reduction lengths along one path through a Llama-shaped decoder's forward (embedding -> logits): per layer
    the q/k/v projection, the attention scores (head_dim), the weighted sum over positions (seq_len), the output
    projection, gate/up, down (intermediate), and the RMSNorm's mean of squares; then the final norm and lm_head."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    per_layer = [hidden, hidden, head_dim, seq_len, hidden, hidden, hidden, config.intermediate_size]
    return per_layer * config.num_hidden_layers + [hidden, hidden]


def chain_atol(reduction_lengths: list[int], magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Absolute bound on the difference between two evaluation orders of a chain of reductions whose outputs are of
    size `magnitude` (to first order the chain's relative errors add)."""
    return sum(gamma(n, dtype) for n in reduction_lengths) * magnitude


def forward_atol(model: Any, seq_len: int, outputs: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The bound for a decoder's outputs (logits) computed two ways, e.g. merged LoRA weights vs base + adapter: the
    chain of `model.config` at `seq_len` tokens, scaled by the outputs' largest magnitude."""
    return chain_atol(decoder_reduction_lengths(model.config, seq_len), outputs.abs().max().item(), dtype)
