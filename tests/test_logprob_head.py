"""The output-layer log-prob head (models.add_logprob_head / chunked_token_logprobs): scoring only the labelled
positions, a chunk of tokens at a time with the logits recomputed in the backward, gives the same log-probs and the
same gradients as full logits + log-softmax."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import backward_atol, chain_atol, forward_atol, gamma

from open_instruct.models import _ChunkedTokenLogprobs, load_causal_lm, sequence_logprobs, token_logprobs

pytestmark = pytest.mark.numerics  # every test here compares numbers computed two ways


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_logprobs_and_gradients_match_full_logits(bias):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=bias).double()
    labels = torch.randint(0, 50, (37,))
    grad_out = torch.randn(37).double()  # float32 values: the float32 grad_out below is the same one, exactly

    full = F.log_softmax(head(hidden), -1).gather(1, labels[:, None]).squeeze(1)
    full.backward(grad_out)
    expected = [hidden.grad.clone(), head.weight.grad.clone(), *([head.bias.grad.clone()] if bias else [])]
    hidden.grad = head.weight.grad = None
    if bias:
        head.bias.grad = None

    # chunks of 8 rows: 5 chunks, the last one short
    chunked = _ChunkedTokenLogprobs.apply(hidden, head.weight, head.bias, labels, torch.float64, 8)
    assert chunked.dtype == torch.float32  # log-probs always come back in fp32
    # the head runs in float64, its logits are rounded to float32 (gamma_1) and log-softmaxed over 50 in float32
    scale = max(head(hidden).abs().max().item(), full.abs().max().item())
    assert (chunked.double() - full.detach()).abs().max().item() <= chain_atol([1, 50], scale)
    chunked.backward(grad_out.float())
    got = [hidden.grad, head.weight.grad, *([head.bias.grad] if bias else [])]
    for g, e in zip(got, expected):  # the backward's softmax (50) and its float32 accumulation over 16 and 37 rows
        bound = chain_atol([1, 50, 16, 37], e.abs().max().item())
        assert (g - e).abs().max().item() <= bound, ((g - e).abs().max(), bound)


def test_model_scored_logprobs_equal_full_forward(tiny_models):
    """sequence_logprobs through the patched forward (responses only reach the output layer) equals the sums of
    token_logprobs over full logits, values and weight gradients."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_models["causal_lm"])
    ids = torch.randint(5, 90, (3, 20))
    attention = torch.ones_like(ids)
    attention[2, 15:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:] = loss_mask[1, 12:] = loss_mask[2, 8:15] = 1

    sums, counts = sequence_logprobs(model, {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask})
    sums.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

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


def test_wrapped_head_logprobs_are_a_new_tensor_with_the_same_numbers():
    """An output layer of another class (FSDP2 makes lm_head an FSDPLinear; LoRA wraps it) runs its own forward. Its
    result must not be a view: returned by the FSDP root module, a view made torch warn on every step."""
    from open_instruct.models import chunked_token_logprobs

    torch.manual_seed(0)
    wrapped = type("WrappedLinear", (torch.nn.Linear,), {})(8, 11, bias=False)
    plain = torch.nn.Linear(8, 11, bias=False)
    plain.weight.data.copy_(wrapped.weight.data)
    hidden, labels = torch.randn(5, 8, requires_grad=True), torch.tensor([0, 3, 10, 7, 7])
    out = chunked_token_logprobs(hidden, wrapped, labels)
    assert out._base is None and out.shape == (5,)
    expected = F.log_softmax(hidden @ wrapped.weight.t(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    bound = chain_atol([8, 11], expected.abs().max().item())  # a hidden-8 dot product, then an 11-way logsumexp
    assert (out - expected).abs().max().item() <= bound
    assert (out - chunked_token_logprobs(hidden, plain, labels)).abs().max().item() <= bound  # the chunked path agrees


def test_value_model_returns_a_new_tensor(tiny_models):
    """TokenValueModel is an FSDP root in PPO: its per-token values must not be a view of the head's output (torch's
    FSDP2 warned about it on every step)."""
    from open_instruct.data import collate_episodes
    from open_instruct.models import TokenValueModel, load_sequence_classifier

    batch = collate_episodes([[5, 6, 7], [8, 9]], [[10, 11], [12]], pad_id=0)
    values = TokenValueModel(load_sequence_classifier(tiny_models["causal_lm"]))(batch, 2)
    assert values._base is None and values.shape == (2, 2) and values.dtype == torch.float32
