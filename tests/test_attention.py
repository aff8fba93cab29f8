"""attn_implementation "sdpa_varlen" (open_instruct/attention.py): a packed row attended one sequence at a time gives
the same outputs and gradients as transformers' sdpa with its block-diagonal mask; padded batches and generation go
through sdpa unchanged."""

import functools

import pytest
import torch
from tolerances import backward_atol, forward_atol

from open_instruct import data
from open_instruct.models import load_causal_lm

pytestmark = pytest.mark.numerics  # every test here compares numbers computed two ways


def packed_and_padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(5, 90, (n,), generator=g).tolist() for n in lengths]
    return data.packed_row(seqs), {
        "input_ids": data.pad(seqs, 0),
        "attention_mask": data.pad([[1] * n for n in lengths], 0),
    }


def test_varlen_packed_row_equals_sdpa_block_mask(tiny_models):
    sdpa = load_causal_lm(tiny_models["causal_lm"], attn_implementation="sdpa")
    varlen = load_causal_lm(tiny_models["causal_lm"], attn_implementation="sdpa_varlen")
    packed, _ = packed_and_padded([7, 1, 30, 12])
    out = {}
    for name, model in (("sdpa", sdpa), ("varlen", varlen)):
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    width = packed["input_ids"].shape[1]  # the attention reduction runs over at most the whole row
    bound = forward_atol(sdpa, width, out["sdpa"][0])
    assert (out["sdpa"][0] - out["varlen"][0]).abs().max().item() <= bound
    grad_bound = backward_atol(sdpa, width, width, list(out["sdpa"][1].values()))
    for n, g in out["sdpa"][1].items():
        assert (g - out["varlen"][1][n]).abs().max().item() <= grad_bound, n


def test_varlen_leaves_padded_batches_and_generation_to_sdpa(tiny_models):
    sdpa = load_causal_lm(tiny_models["causal_lm"], attn_implementation="sdpa").eval()
    varlen = load_causal_lm(tiny_models["causal_lm"], attn_implementation="sdpa_varlen").eval()
    _, padded = packed_and_padded([7, 20, 12])
    with torch.no_grad():
        a, b = sdpa(**padded).logits, varlen(**padded).logits
        assert torch.equal(a, b)
        prompt = padded["input_ids"][1:2, :10]
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(sdpa.generate(prompt, **kwargs), varlen.generate(prompt, **kwargs))


def _per_sequence_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, gqa):
    """What torch's varlen_attn computes, written with one SDPA per sequence ([T, H, D] in and out)."""
    ends = cu_seq_q.tolist()
    assert ends == cu_seq_k.tolist() and max_q == max_k == max(b - a for a, b in zip(ends, ends[1:])) and causal
    out = [
        torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (query, key, value)), is_causal=True, scale=scale, enable_gqa=gqa
        ).transpose(0, 1)
        for a, b in zip(ends, ends[1:])
    ]
    return torch.cat(out)


def recent_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    """torch 2.13's signature: causal as window_size (-1, 0), GQA by keyword."""
    return _per_sequence_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0),
                                scale, enable_gqa)  # fmt: skip


def first_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
    """An is_causal signature without GQA (the caller repeats the kv heads)."""
    assert query.shape[1] == key.shape[1]
    return _per_sequence_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, False)


@pytest.mark.parametrize("kernel", [recent_varlen, first_varlen], ids=["window_size+gqa", "is_causal"])
def test_one_varlen_kernel_call_equals_the_per_sequence_loop(tiny_models, monkeypatch, kernel):
    """On a GPU a packed row goes to torch's varlen_attn in one call; here the call is made on CPU against a kernel
    with its documented semantics (one SDPA per sequence of cu_seq): the layouts, offsets, causal flag and GQA
    handling of both signatures give the loop's outputs and gradients (the same ops: fp32 rounding only)."""
    from open_instruct import attention

    model = load_causal_lm(tiny_models["causal_lm"], attn_implementation="sdpa_varlen")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
    packed, _ = packed_and_padded([7, 1, 30, 12])
    out, calls = {}, []

    @functools.wraps(kernel)  # its signature is what attention.py reads
    def counted(*args, **kwargs):
        calls.append(args[3].tolist())
        return kernel(*args, **kwargs)

    for name, on in (("loop", False), ("kernel", True)):
        model.zero_grad(set_to_none=True)
        monkeypatch.setattr(attention, "use_varlen_kernel", lambda query, dropout: on)
        monkeypatch.setattr(attention, "varlen_kernel", lambda: counted)
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert calls == [[0, 7, 8, 38, 50]] * model.config.num_hidden_layers  # one call per layer, the row's offsets
    width = packed["input_ids"].shape[1]
    assert (out["loop"][0] - out["kernel"][0]).abs().max().item() <= forward_atol(model, width, out["loop"][0])
    grad_bound = backward_atol(model, width, width, list(out["loop"][1].values()))
    for n, g in out["loop"][1].items():
        assert (g - out["kernel"][1][n]).abs().max().item() <= grad_bound, n
