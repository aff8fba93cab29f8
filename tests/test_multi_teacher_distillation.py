"""Multi-teacher on-policy distillation (teacher_models + teacher_column,
docs/distillation.md#several-teachers-multi-teacher-on-policy-distillation): each row is scored by its own teacher,
per-teacher metrics, every teacher's weights in the resume identity, bad routing refused before any model loads."""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch
from tolerances import gamma
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from training_helpers import rl_exit_code as exit_code

TEMPERATURE = 0.7


def bias_teacher(vocab_size: int, bias: torch.Tensor, path: str, tokenizer) -> str:
    """A one-layer Phi model (an output layer with a bias) whose output weight is zero: its logits at every position
    are `bias`, whatever the context, so log pi(y) = log_softmax(bias / T)[y] is known by hand."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(
        PhiConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, max_position_embeddings=1024, pad_token_id=0)
    )  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.copy_(bias)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def token_bias(vocab_size: int, which: str) -> torch.Tensor:
    """Two different, fixed preferences: a, a saw-tooth over the ids; b, a ramp down."""
    v = torch.arange(vocab_size, dtype=torch.float32)
    return 0.5 * (v % 5) if which == "a" else 3.0 - 0.04 * v


@pytest.fixture(scope="module")
def two_teachers(tiny_models, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    root = tmp_path_factory.mktemp("two_teachers")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["causal_lm"])
    vocab = AutoConfig.from_pretrained(tiny_models["causal_lm"]).vocab_size
    return {name: bias_teacher(vocab, token_bias(vocab, name), str(root / name), tokenizer) for name in ("a", "b")} | {
        "vocab": vocab
    }


def test_each_row_is_scored_by_its_own_teacher(tiny_models, two_teachers):
    """Four completions, rows 0 and 3 naming teacher a, rows 1 and 2 teacher b: teacher_logp of every policy token
    is log_softmax(bias_of_its_row's_teacher / T)[y], and the reverse-KL advantage is that minus the student's
    log-prob, row by row. The two teachers' values differ at every token, so a row scored by the other teacher
    fails."""
    from test_multiturn_rlvr import ONE_PROCESS

    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.generation import GenerationOutput
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages
    from open_instruct.rollouts import episode_layout

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "rlvr_tiny.yaml")
    cfg = parse_config(RLVRConfig, [
        recipe, "--model_name_or_path", tiny_models["causal_lm"], "--teacher_models", f"a={two_teachers['a']}",
        f"b={two_teachers['b']}", "--num_samples_per_prompt", "2", "--beta", "0", "--temperature", str(TEMPERATURE),
        "--per_device_train_batch_size", "3",  # micro-batches [0, 1, 2] and [3]: one holds both teachers' rows
    ])  # fmt: skip
    assert cfg.advantage_estimator == "distill"  # the teachers alone pick the row
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    teachers = {name: load_causal_lm(two_teachers[name]) for name in ("a", "b")}
    models = RLModels(policy=load_causal_lm(tiny_models["causal_lm"]), teachers=teachers)
    prompts = [{"prompt_ids": tokenizer(q)["input_ids"], "ground_truth": "2", "verifier": "arithmetic",
                "teacher": name, "row": i, "where": f"row {i}"}
               for i, (q, name) in enumerate((("1+1=", "a"), ("4-2=", "b")))]  # fmt: skip
    responses = [tokenizer(t)["input_ids"] for t in ("2", "23", "11+", "4")]
    index = [0, 1, 1, 0]  # completion i answers prompt index[i]: teachers a, b, b, a
    names = [prompts[p]["teacher"] for p in index]
    out = GenerationOutput(prompt_ids=[p["prompt_ids"] for p in prompts], response_ids=responses,
                           texts=["2", "23", "11+", "4"], stopped=[True] * 4, prompt_index=index,
                           logprobs=[[-0.5] * len(r) for r in responses],
                           weight_versions=[[0] * len(r) for r in responses])  # fmt: skip
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
    rollout = collect_rollout(cfg, models, prompts, out, {}, 0, run, False, episode_layout(cfg, tokenizer.pad_token_id))

    vocab = two_teachers["vocab"]
    by_hand = {name: (token_bias(vocab, name) / TEMPERATURE).log_softmax(-1) for name in ("a", "b")}
    want = torch.zeros_like(rollout.mask)
    for i, (response, name) in enumerate(zip(responses, names)):
        want[i, : len(response)] = by_hand[name][torch.tensor(response)]
        other = by_hand["b" if name == "a" else "a"][torch.tensor(response)]
        assert (want[i, : len(response)] - other).abs().min() > 0.1  # the other teacher would be far off
    # the same float32 ops in another order: a logsumexp over the vocabulary of values up to |bias| / T + log V
    atol = 4 * gamma(vocab) * (token_bias(vocab, "b").abs().max().item() / TEMPERATURE + math.log(vocab))
    assert rollout.mask.sum() == sum(len(r) for r in responses)
    torch.testing.assert_close(rollout.teacher_logp, want * rollout.mask, rtol=0, atol=atol)
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    torch.testing.assert_close(adv.advantages, (want - rollout.old_logp) * rollout.mask, rtol=0, atol=2 * atol)


def routed_rows(n: int) -> list[dict]:
    from demo.synthetic import rl_rows

    return [{**row, "teacher_id": "a" if i % 4 < 2 else "b"} for i, row in enumerate(rl_rows(n, 0))]


@pytest.fixture(scope="module")
def routed_files(tmp_path_factory):
    from demo.synthetic import rl_rows, write_jsonl

    root = tmp_path_factory.mktemp("routed_data")
    unknown = routed_rows(64)
    unknown[5]["teacher_id"] = "c"
    missing = routed_rows(64)
    del missing[7]["teacher_id"]
    return {
        "train": write_jsonl(str(root / "train.jsonl"), routed_rows(64)),
        "unknown": write_jsonl(str(root / "unknown.jsonl"), unknown),
        "missing": write_jsonl(str(root / "missing.jsonl"), missing),
        "eval": write_jsonl(str(root / "eval.jsonl"), rl_rows(8, 1)),
    }


def routed_argv(tiny_models, teachers: dict, files: dict, train: str, out, *extra) -> list[str]:
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "rlvr_tiny.yaml")
    return [
        recipe, "--model_name_or_path", tiny_models["causal_lm"],
        "--teacher_models", *(f"{name}={path}" for name, path in teachers.items()),
        "--dataset_name_or_path", files[train], "--eval_dataset_name_or_path", files["eval"],
        "--output_dir", str(out), "--total_episodes", "32", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "16", "--num_epochs", "1",
        "--response_length", "8", "--eval_steps", "2", "--beta", "0", "--learning_rate", "1e-2", *extra,
    ]  # fmt: skip


def test_a_two_teacher_run_logs_each_teachers_kl(tiny_models, two_teachers, routed_files, tmp_path):
    """2 rollouts of 4 prompts x 4 completions, the prompts alternating a, a, b, b: each row logs both teachers'
    completions (their sum the rollout's 16) and KLs, and train/teacher_kl is the token-weighted mean of the two."""
    teachers = {"a": two_teachers["a"], "b": two_teachers["b"]}
    assert exit_code(routed_argv(tiny_models, teachers, routed_files, "train", tmp_path / "out")) == 0
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    trained = [r for r in rows if "train/teacher_kl" in r]
    assert len(trained) == 2
    for r in trained:
        a, b = r["train/teacher_completions/a"], r["train/teacher_completions/b"]
        assert a + b == 16 and a > 0 and b > 0
        low, high = sorted((r["train/teacher_kl/a"], r["train/teacher_kl/b"]))
        assert low - 1e-6 <= r["train/teacher_kl"] <= high + 1e-6  # a token-weighted mean of the two


def test_every_teacher_folder_is_in_the_resume_identity(tiny_models, two_teachers, routed_files, tmp_path):
    """checkpoint.input_identity hashes each teacher_models folder's weight files under teacher_weights (the
    setting's `loads`); rewriting one teacher's weights is a content change a resume names."""
    import shutil

    from open_instruct import checkpoint
    from open_instruct.config import RLVRConfig, parse_config

    teachers = {name: shutil.copytree(two_teachers[name], str(tmp_path / name)) for name in ("a", "b")}
    cfg = parse_config(RLVRConfig, routed_argv(tiny_models, teachers, routed_files, "train", tmp_path / "out"))
    config = vars(cfg) | {"script": "rlvr_ppo"}
    saved = checkpoint.input_identity(config)
    hashed = {e["what"]: e for e in saved if e["key"] == "teacher_weights"}
    assert set(hashed) == {f"teacher_models a={teachers['a']}", f"teacher_models b={teachers['b']}"}
    from safetensors.torch import load_file, save_file

    weights = os.path.join(teachers["b"], "model.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.bias"] = tensors["lm_head.bias"] + 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    changes = checkpoint.input_content_changes(saved, config)
    assert [key for key, _ in changes] == ["teacher_weights"] and "teacher_models b=" in changes[0][1]


@pytest.mark.parametrize(
    "train,teachers,extra,words",
    [
        ("unknown", "ab", [], ["names teacher 'c'", "teacher_id", "not one of teacher_models ['a', 'b']"]),
        ("missing", "ab", [], ["has no 'teacher_id'", "teacher_models ['a', 'b']"]),
        ("train", "a_missing", [], ["teacher_models b", "does not exist"]),
        ("train", "ab", ["--distill_loss", "jsd"], ["teacher_models with 2 teachers needs distill_loss reverse_kl"]),
        ("train", "ab_and_single", [], ["teacher_model_name_or_path and teacher_models are both set"]),
    ],
)
def test_bad_routing_exits_2_before_any_model_loads(
    tiny_models, two_teachers, routed_files, tmp_path, monkeypatch, capsys, train, teachers, extra, words
):
    from open_instruct import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    monkeypatch.setattr(models, "load_policy", refuse)
    named = {"a": two_teachers["a"], "b": two_teachers["b"] if teachers != "a_missing" else str(tmp_path / "gone")}
    if teachers == "ab_and_single":
        extra = ["--teacher_model_name_or_path", two_teachers["a"]]
    assert exit_code(routed_argv(tiny_models, named, routed_files, train, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_planner_counts_every_teacher(repo_root, tiny_models, two_teachers, capsys):
    """The memory prediction holds each teacher resident (frozen, compute dtype) and the time estimate's teacher
    forward is the sum of the teachers' sizes."""
    from open_instruct import plan
    from open_instruct.config import RLVRConfig, parse_config

    recipe = os.path.join(repo_root, "configs", "rlvr_tiny.yaml")
    base = [recipe, "--model_name_or_path", tiny_models["causal_lm"], "--beta", "0"]
    two = parse_config(RLVRConfig, [*base, "--teacher_models", f"a={two_teachers['a']}", f"b={two_teachers['b']}"])
    one = parse_config(RLVRConfig, [*base, "--teacher_model_name_or_path", two_teachers["a"]])
    a = plan.TimeAssumptions(gpu="H100")
    memory = plan.predict_memory(two, 1, a)["resident"]
    single = plan.predict_memory(one, 1, a)["resident"]
    size = plan.model_params(two_teachers["a"], None)[0]
    assert memory["teacher a (frozen, compute dtype)"] == memory["teacher b (frozen, compute dtype)"] > 0
    assert single["teacher (frozen, compute dtype)"] == memory["teacher a (frozen, compute dtype)"]
    assert plan.teacher_params(two, 1.0) == 2 * size and plan.teacher_params(one, 1.0) == size
