"""The device check: one command that runs every GPU path of the repo on one GPU (sized for ~8 minutes) and writes a
table.

    make gpu-check OUT=DIR                      # or: python bench/gpu_check.py --out DIR
    BUDGET=450 ONLY="env peak build parity rl_1b_fsdp1 sft_1b_fsdp1 sft_1b_single summarize" make gpu-check
    python bench/gpu_check.py --tiny --out /tmp/gc  # the same steps on CPU with tiny shapes (tests/test_gpu_check.py)

Needs only torch, transformers, accelerate and peft (what a bare GPU image has): no datasets, trl, wandb, vLLM,
flash-attn or math-verify, no weights and no hub. Models are built on the device from configs (random init):
m1b = the Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8 heads, FFN 8192, tied, vocab 128256), m1b_rm = the same
backbone as a sequence classifier, w8b = Llama-3.1-8B width (4096, FFN 14336, 32/8 heads, untied) with 4 layers.
Tokenizer: demo.tiny's character-level one; the vocabulary is padded to 128256 so the output layer costs what it costs.

Steps (ONLY= or --only picks some; `summarize` always runs): env, peak (measured bf16 GEMM FLOP/s: the MFU
denominator beside the published one), build, parity (GPU fp32 vs CPU fp32 within 1e-4; GPU bf16 vs CPU fp32 within
2e-2: SFT loss padded / packed sdpa / packed sdpa_varlen, reward-model pair scores, response log-probs), then the
training scripts as they are: rl_1b_fsdp1 (PPO, HF generation, FSDP2 with one process, activation checkpointing,
frozen reference, value model), sft_1b_fsdp1 (a DCP checkpoint and the final HF export), sft_1b_single,
sft_1b_single_packed, rm_1b_fsdp1, dpo_1b_fsdp1, grpo_1b_single, sft_w8b_fsdp1. Each training step reports tokens/s,
MFU (against the measured and the published peak), peak allocated/reserved GB beside plan's prediction, the first
losses and whether every loss is finite. A step that fails is recorded and the rest go on; a step that would start
after BUDGET seconds is skipped and reported. Results: OUT/results.json and OUT/results.md (and OUT/logs/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
OPTIONAL_PACKAGES = ("datasets", "trl", "wandb", "vllm", "flash_attn", "math_verify", "peft")
STEP_TIMEOUT_S = 600  # without BUDGET: the longest one training step may take
FSDP_CONFIG = {"gpu": "configs/accelerate/fsdp_8gpu.yaml", "cpu": "configs/accelerate/fsdp_cpu_2proc.yaml"}


@dataclass(frozen=True)
class Scale:
    """Shapes and sizes of one mode: the GPU run, or --tiny on CPU."""

    vocab: int
    m1b: dict
    w8b: dict
    median: int  # conversation lengths (long-tailed, bench_throughput's generator)
    high: int
    sft_steps: int
    rows_per_step: int
    max_seq_length: int
    rl_prompts: int
    rl_samples: int
    rl_response: int
    rl_prompt_tokens: int
    rl_rollouts: int
    packed_tokens: int
    w8b_packed_tokens: int
    gemm_sizes: tuple[int, ...]
    gemm_repeats: int
    parity_rows: int
    logits_tokens: int


GPU = Scale(
    vocab=128256,
    m1b=dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
    ),  # fmt: skip
    w8b=dict(
        hidden_size=4096,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        tie_word_embeddings=False,
    ),  # fmt: skip
    median=180,
    high=1024,
    sft_steps=20,
    rows_per_step=16,
    max_seq_length=1024,
    rl_prompts=8,
    rl_samples=4,
    rl_response=256,
    rl_prompt_tokens=128,
    rl_rollouts=3,
    packed_tokens=16384,
    w8b_packed_tokens=8192,
    gemm_sizes=(4096, 8192),
    gemm_repeats=30,
    parity_rows=4,
    logits_tokens=8192,
)
TINY = Scale(
    vocab=256,
    m1b=dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    ),  # fmt: skip
    w8b=dict(
        hidden_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        tie_word_embeddings=False,
    ),  # fmt: skip
    median=40,
    high=96,
    sft_steps=3,
    rows_per_step=4,
    max_seq_length=128,
    rl_prompts=2,
    rl_samples=2,
    rl_response=8,
    rl_prompt_tokens=16,
    rl_rollouts=2,
    packed_tokens=512,
    w8b_packed_tokens=512,
    gemm_sizes=(128,),
    gemm_repeats=3,
    parity_rows=4,
    logits_tokens=64,
)

# Tolerances of the parity step (the issue's): fp32 on two devices differs by reduction order only; bf16 autocast
# rounds every matmul input to 8 mantissa bits.
FP32_REL_TOL = 1e-4
BF16_REL_TOL = 2e-2


class Check:
    """The run's state: mode, folders, budget, the results so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tiny = args.tiny
        self.scale = TINY if args.tiny else GPU
        self.out = os.path.abspath(args.out)
        self.work = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
        self.budget = args.budget
        self.started = time.perf_counter()
        self.results: dict[str, dict[str, Any]] = {}
        self.models: dict[str, str] = {}
        self.data: dict[str, str] = {}
        self.matmul_params: dict[str, int] = {}
        self.measured_peak: Optional[float] = None
        self.published_peak: Optional[float] = None
        self.memory_gb: float = 80.0
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        os.makedirs(self.work, exist_ok=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def device(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() and not self.tiny else "cpu"


# ---------------------------------------------------------------------------------------------------------------------
# Steps that run in this process


def step_env(c: Check) -> dict[str, Any]:
    import accelerate
    import torch
    import transformers

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cuda_available": torch.cuda.is_available(),
        "missing_optional_packages": [p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is None],
    }
    if torch.cuda.is_available():
        from open_instruct.gpu_stats import gpu_kind

        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu=props.name,
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            gpu_kind=gpu_kind(props.name, props.total_memory),
            cuda=torch.version.cuda,
            nccl=str(torch.cuda.nccl.version()) if torch.distributed.is_nccl_available() else None,
            sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
            sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
        )
    return out


def step_peak(c: Check) -> dict[str, Any]:
    """Best FLOP/s of square GEMMs (n^3 x 2 per product) in bf16, tf32 and fp32 on the device."""
    import torch

    from open_instruct.gpu_stats import device_peak_flops

    device = c.device
    out: dict[str, Any] = {}
    kinds = (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True), ("fp32", torch.float32, False))
    for label, dtype, tf32 in kinds:
        if device == "cpu" and label == "tf32":
            continue
        torch.backends.cuda.matmul.allow_tf32 = tf32
        best = 0.0
        for n in c.scale.gemm_sizes:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            a @ b
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(c.scale.gemm_repeats):
                a @ b
            synchronize(device)
            best = max(best, 2 * n**3 * c.scale.gemm_repeats / (time.perf_counter() - t0))
        out[f"{label}_tflops"] = best / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    c.measured_peak = out["bf16_tflops"] * 1e12
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        c.published_peak = device_peak_flops(props.name, props.total_memory)
        c.memory_gb = props.total_memory / 1e9
        out["published_bf16_tflops"] = c.published_peak / 1e12 if c.published_peak else None
    return out


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def bench_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_throughput", os.path.join(REPO, "bench", "bench_throughput.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def step_build(c: Check) -> dict[str, Any]:
    """m1b, m1b_rm and w8b saved in bf16 (the scripts load them in fp32), with the tokenizer; jsonl data."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from demo.tiny import build_tokenizer, tiny_llama_config
    from open_instruct.gpu_stats import matmul_params

    bench = bench_module()
    s = c.scale
    tokenizer = build_tokenizer()
    device = c.device
    for name, shape, cls, extra in (
        ("m1b", s.m1b, LlamaForCausalLM, {}),
        ("m1b_rm", s.m1b, LlamaForSequenceClassification, {"num_labels": 1}),
        ("w8b", s.w8b, LlamaForCausalLM, {}),
    ):
        path = os.path.join(c.work, "models", name)
        config = tiny_llama_config(s.vocab, max_position_embeddings=4096, **shape, **extra)
        torch.manual_seed(0)
        with torch.device(device):
            model = cls(config)
        c.matmul_params[name] = matmul_params(model)
        model.to(torch.bfloat16).save_pretrained(path)
        tokenizer.save_pretrained(path)
        c.models[name] = path
        del model
    if device == "cuda":
        torch.cuda.empty_cache()
    data = os.path.join(c.work, "data")
    rows = s.sft_steps * s.rows_per_step
    c.data = {
        "sft": bench_write(bench, os.path.join(data, "sft.jsonl"), bench.sft_rows(rows, 0, s.median, s.high)),
        "pref": bench_write(bench, os.path.join(data, "pref.jsonl"), bench.preference_rows(rows, 1, s.median, s.high)),
        "rl": bench_write(
            bench,
            os.path.join(data, "rl.jsonl"),
            bench.rl_rows(s.rl_prompts * s.rl_rollouts * 2, 2, s.rl_prompt_tokens),
        ),
    }
    return {"params": {k: v for k, v in c.matmul_params.items()}, "models_dir": os.path.join(c.work, "models")}


def bench_write(bench: Any, path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def rel_diff(a: Any, b: Any) -> float:
    """max |a - b| / mean |b| over the elements (a scalar: |a - b| / |b|)."""
    import torch

    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    return float((a - b).abs().max() / b.abs().mean().clamp_min(1e-12))


def step_parity(c: Check) -> dict[str, Any]:
    """One batch through models.scored_logprobs and the reward model on CPU in fp32 (the reference) and on the
    device: fp32 (TF32 off) within FP32_REL_TOL, bf16 autocast within BF16_REL_TOL; padded and packed."""
    import torch

    from open_instruct import data as data_mod
    from open_instruct.models import (
        load_causal_lm,
        load_sequence_classifier,
        load_tokenizer,
        scored_logprobs,
        sequence_logprobs,
    )

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = c.device
    tokenizer = load_tokenizer(c.models["m1b"])
    rows = [json.loads(line) for line in open(c.data["sft"])][: c.scale.parity_rows]
    examples = []
    for i, row in enumerate(rows):
        ids, labels = data_mod.tokenize_sft_messages(tokenizer, row["messages"], f"parity row {i}")
        examples.append({"input_ids": ids, "labels": labels})
    pad = tokenizer.pad_token_id

    def sft_loss(model: Any, packed: bool, dev: str, bf16: bool) -> Any:
        batch = {k: v.to(dev) for k, v in data_mod.collate_sft(examples, pad, packed).items()}
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            logps, _, _ = scored_logprobs(model, batch, batch["labels"])
        return -logps.double().mean().cpu()

    out: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    reference = load_causal_lm(c.models["m1b"], torch.float32, attn_implementation="sdpa").eval()
    ref_loss = sft_loss(reference, False, "cpu", False)
    out["sft_loss_cpu_fp32"] = float(ref_loss)
    model = reference.to(device) if device == "cuda" else reference
    for label, packed, bf16, tol in (
        ("sft_fp32_padded", False, False, FP32_REL_TOL),
        ("sft_bf16_padded", False, True, BF16_REL_TOL),
        ("sft_bf16_packed_sdpa", True, True, BF16_REL_TOL),
    ):
        diff = rel_diff(sft_loss(model, packed, device, bf16), ref_loss)
        out[label + "_rel_diff"], checks[label] = diff, diff < tol
    del model, reference
    varlen = load_causal_lm(c.models["m1b"], torch.float32, attn_implementation="sdpa_varlen").to(device).eval()
    diff = rel_diff(sft_loss(varlen, True, device, True), ref_loss)
    out["sft_bf16_packed_sdpa_varlen_rel_diff"], checks["sft_bf16_packed_sdpa_varlen"] = diff, diff < BF16_REL_TOL
    del varlen

    # Response log-probs of preference pairs (DPO's and RL's quantity) and reward-model pair scores.
    pairs = [json.loads(line) for line in open(c.data["pref"])][: c.scale.parity_rows]
    pair_examples = [pair_example(tokenizer, p) for p in pairs]
    batch = data_mod.collate_preferences(pair_examples, pad)
    policy = load_causal_lm(c.models["m1b"], torch.float32).eval()
    with torch.no_grad():
        ref_logps, _ = sequence_logprobs(policy, batch)
        policy = policy.to(device)
        gpu_batch = {k: v.to(device) for k, v in batch.items()}
        kinds = (("response_logps_fp32", False, FP32_REL_TOL), ("response_logps_bf16", True, BF16_REL_TOL))
        for label, bf16, tol in kinds:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                logps, _ = sequence_logprobs(policy, gpu_batch)
            diff = rel_diff(logps, ref_logps)
            out[label + "_rel_diff"], checks[label] = diff, diff < tol
    del policy
    rm = load_sequence_classifier(c.models["m1b_rm"], torch.float32, pad_token_id=pad).eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref_scores = rm(**inputs).logits.squeeze(-1)
        rm = rm.to(device)
        gpu_inputs = {k: v.to(device) for k, v in inputs.items()}
        for label, bf16, tol in (("rm_scores_fp32", False, FP32_REL_TOL), ("rm_scores_bf16", True, BF16_REL_TOL)):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                scores = rm(**gpu_inputs).logits.squeeze(-1)
            diff = rel_diff(scores, ref_scores)
            out[label + "_rel_diff"], checks[label] = diff, diff < tol
    del rm
    out.update(logits_memory(c))
    out["checks"] = checks
    out["ok"] = all(checks.values())
    if not out["ok"]:
        failed = [k for k, v in checks.items() if not v]
        raise AssertionError(f"parity outside tolerance: {failed}: {json.dumps(out)}")
    return out


def pair_example(tokenizer: Any, pair: dict) -> dict[str, Any]:
    """A preference pair as collate_preferences takes it (chosen_ids, rejected_ids, prompt_len)."""
    from open_instruct.data import chat_ids

    prompt = chat_ids(tokenizer, pair["chosen"][:1], add_generation_prompt=True)
    return {
        "chosen_ids": chat_ids(tokenizer, pair["chosen"]),
        "rejected_ids": chat_ids(tokenizer, pair["rejected"]),
        "prompt_len": len(prompt),
    }


def logits_memory(c: Check) -> dict[str, Any]:
    """The log-prob head's forward + backward over logits_tokens positions, chunked (models.chunked_token_scores)
    and through full [tokens, vocab] logits (what the head replaced): their largest log-prob difference and, on
    a GPU, the peak extra GB of each."""
    import torch

    from open_instruct.models import chunked_token_scores, token_logprobs

    s, device = c.scale, c.device
    hidden_size = s.m1b["hidden_size"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    head = torch.nn.Linear(hidden_size, s.vocab, bias=False, device=device, dtype=dtype)
    labels = torch.randint(0, s.vocab, (s.logits_tokens,), device=device)
    hidden_values = torch.randn(s.logits_tokens, hidden_size, device=device, dtype=dtype)
    out: dict[str, Any] = {"logits_tokens": s.logits_tokens}
    logps = {}
    for label in ("chunked", "full"):
        hidden = hidden_values.clone().requires_grad_(True)
        synchronize(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        if label == "chunked":
            logps[label] = chunked_token_scores(hidden, head, labels)[0]
        else:
            logps[label] = token_logprobs(head(hidden)[None], labels[None])[0]
        logps[label].sum().backward()
        synchronize(device)
        if device == "cuda":
            out[f"logits_peak_extra_gb_{label}"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        head.weight.grad = None
    out["logits_chunked_vs_full_max_abs_diff"] = float((logps["chunked"] - logps["full"]).abs().max())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Training steps: the scripts as they are, one process, through accelerate launch (FSDP2) or plain python


@dataclass(frozen=True)
class TrainStep:
    name: str
    script: str  # sft, reward_model, dpo, rlvr_ppo
    model: str  # m1b, m1b_rm, w8b
    fsdp: bool
    recipe: Callable[[Check], dict[str, Any]]
    compare_first_loss_with: Optional[str] = None  # another step whose first loss this one's must match (2e-2)


def common(c: Check, name: str, script: str, model: str) -> dict[str, Any]:
    return {
        "script": script,
        "exp_name": f"gpu_check_{name}",
        "output_dir": os.path.join(c.work, "runs", name),
        "overwrite_output_dir": True,
        "model_name_or_path": c.models[model],
        "mixed_precision": "no" if c.tiny else "bf16",
        "logging_steps": 1,
        "learning_rate": 1e-5,
        "seed": 1,
        "save_final_model": False,
    }


def supervised(c: Check, name: str, script: str, model: str, data: str, **extra: Any) -> dict[str, Any]:
    s = c.scale
    rows = s.rows_per_step
    return {
        **common(c, name, script, model),
        "dataset_name_or_path": c.data[data],
        "max_seq_length": s.max_seq_length,
        "per_device_train_batch_size": rows // 4,
        "gradient_accumulation_steps": 4,
        "total_episodes": s.sft_steps * rows,
        "lr_scheduler_type": "constant",
        **extra,
    }


def rl(c: Check, name: str, algo: str, **extra: Any) -> dict[str, Any]:
    s = c.scale
    episodes = s.rl_prompts * s.rl_samples
    recipe = {
        **common(c, name, "rlvr_ppo", "m1b"),
        "algo": algo,
        "generation_backend": "hf",
        "dataset_name_or_path": c.data["rl"],
        "max_prompt_length": s.rl_prompt_tokens + 16,
        "response_length": s.rl_response,
        "temperature": 1.0,
        "total_episodes": episodes * s.rl_rollouts,
        "local_rollout_batch_size": s.rl_prompts,
        "num_samples_per_prompt": s.rl_samples,
        "per_device_train_batch_size": episodes // 4,
        "gradient_accumulation_steps": 4,
        "num_epochs": 1,
        "beta": 0.01,
        "lr_scheduler_type": "constant",
        **extra,
    }
    if algo == "ppo":
        recipe["value_model_path"] = c.models["m1b_rm"]
    return recipe


TRAIN_STEPS = (
    TrainStep(
        "rl_1b_fsdp1", "rlvr_ppo", "m1b", True, lambda c: rl(c, "rl_1b_fsdp1", "ppo", activation_checkpointing=True)
    ),  # fmt: skip
    TrainStep(
        "sft_1b_fsdp1",
        "sft",
        "m1b",
        True,
        lambda c: supervised(
            c,
            "sft_1b_fsdp1",
            "sft",
            "m1b",
            "sft",
            activation_checkpointing=True,
            checkpointing_steps=c.scale.sft_steps // 2,
            save_final_model=True,
        ),  # fmt: skip
    ),
    TrainStep(
        "sft_1b_single",
        "sft",
        "m1b",
        False,
        lambda c: supervised(c, "sft_1b_single", "sft", "m1b", "sft"),
        "sft_1b_fsdp1",
    ),  # fmt: skip
    TrainStep(
        "sft_1b_single_packed",
        "sft",
        "m1b",
        False,
        lambda c: supervised(
            c, "sft_1b_single_packed", "sft", "m1b", "sft", max_tokens_per_micro_batch=c.scale.packed_tokens
        ),  # fmt: skip
        "sft_1b_single",
    ),
    TrainStep(
        "rm_1b_fsdp1",
        "reward_model",
        "m1b_rm",
        True,
        lambda c: supervised(c, "rm_1b_fsdp1", "reward_model", "m1b_rm", "pref", activation_checkpointing=True),
    ),  # fmt: skip
    TrainStep(
        "dpo_1b_fsdp1",
        "dpo",
        "m1b",
        True,
        lambda c: supervised(c, "dpo_1b_fsdp1", "dpo", "m1b", "pref", activation_checkpointing=True),
    ),  # fmt: skip
    TrainStep("grpo_1b_single", "rlvr_ppo", "m1b", False, lambda c: rl(c, "grpo_1b_single", "grpo")),
    TrainStep(
        "sft_w8b_fsdp1",
        "sft",
        "w8b",
        True,
        lambda c: supervised(
            c,
            "sft_w8b_fsdp1",
            "sft",
            "w8b",
            "sft",
            activation_checkpointing=True,
            max_tokens_per_micro_batch=c.scale.w8b_packed_tokens,
        ),  # fmt: skip
    ),
)


def write_recipe(c: Check, name: str, recipe: dict[str, Any]) -> str:
    path = os.path.join(c.work, "recipes", f"{name}.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(recipe, f)  # JSON is YAML
    return path


def predicted_memory_gb(c: Check, recipe_path: str, fsdp: bool) -> Optional[float]:
    """plan's prediction (open_instruct.memory_model) of this step's peak per GPU, in GB."""
    from open_instruct.plan import TimeAssumptions, predict_memory, recipe_config

    cfg = recipe_config(recipe_path, [])
    m = predict_memory(cfg, 1, TimeAssumptions(gpu_memory_gb=c.memory_gb, fsdp=fsdp or None))
    return None if m is None else m["total"] / 1e9


def run_training(c: Check, step: TrainStep) -> dict[str, Any]:
    recipe = step.recipe(c)
    path = write_recipe(c, step.name, recipe)
    script = os.path.join(REPO, "open_instruct", f"{step.script}.py")
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if step.fsdp:
        config = FSDP_CONFIG["cpu" if c.device == "cpu" else "gpu"]
        if c.device == "cpu":
            env["OPEN_INSTRUCT_CPU_FSDP"] = "1"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(REPO, config)]
        command += ["--num_processes", "1", script, path]
    else:
        command = [sys.executable, script, path]
    timeout = max(60.0, c.budget - c.elapsed + 60) if c.budget else STEP_TIMEOUT_S  # a hung step ends, the rest run
    log_path = os.path.join(c.out, "logs", f"{step.name}.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0}
    out.update(read_metrics(c, step, recipe))
    try:
        out["predicted_gb"] = predicted_memory_gb(c, path, step.fsdp)
    except Exception as e:  # noqa: BLE001 - the prediction is reported beside the run, never stops it
        out["predicted_gb"] = None
        out["prediction_error"] = f"{type(e).__name__}: {e}"
    if step.fsdp and step.name == "sft_1b_fsdp1":
        run_dir = recipe["output_dir"]
        out["dcp_checkpoint"] = any(n.startswith("step_") for n in os.listdir(os.path.join(run_dir, "checkpoints")))
        out["final_export"] = os.path.isfile(os.path.join(run_dir, "final_model", "config.json"))
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise StepFailed(f"exit {proc.returncode}; log tail:\n{tail}", out)
    return out


class StepFailed(Exception):
    def __init__(self, message: str, partial: dict[str, Any]) -> None:
        super().__init__(message)
        self.partial = partial


def median(values: list[float]) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def read_metrics(c: Check, step: TrainStep, recipe: dict[str, Any]) -> dict[str, Any]:
    """tokens/s (median over rows after the first: warm-up), MFU against the measured and the published peak, peak
    memory (max over rows), first losses, losses finite; RL: response tokens/s, generation and training seconds."""
    path = os.path.join(recipe["output_dir"], "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    rows = [json.loads(line) for line in open(path) if line.strip()]
    train = [r for r in rows if any(k.startswith("perf/") for k in r)]
    if not train:
        return {}
    timed = train[1:] or train
    key = "perf/train_tokens_per_second" if step.script == "rlvr_ppo" else "perf/tokens_per_second"
    tokens_per_second = median([r.get(key) for r in timed])
    losses = {k: v for k, v in train[0].items() if "loss" in k and isinstance(v, (int, float))}
    all_losses = [v for r in train for k, v in r.items() if "loss" in k and isinstance(v, (int, float))]
    n = c.matmul_params[step.model] + (c.matmul_params["m1b_rm"] if recipe.get("algo") == "ppo" else 0)
    out: dict[str, Any] = {
        "tokens_per_second": tokens_per_second,
        "first_losses": losses,
        "losses_finite": all(math.isfinite(v) for v in all_losses),
        "mfu_vs_measured": 6 * n * tokens_per_second / c.measured_peak
        if tokens_per_second and c.measured_peak
        else None,
        "mfu_vs_published": median([r.get("perf/mfu") for r in timed]),
        "peak_allocated_gb": max((r.get("gpu/peak_allocated_gb", 0) for r in train), default=None) or None,
        "peak_reserved_gb": max((r.get("gpu/peak_reserved_gb", 0) for r in train), default=None) or None,
    }
    if step.script == "rlvr_ppo":
        out["response_tokens_per_second"] = median([r.get("perf/response_tokens_per_second") for r in timed])
        out["generation_s"] = median([r.get("time/generation") for r in timed])
        out["training_s"] = median([r.get("time/training") for r in timed])
    return out


def first_loss(result: dict[str, Any]) -> Optional[float]:
    return (result.get("first_losses") or {}).get("train/loss")


# ---------------------------------------------------------------------------------------------------------------------
# Orchestration and the table


def summarize(c: Check) -> dict[str, Any]:
    for step in TRAIN_STEPS:
        mine, other = c.results.get(step.name, {}), c.results.get(step.compare_first_loss_with or "", {})
        a, b = first_loss(mine), first_loss(other)
        if step.compare_first_loss_with and a is not None and b is not None:
            diff = abs(a - b) / max(abs(b), 1e-12)
            mine["first_loss_vs"] = {"step": step.compare_first_loss_with, "rel_diff": diff, "ok": diff < BF16_REL_TOL}
    with open(os.path.join(c.out, "results.json"), "w") as f:
        json.dump({"tiny": c.tiny, "budget_s": c.budget, "elapsed_s": c.elapsed, "steps": c.results}, f, indent=1)
    with open(os.path.join(c.out, "results.md"), "w") as f:
        f.write(markdown(c) + "\n")
    return {"wrote": [os.path.join(c.out, "results.json"), os.path.join(c.out, "results.md")]}


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown(c: Check) -> str:
    env = c.results.get("env", {})
    peak = c.results.get("peak", {})
    lines = [
        f"# gpu-check ({'tiny, CPU' if c.tiny else env.get('gpu', 'no GPU')})",
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, accelerate {env.get('accelerate')}, "
        f"python {env.get('python')}; missing optional packages: {', '.join(env.get('missing_optional_packages', []))}",
        f"bf16 GEMM peak measured {fmt(peak.get('bf16_tflops'))} TFLOP/s (published "
        f"{fmt(peak.get('published_bf16_tflops'))}); tf32 {fmt(peak.get('tf32_tflops'))}, "
        f"fp32 {fmt(peak.get('fp32_tflops'))}",
        "",
        "| step | status | wall s | tokens/s | MFU (measured peak) | MFU (published) | RL resp tok/s | gen s | train s "
        "| first loss | finite | peak alloc GB | peak reserved GB | predicted GB | cross-check |",
        "|" + "---|" * 15,
    ]
    for name, r in c.results.items():
        if name in ("env", "peak", "summarize"):
            continue
        if name in ("build", "parity"):
            status = r.get("status")
            detail = r.get("error", "") if status != "ok" else ""
            lines.append(f"| {name} | {status} | {fmt(r.get('seconds'))} | | | | | | | | | | | | {detail[:80]} |")
            continue
        cross = r.get("first_loss_vs")
        cross_text = f"vs {cross['step']}: {cross['rel_diff']:.2g} ({'ok' if cross['ok'] else 'FAIL'})" if cross else ""
        if r.get("dcp_checkpoint") is not None:
            cross_text += f" DCP {fmt(r.get('dcp_checkpoint'))}, export {fmt(r.get('final_export'))}"
        lines.append(
            f"| {name} | {r.get('status')} | {fmt(r.get('seconds'))} | {fmt(r.get('tokens_per_second'))} "
            f"| {fmt(r.get('mfu_vs_measured'))} | {fmt(r.get('mfu_vs_published'))} "
            f"| {fmt(r.get('response_tokens_per_second'))} | {fmt(r.get('generation_s'))} | {fmt(r.get('training_s'))} "
            f"| {fmt(first_loss(r) or next(iter((r.get('first_losses') or {}).values()), None), 5)} "
            f"| {fmt(r.get('losses_finite'))} | {fmt(r.get('peak_allocated_gb'))} | {fmt(r.get('peak_reserved_gb'))} "
            f"| {fmt(r.get('predicted_gb'))} | {cross_text} |"
        )
    parity = c.results.get("parity", {})
    if parity:
        diffs = ", ".join(f"{k[:-9]} {v:.2g}" for k, v in parity.items() if k.endswith("_rel_diff"))
        lines += [
            "",
            f"Parity (relative differences vs CPU fp32; fp32 < {FP32_REL_TOL:g}, bf16 < {BF16_REL_TOL:g}): {diffs}",
        ]
        if "logits_peak_extra_gb_chunked" in parity:
            lines.append(
                f"Log-prob head over {parity['logits_tokens']} tokens x vocab {c.scale.vocab}: peak extra "
                f"{parity['logits_peak_extra_gb_chunked']:.2f} GB chunked vs "
                f"{parity['logits_peak_extra_gb_full']:.2f} GB full logits"
            )
    skipped = [n for n, r in c.results.items() if r.get("status") == "skipped"]
    if skipped:
        lines += ["", f"Skipped (would start after BUDGET {c.budget:g} s): {', '.join(skipped)}"]
    return "\n".join(lines)


STEP_ORDER = ("env", "peak", "build", "parity", *(s.name for s in TRAIN_STEPS), "summarize")
LOCAL_STEPS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "env": step_env,
    "peak": step_peak,
    "build": step_build,
    "parity": step_parity,
    "summarize": summarize,
}


def run_step(c: Check, name: str) -> None:
    """Run one step; record ok/failed (with the error) and its seconds; never raise."""
    t0 = time.perf_counter()
    print(f"[gpu-check {c.elapsed:6.1f}s] {name} ...", flush=True)
    try:
        if name in LOCAL_STEPS:
            result = LOCAL_STEPS[name](c)
        else:
            result = run_training(c, next(s for s in TRAIN_STEPS if s.name == name))
        result["status"] = "ok"
    except StepFailed as e:
        result = {**e.partial, "status": "failed", "error": str(e)}
    except subprocess.TimeoutExpired as e:
        result = {"status": "failed", "error": f"timed out after {e.timeout:.0f} s (the budget)"}
    except Exception as e:  # noqa: BLE001 - one failing step is recorded, the rest go on
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - t0
    c.results[name] = result
    brief = {k: v for k, v in result.items() if k not in ("traceback", "error", "checks")}
    print(
        f"[gpu-check {c.elapsed:6.1f}s] {name}: {result['status']} {json.dumps(brief, default=str)[:600]}", flush=True
    )
    if result["status"] == "failed":
        print(result["error"][-1500:], flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "output/gpu_check", help="results folder ($OUT)")
    parser.add_argument("--work_dir", default=None, help="models, data and runs (default: a temp folder)")
    parser.add_argument("--tiny", action="store_true", help="every step on CPU with tiny shapes (minutes)")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET", 0) or 0),
                        help="seconds; a step that would start later is skipped (env BUDGET; 0: none)")  # fmt: skip
    parser.add_argument("--only", default=os.environ.get("ONLY", ""), help="steps to run (env ONLY), space separated")
    args = parser.parse_args(argv)
    only = set(args.only.replace(",", " ").split())
    unknown = only - set(STEP_ORDER)
    if unknown:
        print(f"unknown step(s) {sorted(unknown)}; steps: {' '.join(STEP_ORDER)}", file=sys.stderr)
        return 2
    c = Check(args)
    for name in STEP_ORDER:
        if only and name not in only and name != "summarize":
            continue
        if name != "summarize" and c.budget and c.elapsed >= c.budget:
            c.results[name] = {"status": "skipped", "seconds": 0.0}
            print(f"[gpu-check {c.elapsed:6.1f}s] {name}: skipped (budget {c.budget:g} s)", flush=True)
            continue
        if name in ("parity", *(s.name for s in TRAIN_STEPS)) and not c.models:
            run_step(c, "build")  # the models and data every later step needs
        if name == "build" and c.models:
            continue
        if name in (s.name for s in TRAIN_STEPS) and c.measured_peak is None and "peak" not in c.results:
            run_step(c, "peak")
        run_step(c, name)
    print(open(os.path.join(c.out, "results.md")).read())
    if not args.work_dir:
        shutil.rmtree(c.work, ignore_errors=True)
    failed = [n for n, r in c.results.items() if r.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
