"""Sampling with top-k / top-p / min-p: the trainer's log-probs of the sampled tokens (importance ratio, TIS, mismatch/,
the KL to the reference) are the truncated distribution's, renormalised over the kept support, computed in vLLM's
order (temperature, min-p, top-k, top-p) as the hf backend samples; by hand, against transformers' warpers, through
the chunked head's backward, and in a run whose mismatch/ metrics are at float precision for an identical policy
(on the code before this change they were |log kept mass|, about 0.69 at top-p 0.5)."""

import json
import math
import os

import pytest
import torch
from tolerances import chain_atol, decoder_reduction_lengths, gamma, unit_roundoff
from training_helpers import write_rl_files

from open_instruct.models import SamplingTruncation, chunked_token_scores, truncated_logits, truncation_removes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBS = torch.tensor([[0.4, 0.3, 0.2, 0.1]])  # one position, four tokens
LOGITS = PROBS.log()


def truncated_logp(truncation, token):
    return torch.log_softmax(truncated_logits(LOGITS, truncation), -1)[0, token].item()


def test_truncations_by_hand():
    u = unit_roundoff()
    tol = 16 * u  # a softmax of four values and a log: a few roundings of numbers of size ~1
    # top-p 0.5: ascending cumulative mass 0.1, 0.3, 0.6, 1.0; drop where <= 0.5 -> keep {0.4, 0.3}
    assert truncation_removes(LOGITS, SamplingTruncation(top_p=0.5)).tolist() == [[False, False, True, True]]
    assert truncated_logp(SamplingTruncation(top_p=0.5), 1) == pytest.approx(math.log(0.3 / 0.7), abs=tol)
    # top-k 3 -> {0.4, 0.3, 0.2}, renormalised by 0.9
    assert truncated_logp(SamplingTruncation(top_k=3), 0) == pytest.approx(math.log(0.4 / 0.9), abs=tol)
    # min-p 0.3: drop p < 0.3 * 0.4 = 0.12 -> {0.4, 0.3, 0.2}
    assert truncated_logp(SamplingTruncation(min_p=0.3), 2) == pytest.approx(math.log(0.2 / 0.9), abs=tol)
    # the order is vLLM's, min-p before top-p: min-p 0.3 leaves [0.444, 0.333, 0.222]; top-p 0.75 then drops the
    # ascending cumulative mass <= 0.25, i.e. 0.222 -> {0.4, 0.3}: log(3/7). transformers' own order (top-p first,
    # mass <= 0.25 of the full distribution is 0.1 only; min-p then drops nothing more) would give log(0.3 / 0.9).
    both = SamplingTruncation(top_p=0.75, min_p=0.3)
    assert truncated_logp(both, 1) == pytest.approx(math.log(3 / 7), abs=tol)
    # off: the logits as they are (the default run's numbers are untouched)
    assert truncated_logits(LOGITS, SamplingTruncation()) is LOGITS and not SamplingTruncation().active
    # a sampled token the rule drops (engine rounding at the boundary) keeps a finite log-prob
    kept = truncated_logits(LOGITS, SamplingTruncation(top_p=0.5), labels=torch.tensor([3]))
    assert torch.log_softmax(kept, -1)[0, 3].item() == pytest.approx(math.log(0.1 / 0.8), abs=tol)


@pytest.mark.parametrize(
    "truncation", [SamplingTruncation(top_p=0.5), SamplingTruncation(top_k=7, top_p=0.9, min_p=0.05)]
)
def test_the_support_is_the_hf_samplers(truncation):
    """The hf backend's warpers (HFGenerator._warpers: transformers' own, in vLLM's order) drop exactly the tokens
    truncation_removes drops, on the same tempered logits: the same ops, so the same support bit for bit."""
    from open_instruct.generation import GenerationConfig, HFGenerator

    torch.manual_seed(0)
    logits, temperature = torch.randn(64, 50) * 3, 0.7
    config = GenerationConfig(temperature=temperature, top_k=truncation.top_k, top_p=truncation.top_p,
                              min_p=truncation.min_p)  # fmt: skip
    scores = logits.clone()
    for warper in HFGenerator._warpers(config):
        scores = warper(None, scores)
    removed = truncation_removes(logits / temperature, truncation)
    assert torch.equal(torch.isinf(scores), removed) and 0 < removed.sum() < removed.numel()


def test_chunked_head_gradient_is_the_truncated_distributions():
    """The chunked head's backward (g * (onehot - p) with p the truncated, renormalised distribution, the entropy's
    term with the full one) equals autograd through masked logits, within the fp32 bound of two evaluation orders."""
    torch.manual_seed(0)
    (K, d, V), temperature = (37, 16, 50), 0.7
    truncation = SamplingTruncation(top_k=20, top_p=0.8, min_p=0.02)
    hidden = (torch.randn(K, d) * 2).requires_grad_()
    head = torch.nn.Linear(d, V, bias=False)
    labels = torch.randint(0, V, (K,))
    g_logp, g_ent = torch.randn(K), torch.randn(K)

    z = head(hidden) / temperature
    want_logp = torch.log_softmax(truncated_logits(z, truncation, labels), -1).gather(1, labels[:, None]).squeeze(1)
    want_ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    (want_logp * g_logp + want_ent * g_ent).sum().backward()
    want = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad = head.weight.grad = None

    logp, ent = chunked_token_scores(hidden, head, labels, temperature, entropy=True, chunk=8, truncation=truncation)
    (logp * g_logp + ent * g_ent).sum().backward()
    # the bound: a logit is a d-term dot product; the gradients are V- (hidden) or K-term (weight) sums of it
    z_mag = (hidden.detach().abs() @ head.weight.detach().abs().t()).max().item() / temperature
    lse_mag = torch.logsumexp(z.detach(), -1).abs().max().item()
    value_bound = 2 * (2 * gamma(d) * z_mag + gamma(V) + 4 * unit_roundoff() * (z_mag + lse_mag))
    assert (logp - want_logp).abs().max().item() <= value_bound
    assert (ent - want_ent).abs().max().item() <= value_bound
    for got, ref, n in ((hidden.grad, want[0], V), (head.weight.grad, want[1], K)):
        bound = chain_atol([d, V, V, n], ref.abs().max().item() * max(z_mag, 1.0))
        assert (got - ref).abs().max().item() <= bound
    assert (logp - want_logp).abs().max().item() < 1e-3 < (logp - z.log_softmax(-1).gather(1, labels[:, None])
                                                           .squeeze(1)).abs().max().item()  # fmt: skip


@pytest.fixture(scope="module")
def rl_files(tmp_path_factory):
    return write_rl_files(tmp_path_factory.mktemp("truncated"))


def logprob_bound(model_path, width, temperature):
    """fp32 bound on |sampler log-prob - trainer log-prob| of one token when both evaluate the same weights in two
    orders (the hf generator's KV-cached steps, the trainer's full forward): each logit z_v = <h, w_v> with h the final
    RMSNorm's output, so |z_v| <= sum|h_i w_vi| <= ||h|| ||w_v|| <= sqrt(d) max|g| max_v ||w_v|| (g: the norm's gain)
    bounds both the logits and the products they sum; the decoder's chain of reductions carries that relative error
    (chain_atol, both orders); a log-prob z_y - logsumexp over the kept support moves by twice a logit's error plus
    the V-term sum of exponentials and a few roundings of |z| and |logsumexp| <= |z| + log V."""
    from open_instruct.models import load_causal_lm

    model = load_causal_lm(model_path)
    d, w = model.config.hidden_size, model.get_output_embeddings().weight.detach()
    z_mag = math.sqrt(d) * model.model.norm.weight.detach().abs().max().item() * w.norm(dim=1).max().item()
    z_mag /= temperature
    V = w.shape[0]
    dz = chain_atol(decoder_reduction_lengths(model.config, width), z_mag)
    return 2 * dz + 2 * (gamma(V) + 4 * unit_roundoff() * (2 * z_mag + math.log(V)))


@pytest.mark.parametrize(
    "sampling,on_policy", [(["--top_p", "0.5"], False), (["--top_p", "0.5", "--top_k", "20", "--min_p", "0.05"], True)]
)
def test_mismatch_of_an_identical_policy_under_top_p_is_rounding(sampling, on_policy, tiny_models, rl_files, tmp_path):
    """learning_rate 0: the sampler (hf, fp32) and the trainer hold identical weights at every rollout, so the
    mismatch/ metrics must be rounding. Before the trainer applied the sampler's truncation, top-p 0.5 made
    mismatch/abs_mean = mean |log kept mass| ~ 0.69 on this model (the kept half of a near-uniform distribution).
    Off-policy (2 epochs, 2 mini-batches): the rollout's forward gives the old log-probs; on-policy (1 epoch of one
    mini-batch): the update's own. The KL to the reference (same weights, same truncation) is 0 as well."""
    from open_instruct import rlvr_ppo, runtime

    out, temperature = tmp_path / "out", 0.7
    batch = ["--per_device_train_batch_size", "16", "--num_epochs", "1"] if on_policy else []
    runtime.run(rlvr_ppo.main, [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
        "--dataset_name_or_path", rl_files["train"], "--eval_dataset_name_or_path", rl_files["eval"],
        "--output_dir", str(out), "--total_episodes", "32", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
        "--response_length", "8", "--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false",
        "--learning_rate", "0", "--temperature", str(temperature), "--truncated_importance_sampling", "true",
        *sampling, *batch,
    ])  # fmt: skip
    train = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    prompt_width = max(len(r["messages"][0]["content"]) for r in map(json.loads, open(rl_files["train"]))) + 32
    bound = logprob_bound(tiny_models["causal_lm"], prompt_width + 8, temperature)  # chat markup: < 32 characters
    assert bound < 0.69 / 100  # a worst case at float precision, far below comparing a truncated with a full one
    for r in train:
        assert r["mismatch/abs_max"] <= bound and r["mismatch/abs_mean"] <= bound
        assert r["mismatch/k3_kl"] <= bound**2 and r["mismatch/beyond_tis_cap"] == 0.0
        assert abs(r["train/kl"]) <= bound
