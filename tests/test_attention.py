"""attn_implementation "sdpa_varlen" (open_instruct/attention.py): a packed row attended one sequence at a time gives
the same outputs and gradients as transformers' sdpa with its block-diagonal mask; padded batches and generation go
through sdpa unchanged."""

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
