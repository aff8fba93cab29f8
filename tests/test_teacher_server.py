"""Teacher servers (open_instruct/teacher_server.py, docs/distillation.md#teacher-servers) without vLLM: a teacher
given as a URL is neither loaded, nor planned, nor checked as a folder; it serves reverse_kl at temperature 1 only;
one that does not answer stops the run with exit 2 before any model loads. The served scores themselves:
test_teacher_server_vllm.py (make test-vllm)."""

from __future__ import annotations

import os

import pytest
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from training_helpers import rl_exit_code as exit_code

from open_instruct.errors import ConfigError


def closed_url() -> str:
    """A loopback URL nothing listens on (a port the OS just handed out and took back)."""
    from open_instruct.engines import free_port

    return f"http://127.0.0.1:{free_port()}"


def test_a_served_teacher_is_not_loaded_planned_or_hashed_and_takes_reverse_kl_at_temperature_1(repo_root, tiny_models):
    from open_instruct import checkpoint, plan
    from open_instruct.config import RLVRConfig, parse_config

    recipe = os.path.join(repo_root, "configs", "rlvr_tiny.yaml")
    local, url = tiny_models["causal_lm"], closed_url()
    base = [recipe, "--model_name_or_path", local, "--beta", "0"]
    cfg = parse_config(RLVRConfig, [*base, "--teacher_models", f"a={url}", f"b={local}"])
    assert cfg.advantage_estimator == "distill"
    assert cfg.teacher_settings() == [("teacher_models a", url), ("teacher_models b", local)]
    assert cfg.loaded_teacher_settings() == [("teacher_models b", local)]
    resident = plan.predict_memory(cfg, 1, plan.TimeAssumptions(gpu="H100"))["resident"]
    assert "teacher b (frozen, compute dtype)" in resident
    assert not any(key.startswith("teacher a") for key in resident)
    assert plan.teacher_params(cfg, 1.0) == plan.model_params(local, None)[0]
    served_only = parse_config(RLVRConfig, [*base, "--teacher_model_name_or_path", url])
    assert served_only.loaded_teacher_settings() == [] and plan.teacher_params(served_only, 1.0) == 0
    weights = [e["what"] for e in checkpoint.input_identity(vars(cfg) | {"script": "rlvr_ppo"})]
    assert weights and all("teacher_models b=" in w for w in weights if w.startswith("teacher_models"))
    with pytest.raises(ConfigError, match="teacher_model_name_or_path is a teacher server.*distill_loss jsd"):
        parse_config(RLVRConfig, [*base, "--teacher_model_name_or_path", url, "--distill_loss", "jsd"])
    with pytest.raises(ConfigError, match="teacher_models a is a teacher server.*temperature 1.*at temperature 0.7"):
        parse_config(RLVRConfig, [*base, "--teacher_models", f"a={url}", f"b={local}", "--temperature", "0.7"])
    loaded_only = parse_config(RLVRConfig, [*base, "--teacher_models", f"b={local}", "--temperature", "0.7"])
    assert loaded_only.loaded_teacher_settings() == [("teacher_models b", local)]  # a loaded teacher takes any


def test_a_teacher_server_that_does_not_answer_exits_2_before_any_model_loads(
    repo_root, tiny_models, tmp_path, monkeypatch, capsys
):
    from open_instruct import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    monkeypatch.setattr(models, "load_policy", refuse)
    from demo.synthetic import rl_rows, write_jsonl

    url, data = closed_url(), write_jsonl(str(tmp_path / "rl.jsonl"), rl_rows(16, 0))
    argv = [os.path.join(repo_root, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
            "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data,
            "--teacher_model_name_or_path", url, "--beta", "0", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert f"teacher_model_name_or_path {url}: the teacher server cannot be used" in err, err[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
