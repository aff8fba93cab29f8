"""On-policy distillation (open_instruct/distillation.py, rlvr_ppo.py's `distill` row): the generalized JSD equals
TRL 1.16's two implementations (loss and gradients), the reverse-KL advantage is the hand formula, a teacher equal to
the student gives nothing to learn, bad teachers stop before any model loads, a run resumes bit-exactly and lowers
its KL to the teacher."""

from __future__ import annotations

import contextlib
import math
import os
import types

import pytest
import torch
from tolerances import chain_atol
from training_helpers import (
    one_torch_thread,  # noqa: F401  (autouse fixture)
    write_rl_files,
)
from training_helpers import rl_exit_code as exit_code

from open_instruct.distillation import chunked_generalized_jsd, generalized_jsd
from open_instruct.rl_algorithms import teacher_advantages
from open_instruct.rollouts import episode_layout

N_ROWS, WIDTH, H_STUDENT, H_TEACHER, VOCAB = 3, 5, 8, 12, 40


def hidden_states(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "student_hidden": torch.randn(N_ROWS, WIDTH, H_STUDENT, generator=g),
        "teacher_hidden": torch.randn(N_ROWS, WIDTH, H_TEACHER, generator=g),
        "student_weight": torch.randn(VOCAB, H_STUDENT, generator=g) / 2,
        "teacher_weight": torch.randn(VOCAB, H_TEACHER, generator=g) / 2,
        "mask": torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32),
    }


def ours(x: dict[str, torch.Tensor], beta: float, temperature: float, chunk: int = 4) -> torch.Tensor:
    """Mean over the mask of chunked_generalized_jsd (the masked positions are left out, as TRL leaves them)."""
    valid = x["mask"].reshape(-1) > 0
    per_token = chunked_generalized_jsd(
        x["student_hidden"].flatten(0, 1)[valid],
        x["student_weight"],
        x["teacher_hidden"].flatten(0, 1)[valid],
        x["teacher_weight"],
        beta,
        temperature,
        chunk=chunk,
    )
    return per_token.sum() / valid.sum()


def trl_chunked(x: dict[str, torch.Tensor], beta: float, temperature: float) -> torch.Tensor:
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    loss, _, _ = _chunked_divergence_loss(
        x["student_hidden"],
        x["teacher_hidden"],
        x["student_weight"],
        x["teacher_weight"],
        x["mask"],
        beta,
        temperature=temperature,
    )
    return loss


def trl_gold(x: dict[str, torch.Tensor], beta: float, temperature: float) -> torch.Tensor:
    from trl.experimental.gold.gold_trainer import GOLDTrainer

    student_logits = x["student_hidden"] @ x["student_weight"].t()
    teacher_logits = x["teacher_hidden"] @ x["teacher_weight"].t()
    labels = torch.where(x["mask"] > 0, 0, -100)
    return GOLDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature)


def loss_and_grads(fn, x: dict[str, torch.Tensor], beta: float, temperature: float) -> list[torch.Tensor]:
    x = {k: v.clone().requires_grad_(k.startswith("student")) for k, v in x.items()}
    loss = fn(x, beta, temperature)
    loss.backward()
    return [loss.detach(), x["student_hidden"].grad, x["student_weight"].grad]


def divergence_atol(x: dict[str, torch.Tensor], temperature: float) -> float:
    """Two float32 evaluation orders of logits (dot products of H terms) and of the log-softmax / KL sums over the
    vocabulary (V terms, three reductions: logsumexp, the weighted sum, the mean over tokens) differ by at most the
    chain's gamma times the largest logit (the log-probabilities' scale); both models', hence x 2."""
    z = max(
        (x["student_hidden"] @ x["student_weight"].t()).abs().max().item(),
        (x["teacher_hidden"] @ x["teacher_weight"].t()).abs().max().item(),
    )
    return chain_atol([H_TEACHER, VOCAB, VOCAB, N_ROWS * WIDTH], z / temperature)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_loss_and_gradients_equal_trl(beta, temperature):
    x = hidden_states(0)
    mine = loss_and_grads(ours, x, beta, temperature)
    atol = divergence_atol(x, temperature)
    for reference in (trl_chunked, trl_gold):
        theirs = loss_and_grads(reference, x, beta, temperature)
        assert mine[0] > 10 * atol  # a divergence well above rounding: the comparison can fail
        torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=atol)
        for a, b in zip(mine[1:], theirs[1:]):
            # gradients: the same chain, scaled by the largest gradient entry
            torch.testing.assert_close(a, b, rtol=0, atol=atol * max(b.abs().max().item(), 1e-12) / mine[0].item())


def test_jsd_chunking_does_not_change_the_result():
    x = hidden_states(1)
    for chunk in (1, 5, 100):
        torch.testing.assert_close(ours(x, 0.5, 1.0, chunk), ours(x, 0.5, 1.0, 4), rtol=0, atol=divergence_atol(x, 1.0))


def test_jsd_top_k_is_the_divergence_of_the_renormalised_top_k():
    g = torch.Generator().manual_seed(2)
    zs, zt = torch.randn(6, VOCAB, generator=g), torch.randn(6, VOCAB, generator=g)
    k = 5
    # by hand: the teacher's 5 likeliest tokens of each row, both renormalised there, reverse KL
    index = zt.topk(k, -1).indices
    ps, pt = torch.softmax(zs.gather(1, index), -1), torch.softmax(zt.gather(1, index), -1)
    hand = (ps * (ps.log() - pt.log())).sum(-1)
    atol = chain_atol([k, k], max(zs.abs().max().item(), zt.abs().max().item()))
    torch.testing.assert_close(generalized_jsd(zs, zt, 1.0, top_k=k), hand, rtol=0, atol=atol)
    # k at the vocabulary size is the full divergence
    torch.testing.assert_close(generalized_jsd(zs, zt, 0.5, top_k=VOCAB), generalized_jsd(zs, zt, 0.5), rtol=0, atol=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_teacher_equal_to_the_student_gives_zero_loss_and_gradient(beta):
    x = hidden_states(3)
    x["teacher_hidden"], x["teacher_weight"] = x["student_hidden"].clone(), x["student_weight"].clone()
    loss, grad_hidden, grad_weight = loss_and_grads(ours, {**x}, beta, 1.0)
    atol = divergence_atol(x, 1.0)
    assert abs(loss.item()) <= atol
    assert grad_hidden.abs().max().item() <= atol and grad_weight.abs().max().item() <= atol


def test_reverse_kl_advantage_is_the_hand_formula():
    old_logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.25, -0.75, -1.5, 0.0]])
    teacher_logp = torch.tensor([[-1.5, -1.0, -0.5, -0.1], [-0.5, -0.25, -2.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # a hole (an observation) and padding
    # A_t = -(log pi_student - log pi_teacher) on the mask
    expected = torch.tensor([[-0.5, 1.0, 0.0, 2.9], [-0.25, 0.5, -0.5, 0.0]])
    torch.testing.assert_close(teacher_advantages(old_logp, teacher_logp, mask), expected, rtol=0, atol=1e-7)
    assert teacher_advantages(old_logp, old_logp.clone(), mask).abs().max().item() == 0.0
    assert math.isclose(float(generalized_jsd(torch.zeros(3), torch.zeros(3), 0.5)), 0.0, abs_tol=1e-7)


# ---------------------------------------------------------------------------------------------------------------------
# In the RL script: the distill row on multi-turn episodes, the teacher's settings, resume, learning


@pytest.fixture(scope="module")
def teachers(tiny_models, tmp_path_factory):
    """A teacher with the student's tokenizer (the tiny student with its final norm x 10: the same preferences,
    sharper), one whose vocabulary is one larger, and one whose tokenizer swaps two tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from demo.tiny import tiny_llama_config

    root = tmp_path_factory.mktemp("teachers")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["causal_lm"])
    sharp = AutoModelForCausalLM.from_pretrained(tiny_models["causal_lm"])
    with torch.no_grad():
        sharp.model.norm.weight.mul_(10.0)
    paths = {"sharp": str(root / "sharp"), "wide": str(root / "wide"), "swapped": str(root / "swapped")}
    sharp.save_pretrained(paths["sharp"])
    tokenizer.save_pretrained(paths["sharp"])
    LlamaForCausalLM(tiny_llama_config(len(tokenizer) + 1)).save_pretrained(paths["wide"])
    tokenizer.save_pretrained(paths["wide"])
    sharp.save_pretrained(paths["swapped"])
    vocab = tokenizer.get_vocab()
    a, b = vocab["a"], vocab["b"]
    vocab["a"], vocab["b"] = b, a
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    swapped = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    swapped.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=swapped, pad_token="<pad>", eos_token="<|end|>").save_pretrained(
        paths["swapped"]
    )
    return paths


def plain_token_logits(model, episode) -> torch.Tensor:
    """Logits predicting each response token of a multi-turn episode, from one plain forward of prompt + response."""
    ids = torch.tensor([episode.prompt_ids + episode.response_ids])
    with torch.no_grad():
        return model(ids).logits[0, len(episode.prompt_ids) - 1 : -1].float()


@pytest.mark.parametrize("distill_loss", ["reverse_kl", "jsd"])
def test_multi_turn_distillation_is_the_hand_formula_on_policy_tokens_only(tiny_models, teachers, distill_loss):
    """Scripted two-turn tool episodes (tests/test_multiturn_rlvr.py): the teacher's log-probs, the advantages and
    the JSD loss are 0 on observation tokens, and on policy tokens equal the formulas computed here from plain
    forwards of prompt + whole response:
        reverse_kl: A_t = log pi_teacher(y_t) - log pi_student(y_t)
        jsd:        loss = (1/N) sum over policy tokens of JSD_beta(p_student, p_teacher)   (token_mean, beta 0.5)
    and the JSD's gradient is that hand loss's."""
    from test_multiturn_rlvr import ONE_PROCESS, config, observation_positions, play
    from tolerances import decoder_reduction_lengths

    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages, micro_batch_loss

    cfg = config(tiny_models, "--teacher_model_name_or_path", teachers["sharp"], "--num_epochs", "2", "--beta", "0",
                 "--distill_loss", distill_loss, "--distill_jsd_beta", "0.5", "--temperature", "0.7")  # fmt: skip
    assert cfg.advantage_estimator == "distill" and cfg.distill_group_baseline  # the teacher alone picks the row
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    models = RLModels(policy=load_causal_lm(tiny_models["causal_lm"]), teacher=load_causal_lm(teachers["sharp"]))
    prompts, out = play(cfg, tokenizer)
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
    rollout = collect_rollout(cfg, models, prompts, out, {}, 0, run, False, episode_layout(cfg, tokenizer.pad_token_id))
    obs = observation_positions(out)
    assert obs.any() and (rollout.teacher_logp[obs] == 0).all()
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    assert (adv.advantages[obs] == 0).all()

    seq = max(len(e.prompt_ids) + len(e.response_ids) for e in out.episodes)
    n_policy = int(rollout.mask.sum())
    hand_loss, hand_adv = torch.zeros(()), torch.zeros_like(rollout.mask)
    for i, episode in enumerate(out.episodes):
        policy_tokens = torch.tensor(episode.loss_mask, dtype=torch.bool)
        s_logits = plain_token_logits(models.policy, episode) / cfg.temperature
        t_logits = plain_token_logits(models.teacher, episode) / cfg.temperature
        ids = torch.tensor(episode.response_ids).unsqueeze(1)
        gap = (t_logits.log_softmax(-1) - s_logits.log_softmax(-1)).gather(1, ids).squeeze(1)
        hand_adv[i, : len(gap)] = gap * policy_tokens
        hand_loss = hand_loss + generalized_jsd(s_logits, t_logits, 0.5)[policy_tokens].sum() / n_policy
    magnitude = max(hand_adv.abs().max().item(), 10.0 / cfg.temperature)  # logits of the sharp teacher ~ 10
    atol = chain_atol(decoder_reduction_lengths(models.policy.config, seq), magnitude)
    if distill_loss == "reverse_kl":
        assert hand_adv.abs().max() > 100 * atol
        torch.testing.assert_close(adv.advantages, hand_adv, rtol=0, atol=atol)
        return
    assert adv.advantages.abs().max() == 0  # jsd: the teacher term is a loss term, the score weight is 0
    models.policy.zero_grad(set_to_none=True)
    loss_sum, stats = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                       contextlib.nullcontext)  # fmt: skip
    (loss_sum / n_policy).backward()
    got = [p.grad.clone() for p in models.policy.parameters()]
    assert hand_loss > 100 * atol
    torch.testing.assert_close(loss_sum.detach() / n_policy, hand_loss, rtol=0, atol=atol)
    assert stats["jsd_loss"] == pytest.approx(float(loss_sum.detach()), abs=atol * n_policy)

    models.policy.zero_grad(set_to_none=True)
    hand = torch.zeros(())
    for episode in out.episodes:
        ids = torch.tensor([episode.prompt_ids + episode.response_ids])
        s_logits = models.policy(ids).logits[0, len(episode.prompt_ids) - 1 : -1].float() / cfg.temperature
        t_logits = plain_token_logits(models.teacher, episode) / cfg.temperature
        hand = hand + generalized_jsd(s_logits, t_logits, 0.5)[torch.tensor(episode.loss_mask, dtype=torch.bool)].sum()
    (hand / n_policy).backward()
    want = [p.grad.clone() for p in models.policy.parameters()]
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) <= atol * scale / hand_loss.item()


@pytest.mark.parametrize("distill_loss", ["reverse_kl", "jsd"])
def test_a_teacher_identical_to_the_student_gives_zero_advantage_and_loss(tiny_models, distill_loss):
    from test_multiturn_rlvr import ONE_PROCESS, config, play
    from tolerances import decoder_reduction_lengths

    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages, micro_batch_loss

    cfg = config(tiny_models, "--teacher_model_name_or_path", tiny_models["causal_lm"], "--num_epochs", "2",
                 "--beta", "0", "--distill_loss", distill_loss, "--distill_jsd_beta", "0.5")  # fmt: skip
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    models = RLModels(policy=load_causal_lm(tiny_models["causal_lm"]), teacher=load_causal_lm(tiny_models["causal_lm"]))
    prompts, out = play(cfg, tokenizer)
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
    rollout = collect_rollout(cfg, models, prompts, out, {}, 0, run, False, episode_layout(cfg, tokenizer.pad_token_id))
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    seq = max(len(e.prompt_ids) + len(e.response_ids) for e in out.episodes)
    # the same weights through two code paths (full logits vs the chunked output layer): rounding apart
    atol = chain_atol(decoder_reduction_lengths(models.policy.config, seq), rollout.old_logp.abs().max().item())
    assert adv.advantages.abs().max().item() <= atol
    models.policy.zero_grad(set_to_none=True)
    loss_sum, stats = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                       contextlib.nullcontext)  # fmt: skip
    n_policy = float(rollout.mask.sum())
    assert abs(float(loss_sum)) / n_policy <= atol  # the policy term at ratio 1 is -A: rounding too
    if distill_loss == "jsd":
        assert stats["jsd_loss"] / n_policy <= atol


@pytest.fixture(scope="module")
def rl_files(tmp_path_factory):
    return write_rl_files(tmp_path_factory.mktemp("distill_data"))


def distill_argv(tiny_models, teacher, rl_files, out, *extra) -> list[str]:
    """4 rollouts of 4 prompts x 4 completions from the tiny student, KL to the reference off (beta 0)."""
    import os

    return [
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", tiny_models["causal_lm"], "--teacher_model_name_or_path", teacher,
        "--dataset_name_or_path", rl_files["train"], "--eval_dataset_name_or_path", rl_files["eval"],
        "--output_dir", str(out), "--total_episodes", "64", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "16", "--num_epochs", "1",
        "--response_length", "8", "--eval_steps", "2", "--checkpointing_steps", "1", "--beta", "0",
        "--learning_rate", "1e-2", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "teacher,extra,words",
    [
        ("wide", [], ["vocab_size 103", "!= 104", "causal_lm", "wide"]),
        ("swapped", [], ["tokenizers of student", "causal_lm", "swapped", "differ"]),
        ("missing", [], ["teacher_model_name_or_path", "missing' does not exist"]),
        ("sharp", ["--advantage_estimator", "grpo"], ["advantage_estimator grpo uses no teacher", "distill"]),
        ("sharp", ["--distill_jsd_beta", "1.5"], ["distill_jsd_beta must be in [0.0, 1.0], got 1.5"]),
        ("sharp", ["--distill_top_k", "5"], ["distill_top_k applies to distill_loss jsd"]),
        ("sharp", ["--num_samples_per_prompt", "1", "--distill_group_baseline", "true"], ["num_samples_per_prompt"]),
        # a reward model (sequence classifier) as teacher or as policy: its lm_head would be initialised at random
        (
            "seq_cls",
            [],
            [
                "teacher_model_name_or_path",
                "seq_cls",
                "has no trained language-model head",
                "LlamaForSequenceClassification",
            ],
        ),
        ("sharp", ["--model_name_or_path", "seq_cls"], ["model_name_or_path", "has no trained language-model head"]),
    ],
)
def test_bad_teacher_settings_exit_2_before_any_model_loads(
    tiny_models, teachers, rl_files, tmp_path, monkeypatch, capsys, teacher, extra, words
):
    from open_instruct import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    monkeypatch.setattr(models, "load_policy", refuse)
    path = {**teachers, "seq_cls": tiny_models["seq_cls"]}.get(teacher, str(tmp_path / "missing"))
    extra = [tiny_models["seq_cls"] if e == "seq_cls" else e for e in extra]
    assert exit_code(distill_argv(tiny_models, path, rl_files, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def rows_without_timing(out) -> list[dict]:
    import json

    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


# async JSD (beta 0): the JSD loss recomputes under activation checkpointing while the background thread generates
ASYNC_JSD = ["--distill_loss", "jsd", "--distill_jsd_beta", "0", "--async_steps", "2"]


@pytest.mark.concurrency
@pytest.mark.parametrize("extra", [[], ASYNC_JSD], ids=["sync_reverse_kl", "async_jsd"])
def test_killed_distillation_run_resumes_bit_exactly(tiny_models, teachers, rl_files, tmp_path, monkeypatch, extra):
    """SIGTERM during rollout 2 of 4 (checkpoint, exit 0), resume: the metric rows and the final weights equal the
    uninterrupted run's exactly. The teacher is frozen: it is loaded again from its path, nothing of it is saved.
    Async JSD: a second uninterrupted run equals the first too (the generator samples from its own RNG)."""
    from safetensors.torch import load_file
    from training_helpers import sigterm_at_step

    def argv(out, *more):
        return distill_argv(tiny_models, teachers["sharp"], rl_files, out, *extra, *more)

    full, cut, again = tmp_path / "full", tmp_path / "cut", tmp_path / "again"
    assert exit_code(argv(full)) == 0
    with sigterm_at_step(monkeypatch, 2):
        assert exit_code(argv(cut)) == 0
    assert max(r["rollout_step"] for r in rows_without_timing(cut)) == 2
    assert exit_code(argv(cut, "--resume_from_checkpoint", "auto")) == 0
    full_rows = rows_without_timing(full)
    assert rows_without_timing(cut) == full_rows
    assert [r["rollout_step"] for r in full_rows if "train/teacher_kl" in r] == [1, 2, 3, 4]
    finals = [full, cut]
    if extra:
        assert exit_code(argv(again)) == 0
        assert rows_without_timing(again) == full_rows
        finals.append(again)
    weights = [load_file(out / "final_model" / "model.safetensors") for out in finals]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)


@pytest.mark.parametrize("distill_loss", ["jsd"])
def test_distillation_lowers_the_kl_to_the_teacher(tiny_models, teachers, rl_files, tmp_path, distill_loss):
    """8 rollouts x 4 epochs towards the sharp teacher: the per-token KL of the student's samples to the teacher
    falls: the mean of the last 3 rollouts at most 0.85 x that of the first 2 (measured: 1.08 -> 0.74)."""
    out = tmp_path / "out"
    extra = ["--total_episodes", "128", "--num_epochs", "4", "--checkpointing_steps", "100", "--eval_steps", "100"]
    argv = distill_argv(tiny_models, teachers["sharp"], rl_files, out, *extra, "--distill_loss", distill_loss)
    assert exit_code(argv) == 0
    kl = [r["train/teacher_kl"] for r in rows_without_timing(out) if "train/teacher_kl" in r]
    print(f"{distill_loss}: train/teacher_kl by rollout {[round(k, 3) for k in kl]}")
    assert len(kl) == 8 and sum(kl[-3:]) / 3 < 0.85 * sum(kl[:2]) / 2


def test_distillation_keeps_the_demonstrations_loss_beside_the_teachers(
    tiny_models, teachers, rl_files, tmp_path_factory, tmp_path
):
    """What demo.smollm2_tools_distill offers its students (`--ptx_dataset --ptx_coef`): 8 rollouts towards the
    sharp teacher with and without the demonstrations' loss at weight 1. With it, loss/ptx and the teacher's KL are
    logged every rollout, and the final student's NLL of the demonstrations (hand, whole set) is below 0.8 x the
    plain run's (measured: 3.07 against 5.28); without it no loss/ptx is logged."""
    from test_ptx import hand_nll
    from transformers import AutoModelForCausalLM

    from demo.synthetic import sft_rows, write_jsonl
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.models import load_tokenizer
    from open_instruct.ptx import DemonstrationLoss

    ptx = write_jsonl(str(tmp_path_factory.mktemp("distill_ptx") / "ptx.jsonl"), sft_rows(24, 5))
    ptx_args = ["--ptx_dataset", ptx, "--ptx_coef", "1"]
    extra = ["--total_episodes", "128", "--checkpointing_steps", "100", "--eval_steps", "100"]
    for name, more in (("ptx", ptx_args), ("plain", [])):
        assert exit_code(distill_argv(tiny_models, teachers["sharp"], rl_files, tmp_path / name, *extra, *more)) == 0
    rows = {name: [r for r in rows_without_timing(tmp_path / name) if "loss/policy" in r] for name in ("ptx", "plain")}
    assert len(rows["ptx"]) == 8 and all("loss/ptx" in r and "train/teacher_kl" in r for r in rows["ptx"])
    assert len(rows["plain"]) == 8 and not any("loss/ptx" in r for r in rows["plain"])
    cfg = parse_config(RLVRConfig, distill_argv(tiny_models, teachers["sharp"], rl_files, "unused", *ptx_args))
    examples = DemonstrationLoss(cfg, load_tokenizer(tiny_models["causal_lm"])).examples
    nll = {name: hand_nll(AutoModelForCausalLM.from_pretrained(tmp_path / name / "final_model"), examples)
           for name in ("ptx", "plain")}  # fmt: skip
    print(f"demonstrations' NLL after distillation {nll}; loss/ptx {[round(r['loss/ptx'], 3) for r in rows['ptx']]}")
    assert nll["ptx"] < 0.8 * nll["plain"]


@pytest.mark.parametrize("distill_loss,teacher_forwards", [("reverse_kl", 1), ("jsd", 1 + 4)])
def test_the_planner_counts_the_teacher_forward(repo_root, capsys, distill_loss, teacher_forwards):
    """rlvr_8b (4 epochs) with a 70B teacher: the teacher's forward compute is the policy's scoring compute (2
    no-grad forwards per micro-batch: old log-probs, reference) x teacher/policy parameters / 2, once per rollout
    with reverse_kl, and again every epoch with jsd."""
    import json
    import os

    from open_instruct.plan import main as plan_main

    base = [
        os.path.join(repo_root, "configs", "rlvr_8b.yaml"),
        "--num_processes",
        "7",
        "--json",
        "--beta",
        "0",
        "--score_placement",
        "last_token",
        "--num_samples_per_prompt",
        "4",
        "--value_model_path",
        "null",
    ]
    teacher = "allenai/Llama-3.1-Tulu-3-70B"
    assert plan_main([*base, "--teacher_model_name_or_path", teacher, "--distill_loss", distill_loss]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["num_epochs"] == 4
    phases = p["phase_hours"]
    expected = phases["scoring"] / 2 * 70e9 / p["model_params"] * teacher_forwards
    assert phases["teacher forward"] == pytest.approx(expected, rel=1e-9)
    assert plan_main([*base, "--advantage_estimator", "grpo"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert "teacher forward" not in without["phase_hours"] and without["estimated_hours"] < p["estimated_hours"]


def test_packed_micro_batches_give_the_padded_distillation(tiny_models, teachers):
    """Packing (one packed row per micro-batch) gives the padded layout's teacher log-probs, reverse-KL advantages,
    JSD loss and gradients: the teacher's and the student's hidden states are read at the same positions."""
    from test_multiturn_rlvr import ONE_PROCESS, config, play
    from tolerances import decoder_reduction_lengths

    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages, micro_batch_loss

    results = []
    for extra in ([], ["--max_tokens_per_micro_batch", "2048"]):
        base = ["--teacher_model_name_or_path", teachers["sharp"], "--num_epochs", "2", "--beta", "0"]
        cfg = config(tiny_models, *base, "--distill_loss", "jsd", "--distill_jsd_beta", "0.5", *extra)
        tokenizer = load_tokenizer(tiny_models["causal_lm"])
        policy = load_causal_lm(tiny_models["causal_lm"], attn_implementation=cfg.attention_kernel)
        teacher = load_causal_lm(teachers["sharp"], attn_implementation=cfg.attention_kernel)
        models = RLModels(policy=policy, teacher=teacher)
        prompts, out = play(cfg, tokenizer)
        run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
        rollout = collect_rollout(cfg, models, prompts, out, {}, 0, run, False, episode_layout(cfg,
                                  tokenizer.pad_token_id))  # fmt: skip
        adv = compute_advantages(cfg, rollout, ONE_PROCESS)
        loss_sum, stats = micro_batch_loss(cfg, models, rollout, adv, [0, 1, 2, 3], episode_layout(cfg, 0), "cpu",
                                           contextlib.nullcontext)  # fmt: skip
        loss_sum.backward()
        results.append((rollout, float(loss_sum.detach()), [p.grad.clone() for p in policy.parameters()]))
    seq = max(len(e.prompt_ids) + len(e.response_ids) for e in out.episodes)
    (padded, loss_a, grads_a), (packed, loss_b, grads_b) = results
    atol = chain_atol(decoder_reduction_lengths(policy.config, seq), padded.teacher_logp.abs().max().item())
    assert padded.teacher_logp.abs().max() > 0
    torch.testing.assert_close(packed.teacher_logp, padded.teacher_logp, rtol=0, atol=atol)
    n_policy = float(padded.mask.sum())
    assert abs(loss_a - loss_b) / n_policy <= atol
    scale = max(g.abs().max().item() for g in grads_a)
    assert max((a - b).abs().max().item() for a, b in zip(grads_a, grads_b)) <= atol * scale / (loss_a / n_policy)


@pytest.mark.slow
def test_jsd_under_fsdp2_matches_ddp(tiny_models, teachers, rl_files, tmp_path):
    """distill_loss jsd on 2 CPU processes: FSDP2 (student and teacher sharded; the output-layer weights gathered
    once per JSD call) logs the numbers and trains the weights of DDP (same ranks: the same samples), within
    tests/test_fsdp.py's tolerances for RL runs. (A DDP run once failed here: the wrapper hides the output layer.)"""
    from test_fsdp import assert_same_weights, command, metrics, run_all

    out, jobs = {}, []
    for mode in ("ddp", "fsdp"):
        out[mode] = str(tmp_path / mode)
        settings = ["--distill_loss", "jsd", "--distill_jsd_beta", "0.5", "--checkpointing_steps", "100"]
        argv = distill_argv(tiny_models, teachers["sharp"], rl_files, out[mode], *settings, "--eval_steps", "100")
        cmd, env = command("open_instruct/rlvr_ppo.py", argv, mode)  # 2 ranks x 4 prompts x 4: 2 rollouts
        jobs.append((cmd, env, str(tmp_path / f"{mode}.log")))
    run_all(jobs, parallel=1)
    ddp, fsdp = metrics(out["ddp"]), metrics(out["fsdp"])
    train = [r for r in ddp if "loss/jsd" in r]
    assert len(ddp) == len(fsdp) and [r["rollout_step"] for r in train] == [1, 2]
    for x, y in zip(ddp, fsdp):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float) and not k.startswith(("perf/", "time/")):
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), f"{k}: {x[k]} vs {y[k]}"
    assert_same_weights(os.path.join(out["ddp"], "final_model"), os.path.join(out["fsdp"], "final_model"), atol=1e-4)
