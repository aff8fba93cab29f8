"""attn_implementation "sdpa_varlen" (open_instruct/attention.py): a packed row attended one sequence at a time gives
the same outputs and gradients as transformers' sdpa with its block-diagonal mask; padded batches and generation go
through sdpa unchanged."""

import functools
import math
import os

import pytest
import torch
from tolerances import backward_atol, forward_atol

from open_instruct import data
from open_instruct.models import load_causal_lm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        monkeypatch.setattr(attention, "varlen_kernel_dtype", lambda query, key, value: query.dtype)  # fp32 here
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


def torch_2_11_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                           window_size=(-1, -1)):  # fmt: skip
    """torch 2.11's `varlen_attn` signature, refusing what flash attention refuses on a GPU: a dtype other than
    fp16/bf16, q, k and v in different dtypes, offsets other than int32, a last dimension that is not contiguous.
    It has no autocast rule (neither has the real one): it computes in the dtype it is given."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"FlashAttention only supports fp16 and bf16: {name} is {t.dtype}")
        if t.stride(-1) != 1:
            raise RuntimeError(f"FlashAttention needs a contiguous last dimension: {name}")
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(f"FlashAttention needs one dtype: q {query.dtype}, k {key.dtype}, v {value.dtype}")
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError(f"cu_seqlens must be int32: {cu_seq_q.dtype}, {cu_seq_k.dtype}")
    gqa = query.shape[1] != key.shape[1]
    out = _per_sequence_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0),
                               scale, gqa)  # fmt: skip
    assert out.dtype == query.dtype
    return out


# (policy weights' dtype, mixed_precision): what the attention function is handed in each precision setting
PRECISION_SETTINGS = {
    "bf16_weights": (torch.bfloat16, "no"),  # FSDP2's mixed precision: every parameter computed in bf16
    "bf16_weights_autocast": (torch.bfloat16, "bf16"),
    "fp32_weights_autocast": (torch.float32, "bf16"),  # one process or DDP under bf16: q, k fp32 beside a bf16 v
    "fp32": (torch.float32, "no"),  # flash attention refuses fp32: the per-sequence loop
}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("setting", list(PRECISION_SETTINGS))
def test_sft_runs_with_a_flash_like_varlen_kernel_in_every_precision_setting(tiny_models, tmp_path, monkeypatch,
                                                                             setting, packed):  # fmt: skip
    """The real sft.py with torch 2.11's varlen_attn replaced by a stand-in that enforces flash attention's checks,
    and the kernel's device condition widened to this CPU: every precision setting trains with finite losses; a
    packed row reaches the kernel in bf16 (q, k and v alike) where the setting computes in bf16, and the loop in
    fp32; a padded batch never reaches it."""
    from accelerate.state import AcceleratorState
    from training_helpers import read_metrics

    from demo.synthetic import sft_rows, write_jsonl
    from open_instruct import attention, models, sft

    weights_dtype, precision = PRECISION_SETTINGS[setting]
    calls = []

    @functools.wraps(torch_2_11_varlen_attn)  # its signature is what attention.py reads
    def kernel(*args, **kwargs):
        calls.append(tuple(t.dtype for t in args[:3]))
        return torch_2_11_varlen_attn(*args, **kwargs)

    load_policy = models.load_policy
    monkeypatch.setattr(models, "load_policy", lambda cfg: load_policy(cfg).to(weights_dtype))
    monkeypatch.setattr(attention, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(attention, "varlen_kernel", lambda: kernel)
    train = write_jsonl(str(tmp_path / "sft_train.jsonl"), sft_rows(16, 0))
    out = tmp_path / "out"
    args = [os.path.join(REPO, "configs", "sft_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"]]
    args += ["--dataset_name_or_path", train, "--eval_dataset_name_or_path", train, "--output_dir", str(out)]
    args += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--logging_steps", "1"]
    args += ["--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false"]
    args += ["--mixed_precision", precision, "--max_eval_samples", "4"]
    if packed:
        args += ["--max_tokens_per_micro_batch", "512"]
    AcceleratorState._reset_state()
    try:
        sft.main(args)
    finally:
        AcceleratorState._reset_state()
    losses = [r["train/loss"] for r in read_metrics(str(out)) if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    if packed and setting != "fp32":
        assert calls and set(calls) == {(torch.bfloat16,) * 3}, set(calls)
    else:
        assert calls == []
