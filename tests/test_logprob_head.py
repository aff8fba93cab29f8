"""The chunked log-prob head (models.chunked_token_scores, used by every script through the model's `token_scoring`
forward): the log-probs and entropies of the scored positions, a chunk of tokens at a time with the logits recomputed
in the backward, equal the full-logit computation (values and gradients), and the full [tokens, vocab] logits never
exist (measured below). tests/test_fsdp.py checks the same under FSDP2, where the output layer is its own unit."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from tolerances import backward_atol, chain_atol, forward_atol, gamma, unit_roundoff
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from open_instruct import models
from open_instruct.data import collate_episodes
from open_instruct.models import (
    chunked_token_scores,
    entropy_from_logits,
    load_causal_lm,
    response_logits,
    response_scores,
    sequence_logprobs,
    token_logprobs,
    with_scored_index,
)

pytestmark = pytest.mark.numerics  # every test here compares numbers computed two ways


def full_scores(hidden, weight, bias, labels, temperature):
    """The reference: full [K, V] logits, log_softmax and the entropy formula."""
    logits = F.linear(hidden, weight, bias) / temperature
    return F.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1), entropy_from_logits(logits)


def head_bounds(hidden, weight, bias, labels, temperature, g_logp, g_ent):
    """Worst-case differences between two evaluation orders in fp32 (tests/tolerances.py), (values, grad of hidden,
    grad of weight). A logit is a d+1-term dot product: error dz <= gamma_{d+1} * max sum|h w| (z_mag). A log-prob
    z_y - logsumexp(z) moves by at most 2 dz, plus gamma_V (the relative error of the V-term sum of exponentials is an
    absolute one after the log), plus a few roundings of numbers of size |z| and |logsumexp| (exp, log, subtraction);
    the entropy logsumexp - sum(p z) adds the same again through its V-term sum. A gradient is a V-term (hidden) or
    K-term (weight) sum of the logit gradient G times the other factor, with G carrying the values' error: a chain."""
    h, w = hidden.double(), weight.double()
    b = torch.zeros(len(w), dtype=torch.float64) if bias is None else bias.double()
    (K, d), V = h.shape, len(w)
    z = (h @ w.t() + b) / temperature
    p = torch.softmax(z, -1)
    z_mag = ((h.abs() @ w.abs().t() + b.abs()) / temperature).max().item()
    u, lse_mag = unit_roundoff(), torch.logsumexp(z, -1).abs().max().item()
    value_bound = 2 * (2 * gamma(d + 1) * z_mag + gamma(V) + 4 * u * (z_mag + lse_mag))
    onehot = F.one_hot(labels, V).double()
    ez = (p * z).sum(-1, keepdim=True)
    g_abs = g_logp.double().abs()[:, None] * (onehot + p) + g_ent.double().abs()[:, None] * p * (z.abs() + ez.abs())
    g_abs = g_abs / temperature
    grad_h_bound = chain_atol([d + 1, V, V, V], (g_abs @ w.abs()).max().item())
    grad_w_bound = chain_atol([d + 1, V, V, K], (g_abs.t() @ h.abs()).max().item())
    return value_bound, grad_h_bound, grad_w_bound


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_scores_and_gradients_match_full_logits(bias, temperature):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=bias)
    labels = torch.randint(0, 50, (37,))
    g_logp, g_ent = torch.randn(37), torch.randn(37)

    want_logp, want_ent = full_scores(hidden, head.weight, head.bias, labels, temperature)
    (want_logp * g_logp + want_ent * g_ent).sum().backward()
    want_grads = [hidden.grad.clone(), head.weight.grad.clone(), *([head.bias.grad.clone()] if bias else [])]
    for t in (hidden, *head.parameters()):
        t.grad = None

    # chunks of 8 rows: 5 chunks, the last one short
    logp, ent = chunked_token_scores(hidden, head, labels, temperature, entropy=True, chunk=8)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (37,)
    (logp * g_logp + ent * g_ent).sum().backward()
    grads = [hidden.grad, head.weight.grad, *([head.bias.grad] if bias else [])]

    value_bound, grad_h_bound, grad_w_bound = head_bounds(
        hidden.detach(), head.weight.detach(), head.bias, labels, temperature, g_logp, g_ent
    )
    print(f"bounds {value_bound:.2e} (values), {grad_h_bound:.2e}, {grad_w_bound:.2e} (gradients); differences "
          f"{(logp - want_logp).abs().max():.2e}, {(ent - want_ent).abs().max():.2e}, "
          f"{(grads[0] - want_grads[0]).abs().max():.2e}, {(grads[1] - want_grads[1]).abs().max():.2e}")  # fmt: skip
    assert (logp - want_logp).abs().max() <= value_bound
    assert (ent - want_ent).abs().max() <= value_bound
    for got, want, bound in zip(grads, want_grads, [grad_h_bound, grad_w_bound, grad_w_bound]):
        assert (got - want).abs().max() <= bound, ((got - want).abs().max(), bound)


def test_without_entropy_the_head_returns_none_and_only_logp_gradients():
    torch.manual_seed(1)
    hidden = torch.randn(9, 8, requires_grad=True)
    head, labels = torch.nn.Linear(8, 11, bias=False), torch.randint(0, 11, (9,))
    logp, ent = chunked_token_scores(hidden, head, labels, 1.0, entropy=False, chunk=4)
    assert ent is None
    logp.sum().backward()
    want = full_scores(hidden, head.weight, None, labels, 1.0)[0]
    got_grad = hidden.grad.clone()
    hidden.grad = None
    want.sum().backward()
    bound = head_bounds(hidden.detach(), head.weight.detach(), None, labels, 1.0, torch.ones(9), torch.zeros(9))
    assert (logp - want).abs().max() <= bound[0] and (got_grad - hidden.grad).abs().max() <= bound[1]


def test_model_scored_logprobs_equal_full_forward(tiny_models):
    """sequence_logprobs through the patched forward (responses only reach the output layer) equals the sums of
    token_logprobs over full logits, values and weight gradients; the scored positions found on the host
    (with_scored_index) give the same numbers as those found on the device."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_models["causal_lm"])
    ids = torch.randint(5, 90, (3, 20))
    attention = torch.ones_like(ids)
    attention[2, 15:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:] = loss_mask[1, 12:] = loss_mask[2, 8:15] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}

    sums, counts = sequence_logprobs(model, batch)
    sums.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert torch.equal(sequence_logprobs(model, with_scored_index(batch))[0], sums.detach())

    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    per_token = token_logprobs(logits, ids[:, 1:]) * loss_mask[:, 1:]
    per_token.sum().backward()
    # a sum of up to 19 log-probs, each within twice its logits' bound, added up in another order
    logit_bound = forward_atol(model, ids.shape[1], logits)
    sum_bound = 19 * 2 * logit_bound + 2 * gamma(19) * per_token.abs().sum(-1).max().item()
    assert (sums - per_token.sum(-1)).abs().max().item() <= sum_bound
    assert counts.tolist() == [15, 8, 7]
    grad_bound = backward_atol(model, ids.shape[1], ids.numel(), [p.grad for p in model.parameters()])
    for n, p in model.named_parameters():
        assert (got[n] - p.grad).abs().max().item() <= grad_bound, n


def episodes():
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    responses = [[12, 13, 14], [15, 16], [17], [18, 19, 20]]
    return prompts, responses


@pytest.mark.parametrize("layout", ["padded", "shared_prompt", "packed"])
def test_rl_response_scores_equal_full_logits(tiny_models, layout):
    """RL's log-probs and entropies at temperature 0.7 (response_scores) equal token_logprobs / entropy_from_logits of
    the full [B, R, V] logits (response_logits), with the same gradients, in each of the RL forward layouts."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_models["causal_lm"])
    batch = collate_episodes(*episodes(), pad_id=0, packed=layout == "packed")
    group = 2 if layout == "shared_prompt" else 1
    weights = torch.randn(4, 3), torch.randn(4, 3)

    logits = response_logits(model, batch, 0.7, group)
    want_logp, want_ent = token_logprobs(logits, batch["responses"]), entropy_from_logits(logits)
    (want_logp * weights[0] + want_ent * weights[1]).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    scores = response_scores(model, batch, 0.7, group, entropy=True)
    (scores.logp * weights[0] + scores.entropy * weights[1]).sum().backward()
    bound = forward_atol(model, batch["input_ids"].shape[1], logits) * 2  # logp and entropy: two logit-sized terms
    assert scores.logp.shape == scores.entropy.shape == (4, 3)
    assert (scores.logp - want_logp).abs().max() <= bound and (scores.entropy - want_ent).abs().max() <= bound
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want_grads[n], atol=1e-5), n


def test_wrapped_head_scores_are_new_tensors_with_the_same_numbers():
    """An output layer of another class (LoRA wraps it) runs its own forward per chunk under activation checkpointing.
    Its result must not be a view: returned by an FSDP root module, a view made torch warn on every step."""
    torch.manual_seed(0)
    wrapped = type("WrappedLinear", (torch.nn.Linear,), {})(8, 11, bias=False)
    plain = torch.nn.Linear(8, 11, bias=False)
    plain.weight.data.copy_(wrapped.weight.data)
    hidden, labels = torch.randn(5, 8, requires_grad=True), torch.tensor([0, 3, 10, 7, 7])
    logp, ent = chunked_token_scores(hidden, wrapped, labels, 0.7, entropy=True, chunk=2)
    assert logp._base is None and ent._base is None and logp.shape == (5,)
    want_logp, want_ent = full_scores(hidden, wrapped.weight, None, labels, 0.7)
    bound = head_bounds(hidden.detach(), wrapped.weight.detach(), None, labels, 0.7, torch.ones(5), torch.ones(5))
    assert (logp - want_logp).abs().max() <= bound[0] and (ent - want_ent).abs().max() <= bound[0]
    (logp + ent).sum().backward()
    got = wrapped.weight.grad.clone()
    (want_logp + want_ent).sum().backward()
    assert (got - wrapped.weight.grad / 2).abs().max() <= bound[2]  # the reference backward added to the same .grad


def test_value_model_returns_a_new_tensor(tiny_models):
    """TokenValueModel is an FSDP root in PPO: its per-token values must not be a view of the head's output (torch's
    FSDP2 warned about it on every step)."""
    from open_instruct.models import TokenValueModel, load_sequence_classifier

    batch = collate_episodes([[5, 6, 7], [8, 9]], [[10, 11], [12]], pad_id=0)
    values = TokenValueModel(load_sequence_classifier(tiny_models["causal_lm"]))(batch, 2)
    assert values._base is None and values.shape == (2, 2) and values.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Memory, measured without a device allocator: every tensor an op creates (forward and backward) is seen by a
# dispatch mode, and every tensor autograd keeps for the backward by saved_tensors_hooks. Deterministic: the same
# shapes on any machine.


def new_tensors(args, kwargs, out) -> list[torch.Tensor]:
    """The outputs of an op that are new memory (not views of, or written into, one of its inputs)."""
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return [t for t in outs if t.untyped_storage().data_ptr() not in inputs]


class TensorSizes(TorchDispatchMode):
    """The bytes of the largest tensor any op creates while active, and the most bytes of op outputs alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.live, self.peak = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in new_tensors(args, kwargs, out):
            size = t.numel() * t.element_size()
            self.largest = max(self.largest, size)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, size)
        return out

    def _freed(self, size: int) -> None:
        self.live -= size


def measure(step) -> tuple[int, int]:
    """(largest tensor created, bytes saved for the backward) over step() (a forward and its backward)."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    sizes = TensorSizes()
    with sizes, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sizes.largest, sum(saved.values())


def test_chunked_head_never_creates_or_keeps_the_full_logits():
    """4096 tokens x 8192 vocabulary (full fp32 logits: 128 MiB), chunks of 256 tokens: the largest tensor the
    chunked head creates, forward and backward, is one chunk's logits (8 MiB), and what it keeps for the backward is
    the hidden states, the weight and the labels; the full-logit computation creates and keeps [4096, 8192]."""
    torch.manual_seed(0)
    K, d, V, chunk = 4096, 16, 8192, 256
    hidden = torch.randn(K, d, requires_grad=True)
    head = torch.nn.Linear(d, V, bias=False)
    labels = torch.randint(0, V, (K,))
    full_logits_bytes, chunk_bytes = K * V * 4, chunk * V * 4

    def chunked():
        logp, ent = chunked_token_scores(hidden, head, labels, 0.7, entropy=True, chunk=chunk)
        (logp + ent).sum().backward()

    def full():
        logp, ent = full_scores(hidden, head.weight, None, labels, 0.7)
        (logp + ent).sum().backward()

    largest_chunked, saved_chunked = measure(chunked)
    largest_full, saved_full = measure(full)
    print(f"largest tensor: chunked {largest_chunked / 2**20:.1f} MiB, full {largest_full / 2**20:.1f} MiB; saved for "
          f"backward: chunked {saved_chunked / 2**20:.2f} MiB, full {saved_full / 2**20:.1f} MiB")  # fmt: skip
    assert largest_chunked == chunk_bytes and largest_full >= full_logits_bytes
    assert saved_chunked == hidden.numel() * 4 + head.weight.numel() * 4 + labels.numel() * 8
    assert saved_full >= 2 * full_logits_bytes  # e.g. the logits and the softmax


def test_rl_and_sft_forwards_through_the_model_create_no_full_logits(tiny_models, monkeypatch):
    """Through the model, forward and backward: with chunks of 2 tokens, no tensor with more than 2 rows of vocabulary
    width exists in RL's response_scores (log-probs and entropy, the layout of every RL forward) or in SFT/DPO's
    sequence_logprobs; the full-logit path (response_logits) makes [B, R, V]."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_models["causal_lm"])
    vocab = model.config.vocab_size
    monkeypatch.setattr(models, "LOGPROB_CHUNK_TOKENS", 2)
    batch = collate_episodes(*episodes(), pad_id=0)
    sft_batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    sft_batch["loss_mask"] = batch["attention_mask"]

    class VocabRows(TorchDispatchMode):  # rows of the largest [..., vocab] tensor made (new memory, not a view)
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in new_tensors(args, kwargs, out):
                if t.dim() and t.shape[-1] == vocab:
                    self.rows = max(self.rows, t.numel() // vocab)
            return out

    def rows_of(step) -> int:
        with VocabRows() as mode:
            step()
        model.zero_grad()
        return mode.rows

    def rl():
        s = response_scores(model, batch, 0.7, entropy=True)
        (s.logp.sum() + s.entropy.sum()).backward()

    assert rows_of(rl) <= 2
    assert rows_of(lambda: sequence_logprobs(model, sft_batch)[0].sum().backward()) <= 2
    assert rows_of(lambda: token_logprobs(response_logits(model, batch, 0.7), batch["responses"]).sum().backward()) >= (
        4 * 3
    )
