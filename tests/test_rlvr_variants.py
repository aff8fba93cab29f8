"""The GRPO/PPO variants of open_instruct/rlvr_ppo.py: every estimator, policy loss, aggregation, filter and
correction against numbers worked by hand; the aggregations' independence of ranks and micro-batches on the real
micro-batch loss; the sampler's own log-probs; the reward-model read position when pad == eos; and a smoke run of
the script for every estimator and every loss."""

import contextlib
import json
import math
import os
import random

import pytest
import torch
from tolerances import pass_atol, rollout_width
from training_helpers import write_rl_files

from open_instruct.rewards import combine_rewards
from open_instruct.rl_algorithms import (
    Advantages,
    after_last_token,
    aggregation_weights,
    cispo_policy_loss,
    discounted_returns,
    gae_advantages,
    group_advantages,
    gspo_policy_loss,
    overlong_penalty,
    per_token_rewards,
    ppo_policy_loss,
    rloo_advantages,
    truncated_is_weights,
    zero_std_groups,
)
from open_instruct.rlvr_ppo import RLModels, Rollout, micro_batch_loss
from open_instruct.rollouts import episode_layout

T = torch.tensor
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# ---------------------------------------------------------------------------------------------------------------------
# Advantage estimators


def test_group_estimators_by_hand():
    scores = T([1.0, 0.0, 3.0, 1.0, 2.0, 2.0])  # groups of 2: [1, 0], [3, 1], [2, 2]
    # grpo: (r - mean) / (std + eps), std with n - 1: [1, 0] -> mean .5, std .7071
    assert close(group_advantages(scores, 2), [0.70711, -0.70711, 0.70711, -0.70711, 0.0, 0.0])
    # dr_grpo: r - mean only
    assert close(group_advantages(scores, 2, scale=False), [0.5, -0.5, 1.0, -1.0, 0.0, 0.0])
    # rloo with k = 3: [3, 1, 2] -> 3 - (1+2)/2 = 1.5, 1 - 2.5 = -1.5, 2 - 2 = 0
    assert close(rloo_advantages(T([3.0, 1.0, 2.0]), 3), [1.5, -1.5, 0.0])
    # k = 2: the other completion is the whole baseline
    assert close(rloo_advantages(scores, 2), [1.0, -1.0, 2.0, -2.0, 0.0, 0.0])
    # a flat group has no signal in any estimator, and the filter finds exactly it
    assert zero_std_groups(scores, 2).tolist() == [False, False, False, False, True, True]
    with pytest.raises(ValueError):
        rloo_advantages(T([1.0, 2.0, 3.0]), 2)


def test_groups_of_equal_scores_get_exactly_zero_whatever_the_values():
    """Issue 22.1. In float32 the mean of 8 copies of -0.1 (an all-wrong, all-truncated group: combine_rewards with
    non_stop_penalty -0.1) misses -0.1 by one rounding step; the old code divided that ~6e-8 by std ~6e-8 + 1e-6 and
    pushed every member up by +0.0074 (0.7 x 16: +0.056); Dr. GRPO and RLOO kept the ~6e-8 itself, and whitening
    equal values gave ~1e-4 (E[x^2] - E[x]^2) or ~1e-3 (masked_whiten). Now each is exactly 0."""
    from open_instruct.rl_algorithms import masked_whiten, whiten_over_ranks

    all_truncated = combine_rewards(0.0, False, -0.1, None, 0.0, "add")
    assert all_truncated == -0.1
    for value, k in [(all_truncated, 8), (0.7, 8), (0.7, 16), (3.3, 7), (0.7, 3)]:
        flat = torch.full((k,), value)
        assert group_advantages(flat, k).tolist() == [0.0] * k, (value, k)
        assert group_advantages(flat, k, scale=False).tolist() == [0.0] * k, (value, k)
        assert rloo_advantages(flat, k).tolist() == [0.0] * k, (value, k)
    # next to a flat group, a group with one different score keeps the std-normalised formula:
    # [0.7 x 7, 1.7]: mean 0.825, deviations -0.125 (x7) and 0.875, var (7 * 0.015625 + 0.765625) / 7 = 0.125,
    # std 0.353553: A = -0.125 / 0.353553 = -0.353553 (x7) and 0.875 / 0.353553 = 2.474874
    scores = torch.tensor([0.7] * 8 + [0.7] * 7 + [1.7])
    assert close(group_advantages(scores, 8), [0.0] * 8 + [-0.353553] * 7 + [2.474874])
    assert group_advantages(scores, 8)[:8].tolist() == [0.0] * 8
    # whitening (gae, reinforce_pp) of equal values over the batch: exactly 0 too
    x, mask = torch.full((64, 7), 0.7), torch.ones(64, 7)
    mask[:, 5:] = 0
    one_process = dict  # sum_over_ranks on one process: the sums as they are
    assert whiten_over_ranks(x, mask, one_process).abs().max().item() == 0.0
    assert masked_whiten(x, mask).abs().max().item() == 0.0
    # and a spread batch is whitened as before: [1, 2, 3] -> mean 2, unbiased var 1 -> [-1, 0, 1]
    assert close(whiten_over_ranks(T([[1.0, 2.0, 3.0]]), torch.ones(1, 3), one_process), [[-1.0, 0.0, 1.0]])


def test_reinforce_pp_returns_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9 sits on padding and must not leak
    # gamma .5: row 0 -> G2 = 1, G1 = .5, G0 = .25; row 1 -> G1 = 2, G0 = 1
    assert close(discounted_returns(rewards, mask, 0.5), [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    assert close(discounted_returns(rewards, mask, 1.0), [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


def test_overlong_penalty_by_hand():
    lengths = T([6.0, 7.0, 8.0, 10.0])  # L_max 10, buffer 4: free up to 6, then linear down to -factor at 10
    assert close(overlong_penalty(lengths, 10, 4, 1.0), [0.0, -0.25, -0.5, -1.0])
    assert close(overlong_penalty(lengths, 10, 4, 2.0), [0.0, -0.5, -1.0, -2.0])


def test_tulu3_score_placement_by_hand():
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # lengths 2 and 4 (the second ran to max_length 4)
    index, value_mask = after_last_token(mask, 4)
    assert index.tolist() == [2, 3] and value_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # One row, score 10, values 0, no KL, gamma 1, lam .95: the last real token's advantage is the score with the
    # textbook placement, lam * score with Tulu 3's (the value after the last token, 0 here, is bootstrapped):
    # the difference (1 - lam) * (V_after - score) is at most (1 - lam) * score = 0.5.
    row = T([[1.0, 1.0, 0.0]])
    scores, zeros = T([10.0]), torch.zeros(1, 3)
    ours, _ = gae_advantages(per_token_rewards(scores, zeros, row, 0.0), zeros, row, 1.0, 0.95)
    index, value_mask = after_last_token(row, 8)
    tulu, returns = gae_advantages(per_token_rewards(scores, zeros, row, 0.0, index), zeros, value_mask, 1.0, 0.95)
    assert close(ours[0, :2], [9.5, 10.0]) and close(tulu[0, :2], [9.025, 9.5])
    assert close(returns[0, 2], 10.0)  # the value there is trained towards the score


def test_non_stop_penalty_add_or_replace():
    # a right answer (10) that ran out of tokens: Tulu 3 replaces the score with the penalty, "add" sums them
    assert combine_rewards(10.0, False, -10.0, None, 0.0, "add") == 0.0
    assert combine_rewards(10.0, False, -10.0, None, 0.0, "replace") == -10.0
    assert combine_rewards(10.0, True, -10.0, None, 0.0, "replace") == 10.0  # stopped: untouched
    assert combine_rewards(0.0, False, -10.0, 2.0, 0.5, "replace") == -10.0  # the RM term is replaced too


# ---------------------------------------------------------------------------------------------------------------------
# Policy losses


def test_ppo_loss_clip_higher_and_dual_clip_by_hand():
    lp = lambda ratio: T([math.log(ratio)])  # noqa: E731
    zero = T([0.0])
    # A > 0, ratio 1.3: symmetric 0.2 clips at 1.2; clip-higher 0.28 clips at 1.28
    assert close(ppo_policy_loss(lp(1.3), zero, T([1.0]), 0.2, 0.2)[0], [-1.2])
    assert close(ppo_policy_loss(lp(1.3), zero, T([1.0]), 0.2, 0.28)[0], [-1.28])
    # A < 0, ratio 0.7: the lower clip (0.8) is the max
    loss, clipped = ppo_policy_loss(lp(0.7), zero, T([-1.0]), 0.2, 0.28)
    assert close(loss, [0.8]) and clipped.item() == 1.0
    # A < 0, ratio 5: PPO's loss is 5 (unclipped branch); dual clip c = 3 bounds it at -c * A = 3
    assert close(ppo_policy_loss(lp(5.0), zero, T([-1.0]), 0.2, 0.2)[0], [5.0])
    loss, clipped = ppo_policy_loss(lp(5.0), zero, T([-1.0]), 0.2, 0.2, dual_clip_c=3.0)
    assert close(loss, [3.0]) and clipped.item() == 1.0
    # A > 0 is untouched by the dual clip
    assert close(ppo_policy_loss(lp(5.0), zero, T([1.0]), 0.2, 0.2, dual_clip_c=3.0)[0], [-1.2])


def test_gspo_uses_the_sequence_ratio_by_hand():
    logp = T([[math.log(1.1), math.log(1.3), 5.0]], requires_grad=True)  # third token is padding
    old, mask, adv = torch.zeros(1, 3), T([[1.0, 1.0, 0.0]]), T([[1.0, 1.0, 1.0]])
    loss, clipped = gspo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
    s = math.sqrt(1.1 * 1.3)  # geometric mean of the real tokens' ratios: 1.19583 (< 1.2: not clipped)
    assert close(loss[0, :2], [-s, -s]) and clipped[0, :2].tolist() == [0.0, 0.0]
    (loss * mask).sum().backward()
    assert close(logp.grad[0, :2], [-s, -s])  # d/dlogp_t of -A * s_it = -A * s_i
    # with clip_high 0.1 the sequence is clipped at 1.1: value -1.1 and no gradient
    logp2 = logp.detach().clone().requires_grad_(True)
    loss2, clipped2 = gspo_policy_loss(logp2, old, adv, mask, 0.2, 0.1)
    (loss2 * mask).sum().backward()
    assert close(loss2[0, :2], [-1.1, -1.1]) and clipped2[0, 0].item() == 1.0 and close(logp2.grad, [[0.0, 0.0, 0.0]])


def test_gspo_applies_dual_clip_c_by_hand():
    """Issue 22.2: dual_clip_c was accepted with policy_loss gspo but token_policy_loss never passed it on.
    logp [[-1, -1]], old = logp - 1: token log-ratios 1, sequence ratio s = e = 2.71828; A = -1: PPO's max(-A s,
    -A clip(s, 0.8, 1.2)) = max(2.71828, 1.2) = 2.71828 per token; dual clip c = 1.5 bounds it at -c A = 1.5."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.rlvr_ppo import token_policy_loss

    logp = T([[-1.0, -1.0]])
    old, adv, mask = logp - 1.0, T([[-1.0, -1.0]]), T([[1.0, 1.0]])
    args = [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--algo", "grpo", "--policy_loss", "gspo"]
    without = parse_config(RLVRConfig, args)
    loss, _ = token_policy_loss(without, logp, old, adv, mask)
    assert close(loss, [[math.e, math.e]])
    cfg = parse_config(RLVRConfig, [*args, "--dual_clip_c", "1.5"])
    loss, clipped = token_policy_loss(cfg, logp, old, adv, mask)
    assert close(loss, [[1.5, 1.5]]) and clipped.tolist() == [[1.0, 1.0]]


def test_gspo_defaults_to_the_papers_sequence_mean_by_hand():
    """Issue 22.5: with loss_aggregation unset, policy_loss gspo aggregates as the GSPO paper (mean over sequences of
    their token means); ppo keeps token_mean; a loss_aggregation the user sets is used as set.
    Two sequences on the old policy (ratio 1, no clipping): row 0 has 1 token, A = +2 -> loss -2; row 1 has 3
    tokens, A = -1 -> loss +1 each.
      sequence mean: (-2 + (1 + 1 + 1) / 3) / 2 = -0.5        token mean: (-2 + 1 + 1 + 1) / 4 = 0.25
    (the old default, token_mean, gave gspo 0.25: the longer sequence weighed three times as much)."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.rlvr_ppo import token_policy_loss

    logp = T([[-0.5, 0.0, 0.0], [-0.7, -0.2, -1.3]])
    mask, adv = T([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), T([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    args = [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--algo", "grpo"]

    def loss(*extra: str) -> tuple[str, float]:
        cfg = parse_config(RLVRConfig, [*args, *extra])
        per_token, _ = token_policy_loss(cfg, logp, logp.clone(), adv, mask)
        w, units = aggregation_weights(mask, cfg.loss_aggregation, cfg.loss_norm_length)
        return cfg.loss_aggregation, float((per_token * w).sum() / units.sum())

    aggregation, value = loss("--policy_loss", "gspo")
    assert aggregation == "seq_mean_token_mean" and value == pytest.approx(-0.5, abs=1e-6)
    aggregation, value = loss("--policy_loss", "gspo", "--loss_aggregation", "token_mean")  # explicit: kept
    assert aggregation == "token_mean" and value == pytest.approx(0.25, abs=1e-6)
    aggregation, value = loss("--policy_loss", "ppo")
    assert aggregation == "token_mean" and value == pytest.approx(0.25, abs=1e-6)


def test_cispo_keeps_a_gradient_on_clipped_tokens_by_hand():
    logp = T([-0.5], requires_grad=True)
    old = T([-0.5 - math.log(1.5)])  # ratio 1.5
    loss, clipped = cispo_policy_loss(logp, old, T([2.0]), 0.2)
    assert close(loss, [1.2]) and clipped.item() == 1.0  # -min(1.5, 1.2) * 2 * (-0.5)
    loss.sum().backward()
    assert close(logp.grad, [-2.4])  # -w * A: clipped, yet not zero (PPO's clip would give 0)


def test_truncated_is_weights_by_hand():
    w = truncated_is_weights(T([math.log(3.0), math.log(0.5), 0.0]), torch.zeros(3), 2.0)
    assert close(w, [2.0, 0.5, 1.0]) and not w.requires_grad


# ---------------------------------------------------------------------------------------------------------------------
# Loss aggregation


def test_aggregations_by_hand():
    mask = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # the last row is empty
    losses = T([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]])
    expected = {
        "token_mean": (1 + 2 + 3 + 4) / 4,
        "seq_mean_token_mean": ((1 + 2 + 3) / 3 + 4) / 2,
        "seq_mean_token_sum_norm": ((1 + 2 + 3) / 4 + 4 / 4) / 2,  # C = 4
    }
    for aggregation, value in expected.items():
        w, units = aggregation_weights(mask, aggregation, 4)
        assert close((w * losses).sum() / units.sum(), value), aggregation
        assert units[2].item() == 0.0
    with pytest.raises(ValueError):
        aggregation_weights(mask, "sum", 4)


def _fake_rollout(tokenizer, n_prompts: int, group: int, seed: int) -> Rollout:
    rng = random.Random(seed)
    episodes, responses = [], []
    for p in range(n_prompts):
        prompt = tokenizer.encode(f"what is {p}+{rng.randint(0, 9)}?")
        for _ in range(group):
            episodes.append({"prompt_ids": prompt})
            responses.append(tokenizer.encode("x" * rng.randint(1, 7)))  # very different lengths
    n, width = len(responses), max(map(len, responses))
    mask = torch.zeros(n, width)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1
    g = torch.Generator().manual_seed(seed)
    noise = lambda: torch.randn(n, width, generator=g) * mask  # noqa: E731
    return Rollout(
        episodes=episodes, response_ids=responses, texts=[""] * n, stopped=[True] * n, correct=[0.0] * n,
        verifier_timeouts=0, scores=torch.zeros(n), rm_scores=torch.zeros(n), mask=mask,
        value_mask=mask, score_index=None, on_policy=False,
        old_logp=noise() * 0.1 - 2.0, sampler_logp=noise() * 0.1 - 2.0, ref_logp=noise() * 0.1 - 2.0,
        old_values=None, kl=None,
    )  # fmt: skip


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.numerics
def test_aggregation_is_independent_of_ranks_and_micro_batches(tiny_models, aggregation):
    """The real micro-batch loss: one process on all 8 rows in one micro-batch, versus 2 'ranks' of 4 rows in
    micro-batches of 2, each backpropagating sum(w * l) * world / U, gradients averaged as DDP does. With a flat
    group filtered out, GSPO, clip-higher, TIS and the KL term all on."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.models import load_causal_lm, load_tokenizer

    cfg = parse_config(RLVRConfig, [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path",
                                    tiny_models["causal_lm"], "--algo", "grpo", "--num_samples_per_prompt", "2",
                                    "--loss_aggregation", aggregation, "--loss_norm_length", "5",
                                    "--policy_loss", "gspo", "--cliprange_high", "0.28",
                                    "--truncated_importance_sampling", "true"])  # fmt: skip
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    model = load_causal_lm(tiny_models["causal_lm"])
    rollout = _fake_rollout(tokenizer, 4, 2, seed=3)
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(1)).unsqueeze(1) * rollout.mask
    keep = torch.tensor([True, True, False, False, True, True, True, True])  # group 1 dropped
    adv = Advantages(advantages, None, 0.05, keep)
    models = RLModels(policy=model)
    _, units = aggregation_weights(rollout.mask * keep.unsqueeze(1), aggregation, 5)
    total_units = float(units.sum())

    def gradients(parts: list[list[list[int]]]) -> list[torch.Tensor]:
        """parts[rank] = that rank's micro-batches; DDP averages the ranks' gradients."""
        per_rank = []
        for micro_batches in parts:
            model.zero_grad(set_to_none=True)
            for rows in micro_batches:
                loss_sum, _ = micro_batch_loss(
                    cfg, models, rollout, adv, rows, episode_layout(cfg, tokenizer.pad_token_id), "cpu",
                    contextlib.nullcontext,
                )
                (loss_sum * len(parts) / total_units).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        return [sum(g) / len(parts) for g in zip(*per_rank)]

    one = gradients([[list(range(8))]])
    two = gradients([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    width = rollout_width(rollout)
    bound = pass_atol(model.config, width, 8 * width, one)  # tests/tolerances.py
    assert max((a - b).abs().max().item() for a, b in zip(one, two)) <= bound
    assert max(a.abs().max().item() for a in one) > 100 * bound  # there is a gradient to compare


# ---------------------------------------------------------------------------------------------------------------------
# The generator's own log-probs, and where the reward model is read


def test_hf_generator_returns_the_sampled_tokens_log_probs(tiny_models):
    """logprobs[i][t] = log softmax(logits / temperature)[token] under top-p truncation: with top_p 1 it equals the
    trainer's re-scored log-probs of the same tokens (same weights, fp32) up to kernel noise."""
    from open_instruct.data import collate_episodes
    from open_instruct.generation import GenerationConfig, HFGenerator
    from open_instruct.models import load_causal_lm, load_tokenizer, response_logits, token_logprobs

    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    model = load_causal_lm(tiny_models["causal_lm"]).eval()
    prompts = [tokenizer.encode("hello"), tokenizer.encode("what is 2+2?")]
    out = HFGenerator(model, tokenizer, batch_size=8).generate(
        prompts, GenerationConfig(max_new_tokens=6, temperature=0.7, n=3, seed=5)
    )
    assert [len(lp) for lp in out.logprobs] == [len(r) for r in out.response_ids]
    batch = collate_episodes([prompts[i] for i in out.prompt_index], out.response_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        rescored = token_logprobs(response_logits(model, batch, 0.7), batch["responses"])
    for i, lp in enumerate(out.logprobs):
        assert close(rescored[i, : len(lp)], lp, tol=1e-4)
    # top-p truncation renormalises the sampler's distribution: its log-probs are >= the untruncated ones
    nucleus = HFGenerator(model, tokenizer, batch_size=8).generate(
        prompts, GenerationConfig(max_new_tokens=6, temperature=0.7, top_p=0.5, n=3, seed=5)
    )
    batch = collate_episodes([prompts[i] for i in nucleus.prompt_index], nucleus.response_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        full = token_logprobs(response_logits(model, batch, 0.7), batch["responses"])
    gaps = [lp[t] - full[i, t].item() for i, lp in enumerate(nucleus.logprobs) for t in range(len(lp))]
    assert min(gaps) > -1e-4 and max(gaps) > 1e-3


def test_reward_model_is_read_where_training_read_it_when_pad_is_eos(tiny_models):
    """With pad == eos, HF's sequence classifier pools at the last non-pad token, so a response ending in EOS is
    scored at the token before the EOS; sequence_scores must read the same place (not the EOS)."""
    from open_instruct.data import collate_episodes
    from open_instruct.models import TokenValueModel, load_sequence_classifier, load_tokenizer, sequence_scores

    tokenizer = load_tokenizer(tiny_models["seq_cls"])
    eos = tokenizer.eos_token_id
    classifier = load_sequence_classifier(tiny_models["seq_cls"]).eval()
    classifier.config.pad_token_id = eos  # a tokenizer without a pad token: load_tokenizer sets pad = eos
    prompts = [tokenizer.encode("what is 1+1?"), tokenizer.encode("hi")]
    responses = [tokenizer.encode("2") + [eos], tokenizer.encode("hello there") + [eos]]
    batch = collate_episodes(prompts, responses, eos)
    with torch.no_grad():
        ours = sequence_scores(TokenValueModel(classifier), batch)
        hf = [classifier(input_ids=torch.tensor([p + r])).logits[0, 0].item() for p, r in zip(prompts, responses)]
        at_eos = [
            classifier(input_ids=torch.tensor([p + r[:-1]])).logits[0, 0].item() for p, r in zip(prompts, responses)
        ]
    assert close(ours, hf, tol=1e-5) and close(ours, at_eos, tol=1e-5)  # HF skipped the EOS, so do we
    classifier.config.pad_token_id = eos + 1 if eos + 1 < classifier.config.vocab_size else eos - 1
    with torch.no_grad():  # a distinct pad: the EOS is a real token and is read
        hf = [classifier(input_ids=torch.tensor([p + r])).logits[0, 0].item() for p, r in zip(prompts, responses)]
        assert close(sequence_scores(TokenValueModel(classifier), batch), hf, tol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The script runs with every estimator and every loss


@pytest.fixture(scope="module")
def rl_files(tmp_path_factory):
    return write_rl_files(tmp_path_factory.mktemp("variants"))


VARIANTS = {
    "gae": ["--advantage_estimator", "gae"],
    "grpo": ["--advantage_estimator", "grpo", "--filter_zero_std_groups", "true"],
    "dr_grpo": ["--advantage_estimator", "dr_grpo", "--loss_aggregation", "seq_mean_token_sum_norm"],
    "rloo": ["--advantage_estimator", "rloo", "--loss_aggregation", "seq_mean_token_mean"],
    "reinforce_pp": ["--advantage_estimator", "reinforce_pp", "--overlong_buffer_length", "4"],
    "gspo": ["--algo", "grpo", "--policy_loss", "gspo", "--cliprange_low", "3e-4", "--cliprange_high", "4e-4"],
    "cispo": ["--algo", "grpo", "--policy_loss", "cispo", "--cliprange_high", "0.28",
              "--truncated_importance_sampling", "true"],
    "ppo_dual_clip": ["--cliprange_high", "0.28", "--dual_clip_c", "3"],
    "ppo_tulu3": ["--score_placement", "after_last_token", "--non_stop_penalty_mode", "replace"],
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_script_runs_every_estimator_and_loss(variant, tiny_models, rl_files, tmp_path):
    from open_instruct import rlvr_ppo, runtime

    out = tmp_path / "out"
    runtime.run(rlvr_ppo.main, [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
        "--dataset_name_or_path", rl_files["train"], "--eval_dataset_name_or_path", rl_files["eval"],
        "--output_dir", str(out), "--total_episodes", "32", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
        "--response_length", "8", "--eval_steps", "2", "--checkpointing_steps", "100", "--save_final_model", "false",
        *VARIANTS[variant],
    ])  # fmt: skip
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "loss/policy" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    for r in train:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert r["train/sampler_logp_abs_diff"] < 1e-3  # HF samples and trains with the same fp32 weights
    assert ("loss/value" in train[0]) == (variant in ("gae", "ppo_dual_clip", "ppo_tulu3"))
    assert ("loss/kl" in train[0]) == (variant not in ("gae", "ppo_dual_clip", "ppo_tulu3", "reinforce_pp"))
    if variant == "grpo":
        assert 0.0 <= train[0]["train/filtered_groups_fraction"] <= 1.0


def test_a_rollout_whose_groups_all_score_the_same_is_warned_and_not_trained_on(
    tiny_models, rl_files, tmp_path, capsys
):
    """No reward at all (verification_reward 0): every group has zero spread, so filter_zero_std_groups drops every
    group, every optimizer step of each rollout is empty, and each rollout prints a warning naming it."""
    from open_instruct import rlvr_ppo, runtime

    out = tmp_path / "out"
    runtime.run(rlvr_ppo.main, [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
        "--dataset_name_or_path", rl_files["train"], "--eval_dataset_name_or_path", rl_files["eval"],
        "--eval_steps", "100", "--output_dir", str(out), "--total_episodes", "32", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--response_length", "8", "--checkpointing_steps", "100",
        "--save_final_model", "false", "--advantage_estimator", "grpo", "--filter_zero_std_groups", "true",
        "--verification_reward", "0", "--non_stop_penalty", "0",
    ])  # fmt: skip
    train = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in train if "loss/policy" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    for r in train:  # 16 completions, 4 per optimizer step, 2 epochs (the recipe): 8 steps per rollout, all empty
        assert r["train/filtered_groups_fraction"] == 1.0 and r["train/empty_updates"] == 8
    printed = capsys.readouterr().out
    for step in (1, 2):
        assert f"warning: rollout {step}: every group's completions scored the same" in printed


@pytest.mark.parametrize("on_policy", [False, True])
def test_dropped_groups_get_no_forward_and_leave_the_update_as_it_was(
    tiny_models, rl_files, tmp_path, monkeypatch, on_policy
):
    """filter_zero_std_groups: a dropped group's rows weigh 0 in every loss term, so the update runs no forward or
    backward for them. With micro-batches of one whole group each, the run that skips them and one that forwards
    every row (as before) log the same losses and train bit-identical weights (adding no zero-weighted gradient
    changes no float), while the skipping run forwards exactly the kept rows. Both runs have a reference (beta > 0).
    Off-policy (2 epochs) the logged KL of the sampling policy comes from the rollout's own forwards, the same in both;
    on-policy (1 epoch) it comes from the update's, so the skipping run logs the mean over the kept rows."""
    from safetensors.torch import load_file

    from open_instruct import rlvr_ppo, rollouts, runtime

    loss_of_rows, reference_of_rows = rlvr_ppo.micro_batch_loss, rollouts.reference_scores

    def run(name, skip):
        forwarded = {"kept": 0, "dropped": 0, "kept_kl": [], "kept_rows": [], "reference": 0}

        def reference_counted(models, batch, *args):
            forwarded["reference"] += batch["responses"].shape[0]
            return reference_of_rows(models, batch, *args)

        def counted(cfg, models, rollout, adv, rows, *args, **kwargs):
            kept = int(adv.keep[rows].sum())
            forwarded["kept"] += kept
            forwarded["dropped"] += len(rows) - kept
            loss_sum, stats = loss_of_rows(cfg, models, rollout, adv, rows, *args, **kwargs)
            if kept:  # one whole group per micro-batch: kept or dropped entirely
                forwarded["kept_kl"].append(float(stats["kl_sum"]))
                forwarded["kept_rows"].append(kept)
            return loss_sum, stats

        with monkeypatch.context() as m:
            m.setattr(rlvr_ppo, "micro_batch_loss", counted)
            m.setattr(rollouts, "reference_scores", reference_counted)
            if not skip:
                m.setattr(rlvr_ppo, "skips_dropped_rows", lambda cfg: False)
            out = tmp_path / name
            runtime.run(rlvr_ppo.main, [
                os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
                "--dataset_name_or_path", rl_files["train"], "--output_dir", str(out), "--total_episodes", "64",
                "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "4", "--per_device_train_batch_size",
                "4", "--gradient_accumulation_steps", "4", "--response_length", "8", "--checkpointing_steps", "100",
                "--eval_dataset_name_or_path", rl_files["eval"], "--eval_steps", "100", "--algo", "grpo",
                "--filter_zero_std_groups", "true", "--beta", "0.1", "--kl_estimator", "k3",
                "--num_epochs", "1" if on_policy else "2",
            ])  # fmt: skip
        rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "loss/policy" in line]
        final = out / "final_model"
        weights = {
            k: v for f in os.listdir(final) if f.endswith(".safetensors") for k, v in load_file(final / f).items()
        }
        return forwarded, rows, weights

    skipped, every_row = run("skip", True), run("every_row", False)
    print(f"forwarded rows, skipping dropped groups: {skipped[0]['kept']} kept, {skipped[0]['dropped']} dropped; "
          f"every row: {every_row[0]['kept']} kept, {every_row[0]['dropped']} dropped")  # fmt: skip
    assert skipped[0]["dropped"] == 0 and skipped[0]["kept"] == every_row[0]["kept"] > 0
    assert every_row[0]["dropped"] > 0  # some groups were dropped: the comparison means something
    assert len(skipped[1]) == len(every_row[1]) == 4
    for a, b in zip(skipped[1], every_row[1]):
        for key in ("train/score_mean", "loss/policy", "loss/kl", "train/grad_norm", "train/entropy", "train/approx_kl",
                    "train/filtered_groups_fraction"):  # fmt: skip
            assert a[key] == b[key], (a["rollout_step"], key, a[key], b[key])
    assert skipped[2].keys() == every_row[2].keys()
    assert all(torch.equal(skipped[2][k], every_row[2][k]) for k in skipped[2])
    # the reference scores every row, except on-policy when skipping: then only the kept ones (the KL term's rows)
    assert every_row[0]["reference"] == 64  # 4 rollouts of 16
    assert skipped[0]["reference"] == (skipped[0]["kept"] if on_policy else 64)
    if on_policy:  # the KL metric: the kept rows' sum (the same forwards in both runs) over the kept rows
        assert skipped[0]["kept_kl"] == every_row[0]["kept_kl"] and any(x != 0 for x in skipped[0]["kept_kl"])
        # the 4 rollouts' kept groups in order, one micro-batch each, as the rows of metrics.jsonl
        kl_by_rollout, rows_by_rollout, i = [], [], 0
        for a in skipped[1]:
            groups = round((1 - a["train/filtered_groups_fraction"]) * 4)
            kl_by_rollout.append(sum(skipped[0]["kept_kl"][i : i + groups]))
            rows_by_rollout.append(sum(skipped[0]["kept_rows"][i : i + groups]))
            i += groups
        for a, kl, n in zip(skipped[1], kl_by_rollout, rows_by_rollout):
            # float32 sums of a few dozen per-token terms, then float64 division: a relative rounding tolerance
            assert a["train/kl"] == pytest.approx(kl / max(n, 1), rel=1e-6, abs=1e-9), (a["rollout_step"], kl, n)
    else:
        assert all(a["train/kl"] == b["train/kl"] > 0 for a, b in zip(skipped[1][1:], every_row[1][1:]))


def test_a_rank_with_fewer_kept_rows_runs_dummies_up_to_the_most(monkeypatch):
    """After the filter, ranks hold different numbers of rows; each runs as many micro-batches as the rank with the
    most (FSDP forwards are collectives): its own, then dummies (weight 0), a one-row spare when it kept none.
    Without a filter, padded micro-batches of equal item counts need no collective."""
    from types import SimpleNamespace

    from open_instruct import distributed

    cfg = SimpleNamespace(per_device_train_batch_size=4, max_tokens_per_micro_batch=None)
    two_ranks = SimpleNamespace(num_processes=2)
    monkeypatch.setattr(distributed, "global_max", lambda accelerator, value: max(value, 3))  # the other rank: 3
    assert distributed.step_micro_batches(two_ranks, [], [], cfg, spare=7) == [([7], False)] * 3
    assert distributed.step_micro_batches(two_ranks, [1, 2, 3, 4, 5], [9] * 5, cfg, spare=1) == [
        ([1, 2, 3, 4], True), ([5], True), ([1, 2, 3, 4], False),
    ]  # fmt: skip

    def no_collective(accelerator, value):
        raise AssertionError("padded micro-batches of an unfiltered step asked the other ranks")

    monkeypatch.setattr(distributed, "global_max", no_collective)
    assert distributed.step_micro_batches(two_ranks, list(range(8)), [9] * 8, cfg) == [
        ([0, 1, 2, 3], True), ([4, 5, 6, 7], True),
    ]  # fmt: skip


def test_a_new_estimator_and_policy_loss_registered_from_a_test_file(tiny_models, rl_files, tmp_path):
    """A forker's variant, one function + one table row each, written here (no library edit): the config accepts the
    names, the script dispatches to them, and the logged numbers are the hand-worked ones. Advantage 1 on every real
    token; loss -A * ratio with every token marked clipped. One epoch in one mini-batch trains on the weights that
    sampled, so ratio = exp(logp - sg[logp]) = 1: loss/policy = token mean of -1 = -1, clipfrac/policy = 1."""
    from open_instruct import rlvr_ppo, runtime
    from open_instruct.rl_algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, advantage_estimator, policy_loss

    calls = {"estimator": 0, "loss": 0}

    @advantage_estimator("all_ones", uses_groups=False, kl_in_reward=False)
    def all_ones(x):
        calls["estimator"] += 1
        return Advantages(x.mask.clone(), None, 0.0, torch.ones(len(x.scores), dtype=torch.bool))

    @policy_loss("unclipped_ratio", takes_dual_clip=False)
    def unclipped_ratio(x):
        calls["loss"] += 1
        ratio = torch.exp(x.logp - x.old_logp)
        return -x.advantages * ratio, torch.ones_like(ratio)

    out = tmp_path / "out"
    try:
        runtime.run(rlvr_ppo.main, [
            os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
            "--dataset_name_or_path", rl_files["train"], "--eval_dataset_name_or_path", rl_files["eval"],
            "--output_dir", str(out), "--total_episodes", "16",
            "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "1", "--num_epochs", "1", "--response_length", "6", "--beta", "0",
            "--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false",
            "--advantage_estimator", "all_ones", "--policy_loss", "unclipped_ratio",
        ])  # fmt: skip
    finally:
        del ADVANTAGE_ESTIMATORS["all_ones"], POLICY_LOSSES["unclipped_ratio"]
    train = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in train if "loss/policy" in r]
    # one call each on the start's probe batch (a user function's return checked before the model loads), one a rollout
    assert [r["rollout_step"] for r in train] == [1, 2] and calls == {"estimator": 3, "loss": 3}
    for r in train:
        assert r["loss/policy"] == pytest.approx(-1.0, abs=1e-6)
        assert r["clipfrac/policy"] == pytest.approx(1.0, abs=1e-6)
        assert "loss/value" not in r  # the row's traits: no value model


def test_resume_layout_tells_apart_what_the_saved_state_holds():
    """A value model exists only with gae and the parameters are adapters only with LoRA: resuming across either
    change is refused before any model loads (a checkpoint from before these knobs reads as their defaults)."""
    from open_instruct.checkpoint import resume_layout

    base = {"script": "rlvr_ppo", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "seed": 1,
            "local_rollout_batch_size": 4, "num_samples_per_prompt": 2, "num_epochs": 1, "algo": "grpo"}  # fmt: skip
    old = resume_layout(base, 1)
    assert old["advantage_estimator"][0] == "grpo" and old["use_lora"][0] is False
    assert resume_layout({**base, "advantage_estimator": "grpo", "use_lora": False}, 1) == old
    assert resume_layout({**base, "advantage_estimator": "gae"}, 1)["advantage_estimator"][0] == "gae"
    lora = resume_layout({**base, "use_lora": True, "lora_rank": 8, "lora_target_modules": None}, 1)
    assert lora["use_lora"][0] is True and lora["lora_rank"][0] == 8
    assert resume_layout({**base, "use_lora": True, "lora_rank": 16, "lora_target_modules": None}, 1) != lora
