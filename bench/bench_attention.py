"""Packed-row attention on CPU: the ways to attend within each sequence of one packed row, timed forward + backward,
with their largest difference from the per-sequence loop `sdpa_varlen` runs on CPU.

    python bench/bench_attention.py        # the table docs/packing.md quotes

- loop: attention.varlen_sdpa_attention's CPU path, one causal SDPA per sequence (what a CPU runs, before and after
  the varlen kernel: torch's varlen_attn is flash attention, CUDA only);
- block mask: one SDPA over the row with the [T, T] block-diagonal causal mask (transformers' sdpa on a packed row);
- flex compiled: FlexAttention with a document block mask, under torch.compile (the block mask built once per row,
  compile time not counted; recompiles whenever the row's shape changes).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

LENGTHS = (100, 300, 50, 400, 198, 500, 200, 300)  # one 2048-token row of 8 sequences
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def timed(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens = sum(LENGTHS)
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, requires_grad=True)
    k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, requires_grad=True)
    v = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, requires_grad=True)
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    causal_within = (doc[:, None] == doc[None, :]) & torch.ones(tokens, tokens, dtype=torch.bool).tril()

    def loop() -> torch.Tensor:
        pieces = [t.split(list(LENGTHS), dim=2) for t in (q, k, v)]
        return torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
                for a, b, c in zip(*pieces)
            ],
            dim=2,
        )

    def block_mask_sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_within, enable_gqa=True)

    def document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block = create_block_mask(document, 1, None, tokens, tokens, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def flex() -> torch.Tensor:
        return compiled(q, k, v, block_mask=block, enable_gqa=True)

    reference = loop().detach()
    print(
        f"one row of {tokens} tokens, {len(LENGTHS)} sequences, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, fp32, 1 thread"
    )
    print("| way | forward + backward ms | max abs diff vs loop |\n|---|---|---|")
    for name, fn in (("loop (sdpa_varlen on CPU)", loop), ("block mask, one SDPA", block_mask_sdpa),
                     ("FlexAttention compiled", flex)):  # fmt: skip
        try:

            def step(fn: Callable[[], torch.Tensor] = fn) -> None:
                fn().square().sum().backward()

            seconds = timed(step)
            diff = (fn().detach() - reference).abs().max().item()
            print(f"| {name} | {seconds * 1e3:.0f} | {diff:.1e} |")
        except Exception as e:  # noqa: BLE001 - a way this torch cannot run is reported, the others still are
            print(f"| {name} | failed: {type(e).__name__} | |")


if __name__ == "__main__":
    main()
