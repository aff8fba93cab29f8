"""Multi-turn episodes in RLVR training (rlvr_ppo.py with `environment:`): observation tokens carry no loss weight
for every estimator and policy loss, the loss of a 2-turn episode equals the hand-computed one, 1 and 2 ranks give
the same update, packed micro-batches give the padded loss, per-turn rewards land on each turn's last policy token,
rows carry their own environment, tools and tool turns, and end to end: the calculator environment trains, an
environment from a user file trains, a tool that hangs or crashes yields an error observation and the run goes on,
2 processes count episodes as one, and a run SIGKILLed inside a tool call resumes to the uninterrupted run's
weights and metrics bit for bit.

The in-process tests play scripted turns through the Generator contract (ScriptedGenerator: each round's i-th
request gets its script's next turn) against the calculator, then run the trainer's own phases on the tiny model."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from tolerances import max_abs, pass_atol, rollout_width, sum_atol
from training_helpers import run_script, script_env

from open_instruct.generation import GenerationConfig, GenerationOutput
from open_instruct.rollouts import episode_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "rlvr_tiny.yaml")
ESTIMATORS = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"]
LOSSES = ["ppo", "gspo", "cispo"]
ONE_PROCESS = types.SimpleNamespace(num_processes=1, process_index=0, device="cpu", autocast=contextlib.nullcontext)


def hermes_call(expression: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}</tool_call>"


class ScriptedGenerator:
    """The Generator contract's generate(), answering round k's i-th request with scripts[k][i] (+ the EOS, which
    ends the tiny template's turns); sampler log-prob of the j-th token -0.1 * (j + 1), weight version 0."""

    def __init__(self, tokenizer, scripts: list[list[str]]):
        self.tokenizer, self.scripts, self.round = tokenizer, scripts, 0
        self.configs: list[GenerationConfig] = []

    def generate(self, prompt_ids, config, max_new_tokens=None):
        self.configs.append(config)
        texts = self.scripts[self.round]
        self.round += 1
        assert len(texts) == len(prompt_ids) and config.n == 1
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) + [self.tokenizer.eos_token_id]
               for t in texts]  # fmt: skip
        ids = [r[:cap] for r, cap in zip(ids, max_new_tokens)]
        return GenerationOutput(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=ids,
            texts=[self.tokenizer.decode(r, skip_special_tokens=True) for r in ids],
            stopped=[True] * len(ids),
            prompt_index=list(range(len(ids))),
            logprobs=[[-0.1 * (j + 1) for j in range(len(r))] for r in ids],
            weight_versions=[[0] * len(r) for r in ids],
        )


# Two prompts x 2 episodes. Episode 0 calls the calculator, gets "408" back and answers it (right, 2 turns);
# episode 1 answers wrong at once; episode 2 calls the tool twice, then answers right (3 turns); episode 3 right.
SCRIPTS = [[hermes_call("12*34"), "400", hermes_call("21*2"), "42"], ["408", hermes_call("40+2")], ["42"]]


def rows():
    def row(q, a):
        messages = [{"role": "user", "content": q}]
        return {"prompt_ids": [], "ground_truth": a, "verifier": "arithmetic", "source": "", "where": q,
                "example": {"messages": messages, "ground_truth": a, "verifier": "arithmetic"}}  # fmt: skip

    return [row("12*34=", "408"), row("21*2=", "42")]


def config(tiny_models, *extra):
    from open_instruct.config import RLVRConfig, parse_config

    return parse_config(RLVRConfig, [
        RECIPE, "--model_name_or_path", tiny_models["causal_lm"], "--environment", "tool", "--tools", "calculator",
        "--num_samples_per_prompt", "2", "--response_length", "400", "--max_turn_tokens", "120", "--max_turns", "3",
        "--verification_reward", "1.0", "--non_stop_penalty", "0.0", "--tool_output_max_tokens", "16", *extra,
    ])  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from open_instruct.models import TokenValueModel, load_causal_lm, load_sequence_classifier, load_tokenizer

    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    torch.manual_seed(0)
    value = TokenValueModel(
        load_sequence_classifier(
            tiny_models["causal_lm"], pad_token_id=tokenizer.pad_token_id, require_trained_head=False
        )  # fmt: skip
    )
    return {
        "tokenizer": tokenizer,
        "policy": load_causal_lm(tiny_models["causal_lm"]),
        "reference": load_causal_lm(tiny_models["causal_lm"]),
        "value": value,
    }


def play(cfg, tokenizer, generator=None):
    from open_instruct.rollouts import environment_run

    environments = environment_run(cfg, tokenizer)
    prompts = [{**r, "prompt_ids": environments.prompt_ids(r)} for r in rows()]
    generator = generator or ScriptedGenerator(tokenizer, SCRIPTS)
    out = environments.play(generator, prompts, GenerationConfig(n=2, seed=5, stop_strings=["###"]))
    return prompts, out


def rollout_of(cfg, tiny, on_policy):
    from open_instruct.rlvr_ppo import RLModels, collect_rollout

    prompts, out = play(cfg, tiny["tokenizer"])
    models = RLModels(
        policy=tiny["policy"],
        value=tiny["value"] if cfg.uses_value_model else None,
        reference=tiny["reference"] if cfg.beta > 0 else None,
    )
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tiny["tokenizer"])
    rollout = collect_rollout(cfg, models, prompts, out, {}, 0, run, on_policy, episode_layout(cfg,
                              tiny["tokenizer"].pad_token_id))  # fmt: skip
    return models, rollout, out


def observation_positions(out) -> torch.Tensor:
    """[n, R] True on observation tokens (inside the response, loss mask 0)."""
    width = max(len(r) for r in out.response_ids)
    obs = torch.zeros(len(out.response_ids), width, dtype=torch.bool)
    for i, lm in enumerate(out.loss_masks):
        obs[i, : len(lm)] = torch.tensor(lm) == 0
    return obs


def test_scripted_episodes_are_what_the_script_says(tiny_models, tiny):
    cfg = config(tiny_models)
    _, out = play(cfg, tiny["tokenizer"])
    assert [len(e.turns) for e in out.episodes] == [2, 1, 3, 1]
    assert [e.tool_calls for e in out.episodes] == [1, 0, 2, 0]
    assert out.prompt_index == [0, 0, 1, 1] and len(out.prompt_ids) == 2
    text = tiny["tokenizer"].decode(out.response_ids[0])
    assert "<|tool|>\n408<|end|>" in text  # the calculator's answer, as an observation
    for i, e in enumerate(out.episodes):
        assert out.loss_masks[i] == e.loss_mask and len(out.logprobs[i]) == len(out.response_ids[i])
        assert all(lp == 0.0 for lp, m in zip(out.logprobs[i], e.loss_mask) if not m)
    assert observation_positions(out)[0].sum() > 0 and observation_positions(out)[1].sum() == 0


def test_every_turn_is_generated_with_the_call_end_as_a_stop_string(tiny_models, tiny):
    """The hermes environment's `</tool_call>` reaches the generator (HF and vLLM stop there) beside the recipe's
    own stop strings, in every round, and a call turn's policy tokens end with the call."""
    generator = ScriptedGenerator(tiny["tokenizer"], SCRIPTS)
    _, out = play(config(tiny_models), tiny["tokenizer"], generator)
    assert [c.stop_strings for c in generator.configs] == [["###", "</tool_call>"]] * 3
    first = out.episodes[0].turns[0]
    assert tiny["tokenizer"].decode(out.response_ids[0][: first.policy_end]).endswith(hermes_call("12*34"))


def test_rows_carry_their_environment_tools_and_tool_turns(tiny_models, tiny, tmp_path):
    """A row's `environment` and `tools` columns win over the recipe's; a prompt holding an assistant tool call
    (content null) and its tool answer is accepted and rendered; `dataset` may be a one-name list; a row without
    an environment column keeps the recipe's."""
    from open_instruct import data
    from open_instruct.environments import MultiTurnEnvironment, ToolEnvironment
    from open_instruct.rollouts import environment_run, render_environment_prompts

    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}
    lines = [
        {"messages": [{"role": "user", "content": "2+2, then double it"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "content": "4"}],
         "ground_truth": "8", "dataset": ["arithmetic"], "tools": ["calculator"]},
        {"messages": [{"role": "user", "content": "3+3="}], "ground_truth": "6", "dataset": "arithmetic",
         "environment": "multi_turn", "follow_ups": ["sure?"]},
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    # the tiny template renders the earlier call as <tool_call>{json}</tool_call>: 122 prompt tokens
    cfg = config(tiny_models, "--tools", "calculator", "python", "--max_prompt_length", "160")
    examples, _ = data.tokenize_prompts(data.load_rows(str(path)), tiny["tokenizer"], cfg)
    assert examples[0]["verifier"] == "arithmetic" and examples[0]["example"]["tools"] == ["calculator"]
    assert examples[0]["example"]["messages"][1]["tool_calls"] == [call]
    environments = environment_run(cfg, tiny["tokenizer"])
    first, second = (environments.environment(e).env for e in examples[:2])  # the guarded classes
    assert isinstance(first, ToolEnvironment) and isinstance(second, MultiTurnEnvironment)
    rendered = render_environment_prompts(cfg, examples, environments)
    first.reset(examples[0]["example"])
    assert first.all_tools == ("calculator", "python") and first.enabled == ("calculator",)  # the row narrowed it
    assert "<|tool|>\n4<|end|>" in tiny["tokenizer"].decode(rendered[0]["prompt_ids"])


class TwoRewardedTurns:
    """A test environment (found by import path test_multiturn_rlvr:TwoRewardedTurns): turn 1 earns 0.25 and is
    answered "go on", turn 2 earns 0.5 and ends the episode."""

    tools: list = []

    def reset(self, example):
        self.turn = 0
        return example["messages"]

    def step(self, action):
        from open_instruct.environments import StepResult

        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "go on"}], 0.25, False, {})
        return StepResult(None, 0.5, True, {"correct": True})

    def action_end(self, text):
        return None


@pytest.mark.parametrize("aggregation", ["sum", "last"])
def test_turn_rewards_land_on_each_turns_last_policy_token(tiny_models, tiny, aggregation):
    """turn_reward_aggregation sum: the score is verification_reward x (0.25 + 0.5) and the per-token rewards (beta
    0) are 2 x 0.25 on turn 1's last policy token and 2 x 0.5 on turn 2's; last: 2 x 0.5 on the episode's last
    policy token only. Nothing on observation tokens."""
    from open_instruct.rl_algorithms import kl_rewards
    from open_instruct.rlvr_ppo import RLModels, advantage_inputs, collect_rollout
    from open_instruct.rollouts import environment_run

    cfg = config(tiny_models, "--environment", "test_multiturn_rlvr:TwoRewardedTurns", "--beta", "0.0",
                 "--turn_reward_aggregation", aggregation, "--verification_reward", "2.0")  # fmt: skip
    tiny_scripts = [["ab", "cd", "efg", "h"], ["ij", "k", "l", "mn"]]  # 2 turns each
    environments = environment_run(cfg, tiny["tokenizer"])
    prompts = [{**r, "prompt_ids": environments.prompt_ids(r)} for r in rows()]
    out = environments.play(ScriptedGenerator(tiny["tokenizer"], tiny_scripts), prompts, GenerationConfig(n=2, seed=1))
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tiny["tokenizer"])
    rollout = collect_rollout(cfg, RLModels(policy=tiny["policy"]), prompts, out, {}, 0, run, True,
                              episode_layout(cfg, 0))  # fmt: skip
    want_score = 2.0 * (0.75 if aggregation == "sum" else 0.5)
    assert rollout.scores.tolist() == [want_score] * 4
    per_token = kl_rewards(advantage_inputs(cfg, rollout, ONE_PROCESS))
    for i, episode in enumerate(out.episodes):
        first_end, last_end = episode.turns[0].policy_end - 1, episode.turns[1].policy_end - 1
        want = torch.zeros(per_token.shape[1])
        if aggregation == "sum":
            want[first_end] += 0.5
        want[last_end] += 1.0
        assert torch.equal(per_token[i], want), (i, per_token[i].nonzero().tolist())
        assert episode.loss_mask[first_end] == 1 and episode.loss_mask[first_end + 1] == 0  # an observation follows


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_observation_tokens_carry_no_loss_weight(tiny_models, tiny, estimator, loss):
    """Every estimator x policy loss, off-policy (num_epochs 2: the old log-probs come from a separate pass), with
    the KL (in the reward or as a loss term), TIS and the value loss on: the advantages, returns and KL are exactly
    0 on observation tokens, and perturbing every per-token input there (old/sampler/reference log-probs, values,
    advantages, returns) changes neither the advantages of policy tokens nor the loss, its statistics or its
    gradients."""
    from open_instruct.rlvr_ppo import compute_advantages, micro_batch_loss

    cfg = config(tiny_models, "--advantage_estimator", estimator, "--policy_loss", loss, "--num_epochs", "2",
                 "--beta", "0.05", "--kl_estimator", "k3", "--truncated_importance_sampling", "true",
                 "--cliprange_high", "0.28", "--whiten_advantages", "false")  # fmt: skip
    models, rollout, out = rollout_of(cfg, tiny, on_policy=False)
    obs = observation_positions(out)
    assert obs.any() and (rollout.mask[obs] == 0).all()
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    assert (adv.advantages[obs] == 0).all()
    if adv.returns is not None:
        assert (adv.returns[obs] == 0).all()
    if rollout.kl is not None:
        assert (rollout.kl[obs] == 0).all()
    assert adv.advantages[~obs].abs().sum() > 0  # there is a signal on the policy tokens

    g = torch.Generator().manual_seed(7)

    def noisy(x):
        return None if x is None else x + torch.randn(x.shape, generator=g) * 3.0 * obs[:, : x.shape[1]]

    shaken = copy.copy(rollout)
    for name in ("old_logp", "sampler_logp", "ref_logp", "old_values", "kl"):
        setattr(shaken, name, noisy(getattr(rollout, name)))
    adv_shaken = compute_advantages(cfg, shaken, ONE_PROCESS)
    assert torch.equal(adv_shaken.advantages, adv.advantages)  # GAE / returns skip observation tokens entirely
    adv_shaken = dataclasses.replace(adv, advantages=noisy(adv.advantages), returns=noisy(adv.returns))

    def loss_and_grads(r, a):
        models.policy.zero_grad(set_to_none=True)
        if models.value is not None:
            models.value.zero_grad(set_to_none=True)
        loss_sum, stats = micro_batch_loss(cfg, models, r, a, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                           contextlib.nullcontext)  # fmt: skip
        loss_sum.backward()
        trained = list(models.policy.parameters()) + (list(models.value.parameters()) if models.value else [])
        return float(loss_sum.detach()), stats, [p.grad.clone() for p in trained if p.grad is not None]

    base, perturbed = loss_and_grads(rollout, adv), loss_and_grads(shaken, adv_shaken)
    assert base[0] == perturbed[0] and base[1] == perturbed[1]
    assert all(torch.equal(a, b) for a, b in zip(base[2], perturbed[2]))
    assert base[1]["tokens"] == float(sum(sum(m) for m in out.loss_masks))  # policy tokens only


@pytest.mark.numerics
def test_two_turn_episode_loss_equals_the_hand_computed_one(tiny_models, tiny):
    """RLOO, PPO loss, token_mean, on-policy, no KL: A_i = r_i - r_j within a group of 2, and at ratio 1

        loss = -(1/N) sum_i A_i sum_{t in P_i} exp(logp_it - sg[logp_it]),    N = sum_i |P_i|

    with P_i episode i's policy tokens. Its value is -(1/N) sum_i A_i |P_i|, its gradient that of
    -(1/N) sum_i A_i sum_{t in P_i} logp_it, the log-probs taken here from a plain forward of prompt + whole
    response (the observation tokens as context)."""
    from open_instruct.rlvr_ppo import compute_advantages, micro_batch_loss

    cfg = config(tiny_models, "--advantage_estimator", "rloo", "--policy_loss", "ppo", "--num_epochs", "1",
                 "--beta", "0.0", "--loss_aggregation", "token_mean")  # fmt: skip
    models, rollout, out = rollout_of(cfg, tiny, on_policy=True)
    assert rollout.scores.tolist() == [1.0, 0.0, 1.0, 1.0]  # episode 1 answered 400 for 408
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    expected_a = [1.0, -1.0, 0.0, 0.0]  # r_i - r_j
    policy_counts = [sum(m) for m in out.loss_masks]
    n_policy = sum(policy_counts)
    for i in range(4):
        assert torch.allclose(adv.advantages[i][rollout.mask[i] > 0], torch.tensor(expected_a[i]))

    models.policy.zero_grad(set_to_none=True)
    loss_sum, _ = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                   contextlib.nullcontext)  # fmt: skip
    loss = loss_sum / n_policy  # U = N for token_mean
    loss.backward()
    got = [p.grad.clone() for p in models.policy.parameters()]
    hand_value = -sum(a * c for a, c in zip(expected_a, policy_counts)) / n_policy
    # on-policy the ratio is exactly 1: the loss is a weighted sum of n_policy advantages of size 1, rounded
    assert abs(float(loss.detach()) - hand_value) <= sum_atol([a * c for a, c in zip(expected_a, policy_counts)])

    models.policy.zero_grad(set_to_none=True)
    hand = 0.0
    for i, episode in enumerate(out.episodes):
        ids = torch.tensor([episode.prompt_ids + episode.response_ids])
        logp = torch.log_softmax(models.policy(ids).logits[0, :-1].float() / cfg.temperature, -1)
        targets = ids[0, 1:]
        token_logp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)[len(episode.prompt_ids) - 1 :]
        policy = torch.tensor(episode.loss_mask, dtype=torch.bool)
        hand = hand - expected_a[i] * token_logp[policy].sum() / n_policy
    hand.backward()
    want = [p.grad.clone() for p in models.policy.parameters()]
    width = rollout_width(rollout)
    bound = pass_atol(models.policy.config, width, 4 * width, want)
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) <= bound
    assert max(a.abs().max().item() for a in want) > 100 * bound


@pytest.mark.numerics
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_one_and_two_ranks_give_the_same_update(tiny_models, tiny, estimator):
    """The real micro-batch loss on the multi-turn rollout: one process on all 4 episodes in one micro-batch versus
    2 ranks of one group each, each backpropagating sum(w * l) * world / U, gradients averaged as DDP does (the
    pattern of test_rlvr_variants' aggregation test)."""
    from open_instruct.rl_algorithms import aggregation_weights
    from open_instruct.rlvr_ppo import compute_advantages, micro_batch_loss

    cfg = config(tiny_models, "--advantage_estimator", estimator, "--num_epochs", "2", "--beta", "0.05",
                 "--truncated_importance_sampling", "true", "--whiten_advantages", "false")  # fmt: skip
    models, rollout, _ = rollout_of(cfg, tiny, on_policy=False)
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    _, units = aggregation_weights(rollout.mask, cfg.loss_aggregation, cfg.loss_norm_length)
    total = float(units.sum())

    def gradients(parts):
        per_rank = []
        for micro_batches in parts:
            models.policy.zero_grad(set_to_none=True)
            for rows_ in micro_batches:
                loss_sum, _ = micro_batch_loss(cfg, models, rollout, adv, rows_, episode_layout(cfg, 0), "cpu",
                                               contextlib.nullcontext)  # fmt: skip
                (loss_sum * len(parts) / total).backward()
            per_rank.append([p.grad.clone() for p in models.policy.parameters()])
        return [sum(g) / len(parts) for g in zip(*per_rank)]

    one, two = gradients([[[0, 1, 2, 3]]]), gradients([[[0, 1]], [[2, 3]]])
    width = rollout_width(rollout)
    bound = pass_atol(models.policy.config, width, 4 * width, one)
    assert max((a - b).abs().max().item() for a, b in zip(one, two)) <= bound
    assert max(a.abs().max().item() for a in one) > 100 * bound


@pytest.mark.numerics
def test_packed_micro_batches_give_the_padded_loss(tiny_models, tiny):
    """Packing (max_tokens_per_micro_batch: every episode's prompt + policy and observation tokens in one packed
    row, sdpa_varlen) gives the padded rollout's log-probs, values, advantages, loss and gradients."""
    from open_instruct.models import load_causal_lm
    from open_instruct.rlvr_ppo import compute_advantages, micro_batch_loss

    results = []
    for extra in ([], ["--max_tokens_per_micro_batch", "2048"]):
        cfg = config(tiny_models, "--num_epochs", "2", "--beta", "0.05", *extra)
        torch.manual_seed(0)
        models_in = {
            **tiny,
            "policy": load_causal_lm(tiny_models["causal_lm"], attn_implementation=cfg.attention_kernel),
        }
        models, rollout, out = rollout_of(cfg, models_in, on_policy=False)
        adv = compute_advantages(cfg, rollout, ONE_PROCESS)
        models.policy.zero_grad(set_to_none=True)
        loss_sum, _ = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                       contextlib.nullcontext)  # fmt: skip
        loss_sum.backward()
        results.append((rollout, adv, float(loss_sum.detach()), [p.grad.clone() for p in models.policy.parameters()]))
    (padded, adv_a, loss_a, grads_a), (packed, adv_b, loss_b, grads_b) = results
    policy_config, width = models.policy.config, rollout_width(padded)

    def close(a, b) -> bool:  # each a quantity of one forward/backward pass (tests/tolerances.py: pass_atol)
        return max_abs([x - y for x, y in zip(a, b)]) <= pass_atol(policy_config, width, 4 * width, a)

    # log-probs relative to the logits they come from (log_softmax: twice the logits' error)
    with torch.no_grad():
        logits = [models.policy(torch.tensor([e.prompt_ids + e.response_ids])).logits for e in out.episodes]
    assert max_abs(padded.old_logp - packed.old_logp) <= 2 * pass_atol(policy_config, width, 4 * width, logits)
    assert close([adv_a.advantages], [adv_b.advantages]) and close([loss_a], [loss_b]) and close(grads_a, grads_b)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_a_shared_prompt_forward_gives_the_unshared_loss_and_gradients(tiny_models, tiny, monkeypatch, estimator):
    """Each episode pair's prompt computed once (shared_prompt_forward, the default) and its two multi-turn responses
    (policy and observation tokens) run on its key/value cache, with grad: the old log-probs, values, advantages,
    loss and the policy's and value model's gradients equal the unshared computation's (shared_prompt_forward
    false) within one forward and backward's rounding. Each way is checked to take its path."""
    from open_instruct import models as model_functions
    from open_instruct.rlvr_ppo import compute_advantages, micro_batch_loss

    results, calls = [], []
    original = model_functions.shared_prefix_forward

    def counted(*a, **kw):  # the log-prob head's shared forwards that ran (None: fell back to the plain one)
        parts = original(*a, **kw)
        if parts is not None and isinstance(parts[0], model_functions.TokenScores):
            calls[-1].append(torch.is_grad_enabled())
        return parts

    monkeypatch.setattr(model_functions, "shared_prefix_forward", counted)
    for shared in ("true", "false"):
        calls.append([])
        cfg = config(tiny_models, "--advantage_estimator", estimator, "--num_epochs", "2", "--beta", "0.05",
                     "--shared_prompt_forward", shared)  # fmt: skip
        models, rollout, out = rollout_of(cfg, tiny, on_policy=False)
        adv = compute_advantages(cfg, rollout, ONE_PROCESS)
        trained = [m for m in (models.policy, models.value) if m is not None]
        for m in trained:
            m.zero_grad(set_to_none=True)
        loss_sum, _ = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                       contextlib.nullcontext)  # fmt: skip
        loss_sum.backward()
        grads = [p.grad.clone() for m in trained for p in m.parameters() if p.grad is not None]
        olds = [rollout.old_logp] + ([rollout.old_values] if rollout.old_values is not None else [])
        results.append((olds, adv, float(loss_sum.detach()), grads))
    assert True in calls[0] and False in calls[0] and calls[1] == []  # no-grad passes and the training forward
    (olds_a, adv_a, loss_a, grads_a), (olds_b, adv_b, loss_b, grads_b) = results
    assert (estimator == "gae") == (len(olds_a) == 2) and len(grads_a) == len(grads_b) > 0
    policy_config, width = tiny["policy"].config, rollout_width(rollout)

    def close(a, b) -> bool:  # each a quantity of one forward/backward pass (tests/tolerances.py: pass_atol)
        return max_abs([x - y for x, y in zip(a, b)]) <= pass_atol(policy_config, width, 4 * width, a)

    with torch.no_grad():  # log-probs relative to the logits they come from (log_softmax: twice the logits' error)
        logits = [tiny["policy"](torch.tensor([e.prompt_ids + e.response_ids])).logits for e in out.episodes]
    assert max_abs(olds_a[0] - olds_b[0]) <= 2 * pass_atol(policy_config, width, 4 * width, logits)
    assert estimator == "grpo" or close(olds_a[1:], olds_b[1:])  # the value model's old values
    assert close([adv_a.advantages], [adv_b.advantages])
    assert close([loss_a], [loss_b]) and close(grads_a, grads_b)


# ---------------------------------------------------------------------------------------------------------------------
# End to end: the script, in a subprocess


USER_ENV = '''
import json, os, threading
from open_instruct.environments import ToolEnvironment

CALLS = [0]


def runtime(code, timeout_s):
    """The test's python tool: 'hang' never returns, 'crash' raises, anything else prints its length."""
    if code == "hang":
        threading.Event().wait()
    if code == "crash":
        raise RuntimeError("the runtime fell over")
    return str(len(code)) + "\\n", "", "ok"


class AlwaysCalls(ToolEnvironment):
    """Whatever the policy writes first is taken as a python call of the row's `code` (so a random tiny model
    calls tools deterministically); the second turn is the answer."""

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "tools": ["python"], "python_runtime": runtime, "tool_deadline_grace_s": 0.0})

    def reset(self, example):
        self.turn = 0
        return super().reset({**example, "tools": None})

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            CALLS[0] += 1
            gate = os.environ.get("MT_GATE")
            if gate and CALLS[0] == int(os.environ["MT_GATE_AT"]):  # blocked inside the tool step, says so
                open(gate + ".in_tool", "w").close()
                while not os.path.exists(gate + ".release"):
                    threading.Event().wait(0.01)
            call = {"name": "python", "arguments": {"code": self.example["code"]}}
            return super().step("<tool_call>" + json.dumps(call) + "</tool_call>")
        return super().step(action)
'''


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("mt_e2e")
    env_file = root / "user_env.py"
    env_file.write_text(USER_ENV)
    codes = ["print(1)", "hang", "crash", "x = 2"]
    train = [{"messages": [{"role": "user", "content": f"{a}*{b}="}], "ground_truth": str(a * b),
              "dataset": "arithmetic", "code": codes[(a + b) % 4]} for a in range(10, 26) for b in (3, 4)]  # fmt: skip
    path = root / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in train) + "\n")
    evals = root / "eval.jsonl"
    evals.write_text("\n".join(json.dumps(r) for r in train[:4]) + "\n")
    return {"root": root, "env": f"{env_file}:AlwaysCalls", "train": str(path), "eval": str(evals),
            "model": tiny_models["causal_lm"]}  # fmt: skip


def argv(e2e, out, *extra):
    return [
        os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), RECIPE, "--model_name_or_path", e2e["model"],
        "--dataset_name_or_path", e2e["train"], "--eval_dataset_name_or_path", e2e["eval"], "--output_dir", str(out),
        "--total_episodes", "24", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2",
        "--per_device_train_batch_size", "8", "--response_length", "200", "--max_turn_tokens", "8",
        "--max_turns", "3", "--tool_output_max_tokens", "8", "--tool_timeout", "0.2", "--eval_steps", "100",
        "--checkpointing_steps", "1", "--num_samples_logged", "2", *extra,
    ]  # fmt: skip


def kill_inside_tool_turn(args: list[str], env: dict, gate: str, out) -> None:
    """Run the script with `args` and SIGKILL it once it is inside the gated tool turn (the event the code signals:
    the file gate.in_tool), after rollout 1's update and before rollout 2's; then open the gate for the resume."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        while not os.path.exists(gate + ".in_tool"):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.01)
        assert [r["rollout_step"] for r in read_rows(out) if "loss/policy" in r] == [1]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    open(gate + ".release", "w").close()


def read_rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_calculator_environment_trains_end_to_end(tiny_models, tmp_path):
    """The researcher's command: --environment tool --tools calculator on the tiny model; multi-turn metrics in
    the log rows, greedy episode evaluation, whole conversations in samples.jsonl."""
    data = tmp_path / "rl.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"{a}*7="}],
                                          "ground_truth": str(7 * a), "dataset": ["arithmetic"]})
                              for a in range(10, 30)) + "\n")  # fmt: skip
    out = tmp_path / "out"
    run_script([os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), RECIPE, "--environment", "tool", "--tools",
                "calculator", "--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", str(data),
                "--eval_dataset_name_or_path", str(data), "--max_eval_samples", "4", "--output_dir", str(out),
                "--total_episodes", "16", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2",
                "--per_device_train_batch_size", "8", "--response_length", "24", "--max_turn_tokens", "12",
                "--eval_steps", "2", "--checkpointing_steps", "100"])  # fmt: skip
    rows = read_rows(out)
    train = [r for r in rows if "loss/policy" in r]
    evals = [r for r in rows if "eval/correct_rate" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    for key in ("train/turns_per_episode", "train/tool_calls_per_episode", "train/observation_token_share"):
        assert key in train[0]
    assert train[0]["train/turns_per_episode"] >= 1.0
    assert {"eval/tool_calls_per_episode", "eval/turns_per_episode"} <= set(evals[0])
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples[0]["conversation"].startswith("<|user|>\n") and "turns" in samples[0]


@pytest.fixture(scope="module")
def user_env_run(e2e):
    out = e2e["root"] / "one_process"
    run_script(argv(e2e, out, "--environment", e2e["env"], "--checkpointing_steps", "100"))
    return out


def test_user_file_environment_with_hanging_and_crashing_tools_trains(user_env_run):
    """An environment from a user file (import path /path/file.py:Class) whose python tool hangs on some rows and
    raises on others: those calls come back as error observations, counted by reason, and the run finishes."""
    out = user_env_run
    train = [r for r in read_rows(out) if "loss/policy" in r]
    assert len(train) == 3
    errors = {k: sum(r.get(k, 0) for r in train) for k in ("train/tool_errors_python_hung",
                                                          "train/tool_errors_python_crash")}  # fmt: skip
    assert errors["train/tool_errors_python_hung"] > 0 and errors["train/tool_errors_python_crash"] > 0
    assert all(r["train/tool_calls_per_episode"] == 1.0 and r["train/turns_per_episode"] == 2.0 for r in train)
    assert all(r["train/observation_token_share"] > 0 for r in train)
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert any("[[observation]]" in s["conversation"] for s in samples)


@pytest.mark.slow
def test_two_processes_count_episodes_and_tool_errors_as_one(e2e, user_env_run, tmp_path):
    """The same run on 2 processes (torchrun, DDP over gloo), 2 prompts per rank: every rollout consumes the same
    prompts, so the deterministic episode counts (turns, tool calls, tool errors by reason, summed over ranks whose
    reasons differ) and the counters equal the one-process run's."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in script_env().items() if not k.startswith(("ACCELERATE_", "FSDP_", "OPEN_INSTRUCT_FAULT"))}
    env.update(ACCELERATE_USE_CPU="true", WANDB_MODE="disabled")
    out = tmp_path / "two"
    args = argv(e2e, out, "--environment", e2e["env"], "--checkpointing_steps", "100")
    args[args.index("--local_rollout_batch_size") + 1] = "2"
    args[args.index("--per_device_train_batch_size") + 1] = "4"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "2 processes" in proc.stdout + proc.stderr
    keys = ("episode", "rollout_step", "optimizer_step", "train/turns_per_episode", "train/tool_calls_per_episode",
            "train/tool_errors", "train/tool_errors_python_hung", "train/tool_errors_python_crash")  # fmt: skip
    one = [{k: r.get(k) for k in keys} for r in read_rows(user_env_run) if "loss/policy" in r]
    two = [{k: r.get(k) for k in keys} for r in read_rows(out) if "loss/policy" in r]
    assert one == two and len(one) == 3


def test_bad_environment_exits_2_before_loading(e2e, tmp_path):
    missing = (str(tmp_path / "missing.py") + ":X", "missing.py' does not exist")
    for spec, words in [("nope", "unknown environment 'nope'"), missing, ("tool", "tools: unknown ['abacus']")]:
        extra = ["--tools", "calculator", "abacus"] if spec == "tool" else []
        proc = subprocess.run([sys.executable, *argv(e2e, tmp_path / "o", "--environment", spec, *extra)], cwd=REPO,
                              env=script_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.concurrency
@pytest.mark.slow
def test_killed_inside_a_tool_call_resumes_bit_exactly(e2e, tmp_path):
    """SIGKILL while a tool call of rollout 2 is blocked (the runtime says so with a file and waits for the test's
    release file), resume with --resume_from_checkpoint auto: the rollout in flight is regenerated from the same
    seeds, and the metrics rows and final weights equal the uninterrupted run's exactly."""
    from safetensors.torch import load_file

    ref, out = tmp_path / "reference", tmp_path / "crashed"
    run_script(argv(e2e, ref, "--environment", e2e["env"]))
    gate = str(tmp_path / "gate")
    # tool steps: the probe step before loading (rollouts.load_prompts), 4 in the step-0 evaluation,
    # 8 in rollout 1 (4 prompts x 2): the 14th is rollout 2's first
    env = {**script_env(), "MT_GATE": gate, "MT_GATE_AT": "14"}
    kill_inside_tool_turn(argv(e2e, out, "--environment", e2e["env"]), env, gate, out)
    run_script(argv(e2e, out, "--environment", e2e["env"], "--resume_from_checkpoint", "auto"))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    assert comparable(read_rows(out)) == comparable(read_rows(ref))
    a, b = load_file(ref / "final_model" / "model.safetensors"), load_file(out / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_episode_output_round_trips_through_a_checkpoint_buffer(tiny_models, tiny):
    """Multi-turn rollouts played ahead of training (async) are kept in the checkpoint as JSON: the episodes come
    back with their turns, rewards, tool counters and loss masks, equal to the ones played."""
    from open_instruct.rollouts import output_from_state, output_state

    _, out = play(config(tiny_models), tiny["tokenizer"])
    back = output_from_state(json.loads(json.dumps(output_state(out))))
    assert type(back) is type(out) and back == out
    assert [len(e.turns) for e in back.episodes] == [2, 1, 3, 1]
    assert back.episodes[2].turns[0].info == out.episodes[2].turns[0].info and back.episodes[2].tool_calls == 2


def test_verifier_timeouts_inside_environments_are_counted(tiny_models, tiny):
    """A final answer whose verifier times out scores 0 and is counted: on its episode, in the rollout's scores
    (train/verifier_timeouts), and through the checkpoint buffer's JSON."""
    from open_instruct.rollouts import environment_run, output_from_state, output_state, score_rollout

    hang = r"The answer is \boxed{10^{10^{10}}}"  # sympy tries to build a 10-billion-digit integer
    cfg = config(tiny_models, "--verifier_timeout", "0.5")
    environments = environment_run(cfg, tiny["tokenizer"])
    prompts = []
    for r in rows():
        r = {**r, "ground_truth": "2", "verifier": "math", "example": {**r["example"], "ground_truth": "2",
                                                                       "verifier": "math"}}  # fmt: skip
        prompts.append({**r, "prompt_ids": environments.prompt_ids(r)})
    scripts = [[hang, "\\boxed{2}", "\\boxed{3}", hang]]
    out = environments.play(ScriptedGenerator(tiny["tokenizer"], scripts), prompts, GenerationConfig(n=2, seed=5))
    assert [e.verifier_timeouts for e in out.episodes] == [1, 0, 0, 1]
    scored = score_rollout(cfg, out, [p["example"] for p in prompts for _ in range(2)], tiny["tokenizer"])
    assert scored.num_timeouts == 2 and scored.rewards == [0.0, 1.0, 0.0, 0.0]
    back = output_from_state(json.loads(json.dumps(output_state(out))))
    assert [e.verifier_timeouts for e in back.episodes] == [1, 0, 0, 1]


@pytest.mark.concurrency
@pytest.mark.slow
def test_async_multi_turn_run_killed_with_episodes_in_the_checkpoint_resumes_bit_exactly(e2e, tmp_path):
    """async_steps 2 on the hf backend with the user-file environment: SIGKILL as weight version 2 goes to the
    generator, after the checkpoint of rollout step 2 saved rollout 2's episodes (played ahead) in its buffer; the
    resume trains on those episodes as saved, and the metrics rows and final weights equal the uninterrupted run's."""
    from safetensors.torch import load_file

    from open_instruct.checkpoint import FAULT_ENV

    extra = ("--environment", e2e["env"], "--async_steps", "2")
    ref, out = tmp_path / "reference", tmp_path / "crashed"
    run_script(argv(e2e, ref, *extra))
    proc = subprocess.run([sys.executable, *argv(e2e, out, *extra)], cwd=REPO, capture_output=True, text=True,
                          env={**script_env(), FAULT_ENV: "weight_sync:step_2"}, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [r["rollout_step"] for r in read_rows(out) if "loss/policy" in r] == [1, 2]
    run_script(argv(e2e, out, *extra, "--resume_from_checkpoint", "auto"))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    assert comparable(read_rows(out)) == comparable(read_rows(ref))
    lags = [r["train/version_lag_mean"] for r in read_rows(out) if "train/version_lag_mean" in r]
    assert lags == [0.0, 1.0, 2.0]
    a, b = load_file(ref / "final_model" / "model.safetensors"), load_file(out / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
