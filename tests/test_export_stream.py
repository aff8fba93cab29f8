"""Saving an HF model without a whole copy on the host (checkpoint.save_hf_model): the weights are streamed one tensor
at a time into safetensors shards, in the compute dtype of a bf16 run; the folder loads with from_pretrained and
holds exactly the model's weights (cast to that dtype), tied weights tied."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from demo.tiny import build_tokenizer, tiny_llama_config
from open_instruct import checkpoint


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(checkpoint, "MAX_SHARD_BYTES", 40_000)  # a tiny model in many shards: the streamed path


@pytest.mark.parametrize("precision,tied", [("bf16", False), ("no", True)], ids=["bf16-untied", "fp32-tied"])
def test_streamed_save_loads_and_matches(tmp_path, small_shards, precision, tied):
    torch.manual_seed(0)
    config = tiny_llama_config(300, hidden_size=64, num_layers=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    # one process: what save_hf_model asks of accelerate's Accelerator (whose state is one per process)
    accelerator = SimpleNamespace(mixed_precision=precision, num_processes=1, is_main_process=True,
                                  unwrap_model=lambda m: m, wait_for_everyone=lambda: None)  # fmt: skip
    out = str(tmp_path / "final_model")
    checkpoint.save_hf_model(model, build_tokenizer(), out, accelerator, {"optimizer_step": 3})

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) > 1  # sharded as it streamed
    assert json.loads(open(os.path.join(out, "config.json")).read())["dtype"] == str(dtype).split(".")[1]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == dtype for p in loaded.parameters())
    expected = {n: t.to(dtype) for n, t in model.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name  # a cast, nothing else: bit-identical
    assert (loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight) == tied
    ids = torch.randint(0, 300, (2, 9))
    for p in model.parameters():  # parameters only: the rotary buffers stay fp32, as from_pretrained rebuilds them
        p.data = p.data.to(dtype)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
