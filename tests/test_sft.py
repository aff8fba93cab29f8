"""SFT trainer (open_instruct/sft.py) on the tiny model: learning, exact resume after preemption, export.

One uninterrupted training run (module fixture) is shared by the tests."""

import os

import pytest
import torch
from training_helpers import (
    assert_rows_match,
    assert_weights_match,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    read_metrics,
    sigterm_at_step,
)

from demo.synthetic import sft_rows, write_jsonl
from open_instruct import sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20  # 160 conversations / 8 per step


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_data")
    return {
        "train": write_jsonl(str(d / "train.jsonl"), sft_rows(160, 0)),
        "eval": write_jsonl(str(d / "eval.jsonl"), sft_rows(48, 1)),
    }


def sft_args(tiny_models, sft_data, output_dir):
    return [
        os.path.join(REPO, "configs", "sft_tiny.yaml"),
        "--model_name_or_path",
        tiny_models["causal_lm"],
        "--dataset_name_or_path",
        sft_data["train"],
        "--eval_dataset_name_or_path",
        sft_data["eval"],
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--learning_rate",
        "1e-2",
        "--lr_scheduler_type",
        "constant",
        "--warmup_ratio",
        "0",
        "--logging_steps",
        "1",
        "--eval_steps",
        "10",
        "--checkpointing_steps",
        "5",
        "--keep_last_n_checkpoints",
        "2",
    ]


@pytest.fixture(scope="module")
def full_run(tiny_models, sft_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_full")
    sft.main(sft_args(tiny_models, sft_data, out))
    return out


def test_sft_loss_falls_by_half(full_run):
    rows = read_metrics(full_run)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["optimizer_step"] for r in train] == list(range(1, STEPS + 1))
    first, last, final_eval = train[0]["train/loss"], train[-1]["train/loss"], evals[-1]["eval/loss"]
    print(f"SFT loss {first:.3f} -> {last:.3f} (held-out {final_eval:.3f})")
    assert first == pytest.approx(4.66, abs=0.15)  # ~ln(vocab 105): the untrained model is near uniform
    assert last <= 0.5 * first
    assert final_eval <= 0.5 * first
    assert train[-1]["episode"] == STEPS * 8 and train[-1]["epoch"] == 1.0


def test_sft_resume_after_preemption_matches_uninterrupted_run(
    full_run, tiny_models, sft_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "sft_preempted"
    args = sft_args(tiny_models, sft_data, out)
    with sigterm_at_step(monkeypatch, 12):
        sft.main(args)
    assert not (out / "final_model").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_10", "step_12"]
    assert "SIGTERM: checkpoint written at optimizer step 12" in capsys.readouterr().out

    sft.main(args + ["--resume_from_checkpoint", "auto"])
    assert f"resumed from {out / 'checkpoints' / 'step_12'}" in capsys.readouterr().out
    assert_rows_match(read_metrics(full_run), read_metrics(out))
    assert_weights_match(full_run / "final_model", out / "final_model")


def test_export_and_final_model_reproduce_the_trained_model(full_run, sft_data, tmp_path):
    """The exported last checkpoint and final_model/ load with AutoModelForCausalLM, give the same logits, and
    reproduce the held-out loss the trainer logged at its last step."""
    from transformers import AutoModelForCausalLM

    from open_instruct import data
    from open_instruct.config import SFTConfig
    from open_instruct.export import export_checkpoint
    from open_instruct.models import load_tokenizer

    exported = export_checkpoint(str(full_run / "checkpoints" / f"step_{STEPS}"), str(tmp_path / "exported"))
    final = str(full_run / "final_model")
    tokenizer = load_tokenizer(final)
    cfg = SFTConfig(model_name_or_path=final, dataset_name_or_path=sft_data["eval"], max_seq_length=128)
    examples, _ = data.tokenize_sft(data.load_rows(sft_data["eval"]), tokenizer, cfg)
    batch = data.collate_sft(examples, tokenizer.pad_token_id)
    logged = [r for r in read_metrics(full_run) if "eval/loss" in r][-1]["eval/loss"]

    logits = {}
    for name, path in (("exported", exported), ("final", final)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            loss_sum, tokens = sft.token_loss_sum(model, batch)
            logits[name] = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert (loss_sum / tokens).item() == pytest.approx(logged, rel=1e-5)
    assert torch.allclose(logits["exported"], logits["final"], atol=1e-5)
