"""PPO-ptx (open_instruct/ptx.py): the demonstrations' loss term is the hand NLL weighted by the micro-batch's share
of the step, it enters the RL loss through micro_batch_loss, a run with it learns the demonstrations (and one without
it does not), a killed run resumes to the same rows and weights, and bad settings stop before any model loads."""

from __future__ import annotations

import contextlib
import json
import os
import types

import pytest
import torch
from tolerances import chain_atol, decoder_reduction_lengths
from training_helpers import (
    one_torch_thread,  # noqa: F401  (autouse fixture)
    write_rl_files,
)
from training_helpers import rl_exit_code as exit_code

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "rlvr_tiny.yaml")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from demo.synthetic import sft_rows, write_jsonl

    root = tmp_path_factory.mktemp("ptx_data")
    return {**write_rl_files(root), "ptx": write_jsonl(str(root / "ptx.jsonl"), sft_rows(24, 5))}


def argv(tiny_models, files, out, *extra) -> list[str]:
    """4 rollouts of 4 prompts x 4 completions from the tiny model (GRPO, KL to the reference off)."""
    return [
        RECIPE, "--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", files["train"],
        "--eval_dataset_name_or_path", files["eval"], "--eval_steps", "100", "--output_dir", str(out),
        "--algo", "grpo", "--total_episodes", "64", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "4", "--num_epochs", "1",
        "--response_length", "8", "--checkpointing_steps", "1", "--beta", "0", "--learning_rate", "1e-2", *extra,
    ]  # fmt: skip


def hand_nll(model, examples: list[dict]) -> float:
    """Mean over every trained token (label != -100) of -log p(label), from plain full-logit forwards, one row at a
    time (no padding)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids, labels = torch.tensor([e["input_ids"]]), torch.tensor(e["labels"])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            trained = (labels[1:] != -100).nonzero().squeeze(1)
            total -= float(logp[trained, labels[trained + 1]].sum())
            count += len(trained)
    return total / count


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_term_is_the_hand_nll_times_the_micro_batch_units(tiny_models, files, aggregation):
    """term = ptx_coef x NLL x units, NLL the mean over the drawn rows' trained tokens (hand: full logits),
    units token_mean: the weighted tokens, sequence means: the rows with any weight; the statistic is NLL x units.
    The draw: per_device_train_batch_size distinct rows, the same for the same tokens, others for others."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.ptx import DemonstrationLoss

    cfg = parse_config(RLVRConfig, argv(tiny_models, files, "unused", "--ptx_dataset", files["ptx"], "--ptx_coef",
                                        "0.3", "--loss_aggregation", aggregation))  # fmt: skip
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    loss = DemonstrationLoss(cfg, tokenizer)
    assert len(loss.examples) == 24
    models = types.SimpleNamespace(policy=load_causal_lm(tiny_models["causal_lm"]))
    ids = torch.arange(12).view(3, 4)
    drawn = loss.rows_for(cfg, ids)
    assert len({id(e) for e in drawn}) == 4 and drawn == loss.rows_for(cfg, ids.clone())
    assert loss.rows_for(cfg, ids + 1) != drawn
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    w = mask if aggregation == "token_mean" else mask / mask.sum(1, keepdim=True).clamp(min=1)
    units = 6.0 if aggregation == "token_mean" else 2.0  # the empty third row counts in neither
    term, stats = loss(cfg, models, {"host_input_ids": ids}, mask, w, None)
    nll = hand_nll(models.policy, drawn)
    seq = max(len(e["input_ids"]) for e in drawn)
    tokens = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in drawn)
    atol = chain_atol([*decoder_reduction_lengths(models.policy.config, seq), len(tokenizer), tokens], nll)
    assert abs(float(term.detach()) - 0.3 * nll * units) <= 0.3 * units * atol
    assert abs(float(stats["ptx_loss"]) - nll * units) <= units * atol
    term.backward()  # it trains the policy
    assert all(p.grad is not None for p in models.policy.parameters() if p.requires_grad)


def test_micro_batch_loss_adds_the_term(tiny_models, files):
    """The same rollout rows (scripted tool episodes, tests/test_multiturn_rlvr.py) through micro_batch_loss with and
    without the feature: the losses differ by the feature's term (ptx_coef x the hand NLL of the rows that
    micro-batch draws x its policy tokens: token_mean) and only the first logs ptx_loss; called without features, it
    reads the run's own and gives the first."""
    from test_multiturn_rlvr import ONE_PROCESS, config, play

    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages, features_of, micro_batch_loss
    from open_instruct.rollouts import episode_layout

    cfg = config(tiny_models, "--ptx_dataset", files["ptx"], "--ptx_coef", "0.5", "--beta", "0", "--algo", "grpo")
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    models = RLModels(policy=load_causal_lm(tiny_models["causal_lm"]))
    features = features_of(cfg, (), tokenizer)
    assert [f.name for f in features] == ["episodes", "ptx"]
    prompts, out = play(cfg, tokenizer)
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
    layout = episode_layout(cfg, tokenizer.pad_token_id)
    rollout = collect_rollout(cfg, models, prompts, out, {}, 0, run, False, layout, features)
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    rows = [0, 1, 2, 3]
    with_ptx, stats = micro_batch_loss(cfg, models, rollout, adv, rows, layout, "cpu", contextlib.nullcontext, features)
    without, plain_stats = micro_batch_loss(cfg, models, rollout, adv, rows, layout, "cpu", contextlib.nullcontext, [])
    assert "ptx_loss" in stats and "ptx_loss" not in plain_stats
    _, batch, _ = layout.batch(rollout.episodes, rollout.response_ids, rows, "cpu")
    drawn = features[1].loss_term.rows_for(cfg, batch["host_input_ids"])
    nll = hand_nll(models.policy, drawn)
    units = float((rollout.mask[rows] * adv.keep[rows].unsqueeze(1)).sum())
    assert units > 0
    seq = max(len(e["input_ids"]) for e in drawn)
    # the two losses' common terms are the same operations on the same inputs: they cancel exactly; the term's
    # NLL and the hand one are two evaluation orders of the forward and the token sum
    tokens = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in drawn)
    atol = chain_atol([*decoder_reduction_lengths(models.policy.config, seq), len(tokenizer), tokens], nll)
    atol += chain_atol([units], float(with_ptx.detach().abs()))  # the final sum with the other terms
    assert abs(float((with_ptx - without).detach()) - 0.5 * nll * units) <= 0.5 * units * atol + atol
    # a phase called without `features` reads the run's own (features_of(cfg), the policy's tokenizer loaded for the
    # demonstrations): the same term on the same drawn rows, so the very same loss
    default, default_stats = micro_batch_loss(cfg, models, rollout, adv, rows, layout, "cpu", contextlib.nullcontext)
    assert float(default.detach()) == float(with_ptx.detach()) and default_stats.keys() == stats.keys()


def metric_rows(out) -> list[dict]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def train_rows(out) -> list[dict]:
    return [r for r in metric_rows(out) if "loss/policy" in r]


def test_a_run_with_ptx_learns_the_demonstrations_and_one_without_does_not(tiny_models, files, tmp_path):
    """8 rollouts at lr 1e-2: with ptx_coef 1 the demonstrations' NLL (hand, whole set, final model) falls below
    0.6 x its start and half a run without ptx (measured 4.64 -> 2.08, without: 6.61); loss/ptx is logged every
    rollout, starts near the start's NLL (its draws: 16 of the 24 rows) and falls below 0.65 x (measured 0.52 x);
    time/ptx times its forwards."""
    from transformers import AutoModelForCausalLM

    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.models import load_tokenizer
    from open_instruct.ptx import DemonstrationLoss

    ptx_args = ["--ptx_dataset", files["ptx"], "--ptx_coef", "1.0"]
    common = ["--total_episodes", "128", "--checkpointing_steps", "100"]
    assert exit_code(argv(tiny_models, files, tmp_path / "ptx", *common, *ptx_args)) == 0
    assert exit_code(argv(tiny_models, files, tmp_path / "plain", *common)) == 0
    cfg = parse_config(RLVRConfig, argv(tiny_models, files, "unused", *ptx_args))
    examples = DemonstrationLoss(cfg, load_tokenizer(tiny_models["causal_lm"])).examples
    nll = {
        name: hand_nll(AutoModelForCausalLM.from_pretrained(path), examples)
        for name, path in [
            ("start", tiny_models["causal_lm"]),
            ("ptx", tmp_path / "ptx" / "final_model"),
            ("plain", tmp_path / "plain" / "final_model"),
        ]  # fmt: skip
    }
    logged = [r["loss/ptx"] for r in train_rows(tmp_path / "ptx")]
    print(f"demonstrations' NLL {nll}; loss/ptx by rollout {[round(x, 3) for x in logged]}")
    assert len(logged) == 8 and logged[-1] < 0.65 * logged[0]
    assert abs(logged[0] - nll["start"]) < 0.25 * nll["start"]  # rollout 1: the start, on the rows drawn
    assert nll["ptx"] < 0.6 * nll["start"] and nll["ptx"] < 0.5 * nll["plain"]
    assert train_rows(tmp_path / "plain") and all("loss/ptx" not in r for r in metric_rows(tmp_path / "plain"))
    timed = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("ptx", "plain")}
    assert all(r["time/ptx"] > 0 for r in timed["ptx"] if "loss/policy" in r)  # its forwards, on their own clock
    assert all("time/ptx" not in r for r in timed["plain"])


def test_a_killed_run_with_ptx_resumes_to_the_same_rows_and_weights(tiny_models, files, tmp_path, monkeypatch):
    """SIGTERM during rollout 2 of 4, resume: the metric rows (loss/ptx among them) and the final weights equal the
    uninterrupted run's exactly: the demonstrations each micro-batch draws depend on the seed and its tokens only."""
    from safetensors.torch import load_file
    from training_helpers import sigterm_at_step

    ptx_args = ["--ptx_dataset", files["ptx"], "--ptx_coef", "0.5"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert exit_code(argv(tiny_models, files, full, *ptx_args)) == 0
    with sigterm_at_step(monkeypatch, 2):
        assert exit_code(argv(tiny_models, files, cut, *ptx_args)) == 0
    assert max(r["rollout_step"] for r in metric_rows(cut)) == 2
    assert exit_code(argv(tiny_models, files, cut, *ptx_args, "--resume_from_checkpoint", "auto")) == 0
    assert metric_rows(cut) == metric_rows(full)
    assert [r["rollout_step"] for r in train_rows(full) if "loss/ptx" in r] == [1, 2, 3, 4]
    a, b = (load_file(out / "final_model" / "model.safetensors") for out in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--ptx_coef", "0.1"], ["ptx_coef 0.1 needs ptx_dataset"]),
        (["--ptx_dataset", "PTX"], ["ptx_dataset", "ptx_coef is 0"]),
        (["--ptx_dataset", "PTX", "--ptx_coef", "-1"], ["ptx_coef", "-1"]),
        (["--ptx_dataset", "MISSING", "--ptx_coef", "0.1"], ["missing.jsonl", "does not exist"]),
        (["--ptx_dataset", "TRAIN", "--ptx_coef", "0.1"], ["train.jsonl", "messages"]),  # prompts, no assistant turn
    ],
)
def test_bad_ptx_settings_exit_2_before_any_model_loads(tiny_models, files, tmp_path, monkeypatch, capsys, extra,
                                                        words):  # fmt: skip
    from open_instruct import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    monkeypatch.setattr(models, "load_policy", refuse)
    paths = {"PTX": files["ptx"], "MISSING": str(tmp_path / "missing.jsonl"), "TRAIN": files["train"]}
    extra = [paths.get(e, e) for e in extra]
    assert exit_code(argv(tiny_models, files, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_planner_counts_ptx(repo_root, files, capsys):
    """rlvr_8b under GRPO (no value model): PPO-ptx's phase is the policy's training compute again (as many
    demonstrations per micro-batch, as long), and a training micro-batch's kept activations double (a demonstration
    is at most an episode's length: ptx.demonstrations_config)."""
    from open_instruct.plan import main as plan_main

    base = [os.path.join(repo_root, "configs", "rlvr_8b.yaml"), "--num_processes", "7", "--json", "--beta", "0",
            "--value_model_path", "null", "--algo", "grpo", "--num_samples_per_prompt", "4", "--score_placement",
            "last_token"]  # fmt: skip
    plans = {}
    for name, extra in (("plain", []), ("ptx", ["--ptx_dataset", files["ptx"], "--ptx_coef", "0.05"])):
        assert plan_main([*base, *extra]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    phases = plans["ptx"]["phase_hours"]
    assert "ptx" not in plans["plain"]["phase_hours"]
    assert phases["ptx"] == pytest.approx(phases["training compute"], rel=1e-12)
    assert phases["training compute"] == pytest.approx(plans["plain"]["phase_hours"]["training compute"], rel=1e-12)
    kept = [p["memory"]["phases"]["training micro-batch"]["activations (checkpointed)"] for p in plans.values()]
    assert kept[1] == pytest.approx(2 * kept[0], rel=1e-12)


def test_a_demonstration_longer_than_an_episode_is_dropped(tiny_models, files):
    """Demonstrations are bounded by an episode's tokens (max_prompt_length + response_length), as the planner
    counts them: with a 58 + 8 token episode exactly the rows of at most 66 tokens are kept (overlong drop), and
    with overlong truncate every row is kept, cut to 66."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.models import load_tokenizer
    from open_instruct.ptx import DemonstrationLoss

    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    ptx = ["--ptx_dataset", files["ptx"], "--ptx_coef", "0.1"]
    wide = DemonstrationLoss(parse_config(RLVRConfig, argv(tiny_models, files, "unused", *ptx)), tokenizer)
    lengths = [len(e["input_ids"]) for e in wide.examples]
    assert len(lengths) == 24 and min(lengths) <= 66 < max(lengths)  # the bound splits this data
    short = ["--max_prompt_length", "58", "--response_length", "8"]
    kept = DemonstrationLoss(parse_config(RLVRConfig, argv(tiny_models, files, "unused", *ptx, *short)), tokenizer)
    assert sorted(len(e["input_ids"]) for e in kept.examples) == sorted(n for n in lengths if n <= 66)
    cut = parse_config(RLVRConfig, argv(tiny_models, files, "unused", *ptx, *short, "--overlong", "truncate"))
    assert sorted(len(e["input_ids"]) for e in DemonstrationLoss(cut, tokenizer).examples) == sorted(
        min(n, 66) for n in lengths
    )


def test_demonstrations_are_tokenized_once_and_never_split_off_as_held_out(tiny_models, files, tmp_path):
    """The demonstrations go through the tokenized-data cache like a train set: a second run reads the same examples
    back, a different bound is a different entry, and the RL run's own held-out settings (eval_fraction,
    max_train_samples) leave every demonstration in."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.models import load_tokenizer
    from open_instruct.ptx import DemonstrationLoss

    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    ptx = ["--ptx_dataset", files["ptx"], "--ptx_coef", "0.1", "--dataset_cache_dir", str(tmp_path / "cache")]
    cfg = lambda *extra: parse_config(RLVRConfig, argv(tiny_models, files, "unused", *ptx, *extra))  # noqa: E731
    first, again = DemonstrationLoss(cfg(), tokenizer), DemonstrationLoss(cfg(), tokenizer)
    assert "written to the cache" in first.stats.inputs and "read from the cache" in again.stats.inputs
    assert again.examples == first.examples and len(first.examples) == 24
    bounded = DemonstrationLoss(cfg("--max_prompt_length", "58", "--response_length", "8"), tokenizer)
    assert "written to the cache" in bounded.stats.inputs and len(bounded.examples) < 24
    split = DemonstrationLoss(cfg("--eval_dataset_name_or_path", "", "--eval_fraction", "0.5",
                                  "--max_train_samples", "4"), tokenizer)  # fmt: skip
    assert [e["input_ids"] for e in split.examples] == [e["input_ids"] for e in first.examples]
