"""What the multi-teacher tests share (tests/test_multi_teacher_distillation.py, loaded teachers;
tests/test_teacher_server_vllm.py, one of them served by vLLM): teachers whose log-probs are known by hand, and the
check that each routed row is scored by its own teacher."""

from __future__ import annotations

import math
import os
import types
from typing import Any

import torch
from tolerances import gamma

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def token_bias(vocab_size: int, which: str) -> torch.Tensor:
    """Two different, fixed preferences: a, a saw-tooth over the ids; b, a ramp down."""
    v = torch.arange(vocab_size, dtype=torch.float32)
    return 0.5 * (v % 5) if which == "a" else 3.0 - 0.04 * v


def bias_teacher(vocab_size: int, bias: torch.Tensor, path: str, tokenizer: Any, hidden_size: int = 32) -> str:
    """A one-layer Phi model (an output layer with a bias) whose output weight is zero: its logits at every position
    are `bias`, whatever the context, so log pi(y) = log_softmax(bias / T)[y] is known by hand. 4 heads (vLLM's CPU
    attention needs head_dim 32: hidden_size 128 for a served one)."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(
        PhiConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=1024, pad_token_id=0)
    )  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.copy_(bias)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def check_rows_scored_by_their_own_teachers(
    student: str, teachers: dict[str, Any], settings: dict[str, str], vocab: int, temperature: float
) -> None:
    """Four completions, rows 0 and 3 naming teacher a, rows 1 and 2 teacher b, in micro-batches [0, 1, 2] and [3]
    (one holds both teachers' rows), collected with `teachers` (name -> a loaded model or a TeacherServer; `settings`
    name -> its teacher_models value): teacher_logp of every policy token is log_softmax(bias_of_its_row's_teacher /
    T)[y], and the reverse-KL advantage is that minus the student's log-prob, row by row. The two teachers' values
    differ at every token by more than 0.1, so a row scored by the other teacher fails."""
    from test_multiturn_rlvr import ONE_PROCESS

    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.generation import GenerationOutput
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rlvr_ppo import RLModels, collect_rollout, compute_advantages
    from open_instruct.rollouts import episode_layout

    cfg = parse_config(RLVRConfig, [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", student,
        "--teacher_models", *(f"{name}={value}" for name, value in settings.items()),
        "--num_samples_per_prompt", "2", "--beta", "0", "--temperature", str(temperature),
        "--per_device_train_batch_size", "3",
    ])  # fmt: skip
    assert cfg.advantage_estimator == "distill"  # the teachers alone pick the row
    tokenizer = load_tokenizer(student)
    models = RLModels(policy=load_causal_lm(student), teachers=teachers)
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

    by_hand = {name: (token_bias(vocab, name) / temperature).log_softmax(-1) for name in ("a", "b")}
    want = torch.zeros_like(rollout.mask)
    for i, (response, name) in enumerate(zip(responses, names)):
        want[i, : len(response)] = by_hand[name][torch.tensor(response)]
        other = by_hand["b" if name == "a" else "a"][torch.tensor(response)]
        assert (want[i, : len(response)] - other).abs().min() > 0.1  # the other teacher would be far off
    # the same float32 ops in another order: a logsumexp over the vocabulary of values up to |bias| / T + log V
    atol = 4 * gamma(vocab) * (token_bias(vocab, "b").abs().max().item() / temperature + math.log(vocab))
    assert rollout.mask.sum() == sum(len(r) for r in responses)
    torch.testing.assert_close(rollout.teacher_logp, want * rollout.mask, rtol=0, atol=atol)
    adv = compute_advantages(cfg, rollout, ONE_PROCESS)
    torch.testing.assert_close(adv.advantages, (want - rollout.old_logp) * rollout.mask, rtol=0, atol=2 * atol)
