"""`sdpa_varlen`: attention for packed rows without the quadratic mask, registered with transformers.

A packed row (data.packed_row) holds many sequences; transformers' sdpa path builds a [T, T] block-diagonal mask for
it and attends over all T^2 query-key pairs, masked ones included: at 4k tokens of sequences averaging 250 that is
~16x the work of attending within each sequence (sum of l^2), and on CPU the attention then costs more than every
linear layer together. `sdpa_varlen` runs torch's scaled_dot_product_attention sequence by sequence (is_causal, no
mask), with the boundaries read from the position ids transformers hands every attention call (they restart at 0
at each sequence). Anything else (a padded batch with its mask, several rows, decoding with a KV cache) goes to
transformers' own sdpa unchanged, so the name can stay on for every forward of a run: generation and eval included.

On a GPU the sequences of a row go to one kernel call instead: torch's own variable-length attention
(`torch.nn.attention.varlen.varlen_attn`, flash attention with cumulative sequence offsets; torch >= 2.10), when the
installed torch has it and the call needs nothing it lacks (no dropout). Flash attention takes q, k and v in one
16-bit dtype only, and `varlen_attn` has no autocast rule, so the row goes to it in autocast's dtype where autocast is
on (over fp32 weights the rotary embedding leaves q and k fp32 beside a bf16 v), in their own dtype where they share a
16-bit one (bf16 weights, FSDP2's mixed precision), and otherwise (fp32 without autocast) to the loop. Elsewhere
(CPU, where that kernel does not run, or an older torch) the loop stays: on CPU it is also faster than FlexAttention
with a document block mask (bench/bench_attention.py). flash_attention_2 (flash-attn's varlen kernel) remains an
option where installed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

NAME = "sdpa_varlen"
KERNEL_DEVICE_TYPES = ("cuda",)  # where varlen_attn runs (flash attention); tests add "cpu" to drive a stand-in
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # what flash attention accepts


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence of one packed row: a new sequence wherever the position does not follow on."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    edges = [0, *starts.tolist(), len(pos)]
    return list(zip(edges[:-1], edges[1:]))


_bounds_cache: dict[str, Any] = {"key": None, "bounds": None, "offsets": None}  # per forward, not per layer


def _cached_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    if _bounds_cache["key"] is not position_ids:
        _bounds_cache.update(key=position_ids, bounds=sequence_bounds(position_ids), offsets=None)
    return _bounds_cache["bounds"]


def _cached_offsets(position_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The row's cumulative sequence offsets [0, end_1, ..., T] (int32, on `device`), made once per forward."""
    from open_instruct.data import host_to_device

    bounds = _cached_bounds(position_ids)
    if _bounds_cache["offsets"] is None:
        host = torch.tensor([0, *(end for _, end in bounds)], dtype=torch.int32)
        _bounds_cache["offsets"] = host_to_device(host, device)
    return _bounds_cache["offsets"]


def varlen_kernel() -> Optional[Any]:
    """torch's variable-length attention function, or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def use_varlen_kernel(query: torch.Tensor, dropout: float) -> bool:
    """One kernel call for the row: on CUDA (the kernel is flash attention's), without dropout (it has none)."""
    return query.device.type in KERNEL_DEVICE_TYPES and dropout == 0.0 and varlen_kernel() is not None


def varlen_kernel_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Optional[torch.dtype]:
    """The one dtype q, k and v go to the kernel in: autocast's where it is on for their device (it decides what
    every matmul computes in, and the rotary embedding leaves q and k fp32 beside a bf16 v), else theirs where they
    share a 16-bit one; None when that is no dtype flash attention takes (fp32 without autocast: the loop instead)."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif query.dtype == key.dtype == value.dtype:
        dtype = query.dtype
    else:
        return None
    return dtype if dtype in KERNEL_DTYPES else None


def varlen_kernel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor,
    bounds: list[tuple[int, int]],
    scaling: Optional[float],
) -> torch.Tensor:
    """Causal attention within each sequence of one packed row in a single varlen_attn call: [1, H, T, D] inputs,
    [1, T, H, D] output. Its keywords differ across torch releases (is_causal, or window_size (-1, 0) for causal;
    enable_gqa or not), so they are read from its signature; without enable_gqa the kv heads are repeated."""
    import inspect

    kernel = varlen_kernel()
    params = inspect.signature(kernel).parameters
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, D]
    kwargs: dict[str, Any] = {"scale": scaling}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    offsets = _cached_offsets(position_ids, q.device)
    longest = max(end - start for start, end in bounds)
    out = kernel(q, k, v, offsets, offsets, longest, longest, **kwargs)
    return out.unsqueeze(0)  # [1, T, H, D]


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, H, T, D], key/value [1, H_kv, T, D] -> ([1, T, H, D],
    None). One causal sdpa per sequence of a packed row; everything else is transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    packed_row = (
        attention_mask is None
        and position_ids is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2] > 1  # not decoding against a cache
        and getattr(module, "is_causal", True)
    )
    if position_ids is None and attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2] > 1:
        raise RuntimeError(
            f"{NAME}: {type(module).__name__} passes no position_ids to its attention, so a packed row's sequence "
            "boundaries are unknown; use attn_implementation sdpa (or flash_attention_2)"
        )
    bounds = _cached_bounds(position_ids) if packed_row else []
    if len(bounds) <= 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    dropout = dropout if module.training else 0.0
    kernel_dtype = varlen_kernel_dtype(query, key, value) if use_varlen_kernel(query, dropout) else None
    if kernel_dtype is not None:
        q, k, v = (t.to(kernel_dtype) for t in (query, key, value))  # a no-op where they have it already
        return varlen_kernel_attention(q, k, v, position_ids, bounds, scaling), None
    # Split along the sequence axis of the [1, T, H, D] layout the projections produced: every piece is a view, and
    # the backward of a split is one concatenation (slicing would zero-fill a full-size gradient per sequence).
    sizes = [e - s for s, e in bounds]
    pieces = [t.transpose(1, 2).split(sizes, dim=1) for t in (query, key, value)]
    gqa = query.shape[1] != key.shape[1]
    out = [
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        ).transpose(1, 2)
        for q, k, v in zip(*pieces)
    ]
    return torch.cat(out, dim=1), None


def varlen_mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask transformers builds for `sdpa_varlen`: none for a row without a 2D attention mask (a packed row: the
    attention keeps to each sequence itself), sdpa's for a padded batch."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make `attn_implementation="sdpa_varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)
