"""Training throughput on a realistic length mix, ours vs TRL with its best settings, in one run; MFU against a GEMM
peak measured in the same run.

    python bench/bench_throughput.py                          # CPU: 25M-parameter Llama, SFT / RM / DPO, fp32
    python bench/bench_throughput.py --precision bf16         # the same under bf16 autocast
    python bench/bench_throughput.py --preset gpu             # one GPU: 0.6B Llama, bf16, SFT / RM / DPO / GRPO
    python bench/bench_throughput.py --preset tiny            # every path on a tiny model, CPU, a few minutes

Workload. A Llama built from a config (no hub; `PRESETS`; the character-level tokenizer of demo/tiny.py with the
model's vocabulary padded to a realistic size, so the output layer costs what it costs in a real model), and
conversations whose token lengths are drawn from a long-tailed (log-normal) distribution clipped to 32..1024
(median ~180, mean ~250; `lengths`): a user turn and an assistant turn (SFT), or a prompt and two responses of
independent lengths (RM, DPO). Every trainer sees the same examples in the same order and the same batches: the
order is our scripts' (seeded) episode order, and TRL's sampler is made sequential over the rows in that order
(its tokenization is checked against ours). Per optimizer step: `--batch_size` conversations (SFT) or pairs (RM,
DPO), no gradient accumulation, AdamW at a constant learning rate, clipping at 1.0, no activation checkpointing,
no eval, no checkpoints. Every trainer runs in its own fresh process.

Variants.
  ours_padded  our scripts, each micro-batch padded to its longest sequence;
  ours_packed  our scripts with `--max_tokens_per_micro_batch` (padding-free packing), when the config has it;
  trl          TRL (installed version) with its best settings for the workload: SFT `padding_free=True`; RM padded
               (RewardTrainer has no padding-free mode); DPO padded (its `padding_free` is disabled in trl 1.16, it
               falls back to padding) with `precompute_ref_log_probs=True` (the reference pass once, before
               training, like our cache; both passes are timed on their own line); GRPO the default.
Ours and TRL run at the same precision (`--precision`; TRL `bf16=True` autocasts like ours).

Measured. Tokens/s = real (non-pad) tokens of the timed optimizer steps (all but the first `--warmup`) over their
wall time; pairs/s (RM, DPO) likewise; CPU s/step = process CPU time per timed step (robust when other jobs share
the machine). Peak memory: the worker's peak resident set (VmHWM, CPU) or torch's peak allocated GPU memory.
MFU = 6 * N * tokens/s / peak FLOP/s, N = parameters without the input embedding (its lookup costs no FLOPs; the
output layer is in, tied or not: open_instruct.gpu_stats.matmul_params), so padding, attention (not in 6N) and
recomputation count as lost time. On CPU the peak is the best of matmuls of the model's own shapes (tokens x hidden
@ hidden x {hidden, intermediate, vocab}) measured in each worker right before and after its training, with its
threads, in fp32 and bf16: MFU is reported against the peak of the run's precision. On a GPU the peak is the
published dense bf16 FLOP/s of the detected GPU (open_instruct/gpu_stats.py: H100 SXM, PCIe and NVL told apart).
Runs alternate (each variant once per repeat) so they share the machine's load;
ratios are per repeat, the median is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.worker_process import print_result, run_worker  # noqa: E402  (also when a test loads this file by path)

BETA = 0.1
LEARNING_RATE = 1e-5
PACKING_KNOB = "max_tokens_per_micro_batch"


@dataclasses.dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch_size: int  # conversations (SFT) or pairs (RM, DPO) per optimizer step
    steps: int
    warmup: int
    max_tokens: int  # ours_packed: max_tokens_per_micro_batch
    workloads: tuple[str, ...]
    precision: str
    threads: int
    median_length: int = 180
    max_length: int = 1024
    grpo_prompts: int = 8  # per step, GROUP completions each
    grpo_prompt_tokens: int = 128
    grpo_completion_tokens: int = 256


PRESETS = {
    # 25.2M parameters (18.9M without the input embedding); a 16k vocabulary keeps the output layer ~1/3 of the FLOPs.
    "cpu": Preset(384, 8, 6, 2, 1024, 16384, 8, 10, 2, 4096, ("sft", "rm", "dpo"), "no", 1),
    # 0.64B parameters (0.59B without the input embedding), Llama-shaped (GQA 12/4 heads of 128).
    "gpu": Preset(1536, 22, 12, 4, 4096, 32000, 16, 12, 2, 16384, ("sft", "rm", "dpo", "grpo"), "bf16", 0),
    # Every code path in a couple of minutes on CPU (the GPU preset's workloads on a tiny model).
    "tiny": Preset(64, 2, 4, 2, 128, 1024, 4, 4, 1, 1024, ("sft", "rm", "dpo", "grpo"), "no", 1, 60, 256, 2, 16, 8),
}
VARIANTS = ("ours_padded", "ours_packed", "trl")


# ---------------------------------------------------------------------------------------------------------------------
# The workload: lengths, rows, model


def lengths(n: int, rng: random.Random, median: int, low: int = 32, high: int = 1024, sigma: float = 0.8) -> list[int]:
    """n token lengths from a log-normal (median `median`, sigma 0.8: a long right tail), redrawn until in
    [low, high]."""
    out = []
    while len(out) < n:
        x = int(round(math.exp(rng.gauss(math.log(median), sigma))))
        if low <= x <= high:
            out.append(x)
    return out


def text(rng: random.Random, n: int) -> str:
    """n characters of word-like text (one token per character with the character-level tokenizer)."""
    words = []
    while sum(len(w) + 1 for w in words) <= n:  # joined length = that sum - 1 >= n
        words.append("".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(1, 9))))
    return " ".join(words)[:n]


TURN_OVERHEAD = 4  # "<|role|>" "\n" ... "<|end|>" "\n": tokens the chat template adds per message


def sft_rows(n: int, seed: int, median: int, high: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for total in lengths(n, rng, median, high=high):
        prompt = max(TURN_OVERHEAD + 1, int(total * rng.uniform(0.1, 0.6)))
        response = total - prompt
        rows.append(
            {
                "id": f"sft-{len(rows)}",
                "messages": [
                    {"role": "user", "content": text(rng, prompt - TURN_OVERHEAD)},
                    {"role": "assistant", "content": text(rng, response - TURN_OVERHEAD)},
                ],
            }
        )
    return rows


def preference_rows(n: int, seed: int, median: int, high: int) -> list[dict]:
    """Pairs with one prompt and two responses; each full conversation's length is drawn independently."""
    rng = random.Random(seed)
    drawn = lengths(2 * n, rng, median, high=high)
    rows = []
    for i in range(n):
        chosen_total, rejected_total = drawn[2 * i], drawn[2 * i + 1]
        prompt = max(TURN_OVERHEAD + 1, int(min(chosen_total, rejected_total) * rng.uniform(0.1, 0.6)))
        user = {"role": "user", "content": text(rng, prompt - TURN_OVERHEAD)}
        rows.append(
            {
                "id": f"pair-{i}",
                "chosen": [user, {"role": "assistant", "content": text(rng, chosen_total - prompt - TURN_OVERHEAD)}],
                "rejected": [
                    user,
                    {"role": "assistant", "content": text(rng, rejected_total - prompt - TURN_OVERHEAD)},
                ],
            }
        )
    return rows


def rl_rows(n: int, seed: int, prompt_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "id": f"rl-{i}",
            "messages": [{"role": "user", "content": text(rng, prompt_tokens - 3)}],
            "ground_truth": "7",
            "dataset": "arithmetic",
        }
        for i in range(n)
    ]


def build_models(out_dir: str, p: Preset, seed: int = 0) -> dict[str, str]:
    """A causal LM and a sequence classifier (num_labels=1) of the preset's shape, random weights, with the
    character-level chat tokenizer (its ~100 ids are the first of the model's vocabulary)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from demo.tiny import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    shape = dict(
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        intermediate_size=p.intermediate,
        max_position_embeddings=4096,
    )
    paths = {}
    for name, cls, extra in (
        ("causal_lm", LlamaForCausalLM, {}),
        ("seq_cls", LlamaForSequenceClassification, {"num_labels": 1}),
    ):
        path = os.path.join(out_dir, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            torch.manual_seed(seed)
            config = tiny_llama_config(p.vocab, p.hidden, p.layers, **shape, **extra)
            cls(config).save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


def flops_params(model: Any) -> int:
    """N of 6N (open_instruct.gpu_stats.matmul_params: the output layer counts even when tied to the embedding)."""
    from open_instruct.gpu_stats import matmul_params

    return matmul_params(model)


# ---------------------------------------------------------------------------------------------------------------------
# Peak FLOP/s


def gemm_peak(p: Preset, dtype: str, tokens: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of the model's matmuls (tokens x hidden @ hidden x {hidden, intermediate, vocab}) on this CPU,
    with this process's threads: the peak the training run's GEMMs could reach on this machine right now."""
    import torch

    best = 0.0
    torch_dtype = {"no": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for n in (p.hidden, p.intermediate, p.vocab):
        a = torch.randn(tokens, p.hidden, dtype=torch_dtype)
        b = torch.randn(p.hidden, n, dtype=torch_dtype)
        a @ b
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * tokens * p.hidden * n / (time.perf_counter() - t0))
    return best


def gpu_peak() -> tuple[str, Optional[float]]:
    """(GPU name, published dense bf16 FLOP/s) from open_instruct.gpu_stats (H100 SXM, PCIe and NVL told apart), or
    (name, None) if unknown."""
    import torch

    from open_instruct.gpu_stats import device_peak_flops

    props = torch.cuda.get_device_properties(0)
    return props.name, device_peak_flops(props.name, props.total_memory)


def flash_attention() -> Optional[str]:
    """flash_attention_2 on a GPU with flash-attn installed (varlen kernel for packed rows, TRL's padding_free
    needs it too), else None (sdpa; ours packs with sdpa_varlen)."""
    import importlib.util

    import torch

    return "flash_attention_2" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else None


def mfu(flops_n: int, tokens_per_second: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: 6 N tokens/s over the peak (None without a peak), open_instruct.gpu_stats.mfu."""
    from open_instruct.gpu_stats import mfu as model_flops_utilisation

    return model_flops_utilisation(6 * flops_n, tokens_per_second, peak)


# ---------------------------------------------------------------------------------------------------------------------
# Workers (one fresh process each)


def rss_mb(field: str = "VmHWM") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stamp(stamps: list) -> None:
    sync()
    stamps.append((time.perf_counter(), time.process_time()))


def has_packing() -> bool:
    from open_instruct.config import BaseConfig

    return PACKING_KNOB in {f.name for f in dataclasses.fields(BaseConfig)}


def ours_args(a: argparse.Namespace, p: Preset) -> list[str]:
    out = tempfile.mkdtemp(prefix=f"bench_{a.workload}_ours_")
    args = ["--output_dir", os.path.join(out, "run"), "--seed", "1", "--mixed_precision", a.precision]
    args += ["--learning_rate", str(LEARNING_RATE), "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0"]
    args += ["--save_final_model", "false", "--logging_steps", str(1 if a.workload == "grpo" else p.steps)]
    if a.workload != "grpo":
        args += ["--dataset_name_or_path", a.data, "--max_seq_length", str(p.max_length)]
        args += ["--gradient_accumulation_steps", "1"]
        args += ["--per_device_train_batch_size", str(p.batch_size), "--total_episodes", str(p.steps * p.batch_size)]
    if a.variant == "ours_packed":
        args += [f"--{PACKING_KNOB}", str(p.max_tokens)]
    if flash_attention():
        args += ["--attn_implementation", flash_attention()]
    if a.workload == "dpo":
        args += ["--loss_type", "dpo", "--beta", str(BETA), "--reference_cache_dir", os.path.join(out, "cache")]
    return args


def run_ours(a: argparse.Namespace, p: Preset) -> dict:
    from open_instruct import runtime

    stamps: list = []
    marks: dict[str, float] = {}
    original = runtime.RunContext.count_update

    def count_update(self: Any, *args: Any) -> None:  # once per optimizer step (SFT, RM, DPO)
        original(self, *args)
        stamp(stamps)

    runtime.RunContext.count_update = count_update
    args = ours_args(a, p)
    if a.workload == "sft":
        from open_instruct import sft

        sft.main(["--model_name_or_path", a.models["causal_lm"], *args])
    elif a.workload == "rm":
        from open_instruct import reward_model

        reward_model.main(["--model_name_or_path", a.models["seq_cls"], *args])
    elif a.workload == "dpo":
        from open_instruct import dpo, reference_cache

        original_tables = reference_cache.reference_tables

        def timed_tables(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = original_tables(*args, **kwargs)
            marks["reference_pass_s"] = time.perf_counter() - t0
            return out

        reference_cache.reference_tables = timed_tables
        dpo.main(["--model_name_or_path", a.models["causal_lm"], *args])
    else:
        return run_ours_grpo(a, p, args)
    return {"stamps": stamps, **marks}


GROUP = 8  # GRPO completions per prompt


def run_ours_grpo(a: argparse.Namespace, p: Preset, args: list[str]) -> dict:
    from open_instruct import rlvr_ppo, tracking

    stamps: list = []
    lengths_: list[float] = []
    original = tracking.MetricsLogger.log

    def log(self: Any, row: dict) -> None:  # one row per rollout (logging_steps 1), after its optimizer step
        original(self, row)
        if "train/response_length" in row:
            stamp(stamps)
            lengths_.append(row["train/response_length"])

    tracking.MetricsLogger.log = log
    rlvr_ppo.main(
        [
            "--model_name_or_path",
            a.models["causal_lm"],
            "--dataset_name_or_path",
            a.data,
            "--algo",
            "grpo",
            "--num_samples_per_prompt",
            str(GROUP),
            "--local_rollout_batch_size",
            str(p.grpo_prompts),
            "--per_device_train_batch_size",
            str(p.grpo_prompts * GROUP),
            "--total_episodes",
            str(p.steps * p.grpo_prompts * GROUP),
            "--num_epochs",
            "1",
            "--response_length",
            str(p.grpo_completion_tokens),
            "--max_prompt_length",
            str(p.grpo_prompt_tokens + 8),
            "--beta",
            "0.01",
            "--kl_estimator",
            "k3",
            "--temperature",
            "1.0",
            "--num_samples_logged",
            "0",
            *args,
        ]
    )
    return {"stamps": stamps, "completion_tokens": lengths_}


def trl_callback(stamps: list, completion_lengths: list) -> Any:
    """A TrainerCallback that stamps every optimizer step and keeps GRPO's logged mean completion length."""
    from transformers import TrainerCallback

    class Stamps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamp(stamps)

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
            if logs and "completions/mean_length" in logs:
                completion_lengths.append(logs["completions/mean_length"])

    return Stamps()


def trl_common(a: argparse.Namespace, p: Preset) -> dict:
    import torch

    return dict(
        output_dir=tempfile.mkdtemp(prefix=f"bench_{a.workload}_trl_"),
        per_device_train_batch_size=p.batch_size,
        gradient_accumulation_steps=1,
        max_steps=p.steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        bf16=a.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=p.steps,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=1,
    )


def in_our_order(rows: list[dict], order: list[int]) -> list[dict]:
    return [rows[i] for i in order]


def sequential(trainer: Any) -> None:
    """TRL's trainer reads its (already reordered) rows in order: the same batches as ours, step for step."""
    import torch

    trainer._get_train_sampler = lambda *args, **kwargs: torch.utils.data.SequentialSampler(trainer.train_dataset)


def run_trl(a: argparse.Namespace, p: Preset) -> dict:
    import datasets
    import torch

    from open_instruct.models import load_tokenizer

    stamps: list = []
    marks: dict[str, Any] = {"completion_tokens": []}
    callback = trl_callback(stamps, marks["completion_tokens"])
    tokenizer = load_tokenizer(a.models["causal_lm"])
    rows = in_our_order([json.loads(line) for line in open(a.data)], a.order) if a.workload != "grpo" else None
    dtype = torch.float32  # master weights fp32; bf16=True autocasts, as ours
    load = {"dtype": dtype, "attn_implementation": flash_attention()}
    if a.workload == "sft":
        from transformers import AutoModelForCausalLM
        from trl import SFTConfig, SFTTrainer

        train = datasets.Dataset.from_list(
            [{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows]
        )
        config = SFTConfig(**trl_common(a, p), max_length=None, padding_free=True)
        model = AutoModelForCausalLM.from_pretrained(a.models["causal_lm"], **load)
        trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
        check_sft_tokens(trainer, rows, tokenizer)
    elif a.workload == "rm":
        from transformers import AutoModelForSequenceClassification
        from trl import RewardConfig, RewardTrainer

        train = datasets.Dataset.from_list([{"chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
        config = RewardConfig(**trl_common(a, p), max_length=None, center_rewards_coefficient=None)
        model = AutoModelForSequenceClassification.from_pretrained(a.models["seq_cls"], num_labels=1, **load)
        model.config.pad_token_id = tokenizer.pad_token_id
        trainer = RewardTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    elif a.workload == "dpo":
        from transformers import AutoModelForCausalLM
        from trl import DPOConfig, DPOTrainer

        original = DPOTrainer._precompute_ref_logps

        def timed_precompute(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = original(self, *args, **kwargs)
            marks["reference_pass_s"] = marks.get("reference_pass_s", 0.0) + time.perf_counter() - t0
            return out

        DPOTrainer._precompute_ref_logps = timed_precompute
        train = datasets.Dataset.from_list([{"chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
        config = DPOConfig(
            **trl_common(a, p),
            max_length=None,
            beta=BETA,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            precompute_ref_batch_size=p.batch_size,
            disable_dropout=True,
        )
        model = AutoModelForCausalLM.from_pretrained(a.models["causal_lm"], **load)
        trainer = DPOTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    else:
        run_trl_grpo(a, p, callback)
        return {"stamps": stamps, **marks}
    sequential(trainer)
    trainer.add_callback(callback)
    trainer.train()
    return {"stamps": stamps, **marks}


def check_sft_tokens(trainer: Any, rows: list[dict], tokenizer: Any) -> None:
    """TRL's prompt + completion tokens and trained positions equal ours, row for row."""
    from open_instruct.data import tokenize_sft_messages

    for r, t in zip(rows, trainer.train_dataset):
        ids, labels = tokenize_sft_messages(tokenizer, r["messages"], r["id"])
        assert t["input_ids"] == ids and t["labels"] == labels, r["id"]


def run_trl_grpo(a: argparse.Namespace, p: Preset, callback: Any) -> None:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(a.data)]
    dataset = datasets.Dataset.from_list([{"prompt": r["messages"]} for r in rows])

    def reward(completions: list, **kwargs: Any) -> list[float]:  # a random model: every score 0 (ours likewise)
        return [0.0 for _ in completions]

    common = trl_common(a, p)
    common.update(per_device_train_batch_size=p.grpo_prompts * GROUP, logging_steps=1)
    config = GRPOConfig(
        **common,
        num_generations=GROUP,
        num_iterations=1,
        max_completion_length=p.grpo_completion_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.01,
        loss_type="dapo",
        disable_dropout=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        a.models["causal_lm"], dtype="float32", attn_implementation=flash_attention()
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(a.models["causal_lm"]),
        callbacks=[callback],
    )
    trainer.train()


def worker(a: argparse.Namespace) -> None:
    import torch

    p = PRESETS[a.preset]
    if a.threads:
        torch.set_num_threads(a.threads)
    a.models, a.order = json.loads(a.models), json.loads(a.order) if a.order else None
    gpu = torch.cuda.is_available()
    peaks = {} if gpu else {k: gemm_peak(p, k) for k in ("no", "bf16")}
    result = run_ours(a, p) if a.variant.startswith("ours") else run_trl(a, p)
    if not gpu:  # the peak right after training too: the better of the two
        peaks = {k: max(v, gemm_peak(p, k)) for k, v in peaks.items()}
    result["gemm_peak"] = peaks
    result["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20 if gpu else rss_mb("VmHWM")
    print_result(result)


# ---------------------------------------------------------------------------------------------------------------------
# Driver


def our_order(n: int) -> list[int]:
    """The order our scripts consume n examples in (seed 1, one epoch)."""
    from open_instruct.data import EpisodeStream

    return EpisodeStream(n, 1).take(0, n)


def example_tokens(workload: str, rows: list[dict], tokenizer: Any) -> list[int]:
    """Real tokens per example: the conversation (SFT), chosen + rejected (RM, DPO)."""
    from open_instruct.data import chat_ids

    if workload == "sft":
        return [len(chat_ids(tokenizer, r["messages"])) for r in rows]
    return [len(chat_ids(tokenizer, r["chosen"])) + len(chat_ids(tokenizer, r["rejected"])) for r in rows]


def spawn(kind: str, workload: str, data: str, models: dict, order: Optional[list], a: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--workload", workload, "--data", data]
    cmd += ["--models", json.dumps(models), "--order", json.dumps(order) if order else ""]
    cmd += ["--preset", a.preset, "--precision", a.precision, "--threads", str(a.threads)]
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    return run_worker(cmd, env, f"{kind} {workload}")


def summarize(raw: dict, workload: str, per_step_tokens: list[int], p: Preset, a: argparse.Namespace, n: int) -> dict:
    """tokens/s, pairs/s, CPU s/step, MFU of one worker's result over the timed steps."""
    stamps = raw["stamps"]
    if len(stamps) != p.steps:
        raise SystemExit(f"{workload}: {len(stamps)} step stamps, expected {p.steps}")
    (t0, c0), (t1, c1) = stamps[p.warmup - 1], stamps[-1]
    steps = p.steps - p.warmup
    episodes = steps * (p.grpo_prompts * GROUP if workload == "grpo" else p.batch_size)
    if workload == "grpo":  # prompt + completion tokens trained per step (completion lengths as each trainer logged)
        completion = statistics.mean(raw["completion_tokens"][p.warmup :] or raw["completion_tokens"])
        tokens = episodes * (p.grpo_prompt_tokens + completion)
    else:
        tokens = sum(per_step_tokens[p.warmup : p.steps])
    wall, cpu = t1 - t0, c1 - c0
    out = {
        "tokens_per_second": tokens / wall,
        "episodes_per_second": episodes / wall,
        "cpu_s_per_step": cpu / steps,
        "peak_memory_mb": raw["peak_memory_mb"],
        "reference_pass_s": raw.get("reference_pass_s"),
    }
    peak = a.gpu_peak if a.gpu_peak else raw["gemm_peak"].get(a.precision)
    out["mfu"] = mfu(n, out["tokens_per_second"], peak)
    out["peak_flops"] = peak
    if raw.get("gemm_peak"):
        out["mfu_vs_fp32_peak"] = mfu(n, out["tokens_per_second"], raw["gemm_peak"]["no"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--workloads", nargs="+", choices=["sft", "rm", "dpo", "grpo"], default=None)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--precision", choices=["no", "bf16"], default=None, help="default: the preset's")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write every run's numbers to this file")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--models", help=argparse.SUPPRESS)
    parser.add_argument("--order", help=argparse.SUPPRESS)
    a = parser.parse_args()
    p = PRESETS[a.preset]
    a.precision = a.precision or p.precision
    a.threads = p.threads if a.threads is None else a.threads
    if a.worker:
        a.variant = a.worker
        return worker(a)
    run(a, p)


def run(a: argparse.Namespace, p: Preset) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from demo.synthetic import write_jsonl
    from open_instruct.models import load_tokenizer

    workloads = a.workloads or list(p.workloads)
    variants = [v for v in a.variants if v != "ours_packed" or has_packing()]
    work = a.workdir or tempfile.mkdtemp(prefix="bench_throughput_")
    models = build_models(os.path.join(work, "models"), p)
    tokenizer = load_tokenizer(models["causal_lm"])
    n_params = {
        "causal_lm": flops_params(AutoModelForCausalLM.from_pretrained(models["causal_lm"])),
        "seq_cls": flops_params(AutoModelForSequenceClassification.from_pretrained(models["seq_cls"])),
    }
    a.gpu_peak, device = None, f"CPU, {a.threads or torch.get_num_threads()} torch thread(s)"
    if torch.cuda.is_available():
        name, a.gpu_peak = gpu_peak()
        device = f"{name} (peak bf16 {a.gpu_peak / 1e12:.0f} TFLOP/s)" if a.gpu_peak else f"{name} (peak unknown)"
    n_examples = p.steps * p.batch_size
    print(
        f"{a.preset}: Llama hidden {p.hidden}, {p.layers} layers, vocab {p.vocab}: "
        f"N = {n_params['causal_lm'] / 1e6:.1f}M (without the input embedding); {device}; precision {a.precision}; "
        f"{p.steps} steps of {p.batch_size} (timed after {p.warmup}); lengths 32..{p.max_length} (log-normal, "
        f"median {p.median_length}); load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    if "ours_packed" not in variants and "ours_packed" in a.variants:
        print(f"  (ours_packed skipped: this checkout's config has no {PACKING_KNOB})")
    results: dict[str, dict[str, list[dict]]] = {}
    for workload in workloads:
        if workload == "sft":
            rows = sft_rows(n_examples, 0, p.median_length, p.max_length)
        elif workload == "grpo":
            rows = rl_rows(n_examples, 0, p.grpo_prompt_tokens)
        else:
            rows = preference_rows(n_examples, 0, p.median_length, p.max_length)
        data = write_jsonl(os.path.join(work, f"{workload}.jsonl"), rows)
        order = our_order(len(rows)) if workload != "grpo" else None
        per_step: list[int] = []
        if order is not None:
            tokens = example_tokens(workload, rows, tokenizer)
            ordered = [tokens[i] for i in order]
            per_step = [sum(ordered[s * p.batch_size : (s + 1) * p.batch_size]) for s in range(p.steps)]
        n = n_params["seq_cls" if workload == "rm" else "causal_lm"]
        kinds = [v for v in variants if workload != "grpo" or v != "ours_packed"]
        results[workload] = {k: [] for k in kinds}
        for _ in range(a.repeats):
            for kind in kinds:
                raw = spawn(kind, workload, data, models, order, a)
                r = summarize(raw, workload, per_step, p, a, n)
                results[workload][kind].append(r)
                print(f"  {workload:>4} {kind:>11}: {line(r, workload)}", flush=True)
    report(results, a, p)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": dataclasses.asdict(p), "precision": a.precision, "results": results}, f, indent=1)
    return results


def line(r: dict, workload: str) -> str:
    unit = "pairs/s" if workload in ("rm", "dpo") else "episodes/s"
    mfu_ = f"MFU {100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "MFU n/a"
    ref = f", reference pass {r['reference_pass_s']:.1f}s" if r.get("reference_pass_s") else ""
    return (
        f"{r['tokens_per_second']:9.0f} tokens/s, {r['episodes_per_second']:7.2f} {unit}, "
        f"CPU {r['cpu_s_per_step']:6.2f} s/step, {mfu_}, peak memory {r['peak_memory_mb']:6.0f} MB{ref}"
    )


def report(results: dict, a: argparse.Namespace, p: Preset) -> None:
    print(
        "\nMedians over repeats. ratio = ours tokens/s over TRL's in the same repeat (median); memory = peak "
        "resident set (CPU) or peak allocated (GPU)."
    )
    print(f"{'workload':<9}{'variant':<13}{'tokens/s':>10}{'MFU':>8}{'CPU s/step':>12}{'memory MB':>11}{'vs TRL':>9}")
    for workload, by_kind in results.items():
        for kind, runs in by_kind.items():
            med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
            ratio = ""
            if kind != "trl" and "trl" in by_kind:
                ratios = [o["tokens_per_second"] / t["tokens_per_second"] for o, t in zip(runs, by_kind["trl"])]
                ratio = f"{statistics.median(ratios):.2f}x"
            mfus = [r["mfu"] for r in runs if r["mfu"] is not None]
            mfu_ = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"
            print(
                f"{workload:<9}{kind:<13}{med('tokens_per_second'):>10.0f}{mfu_:>8}{med('cpu_s_per_step'):>12.2f}"
                f"{med('peak_memory_mb'):>11.0f}{ratio:>9}"
            )


if __name__ == "__main__":
    main()
