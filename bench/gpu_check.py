"""The device check: one command that runs every GPU path of the repo on one GPU inside one short device slot, and
writes a table.

    python3 bench/gpu_check.py --out DIR --budget 400           # the whole check (docs/gpu.md: its timeout, a rerun)
    python3 bench/gpu_check.py --out DIR --budget 150 --only sft_1b_single_packed   # rerun one step
    python3 bench/gpu_check.py --tiny --out /tmp/gc             # the same steps on CPU with tiny shapes

Needs only python3 with torch, transformers, accelerate and peft (what a bare GPU image has): no make, no virtual
environment, no datasets, trl, wandb, vLLM, flash-attn or math-verify, no weights and no hub. Models are built from
configs (random init): m1b = the Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8 heads, FFN 8192, tied, vocab
128256), m1b_rm = the same backbone as a sequence classifier, w8b = Llama-3.1-8B width (4096, FFN 14336, 32/8 heads,
untied) with 4 layers, smoke = a 2-layer model for the first step. Tokenizer: demo.tiny's character-level one; the
vocabulary is padded to 128256 so the output layer costs what it costs.

Steps (--only picks some; `summarize` always runs):
- fsdp_smoke first: sft.py through `accelerate launch` with one process on FSDP2 (NCCL on a GPU, gloo under --tiny),
  rank-0 loading, packed `sdpa_varlen` attention, the chunked head's backward, a DCP checkpoint (object collectives)
  and the export, on the small model with a 30-second collective timeout. When it fails the other FSDP steps are
  skipped (they would fail or hang the same way) and the one-process steps still run.
- env, peak (measured bf16 GEMM FLOP/s: the MFU denominator beside the published one), build, parity (GPU bf16 vs
  GPU fp32 within 2e-2: SFT loss padded / packed sdpa / packed sdpa_varlen, reward-model pair scores, response
  log-probs; GPU fp32 vs CPU fp32 within 1e-4 on the shortest row and pair);
- the training scripts as they are: rl_1b_fsdp1 (PPO, HF generation, FSDP2 with one process, activation
  checkpointing, frozen reference, value model), sft_1b_fsdp1 (the final HF export), sft_1b_single,
  sft_1b_single_packed, rm_1b_fsdp1, dpo_1b_fsdp1, grpo_1b_single, sft_w8b_fsdp1. Each reports tokens/s, MFU
  (against the measured and the published peak), peak allocated/reserved GB beside plan's prediction, the first
  losses and whether every loss is finite.

Bounds. Every step runs in its own process session and gets its own share of what is left of --budget (`shares`: the
smoke step SMOKE_SHARE_S, the others in proportion to EXPECTED_S); a step still running at its share is killed with
every process it started (torchrun's workers live in sessions of their own, so the whole tree is signalled), recorded
as failed, and the rest go on; the kill's SIGTERM ends a training script without a checkpoint (STEP_SIGTERM). The
NCCL collective timeout of the training steps is short (COLLECTIVE_TIMEOUT_MINUTES), so a hung collective errors out
instead of waiting an hour. Disk: each step's run folder is deleted once its numbers are read, and only the small
smoke model writes a DCP checkpoint (1B with AdamW would be ~15 GB), so the work folder stays under ~15 GB.

Output: at most 3 files directly in OUT, rewritten after every step so a run cut off keeps what it did:
results.json, results.md and logs.tar.gz (every step's log). Each step's table row is printed as it finishes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
OPTIONAL_PACKAGES = ("datasets", "trl", "wandb", "vllm", "flash_attn", "math_verify", "peft")
STEP_TIMEOUT_S = 600  # without --budget: the longest one step may take
SMOKE_SHARE_S = 90  # the smoke step's seconds (~30 expected, a cold start included): a floor while the budget has it,
# and its whole share, so that a hang fails fast
COLLECTIVE_TIMEOUT_MINUTES = {"fsdp_smoke": 0.5, "other": 2.0}
KILL_GRACE_S = 10  # SIGTERM first (torchrun stops its workers), SIGKILL after this
FSDP_CONFIG = {"gpu": "configs/accelerate/fsdp_8gpu.yaml", "cpu": "configs/accelerate/fsdp_cpu_2proc.yaml"}
# Seconds each step is expected to take on one H100: estimates from the work each does (process start and model
# load dominate), never measured. The shares split the budget in these proportions, the smoke step's SMOKE_SHARE_S
# first, so at --budget 400 every step gets at least this much (tests/test_gpu_check_shares.py).
EXPECTED_S = {
    "fsdp_smoke": 30,
    "env": 5,
    "peak": 10,
    "build": 25,
    "parity": 20,
    "rl_1b_fsdp1": 45,
    "sft_1b_fsdp1": 30,
    "sft_1b_single": 20,
    "sft_1b_single_packed": 20,
    "rm_1b_fsdp1": 25,
    "dpo_1b_fsdp1": 30,
    "grpo_1b_single": 40,
    "sft_w8b_fsdp1": 30,
}
# What bench/gpu_check.py sets in every child: a SIGTERM (the kill at a step's share) ends a training script at once
# instead of checkpointing first (open_instruct.runtime.SIGTERM_ENV).
STEP_SIGTERM = "exit"


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


SMOKE_MODEL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=512, tie_word_embeddings=True)  # fmt: skip
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
    sft_steps=8,
    rows_per_step=16,
    max_seq_length=1024,
    rl_prompts=8,
    rl_samples=4,
    rl_response=256,
    rl_prompt_tokens=128,
    rl_rollouts=2,
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
    """The run's state: mode, folders, budget, the results so far. Steps run in child processes (`--worker`), which
    read and write the state they share (models, data, measured peak) in WORK/state.json."""

    STATE_KEYS = ("models", "data", "matmul_params", "measured_peak", "published_peak", "memory_gb")

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
        self.max_work_gb = 0.0
        for folder in (self.out, self.work, self.logs):
            os.makedirs(folder, exist_ok=True)
        self.load_state()

    @property
    def logs(self) -> str:
        return os.path.join(self.work, "logs")

    @property
    def state_path(self) -> str:
        return os.path.join(self.work, "state.json")

    def load_state(self) -> None:
        if os.path.isfile(self.state_path):
            with open(self.state_path) as f:
                for key, value in json.load(f).items():
                    setattr(self, key, value)

    def save_state(self) -> None:
        with open(self.state_path + ".tmp", "w") as f:
            json.dump({key: getattr(self, key) for key in self.STATE_KEYS}, f)
        os.replace(self.state_path + ".tmp", self.state_path)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def device(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() and not self.tiny else "cpu"


# ---------------------------------------------------------------------------------------------------------------------
# Steps that run in a worker process (`--worker NAME`)


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
    s = c.scale
    built = build_models(c, (("m1b", s.m1b, False), ("m1b_rm", s.m1b, True), ("w8b", s.w8b, False)), c.device)
    bench = bench_module()
    data = os.path.join(c.work, "data")
    rows = s.sft_steps * s.rows_per_step
    c.data.update(
        sft=bench_write(os.path.join(data, "sft.jsonl"), bench.sft_rows(rows, 0, s.median, s.high)),
        pref=bench_write(os.path.join(data, "pref.jsonl"), bench.preference_rows(rows, 1, s.median, s.high)),
        rl=bench_write(
            os.path.join(data, "rl.jsonl"), bench.rl_rows(s.rl_prompts * s.rl_rollouts * 2, 2, s.rl_prompt_tokens)
        ),
    )
    return {"params": built, "models_dir": os.path.join(c.work, "models")}


def step_build_smoke(c: Check) -> dict[str, Any]:
    """The fsdp_smoke step's small model (built on CPU: this process never touches the GPU) and a few rows."""
    s = c.scale
    built = build_models(c, (("smoke", SMOKE_MODEL if not c.tiny else s.m1b, False),), "cpu")
    rows = bench_module().sft_rows(2 * s.rows_per_step, 3, s.median, s.high)
    c.data["smoke"] = bench_write(os.path.join(c.work, "data", "smoke.jsonl"), rows)
    return {"params": built}


def build_models(c: Check, specs: tuple[tuple[str, dict, bool], ...], device: str) -> dict[str, int]:
    """Each (name, shape, reward model?) built from its config with seed 0 and saved in bf16 with the tokenizer."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from demo.tiny import build_tokenizer, tiny_llama_config
    from open_instruct.gpu_stats import matmul_params

    tokenizer = build_tokenizer()
    for name, shape, reward_model in specs:
        path = os.path.join(c.work, "models", name)
        extra = {"num_labels": 1} if reward_model else {}
        config = tiny_llama_config(c.scale.vocab, max_position_embeddings=4096, **shape, **extra)
        torch.manual_seed(0)
        with torch.device(device):
            model = (LlamaForSequenceClassification if reward_model else LlamaForCausalLM)(config)
        c.matmul_params[name] = matmul_params(model)
        model.to(torch.bfloat16).save_pretrained(path)
        tokenizer.save_pretrained(path)
        c.models[name] = path
        del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {name: c.matmul_params[name] for name, _, _ in specs}


def bench_write(path: str, rows: list[dict]) -> str:
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
    """One batch through models.scored_logprobs, sequence_logprobs and the reward model. The reference is the device
    in fp32 (TF32 off): bf16 autocast within BF16_REL_TOL of it, padded and packed. The device's fp32 is checked
    against the CPU's within FP32_REL_TOL on the shortest row (pair) only: a 1.24B model over every row on the CPU
    would take longer than the step's share."""
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
    pad = tokenizer.pad_token_id
    rows = [json.loads(line) for line in open(c.data["sft"])][: c.scale.parity_rows]
    examples = []
    for i, row in enumerate(rows):
        ids, labels = data_mod.tokenize_sft_messages(tokenizer, row["messages"], f"parity row {i}")
        examples.append({"input_ids": ids, "labels": labels})
    shortest = [min(examples, key=lambda e: len(e["input_ids"]))]
    pairs = [json.loads(line) for line in open(c.data["pref"])][: c.scale.parity_rows]
    pair_examples = [pair_example(tokenizer, p) for p in pairs]
    shortest_pair = [min(pair_examples, key=lambda e: len(e["chosen_ids"]) + len(e["rejected_ids"]))]
    out: dict[str, Any] = {}
    checks: dict[str, bool] = {}

    def check(label: str, value: Any, reference: Any, tol: float) -> None:
        diff = rel_diff(value, reference)
        out[label + "_rel_diff"], checks[label] = diff, diff < tol

    def sft_loss(model: Any, batch_examples: list, packed: bool, dev: str, bf16: bool) -> Any:
        batch = {k: v.to(dev) for k, v in data_mod.collate_sft(batch_examples, pad, packed).items()}
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            logps, _, _ = scored_logprobs(model, batch, batch["labels"])
        return -logps.double().mean().cpu()

    def response_logps(model: Any, batch_examples: list, dev: str, bf16: bool) -> Any:
        batch = {k: v.to(dev) for k, v in data_mod.collate_preferences(batch_examples, pad).items()}
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            return sequence_logprobs(model, batch)[0].cpu()

    def rm_scores(model: Any, batch_examples: list, dev: str, bf16: bool) -> Any:
        batch = data_mod.collate_preferences(batch_examples, pad)
        inputs = {k: batch[k].to(dev) for k in ("input_ids", "attention_mask")}
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            return model(**inputs).logits.squeeze(-1).cpu()

    model = load_causal_lm(c.models["m1b"], torch.float32, attn_implementation="sdpa").eval()
    cpu_loss = sft_loss(model, shortest, False, "cpu", False)
    model = model.to(device)
    check("sft_fp32_device_vs_cpu", sft_loss(model, shortest, False, device, False), cpu_loss, FP32_REL_TOL)
    reference = sft_loss(model, examples, False, device, False)
    out["sft_loss_fp32"] = float(reference)
    check("sft_bf16_padded", sft_loss(model, examples, False, device, True), reference, BF16_REL_TOL)
    check("sft_bf16_packed_sdpa", sft_loss(model, examples, True, device, True), reference, BF16_REL_TOL)
    del model
    # sdpa_varlen: the packed row (varlen_attn on a GPU); padded pairs go to sdpa, so it also scores the pairs.
    model = load_causal_lm(c.models["m1b"], torch.float32, attn_implementation="sdpa_varlen").eval()
    cpu_logps = response_logps(model, shortest_pair, "cpu", False)
    model = model.to(device)
    check("sft_bf16_packed_sdpa_varlen", sft_loss(model, examples, True, device, True), reference, BF16_REL_TOL)
    check("response_logps_fp32_device_vs_cpu", response_logps(model, shortest_pair, device, False), cpu_logps,
          FP32_REL_TOL)  # fmt: skip
    reference_logps = response_logps(model, pair_examples, device, False)
    check("response_logps_bf16", response_logps(model, pair_examples, device, True), reference_logps, BF16_REL_TOL)
    del model
    model = load_sequence_classifier(c.models["m1b_rm"], torch.float32, pad_token_id=pad).eval()
    cpu_scores = rm_scores(model, shortest_pair, "cpu", False)
    model = model.to(device)
    check("rm_scores_fp32_device_vs_cpu", rm_scores(model, shortest_pair, device, False), cpu_scores, FP32_REL_TOL)
    reference_scores = rm_scores(model, pair_examples, device, False)
    check("rm_scores_bf16", rm_scores(model, pair_examples, device, True), reference_scores, BF16_REL_TOL)
    del model
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
        "model_name_or_path": c.models[model],
        "mixed_precision": "bf16",  # --tiny too: the autocast path a card takes (CPU autocasts bf16)
        "logging_steps": 1,
        "learning_rate": 1e-5,
        "seed": 1,
        "save_final_model": False,
        "distributed_timeout_minutes": COLLECTIVE_TIMEOUT_MINUTES.get(name, COLLECTIVE_TIMEOUT_MINUTES["other"]),
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
        "fsdp_smoke",
        "sft",
        "smoke",
        True,
        lambda c: supervised(
            c,
            "fsdp_smoke",
            "sft",
            "smoke",
            "smoke",
            activation_checkpointing=True,
            max_tokens_per_micro_batch=c.scale.w8b_packed_tokens,
            total_episodes=2 * c.scale.rows_per_step,
            checkpointing_steps=1,
            keep_last_n_checkpoints=1,
            save_final_model=True,
        ),  # fmt: skip
    ),
    TrainStep(
        "rl_1b_fsdp1", "rlvr_ppo", "m1b", True, lambda c: rl(c, "rl_1b_fsdp1", "ppo", activation_checkpointing=True)
    ),  # fmt: skip
    TrainStep(
        "sft_1b_fsdp1",
        "sft",
        "m1b",
        True,
        lambda c: supervised(
            c, "sft_1b_fsdp1", "sft", "m1b", "sft", activation_checkpointing=True, save_final_model=True
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


def step_command(c: Check, name: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a worker step: this file again, in its own process."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--work_dir", c.work, "--out", c.out]
    return command + (["--tiny"] if c.tiny else []), child_env()


def child_env() -> dict[str, str]:
    """The environment of every child: the repo first on the path (what was on it before stays after)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    from open_instruct.runtime import SIGTERM_ENV

    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {**env, SIGTERM_ENV: STEP_SIGTERM}  # a step killed at its share writes no checkpoint


def training_command(c: Check, step: TrainStep, recipe_path: str) -> tuple[list[str], dict[str, str]]:
    script = os.path.join(REPO, "open_instruct", f"{step.script}.py")
    run_args = [recipe_path, "--overwrite_output_dir", "true"]  # a rerun (--only) replaces the step's own run
    env = child_env()
    if not step.fsdp:
        return [sys.executable, script, *run_args], env
    config = FSDP_CONFIG["cpu" if c.tiny else "gpu"]
    if c.tiny:
        env["OPEN_INSTRUCT_CPU_FSDP"] = "1"  # one gloo process on FSDP2: the same path one GPU takes on NCCL
    env["OPEN_INSTRUCT_SHARD_REPORT"] = os.path.join(c.work, "shards", step.name)  # read after a checkpoint
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(REPO, config)]
    return command + ["--num_processes", "1", script, *run_args], env


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), whatever session it started."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's session and to every process below it (torchrun's workers have sessions of their own),
    then SIGKILL to those still alive after KILL_GRACE_S. The tree is read before anything is signalled: a killed
    parent's children are handed to init and no longer found below it."""
    pids = [proc.pid, *descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline:
            proc.poll()  # reaps the step's own process
            if not any(alive(pid) for pid in pids):
                return
            time.sleep(0.1)
    proc.wait()


class StepTimeout(Exception):
    pass


def run_bounded(command: list[str], env: dict[str, str], log_path: str, timeout: float) -> int:
    """Run `command` in a session of its own with its output in `log_path`; at `timeout` seconds kill it and every
    process it started, and raise StepTimeout."""
    with open(log_path, "a") as log:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise StepTimeout(f"killed at its share of the budget, {timeout:.0f} s") from None


def log_tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def run_worker_step(c: Check, name: str, timeout: float) -> dict[str, Any]:
    log_path = os.path.join(c.logs, f"{name}.log")
    result_path = os.path.join(c.work, "results", f"{name}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    command, env = step_command(c, name)
    rc = run_bounded(command, env, log_path, timeout)
    c.load_state()
    if rc != 0 or not os.path.isfile(result_path):
        raise StepFailed(f"exit {rc}; log tail:\n{log_tail(log_path)}", {"rc": rc})
    with open(result_path) as f:
        result = json.load(f)
    if result.get("status") == "failed":
        raise StepFailed(result.get("error", ""), result)
    return result


def work_gb(c: Check) -> float:
    total = 0
    for root, _, files in os.walk(c.work):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total / 1e9


def run_training(c: Check, step: TrainStep, timeout: float) -> dict[str, Any]:
    recipe = step.recipe(c)
    path = write_recipe(c, step.name, recipe)
    log_path = os.path.join(c.logs, f"{step.name}.log")
    t0 = time.perf_counter()
    try:
        rc = run_bounded(*training_command(c, step, path), log_path, timeout)
        out: dict[str, Any] = {"rc": rc, "wall_s": time.perf_counter() - t0}
        out.update(read_metrics(c, step, recipe))
        try:
            out["predicted_gb"] = predicted_memory_gb(c, path, step.fsdp)
        except Exception as e:  # noqa: BLE001 - the prediction is reported beside the run, never stops it
            out["predicted_gb"] = None
            out["prediction_error"] = f"{type(e).__name__}: {e}"
        run_dir = recipe["output_dir"]
        if recipe.get("checkpointing_steps"):
            checkpoints = os.path.join(run_dir, "checkpoints")
            out["dcp_checkpoint"] = os.path.isdir(checkpoints) and any(
                n.startswith("step_") for n in os.listdir(checkpoints)
            )
        if recipe.get("save_final_model"):
            out["final_export"] = os.path.isfile(os.path.join(run_dir, "final_model", "config.json"))
        out.update(shard_summary(c, step))
        c.max_work_gb = max(c.max_work_gb, work_gb(c))
        out["work_gb"] = c.max_work_gb
    finally:
        shutil.rmtree(recipe["output_dir"], ignore_errors=True)  # the next steps need the disk
    if rc != 0:
        raise StepFailed(f"exit {rc}; log tail:\n{log_tail(log_path)}", out)
    return out


def shard_summary(c: Check, step: TrainStep) -> dict[str, Any]:
    """From the shard report a checkpoint writes: the world size, accelerate's distributed type and whether every
    trained parameter was a DTensor (FSDP2), so one-process FSDP2 is shown, not assumed."""
    folder = os.path.join(c.work, "shards", step.name)
    reports = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not reports:
        return {}
    with open(os.path.join(folder, reports[-1])) as f:
        report = json.load(f)
    params = [p for model in report["models"].values() for p in model["params"].values()]
    return {
        "world_size": report["world_size"],
        "distributed_type": report["distributed_type"],
        "fsdp2_dtensor_params": bool(params) and all(p["dtensor"] for p in params),
    }


class StepFailed(Exception):
    def __init__(self, message: str, partial: dict[str, Any]) -> None:
        super().__init__(message)
        self.partial = partial


def summarize(c: Check) -> dict[str, Any]:
    """results.json, results.md and logs.tar.gz in OUT (rewritten after every step: a run cut off keeps them)."""
    for step in TRAIN_STEPS:
        mine, other = c.results.get(step.name, {}), c.results.get(step.compare_first_loss_with or "", {})
        a, b = first_loss(mine), first_loss(other)
        if step.compare_first_loss_with and a is not None and b is not None:
            diff = abs(a - b) / max(abs(b), 1e-12)
            mine["first_loss_vs"] = {"step": step.compare_first_loss_with, "rel_diff": diff, "ok": diff < BF16_REL_TOL}
    results = {"tiny": c.tiny, "budget_s": c.budget, "elapsed_s": c.elapsed, "steps": c.results}
    write_atomic(os.path.join(c.out, "results.json"), json.dumps(results, indent=1, default=str))
    write_atomic(os.path.join(c.out, "results.md"), markdown(c) + "\n")
    archive = os.path.join(c.out, "logs.tar.gz")
    with tarfile.open(archive + ".tmp", "w:gz") as tar:
        tar.add(c.logs, arcname="logs")
    os.replace(archive + ".tmp", archive)
    return {"wrote": ["results.json", "results.md", "logs.tar.gz"]}


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


TABLE_HEADER = (
    "| step | status | wall s | tokens/s | MFU (measured peak) | MFU (published) | RL resp tok/s | gen s | train s "
    "| first loss | finite | peak alloc GB | peak reserved GB | predicted GB | cross-check |"
)


def table_row(name: str, r: dict[str, Any]) -> str:
    """One step's row of results.md (also printed when the step ends)."""
    if name in ("env", "peak", "build", "parity") or r.get("status") == "skipped":
        status = r.get("status")
        detail = (r.get("error") or r.get("reason") or "") if status != "ok" else ""
        return f"| {name} | {status} | {fmt(r.get('seconds'))} | | | | | | | | | | | | {detail[:80]} |"
    cross = r.get("first_loss_vs")
    cross_text = f"vs {cross['step']}: {cross['rel_diff']:.2g} ({'ok' if cross['ok'] else 'FAIL'})" if cross else ""
    if r.get("dcp_checkpoint") is not None:
        cross_text += f" DCP {fmt(r.get('dcp_checkpoint'))}"
    if r.get("final_export") is not None:
        cross_text += f" export {fmt(r.get('final_export'))}"
    if r.get("fsdp2_dtensor_params") is not None:
        cross_text += f" FSDP2 x{r.get('world_size')} {fmt(r.get('fsdp2_dtensor_params'))}"
    if r.get("status") == "failed":
        cross_text += " " + (r.get("error") or "").splitlines()[0][:80]
    return (
        f"| {name} | {r.get('status')} | {fmt(r.get('seconds'))} | {fmt(r.get('tokens_per_second'))} "
        f"| {fmt(r.get('mfu_vs_measured'))} | {fmt(r.get('mfu_vs_published'))} "
        f"| {fmt(r.get('response_tokens_per_second'))} | {fmt(r.get('generation_s'))} | {fmt(r.get('training_s'))} "
        f"| {fmt(first_loss(r) or next(iter((r.get('first_losses') or {}).values()), None), 5)} "
        f"| {fmt(r.get('losses_finite'))} | {fmt(r.get('peak_allocated_gb'))} | {fmt(r.get('peak_reserved_gb'))} "
        f"| {fmt(r.get('predicted_gb'))} | {cross_text.strip()} |"
    )


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
        f"fp32 {fmt(peak.get('fp32_tflops'))}; budget {fmt(c.budget)} s, elapsed {c.elapsed:.0f} s, "
        f"work folder at most {c.max_work_gb:.3g} GB",
        "",
        TABLE_HEADER,
        "|" + "---|" * 15,
    ]
    lines += [table_row(name, r) for name, r in c.results.items() if name != "summarize"]
    parity = c.results.get("parity", {})
    if parity:
        diffs = ", ".join(f"{k[:-9]} {v:.2g}" for k, v in parity.items() if k.endswith("_rel_diff"))
        lines += [
            "",
            f"Parity (relative differences; bf16 vs the device's fp32 < {BF16_REL_TOL:g}, fp32 device_vs_cpu "
            f"< {FP32_REL_TOL:g}): {diffs}",
        ]
        if "logits_peak_extra_gb_chunked" in parity:
            lines.append(
                f"Log-prob head over {parity['logits_tokens']} tokens x vocab {c.scale.vocab}: peak extra "
                f"{parity['logits_peak_extra_gb_chunked']:.2f} GB chunked vs "
                f"{parity['logits_peak_extra_gb_full']:.2f} GB full logits"
            )
    skipped = [n for n, r in c.results.items() if r.get("status") == "skipped"]
    if skipped:
        reasons = ", ".join(f"{n} ({c.results[n].get('reason')})" for n in skipped)
        lines += ["", f"Skipped: {reasons}"]
    return "\n".join(lines)


WORKER_STEPS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "env": step_env,
    "peak": step_peak,
    "build": step_build,
    "build_smoke": step_build_smoke,
    "parity": step_parity,
}
STEP_ORDER = ("fsdp_smoke", "env", "peak", "build", "parity", *(s.name for s in TRAIN_STEPS[1:]), "summarize")


def worker_main(c: Check, name: str) -> int:
    """One worker step in this process: its result in WORK/results/NAME.json, the shared state saved."""
    try:
        result = WORKER_STEPS[name](c)
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded; the orchestrator goes on
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        traceback.print_exc()
    c.save_state()
    os.makedirs(os.path.join(c.work, "results"), exist_ok=True)
    write_atomic(os.path.join(c.work, "results", f"{name}.json"), json.dumps(result, default=str))
    return 0


def shares(budget: float, steps: list[str]) -> dict[str, float]:
    """Seconds of `budget` for each of `steps` (summing to it): the smoke step SMOKE_SHARE_S when the budget has
    them beside the others' expected seconds (else its proportional part), the rest in proportion to EXPECTED_S."""
    expected = {n: float(EXPECTED_S.get(n, 0)) for n in steps}
    out: dict[str, float] = {}
    if "fsdp_smoke" in expected:
        others = sum(v for n, v in expected.items() if n != "fsdp_smoke")
        if budget >= SMOKE_SHARE_S + others:
            out["fsdp_smoke"] = float(SMOKE_SHARE_S)
            budget -= SMOKE_SHARE_S
            del expected["fsdp_smoke"]
    total = sum(expected.values())
    out.update({n: budget * v / total if total else 0.0 for n, v in expected.items()})
    return {n: out[n] for n in steps}


def share(c: Check, name: str, still_to_run: list[str]) -> float:
    """This step's seconds: its part (`shares`) of what is left of the budget over the steps still to run, so time a
    step did not use goes to the later ones (no budget: STEP_TIMEOUT_S; the smoke step SMOKE_SHARE_S)."""
    if not c.budget:
        return float(SMOKE_SHARE_S if name == "fsdp_smoke" and not c.tiny else STEP_TIMEOUT_S)
    return max(1.0, shares(c.budget - c.elapsed, still_to_run)[name])


def run_step(c: Check, name: str, timeout: float) -> None:
    """Run one step within `timeout` seconds; record ok/failed (with the error) and its seconds; print its row."""
    t0 = time.perf_counter()
    print(f"[gpu-check {c.elapsed:6.1f}s] {name} (up to {timeout:.0f} s) ...", flush=True)
    try:
        train = next((s for s in TRAIN_STEPS if s.name == name), None)
        if train is None:
            result = run_worker_step(c, name, timeout)
        else:
            if train.model not in c.models:
                run_worker_step(c, "build_smoke" if train.model == "smoke" else "build", timeout)
            result = run_training(c, train, max(1.0, timeout - (time.perf_counter() - t0)))
        result["status"] = "ok"
    except StepFailed as e:
        result = {**e.partial, "status": "failed", "error": str(e)}
    except StepTimeout as e:
        result = {"status": "failed", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - one failing step is recorded, the rest go on
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - t0
    result["share_s"] = timeout
    c.results[name] = result
    print(table_row(name, result), flush=True)
    if result["status"] == "failed":
        print(result["error"][-1500:], flush=True)


def steps_to_run(only: set[str]) -> list[str]:
    """The steps a run with `--only` (empty: every step) runs, in order, with the build and peak steps they need."""
    to_run = [n for n in STEP_ORDER if n != "summarize" and (not only or n in only)]
    needs_models = any(n == "parity" or (n in EXPECTED_S and n not in LOCAL_ONLY) for n in to_run)
    if needs_models and "build" not in to_run:
        to_run.insert(0, "build")  # the models and data the later steps need
    if any(n in TRAINING for n in to_run) and "peak" not in to_run:
        to_run.insert(0, "peak")  # the MFU denominator
    return sorted(to_run, key=STEP_ORDER.index)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "output/gpu_check", help="results folder ($OUT)")
    parser.add_argument("--work_dir", default=None, help="models, data and runs (default: a temp folder)")
    parser.add_argument("--tiny", action="store_true", help="every step on CPU with tiny shapes (minutes)")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds in all, each step its share (0: 600 each)")
    parser.add_argument("--only", default="", help="steps to run, space or comma separated")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one step in a child process
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(Check(args), args.worker)
    only = set(args.only.replace(",", " ").split())
    unknown = only - set(STEP_ORDER)
    if unknown:
        print(f"unknown step(s) {sorted(unknown)}; steps: {' '.join(STEP_ORDER)}", file=sys.stderr)
        return 2
    c = Check(args)
    to_run = steps_to_run(only)
    for i, name in enumerate(to_run):
        smoke = c.results.get("fsdp_smoke", {})
        if smoke.get("status") == "failed" and name in FSDP_STEPS:
            c.results[name] = {"status": "skipped", "seconds": 0.0, "reason": "fsdp_smoke failed"}
        elif c.budget and c.elapsed >= c.budget:
            c.results[name] = {"status": "skipped", "seconds": 0.0, "reason": f"budget {c.budget:g} s spent"}
        else:
            run_step(c, name, share(c, name, to_run[i:]))
            summarize(c)
            continue
        print(table_row(name, c.results[name]), flush=True)
    summarize(c)
    print(open(os.path.join(c.out, "results.md")).read())
    if not args.work_dir:
        shutil.rmtree(c.work, ignore_errors=True)
    failed = [n for n, r in c.results.items() if r.get("status") == "failed"]
    return 1 if failed else 0


TRAINING = {s.name for s in TRAIN_STEPS}
FSDP_STEPS = {s.name for s in TRAIN_STEPS if s.fsdp and s.name != "fsdp_smoke"}
LOCAL_ONLY = {"env", "peak", "build", "fsdp_smoke"}  # steps that need no model from `build`

if __name__ == "__main__":
    sys.exit(main())
