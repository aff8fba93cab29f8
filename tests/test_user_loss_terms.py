"""Loss terms and rollout filters from the user's own file (issue 68): `LossInputs` carries the policy's per-token
entropy (with gradient), the loss mask and the reference's log-probs, so an entropy bonus or a length penalty is a
policy loss of a few lines in a file named by path (`--policy_loss file.py:entropy_bonus`), checked here against
entropies worked by hand; and an estimator that drops rows through `Advantages.keep` sees its dropped share logged
(`train/filtered_fraction`)."""

import contextlib
import json
import math
import os

import pytest
import torch

from open_instruct import rl_algorithms
from open_instruct.config import RLVRConfig, parse_config
from open_instruct.rl_algorithms import Advantages, LossInputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "rlvr_tiny.yaml")
FP32_EPS = 2.0**-23

USER_FILE = """
import torch
from open_instruct.rl_algorithms import AdvantageInputs, Advantages, LossInputs, advantage_estimator, grpo, ppo

SEEN = {}


def entropy_bonus(x: LossInputs, entropy_coef=0.01):
    \"\"\"PPO's clipped loss minus entropy_coef x the policy's entropy, per token (aggregated like the loss).\"\"\"
    SEEN["entropy"], SEEN["requires_grad"] = x.entropy.detach().clone(), x.entropy.requires_grad
    loss, clipped = ppo(x)
    return loss - entropy_coef * x.entropy, clipped


def length_penalty(x: LossInputs, per_token=0.001):
    \"\"\"PPO's loss plus per_token x the response's length on each of its tokens.\"\"\"
    loss, clipped = ppo(x)
    return loss + per_token * x.mask.sum(1, keepdim=True), clipped


@advantage_estimator("drop_odd_groups", uses_groups=True)
def drop_odd_groups(x: AdvantageInputs) -> Advantages:
    \"\"\"GRPO's advantages, the update keeping only the even-numbered prompts' groups.\"\"\"
    adv = grpo(x)
    adv.keep = (torch.arange(len(x.scores)) // x.group_size) % 2 == 0
    return adv
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_terms.py"
    path.write_text(USER_FILE)
    yield str(path)
    for table, _, _ in rl_algorithms.TABLES.values():  # the rows the specs registered
        for name in [n for n in table if str(path) in n or n == "drop_odd_groups"]:
            del table[name]


def test_entropy_bonus_from_a_file_on_hand_worked_entropies(user_file):
    """Logits (0, ln 3) over two tokens: p = (1/4, 3/4), H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3; logits
    (0, 0): H = ln 2. On-policy (ratio 1) PPO's loss is -A, so the term's per-token loss is -A - coef x H."""
    from open_instruct.models import entropy_from_logits

    cfg = parse_config(RLVRConfig, [RECIPE, "--model_name_or_path", "m", "--algo", "grpo",
                                    "--policy_loss", f"{user_file}:entropy_bonus",
                                    "--algo_kwargs", "entropy_coef=0.5"])  # fmt: skip
    row = rl_algorithms.POLICY_LOSSES[cfg.policy_loss]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]], requires_grad=True)  # [1 row, 2 tokens, vocab 2]
    entropy = entropy_from_logits(logits)
    hand = [math.log(4.0) - 0.75 * math.log(3.0), math.log(2.0)]  # 0.5623, 0.6931
    # fp32: logsumexp and the softmax-weighted sum of values of magnitude <= ln 3, a few roundings each
    assert entropy[0].tolist() == pytest.approx(hand, abs=8 * FP32_EPS)
    logp = torch.tensor([[-0.3, -0.7]], requires_grad=True)
    advantages, mask = torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)
    x = LossInputs(logp, logp.detach(), advantages, mask, 0.2, 0.2, entropy=entropy)
    loss, clipped = row.function(x, **rl_algorithms.chosen_kwargs(cfg, "policy_loss"))
    want = [-2.0 - 0.5 * hand[0], 1.0 - 0.5 * hand[1]]
    assert loss[0].tolist() == pytest.approx(want, abs=8 * FP32_EPS)
    assert clipped.sum() == 0
    loss.sum().backward()  # the bonus reaches the logits: d(-coef H)/dz = coef p (z - E_p z) per token
    p = torch.tensor([0.25, 0.75])
    z = torch.tensor([0.0, math.log(3.0)])
    want_grad = 0.5 * p * (z - (p * z).sum())
    torch.testing.assert_close(logits.grad[0, 0], want_grad, rtol=0, atol=8 * FP32_EPS)
    assert logits.grad[0, 1].abs().max() == 0  # uniform logits: the entropy is at its maximum


def test_the_update_hands_the_policys_entropy_to_a_loss_from_a_file(user_file, tiny_models):
    """Through micro_batch_loss with the policy's output layer zeroed: every logit is 0, so every token's entropy is
    ln V (V the vocabulary) and its log-prob -ln V; on-policy the loss sum is sum_t m_t (-A_t - coef ln V)."""
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, Rollout, micro_batch_loss
    from open_instruct.rollouts import episode_layout

    cfg = parse_config(RLVRConfig, [RECIPE, "--model_name_or_path", tiny_models["causal_lm"], "--algo", "grpo",
                                    "--beta", "0", "--policy_loss", f"{user_file}:entropy_bonus",
                                    "--algo_kwargs", "entropy_coef=0.1"])  # fmt: skip
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    policy = load_causal_lm(tiny_models["causal_lm"])
    with torch.no_grad():
        policy.get_output_embeddings().weight.zero_()
    vocab = policy.get_output_embeddings().weight.shape[0]
    prompt = tokenizer.encode("1+2=")
    responses = [tokenizer.encode("3"), tokenizer.encode("12"), tokenizer.encode("4"), tokenizer.encode("345")]
    n, width = len(responses), max(map(len, responses))
    mask = torch.zeros(n, width)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1
    zeros = torch.zeros(n, width)
    rollout = Rollout(
        episodes=[{"prompt_ids": prompt}] * n, response_ids=responses, texts=[""] * n, stopped=[True] * n,
        correct=[0.0] * n, verifier_timeouts=0, scores=torch.zeros(n), rm_scores=torch.zeros(n), mask=mask,
        value_mask=mask, score_index=None, on_policy=True, old_logp=None, sampler_logp=zeros, ref_logp=None,
        old_values=None, kl=None,
    )  # fmt: skip
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.0]).unsqueeze(1) * mask
    adv = Advantages(advantages, None, 0.0, torch.ones(n, dtype=torch.bool))
    models = RLModels(policy=policy)
    layout = episode_layout(cfg, tokenizer.pad_token_id)
    loss_sum, stats = micro_batch_loss(cfg, models, rollout, adv, list(range(n)), layout, "cpu", contextlib.nullcontext)
    seen = rl_algorithms.POLICY_LOSSES[cfg.policy_loss].function.__globals__["SEEN"]
    assert seen["requires_grad"]  # a bonus that trains: the entropy keeps its gradient
    tokens = float(mask.sum())  # 7
    hand = float(-(advantages * mask).sum()) - 0.1 * math.log(vocab) * tokens  # token_mean: w = mask
    # per token: logsumexp of V zeros (V-term sum) minus a zero sum, then a sum over 7 tokens of magnitude <= 2
    atol = (vocab + tokens) * FP32_EPS * (math.log(vocab) + 2.0)
    torch.testing.assert_close(seen["entropy"] * mask, math.log(vocab) * mask, rtol=0, atol=vocab * FP32_EPS * 5)
    assert float(loss_sum.detach()) == pytest.approx(hand, abs=atol)
    assert float(stats["entropy"]) == pytest.approx(math.log(vocab) * tokens, abs=atol)


def test_length_penalty_from_a_file_adds_the_length_on_each_token(user_file):
    cfg = parse_config(RLVRConfig, [RECIPE, "--model_name_or_path", "m", "--algo", "grpo",
                                    "--policy_loss", f"{user_file}:length_penalty",
                                    "--algo_kwargs", "per_token=0.25"])  # fmt: skip
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    x = LossInputs(logp, logp, torch.ones(2, 3), mask, 0.2, 0.2)
    row = rl_algorithms.POLICY_LOSSES[cfg.policy_loss]
    loss, _ = row.function(x, **rl_algorithms.chosen_kwargs(cfg, "policy_loss"))
    assert loss.tolist() == [[-1.0 + 0.5] * 3, [-1.0 + 0.75] * 3]  # -A x ratio 1, + 0.25 x length (2, 3)


def test_a_filter_through_keep_logs_its_dropped_share(user_file, tiny_models, tmp_path):
    """An estimator from a file that keeps half of the groups (filter_zero_std_groups off): the log row says
    train/filtered_fraction 0.5, whatever the scores were; a run that drops nothing and does not filter logs no such
    key (tests/test_rlvr.py's rows)."""
    from demo import synthetic
    from open_instruct import rlvr_ppo, runtime

    data = synthetic.write_jsonl(str(tmp_path / "rl.jsonl"), synthetic.rl_rows(8, 0))
    out = tmp_path / "out"
    runtime.run(rlvr_ppo.main, [
        RECIPE, "--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", data,
        "--eval_dataset_name_or_path", data, "--eval_steps", "100", "--checkpointing_steps", "100",
        "--output_dir", str(out), "--algo", "grpo", "--advantage_estimator", f"{user_file}:drop_odd_groups",
        "--policy_loss", f"{user_file}:entropy_bonus", "--total_episodes", "16", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "16", "--num_epochs", "1",
        "--response_length", "6", "--beta", "0",
    ])  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/score_mean" in r]
    assert len(train) == 1
    assert train[0]["train/filtered_fraction"] == 0.5  # 2 of 4 groups, 8 of 16 completions
    assert "train/filtered_groups_fraction" not in train[0]  # the built-in filter is off
    assert math.isfinite(train[0]["loss/policy"])
