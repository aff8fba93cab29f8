"""Reward model trainer (open_instruct/reward_model.py) and its evaluator (eval/reward_model.py) on the tiny model.

One uninterrupted training run (module fixture) is shared by the learning, resume and export tests."""

import json
import math
import os
import random

import pytest
import torch
from tolerances import forward_atol
from training_helpers import (
    assert_rows_match,
    assert_weights_match,
    break_checkpoints,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    read_metrics,
    sigterm_at_step,
)

from open_instruct import reward_model
from open_instruct.checkpoint import find_resume_checkpoint
from open_instruct.errors import DataError
from open_instruct.models import pair_rewards

STEPS = 12  # 192 pairs / (8 per micro-batch x 2 accumulation)


def case_rows(n: int, seed: int) -> list[dict]:
    """A rule a tiny model learns in a few steps: the chosen reply is a lowercase word, the rejected one the same
    word in uppercase (so only the rule, never the content, tells the two apart)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        prompt = [{"role": "user", "content": rng.choice(["Say a word.", "Any word?", "Give me one word."])}]
        rows.append(
            {
                "id": f"case-{seed}-{i}",
                "chosen": prompt + [{"role": "assistant", "content": word}],
                "rejected": prompt + [{"role": "assistant", "content": word.upper()}],
            }
        )
    return rows


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def rm_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm_data")
    return {
        "train": write_jsonl(d / "train.jsonl", case_rows(192, 0)),
        "eval": write_jsonl(d / "eval.jsonl", case_rows(64, 1)),
    }


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rm_args(tiny_models, rm_data, output_dir):
    return [
        os.path.join(REPO, "configs", "rm_tiny.yaml"),
        "--model_name_or_path",
        tiny_models["seq_cls"],
        "--dataset_name_or_path",
        rm_data["train"],
        "--eval_dataset_name_or_path",
        rm_data["eval"],
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "8",
        "--gradient_accumulation_steps",
        "2",
        "--learning_rate",
        "2e-3",
        "--warmup_ratio",
        "0",
        "--logging_steps",
        "1",
        "--eval_steps",
        "6",
        "--checkpointing_steps",
        "4",
        "--keep_last_n_checkpoints",
        "2",
    ]


@pytest.fixture(scope="module")
def full_run(tiny_models, rm_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_full")
    reward_model.main(rm_args(tiny_models, rm_data, out))
    return out


def test_bradley_terry_against_hand_worked_values():
    chosen = torch.tensor([1.0, 0.0, 2.0, 30.0])
    rejected = torch.tensor([0.0, 0.0, 3.0, -30.0])
    losses = reward_model.bradley_terry(chosen, rejected)
    # -log sigmoid(m) = log(1 + e^-m): m = 1, 0, -1, 60
    expected = [math.log(1 + math.exp(-1)), math.log(2), math.log(1 + math.e), math.log1p(math.exp(-60))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert expected[:3] == pytest.approx([0.313262, 0.693147, 1.313262], abs=1e-6)
    sums = reward_model.pair_sums(losses, chosen, rejected)
    metrics = reward_model.summarize(dict(zip(reward_model.STAT_KEYS, sums.tolist())), 4, "train")
    assert metrics["train/loss"] == pytest.approx(sum(expected) / 4, rel=1e-6)
    assert metrics["train/accuracy"] == 0.5  # the tie (0 vs 0) counts as wrong
    assert metrics["train/chosen_reward"] == pytest.approx(33 / 4)
    assert metrics["train/rejected_reward"] == pytest.approx(-27 / 4)
    assert metrics["train/margin"] == pytest.approx(15.0)


def test_margin_and_centering_against_hand_worked_values():
    """TRL's RewardTrainer: loss = mean(-log sigmoid(r_c - r_r - margin)) + coef * mean((r_c + r_r)^2)."""
    chosen = torch.tensor([1.0, 0.0, 2.0])
    rejected = torch.tensor([0.0, 0.0, 3.0])
    margin = torch.tensor([0.5, -1.0, 1.0])
    # r_c - r_r - margin = 0.5, 1, -2 -> log(1 + e^-0.5) = 0.474077, log(1 + e^-1) = 0.313262, log(1 + e^2) = 2.126928
    bt = [0.4740770, 0.3132617, 2.1269280]
    assert reward_model.bradley_terry(chosen, rejected, margin).tolist() == pytest.approx(bt, abs=1e-6)
    # centering, coef 0.1: (1 + 0)^2 = 1, (0 + 0)^2 = 0, (2 + 3)^2 = 25 -> 0.1, 0, 2.5
    losses, center = reward_model.pair_losses(chosen, rejected, margin, 0.1)
    assert center.tolist() == pytest.approx([0.1, 0.0, 2.5], abs=1e-6)
    assert losses.tolist() == pytest.approx([0.5740770, 0.3132617, 4.6269280], abs=1e-6)
    sums = reward_model.pair_sums(losses, chosen, rejected, center, margin)
    metrics = reward_model.summarize(dict(zip(reward_model.STAT_KEYS, sums.tolist())), 3, "train")
    # (0.474077 + 0.313262 + 2.126928) / 3 = 0.971422, + 0.1 * (1 + 0 + 25) / 3 = 0.866667 -> 1.838089
    assert metrics["train/loss"] == pytest.approx(1.838089, abs=1e-6)
    assert metrics["train/center_loss"] == pytest.approx(0.866667, abs=1e-6)
    assert metrics["train/target_margin"] == pytest.approx(0.5 / 3, abs=1e-6)
    assert metrics["train/accuracy"] == pytest.approx(1 / 3)  # only 1 > 0; the margin does not change accuracy
    # Without a margin and with coef 0 the loss is plain Bradley-Terry: margin 1, 0, -1.
    losses, center = reward_model.pair_losses(chosen, rejected, None, 0.0)
    assert losses.tolist() == pytest.approx([0.313262, 0.693147, 1.313262], abs=1e-6) and center.sum() == 0


def test_margin_column_is_read_checked_and_logged(tiny_models, rm_data, tmp_path):
    rows = [json.loads(line) for line in open(rm_data["train"])][:32]
    for i, r in enumerate(rows):
        r["score_gap"] = 0.25 * (i % 4)  # margins 0, 0.25, 0.5, 0.75: mean 0.375 over the 32 rows
    train = write_jsonl(tmp_path / "margins.jsonl", rows)
    out = tmp_path / "run"
    args = rm_args(tiny_models, rm_data, out)
    args += ["--dataset_name_or_path", train, "--eval_dataset_name_or_path", train, "--margin_column", "score_gap"]
    args += ["--center_rewards_coefficient", "0.01"]
    args += ["--eval_steps", "2", "--checkpointing_steps", "100"]
    reward_model.main(args)
    metrics = read_metrics(out)
    train_rows = [m for m in metrics if "train/loss" in m]
    assert len(train_rows) == 2  # 32 pairs / 16 per step
    # The two steps cover the epoch (all 32 rows, shuffled): their mean target margin is the file's mean.
    assert sum(m["train/target_margin"] for m in train_rows) / 2 == pytest.approx(0.375)
    assert all(m["train/center_loss"] > 0 for m in train_rows)
    eval_row = next(m for m in metrics if "eval/loss" in m)
    assert eval_row["eval/target_margin"] == pytest.approx(0.375) and eval_row["eval/center_loss"] > 0
    rows[5]["score_gap"] = "big"
    bad = write_jsonl(tmp_path / "bad_margin.jsonl", rows)
    with pytest.raises(DataError, match=r"bad_margin.jsonl line 6: column 'score_gap' must be a finite number"):
        reward_model.main(
            rm_args(tiny_models, rm_data, tmp_path / "bad")
            + ["--dataset_name_or_path", bad, "--eval_dataset_name_or_path", bad, "--margin_column", "score_gap"]
        )


def test_mixed_eval_set_reports_each_source(tiny_models, rm_data, tmp_path):
    rows = [json.loads(line) for line in open(rm_data["eval"])]
    upper = write_jsonl(tmp_path / "eval_upper.jsonl", rows[:40])
    lower = write_jsonl(tmp_path / "eval_lower.jsonl", rows[40:])  # 24 rows
    out = tmp_path / "run"
    args = rm_args(tiny_models, rm_data, out)
    at = args.index("--eval_dataset_name_or_path")
    args[at : at + 2] = ["--eval_dataset_name_or_path", "null", "--max_train_samples", "32"]
    args += [
        "--eval_dataset_mixer_list",
        upper,
        "1.0",
        lower,
        "12",
        "--eval_steps",
        "2",
        "--checkpointing_steps",
        "100",
    ]
    reward_model.main(args)
    row = [m for m in read_metrics(out) if "eval/loss" in m][-1]
    for key in ("loss", "accuracy", "margin"):
        # 40 pairs from one source, 12 from the other: the overall number is their pair-weighted mean.
        mixed = (40 * row[f"eval/eval_upper/{key}"] + 12 * row[f"eval/eval_lower/{key}"]) / 52
        assert row[f"eval/{key}"] == pytest.approx(mixed, rel=1e-6, abs=1e-9), key  # float32 sums per batch
    assert row["eval/eval_upper/accuracy"] * 40 == pytest.approx(round(row["eval/eval_upper/accuracy"] * 40))


@pytest.mark.numerics
def test_reward_is_read_at_last_non_pad_token(tiny_models, monkeypatch):
    """HF's sequence classifier pools at the last non-pad token when config.pad_token_id is our pad id: a row's
    reward must not depend on the padding added for longer rows, and must equal the head applied by hand.
    The training forward builds no KV cache (transformers fills one whenever use_cache is left unset)."""
    from transformers.cache_utils import DynamicCache

    from open_instruct.data import collate_preferences
    from open_instruct.models import load_sequence_classifier, load_tokenizer

    caches = []
    init = DynamicCache.__init__
    monkeypatch.setattr(DynamicCache, "__init__", lambda self, *a, **kw: caches.append(1) or init(self, *a, **kw))

    tok = load_tokenizer(tiny_models["seq_cls"])
    model = load_sequence_classifier(tiny_models["seq_cls"], pad_token_id=tok.pad_token_id).eval()
    ex = [
        {
            "chosen_ids": tok.encode("hello there"),
            "rejected_ids": tok.encode("a much longer reply, padded"),
            "prompt_len": 1,
        }
    ]
    batch = collate_preferences(ex, tok.pad_token_id)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"].shape[1]  # row 0 is right-padded
    with torch.no_grad():
        chosen, rejected = pair_rewards(model, batch)
        assert caches == []
        model(input_ids=batch["input_ids"])
        assert caches == [1]  # the trap the scripts avoid
        for row, reward in ((ex[0]["chosen_ids"], chosen), (ex[0]["rejected_ids"], rejected)):
            ids = torch.tensor([row])
            alone = model(input_ids=ids).logits.squeeze()
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
            bound = forward_atol(model, batch["input_ids"].shape[1], alone)  # padded row vs alone: sums reorder
            assert abs(reward.item() - alone.item()) <= bound
            assert abs(reward.item() - model.score(hidden).item()) <= bound


def test_rm_learns_a_rule_on_held_out_pairs(full_run):
    rows = read_metrics(full_run)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["optimizer_step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["optimizer_step"] for r in evals] == [6, 12]
    for key in (
        "train/accuracy",
        "train/chosen_reward",
        "train/rejected_reward",
        "train/margin",
        "lr",
        "perf/tokens_per_second",
        "perf/episodes_per_second",
        "episode",
        "optimizer_step",
        "rollout_step",
        "epoch",
    ):
        assert key in train[-1], key
    assert train[-1]["episode"] == STEPS * 16 and train[-1]["epoch"] == 1.0
    final = evals[-1]
    print(
        f"held-out accuracy {final['eval/accuracy']:.3f}, margin {final['eval/margin']:.3f}, "
        f"train loss {train[0]['train/loss']:.3f} -> {train[-1]['train/loss']:.3f}"
    )
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=0.05)  # untrained: rewards nearly equal
    assert final["eval/accuracy"] >= 0.95
    assert final["eval/margin"] > 0.5
    assert final["eval/loss"] < 0.3
    assert final["eval/margin"] == pytest.approx(final["eval/chosen_reward"] - final["eval/rejected_reward"])
    assert os.path.isdir(full_run / "best_model") and os.path.isdir(full_run / "final_model")


def test_rm_resume_after_preemption_matches_uninterrupted_run(
    full_run, tiny_models, rm_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "rm_preempted"
    args = rm_args(tiny_models, rm_data, out)
    with sigterm_at_step(monkeypatch, 6):
        reward_model.main(args)
    assert not (out / "final_model").exists()
    assert max(r["optimizer_step"] for r in read_metrics(out)) == 6
    assert "SIGTERM: checkpoint written at optimizer step 6" in capsys.readouterr().out

    # Debris of saves that crashed after step 6: auto resume must skip it and fall back to step_6.
    broken = break_checkpoints(str(out), 6, (9, 10))
    reward_model.main(args + ["--resume_from_checkpoint", "auto"])
    printed = capsys.readouterr().out
    assert f"skipping checkpoint {broken['truncated']}: file" in printed
    assert f"skipping checkpoint {broken['no_marker']}: no COMPLETE marker" in printed
    assert f"resumed from {out / 'checkpoints' / 'step_6'}" in printed

    assert_rows_match(read_metrics(full_run), read_metrics(out))
    assert_weights_match(full_run / "final_model", out / "final_model")


def test_auto_resume_never_picks_a_half_written_checkpoint(full_run, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(full_run / "checkpoints", out / "checkpoints")
    valid = max(int(p.split("_")[1]) for p in os.listdir(out / "checkpoints"))
    broken = break_checkpoints(str(out), valid, (valid + 1, valid + 2))
    messages = []
    assert find_resume_checkpoint(str(out), messages.append) == str(out / "checkpoints" / f"step_{valid}")
    assert len(messages) == 2, messages  # newest first; the .tmp_ folder is never a candidate
    assert messages[0].startswith(f"skipping checkpoint {broken['truncated']}: file ")
    assert "bytes, manifest says" in messages[0]
    assert messages[1] == f"skipping checkpoint {broken['no_marker']}: no COMPLETE marker (the save was interrupted)"


def test_export_and_final_model_reproduce_the_trained_model(full_run, rm_data, tmp_path, capsys, monkeypatch):
    """`python -m open_instruct.export CHECKPOINT OUT` and final_model/ load with AutoModelForSequenceClassification
    and give the rewards the trainer measured at its last eval (eval/reward_model.py recomputes them)."""
    import sys

    from transformers import AutoModelForSequenceClassification

    from eval import reward_model as rm_eval
    from open_instruct import export

    exported = str(tmp_path / "exported")
    monkeypatch.setattr(sys, "argv", ["export", str(full_run / "checkpoints" / f"step_{STEPS}"), exported])
    export.main()
    final = str(full_run / "final_model")
    logged = [r for r in read_metrics(full_run) if "eval/accuracy" in r][-1]

    scores = {}
    for name, path in (("exported", exported), ("final", final)):
        model = AutoModelForSequenceClassification.from_pretrained(path)
        summary = rm_eval.main(
            [path, rm_data["eval"], "--batch_size", "16", "--output", str(tmp_path / f"{name}.jsonl")]
        )
        assert summary["total"] == 64
        assert summary["accuracy"] == logged["eval/accuracy"]
        assert summary["mean_chosen_reward"] == pytest.approx(logged["eval/chosen_reward"], abs=1e-5)
        assert summary["mean_rejected_reward"] == pytest.approx(logged["eval/rejected_reward"], abs=1e-5)
        assert summary["mean_margin"] == pytest.approx(logged["eval/margin"], abs=1e-5)
        lo, hi = summary["ci95"]
        assert lo < summary["accuracy"] <= hi <= 1.0
        with open(tmp_path / f"{name}.jsonl") as f:
            scores[name] = [json.loads(line) for line in f]
        assert model.config.num_labels == 1
    assert len(scores["final"]) == 64
    for a, b in zip(scores["exported"], scores["final"]):
        assert a["chosen_reward"] == pytest.approx(b["chosen_reward"], abs=1e-6)
    assert "95% CI" in capsys.readouterr().out


def test_eval_summary_numbers():
    from eval.reward_model import summarize_scores

    scores = [
        {"chosen_reward": c, "rejected_reward": r, "margin": c - r, "correct": c > r}
        for c, r in [(1.0, 0.0), (2.0, 1.5), (0.0, 0.0), (-1.0, 1.0)]
    ]
    s = summarize_scores(scores)
    assert (s["correct"], s["total"], s["ties"]) == (2, 4, 1)
    assert s["accuracy"] == 0.5 and s["mean_margin"] == pytest.approx((1 + 0.5 + 0 - 2) / 4)
    # Wilson 95% interval for 2/4: centre (0.5 + z^2/8) / (1 + z^2/4) = 0.5, half-width z*sqrt(1/16 + z^2/64)/(1 +
    # z^2/4)
    z = 1.96
    half = z * math.sqrt(0.25 / 4 + z * z / 64) / (1 + z * z / 4)
    assert s["ci95"] == pytest.approx((0.5 - half, 0.5 + half))
    assert s["ci95"][0] == pytest.approx(0.1500, abs=1e-4)
