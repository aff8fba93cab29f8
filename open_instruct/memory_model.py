"""Peak GPU memory per training process, predicted from a recipe and the model's shape (what `plan` prints and checks).

Every component is a formula in bytes (docs/gpu.md derives each one); the peak is the memory held the whole run
(weights, optimizer state, frozen models, the CUDA context) plus the largest of the phases that take turns on the GPU
(a training micro-batch, a no-grad scoring forward, HF generation), plus a stated margin for the caching allocator's
fragmentation. Pure arithmetic: no torch, no model loaded. GB here is 10^9 bytes (decimal), as is --gpu_memory_gb.

tests/test_plan_memory.py holds every phase's formula against what torch's CPU allocator records for a small model
(within 15%); the GPU check (bench/gpu_check.py) puts the prediction beside the measured CUDA peak.
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
# RL with vllm_server: rank 0 sends the weights to the engines through vLLM's packed NCCL producer, two 1 GiB buffers
# (double-buffered packing); the caching allocator keeps them reserved between syncs.
WEIGHT_BROADCAST_BUFFER_BYTES = 2 * 2**30
# The caching allocator's reserved memory runs above what tensors hold (blocks split and rounded, a growing KV cache's
# freed blocks): a margin on everything torch allocates, not a measured constant.
FRAGMENTATION_MARGIN = 0.05

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
    output_layer: bool = True  # False: a value or reward model, whose head is hidden -> 1 (no vocabulary layer)

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
        """Every parameter (the embedding once when tied), equal to plan.llama_like_params; a scalar-head model has
        the embedding, a hidden x 1 head and no output layer."""
        head = self.vocab * self.hidden * (0 if self.tied else 1) if self.output_layer else self.hidden
        return self.layers * self.layer_params + self.vocab * self.hidden + head + self.hidden

    def without_output_layer(self) -> "ModelShape":
        """The same backbone with a scalar head (PPO's value model, a reward model)."""
        import dataclasses

        return dataclasses.replace(self, output_layer=False, tied=False)

    @property
    def largest_unit_params(self) -> int:
        """The largest FSDP unit: a decoder layer, or the embedding or [final norm, output layer] unit accelerate
        carves out (one tensor when tied)."""
        return max(self.layer_params, self.vocab * self.hidden + self.hidden)

    def norm_bytes_per_token(self, dtype_bytes: int, fp32_residual: bool, consumers: int) -> int:
        """What one RMSNorm (HF's: upcast to fp32, normalise, scale) keeps per token for the backward. With weights in
        the compute dtype (FSDP2, or fp32): its input, the fp32 upcast (none in fp32), the normalised values and the
        scaled output, which the next projection keeps. Under autocast over fp32 weights (one process, no FSDP): the
        fp32 input and normalised values, and one compute-dtype copy of the output per projection reading it
        (autocast casts each matmul's input separately: q, k, v read the first norm, gate and up the second)."""
        h, b = self.hidden, dtype_bytes
        if fp32_residual:
            return h * (4 + 4 + consumers * b)
        return h * (3 * b + (4 if b < 4 else 0))

    def activation_bytes_per_token_per_layer(self, dtype_bytes: int, fp32_residual: bool = False) -> int:
        """What one decoder layer's backward keeps per token: the two norms (norm_bytes_per_token), rotated q and k
        and v (which SDPA keeps), SDPA's output and the contiguous copy o_proj keeps, and the MLP's gate, up,
        act(gate) and product, in the compute dtype. Attention scores are not kept (SDPA's fused kernels); the
        rotary embedding keeps nothing of this size (its cos/sin are constants)."""
        h, kv, b = self.hidden, self.kv_heads * self.head_dim, dtype_bytes
        norms = self.norm_bytes_per_token(b, fp32_residual, 3) + self.norm_bytes_per_token(b, fp32_residual, 2)
        return norms + (3 * h + 2 * kv) * b + 4 * self.intermediate * b

    def forward_bytes_per_token(self, dtype_bytes: int, fp32_residual: bool = False) -> int:
        """The most a no-grad forward holds per token inside one layer (nothing is kept for a backward): the
        residual stream and the new residual, the norm's fp32 upcast, and the MLP's gate, act(gate) and up before
        the product replaces two of them."""
        h, b = self.hidden, dtype_bytes
        residual = 4 if fp32_residual else b
        return h * (2 * residual + 4) + 3 * self.intermediate * b

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: layers x 2 x kv_heads x head_dim x bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


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
    generation_prompt_tokens: int = 0  # RL hf: the longest prompt (the prefill's width)
    weight_broadcast_bytes: float = 0.0  # RL vllm_server: rank 0's buffers for sending weights to the engines

    @property
    def fp32_residual(self) -> bool:
        """One process without FSDP under autocast: the weights stay fp32, so the residual stream, the norms and
        everything not a matmul stay fp32, and autocast keeps compute-dtype copies of the matmuls' inputs."""
        return not self.fsdp and self.compute_bytes < 4


def trained_model_bytes(shape: ModelShape, lay: MemoryLayout) -> dict[str, float]:
    """A trained model's resident bytes on one device: fp32 master parameters, fp32 gradients, AdamW's two fp32
    moments (4 + 4 + 8 bytes per parameter), sharded over the world under FSDP; in host memory with CPU offload."""
    shard = shape.params / (lay.world if lay.fsdp else 1)
    if lay.cpu_offload:
        return {"parameters (fp32)": 0.0, "gradients (fp32)": 0.0, "AdamW moments (fp32)": 0.0}
    if lay.lora:  # the frozen base weights in fp32; adapters are a rounding error
        return {"parameters (fp32)": 4 * shard, "gradients (fp32)": 0.0, "AdamW moments (fp32)": 0.0}
    return {"parameters (fp32)": 4 * shard, "gradients (fp32)": 4 * shard, "AdamW moments (fp32)": 8 * shard}


def working_weights_bytes(shape: ModelShape, lay: MemoryLayout, backward: bool = True) -> float:
    """Compute-dtype weights alive while a micro-batch runs. FSDP2: the unit computing and the one prefetched, both
    gathered in the compute dtype, plus, in a backward (`backward`; a no-grad forward has none), the largest unit's
    unsharded gradient (compute dtype) and its fp32 copy for the reduce-scatter. One process without FSDP under
    autocast: the compute-dtype copy of every matmul's weight (not the embedding table, which is looked up, unless
    tied to the output layer), which autocast's cache keeps until the forward returns and autograd keeps for the
    backward (none in fp32)."""
    b = lay.compute_bytes
    if lay.fsdp:
        gradient = (b + 4) * shape.largest_unit_params if backward else 0
        return 2 * b * (shape.largest_unit_params + shape.layer_params) + gradient
    if b == 4:
        return 0.0
    return b * (shape.params - (0 if shape.tied else shape.vocab * shape.hidden))


def saved_activation_bytes(shape: ModelShape, tokens: int, lay: MemoryLayout) -> float:
    """A training micro-batch's saved activations, all layers. Without checkpointing: every layer's set
    (activation_bytes_per_token_per_layer). With it: each layer's input, in the residual stream's dtype (fp32 under
    autocast over fp32 weights: 4 bytes, not 2)."""
    if lay.activation_checkpointing:
        return shape.layers * tokens * shape.hidden * (4 if lay.fp32_residual else lay.compute_bytes)
    return shape.layers * tokens * shape.activation_bytes_per_token_per_layer(lay.compute_bytes, lay.fp32_residual)


def recompute_bytes(shape: ModelShape, tokens: int, lay: MemoryLayout) -> float:
    """With checkpointing, the backward of one layer: its recomputed set, the fp32 gradients of the residual stream
    flowing in and out (2 x hidden x 4 per token) and the MLP's gate and up gradients (2 x intermediate, compute
    dtype)."""
    per_layer = shape.activation_bytes_per_token_per_layer(lay.compute_bytes, lay.fp32_residual)
    return tokens * (per_layer + 2 * shape.hidden * 4 + 2 * shape.intermediate * lay.compute_bytes)


def output_stack_bytes(shape: ModelShape, tokens: int, scored_tokens: int, lay: MemoryLayout) -> float:
    """Kept between the last layer and the head: the final norm's set, and the scored positions' hidden states the
    head keeps."""
    out = 4 if lay.fp32_residual else lay.compute_bytes
    return (
        tokens * shape.norm_bytes_per_token(lay.compute_bytes, lay.fp32_residual, 1)
        + scored_tokens * shape.hidden * out
    )


def logprob_head_bytes(shape: ModelShape, scored_tokens: int, lay: MemoryLayout, training: bool) -> float:
    """The chunked log-prob head (models._ChunkedTokenScores), one chunk of at most LOGPROB_CHUNK_TOKENS rows at a
    time. Forward: the [rows, vocab] logits in the compute dtype, their fp32 copy (none in fp32) and the fp32
    log-softmax. Backward (training; the larger): the recomputed logits in the compute dtype and fp32, the fp32
    softmax turned in place into the gradient, and its compute-dtype copy; the output layer's fp32 weight gradient
    with one [vocab, hidden] product in the compute dtype (and its fp32 copy)."""
    rows, b = min(scored_tokens, LOGPROB_CHUNK_TOKENS), lay.compute_bytes
    upcast = 4 if b < 4 else 0  # .float() of a compute-dtype tensor; a no-op in fp32
    forward = rows * shape.vocab * (b + upcast + 4)
    if not training:
        return forward
    backward = rows * shape.vocab * (b + upcast + 4 + (b if b < 4 else 0))
    return max(forward, backward + shape.vocab * shape.hidden * (4 + b + upcast))


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, dtype_bytes: int) -> float:
    """HF generation's KV cache: layers x 2 x kv_heads x head_dim x (sequences x tokens) x bytes."""
    return shape.kv_bytes_per_token(dtype_bytes) * sequences * tokens


def generation_bytes(shape: ModelShape, lay: MemoryLayout) -> dict[str, float]:
    """One HF `generate` call of `generation_sequences` sequences, from weights in the compute dtype (FSDP2's gathered
    ones, or one process's cast copy): the KV cache at its full length (the compute dtype); then the larger of the
    prefill (one layer's no-grad intermediates over every prompt token, and the [sequences, 1, prompt, prompt]
    boolean mask transformers builds for left-padded prompts) and the cache's growth
    (each decoding step concatenates every layer's K and V with the new token's: one layer's old and new cache
    coexist); and the sampling logits (the last position's, fp32, a few [sequences, vocab] buffers)."""
    b, n, prompt = lay.compute_bytes, lay.generation_sequences, lay.generation_prompt_tokens or lay.generation_tokens
    cache = kv_cache_bytes(shape, n, lay.generation_tokens, b)
    prefill = n * prompt * shape.forward_bytes_per_token(b) + n * prompt * prompt  # weights in b: residual too
    growth = cache / shape.layers
    return {
        "KV cache": cache,
        "prefill intermediates or one layer's cache copy": max(
            prefill - (cache - kv_cache_bytes(shape, n, prompt, b)), growth
        ),  # fmt: skip
        "sampling logits (fp32)": 4 * n * shape.vocab * 4,
    }


def predict_peak(
    lay: MemoryLayout,
    policy: ModelShape,
    gpu_memory_gb: float,
    value: Optional[ModelShape] = None,
    frozen: tuple[tuple[str, ModelShape], ...] = (),
    trains_lm_head: bool = True,
    on_gpu: bool = True,
) -> dict[str, Any]:
    """Peak bytes per GPU: {"resident": {component: bytes}, "phases": {phase: {component: bytes}}, "peak_phase",
    "margin", "total", "gpu_memory_gb", "fits"}. `value`: a second trained model (PPO's value model, trained in the
    same backward; a scalar head, no output layer); `frozen`: (name, shape) of no-grad models held in the compute
    dtype (reference, reward); `trains_lm_head`: False for a scalar-head model (reward model), which has no
    vocabulary logits; `on_gpu`: False for a run on the CPU (no CUDA context, host memory judged)."""
    if not trains_lm_head:
        policy = policy.without_output_layer()
    value = value.without_output_layer() if value is not None else None
    resident: dict[str, float] = {}
    for prefix, shape in (("policy", policy), ("value model", value)):
        if shape is not None:
            for name, size in trained_model_bytes(shape, lay).items():
                resident[f"{prefix} {name}"] = size
    shard = lay.world if lay.fsdp else 1
    for name, shape in frozen:
        resident[f"{name} (frozen, compute dtype)"] = lay.compute_bytes * shape.params / shard
    context = CUDA_CONTEXT_BYTES if on_gpu else 0.0
    resident["CUDA context and workspaces"] = context
    if lay.weight_broadcast_bytes:
        resident["vLLM weight-broadcast buffers (rank 0)"] = lay.weight_broadcast_bytes
    if lay.engine_fraction:
        resident["colocated vLLM engine (gpu_memory_utilization)"] = lay.engine_fraction * gpu_memory_gb * GB

    trained = [s for s in (policy, value) if s is not None]
    tokens, scored = lay.train_tokens, lay.scored_tokens
    # The head's peak (forward or backward) comes with every activation kept; with checkpointing, each layer's
    # recompute comes later, with the inputs only: the larger of the two counts.
    head = logprob_head_bytes(policy, scored, lay, training=True) if trains_lm_head else 0.0
    later = max(recompute_bytes(s, tokens, lay) for s in trained) if lay.activation_checkpointing else 0.0
    gathered = sum(working_weights_bytes(s, lay) for s in trained)
    if lay.fsdp and trains_lm_head and head:
        # The largest unit is the output layer's: its unsharded gradient and fp32 reduce-scatter copy come after the
        # head's backward has freed its own weight-gradient buffers, so only what exceeds them adds.
        b = lay.compute_bytes
        unit_gradient = (b + 4) * policy.largest_unit_params
        gathered -= min(unit_gradient, policy.vocab * policy.hidden * (4 + b + (4 if b < 4 else 0)))
    training = {
        "gathered weights and gradients": gathered,
        "activations" + (" (checkpointed)" if lay.activation_checkpointing else ""): sum(
            saved_activation_bytes(s, tokens, lay) + output_stack_bytes(s, tokens, scored if s is policy else 0, lay)
            for s in trained
        ),
        "log-prob head (chunk) or one layer's recompute": max(head, later),
    }
    largest = max([policy, value, *(s for _, s in frozen)], key=lambda s: 0 if s is None else s.params)
    # A no-grad forward keeps nothing: one layer's intermediates, then (after the last layer) the head's chunk.
    intermediates = lay.score_tokens * largest.forward_bytes_per_token(lay.compute_bytes, lay.fp32_residual)
    scoring_head = logprob_head_bytes(policy, lay.score_tokens, lay, training=False) if trains_lm_head else 0.0
    scoring = {
        "gathered weights": working_weights_bytes(largest, lay, backward=False),
        "one layer's intermediates or the log-prob head (chunk)": max(intermediates, scoring_head),
    }
    phases = {"training micro-batch": training, "no-grad forward": scoring}
    if lay.generation_sequences:
        # Between updates gradients are freed (zero_grad(set_to_none)). FSDP2 gathers the whole policy for generate
        # (distributed.full_params); one process under bf16/fp16 generates from a copy of the weights in that dtype
        # made once per weight version (HFGenerator._compute_dtype_model); fp32 from the weights as they are.
        freed = sum(v for k, v in resident.items() if "gradients" in k)
        weights = lay.compute_bytes * policy.params if (lay.fsdp or lay.compute_bytes < 4) else 0.0
        phases["HF generation"] = {
            "whole policy in the compute dtype": weights,
            **generation_bytes(policy, lay),
            "gradients freed": -freed,
        }
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    allocated = sum(resident.values()) - context + totals[peak_phase]
    margin = FRAGMENTATION_MARGIN * allocated
    total = sum(resident.values()) + totals[peak_phase] + margin
    return {
        "resident": resident,
        "phases": phases,
        "peak_phase": peak_phase,
        "margin": margin,
        "total": total,
        "gpu_memory_gb": gpu_memory_gb,
        "fits": total <= gpu_memory_gb * GB,
        "on_gpu": on_gpu,
    }


def memory_lines(m: dict[str, Any]) -> list[str]:
    """The prediction as the plan prints it (and names in a refusal): every component in GB."""
    per = "GPU" if m.get("on_gpu", True) else "process (host memory)"
    lines = [f"Memory per {per} (predicted peak; docs/gpu.md): {m['total'] / GB:.1f} GB of {m['gpu_memory_gb']:g} GB"]
    for name, size in m["resident"].items():
        if size:
            lines.append(f"  {name:<52} {size / GB:8.2f} GB")
    lines.append(f"  + the largest phase: {m['peak_phase']}")
    for name, size in m["phases"][m["peak_phase"]].items():
        if size:
            lines.append(f"    {name:<50} {size / GB:8.2f} GB")
    lines.append(
        f"  + allocator fragmentation margin ({FRAGMENTATION_MARGIN:.0%} of the allocated) {m['margin'] / GB:8.2f} GB"
    )
    others = [f"{n} {sum(p.values()) / GB:.2f} GB" for n, p in m["phases"].items() if n != m["peak_phase"]]
    lines.append(f"  (other phases: {', '.join(others)}; GB = 10^9 bytes)")
    return lines
