"""Adapter-only weight sync to a dedicated vLLM engine (generation_backend vllm_server, vllm_lora_sync adapter) on CPU:
the engine is started with vLLM's LoRA and runtime adapter loading (engines.engine_specs' lora_rank), the trainer
broadcasts the frozen base weights once and then loads each sync's adapter by folder (/v1/load_lora_adapter).

Needs vLLM (the vLLM venv: `make test-vllm`); skipped in the main venv.
"""

import os

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # an engine process: every wait is on an event

from engine_client_helpers import tiny_policy  # noqa: E402
from training_helpers import chat_prompts, move_adapter  # noqa: E402

from open_instruct.engines import LocalEngines, check_running_engines, engine_specs, free_port, write_engine_model  # noqa: E402
from open_instruct.errors import ConfigError  # noqa: E402
from open_instruct.generation import GenerationConfig, HFGenerator  # noqa: E402

RANK = 8


def test_a_dedicated_engine_takes_the_base_once_then_serves_each_synced_adapter(tmp_path):
    """The engine passes the check engines started apart get (LoRA up to the run's rank; a higher rank is refused).
    Sync 1 sends the base weights (the merged model's bytes) and the adapter (its factors' bytes, by hand: rank 8, 2
    layers of q, o 128->128, k, v 128->64 (2 of 4 heads), gate/up 128->256, down 256->128); greedy answers are then
    the adapted policy's, not the base's, every token labelled version 1. The generation check passes against the
    adapted trainer while the base model's log-probs are beyond its limits. A moved adapter is stale until synced,
    then followed; the base is not sent again; the adapter two versions back is unloaded, its folder gone."""
    import requests
    from peft import LoraConfig, get_peft_model

    from open_instruct.engine_client import ServerGenerator, adapter_name
    from open_instruct.generation_check import (
        GenerationChecker,
        Limits,
        compare,
        forward_scores,
        logit_scale,
        make_probe,
    )

    base_model, tokenizer = tiny_policy(str(tmp_path / "policy"), seed=3, tie=False)
    policy = get_peft_model(base_model, LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear")).eval()
    move_adapter(policy, 0)
    model_dir, untied = write_engine_model(str(tmp_path / "policy"), str(tmp_path / "engine_model"))
    specs = engine_specs(
        model_dir, num_engines=1, tensor_parallel_size=1, max_model_len=256, dtype="float32", seed=0,
        transfer="gloo", gpu_memory_utilization=0.5, devices=None, port=free_port(), lora_rank=RANK,
    )  # fmt: skip
    assert "--enable-lora" in specs[0].argv and specs[0].env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    engines = LocalEngines(specs, str(tmp_path / "logs"), start_timeout=600, repick_ports=True)
    # as engines started apart (vllm_server_urls) are checked: LoRA up to the run's rank, else refused naming it
    check_running_engines(engines.urls, 1, 200, dtype="float32", transfer="gloo", lora_rank=RANK)
    with pytest.raises(ConfigError, match="started with max_lora_rank 8; adapter-only sync .* lora_rank 16"):
        check_running_engines(engines.urls, 1, 200, dtype="float32", transfer="gloo", lora_rank=16)
    adapters = str(tmp_path / "adapters")
    gen = ServerGenerator(
        engines.urls, tokenizer, [tokenizer.eos_token_id], policy, rank=0, num_ranks=1, transfer="gloo",
        untie=untied, max_model_len=256, timeout=120, local_engines=engines, adapter_dir=adapters, keep_adapters=1,
    )  # fmt: skip
    try:
        sent = []
        real_send = gen.transfer.send_weights
        gen.transfer.send_weights = lambda *a, **kw: sent.append(1) or real_send(*a, **kw)
        gen.sync_weights(policy, version=1)
        vocab, hidden, kv, inner = len(tokenizer), 128, 64, 256
        per_layer = RANK * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inner))  # A: r x in, B: out x r
        assert gen.last_sync_bytes == 2 * per_layer * 4
        layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden  # + its two norms
        base_bytes = 2 * vocab * hidden + 2 * layer + hidden  # embedding, lm_head, layers, final norm
        assert sent == [1] and gen.full_sync_bytes == base_bytes * 4
        assert os.path.isfile(os.path.join(adapters, "adapter_1", "adapter_model.safetensors"))

        prompts = chat_prompts(tokenizer)
        cfg = GenerationConfig(max_new_tokens=16, temperature=0)
        hf = HFGenerator(policy, tokenizer, batch_size=4)
        adapted = hf.generate(prompts, cfg).response_ids
        with policy.disable_adapter():
            base = hf.generate(prompts, cfg).response_ids
        assert adapted != base
        got = gen.generate(prompts, cfg)
        assert got.response_ids == adapted
        assert got.weight_versions == [[1] * len(r) for r in got.response_ids]

        # The generation check: the engine's fingerprint is the adapted policy's; the base's is beyond the limits.
        probe = make_probe(tokenizer, 256)
        checker = GenerationChecker(gen, policy, probe, torch.float32)
        checker.sync(policy, 2)
        assert checker.at_launch["margin"] > 1
        (engine_scores,) = gen.score_tokens(probe.prompts, probe.continuations).values()
        with policy.disable_adapter():
            base_scores = forward_scores(policy, probe.prompts, probe.continuations)
        assert Limits.for_dtype(torch.float32, logit_scale(base_scores)).exceeded(compare(engine_scores, base_scores))

        # A moved adapter: stale until synced, then followed; the base is not sent again; version 1 unloaded.
        move_adapter(policy, 1)
        moved = hf.generate(prompts, cfg).response_ids
        assert moved != adapted
        assert gen.generate(prompts, cfg).response_ids == adapted  # stale until synced
        checker.sync(policy, 3)
        assert checker.last["check/margin"] > 1 and sent == [1] and gen.last_sync_bytes == 2 * per_layer * 4
        got = gen.generate(prompts, cfg)
        assert got.response_ids == moved and got.weight_versions == [[3] * len(r) for r in got.response_ids]
        served = {m["id"] for m in requests.get(f"{gen.urls[0]}/v1/models").json()["data"]}
        assert {adapter_name(2), adapter_name(3)} <= served and adapter_name(1) not in served
        assert sorted(os.listdir(adapters)) == ["adapter_2", "adapter_3"]
    finally:
        gen.close()


def test_a_lora_run_on_a_dedicated_engine_syncs_the_adapter_alone(tmp_path):
    """rlvr_ppo with use_lora, vllm_lora_sync adapter and generation_backend vllm_server (async 1: an adapter in
    flight while the next is loaded): the run starts its engine with LoRA, passes the launch and post-sync generation
    checks, and after the first rollout moves only the adapter's bytes per sync (by hand for lora_rank 16 on the
    hidden-128 tiny Llama, as above)."""
    from engine_client_helpers import REPO, SCRIPT, read_rows, run

    from demo import synthetic
    from demo.tiny import save_tiny_models

    models = save_tiny_models(str(tmp_path / "models"), hidden_size=128)
    data = synthetic.write_jsonl(str(tmp_path / "rl.jsonl"), synthetic.rl_rows(64, 0))
    out = str(tmp_path / "out")
    run([
        SCRIPT, os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", models["causal_lm"], "--dataset_name_or_path", data, "--eval_dataset_name_or_path",
        data, "--output_dir", out, "--algo", "grpo", "--num_samples_per_prompt", "4", "--local_rollout_batch_size",
        "4", "--per_device_train_batch_size", "16", "--num_epochs", "1", "--total_episodes", "48",
        "--response_length", "8", "--eval_steps", "100", "--checkpointing_steps", "100", "--beta", "0",
        "--use_lora", "true", "--lora_rank", "16", "--vllm_lora_sync", "adapter", "--generation_backend",
        "vllm_server", "--async_steps", "1", "--vllm_engine_start_timeout", "600",
    ])  # fmt: skip
    rows = [r for r in read_rows(out) if "perf/weight_sync_bytes" in r]
    assert len(rows) == 3
    adapter_bytes = 2 * 16 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256)) * 4
    assert rows[-1]["perf/weight_sync_bytes"] == adapter_bytes
    # versions 1 (launch) to 3: async 1 keeps the adapters async_steps + 1 versions back loaded (in-flight requests)
    assert sorted(os.listdir(os.path.join(out, "engine_adapters"))) == ["adapter_1", "adapter_2", "adapter_3"]
