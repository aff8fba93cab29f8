"""TRL's mask_truncated_completions (issue 41, item 3), worked by hand: a completion no EOS/stop string ended within
response_length gets no loss weight, yet its score counts in its group's baseline, and the normalisers are TRL's
(grpo_trainer.py: the completion mask is zeroed, then dapo/bnpo divide by the unmasked tokens, grpo and dr_grpo by
the number of sequences, the masked one included)."""

import contextlib
import math
import os
import types

import pytest
import torch

from open_instruct.config import RLVRConfig, parse_config
from open_instruct.errors import ConfigError
from open_instruct.rollouts import episode_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "rlvr_tiny.yaml")
ONE_PROCESS = types.SimpleNamespace(num_processes=1, process_index=0, device="cpu", autocast=contextlib.nullcontext)
# one prompt, 4 completions: 12 * 34 = 408; completion 1 is right but was cut at response_length
TEXTS = ["408", "408 is it", "407", "400 or so"]
STOPPED = [True, False, True, True]
SCORES = [1.0, 1.0, 0.0, 0.0]  # verification_reward 1, no non-stop penalty


def config(tiny_models, *extra):
    return parse_config(RLVRConfig, [
        RECIPE, "--model_name_or_path", tiny_models["causal_lm"], "--algo", "grpo", "--beta", "0",
        "--non_stop_penalty", "0", "--local_rollout_batch_size", "1", "--per_device_train_batch_size", "4", *extra,
    ])  # fmt: skip


def rollout_and_loss(tiny_models, *extra):
    """collect_rollout of the 4 completions on the old policy (ratio 1: the per-token policy loss is -A_i), the
    estimator's advantages, and the loss as `update` takes it: micro_batch_loss / the units of the mini-batch."""
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import (
        RLModels,
        aggregation_weights,
        collect_rollout,
        compute_advantages,
        micro_batch_loss,
    )

    cfg = config(tiny_models, *extra)
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    out = types.SimpleNamespace(
        response_ids=ids, texts=TEXTS, stopped=STOPPED, prompt_index=[0, 0, 0, 0],
        logprobs=[[-0.5] * len(r) for r in ids], weight_versions=[[0] * len(r) for r in ids],
    )  # fmt: skip
    prompt = {"prompt_ids": tokenizer.encode("12*34="), "ground_truth": "408", "verifier": "arithmetic", "where": "r"}
    torch.manual_seed(0)
    models = RLModels(policy=load_causal_lm(tiny_models["causal_lm"]))
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
    layout = episode_layout(cfg, tokenizer.pad_token_id)
    rollout = collect_rollout(cfg, models, [prompt], out, {}, 0, run, True, layout)
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    loss_sum, _ = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], layout, "cpu", contextlib.nullcontext)
    counted = adv.keep if cfg.mask_truncated_completions else None  # as update() counts the units
    _, units = aggregation_weights(rollout.mask * adv.keep.unsqueeze(1), cfg.loss_aggregation, cfg.loss_norm_length,
                                   counted)  # fmt: skip
    return cfg, [len(r) for r in ids], rollout, adv, float(loss_sum.detach() / units.sum())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_truncated_completion_left_out_of_the_loss_by_hand(tiny_models, aggregation):
    cfg, n, rollout, adv, loss = rollout_and_loss(
        tiny_models, "--mask_truncated_completions", "true", "--loss_aggregation", aggregation
    )
    assert rollout.scores.tolist() == SCORES and rollout.stopped == STOPPED
    assert rollout.mask[1].sum() == 0 and [int(rollout.mask[i].sum()) for i in (0, 2, 3)] == [n[0], n[2], n[3]]
    # the truncated completion's score is in its group's baseline: mean 0.5, std (n - 1) sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv.advantages[:, 0], torch.tensor([a, 0.0, -a, -a]), rtol=0, atol=1e-6)
    kept = [(n[0], -a), (n[2], a), (n[3], a)]  # (tokens, per-token loss -A) of the rows the loss keeps
    expected = {
        # TRL dapo/bnpo: over the unmasked tokens only
        "token_mean": sum(k * x for k, x in kept) / sum(k for k, _ in kept),
        # TRL grpo: mean over all 4 sequences of their token means, the masked one adding 0
        "seq_mean_token_mean": sum(x for _, x in kept) / 4,
        # TRL dr_grpo: sum over tokens / (4 sequences x max_completion_length)
        "seq_mean_token_sum_norm": sum(k * x for k, x in kept) / (4 * cfg.loss_norm_length),
    }[aggregation]
    # float32 sums of a few terms of magnitude ~1
    assert loss == pytest.approx(expected, abs=1e-5)
    assert abs(expected) > 1e-2  # not a vacuous 0


def test_off_by_default_and_refused_with_a_value_model(tiny_models):
    cfg, n, rollout, _, _ = rollout_and_loss(tiny_models)
    assert not cfg.mask_truncated_completions and int(rollout.mask[1].sum()) == n[1]
    with pytest.raises(ConfigError, match="mask_truncated_completions is TRL's GRPO option: it needs an estimator"):
        parse_config(RLVRConfig, [RECIPE, "--mask_truncated_completions", "true"])  # algo ppo: gae, a value model


def test_a_run_with_truncated_completions_masked(tiny_models, tmp_path):
    """The script end to end with response_length 4 (most completions are cut): it trains, and the logged policy loss
    is finite."""
    import json

    from test_reward_functions_trl import command, run, write_rows

    rewards_file = tmp_path / "r.py"
    rewards_file.write_text(
        "def solution_length(completions, solution, **kwargs):\n    return [len(s) for s in solution]\n"
    )
    data, out = write_rows(tmp_path / "rows.jsonl", False), tmp_path / "out"
    argv = command(tiny_models["causal_lm"], data, out, "--reward_functions", f"{rewards_file}:solution_length",
                   "--mask_truncated_completions", "true", "--loss_aggregation", "seq_mean_token_mean")  # fmt: skip
    assert run(argv) == 0
    (train,) = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
    assert train["train/non_stop_rate"] > 0 and math.isfinite(train["loss/policy"])
