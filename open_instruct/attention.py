"""`sdpa_varlen`: attention for packed rows without the quadratic mask, registered with transformers.

A packed row (data.packed_row) holds many sequences; transformers' sdpa path builds a [T, T] block-diagonal mask for
it and attends over all T^2 query-key pairs, masked ones included: at 4k tokens of sequences averaging 250 that is
~16x the work of attending within each sequence (sum of l^2), and on CPU the attention then costs more than every
linear layer together. `sdpa_varlen` runs torch's scaled_dot_product_attention sequence by sequence (is_causal, no
mask), with the boundaries read from the position ids transformers hands every attention call (they restart at 0
at each sequence). Anything else (a padded batch with its mask, several rows, decoding with a KV cache) goes to
transformers' own sdpa unchanged, so the name can stay on for every forward of a run: generation and eval included.

On GPUs, flash_attention_2 (its varlen kernel) is the faster choice when flash-attn is installed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

NAME = "sdpa_varlen"


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence of one packed row: a new sequence wherever the position does not follow on."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    edges = [0, *starts.tolist(), len(pos)]
    return list(zip(edges[:-1], edges[1:]))


_bounds_cache: dict[str, Any] = {"key": None, "bounds": None}  # one host sync per forward, not one per layer


def _cached_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    if _bounds_cache["key"] is not position_ids:
        _bounds_cache["key"], _bounds_cache["bounds"] = position_ids, sequence_bounds(position_ids)
    return _bounds_cache["bounds"]


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
    # Split along the sequence axis of the [1, T, H, D] layout the projections produced: every piece is a view, and
    # the backward of a split is one concatenation (slicing would zero-fill a full-size gradient per sequence).
    sizes = [e - s for s, e in bounds]
    pieces = [t.transpose(1, 2).split(sizes, dim=1) for t in (query, key, value)]
    dropout = dropout if module.training else 0.0
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
