"""Dry-run planner: every batch quantity, step count and an estimated wall-clock time, without loading a model.

    python -m open_instruct.plan configs/rlvr_8b.yaml --num_processes 7
    python -m open_instruct.plan configs/dpo_8b.yaml --num_processes 8 --num_examples 60000 --json

Planner flags (`--num_processes`, `--num_examples`, `--json`, `--model_params`, `--engine_layout` and one flag per
field of `TimeAssumptions`: `--gpu`, `--mfu`, `--fill`, `--layer_overhead_ms`, `--generation_gpus`, ... see `--help`)
are read here; every other `--key value` is a recipe override. RL plans read the generation layout from the recipe
(generation_backend, vllm_num_engines x vllm_tensor_parallel_size, vllm_server_urls, async_steps). Invalid plans
and layouts that cannot start exit 2. The time is a sum of per-phase costs; the plan names the phase that dominates
and the flag that governs it (docs/planner.md#the-time-model-and-its-calibration). Imports neither torch nor model code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from open_instruct import integrations
from open_instruct.batch_math import BatchPlan, count_eval_points, count_multiples, generation_sequences_per_call
from open_instruct.config import CONFIG_CLASSES, BaseConfig, RLVRConfig, load_recipe, parse_config
from open_instruct.errors import ConfigError
from open_instruct.gpu_stats import PEAK_BF16_FLOPS
from open_instruct.memory_model import WEIGHT_BROADCAST_BUFFER_BYTES, MemoryLayout, memory_lines, predict_peak, shape_of
from open_instruct.mixture import mixture_summary, parse_mixer_list
from open_instruct.preflight import DATASET_EXTENSIONS, looks_local


@dataclass(frozen=True)
class GPUSpec:
    """A device's published peaks, for the time model (not accelerate's Accelerator)."""

    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_gb: float


# Published dense bf16 peaks (gpu_stats.PEAK_BF16_FLOPS) and HBM bandwidth; "H100" is the SXM card. "cpu" is this
# repo's 2-core test machine (measured bf16 matmul).
GPU_SPECS: dict[str, GPUSpec] = {
    "H100": GPUSpec(PEAK_BF16_FLOPS["H100 SXM"], 3.35e12, 80),
    "H100-PCIe": GPUSpec(PEAK_BF16_FLOPS["H100 PCIe"], 2.0e12, 80),
    "H100-NVL": GPUSpec(PEAK_BF16_FLOPS["H100 NVL"], 3.9e12, 94),
    "H200": GPUSpec(PEAK_BF16_FLOPS["H200"], 4.8e12, 141),
    "B200": GPUSpec(PEAK_BF16_FLOPS["B200"], 8.0e12, 180),
    "A100": GPUSpec(PEAK_BF16_FLOPS["A100"], 2.04e12, 80),
    "A100-40GB": GPUSpec(PEAK_BF16_FLOPS["A100"], 1.56e12, 40),
    "L40S": GPUSpec(PEAK_BF16_FLOPS["L40S"], 0.864e12, 48),
    "A10G": GPUSpec(PEAK_BF16_FLOPS["A10G"], 0.6e12, 24),
    "cpu": GPUSpec(1.84e12, 20e9, 24),
}

# Row counts of the published datasets (from their dataset cards), so recipes plan offline.
# A local file is counted exactly; pass --num_examples to override.
KNOWN_DATASET_SIZES: dict[str, int] = {
    "allenai/tulu-3-sft-mixture": 939_343,
    "allenai/llama-3.1-tulu-3-8b-preference-mixture": 272_898,
    "allenai/llama-3.1-tulu-3-70b-preference-mixture": 337_186,
    "allenai/RLVR-GSM-MATH-IF-Mixed-Constraints": 29_946,
    "allenai/RLVR-GSM": 7_473,
}


def count_local_rows(path: str, split: str = "train") -> int:
    """Rows in local .jsonl/.json/.parquet/.csv file(s) or Dataset.save_to_disk folders (comma separated), without
    loading the data into memory."""
    total = 0
    for part in path.split(","):
        part = part.strip()
        if part.endswith(".jsonl"):
            with open(part, "rb") as f:
                total += sum(1 for line in f if line.strip())
        elif part.endswith(".json"):
            with open(part) as f:
                data = json.load(f)
            total += len(data if isinstance(data, list) else next(iter(data.values())))
        elif part.endswith(".parquet"):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(part).metadata.num_rows
        elif part.endswith(".csv"):
            import pyarrow.csv

            total += pyarrow.csv.read_csv(part).num_rows
        elif os.path.isdir(part) and os.path.isfile(os.path.join(part, "state.json")):  # Dataset.save_to_disk
            import datasets

            total += datasets.load_from_disk(part).num_rows
        elif os.path.isdir(part) and os.path.isfile(os.path.join(part, "dataset_dict.json")):  # DatasetDict's
            import datasets

            saved = datasets.load_from_disk(part)
            if split not in saved:
                raise ConfigError(f"saved DatasetDict {part!r} has no split {split!r} (splits: {sorted(saved)})")
            total += saved[split].num_rows
        else:
            raise ConfigError(f"dataset_name_or_path {part!r}: cannot count rows of this file type")
    return total


def dataset_size(name: str, split: str) -> tuple[Optional[int], str]:
    """(rows, where the number came from); (None, reason) if it cannot be had offline."""
    parts = integrations.expand_sources(name)
    found = [integrations.find(p) for p in parts]
    if parts and all(found):  # an integration's sources: what each says (its size, or why it cannot tell)
        sizes = [integration.size(p, split) for integration, p in zip(found, parts)]
        if any(rows is None for rows, _ in sizes):
            return None, next(how for rows, how in sizes if rows is None)
        return sum(rows for rows, _ in sizes), sizes[0][1]
    if any(found):
        return None, "an integration's sources listed with other sources are counted when the run loads them"
    first = name.split(",")[0].strip()
    if os.path.exists(first):
        return count_local_rows(name, split), "counted in the local file(s)"
    if first.endswith(DATASET_EXTENSIONS) or looks_local(first):
        return None, f"local file {first!r} does not exist"
    if name in KNOWN_DATASET_SIZES:
        return KNOWN_DATASET_SIZES[name], "published size from the dataset card"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None, "hub dataset unknown offline"
    try:
        from datasets import load_dataset_builder

        info = load_dataset_builder(name).info
        return info.splits[split].num_examples, "hub dataset metadata"
    except Exception as e:  # noqa: BLE001 - any failure means "unknown", reported to the user
        return None, f"could not read hub metadata ({type(e).__name__})"


def llama_like_params(config: dict[str, Any]) -> int:
    """Parameter count of a decoder-only transformer from its HF config (Llama/Qwen/Mistral shape)."""
    h = config["hidden_size"]
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    inter = config.get("intermediate_size", 4 * h)
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    embed = vocab * h * (1 if config.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + h


def model_params(name: str, override: Optional[float]) -> tuple[Optional[float], str]:
    if override:
        return override, "--model_params"
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            return float(llama_like_params(json.load(f))), "counted from the local config.json"
    match = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([BbMm])(?![a-z])", name.split("/")[-1])
    if match:
        scale = 1e9 if match.group(2).lower() == "b" else 1e6
        return float(match.group(1)) * scale, f"read from the model name ({match.group(0)})"
    return None, "unknown: pass --model_params"


# Bytes of KV cache per token (K and V, bf16, every layer) of the published Llama 3.1 shapes: 2 x 2 bytes x layers x
# kv_heads x head_dim. Other models: from their local config.json, else the 8B ratio (16 kB per billion parameters).
KV_BYTES_PER_TOKEN = {8: 2 * 2 * 32 * 8 * 128, 70: 2 * 2 * 80 * 8 * 128}
LAYERS = {8: 32, 70: 80}  # transformer layers of the Llama 3.1 shapes (per-layer overheads)

# Mean prompt tokens (chat template included) of the published RL prompt sets, for generation and training lengths.
# Estimates, not measured here (no hub access): GSM8K / MATH / IFEval-style prompts are short questions.
KNOWN_PROMPT_TOKENS: dict[str, int] = {"allenai/RLVR-GSM-MATH-IF-Mixed-Constraints": 200, "allenai/RLVR-GSM": 150}


def check_recipe_gpu(cfg: BaseConfig) -> None:
    if cfg.gpu is not None and cfg.gpu not in GPU_SPECS:
        raise ConfigError(f"gpu {cfg.gpu!r} is not in the planner's table; choose from {sorted(GPU_SPECS)}")


@dataclass
class TimeAssumptions:
    """Every assumption of the time model, each a `plan` flag of the same name (see `ASSUMPTION_HELP`)."""

    gpu: Optional[str] = None  # None: the recipe's `gpu`, else H100 (for_recipe)
    mfu: float = 0.3
    fill: float = 0.5
    tokens_per_sample: Optional[int] = None
    prompt_tokens: Optional[int] = None
    response_fill: float = 0.5
    rl_padding: str = "max"
    interconnect_gb_s: float = 150.0
    layer_overhead_ms: float = 6.0
    pair_padding: float = 1.25
    host_gb_s: float = 12.0
    load_gb_s: float = 1.0
    decode_efficiency: float = 0.6
    first_step_factor: float = 3.0
    generation_gpus: Optional[int] = None  # None: the recipe's layout
    overlap_generation: Optional[bool] = None  # None: the recipe's async_steps
    network_gb_s: float = 25.0
    gpus_per_node: int = 8
    stop_at_episode: Optional[int] = None
    code_fraction: float = 0.0
    sandbox_call_seconds: float = 0.0  # 0: measured on this machine (sandbox.measure_call_seconds)
    turns_per_episode: Optional[int] = None  # multi-turn: None = the recipe's max_turns (an upper bound)
    tool_call_seconds: Optional[float] = None  # multi-turn: None = a sandbox call with python, else ~0
    gpu_memory_gb: Optional[float] = None  # None: the --gpu's memory (H100: 80)
    fsdp: Optional[bool] = None  # None: FSDP2 when num_processes > 1

    def for_recipe(self, cfg: BaseConfig) -> TimeAssumptions:
        """These assumptions, checked, on the device the recipe names (`gpu`, `gpu_memory_gb`: what its start's
        memory check judges) where the command line named none; else the H100."""
        if self.gpu is None:
            check_recipe_gpu(cfg)
        memory = self.gpu_memory_gb
        if memory is None and self.gpu is None:  # the recipe's memory goes with the recipe's device only
            memory = cfg.gpu_memory_gb
        a = dataclasses.replace(self, gpu=self.gpu or cfg.gpu or "H100", gpu_memory_gb=memory)
        a.check()
        return a

    def check(self) -> None:
        if self.gpu not in GPU_SPECS:
            raise ConfigError(f"--gpu {self.gpu!r} is not in the table; choose from {sorted(GPU_SPECS)}")
        for name in ("mfu", "fill", "response_fill", "decode_efficiency"):
            if not (0 < getattr(self, name) <= 1):
                raise ConfigError(f"--{name} must be in (0, 1], got {getattr(self, name)}")
        if self.layer_overhead_ms < 0:
            raise ConfigError(f"--layer_overhead_ms must be >= 0, got {self.layer_overhead_ms}")
        for name in ("interconnect_gb_s", "host_gb_s", "load_gb_s", "network_gb_s", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.pair_padding < 1:
            raise ConfigError(f"--pair_padding must be >= 1, got {self.pair_padding}")
        if self.first_step_factor < 1:
            raise ConfigError(f"--first_step_factor must be >= 1, got {self.first_step_factor}")
        if self.rl_padding not in ("max", "mean"):
            raise ConfigError(f"--rl_padding must be 'max' or 'mean', got {self.rl_padding!r}")
        if not 0 <= self.code_fraction <= 1 or self.sandbox_call_seconds < 0:
            raise ConfigError(
                f"--code_fraction must be in [0, 1] and --sandbox_call_seconds >= 0, got {self.code_fraction}, "
                f"{self.sandbox_call_seconds}"
            )
        if self.tool_call_seconds is not None and self.tool_call_seconds < 0:
            raise ConfigError(f"--tool_call_seconds must be >= 0, got {self.tool_call_seconds}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ConfigError(f"--gpu_memory_gb must be > 0, got {self.gpu_memory_gb}")
        for name in ("generation_gpus", "stop_at_episode", "tokens_per_sample", "prompt_tokens", "turns_per_episode"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")


ASSUMPTION_HELP = {
    "gpu": f"device, one of {sorted(GPU_SPECS)} (default: the recipe's gpu, else H100)",
    "mfu": "fraction of peak bf16 FLOP/s reached by forward/backward compute at micro-batches of 1-2 sequences "
    "(default 0.3)",
    "fill": "supervised: mean sequence length as a fraction of max_seq_length (default 0.5)",
    "tokens_per_sample": "supervised: mean tokens per sequence (overrides --fill)",
    "prompt_tokens": "RL: mean prompt tokens (default: the dataset table, else max_prompt_length / 4)",
    "response_fill": "RL: mean response length as a fraction of response_length, for KV-cache traffic (0.5)",
    "rl_padding": "RL training/scoring length: 'max' = prompt + response_length (a rollout is padded to its "
    "longest response, which reaches the limit at temperature 1), 'mean' = prompt + mean response",
    "interconnect_gb_s": "effective per-GPU bandwidth of FSDP/ZeRO-3 all-gathers and reduce-scatters, GB/s (150)",
    "layer_overhead_ms": "fixed cost per layer per training micro-batch (forward + backward), ms: per-layer gather/"
    "reduce launches, hooks and activation-checkpoint bookkeeping that no compute hides (default 6)",
    "pair_padding": "RM/DPO: chosen and rejected share one padded batch, so each costs the longer one: E[max of two "
    "lengths] / mean (default 1.25, lengths with a coefficient of variation ~0.45)",
    "host_gb_s": "host <-> device bandwidth for fsdp_cpu_offload, GB/s (12)",
    "load_gb_s": "weight loading from disk or network, GB/s (1)",
    "decode_efficiency": "fraction of HBM bandwidth reached while decoding (0.6)",
    "first_step_factor": "the first step costs this many steps (allocator warm-up, compilation, caches) (3)",
    "generation_gpus": "RL: GPUs that generate, overriding the recipe's layout (vllm_server: vllm_num_engines x "
    "vllm_tensor_parallel_size, dedicated; hf/vllm: the training GPUs)",
    "overlap_generation": "RL: plan generation beside training (one-step off-policy) whatever the recipe's async_steps "
    "(default: async_steps > 0; needs dedicated engines)",
    "network_gb_s": "RL: bandwidth of the weight broadcast to engines on other nodes (vllm_server_urls), GB/s (25: "
    "one 200-400 Gb/s NIC, effective); engines on the training node use --interconnect_gb_s",
    "gpus_per_node": "GPUs per node: engines started by the trainer (vllm_server_urls unset) must fit beside its "
    "training processes on its node (8)",
    "stop_at_episode": "plan a run stopped at this episode (an early checkpoint) instead of the whole schedule",
    "code_fraction": "RL: fraction of completions scored by the `code` verifier (programs run in the sandbox) (0)",
    "turns_per_episode": "RL with an environment: policy turns (generation rounds) per episode (default: the "
    "recipe's max_turns, an upper bound; train/turns_per_episode of a short run measures it)",
    "tool_call_seconds": "RL with an environment: seconds one tool call takes (default: a sandboxed call when tools "
    "include python, else 0.001 for the in-process calculator)",
    "gpu_memory_gb": "memory of one training GPU in GB, for the memory prediction; a layout predicted above it is "
    "refused (exit 2) (default: the recipe's gpu_memory_gb without --gpu, else the --gpu's: H100 80)",
    "fsdp": "plan FSDP2 sharding even with --num_processes 1 (default: FSDP2 when num_processes > 1, as the "
    "launchers run it; one process without it otherwise)",
    "sandbox_call_seconds": "RL: seconds one response's sandboxed tests take (process start + tests); 0 = measure "
    "a trivial call on this machine (bench/bench_code_verifier.py measures real responses) (0)",
}


def kv_bytes_per_token(name: str, params: float) -> tuple[float, str]:
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            c = json.load(f)
        heads = c.get("num_attention_heads", 1)
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return 4.0 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim, "local config.json"
    size = round(params / 1e9)
    if size in KV_BYTES_PER_TOKEN:
        return float(KV_BYTES_PER_TOKEN[size]), f"Llama 3.1 {size}B shape"
    return 16.4e3 * params / 1e9, "16 kB per billion parameters (Llama 3.1 8B ratio)"


# Attention heads (query, key/value) of the published Llama 3.1 shapes: tensor parallelism splits them.
ATTENTION_HEADS = {8: (32, 8), 70: (64, 8)}


def attention_heads(name: str, params: float) -> Optional[tuple[int, int, str]]:
    """(query heads, key/value heads, where from) when the planner knows the model's shape, else None."""
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            c = json.load(f)
        if "num_attention_heads" not in c:
            return None
        heads = c["num_attention_heads"]
        return heads, c.get("num_key_value_heads", heads), "local config.json"
    size = round(params / 1e9)
    if size in ATTENTION_HEADS:
        return (*ATTENTION_HEADS[size], f"Llama 3.1 {size}B shape")
    return None


@dataclass(frozen=True)
class GenerationLayout:
    """Where RL rollouts are generated: the recipe's backend and engines, with the plan flags' overrides applied."""

    backend: str
    engines: int
    tensor_parallel: int
    dedicated: bool  # engines on GPUs of their own (vllm_server), not the training GPUs
    remote: bool  # engines on other nodes (vllm_server_urls set), reached over the network
    async_steps: int  # rollouts generated ahead of training: the policy lag; > 0 overlaps generation with training

    @property
    def gpus(self) -> int:
        return self.engines * self.tensor_parallel

    @property
    def overlap(self) -> bool:
        return self.async_steps > 0


def generation_layout(cfg: RLVRConfig, world: int, params: float, a: TimeAssumptions) -> GenerationLayout:
    """The recipe's generation layout: vllm_server = vllm_num_engines engines of vllm_tensor_parallel_size GPUs each,
    dedicated, overlapping training when async_steps > 0; hf/vllm = every training GPU generates (colocated, engines
    of the TP the weights need, never overlapping). `--generation_gpus` / `--overlap_generation` override it."""
    if cfg.generation_backend == "vllm_server":
        tp, engines = cfg.vllm_tensor_parallel_size, cfg.vllm_num_engines
        if a.generation_gpus:
            if a.generation_gpus % tp:
                raise ConfigError(
                    f"--generation_gpus {a.generation_gpus} is not a multiple of vllm_tensor_parallel_size {tp}: "
                    f"engines take whole groups of {tp} GPUs"
                )
            engines = a.generation_gpus // tp
        async_steps = cfg.async_steps or (1 if a.overlap_generation else 0)
        return GenerationLayout("vllm_server", engines, tp, True, cfg.vllm_server_urls is not None, async_steps)
    if a.overlap_generation:
        raise ConfigError(
            f"--overlap_generation needs dedicated engines (generation_backend vllm_server); generation_backend "
            f"{cfg.generation_backend!r} generates on the training GPUs, between updates"
        )
    gpu = GPU_SPECS[a.gpu]
    # colocated: the smallest power-of-two TP whose bf16 weights take at most half of each GPU
    tp = max(1, 2 ** math.ceil(math.log2(max(1.0, 2 * params / (0.5 * gpu.memory_gb * 1e9)))))
    gpus = a.generation_gpus or world
    return GenerationLayout(cfg.generation_backend, max(1, gpus // tp), tp, False, False, 0)


def check_generation_layout(
    layout: GenerationLayout, cfg: RLVRConfig, world: Optional[int], params: Optional[float], a: TimeAssumptions
) -> None:
    """Refuse (ConfigError) a dedicated-engine layout that cannot start: TP not splitting the attention heads, an
    engine larger than a node or than its GPUs' memory, or (given the training world size) engines that do not fit
    beside the training processes on the trainer's node when it starts them itself (vllm_server_urls unset)."""
    if not layout.dedicated:
        return
    tp, gpn = layout.tensor_parallel, a.gpus_per_node
    shape = attention_heads(cfg.model_name_or_path, params or 0.0)
    if shape is not None:
        heads, kv_heads, source = shape
        # vLLM: query heads split evenly; key/value heads split evenly or, when fewer than tp, replicated evenly
        kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        if heads % tp or not kv_ok:
            valid = [t for t in range(1, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]
            raise ConfigError(
                f"vllm_tensor_parallel_size {tp} does not split the attention heads of {cfg.model_name_or_path} "
                f"({heads} query heads, {kv_heads} key/value heads, {source}): vLLM needs a TP that divides {heads} "
                f"and divides or is a multiple of {kv_heads}: {', '.join(map(str, valid))}"
            )
    if tp > gpn:
        raise ConfigError(
            f"vllm_tensor_parallel_size {tp} > --gpus_per_node {gpn}: an engine runs on the GPUs of one node"
        )
    gpu = GPU_SPECS[a.gpu]
    weights_gb = 2 * (params or 0.0) / 1e9 / tp
    if weights_gb > 0.9 * gpu.memory_gb:
        raise ConfigError(
            f"vllm_tensor_parallel_size {tp}: each engine GPU would hold {weights_gb:.0f} GB of bf16 weights "
            f"({params / 1e9:.1f} B parameters / {tp}), more than 90% of a {a.gpu}'s {gpu.memory_gb:.0f} GB (the "
            f"KV cache needs the rest): raise vllm_tensor_parallel_size"
        )
    if world is not None and not layout.remote:
        local = min(world, gpn)  # training processes on the trainer's node (nodes are filled first)
        if local + layout.gpus > gpn:
            raise ConfigError(
                f"the engines do not fit on the trainer's node: vllm_server_urls is unset, so its rank 0 starts "
                f"vllm_num_engines {layout.engines} x vllm_tensor_parallel_size {tp} = {layout.gpus} GPU(s) beside "
                f"its {local} training processes: {local} + {layout.gpus} = {local + layout.gpus} > --gpus_per_node "
                f"{gpn}. Train on fewer processes per node, or start the engines on nodes of their own "
                f"(python -m open_instruct.engines RECIPE) and pass --vllm_server_urls (scripts/rlvr_70b.sh does)"
            )


def weight_sync_seconds(params: float, layout: GenerationLayout, world: int, a: TimeAssumptions) -> float:
    """Seconds per rollout to put the updated bf16 weights into the engines. Dedicated engines: the trainer gathers
    its shards and broadcasts them layer by layer (pipelined), so the bytes cross the slower link once: the network
    to other nodes, the node's interconnect to local engines. Colocated: every training GPU gathers the whole model."""
    if layout.dedicated:
        return 2 * params / ((a.network_gb_s if layout.remote else a.interconnect_gb_s) * 1e9)
    return fsdp_gather_seconds(params, world, 1, a)


# generation_check.py's post-sync probe, at most: POST_SYNC_SEQUENCES x MAX_PROBE_TOKENS tokens (the launch check's
# four sequences run once); tests/test_generation_check.py keeps the two in step
PROBE_TOKENS = 1 * 48


def generation_check_seconds(
    params: float, layout: GenerationLayout, world: int, a: TimeAssumptions, flops_rate: float
) -> float:
    """The probe check after each weight sync to an engine (generation_check.py; hf generates with the trainer's own
    module and skips it): the trainer's forward of the probe (its FSDP gather included) and the engine's prefill of
    it, one after the other; neither is hidden."""
    tp = layout.tensor_parallel if layout.dedicated else 1
    probe_flops = 2 * params * PROBE_TOKENS
    return probe_flops / flops_rate + fsdp_gather_seconds(params, world, 1, a) + probe_flops / (tp * flops_rate)


def fsdp_gather_seconds(params: float, world: int, passes: float, a: TimeAssumptions) -> float:
    """FSDP/ZeRO-3 traffic: each pass moves the bf16 weights' (world-1)/world through every GPU's link. A training
    micro-batch makes 3 passes (all-gather for forward, again for backward, reduce-scatter of gradients), a
    no-grad forward 1. Prefetching overlaps it with compute: a micro-batch costs the slower of the two."""
    if world <= 1:
        return 0.0
    return passes * 2 * params * (world - 1) / world / (a.interconnect_gb_s * 1e9)


def num_layers(name: str, params: float) -> int:
    cfg_path = os.path.join(name, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            return int(json.load(f)["num_hidden_layers"])
    size = round(params / 1e9)
    return LAYERS.get(size, max(1, round(32 * (params / 8e9) ** (1 / 3))))


def micro_batch_phases(
    compute: float, comm: float, layers: int, training: bool, a: TimeAssumptions
) -> dict[str, float]:
    """One micro-batch's seconds by phase: compute, the FSDP traffic that prefetching does not hide behind it
    (a micro-batch costs the slower of the two), and the fixed per-layer overhead (a no-grad forward: a third)."""
    return {
        "training compute": compute,
        "FSDP communication": max(0.0, comm - compute),
        "per-layer overhead": layers * a.layer_overhead_ms / 1e3 * (1 if training else 1 / 3),
    }


def add_phases(total: dict[str, float], part: dict[str, float], times: float) -> None:
    for name, seconds in part.items():
        total[name] = total.get(name, 0.0) + times * seconds


def optimizer_seconds(cfg: BaseConfig, params: float, world: int, gpu: GPUSpec, a: TimeAssumptions) -> float:
    """One AdamW step on this device's shard: fp32 weights, gradients and two moments read and written (HBM bound);
    with fsdp_cpu_offload the shard's gradients go down and weights come back over the host link as well."""
    shard = params / world
    seconds = shard * 32 / gpu.memory_bandwidth
    if cfg.fsdp_cpu_offload:
        seconds += shard * 16 / (a.host_gb_s * 1e9)
    return seconds


def train_tokens_per_sample(cfg: BaseConfig, a: TimeAssumptions) -> float:
    """Tokens one sample puts through a training forward. Supervised: the assumed sequence length (--fill or
    --tokens_per_sample), twice for a pair, whose padded batch costs the longer sequence twice (--pair_padding).
    RL: prompt + response, the response padded to response_length with --rl_padding max. Packing
    (max_tokens_per_micro_batch) leaves no padding: the mean lengths."""
    if isinstance(cfg, RLVRConfig):
        padded = a.rl_padding == "max" and not cfg.packing
        return rl_prompt_tokens(cfg, a) + (cfg.response_length if padded else a.response_fill * cfg.response_length)
    tokens = a.tokens_per_sample or max(1, int(cfg.max_seq_length * a.fill))
    if cfg.script == "sft":
        return tokens
    return 2 * (tokens if cfg.packing else min(cfg.max_seq_length, int(tokens * a.pair_padding)))


def rl_prompt_tokens(cfg: RLVRConfig, a: TimeAssumptions) -> int:
    return a.prompt_tokens or KNOWN_PROMPT_TOKENS.get(cfg.dataset_name_or_path, cfg.max_prompt_length // 4)


def micro_batches_per_update(cfg: BaseConfig, plan: BatchPlan, a: TimeAssumptions) -> int:
    """Forward/backward passes per optimizer step on one device: gradient_accumulation_steps, or with packing the
    packed rows the local mini-batch's tokens fill (packs assumed full: best-fit decreasing leaves little room)."""
    if not cfg.packing:
        return plan.gradient_accumulation_steps
    tokens = plan.local_mini_batch_size * train_tokens_per_sample(cfg, a)
    return max(1, math.ceil(tokens / cfg.max_tokens_per_micro_batch))


def estimate(cfg: BaseConfig, plan: BatchPlan, params: float, a: TimeAssumptions) -> dict[str, Any]:
    """Seconds per phase, summed over the run. Training compute: 6 FLOPs/parameter/token (8 with activation
    checkpointing) at `mfu` of peak; FSDP communication per micro-batch; the optimizer step; RL generation bound by
    memory bandwidth (weights + KV cache read per decoded token); weight loading; a costlier first step."""
    gpu = GPU_SPECS[a.gpu]
    w = plan.world_size
    k = 8 if cfg.activation_checkpointing else 6
    flops_rate = gpu.peak_flops * a.mfu  # per GPU
    phases: dict[str, float] = {}
    out: dict[str, Any] = {}
    if not plan.is_rl:
        tokens = train_tokens_per_sample(cfg, a)  # RM and DPO: chosen + rejected
        steps = plan.optimizer_steps
        if a.stop_at_episode:
            steps = min(steps, -(-a.stop_at_episode // plan.mini_batch_size))
        micro_batches = micro_batches_per_update(cfg, plan, a)
        compute = plan.local_mini_batch_size * tokens * k * params / flops_rate / micro_batches
        layers = num_layers(cfg.model_name_or_path, params)
        micro = micro_batch_phases(compute, fsdp_gather_seconds(params, w, 3, a), layers, True, a)
        add_phases(phases, micro, steps * micro_batches)
        phases["optimizer step"] = steps * optimizer_seconds(cfg, params, w, gpu, a)
        out["train_tokens"] = int(steps * plan.mini_batch_size * tokens)
        if cfg.script == "dpo" and getattr(cfg, "loss_type", "") != "simpo":
            ref_tokens = int((plan.num_examples or plan.total_episodes) * tokens)
            out["reference_cache_tokens"] = ref_tokens
            phases["reference pass"] = ref_tokens * 2 * params / (w * flops_rate)
        models_loaded = 1
    else:
        assert isinstance(cfg, RLVRConfig)
        phases, details, steps = rl_phases(cfg, plan, params, a, gpu, k, flops_rate)
        out.update(details)
        models_loaded = 2 + cfg.uses_value_model + bool(cfg.reward_model_multiplier)
    step_seconds = sum(phases.values()) / max(steps, 1)
    phases["weight loading"] = models_loaded * 2 * params / (a.load_gb_s * 1e9)
    phases["first step"] = (a.first_step_factor - 1) * step_seconds
    total = sum(phases.values())
    dominant = max(phases, key=phases.get)
    out.update(
        planned_steps=steps,
        flops_per_param_token=k,
        seconds_per_step=step_seconds,
        estimated_hours=total / 3600,
        phase_hours={name: s / 3600 for name, s in phases.items()},
        dominant_phase=dominant,
        dominant_share=phases[dominant] / total,
        dominant_assumption=DOMINANT_ASSUMPTION[dominant],
    )
    return out


DOMINANT_ASSUMPTION = {
    "training compute": "--mfu and the sequence lengths (--fill / --tokens_per_sample / --rl_padding)",
    "FSDP communication": "--interconnect_gb_s (weights re-gathered every micro-batch: fewer, larger micro-batches)",
    "optimizer step": "--host_gb_s (fsdp_cpu_offload) or HBM bandwidth",
    "per-layer overhead": "--layer_overhead_ms (many small micro-batches: raise per_device_train_batch_size)",
    "reference pass": "--mfu and the sequence lengths",
    "generation": "--response_fill / --decode_efficiency / the engines (vllm_num_engines x vllm_tensor_parallel_size; "
    "memory-bandwidth bound decoding), or async_steps 1 to hide it behind training",
    "weight sync": "--network_gb_s (engines on other nodes) or --interconnect_gb_s (engines on the training node)",
    "generation check": "--interconnect_gb_s (the probe forward's FSDP gather), or generation_check off",
    "scoring": "--mfu and --rl_padding (no-grad forwards of policy, reference and value models)",
    "teacher forward": "--mfu and --rl_padding (the distillation teacher's no-grad forwards; its size)",
    "ptx": "--mfu and --rl_padding (PPO-ptx: a forward/backward on as many demonstrations as a micro-batch has rows)",
    "weight loading": "--load_gb_s",
    "verification": "--sandbox_call_seconds and --code_fraction, or more sandbox_workers (CPU cores per process)",
    "first step": "--first_step_factor",
}


def verification_seconds(responses: float, call_seconds: float, workers: int) -> float:
    """Seconds one process spends running its code responses' tests: responses * call_seconds / workers (the pool
    keeps `workers` sandboxes busy; the last wave's tail is ignored)."""
    return responses * call_seconds / max(1, workers)


def sandbox_call_seconds(a: TimeAssumptions) -> float:
    """--sandbox_call_seconds, or the mean of a few trivial sandboxed calls measured here (startup-bound)."""
    if a.sandbox_call_seconds:
        return a.sandbox_call_seconds
    from open_instruct.sandbox import measure_call_seconds

    return measure_call_seconds()


def multi_turn_generation(
    cfg: RLVRConfig, a: TimeAssumptions, decode: float, prefill: float, seqs: float, local_episodes: float
) -> tuple[float, float, float, int]:
    """Multi-turn generation (an environment): `turns` rounds (--turns_per_episode, default max_turns). Each round
    decodes until its longest turn ends (max_turn_tokens), and re-reads every episode's context so far (no prefix
    cache assumed: prompt + on average half the mean response); between rounds the trainer waits for the round's
    tool calls, turns - 1 per episode, sandbox_workers at a time per process:

        decode'  = decode  x turns x max_turn_tokens / response_length
        prefill' = prefill x turns + seqs x (turns - 1) x response_fill x response_length / 2 tokens of prefill
        tools    = local episodes x (turns - 1) x tool_call_seconds / sandbox_workers

    Returns (decode', prefill', tools, turns)."""
    turns = a.turns_per_episode or cfg.max_turns
    per_turn = min(cfg.max_turn_tokens or cfg.response_length, cfg.response_length)
    decode = decode * turns * per_turn / cfg.response_length
    prompt = rl_prompt_tokens(cfg, a)
    context = (turns - 1) * a.response_fill * cfg.response_length / 2
    prefill = prefill * turns + (prefill / max(prompt, 1)) * context
    call = a.tool_call_seconds
    if call is None:
        call = sandbox_call_seconds(a) if "python" in cfg.tools else 0.001
    tools = local_episodes * (turns - 1) * call / max(1, cfg.sandbox_workers)
    return decode, prefill, tools, turns


def rollout_seconds(generation: float, training: float, weight_sync: float, overlap: bool) -> float:
    """One rollout's wall clock. Synchronous: generate, then sync the weights, then train. Overlapped (async_steps
    > 0): the engines generate the next rollout while the trainer trains on this one, so the slower of the two
    sets the pace; the weight sync between them is hidden by neither."""
    return (max(generation, training) if overlap else generation + training) + weight_sync


def teacher_params(cfg: RLVRConfig, params: float) -> float:
    """The distillation teachers' parameters (0 without one), summed over teacher_models (each teacher's forward
    runs on every micro-batch that holds one of its rows: at most all of them): each from its local config.json or
    its name, else the policy's. A teacher server runs elsewhere (0 here)."""
    names = [path for _, path in cfg.loaded_teacher_settings()] if hasattr(cfg, "loaded_teacher_settings") else []
    return sum(model_params(name, None)[0] or params for name in names)


@dataclass
class RLGeneration:
    """One rollout's generation on the recipe's layout: seconds (decode + prefill + tools), and how they came about."""

    layout: Any
    seconds: float
    waves: int
    turns: float
    tool_seconds: float
    kv_bytes_per_token: float
    kv_bytes_source: str


def rl_generation(
    cfg: RLVRConfig,
    plan: BatchPlan,
    params: float,
    a: TimeAssumptions,
    gpu: GPUSpec,
    flops_rate: float,
    prompt: float,
    mean_response: float,
) -> RLGeneration:
    """The recipe's engines of `tp` GPUs each, sequences in waves that fit the KV cache: decode bound by HBM
    bandwidth (each decoded token reads the weights and the KV cache of every sequence in flight), prefill by
    compute; multi-turn episodes add their turns and tool calls."""
    w, episodes = plan.world_size, plan.episodes_per_rollout
    layout = generation_layout(cfg, w, params, a)  # checked in plan_from_config
    tp, engines = layout.tensor_parallel, layout.engines
    kv_token, kv_source = kv_bytes_per_token(cfg.model_name_or_path, params)
    seqs = episodes / engines
    kv_room = max(tp * gpu.memory_gb * 1e9 * 0.9 - 2 * params, 1e9)
    waves = max(1, math.ceil(seqs * (prompt + cfg.response_length) * kv_token / kv_room))
    per_wave = seqs / waves
    step_bytes = (2 * params + per_wave * (prompt + mean_response) * kv_token) / tp
    decode = waves * cfg.response_length * step_bytes / (gpu.memory_bandwidth * a.decode_efficiency)
    prefill = seqs * prompt * 2 * params / (tp * flops_rate)
    turns, tool_seconds = 1, 0.0
    if getattr(cfg, "environment", None):
        decode, prefill, tool_seconds, turns = multi_turn_generation(cfg, a, decode, prefill, seqs, episodes / w)
    return RLGeneration(layout, decode + prefill + tool_seconds, waves, turns, tool_seconds, kv_token, kv_source)


def rl_train_side(
    cfg: RLVRConfig,
    plan: BatchPlan,
    params: float,
    value: float,
    reward: float,
    a: TimeAssumptions,
    gpu: GPUSpec,
    k: int,
    flops_rate: float,
    train_len: float,
) -> tuple[dict[str, float], Optional[float]]:
    """Per-phase seconds of one rollout's training side, per device, and the sandbox's seconds per call (None: no
    code). Micro-batches of per_device_train_batch_size episodes (packing: the micro-batches their tokens fill).
    Scoring: no-grad forwards of the policy (old log-probs), reference, value and reward models (and a teacher);
    training: num_epochs forward/backward passes of the policy and the value model (and PPO-ptx's, as long as the
    policy's)."""
    w, episodes = plan.world_size, plan.episodes_per_rollout
    micro_batches = episodes / w / plan.local_mini_batch_size * micro_batches_per_update(cfg, plan, a)
    tokens = episodes / w * train_len / micro_batches
    layers = num_layers(cfg.model_name_or_path, params)
    value_layers = num_layers(cfg.value_model_path or "", value) if value else 0
    teacher = teacher_params(cfg, params)
    loaded = cfg.loaded_teacher_settings()
    teacher_layers = max((num_layers(p, teacher) for _, p in loaded), default=0) if teacher else 0
    # (size, layers, forwards per micro-batch, phase name); the teacher's again each epoch under jsd
    no_grad = [(params, layers, 2, "scoring"), (value, value_layers, 1, "scoring"), (reward, layers, 1, "scoring")]
    teacher_forwards = 1 + (cfg.num_epochs if cfg.distill_loss == "jsd" else 0) if teacher else 0
    no_grad.append((teacher, teacher_layers, teacher_forwards, "teacher forward"))
    train_side: dict[str, float] = {}
    for size, n_layers, forwards, name in no_grad:
        if size:
            part = micro_batch_phases(
                tokens * 2 * size / flops_rate, fsdp_gather_seconds(size, w, 1, a), n_layers, False, a
            )
            add_phases(
                train_side,
                {name if n == "training compute" else n: v for n, v in part.items()},
                forwards * micro_batches,
            )
    # (size, layers, phase name) of each forward/backward per micro-batch; PPO-ptx: the policy's again, on as many
    # demonstrations, as long
    trained = [(params, layers, "training compute"), (value, value_layers, "training compute")]
    trained.append((params if cfg.ptx_dataset else 0.0, layers, "ptx"))
    for size, n_layers, name in trained:
        if size:
            step = micro_batch_phases(
                tokens * k * size / flops_rate, fsdp_gather_seconds(size, w, 3, a), n_layers, True, a
            )
            add_phases(
                train_side,
                {name if n == "training compute" else n: v for n, v in step.items()},
                cfg.num_epochs * micro_batches,
            )
    call_seconds = sandbox_call_seconds(a) if a.code_fraction else None
    if call_seconds:  # each process runs its own completions' programs, sandbox_workers at a time
        train_side["verification"] = verification_seconds(
            episodes / w * a.code_fraction, call_seconds, getattr(cfg, "sandbox_workers", 1)
        )
    optimizer_steps_per_rollout = plan.optimizer_steps / plan.num_training_steps
    train_side["optimizer step"] = optimizer_steps_per_rollout * (
        optimizer_seconds(cfg, params, w, gpu, a) + (optimizer_seconds(cfg, value, w, gpu, a) if value else 0.0)
    )
    return train_side, call_seconds


def rl_phases(
    cfg: RLVRConfig, plan: BatchPlan, params: float, a: TimeAssumptions, gpu: GPUSpec, k: int, flops_rate: float
) -> tuple[dict[str, float], dict[str, Any], int]:
    """Per-phase seconds of an RL run: generation (decode bound by HBM bandwidth: each decoded token reads the
    weights and the KV cache of every sequence in flight) on the recipe's generation layout, the weight sync to the
    engines, scoring (no-grad forwards), training (policy and value model, `num_epochs` passes) and FSDP
    communication; generation hidden behind training when async_steps > 0. The value model is the size of
    value_model_path's model when the name tells (Tulu 3 70B uses the 8B reward model), else the policy's."""
    w = plan.world_size
    episodes = plan.episodes_per_rollout
    rollouts = plan.num_training_steps
    if a.stop_at_episode:
        rollouts = min(rollouts, -(-a.stop_at_episode // episodes))
    prompt = rl_prompt_tokens(cfg, a)
    mean_response = a.response_fill * cfg.response_length
    train_len = train_tokens_per_sample(cfg, a)
    value = 0.0
    if cfg.uses_value_model:
        value = model_params(cfg.value_model_path, None)[0] if cfg.value_model_path else params
        value = value or params
    reward = params if cfg.reward_model_multiplier else 0.0

    gen = rl_generation(cfg, plan, params, a, gpu, flops_rate, prompt, mean_response)
    layout, generation = gen.layout, gen.seconds
    weight_sync = weight_sync_seconds(params, layout, w, a)
    checked = cfg.generation_check != "off" and layout.backend != "hf"
    check = generation_check_seconds(params, layout, w, a, flops_rate) if checked else 0.0
    train_side, call_seconds = rl_train_side(cfg, plan, params, value, reward, a, gpu, k, flops_rate, train_len)
    # A rollout: synchronous = generation + weight sync + training; with async_steps > 0 the engines generate the
    # next rollout while the trainer updates on this one, so it costs the slower of the two, plus the weight sync
    # that neither hides (the trainer sends, the engines wait for the new weights). The overlap is taken off
    # generation in the phase table, so the phases still add up to the total.
    training = sum(train_side.values())
    sync_rollout = rollout_seconds(generation, training, weight_sync + check, overlap=False)
    async_rollout = rollout_seconds(generation, training, weight_sync + check, overlap=True)
    visible_generation = max(0.0, generation - training) if layout.overlap else generation
    phases = {
        "generation": rollouts * visible_generation,
        "weight sync": rollouts * weight_sync,
        "generation check": rollouts * check,
        **{n: rollouts * v for n, v in train_side.items()},
    }
    details = {
        "generation_tokens": int(rollouts * episodes * mean_response),
        "train_tokens": int(rollouts * episodes * train_len * cfg.num_epochs),
        "generation_hours": rollouts * generation / 3600,
        "generation_hidden_hours": rollouts * (generation - visible_generation) / 3600,
        "weight_sync_hours": phases["weight sync"] / 3600,
        "training_hours": rollouts * training / 3600,
        "generation_backend": layout.backend,
        "generation_dedicated": layout.dedicated,
        "generation_remote": layout.remote,
        "generation_gpus": layout.gpus if layout.dedicated else w,
        "total_gpus": w + (layout.gpus if layout.dedicated else 0),
        "async_steps": layout.async_steps,
        "policy_lag_optimizer_steps": layout.async_steps * plan.optimizer_steps // plan.num_training_steps,
        "generation_seconds_per_rollout": generation,
        "training_seconds_per_rollout": training,
        "weight_sync_seconds_per_rollout": weight_sync,
        "generation_check_seconds_per_rollout": check,
        "verification_seconds_per_rollout": train_side.get("verification", 0.0),
        "turns_per_episode": gen.turns,
        "tool_seconds_per_rollout": gen.tool_seconds,
        "sandbox_call_seconds": call_seconds,
        "weight_sync_gb_s": (a.network_gb_s if layout.remote else a.interconnect_gb_s) if layout.dedicated else None,
        "rollout_seconds_sync": sync_rollout,
        "rollout_seconds_async": async_rollout,
        "generation_tensor_parallel": layout.tensor_parallel,
        "generation_engines": layout.engines,
        "generation_waves": gen.waves,
        "prompt_tokens": prompt,
        "value_params": value,
        "kv_bytes_per_token": gen.kv_bytes_per_token,
        "kv_bytes_source": gen.kv_bytes_source,
    }
    return phases, details, rollouts


def build_plan(
    recipe_path: str,
    overrides: Sequence[str],
    num_processes: int,
    num_examples: Optional[int],
    model_params_override: Optional[float] = None,
    assumptions: Optional[TimeAssumptions] = None,
) -> dict[str, Any]:
    cfg = recipe_config(recipe_path, overrides)
    return plan_from_config(cfg, num_processes, num_examples, model_params_override, assumptions)


def engine_layout(
    recipe_path: str,
    overrides: Sequence[str],
    num_processes: Optional[int],
    model_params_override: Optional[float] = None,
    assumptions: Optional[TimeAssumptions] = None,
) -> tuple[str, int, int, str]:
    """(generation_backend, vllm_num_engines, vllm_tensor_parallel_size, "local" or "remote") of an RL recipe after
    overrides, checked like the plan checks them (the node fit only when the training world size is given)."""
    cfg = recipe_config(recipe_path, overrides)
    a = (assumptions or TimeAssumptions()).for_recipe(cfg)
    if not isinstance(cfg, RLVRConfig):
        raise ConfigError(f"--engine_layout: {recipe_path} is a {cfg.script} recipe, not an RL one")
    params = model_params(cfg.model_name_or_path, model_params_override)[0]
    check_generation_layout(generation_layout(cfg, num_processes or 1, params or 0.0, a), cfg, num_processes, params, a)
    where = "remote" if cfg.vllm_server_urls else "local"
    return cfg.generation_backend, cfg.vllm_num_engines, cfg.vllm_tensor_parallel_size, where


def recipe_config(recipe_path: str, overrides: Sequence[str]) -> BaseConfig:
    """The recipe parsed (and checked) by the config class its `script` key names."""
    recipe = load_recipe(recipe_path)
    script = recipe.get("script")
    if script not in CONFIG_CLASSES:
        raise ConfigError(f"recipe {recipe_path}: key 'script' must be one of {sorted(CONFIG_CLASSES)}, got {script!r}")
    return parse_config(CONFIG_CLASSES[script], [recipe_path, *overrides])


def training_size(cfg: BaseConfig) -> tuple[Optional[int], str, list[dict]]:
    """(rows, where the number came from, rows per source of a mixture) of the train set."""
    if cfg.dataset_mixer_list is None:
        rows, source = dataset_size(cfg.dataset_name_or_path, cfg.dataset_split)
        if rows is not None and cfg.max_train_samples:
            rows = min(rows, cfg.max_train_samples)
        return rows, source, []
    entries = parse_mixer_list(cfg.dataset_mixer_list)
    sizes = [dataset_size(e.source, cfg.dataset_split) for e in entries]
    per_source = mixture_summary(entries, [n for n, _ in sizes])
    for row, (_, how) in zip(per_source, sizes):
        row["available_source"] = how
    if any(row["rows"] is None for row in per_source):
        unknown = [row["source"] for row in per_source if row["rows"] is None]
        return None, f"mixture with unsized fraction source(s) {unknown}", per_source
    return sum(row["rows"] for row in per_source), "mixture: rows per source below", per_source


def plan_from_config(
    cfg: BaseConfig,
    num_processes: int,
    num_examples: Optional[int] = None,
    model_params_override: Optional[float] = None,
    assumptions: Optional[TimeAssumptions] = None,
) -> dict[str, Any]:
    """The plan as one flat dict (also what --json prints). Raises ConfigError on an invalid plan."""
    a = (assumptions or TimeAssumptions()).for_recipe(cfg)
    source, per_source = "--num_examples", []
    if num_examples is None:
        num_examples, source, per_source = training_size(cfg)
    if num_examples is None and not isinstance(cfg, RLVRConfig) and cfg.total_episodes is None:
        raise ConfigError(f"cannot size the train set ({source}): pass --num_examples N or set total_episodes")
    plan = cfg.batch_plan(num_processes, num_examples)
    steps_for_events = plan.num_training_steps
    params, params_source = model_params(cfg.model_name_or_path, model_params_override)
    if isinstance(cfg, RLVRConfig):  # a generation layout that cannot start is refused like an invalid batch
        check_generation_layout(generation_layout(cfg, num_processes, params or 0.0, a), cfg, num_processes, params, a)
    result: dict[str, Any] = {"script": cfg.script, "recipe_model": cfg.model_name_or_path, **plan.to_dict()}
    result.update(
        num_examples=num_examples,
        num_examples_source=source,
        sources=per_source,
        logging_steps=cfg.logging_steps,
        log_rows=plan.log_rows(cfg.logging_steps),
        log_counter="rollout_step" if plan.is_rl else "optimizer_step",
        eval_points=count_eval_points(steps_for_events, cfg.eval_steps or 0, cfg.script in ("dpo", "rlvr_ppo")),
        checkpoint_points=count_multiples(steps_for_events, cfg.checkpointing_steps or 0),
        warmup_steps=int(cfg.warmup_ratio * plan.optimizer_steps),
        micro_batches_per_update=micro_batches_per_update(cfg, plan, a),
        learning_rate=cfg.learning_rate,
        model_params=params,
        model_params_source=params_source,
        assumptions=dataclasses.asdict(a),
    )
    if params is None:
        result["estimated_hours"] = None
    else:
        result.update(estimate(cfg, plan, params, a))
    result["memory"] = predict_memory(cfg, num_processes, a)
    check_memory_fits(result["memory"], JudgedLayout(a, num_processes, True).describe(), on_cpu=a.gpu == "cpu")
    return result


def check_memory_fits(m: Optional[dict[str, Any]], judged: str, how_to_tell: str = "", on_cpu: bool = False) -> None:
    """ConfigError (exit 2) when a memory prediction is above the device's memory: the prediction, the layout it
    judged, what to change, and (`how_to_tell`) how to name the layout the recipe targets."""
    if m is None or m["fits"]:
        return
    problem = hf_generation_problem(m)
    if problem:
        raise ConfigError(f"{problem}\n(judged: {judged})")
    raise ConfigError(
        f"this layout does not fit in {'host' if on_cpu else 'GPU'} memory (judged: {judged}):\n"
        + "\n".join(memory_lines(m))
        + "\nShard over more processes (--num_processes), turn on activation_checkpointing, lower "
        "per_device_train_batch_size / max_tokens_per_micro_batch (RL: local_rollout_batch_size), or set "
        "--gpu_memory_gb to the card's memory" + how_to_tell
    )


def host_memory_gb() -> float:
    """This machine's physical memory in GB (what a CPU run's processes share)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


@dataclass
class JudgedLayout:
    """The layout a start's memory check judges (`judged_layout`): the planner's assumptions, the world size, and
    whether the recipe or command line named it (else it is this machine's)."""

    assumptions: TimeAssumptions
    world: int
    told: bool

    def describe(self) -> str:
        a = self.assumptions
        memory = f"{a.gpu_memory_gb or GPU_SPECS[a.gpu].memory_gb:g} GB"
        if a.gpu == "cpu":
            return f"{self.world} process(es) on this machine's CPU, {memory} of host memory each"
        return f"{self.world} process(es) on {a.gpu}, {memory} each"


def judged_layout(cfg: BaseConfig, launcher_world: int, real_start: bool) -> JudgedLayout:
    """The device and world size a start judges: the recipe's `gpu` / `gpu_memory_gb` (gpu_memory_gb alone: the
    planner's H100 entry) or else this machine's device (this_machine_device; on the CPU, the host's memory over
    the processes), and `num_processes` or else the launcher's WORLD_SIZE. A real start takes the launcher's world
    size and refuses a different num_processes."""
    if cfg.num_processes is not None and real_start and cfg.num_processes != launcher_world:
        raise ConfigError(
            f"num_processes {cfg.num_processes} (the world size a --dry_run plans) differs from this launch's "
            f"{launcher_world} processes: launch {cfg.num_processes} (accelerate launch --num_processes "
            f"{cfg.num_processes}) or unset num_processes"
        )
    check_recipe_gpu(cfg)
    world = cfg.num_processes or launcher_world
    named = {k: getattr(cfg, k) for k in ("gpu", "gpu_memory_gb") if getattr(cfg, k) is not None}
    if real_start and named and this_machine_device() == "cpu":
        # a planner setting: this start trains on the CPU, so the CPU (its host memory) is what is judged
        if int(os.environ.get("RANK", "0")) == 0:
            said = " ".join(f"{k} {v}" for k, v in named.items())
            print(f"{said}: only affects --dry_run and oi-plan; this start runs on this machine's CPU", flush=True)
        named = {}
    gpu = named.get("gpu") or ("H100" if named.get("gpu_memory_gb") else this_machine_device())
    memory = named.get("gpu_memory_gb")
    if gpu == "cpu" and memory is None:
        memory = round(host_memory_gb() / world, 1)
    return JudgedLayout(TimeAssumptions(gpu=gpu, gpu_memory_gb=memory), world, bool(named))


def check_memory(cfg: BaseConfig, layout: JudgedLayout) -> None:
    """The memory check every start runs before loading a model (runtime.start_checks): the predicted peak of the
    judged layout must fit. On a machine without a GPU and no layout named, the refusal says how to name one."""
    how_to_tell = ""
    if not layout.told and layout.assumptions.gpu == "cpu":
        how_to_tell = (
            "\nThis machine has no GPU, so this machine's CPU was judged. To judge the GPU layout the recipe "
            "targets, name it: --gpu H100 (or --gpu_memory_gb N) and --num_processes 8 (or gpu / num_processes in "
            "the recipe; the launcher's WORLD_SIZE also sets the processes)"
        )
    m = predict_memory(cfg, layout.world, layout.assumptions)
    check_memory_fits(m, layout.describe(), how_to_tell, on_cpu=layout.assumptions.gpu == "cpu")


def hf_generation_problem(memory: dict[str, Any]) -> Optional[str]:
    """The refusal of a layout whose HF generation phase does not fit (its peak phase, the prediction over the
    GPU's memory), naming the way out; None when HF generation is not what does not fit. HF generation holds the
    whole policy in the compute dtype on every rank (FSDP2 gathers it: distributed.full_params) beside the KV cache
    of one generate call, and vLLM holds neither on the training GPUs."""
    if memory["fits"] or memory["peak_phase"] != "HF generation":
        return None
    return (
        "HF generation does not fit in GPU memory (generation_backend hf):\n"
        + "\n".join(memory_lines(memory))
        + "\nGenerate with vLLM instead: generation_backend vllm_server (engines on GPUs of their own; "
        "scripts/rlvr_8b.sh) or vllm (an engine colocated on each training GPU); or, with hf, lower "
        "generation_micro_batch_size (sequences per generate call) or shard the policy over more processes"
    )


def check_hf_generation_fits(cfg: BaseConfig, world: int, gpu_memory_gb: float, fsdp: bool) -> None:
    """What the RL script checks before loading any model: with generation_backend hf, the planner's prediction
    on this GPU's memory (decimal GB) must not be refused for HF generation (hf_generation_problem). Nothing is
    refused when the model's shape is unknown offline, or for the other phases (docs/gpu.md: why scripts do not
    refuse those)."""
    if not isinstance(cfg, RLVRConfig) or cfg.generation_backend != "hf":
        return
    memory = predict_memory(cfg, world, TimeAssumptions(gpu_memory_gb=gpu_memory_gb, fsdp=fsdp or None))
    problem = hf_generation_problem(memory) if memory is not None else None
    if problem:
        raise ConfigError(problem)


def memory_layout(cfg: BaseConfig, world: int, a: TimeAssumptions) -> MemoryLayout:
    """The recipe's memory-relevant layout: FSDP2 when more than one process (the launchers' accelerate configs) or
    --fsdp; tokens per micro-batch at the longest sequences the recipe allows (padded: rows x max length; packing:
    max_tokens_per_micro_batch; PPO-ptx adds per_device_train_batch_size demonstrations of an episode's length); RL hf
    generation of the sequences one generate call decodes
    (batch_math.generation_sequences_per_call: generation_micro_batch_size or the default KV-token bound)."""
    compute = 2 if cfg.mixed_precision in ("bf16", "fp16") else 4
    rows = 1 if cfg.script in ("sft", "rlvr_ppo") else 2  # RM/DPO: chosen and rejected in one batch
    if isinstance(cfg, RLVRConfig):
        length = cfg.max_prompt_length + cfg.response_length
        eval_rows = cfg.per_device_train_batch_size  # scoring forwards take the training micro-batches
    else:
        length = cfg.max_seq_length
        eval_rows = cfg.per_device_eval_batch_size
    train = cfg.max_tokens_per_micro_batch or cfg.per_device_train_batch_size * rows * length
    if isinstance(cfg, RLVRConfig) and cfg.ptx_dataset:  # PPO-ptx: its demonstrations' activations join the rollout's
        train += cfg.per_device_train_batch_size * length  # (ptx.demonstrations_config: none is longer than an episode)
    score = cfg.max_tokens_per_micro_batch or eval_rows * rows * length
    sequences = tokens = 0
    engine = 0.0
    if isinstance(cfg, RLVRConfig) and cfg.generation_backend == "hf":
        sequences, tokens = generation_sequences_per_call(cfg, length), length
    elif isinstance(cfg, RLVRConfig) and cfg.generation_backend == "vllm":
        engine = cfg.vllm_gpu_memory_utilization
    broadcast = isinstance(cfg, RLVRConfig) and cfg.generation_backend == "vllm_server"
    return MemoryLayout(
        world=world,
        fsdp=bool(a.fsdp) or world > 1,
        compute_bytes=compute,
        activation_checkpointing=cfg.activation_checkpointing,
        cpu_offload=cfg.fsdp_cpu_offload,
        lora=bool(getattr(cfg, "use_lora", False)),
        train_tokens=train,
        scored_tokens=train,
        score_tokens=score,
        generation_sequences=sequences,
        generation_tokens=tokens,
        engine_fraction=engine,
        generation_prompt_tokens=cfg.max_prompt_length if sequences else 0,
        weight_broadcast_bytes=WEIGHT_BROADCAST_BUFFER_BYTES if broadcast else 0.0,
    )


def predict_memory(cfg: BaseConfig, world: int, a: TimeAssumptions) -> Optional[dict[str, Any]]:
    """memory_model.predict_peak for the recipe (None when the policy's shape is unknown offline: a hub name of
    another size than the Llama 3.1 8B/70B shapes; pass a local model folder to have it)."""
    policy = shape_of(cfg.model_name_or_path)
    if policy is None:
        return None
    value, frozen = None, []
    if isinstance(cfg, RLVRConfig):
        if cfg.uses_value_model:
            value = shape_of(cfg.value_model_path) or policy
        if cfg.beta > 0 and not cfg.use_lora:
            frozen.append(("reference", policy))
        if cfg.reward_model_path:
            frozen.append(("reward model", (shape_of(cfg.reward_model_path) or policy).without_output_layer()))
        for key, path in cfg.loaded_teacher_settings():  # every loaded teacher resident beside the policy (no-grad)
            frozen.append((key.replace("_model_name_or_path", "").replace("teacher_models ", "teacher "),
                           shape_of(path) or policy))  # fmt: skip
    memory = a.gpu_memory_gb or GPU_SPECS[a.gpu].memory_gb
    m = predict_peak(
        memory_layout(cfg, world, a),
        policy,
        memory,
        value,
        tuple(frozen),
        trains_lm_head=cfg.script != "reward_model",
        on_gpu=a.gpu != "cpu",
    )
    m["shape_source"] = policy.source
    return m


def batch_rows(p: dict[str, Any], rl: bool) -> list[tuple[str, Any, str]]:
    """The plan's batch-math table: (name, value, what it is)."""
    rows = [
        ("world_size", p["world_size"], "training processes"),
        ("per_device_train_batch_size", p["per_device_train_batch_size"], "micro batch per device"),
        ("gradient_accumulation_steps", p["gradient_accumulation_steps"], "micro batches per update per device"),
        ("local_mini_batch_size", p["local_mini_batch_size"], "= micro x accumulation (per device, per update)"),
        ("mini_batch_size", p["mini_batch_size"], "= local_mini x world_size (global samples per update)"),
    ]
    budget = p.get("max_tokens_per_micro_batch")
    rows += [
        (
            "max_tokens_per_micro_batch",
            budget or "off",
            "packing: one row per device of whole sequences, cut by tokens" if budget else "padded micro batches",
        ),
        (
            "micro_batches_per_update",
            p["micro_batches_per_update"],
            "forward/backward passes per update per device" + (" (estimated from the lengths)" if budget else ""),
        ),
    ]
    if rl:
        rows += [
            ("local_rollout_batch_size", p["local_rollout_batch_size"], "prompts per device per rollout"),
            ("rollout_batch_size", p["rollout_batch_size"], "= local_rollout x world_size (prompts per rollout)"),
            ("num_samples_per_prompt", p["num_samples_per_prompt"], "completions per prompt"),
            ("episodes_per_rollout", p["episodes_per_rollout"], "= rollout_batch x samples per prompt"),
            ("num_mini_batches", p["num_mini_batches"], "= episodes_per_rollout / mini_batch_size"),
            ("num_epochs", p["num_epochs"], "passes over each rollout"),
        ]
    rows += [
        ("num_examples", p["num_examples"], p["num_examples_source"]),
        ("total_episodes", p["total_episodes"], "completions" if rl else "examples/pairs"),
        ("num_train_epochs", _fmt(p.get("num_train_epochs")), "passes over the data"),
        ("num_training_steps", p["num_training_steps"], "rollouts" if rl else "optimizer steps"),
        (
            "optimizer_steps",
            p["optimizer_steps"],
            "= rollouts x num_epochs x num_mini_batches" if rl else "parameter updates",
        ),
        ("warmup_steps", p["warmup_steps"], "optimizer steps"),
        ("log_rows", p["log_rows"], f"one per {p['logging_steps']} {p['log_counter']}"),
        ("eval_points", p["eval_points"], ""),
        ("checkpoint_points", p["checkpoint_points"], ""),
    ]
    return rows


def time_lines(p: dict[str, Any], rl: bool) -> list[str]:
    """The time estimate: wall clock, its phases, the dominant one and every assumption behind it (a flag each)."""
    lines = []
    a = p["assumptions"]
    stopped = f", stopped at episode {a['stop_at_episode']:,}" if a["stop_at_episode"] else ""
    lines.append(
        f"Estimated wall clock: {duration(p['estimated_hours'])}  ({duration(p['seconds_per_step'] / 3600)} per "
        f"{'rollout' if rl else 'step'}, {p['planned_steps']:,} {'rollouts' if rl else 'steps'}{stopped})"
    )
    total = sum(p["phase_hours"].values())
    for name, hours in sorted(p["phase_hours"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<20} {duration(hours):>10}  {hours / total:6.1%}")
    lines.append(
        f"Dominant: {p['dominant_phase']} ({p['dominant_share']:.0%} of the time); its assumption: "
        f"{p['dominant_assumption']}"
    )
    lines.append("Assumptions (each a flag of `python -m open_instruct.plan`):")
    lines.append(f"  model parameters {parameter_count(p['model_params'])} ({p['model_params_source']})")
    lines.append(
        f"  --gpu {a['gpu']} x {p['world_size']} training, --mfu {a['mfu']} of peak bf16 FLOP/s "
        f"({p['flops_per_param_token']} FLOPs/parameter/token: 6, 8 with activation checkpointing)"
    )
    if rl:
        lines.append(
            f"  --prompt_tokens {p['prompt_tokens']}, --response_fill {a['response_fill']}, --rl_padding "
            f"{a['rl_padding']}; generation: {p['generation_waves']} wave(s) per engine, --decode_efficiency "
            f"{a['decode_efficiency']}, KV {p['kv_bytes_per_token'] / 1e3:.0f} kB/token ({p['kv_bytes_source']}); "
            f"layout overrides: --generation_gpus {a['generation_gpus']}, --overlap_generation "
            f"{a['overlap_generation']}, --network_gb_s {a['network_gb_s']}, --gpus_per_node {a['gpus_per_node']}"
        )
    else:
        tokens = a["tokens_per_sample"] or f"--fill {a['fill']} of the max length"
        lines.append(f"  sequence length: {tokens} (--tokens_per_sample to set)")
    lines.append(
        f"  --interconnect_gb_s {a['interconnect_gb_s']} (FSDP gathers per micro-batch), --host_gb_s "
        f"{a['host_gb_s']} (CPU offload), --load_gb_s {a['load_gb_s']}, --first_step_factor "
        f"{a['first_step_factor']}; eval time not included"
    )
    return lines


def format_plan(p: dict[str, Any]) -> str:
    rl = "episodes_per_rollout" in p
    lines = [f"Plan for {p['script']} ({p['recipe_model']})", ""]
    rows = batch_rows(p, rl)
    width = max(len(r[0]) for r in rows)
    lines += [f"  {k:<{width}}  {_fmt(v):>14}  {note}" for k, v, note in rows]
    if p.get("sources"):
        lines += ["", "Rows per source (dataset_mixer_list)"]
        for src in p["sources"]:
            available = "unknown size" if src["available"] is None else f"{src['available']:,} rows"
            taken = "?" if src["rows"] is None else f"{src['rows']:,}"
            lines.append(f"  {src['label']:<24} {taken:>12}  ({src['amount']} of {available})  {src['source']}")
    lines.append("")
    if p.get("memory") is not None:
        lines += memory_lines(p["memory"]) + [""]
    else:
        lines += ["Memory per GPU: unavailable (model shape unknown offline: pass a local model folder)", ""]
    if p.get("estimated_hours") is None:
        lines.append(f"Time estimate: unavailable, model size {p['model_params_source']}")
        return "\n".join(lines)
    lines.append("Tokens")
    for key in ("train_tokens", "generation_tokens", "reference_cache_tokens"):
        if key in p:
            lines.append(f"  {key:<24} {p[key]:>18,}")
    lines.append("")
    if rl:
        lines += generation_layout_lines(p) + [""]
    lines += time_lines(p, rl)
    return "\n".join(lines)


def generation_layout_lines(p: dict[str, Any]) -> list[str]:
    """The RL plan's generation layout and the time of one rollout, synchronous and with async overlap."""
    engines, tp, world = p["generation_engines"], p["generation_tensor_parallel"], p["world_size"]
    lines = ["Generation layout"]
    if p["generation_dedicated"]:
        where = "on other nodes (vllm_server_urls)" if p["generation_remote"] else "started by the trainer on its node"
        lines.append(
            f"  {p['generation_backend']}: {engines} engine(s) x TP {tp} = {p['generation_gpus']} dedicated GPU(s), "
            f"{where}; {world} training + {p['generation_gpus']} generation = {p['total_gpus']} GPUs"
        )
    else:
        lines.append(
            f"  {p['generation_backend']}: colocated, every training GPU generates between updates ({engines} "
            f"engine(s) x TP {tp} on the {world} training GPUs); {p['total_gpus']} GPUs"
        )
    steps = p["async_steps"]
    if steps:
        lines.append(
            f"  async_steps {steps}: the engines generate rollout k+{steps} while the trainer updates on rollout k; "
            f"policy lag {steps} rollout(s) = {p['policy_lag_optimizer_steps']} optimizer steps"
        )
    elif p["generation_dedicated"]:
        lines.append("  async_steps 0: synchronous, on-policy (the engines wait while the trainer updates)")
    else:
        lines.append("  synchronous, on-policy: generation and training take turns on the training GPUs")
    sync_gb_s = p["weight_sync_gb_s"]
    link = f"at {sync_gb_s:g} GB/s" if sync_gb_s else "gathered on every training GPU"
    g, t, w = (
        p[k]
        for k in ("generation_seconds_per_rollout", "training_seconds_per_rollout", "weight_sync_seconds_per_rollout")
    )
    weights_gb = p["model_params"] * 2 / 1e9
    lines.append(
        f"  per rollout: generation {duration(g / 3600)}, training {duration(t / 3600)} (scoring + updates), weight "
        f"sync {duration(w / 3600)} ({f'{weights_gb:.0f} GB' if weights_gb >= 1 else f'{weights_gb * 1e3:.1f} MB'} "
        f"bf16 {link})"
    )
    if p["turns_per_episode"] > 1:
        lines.append(
            f"  multi-turn: {p['turns_per_episode']} generation rounds per rollout (turns_per_episode), tool calls "
            f"{duration(p['tool_seconds_per_rollout'] / 3600)} of the generation time"
        )
    chosen = "async" if steps else "synchronous"
    lines.append(
        f"  synchronous: generation + weight sync + check + training = {duration(p['rollout_seconds_sync'] / 3600)}; "
        f"async: max(generation, training) + weight sync + check = {duration(p['rollout_seconds_async'] / 3600)}"
        + (f"  (planned: {chosen})" if p["generation_dedicated"] else "  (colocated: synchronous only)")
    )
    return lines


def duration(hours: float) -> str:
    """A time in the unit that shows it: "41.2 h", "12.5 min", "3.2 s", "40 ms" (a tiny CPU run is not "0.0 h")."""
    seconds = hours * 3600
    if seconds >= 3600:
        return f"{hours:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    return f"{seconds * 1000:.0f} ms"


def parameter_count(n: float) -> str:
    """8.03e9 -> "8.03 B", 3.2e5 -> "0.32 M" (a tiny model is not "0.00 B")."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def this_machine_device() -> str:
    """The device a run started here would train on, for a script's --dry_run: "H100" (the GPU table's default)
    when an NVIDIA driver is present, else "cpu". Read without importing torch (nvidia-smi, as the Makefile does)."""
    return "H100" if shutil.which("nvidia-smi") else "cpu"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_dry_run(cfg: BaseConfig, world_size: int, num_examples: Optional[int] = None) -> None:
    """What every script's --dry_run prints: `python -m open_instruct.plan`'s plan for the layout the memory check
    judged (judged_layout: the recipe's gpu / num_processes, else this machine's device: the CPU where there is no
    GPU, so a tiny recipe is planned where it will run, not on an H100), and which layout that was."""
    layout = judged_layout(cfg, world_size, real_start=False)
    print(format_plan(plan_from_config(cfg, layout.world, num_examples, assumptions=layout.assumptions)))
    print(f"Layout judged: {layout.describe()} ({'as named' if layout.told else 'this machine'})")
    if layout.assumptions.gpu == "cpu":
        print("Planned for this machine's CPU (no GPU here); --gpu H100 --num_processes 8 plans that GPU layout")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("recipe")
    parser.add_argument("--num_processes", type=int, default=None, help="training processes (world_size; 1)")
    parser.add_argument("--num_examples", type=int, default=None, help="dataset rows; skips reading the dataset")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model_params", type=float, default=None, help="parameter count, e.g. 8e9")
    parser.add_argument(
        "--engine_layout",
        action="store_true",
        help="print the RL recipe's `generation_backend vllm_num_engines vllm_tensor_parallel_size local|remote` "
        "(after overrides) and exit, what "
        "scripts/rlvr_*.sh read to place the engines; exit 2 if the engines cannot start (with --num_processes: "
        "also if the trainer's node cannot hold them)",
    )
    for f in dataclasses.fields(TimeAssumptions):
        if "bool" in str(f.type):  # a switch; unset (None) leaves the recipe's setting
            parser.add_argument(
                f"--{f.name}", action="store_const", const=True, default=None, help=ASSUMPTION_HELP[f.name]
            )
        else:
            kind = float if "float" in str(f.type) else str if "str" in str(f.type) else int
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=ASSUMPTION_HELP[f.name])
    args, overrides = parser.parse_known_args(argv)
    assumptions = TimeAssumptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TimeAssumptions)})
    try:
        if args.engine_layout:
            print(*engine_layout(args.recipe, overrides, args.num_processes, args.model_params, assumptions))
            return 0
        world = args.num_processes or 1
        plan = build_plan(args.recipe, overrides, world, args.num_examples, args.model_params, assumptions)
    except ConfigError as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
