"""The console a researcher reads (open_instruct/console.py): the progress bar's key numbers, one line per eval, a
plain start-up summary and an end-of-run summary, checked as text and in a real DPO run."""

import copy
import json
import math
import os

from demo.synthetic import preference_rows, write_jsonl
from open_instruct import console, dpo
from open_instruct.config import DPOConfig, RLVRConfig, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bar_shows_each_scripts_key_numbers():
    dpo_row = {"train/loss": 0.523412, "train/rewards/accuracy": 0.8125, "train/rewards/margin": 0.77123, "lr": 1e-3}
    assert console.bar_postfix(dpo_row) == {"loss": "0.5234", "acc": "0.8125", "margin": "0.7712"}
    rm_row = {"train/loss": 0.5, "train/accuracy": 0.75, "train/margin": 1.5}
    assert console.bar_postfix(rm_row) == {"loss": "0.5", "acc": "0.75", "margin": "1.5"}
    rl_row = {"train/correct_rate": 0.0703125, "train/score_mean": 0.0703125, "train/kl": 0.3875, "train/entropy": 2}
    assert console.bar_postfix(rl_row) == {"correct": "0.07031", "score": "0.07031", "kl": "0.3875"}
    assert console.bar_postfix({"eval/loss": 1.0}) == {}


def test_bar_shows_the_score_and_each_reward_function_in_a_run_driven_by_them():
    """Issue 41: rows scored by reward functions alone have no verifier, so `correct` is 0 and not shown; the score
    that drives training and each function's mean are."""
    row = {"train/correct_rate": 0.0, "train/score_mean": 0.3125, "reward/accuracy/mean": 0.3125,
           "reward/accuracy/std": 0.46, "reward/brevity/mean": -0.05, "train/kl": 0.5}  # fmt: skip
    assert console.bar_postfix(row) == {"score": "0.3125", "accuracy": "0.3125", "brevity": "-0.05", "kl": "0.5"}
    with_verifiers = {**row, "train/correct_rate": 0.25}
    assert list(console.bar_postfix(with_verifiers)) == ["correct", "score", "accuracy", "brevity", "kl"]


def test_eval_line_is_compact_with_the_per_source_headline():
    row = {
        "rollout_step": 8,
        "eval/correct_rate": 0.5,
        "eval/score_mean": 5.0,
        "eval/response_length": 6.5,
        "eval/non_stop_rate": 0.0,
        "eval/gsm8k/correct_rate": 0.25,
        "eval/math/correct_rate": 0.75,
    }
    assert console.eval_line(row, "rollout_step") == (
        "eval @ rollout 8: correct 0.5 | score 5 | length 6.5 | gsm8k 0.25 | math 0.75"
    )
    assert console.eval_line({"optimizer_step": 3, "eval/loss": 1.23456, "eval/perplexity": math.exp(1.23456)}) == (
        "eval @ step 3: loss 1.235 | ppl 3.437"
    )
    assert console.eval_line({"optimizer_step": 3, "train/loss": 1.0}) is None


def _cfg(cls, recipe, *extra):
    return parse_config(cls, [os.path.join(REPO, "configs", recipe), *extra])


def test_startup_summary_is_plain_words_not_a_dict():
    cfg = _cfg(DPOConfig, "dpo_tiny.yaml", "--mixed_precision", "bf16")
    text = console.startup_summary(cfg, cfg.batch_plan(1, 2000), "2000/2000 rows kept", 200)
    assert text.splitlines() == [
        "dpo: output/dpo_tiny  (model output/sft_tiny/final_model; 1 process, bf16 (fp32 master weights); loss dpo, "
        "beta 0.5)",
        "  data   2000/2000 rows kept; 200 held-out pairs",
        "  batch  16 x 2 accumulation x 1 process = 32 pairs per optimizer step; 62 steps (1 epoch of 2,000)",
        "  run    eval every 20 steps and at the end; best_model/ by eval/rewards/accuracy (max); checkpoint every 20 "
        "steps (last 2 kept); metrics.jsonl",
    ]
    rl = _cfg(RLVRConfig, "rlvr_tiny.yaml")
    text = console.startup_summary(rl, rl.batch_plan(2, 2000), "2000/2000 rows kept", 200)
    assert "{" not in text  # the RL start line printed plan.to_dict() raw
    assert "; ppo (gae advantages, ppo loss), generation hf)" in text.splitlines()[0]
    custom = copy.copy(rl)  # (replace would import the file the name points at)
    custom.policy_loss, custom.kl_estimator = "my_losses.py:capped", "k3"
    first = console.startup_summary(custom, rl.batch_plan(2, 2000), "", 200).splitlines()[0]
    assert "(gae advantages, my_losses.py:capped loss, k3 KL)" in first  # a user's loss is named like its estimator
    assert text.splitlines()[2] == (
        "  batch  64 prompts x 4 = 256 completions per rollout; 2 epoch(s) x 2 mini-batch(es) of 64 x 1 accumulation "
        "x 2 processes = 128; 8 rollouts, 32 optimizer steps (2,048 completions)"
    )


def test_end_summary_names_final_best_paths_time_and_rate():
    cfg = _cfg(DPOConfig, "dpo_tiny.yaml")
    rows = [
        {"optimizer_step": 0, "eval/rewards/accuracy": 0.5},
        {"optimizer_step": 10, "train/loss": 0.6},
        {"optimizer_step": 20, "eval/rewards/accuracy": 0.84},
        {"optimizer_step": 40, "eval/rewards/accuracy": 0.8},
    ]
    counters = {"optimizer_step": 40, "episode": 1280}
    text = console.end_summary(
        cfg, rows, counters, "optimizer_step", 200.4, 1_000_000, "tokens trained", 0.84, "output/dpo_tiny/final_model"
    )
    assert text.splitlines() == [
        "done: 40 optimizer steps, 1,280 episodes in 3 min 20 s; 1,000,000 tokens trained (4,990/s)",
        "  eval/rewards/accuracy: final 0.8 (step 40), best 0.84 at step 20 -> output/dpo_tiny/best_model",
        "  final_model: output/dpo_tiny/final_model",
        "  metrics: output/dpo_tiny/metrics.jsonl",
    ]


def test_a_dpo_run_prints_the_console(tiny_models, tmp_path, capsys):
    """A real run: start-up summary, the step-0 eval line (policy == reference: accuracy 0.5 by the tie rule, margin
    0, loss ln 2), the bar with accuracy and margin, and the end summary matching metrics.jsonl and the folders."""
    data = write_jsonl(str(tmp_path / "pref.jsonl"), preference_rows(64, 3))
    out = tmp_path / "run"
    dpo.main(
        [os.path.join(REPO, "configs", "dpo_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
         "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data, "--output_dir", str(out),
         "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
         "--eval_steps", "2", "--checkpointing_steps", "100"]
    )  # fmt: skip
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith(f"dpo: {out}  (model {tiny_models['causal_lm']}; 1 process, fp32; loss dpo, beta 0.5)")
    assert "eval @ step 0: acc 0.5 | margin 0 | loss 0.6931" in lines
    assert "acc=" in captured.err and "margin=" in captured.err and "loss=" in captured.err  # the tqdm bar
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in rows if "eval/rewards/accuracy" in r]
    assert [r["optimizer_step"] for r in evals] == [0, 2, 4]
    for r in evals[1:]:  # every eval row has its line
        acc, margin = r["eval/rewards/accuracy"], r["eval/rewards/margin"]
        assert f"eval @ step {r['optimizer_step']}: acc {acc:.4g} | margin {margin:.4g}" in captured.out
    done = next(i for i, line in enumerate(lines) if line.startswith("done: "))
    assert lines[done].startswith("done: 4 optimizer steps, 64 episodes in ") and " tokens trained (" in lines[done]
    best = max(r["eval/rewards/accuracy"] for r in evals[1:])  # the step-0 row does not pick best_model
    assert lines[done + 1].startswith(
        f"  eval/rewards/accuracy: final {evals[-1]['eval/rewards/accuracy']:.4g} (step 4), best {best:.4g} at step "
    )
    assert lines[done + 1].endswith(f" -> {out}/best_model") and os.path.isdir(out / "best_model")
    assert lines[done + 2] == f"  final_model: {out}/final_model" and os.path.isdir(out / "final_model")
