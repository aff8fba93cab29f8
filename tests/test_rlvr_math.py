"""The PPO/GRPO math of open_instruct/rlvr_ppo.py against numbers worked out by hand (in the comments)."""

import math

import pytest
import torch

from open_instruct.data import collate_episodes
from open_instruct.models import entropy_from_logits
from open_instruct.rewards import combine_rewards
from open_instruct.rl_algorithms import (
    approx_kl,
    clipped_value_loss,
    gae_advantages,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    ppo_policy_loss,
)
from open_instruct.rollouts import derived_seed

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0
    )


def test_gae_four_tokens_by_hand():
    # gamma 0.9, lam 0.5 -> gamma*lam = 0.45. Row 0 has 4 response tokens:
    #   r = [0.1, 0, -0.2, 1.0], V = [0.4, 0.5, 0.2, 0.6], V after the last token = 0.
    #   delta_3 = 1.0 + 0.9*0   - 0.6 =  0.4
    #   delta_2 = -0.2 + 0.9*0.6 - 0.2 =  0.14
    #   delta_1 = 0   + 0.9*0.2 - 0.5 = -0.32
    #   delta_0 = 0.1 + 0.9*0.5 - 0.4 =  0.15
    #   A_3 = 0.4
    #   A_2 = 0.14 + 0.45*0.4     =  0.32
    #   A_1 = -0.32 + 0.45*0.32   = -0.176
    #   A_0 = 0.15 + 0.45*(-0.176) = 0.0708
    #   returns = A + V = [0.4708, 0.324, 0.52, 1.0]
    # Row 1 has 2 tokens then padding whose (garbage) rewards/values must not leak in:
    #   r = [0, 2], V = [1, 1]: delta_1 = 2 - 1 = 1, delta_0 = 0 + 0.9*1 - 1 = -0.1
    #   A_1 = 1, A_0 = -0.1 + 0.45*1 = 0.35; returns = [1.35, 2.0]
    rewards = T([[0.1, 0.0, -0.2, 1.0], [0.0, 2.0, 5.0, 7.0]])
    values = T([[0.4, 0.5, 0.2, 0.6], [1.0, 1.0, 9.0, 9.0]])
    mask = T([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    assert close(adv, [[0.0708, -0.176, 0.32, 0.4], [0.35, 1.0, 0, 0]])
    assert close(ret, [[0.4708, 0.324, 0.52, 1.0], [1.35, 2.0, 0, 0]])


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    # With gamma = lam = 1, A_t = (sum of rewards from t on) - V_t: Monte-Carlo return minus baseline.
    rewards = T([[0.5, -1.0, 2.0]])
    values = T([[0.3, 0.1, -0.4]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert close(ret, [[1.5, 1.0, 2.0]])
    assert close(adv, [[1.2, 0.9, 2.4]])


def test_kl_estimators():
    # logp = log 0.5, ref = log 0.25: logp - ref = log 2 = 0.693147
    #   k1 = 0.693147; k2 = 0.5 * 0.693147^2 = 0.240227
    #   k3: r = exp(ref - logp) = 0.5 -> (0.5 - 1) - log 0.5 = -0.5 + 0.693147 = 0.193147
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    assert close(kl_penalty(logp, ref, "k1"), [0.693147])
    assert close(kl_penalty(logp, ref, "k2"), [0.240227])
    assert close(kl_penalty(logp, ref, "k3"), [0.193147])
    # The other direction: logp - ref = -log 2. k1 = -0.693147 (can be negative); k2 same as before;
    #   k3: r = 2 -> (2 - 1) - log 2 = 0.306853
    assert close(kl_penalty(ref, logp, "k1"), [-0.693147])
    assert close(kl_penalty(ref, logp, "k2"), [0.240227])
    assert close(kl_penalty(ref, logp, "k3"), [0.306853])
    assert close(kl_penalty(logp, logp, "k3"), [0.0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    # Tokens sampled from p; E_p[k1] = E_p[k3] = KL(p || q). p = [0.7, 0.2, 0.1], q = [0.2, 0.5, 0.3]:
    # KL = 0.7 ln 3.5 + 0.2 ln 0.4 + 0.1 ln(1/3) = 0.876934 - 0.183258 - 0.109861 = 0.583815
    p, q = T([0.7, 0.2, 0.1]), T([0.2, 0.5, 0.3])
    exact = sum(p[i] * math.log(p[i] / q[i]) for i in range(3))
    assert abs(exact - 0.583815) < 1e-5
    for est in ("k1", "k3"):
        expectation = (p * kl_penalty(p.log(), q.log(), est)).sum()
        assert close(expectation, exact)


def test_per_token_rewards_score_on_last_token():
    # beta 0.1, kl = [[1, 2, 3], [4, 5, 6]], row 1 has 2 tokens. Scores [10, -1]:
    #   row 0: [-0.1, -0.2, -0.3 + 10] ; row 1: [-0.4, -0.5 - 1, 0]
    kl = T([[1.0, 2, 3], [4, 5, 6]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    r = per_token_rewards(T([10.0, -1.0]), kl, mask, beta=0.1)
    assert close(r, [[-0.1, -0.2, 9.7], [-0.4, -1.5, 0.0]])


def test_symmetric_ppo_clip_four_cases():
    # cliprange 0.2; ratio = exp(logp - old):
    #   ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2  (clipped: no credit past 1.2)
    #   ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5  (unclipped)
    #   ratio 1.5, A=-1: max( 1.5,  1.2) =  1.5  (unclipped: the pessimistic bound)
    #   ratio 0.5, A=-1: max( 0.5,  0.8) =  0.8  (clipped)
    old = torch.zeros(4)
    logp = T([math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5)])
    adv = T([1.0, 1.0, -1.0, -1.0])
    loss, clipped = ppo_policy_loss(logp, old, adv, 0.2, 0.2)
    assert close(loss, [-1.2, -0.5, 1.5, 0.8])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]
    # Inside the trust region the loss is -A * ratio and its gradient is -A * ratio.
    lp = T([0.1], requires_grad=True)
    loss, _ = ppo_policy_loss(lp, T([0.0]), T([2.0]), 0.2, 0.2)
    loss.sum().backward()
    assert close(lp.grad, [-2.0 * math.exp(0.1)])
    # Outside it (ratio 1.5 > 1.2 with A > 0) there is no gradient.
    lp = T([math.log(1.5)], requires_grad=True)
    ppo_policy_loss(lp, T([0.0]), T([1.0]), 0.2, 0.2)[0].sum().backward()
    assert lp.grad.item() == 0.0


def test_clipped_value_loss():
    # old V = 1, return R = 2, cliprange_value 0.2:
    #   V = 1.5: V_clip = 1.2; (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.5 * 0.64 = 0.32 (clipped branch)
    #   V = 0.9: V_clip = 0.9 (within 0.2); (0.9-2)^2 = 1.21 -> 0.605 (unclipped)
    #   V = 2.5: V_clip = 1.2; (0.5)^2 = 0.25 vs 0.64 -> 0.32 (clipped: moving past the return does not help)
    loss, clipped = clipped_value_loss(T([1.5, 0.9, 2.5]), T([1.0, 1.0, 1.0]), T([2.0, 2.0, 2.0]), 0.2)
    assert close(loss, [0.32, 0.605, 0.32])
    assert clipped.tolist() == [1.0, 0.0, 1.0]


def test_whitening_masked():
    # x = [1, 2, 3, 4] (the 100 is masked out): mean 2.5, unbiased var = (2.25+0.25+0.25+2.25)/3 = 5/3,
    # std = 1.290994 -> [-1.161895, -0.387298, 0.387298, 1.161895]
    x = T([[1.0, 2, 3], [4, 100, 100]])
    mask = T([[1.0, 1, 1], [1, 0, 0]])
    assert close(masked_mean(x, mask), 2.5)
    assert close(masked_var(x, mask), 5 / 3)
    w = masked_whiten(x, mask)
    assert close(w, [[-1.161895, -0.387298, 0.387298], [1.161895, 0.0, 0.0]])
    # Given statistics (the loop passes all-rank ones) are used as is.
    assert close(masked_whiten(x, mask, T(1.0), T(4.0)), [[0.0, 0.5, 1.0], [1.5, 0, 0]])


def test_group_advantages():
    # Group 1 scores [10, 0, 0, 10]: mean 5, sample std sqrt(4 * 25 / 3) = 5.773503 -> +-0.866025
    # Group 2 all 0: no signal, advantage 0. Group 3 [1, 0, 0, 0]: mean 0.25, std sqrt((0.5625 + 3*0.0625)/3) = 0.5
    #   -> [1.5, -0.5, -0.5, -0.5]
    scores = T([10.0, 0, 0, 10, 0, 0, 0, 0, 1, 0, 0, 0])
    adv = group_advantages(scores, 4)
    assert close(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0, 1.5, -0.5, -0.5, -0.5], tol=1e-4)
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(scores, 5)


def test_entropy_and_approx_kl():
    # Uniform over 4: H = ln 4 = 1.386294. One-hot (large margin): H ~ 0.
    # softmax([0, ln 3]) = [0.25, 0.75]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = T([[0.0, 0, 0, 0], [50.0, 0, 0, 0]])
    assert close(entropy_from_logits(logits), [1.386294, 0.0])
    assert close(entropy_from_logits(T([[0.0, math.log(3)]])), [0.562335])
    assert close(approx_kl(T([0.2, -0.1]), T([0.0, 0.0])), [0.02, 0.005])


def test_sequence_score_signs():
    # Correct (10) and stopped: 10. Not stopped, recipe penalty -10: 10 - 10 = 0. Reward model 2.0 x 0.5 adds 1.
    assert combine_rewards(10.0, True, -10.0, None, 0.0) == 10.0
    assert combine_rewards(10.0, False, -10.0, None, 0.0) == 0.0
    assert combine_rewards(0.0, False, -10.0, None, 0.0) == -10.0
    assert combine_rewards(10.0, True, -10.0, 2.0, 0.5) == 11.0


def test_collate_episodes_alignment():
    # Prompts [5, 6] and [7]; responses [8, 9, 1] and [10]. P = 2, R = 3:
    #   row 0: 5 6 | 8 9 1      row 1: pad 7 | 10 pad pad ; positions count real tokens only.
    b = collate_episodes([[5, 6], [7]], [[8, 9, 1], [10]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 8, 9, 1], [0, 7, 10, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 4] and b["position_ids"][1, 1:3].tolist() == [0, 1]
    assert b["responses"].tolist() == [[8, 9, 1], [10, 0, 0]]
    assert b["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_derived_seed_deterministic_and_distinct():
    assert derived_seed(1, 5, 0) == derived_seed(1, 5, 0)
    assert len({derived_seed(1, s, r) for s in range(20) for r in range(4)}) == 80
