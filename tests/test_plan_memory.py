"""The planner's GPU memory prediction (open_instruct/memory_model.py): the published layouts fit, an impossible one
exits 2 naming every component, and the formulas equal what a real (tiny) model holds."""

import os

import pytest

from open_instruct.memory_model import (
    GB,
    LOGPROB_CHUNK_TOKENS,
    MemoryLayout,
    ModelShape,
    kv_cache_bytes,
    predict_peak,
    shape_of,
)
from open_instruct.plan import TimeAssumptions, build_plan, plan_from_config, recipe_config
from open_instruct.plan import main as plan_main

LLAMA_8B_PARAMS = 8_030_261_248  # meta-llama/Llama-3.1-8B's parameter count (its model card / safetensors index)
LLAMA_70B_PARAMS = 70_553_706_496
PUBLISHED = [
    ("sft_8b", 8, []),
    ("rm_8b", 8, []),
    ("dpo_8b", 8, []),
    ("rlvr_8b", 7, []),
    ("rlvr_70b", 40, ["--vllm_server_urls", "http://gen:8000", "http://gen:8001"]),
]


def _recipe(repo_root, name):
    return os.path.join(repo_root, "configs", f"{name}.yaml")


def test_published_shapes_have_the_published_parameter_counts():
    assert shape_of("meta-llama/Llama-3.1-8B").params == LLAMA_8B_PARAMS
    assert shape_of("allenai/Llama-3.1-Tulu-3-70B-DPO").params == LLAMA_70B_PARAMS


@pytest.mark.parametrize("name,world,extra", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_layouts_fit_on_80gb(repo_root, name, world, extra):
    m = build_plan(_recipe(repo_root, name), extra, world, None)["memory"]
    print(f"{name} x{world}: {m['total'] / GB:.1f} GB predicted peak per GPU ({m['peak_phase']})")
    assert m["fits"] and m["total"] < 80 * GB
    # AdamW's two fp32 moments of the policy, sharded over the world: 8 bytes x parameters / world.
    params = LLAMA_70B_PARAMS if "70b" in name else LLAMA_8B_PARAMS
    assert m["resident"]["policy AdamW moments (fp32)"] == pytest.approx(8 * params / world, rel=1e-12)


def test_impossible_layout_exits_2_naming_each_component(repo_root, capsys):
    # The 8B SFT recipe on one 80 GB GPU: fp32 weights + gradients + AdamW alone are 16 B x 8.03e9 = 128.5 GB.
    assert plan_main([_recipe(repo_root, "sft_8b"), "--num_processes", "1"]) == 2
    err = capsys.readouterr().err
    assert "does not fit in GPU memory" in err and "of 80 GB" in err
    assert f"{4 * LLAMA_8B_PARAMS / GB:8.2f} GB" in err  # parameters and gradients, 32.12 GB each
    assert f"{8 * LLAMA_8B_PARAMS / GB:8.2f} GB" in err  # AdamW moments, 64.24 GB
    assert "policy AdamW moments (fp32)" in err and "CUDA context" in err


def test_gpu_memory_gb_moves_the_verdict(repo_root, capsys):
    recipe = _recipe(repo_root, "rlvr_8b")
    total = build_plan(recipe, [], 7, None)["memory"]["total"]
    below = f"{total / GB * 0.9:.1f}"
    assert plan_main([recipe, "--num_processes", "7", "--gpu_memory_gb", below]) == 2
    assert f"of {float(below):g} GB" in capsys.readouterr().err
    assert plan_main([recipe, "--num_processes", "7", "--gpu", "H200", "--json"]) == 0


def test_params_and_kv_cache_equal_a_real_tiny_model(tiny_models, repo_root):
    """The parameter bytes of the plan equal the model's real parameter count x 4 (fp32 masters), and the KV cache
    formula equals the bytes of the cache a real forward builds."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["causal_lm"])
    real = sum(p.numel() for p in model.parameters())
    shape = shape_of(tiny_models["causal_lm"])
    assert shape.params == real
    cfg = recipe_config(_recipe(repo_root, "sft_tiny"), ["--model_name_or_path", tiny_models["causal_lm"]])
    for world in (1, 2):
        m = plan_from_config(cfg, world, 1000, assumptions=TimeAssumptions(gpu="H100", fsdp=True))["memory"]
        assert m["resident"]["policy parameters (fp32)"] == 4 * real / world
        assert m["resident"]["policy gradients (fp32)"] == 4 * real / world
        assert m["resident"]["policy AdamW moments (fp32)"] == 8 * real / world

    sequences, tokens = 3, 11
    with torch.no_grad():
        out = model(torch.ones(sequences, tokens, dtype=torch.long), use_cache=True)
    cache = out.past_key_values
    cached = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )
    assert cached == kv_cache_bytes(shape, sequences, tokens, 4)


def test_activation_and_head_formulas_by_hand():
    """Checkpointed activations = layers x tokens x hidden x bytes + one layer's full set; the chunked head keeps one
    chunk of logits in the compute dtype and fp32, plus in training the chunk's fp32 gradient and the output layer's
    fp32 weight gradient."""
    shape = ModelShape(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=100,
                       tied=False, source="hand")  # fmt: skip
    lay = MemoryLayout(world=1, fsdp=True, compute_bytes=2, activation_checkpointing=True, cpu_offload=False,
                       lora=False, train_tokens=4096, scored_tokens=4096, score_tokens=4096)  # fmt: skip
    per_layer = (6 * 64 + 2 * 2 * 16 + 4 * 128) * 2 + 2 * 64 * 4  # 2304 bytes per token
    assert shape.activation_bytes_per_token_per_layer(2) == per_layer
    m = predict_peak(lay, shape, 80.0)
    training = m["phases"]["training micro-batch"]
    assert training["activations (checkpointed)"] == 2 * 4096 * 64 * 2 + 4096 * per_layer
    rows = LOGPROB_CHUNK_TOKENS
    assert training["log-prob head (chunk)"] == rows * 100 * (2 + 4) + rows * 100 * 4 + 100 * 64 * 4
    assert m["total"] == sum(m["resident"].values()) + sum(m["phases"][m["peak_phase"]].values())


def test_chunk_size_matches_the_head():
    from open_instruct import models

    assert models.LOGPROB_CHUNK_TOKENS == LOGPROB_CHUNK_TOKENS


def test_colocated_engine_takes_its_share(repo_root):
    recipe = _recipe(repo_root, "rlvr_8b")
    colocated = ["--generation_backend", "vllm", "--async_steps", "0", "--vllm_gpu_memory_utilization", "0.5"]
    m = build_plan(recipe, colocated, 8, None, assumptions=TimeAssumptions(gpu="H200"))["memory"]
    assert m["resident"]["colocated vLLM engine (gpu_memory_utilization)"] == 0.5 * 141 * GB


def test_hf_generation_kv_cache_follows_the_generate_call_size(repo_root):
    """The plan's KV cache is one generate call's: generation_micro_batch_size sequences (or the default token bound),
    not the rank's whole rollout."""
    recipe = _recipe(repo_root, "rlvr_8b")
    hf = ["--generation_backend", "hf", "--async_steps", "0", "--local_rollout_batch_size", "64"]
    shape = shape_of("meta-llama/Llama-3.1-8B")
    tokens = 2048 + 2048  # the recipe's max_prompt_length + response_length
    for extra, sequences in [([], 131072 // tokens), (["--generation_micro_batch_size", "4"], 4)]:
        m = build_plan(recipe, hf + extra, 8, None)["memory"]
        assert m["phases"]["HF generation"]["KV cache"] == kv_cache_bytes(shape, sequences, tokens, 2)
