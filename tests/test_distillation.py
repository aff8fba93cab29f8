"""On-policy distillation (open_instruct/distillation.py, rlvr_ppo.py's `distill` row): the generalized JSD equals
TRL 1.16's two implementations (loss and gradients), the reverse-KL advantage is the hand formula, a teacher equal to
the student gives nothing to learn, bad teachers stop before any model loads, a run resumes bit-exactly and lowers
its KL to the teacher."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import chain_atol
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)

from open_instruct.distillation import chunked_generalized_jsd, generalized_jsd, teacher_advantages

N_ROWS, WIDTH, H_STUDENT, H_TEACHER, VOCAB = 3, 5, 8, 12, 40


def hidden_states(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "student_hidden": torch.randn(N_ROWS, WIDTH, H_STUDENT, generator=g),
        "teacher_hidden": torch.randn(N_ROWS, WIDTH, H_TEACHER, generator=g),
        "student_weight": torch.randn(VOCAB, H_STUDENT, generator=g) / 2,
        "teacher_weight": torch.randn(VOCAB, H_TEACHER, generator=g) / 2,
        "mask": torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32),
    }


def ours(x: dict[str, torch.Tensor], beta: float, temperature: float, chunk: int = 4) -> torch.Tensor:
    """Mean over the mask of chunked_generalized_jsd (the masked positions are left out, as TRL leaves them)."""
    valid = x["mask"].reshape(-1) > 0
    per_token = chunked_generalized_jsd(
        x["student_hidden"].flatten(0, 1)[valid],
        x["student_weight"],
        x["teacher_hidden"].flatten(0, 1)[valid],
        x["teacher_weight"],
        beta,
        temperature,
        chunk=chunk,
    )
    return per_token.sum() / valid.sum()


def trl_chunked(x: dict[str, torch.Tensor], beta: float, temperature: float) -> torch.Tensor:
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    loss, _, _ = _chunked_divergence_loss(
        x["student_hidden"],
        x["teacher_hidden"],
        x["student_weight"],
        x["teacher_weight"],
        x["mask"],
        beta,
        temperature=temperature,
    )
    return loss


def trl_gold(x: dict[str, torch.Tensor], beta: float, temperature: float) -> torch.Tensor:
    from trl.experimental.gold.gold_trainer import GOLDTrainer

    student_logits = x["student_hidden"] @ x["student_weight"].t()
    teacher_logits = x["teacher_hidden"] @ x["teacher_weight"].t()
    labels = torch.where(x["mask"] > 0, 0, -100)
    return GOLDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature)


def loss_and_grads(fn, x: dict[str, torch.Tensor], beta: float, temperature: float) -> list[torch.Tensor]:
    x = {k: v.clone().requires_grad_(k.startswith("student")) for k, v in x.items()}
    loss = fn(x, beta, temperature)
    loss.backward()
    return [loss.detach(), x["student_hidden"].grad, x["student_weight"].grad]


def divergence_atol(x: dict[str, torch.Tensor], temperature: float) -> float:
    """Two float32 evaluation orders of logits (dot products of H terms) and of the log-softmax / KL sums over the
    vocabulary (V terms, three reductions: logsumexp, the weighted sum, the mean over tokens) differ by at most the
    chain's gamma times the largest logit (the log-probabilities' scale); both models', hence x 2."""
    z = max(
        (x["student_hidden"] @ x["student_weight"].t()).abs().max().item(),
        (x["teacher_hidden"] @ x["teacher_weight"].t()).abs().max().item(),
    )
    return 2 * chain_atol([H_TEACHER, VOCAB, VOCAB, N_ROWS * WIDTH], z / temperature)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_loss_and_gradients_equal_trl(beta, temperature):
    x = hidden_states(0)
    mine = loss_and_grads(ours, x, beta, temperature)
    atol = divergence_atol(x, temperature)
    for reference in (trl_chunked, trl_gold):
        theirs = loss_and_grads(reference, x, beta, temperature)
        assert mine[0] > 10 * atol  # a divergence well above rounding: the comparison can fail
        torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=atol)
        for a, b in zip(mine[1:], theirs[1:]):
            # gradients: the same chain, scaled by the largest gradient entry
            torch.testing.assert_close(a, b, rtol=0, atol=atol * max(b.abs().max().item(), 1e-12) / mine[0].item())


def test_jsd_chunking_does_not_change_the_result():
    x = hidden_states(1)
    for chunk in (1, 5, 100):
        torch.testing.assert_close(ours(x, 0.5, 1.0, chunk), ours(x, 0.5, 1.0, 4), rtol=0, atol=divergence_atol(x, 1.0))


def test_jsd_top_k_is_the_divergence_of_the_renormalised_top_k():
    g = torch.Generator().manual_seed(2)
    zs, zt = torch.randn(6, VOCAB, generator=g), torch.randn(6, VOCAB, generator=g)
    k = 5
    # by hand: the teacher's 5 likeliest tokens of each row, both renormalised there, reverse KL
    index = zt.topk(k, -1).indices
    ps, pt = torch.softmax(zs.gather(1, index), -1), torch.softmax(zt.gather(1, index), -1)
    hand = (ps * (ps.log() - pt.log())).sum(-1)
    atol = chain_atol([k, k], max(zs.abs().max().item(), zt.abs().max().item()))
    torch.testing.assert_close(generalized_jsd(zs, zt, 1.0, top_k=k), hand, rtol=0, atol=atol)
    # k at the vocabulary size is the full divergence
    torch.testing.assert_close(generalized_jsd(zs, zt, 0.5, top_k=VOCAB), generalized_jsd(zs, zt, 0.5), rtol=0, atol=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_teacher_equal_to_the_student_gives_zero_loss_and_gradient(beta):
    x = hidden_states(3)
    x["teacher_hidden"], x["teacher_weight"] = x["student_hidden"].clone(), x["student_weight"].clone()
    loss, grad_hidden, grad_weight = loss_and_grads(ours, {**x}, beta, 1.0)
    atol = divergence_atol(x, 1.0)
    assert abs(loss.item()) <= atol
    assert grad_hidden.abs().max().item() <= atol and grad_weight.abs().max().item() <= atol


def test_reverse_kl_advantage_is_the_hand_formula():
    old_logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.25, -0.75, -1.5, 0.0]])
    teacher_logp = torch.tensor([[-1.5, -1.0, -0.5, -0.1], [-0.5, -0.25, -2.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # a hole (an observation) and padding
    # A_t = -(log pi_student - log pi_teacher) on the mask
    expected = torch.tensor([[-0.5, 1.0, 0.0, 2.9], [-0.25, 0.5, -0.5, 0.0]])
    torch.testing.assert_close(teacher_advantages(old_logp, teacher_logp, mask), expected, rtol=0, atol=1e-7)
    assert teacher_advantages(old_logp, old_logp.clone(), mask).abs().max().item() == 0.0
    assert math.isclose(float(generalized_jsd(torch.zeros(3), torch.zeros(3), 0.5)), 0.0, abs_tol=1e-7)
