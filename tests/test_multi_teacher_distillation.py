"""Multi-teacher on-policy distillation (teacher_models + teacher_column,
docs/distillation.md#several-teachers-multi-teacher-on-policy-distillation): each row is scored by its own teacher,
per-teacher metrics, every teacher's weights in the resume identity, bad routing refused before any model loads."""

from __future__ import annotations

import json
import os

import pytest
from teacher_helpers import bias_teacher, check_rows_scored_by_their_own_teachers, token_bias
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from training_helpers import rl_exit_code as exit_code

TEMPERATURE = 0.7


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
    """teacher_helpers.check_rows_scored_by_their_own_teachers with both teachers loaded."""
    from open_instruct.models import load_causal_lm

    paths = {name: two_teachers[name] for name in ("a", "b")}
    teachers = {name: load_causal_lm(path) for name, path in paths.items()}
    check_rows_scored_by_their_own_teachers(tiny_models["causal_lm"], teachers, paths, two_teachers["vocab"],
                                            TEMPERATURE)  # fmt: skip


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
