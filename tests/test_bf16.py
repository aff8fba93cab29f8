"""`mixed_precision: bf16` on CPU: autocast really runs (bf16 matmuls), master weights, gradients and optimizer state
stay fp32, log-probs and scalar heads are computed in fp32, losses stay close to fp32's, and short runs of the
scripts learn. fp16, which accelerate does not autocast on CPU, is refused instead of silently running in fp32.

accelerate keeps one process-wide AcceleratorState whose precision cannot change once set, so every test here
resets it before and after (the other test modules run with precision "no")."""

import math

import pytest
import torch
from tolerances import chain_atol
from training_helpers import one_torch_thread, read_metrics, recipe_args  # noqa: F401  (autouse fixture)

from demo.synthetic import preference_rows, rl_rows, sft_rows, write_jsonl
from open_instruct import dpo, rlvr_ppo, sft
from open_instruct.models import load_causal_lm, load_sequence_classifier, pair_logps, token_logprobs

pytestmark = pytest.mark.numerics  # every test here compares numbers computed two ways


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def accelerator(precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return Accelerator(mixed_precision=precision)


def sft_batch(tokenizer_path: str, n: int = 8) -> dict[str, torch.Tensor]:
    from open_instruct import data
    from open_instruct.config import SFTConfig
    from open_instruct.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    rows = [data.Row(source="mem", index=i, line=None, data=r) for i, r in enumerate(sft_rows(n, 0))]
    cfg = SFTConfig(model_name_or_path=tokenizer_path, dataset_name_or_path="unused.jsonl")
    examples, _ = data.tokenize_sft(rows, tokenizer, cfg)
    return data.collate_sft(examples, tokenizer.pad_token_id)


def test_bf16_autocasts_on_cpu_and_keeps_fp32_master_weights(tiny_models):
    acc = accelerator("bf16")
    model = load_causal_lm(tiny_models["causal_lm"])
    seen = {}
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.update(q_proj=o.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    batch = sft_batch(tiny_models["causal_lm"])
    with acc.autocast():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum, tokens = sft.token_loss_sum(model, batch)
    acc.backward(loss_sum / tokens)
    optimizer.step()
    assert seen["q_proj"] == torch.bfloat16  # the matmuls really ran in bf16 (accelerate autocasts on CPU)
    assert logits.dtype == torch.float32 and loss_sum.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    assert states and {v.dtype for v in states} == {torch.float32}


def test_bf16_losses_and_logprobs_stay_close_to_fp32(tiny_models):
    """The same batch in fp32 and under bf16 autocast: the SFT loss within 1% (relative), DPO's summed response
    log-probs within 1% and per-token RL log-probs (fp32 log-softmax of upcast logits) within 0.05 nats. Each must
    also differ from fp32 somewhat, or bf16 was not used at all."""
    from open_instruct import data
    from open_instruct.models import load_tokenizer

    batch = sft_batch(tiny_models["causal_lm"])
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = dpo.DPOConfig(model_name_or_path="m", dataset_name_or_path="d.jsonl")
    rows = [data.Row(source="mem", index=i, line=None, data=r) for i, r in enumerate(preference_rows(8, 0))]
    pairs = data.collate_preferences(data.tokenize_preferences(rows, tokenizer, cfg)[0], tokenizer.pad_token_id)
    out = {}
    for precision in ("no", "bf16"):
        acc = accelerator(precision)
        model = acc.prepare_model(load_causal_lm(tiny_models["causal_lm"]), evaluation_mode=True)
        with torch.no_grad(), acc.autocast():
            loss_sum, tokens = sft.token_loss_sum(model, batch)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            per_token = token_logprobs(logits, batch["input_ids"][:, 1:])
            out[precision] = (float(loss_sum / tokens), pair_logps(model, pairs), per_token, logits.dtype)
    (loss32, lp32, tok32, _), (loss16, lp16, tok16, dtype16) = out["no"], out["bf16"]
    print(
        f"bf16 vs fp32: SFT loss {loss16:.5f} vs {loss32:.5f}; DPO summed log-probs max relative gap "
        f"{((lp32.chosen - lp16.chosen).abs() / lp32.chosen.abs()).max().item():.2e}; per-token log-prob max gap "
        f"{(tok32 - tok16).abs()[batch['attention_mask'][:, 1:].bool()].max().item():.2e} nats"
    )
    assert dtype16 == torch.float32  # logits reach the log-softmax in fp32
    assert 0 < abs(loss16 - loss32) / loss32 < 0.01, (loss32, loss16)
    for a, b in ((lp32.chosen, lp16.chosen), (lp32.rejected, lp16.rejected)):
        rel = ((a - b).abs() / a.abs()).max().item()
        assert 0 < rel < 0.01, rel
    real = batch["attention_mask"][:, 1:].bool()
    gap = (tok32 - tok16).abs()[real].max().item()
    assert 0 < gap < 0.05, gap


def test_scalar_heads_compute_in_fp32_under_bf16(tiny_models):
    """A reward/value head's output equals the fp32 product of its input and weight (bf16 would be ~1e-3 off)."""
    acc = accelerator("bf16")
    model = load_sequence_classifier(tiny_models["seq_cls"], pad_token_id=0)
    seen = {}
    model.score.register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach(), y=o.detach()))
    model = acc.prepare_model(model, evaluation_mode=True)
    ids = torch.randint(5, 90, (4, 12))
    with torch.no_grad(), acc.autocast():
        model(input_ids=ids)
    weight = model.score.weight.detach()
    exact = seen["x"].float() @ weight.float().T
    in_bf16 = (seen["x"].bfloat16() @ weight.bfloat16().T).float()
    assert seen["y"].dtype == torch.float32
    # the same fp32 product (a hidden-64 dot product) in another order; a bf16 head would be off by ~u(bf16) = 2e-3
    bound = chain_atol([weight.shape[1]], (seen["x"].float().abs() @ weight.float().abs().T).max().item())
    assert (seen["y"] - exact).abs().max().item() <= bound
    assert (in_bf16 - exact).abs().max() > 10 * bound  # the check above would catch a bf16 head


def test_fp16_on_cpu_is_refused_not_silently_fp32(tiny_models, tmp_path):
    train = write_jsonl(str(tmp_path / "train.jsonl"), sft_rows(16, 0))
    args = recipe_args("sft_tiny.yaml", tiny_models["causal_lm"], train, train, tmp_path / "out")
    args += ["--mixed_precision", "fp16"]
    from open_instruct import runtime

    with pytest.raises(SystemExit) as e:
        runtime.run(sft.main, args)
    assert e.value.code == 2


def sft_run(tiny_models, tmp_path, precision: str) -> list[float]:
    train = write_jsonl(str(tmp_path / "sft_train.jsonl"), sft_rows(160, 0))
    out = tmp_path / f"sft_{precision}"
    args = recipe_args("sft_tiny.yaml", tiny_models["causal_lm"], train, train, out)
    args += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-2"]
    args += ["--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--logging_steps", "1", "--eval_steps", "100"]
    args += ["--checkpointing_steps", "100", "--save_final_model", "false", "--mixed_precision", precision]
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    sft.main(args)
    return [r["train/loss"] for r in read_metrics(str(out)) if "train/loss" in r]


def test_bf16_sft_learns_like_fp32(tiny_models, tmp_path):
    """20 steps of SFT: bf16 halves the loss as fp32 does, and each step's loss is within 5% of fp32's (the same
    data and initial weights; the gap grows slowly as the two runs' weights drift apart)."""
    fp32, bf16 = sft_run(tiny_models, tmp_path, "no"), sft_run(tiny_models, tmp_path, "bf16")
    print("fp32", [round(x, 3) for x in fp32], "\nbf16", [round(x, 3) for x in bf16])
    assert len(bf16) == len(fp32) == 20
    assert bf16[-1] <= 0.5 * bf16[0]
    assert bf16 != fp32
    assert all(abs(a - b) <= 0.05 * a for a, b in zip(fp32, bf16)), list(zip(fp32, bf16))


def test_bf16_dpo_reference_cache_reproduced_at_step_0_and_learns(tiny_models, tmp_path):
    """The reference pass and the policy at step 0 both run under bf16 autocast on the same batches: the step-0
    eval's log-ratios are exactly 0 (the cache is read in the precision it was written), and the policy fits its
    training pairs (evaluated on them: from the untrained model, held-out pairs need an SFT stage first)."""
    train = evals = write_jsonl(str(tmp_path / "pref_train.jsonl"), preference_rows(64, 0))
    out = tmp_path / "dpo_bf16"
    args = recipe_args("dpo_tiny.yaml", tiny_models["causal_lm"], train, evals, out)
    args += ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--total_episodes", "96"]
    args += ["--eval_steps", "12", "--checkpointing_steps", "100", "--logging_steps", "1", "--learning_rate", "3e-3"]
    args += ["--save_final_model", "false", "--mixed_precision", "bf16", "--warmup_ratio", "0"]
    dpo.main(args)
    evals_rows = [r for r in read_metrics(str(out)) if "eval/rewards/margin" in r]
    first, last = evals_rows[0], evals_rows[-1]
    assert first["optimizer_step"] == 0
    assert first["eval/rewards/chosen"] == 0.0 and first["eval/rewards/rejected"] == 0.0
    print("margins", [round(r["eval/rewards/margin"], 3) for r in evals_rows])
    assert last["eval/rewards/margin"] > 0.1 and last["eval/rewards/accuracy"] > 0.7, last


def test_bf16_grpo_rollout_logprobs_match_sampler(tiny_models, tmp_path):
    """GRPO under bf16: generation and the trainer's re-score both run under autocast and their per-token log-probs
    (fp32 log-softmax) agree to a small mean gap; the run finishes with finite losses."""
    train = write_jsonl(str(tmp_path / "rl_train.jsonl"), rl_rows(64, 0))
    out = tmp_path / "grpo_bf16"
    args = recipe_args("rlvr_tiny.yaml", tiny_models["causal_lm"], train, train, out)
    args += ["--algo", "grpo", "--num_samples_per_prompt", "4", "--local_rollout_batch_size", "8"]
    args += ["--per_device_train_batch_size", "16", "--total_episodes", "64", "--num_epochs", "1", "--beta", "0.01"]
    args += ["--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false"]
    args += ["--mixed_precision", "bf16", "--max_eval_samples", "8"]
    rlvr_ppo.main(args)
    rows = [r for r in read_metrics(str(out)) if "train/sampler_logp_abs_diff" in r]
    assert len(rows) == 2
    print("sampler vs trainer mean |logp gap| per token", [r["train/sampler_logp_abs_diff"] for r in rows])
    for r in rows:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["train/kl"])
        assert r["train/sampler_logp_abs_diff"] < 0.02, r["train/sampler_logp_abs_diff"]
