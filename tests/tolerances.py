"""Numeric tolerances derived from the dtype, the magnitudes and the number of operations, never from what one machine
printed: torch's CPU kernels (default / AVX2 / AVX-512, oneDNN, MKL) sum in different orders, so two evaluations of
the same network that are equal in exact arithmetic differ by rounding that depends on the host.

The bound used is Higham's for a dot product of length n evaluated in any order (Accuracy and Stability of Numerical
Algorithms, 2nd ed., eq. 3.5): |fl(x.y) - x.y| <= gamma_n * sum|x_i y_i|, gamma_n = n*u / (1 - n*u), u = eps/2.
A forward pass is a chain of such reductions; to first order their relative errors add along the chain, so two
evaluation orders of one network differ by at most (sum of the chain's reduction lengths) * u * (the magnitude the
products sum to). Each of two evaluations lies within that bound of the exact value, so they differ by at most twice
it. Worst-case bounds, not typical ones (rounding errors mostly cancel: what a run shows is often 10-100x below): a test
that exceeds one has found a real difference.

Which tolerance where (docs/testing.md has the audit of every tolerance in tests/):
- one value computed two ways by a decoder (logits, scores, log-probs): forward_atol / chain_atol;
- a sum or mean of many terms (a loss, a log-prob sum) added up in another order: sum_atol;
- gradients computed two ways: backward_atol;
- what a short training run logs, run two ways (padded vs packed, 1 process vs 2): run_rtol;
- a hand-worked formula evaluated elementwise in float32 (a few ops on values of size ~1): elementwise_atol."""

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
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden  # GPT-2
    per_layer = [hidden, hidden, head_dim, seq_len, hidden, hidden, hidden, intermediate]
    return per_layer * config.num_hidden_layers + [hidden, hidden]


def chain_atol(reduction_lengths: list[int], magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Absolute bound on the difference between two evaluation orders of a chain of reductions whose outputs are of
    size `magnitude` (to first order the chain's relative errors add; x2: both evaluations err)."""
    return 2 * sum(gamma(n, dtype) for n in reduction_lengths) * magnitude


def forward_atol(model: Any, seq_len: int, outputs: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The bound for a decoder's outputs (logits) computed two ways, e.g. merged LoRA weights vs base + adapter: the
    chain of `model.config` at `seq_len` tokens, scaled by the outputs' largest magnitude."""
    return chain_atol(decoder_reduction_lengths(model.config, seq_len), outputs.abs().max().item(), dtype)


def max_abs(values: Any) -> float:
    """The largest |entry| of a tensor, a number, or a list / dict of them."""
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (list, tuple)):
        return max(max_abs(v) for v in values)
    return torch.as_tensor(values).abs().max().item()


def sum_atol(terms: Any, dtype: torch.dtype = torch.float32) -> float:
    """Two evaluation orders of sum(terms) (a loss summed over tokens, a log-prob sum over a sequence) differ by at most
    2 * gamma_{n-1} * sum|terms|. Divide by the count for a mean (the division rounds once more, u relative)."""
    flat = torch.as_tensor(terms, dtype=torch.float64).flatten()
    return 2 * gamma(max(flat.numel() - 1, 1), dtype) * flat.abs().sum().item()


def elementwise_atol(ops: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """A hand-worked formula of `ops` elementwise operations (exp, log, softplus, products: each correctly rounded to
    within one ulp by any kernel, SLEEF's vectorised ones included) on values of size `magnitude`, against the exact
    value computed in float64: ops * 2u * magnitude (2u: one ulp, the vectorised kernels' accuracy)."""
    return ops * 2 * unit_roundoff(dtype) * max(magnitude, 1.0)


def backward_atol(model: Any, seq_len: int, tokens: int, grads: Any, dtype: torch.dtype = torch.float32) -> float:
    """Gradients computed two ways: the forward chain, the same chain transposed in the backward, and each weight
    gradient's reduction over the `tokens` positions of the batch, scaled by the largest gradient entry."""
    lengths = decoder_reduction_lengths(model.config, seq_len)
    return chain_atol(2 * lengths + [tokens], max_abs(grads), dtype)


def run_rtol(config: Any, seq_len: int, tokens: int, steps: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound on what a short training run logs when it is run two ways (padded vs packed, one process vs two,
    another kernel): every step's gradient carries the forward + backward bound (backward_atol, relative); Adam's
    update m / sqrt(v) does not depend on the gradient's scale, so a relative gradient error moves each update by at
    most the same relative amount, and to first order the errors of the `steps` steps and of the logging forward add."""
    lengths = decoder_reduction_lengths(config, seq_len)
    per_step = 2 * sum(gamma(n, dtype) for n in 2 * lengths + [tokens])
    return (steps + 1) * per_step


def pass_atol(config: Any, seq_len: int, tokens: int, values: Any, dtype: torch.dtype = torch.float32) -> float:
    """Any quantity computed from one forward and backward pass of a decoder (log-probs, values, advantages, a loss,
    gradients), computed two ways: to first order its relative error is the pass's (run_rtol with no optimizer
    step), scaled by the quantity's largest magnitude."""
    return run_rtol(config, seq_len, tokens, 0, dtype) * max_abs(values)


def rollout_width(rollout: Any) -> int:
    """The widest prompt + response row of an RL rollout (rlvr_ppo.Rollout): the longest reduction over positions."""
    prompts = [e["prompt_ids"] if isinstance(e, dict) else e.prompt_ids for e in rollout.episodes]
    return max(map(len, prompts)) + rollout.mask.shape[1]
