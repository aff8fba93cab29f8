"""Peak GPU memory per training process, predicted from a recipe and the model's shape (what `plan` prints and checks).

Every component is a formula in bytes (docs/gpu.md derives each one); the peak is the memory held the whole run
(weights, optimizer state, frozen models, the CUDA context) plus the largest of the phases that take turns on the GPU
(a training micro-batch, a no-grad scoring forward, HF generation). Pure arithmetic: no torch, no model loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

GB = 1e9
LOGPROB_CHUNK_TOKENS = 2048  # models.LOGPROB_CHUNK_TOKENS (tests/test_plan_memory.py holds them equal)
CUDA_CONTEXT_BYTES = 1.0 * GB  # CUDA context, cuBLAS/NCCL workspaces: outside torch's allocator, always there

# The published Llama 3.1 shapes (their HF config.json), for hub names the planner cannot read offline.
LLAMA_31_SHAPES: dict[int, dict[str, Any]] = {
    8: dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    70: dict(
        hidden_size=8192,
        num_hidden_layers=80,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a decoder-only transformer (Llama/Qwen/Mistral shape)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    source: str

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> "ModelShape":
        heads = config.get("num_attention_heads", 1)
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            intermediate=config.get("intermediate_size", 4 * config["hidden_size"]),
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            source=source,
        )

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, the gated MLP, two RMSNorm weights."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        """Every parameter (the embedding once when tied), equal to plan.llama_like_params."""
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def largest_unit_params(self) -> int:
        """The largest FSDP unit: a decoder layer, or the [final norm, output layer] unit accelerate carves out (with
        the embedding when tied: one tensor)."""
        return max(self.layer_params, self.vocab * self.hidden + self.hidden)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: layers x 2 x kv_heads x head_dim x bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        """What one decoder layer's backward keeps per token: the norms' inputs and outputs (h each, x2), q (h), k
        and v (2 kv_heads x head_dim), the attention output (h), the MLP's gate, up, act(gate) and product
        (4 x intermediate), in the compute dtype; plus the two RMSNorms' fp32 copies of their input (HF casts to
        fp32). Attention scores are not kept (SDPA's fused kernels)."""
        h = self.hidden
        elements = 6 * h + 2 * self.kv_heads * self.head_dim + 4 * self.intermediate
        return elements * dtype_bytes + 2 * h * 4


def shape_of(name: Optional[str]) -> Optional[ModelShape]:
    """The model's shape from its local config.json, else the Llama 3.1 shape its name's size names (8B, 70B), else
    None (the memory prediction is then unavailable; so for a config.json without a decoder's sizes: its loader
    reports what is wrong with it)."""
    if not name:
        return None
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path) as f:
                return ModelShape.from_config(json.load(f), "local config.json")
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None
    match = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)\s*[Bb](?![a-z])", name.split("/")[-1])
    if match and float(match.group(1)) in LLAMA_31_SHAPES:
        size = int(float(match.group(1)))
        return ModelShape.from_config(LLAMA_31_SHAPES[size], f"Llama 3.1 {size}B shape (from the name)")
    return None


@dataclass(frozen=True)
class MemoryLayout:
    """How the recipe runs, as far as memory goes (filled by plan.memory_layout from the config and flags)."""

    world: int  # training processes
    fsdp: bool  # FSDP2 (parameters, gradients, optimizer state sharded over `world`); else one replica per process
    compute_bytes: int  # 2 under bf16/fp16 mixed precision, 4 in fp32
    activation_checkpointing: bool
    cpu_offload: bool  # fsdp_cpu_offload: parameters, gradients, optimizer state in host memory
    lora: bool  # only adapters trained: no gradients or optimizer state for the base weights
    train_tokens: int  # tokens in one training micro-batch on one device
    scored_tokens: int  # positions that reach the output layer in that micro-batch (<= train_tokens)
    score_tokens: int  # tokens of one no-grad forward (eval, reference pass, RL scoring)
    generation_sequences: int = 0  # RL hf: sequences decoded at once on one device
    generation_tokens: int = 0  # RL hf: prompt + response tokens of each
    engine_fraction: float = 0.0  # RL colocated vllm: share of the GPU the engine reserves


def trained_model_bytes(shape: ModelShape, lay: MemoryLayout) -> dict[str, float]:
    """A trained model's resident bytes on one device: fp32 master parameters, fp32 gradients, AdamW's two fp32
    moments (4 + 4 + 8 bytes per parameter), sharded over the world under FSDP; in host memory with CPU offload."""
    shard = shape.params / (lay.world if lay.fsdp else 1)
    if lay.cpu_offload:
        return {"parameters (fp32)": 0.0, "gradients (fp32)": 0.0, "AdamW moments (fp32)": 0.0}
    if lay.lora:  # the frozen base weights in fp32; adapters are a rounding error
        return {"parameters (fp32)": 4 * shard, "gradients (fp32)": 0.0, "AdamW moments (fp32)": 0.0}
    return {"parameters (fp32)": 4 * shard, "gradients (fp32)": 4 * shard, "AdamW moments (fp32)": 8 * shard}


def working_weights_bytes(shape: ModelShape, lay: MemoryLayout) -> float:
    """Compute-dtype weights alive while a micro-batch runs. FSDP2: the unit computing and the one prefetched, both
    gathered in the compute dtype, plus, in backward, the largest unit's unsharded gradient (compute dtype) and its
    fp32 copy for the reduce-scatter. One process without FSDP under autocast: the compute-dtype copy of every
    weight, which autograd keeps for the backward (none in fp32)."""
    b = lay.compute_bytes
    if lay.fsdp:
        return 2 * b * (shape.largest_unit_params + shape.layer_params) + (b + 4) * shape.largest_unit_params
    return b * shape.params if b < 4 else 0.0


def activation_bytes(shape: ModelShape, tokens: int, lay: MemoryLayout) -> float:
    """A training micro-batch's saved activations. Without checkpointing: every layer's (per-token, per-layer
    estimate above). With it: each layer's input (hidden x compute bytes), and one layer's full set while it is
    recomputed in the backward."""
    per_layer = tokens * shape.activation_bytes_per_token_per_layer(lay.compute_bytes)
    if lay.activation_checkpointing:
        return shape.layers * tokens * shape.hidden * lay.compute_bytes + per_layer
    return shape.layers * per_layer


def logprob_head_bytes(shape: ModelShape, scored_tokens: int, lay: MemoryLayout, training: bool) -> float:
    """The chunked log-prob head (models.chunked_token_scores): one chunk of at most LOGPROB_CHUNK_TOKENS rows of
    [rows, vocab] logits in the compute dtype and in fp32; the backward adds the chunk's fp32 softmax gradient and
    the output layer's fp32 weight gradient (vocab x hidden x 4)."""
    rows = min(scored_tokens, LOGPROB_CHUNK_TOKENS)
    logits = rows * shape.vocab * (lay.compute_bytes + 4)
    if not training:
        return logits
    return logits + rows * shape.vocab * 4 + shape.vocab * shape.hidden * 4


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, dtype_bytes: int) -> float:
    """HF generation's KV cache: layers x 2 x kv_heads x head_dim x (sequences x tokens) x bytes."""
    return shape.kv_bytes_per_token(dtype_bytes) * sequences * tokens


def predict_peak(
    lay: MemoryLayout,
    policy: ModelShape,
    gpu_memory_gb: float,
    value: Optional[ModelShape] = None,
    frozen: tuple[tuple[str, ModelShape], ...] = (),
    trains_lm_head: bool = True,
) -> dict[str, Any]:
    """Peak bytes per GPU: {"resident": {component: bytes}, "phases": {phase: {component: bytes}}, "peak_phase",
    "total", "gpu_memory_gb", "fits"}. `value`: a second trained model (PPO's value model, trained in the same
    backward); `frozen`: (name, shape) of no-grad models held in the compute dtype (reference, reward);
    `trains_lm_head`: False for a scalar-head model (reward model), which has no vocabulary logits."""
    resident: dict[str, float] = {}
    for prefix, shape in (("policy", policy), ("value model", value)):
        if shape is not None:
            for name, size in trained_model_bytes(shape, lay).items():
                resident[f"{prefix} {name}"] = size
    shard = lay.world if lay.fsdp else 1
    for name, shape in frozen:
        resident[f"{name} (frozen, compute dtype)"] = lay.compute_bytes * shape.params / shard
    resident["CUDA context and workspaces"] = CUDA_CONTEXT_BYTES
    if lay.engine_fraction:
        resident["colocated vLLM engine (gpu_memory_utilization)"] = lay.engine_fraction * gpu_memory_gb * GB

    trained = [s for s in (policy, value) if s is not None]
    training = {
        "gathered weights and gradients": sum(working_weights_bytes(s, lay) for s in trained),
        "activations" + (" (checkpointed)" if lay.activation_checkpointing else ""): sum(
            activation_bytes(s, lay.train_tokens, lay) for s in trained
        ),
    }
    if trains_lm_head:
        training["log-prob head (chunk)"] = logprob_head_bytes(policy, lay.scored_tokens, lay, training=True)
    largest = max([policy, value, *(s for _, s in frozen)], key=lambda s: 0 if s is None else s.params)
    scoring = {
        "gathered weights": working_weights_bytes(largest, lay) if lay.fsdp else lay.compute_bytes * largest.params,
        "one layer's activations": lay.score_tokens * largest.activation_bytes_per_token_per_layer(lay.compute_bytes),
    }
    if trains_lm_head:
        scoring["log-prob head (chunk)"] = logprob_head_bytes(policy, lay.score_tokens, lay, training=False)
    phases = {"training micro-batch": training, "no-grad forward": scoring}
    if lay.generation_sequences:
        # Between updates gradients are freed (zero_grad(set_to_none)); the whole policy is gathered for generate.
        freed = sum(v for k, v in resident.items() if "gradients" in k)
        phases["HF generation"] = {
            "whole policy gathered (compute dtype)": lay.compute_bytes * policy.params,
            "KV cache": kv_cache_bytes(policy, lay.generation_sequences, lay.generation_tokens, lay.compute_bytes),
            "sampling logits (fp32)": 2 * lay.generation_sequences * policy.vocab * 4,
            "gradients freed": -freed,
        }
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    total = sum(resident.values()) + totals[peak_phase]
    return {
        "resident": resident,
        "phases": phases,
        "peak_phase": peak_phase,
        "total": total,
        "gpu_memory_gb": gpu_memory_gb,
        "fits": total <= gpu_memory_gb * GB,
    }


def memory_lines(m: dict[str, Any]) -> list[str]:
    """The prediction as the plan prints it (and names in a refusal): every component in GB."""
    lines = [f"Memory per GPU (predicted peak; docs/gpu.md): {m['total'] / GB:.1f} GB of {m['gpu_memory_gb']:g} GB"]
    for name, size in m["resident"].items():
        if size:
            lines.append(f"  {name:<52} {size / GB:8.2f} GB")
    lines.append(f"  + the largest phase: {m['peak_phase']}")
    for name, size in m["phases"][m["peak_phase"]].items():
        if size:
            lines.append(f"    {name:<50} {size / GB:8.2f} GB")
    others = [f"{n} {sum(p.values()) / GB:.2f} GB" for n, p in m["phases"].items() if n != m["peak_phase"]]
    lines.append(f"  (other phases: {', '.join(others)})")
    return lines
