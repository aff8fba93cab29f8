"""The memory model (open_instruct/memory_model.py) against what torch's CPU allocator records, phase by phase, at
small shapes: a training micro-batch (fp32 and bf16 autocast, with and without activation checkpointing), a no-grad
scoring forward and HF generation (fp32 and bf16 autocast), for a model whose memory the log-prob head dominates and
one whose layers do.

    python bench/memory_check.py          # the table docs/gpu.md quotes; tests/test_plan_memory.py asserts 15%

How it measures. torch.profiler with profile_memory records every allocation and free of the CPU allocator, each
attributed to the op that made it: allocations are placed at their op's start, frees at its end, and the running
sum's peak above the start is the phase's peak extra memory. What is held before the phase (fp32 weights, the
gradients a warm-up step allocated) is not in it, as the model's phases exclude the resident parts. One process,
no FSDP: the layouts a CPU can run (FSDP's gathered units are arithmetic on the unit sizes, checked in
tests/test_plan_memory.py by hand).
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from dataclasses import dataclass
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    rows: int  # training and scoring: rows x tokens, every position scored but the last
    tokens: int
    sequences: int = 8  # generation: sequences x (prompt + response)
    prompt: int = 96
    response: int = 64
    generation: bool = True  # measure HF generation at this shape


SHAPES = (
    # No generation here: on CPU, the bf16 output-layer matmul of the last position (a strided slice) allocates a
    # 2^24-byte oneDNN buffer at this vocabulary, more than the phase itself; a GPU's cuBLAS does not.
    Shape("head-heavy", hidden=256, layers=4, intermediate=688, vocab=4096, rows=4, tokens=256, generation=False),
    Shape("layer-heavy", hidden=256, layers=4, intermediate=688, vocab=256, rows=8, tokens=256),
)


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """The CPU allocator's peak above its level at the start, while `fn` runs (torch.profiler's memory records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted(
        (e.time_range.start if e.self_cpu_memory_usage > 0 else e.time_range.end, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    level = peak = 0
    for _, change in changes:
        level += change
        peak = max(peak, level)
    return peak


def build_model(shape: Shape, folder: str) -> str:
    import torch
    from transformers import LlamaForCausalLM

    from demo.tiny import tiny_llama_config

    config = tiny_llama_config(shape.vocab, hidden_size=shape.hidden, num_layers=shape.layers,
                               intermediate_size=shape.intermediate, num_attention_heads=8, num_key_value_heads=2,
                               max_position_embeddings=2048)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def layout(shape: Shape, bf16: bool, checkpointing: bool, generation: bool = False) -> Any:
    from open_instruct.memory_model import MemoryLayout

    tokens = shape.rows * shape.tokens
    return MemoryLayout(
        world=1, fsdp=False, compute_bytes=2 if bf16 else 4, activation_checkpointing=checkpointing,
        cpu_offload=False, lora=False, train_tokens=tokens, scored_tokens=shape.rows * (shape.tokens - 1),
        score_tokens=tokens, generation_sequences=shape.sequences if generation else 0,
        generation_tokens=shape.prompt + shape.response, generation_prompt_tokens=shape.prompt,
    )  # fmt: skip


class _Tokenizer:
    pad_token_id = 0

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return ""


def measure(shape: Shape) -> list[dict[str, Any]]:
    """Rows of {shape, phase, dtype, checkpointing, predicted, measured} (bytes)."""
    import torch

    from open_instruct.generation import GenerationConfig, HFGenerator
    from open_instruct.memory_model import predict_peak, shape_of
    from open_instruct.models import load_causal_lm, scored_logprobs

    folder = build_model(shape, tempfile.mkdtemp(prefix="memory_check_"))
    model_shape = shape_of(folder)
    torch.manual_seed(1)
    ids = torch.randint(0, shape.vocab, (shape.rows, shape.tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    rows = []

    def row(phase: str, bf16: bool, checkpointing: bool, measured: int, lay: Any) -> None:
        parts = predict_peak(lay, model_shape, 80.0)["phases"][phase]
        predicted = sum(v for k, v in parts.items() if k != "gradients freed")
        rows.append(dict(shape=shape.name, phase=phase, dtype="bf16 autocast" if bf16 else "fp32",
                         checkpointing=checkpointing, predicted=predicted, measured=measured))  # fmt: skip

    for bf16 in (False, True):
        for checkpointing in (False, True):
            model = load_causal_lm(folder, torch.float32, attn_implementation="sdpa").train()
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

            def step() -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logps, _, _ = scored_logprobs(model, batch, batch["labels"])
                (-logps.mean()).backward()

            step()  # the gradients exist from here on: resident, not the phase's
            row("training micro-batch", bf16, checkpointing, peak_extra_bytes(step), layout(shape, bf16, checkpointing))
            if not checkpointing:

                def forward() -> None:
                    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        scored_logprobs(model, batch, batch["labels"])

                row("no-grad forward", bf16, False, peak_extra_bytes(forward), layout(shape, bf16, False))
        if not shape.generation:
            continue
        model = load_causal_lm(folder, torch.float32, attn_implementation="sdpa")
        if bf16:  # as accelerate's prepare does without FSDP: autocast around every forward, bound to the model
            model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__), model)
        dtype = torch.bfloat16 if bf16 else None  # bf16: the weights cast once into a copy (what RL's generator does)
        generator = HFGenerator(model, _Tokenizer(), batch_size=shape.sequences, eos_token_ids=[1], compute_dtype=dtype)
        prompts = [torch.randint(5, shape.vocab, (shape.prompt - i % 3,)).tolist() for i in range(shape.sequences)]
        config = GenerationConfig(max_new_tokens=shape.response, temperature=1.0, seed=1)
        measured = peak_extra_bytes(lambda: generator.generate(prompts, config))
        row("HF generation", bf16, False, measured, layout(shape, bf16, False, generation=True))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | phase | dtype | checkpointing | predicted MB | measured MB | predicted / measured |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['phase']} | {r['dtype']} | {'yes' if r['checkpointing'] else 'no'} "
            f"| {r['predicted'] / 1e6:.1f} | {r['measured'] / 1e6:.1f} | {r['predicted'] / r['measured']:.2f} |"
        )
    return "\n".join(lines)


def generation_dtype(repeats: int = 3) -> str:
    """HF generation of a bf16 run without FSDP, two ways: fp32 weights under autocast around each forward (every
    decoding step casts every weight again: what it did) and a bf16 copy made once per weight version (what
    HFGenerator does now, its copy counted in the time); seconds (best of `repeats`) and peak extra memory."""
    import time

    import torch

    from open_instruct.generation import GenerationConfig, HFGenerator
    from open_instruct.models import load_causal_lm

    shape = Shape("gen", hidden=512, layers=8, intermediate=1376, vocab=2048, rows=0, tokens=0, sequences=8,
                  prompt=64, response=64)  # fmt: skip
    folder = build_model(shape, tempfile.mkdtemp(prefix="memory_check_"))
    torch.manual_seed(1)
    prompts = [torch.randint(5, shape.vocab, (shape.prompt,)).tolist() for _ in range(shape.sequences)]
    config = GenerationConfig(max_new_tokens=shape.response, temperature=0)
    lines = ["| weights while generating | seconds | new tokens/s | peak extra MB |", "|---|---|---|---|"]
    outputs = {}
    for label, dtype in (("fp32, cast under autocast at every step", None), ("bf16 copy, once per version", True)):
        model = load_causal_lm(folder, torch.float32, attn_implementation="sdpa")
        model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__), model)
        best = float("inf")
        for _ in range(repeats):
            generator = HFGenerator(model, _Tokenizer(), batch_size=shape.sequences, eos_token_ids=[1],
                                    compute_dtype=torch.bfloat16 if dtype else None)  # fmt: skip
            t0 = time.perf_counter()
            outputs[label] = generator.generate(prompts, config).response_ids
            best = min(best, time.perf_counter() - t0)
        generator = HFGenerator(model, _Tokenizer(), batch_size=shape.sequences, eos_token_ids=[1],
                                compute_dtype=torch.bfloat16 if dtype else None)  # fmt: skip
        peak = peak_extra_bytes(lambda: generator.generate(prompts, config))
        tokens = shape.sequences * shape.response
        lines.append(f"| {label} | {best:.2f} | {tokens / best:.0f} | {peak / 1e6:.1f} |")
    same = sum(a == b for a, b in zip(*outputs.values()))
    lines.append(f"\nGreedy responses identical in {same} of {shape.sequences} sequences (bf16 residual vs fp32).")
    return "\n".join(lines)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    print(table([r for shape in SHAPES for r in measure(shape)]))
    print()
    print(generation_dtype())


if __name__ == "__main__":
    main()
