"""What a run prints for the researcher watching it: a start-up summary in words, the progress bar's metrics, one
compact line per evaluation, and an end-of-run summary. Pure functions of the config, the batch plan and the
logged rows (tracking.py and runtime.py print them); no torch.

    dpo: output/dpo_tiny  (model output/sft_tiny/final_model; 1 process, fp32; loss dpo, beta 0.5)
      data   2000/2000 rows kept: 0 bad, 0 dropped as over-long, 0 truncated, 0 duplicate ids; 200 held-out pairs
      batch  16 x 2 accumulation x 1 process = 32 pairs per optimizer step; 62 steps (1 epoch of 2,000)
      run    eval every 20 steps and at the end; best_model/ by eval/rewards/accuracy (max); checkpoint every ...
    eval @ step 20: acc 0.51 | margin 0.09981 | loss 0.6792
    train: 100%|██████████| 62/62 [00:20<00:00,  3.07step/s, loss=0.6706, acc=0.5, margin=0.2068]
    done: 62 optimizer steps, 1,984 episodes in 20 s; 262,542 tokens trained (13,015/s)
      eval/rewards/accuracy: final 0.59 (step 62), best 0.59 at step 60 -> output/dpo_tiny/best_model

(docs/running.md#what-a-run-prints has whole runs)."""

from __future__ import annotations

import math
from typing import Any, Optional

# Progress bar: the step's key numbers, as they appear in the train rows of each script (absent keys are skipped).
BAR_METRICS: tuple[tuple[str, str], ...] = (
    ("train/loss", "loss"),
    ("train/accuracy", "acc"),  # reward model
    ("train/rewards/accuracy", "acc"),  # DPO
    ("train/margin", "margin"),  # reward model
    ("train/rewards/margin", "margin"),  # DPO
    ("train/correct_rate", "correct"),  # RL
    ("train/score_mean", "score"),
    ("train/kl", "kl"),
    ("perf/mfu", "mfu"),  # GPU only (gpu_stats.StepGPUStats)
    ("gpu/peak_allocated_gb", "mem GB"),
)

# An eval line's metrics, headline first (absent keys are skipped); per-source values of the first one follow.
EVAL_METRICS: tuple[tuple[str, str], ...] = (
    ("eval/correct_rate", "correct"),  # RL
    ("eval/accuracy", "acc"),  # reward model
    ("eval/rewards/accuracy", "acc"),  # DPO
    ("eval/margin", "margin"),
    ("eval/rewards/margin", "margin"),
    ("eval/score_mean", "score"),
    ("eval/response_length", "length"),
    ("eval/loss", "loss"),
    ("eval/perplexity", "ppl"),
)

# The metric an end-of-run summary reports when the recipe names no best_metric.
DEFAULT_HEADLINE = {
    "sft": ("eval/loss", "min"),
    "reward_model": ("eval/accuracy", "max"),
    "dpo": ("eval/rewards/accuracy", "max"),
    "rlvr_ppo": ("eval/correct_rate", "max"),
}


def number(value: Any) -> str:
    """4 significant digits, thousands separated for large counts; anything else as is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) >= 1000):
        return f"{int(value):,}"
    return f"{value:.4g}"


def duration(seconds: float) -> str:
    """41 s, 3 min 20 s, 2 h 05 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def bar_postfix(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's postfix for a train row: {label: value} of BAR_METRICS present in it, and after the score
    that drives training each reward function's mean (`reward/<function>/mean`). In a run driven by reward functions
    the verifiers' `correct` is left out while it is 0 (rows with no verifier are never "correct")."""
    functions = {key[len("reward/") : -len("/mean")]: row[key] for key in row if _is_function_mean(key)}
    shown: dict[str, str] = {}
    for key, label in BAR_METRICS:
        if key not in row or (functions and key == "train/correct_rate" and not row[key]):
            continue
        shown[label] = number(row[key])
        if key == "train/score_mean":
            shown.update({name: number(value) for name, value in functions.items()})
    return shown


def _is_function_mean(key: str) -> bool:
    return key.startswith("reward/") and key.endswith("/mean")


def eval_line(row: dict[str, Any], counter: str = "optimizer_step") -> Optional[str]:
    """One compact line for an eval row (None for other rows): `eval @ step 20: acc 0.835 | margin 1.21 | ...`,
    then the headline metric per source when the held-out set mixes sources."""
    shown = [(key, label) for key, label in EVAL_METRICS if key in row]
    if not shown:
        return None
    parts = [f"{label} {number(row[key])}" for key, label in shown]
    headline = shown[0][0].split("/", 1)[1]  # e.g. correct_rate, rewards/accuracy
    known = {key for key, _ in EVAL_METRICS}
    for key in row:
        if key.startswith("eval/") and key not in known and key.endswith("/" + headline):
            source = key[len("eval/") : -len(headline) - 1]
            parts.append(f"{source} {number(row[key])}")
    where = "rollout" if counter == "rollout_step" else "step"
    return f"eval @ {where} {row.get(counter, '?')}: " + " | ".join(parts)


def _precision(cfg: Any) -> str:
    text = {"no": "fp32", "bf16": "bf16 (fp32 master weights)", "fp16": "fp16"}.get(cfg.mixed_precision, "")
    if getattr(cfg, "use_lora", False):
        text += f", LoRA r{cfg.lora_rank}"
    return text


def _algorithm(cfg: Any) -> str:
    if cfg.script == "dpo":
        return f"; loss {cfg.loss_type}, beta {number(cfg.beta)}"
    if cfg.script == "rlvr_ppo":
        variants = f"{cfg.advantage_estimator} advantages, {cfg.policy_loss} loss"
        if cfg.kl_estimator != "k1":
            variants += f", {cfg.kl_estimator} KL"
        return f"; {cfg.algo} ({variants}), generation {cfg.generation_backend}"
    return ""


def startup_summary(cfg: Any, plan: Any, data_summary: str, num_eval: int) -> str:
    """The plain start-up lines: what runs where, the data, the batch layout and the run's schedule."""
    world = plan.world_size
    procs = f"{world} process{'es' if world > 1 else ''}"
    unit = {"sft": "examples", "reward_model": "pairs", "dpo": "pairs", "rlvr_ppo": "completions"}.get(cfg.script)
    held_out = {"rlvr_ppo": "prompts", "sft": "examples"}.get(cfg.script, "pairs")
    what = f"{procs}, {_precision(cfg)}{_algorithm(cfg)}"
    lines = [
        f"{cfg.script}: {cfg.output_dir}  (model {cfg.model_name_or_path}; {what})",
        f"  data   {data_summary}; {num_eval:,} held-out {held_out}",
    ]
    micro = f"{plan.per_device_train_batch_size} x {plan.gradient_accumulation_steps} accumulation x {procs}"
    if plan.is_rl:
        lines.append(
            f"  batch  {plan.rollout_batch_size:,} prompts x {plan.num_samples_per_prompt} = "
            f"{plan.episodes_per_rollout:,} completions per rollout; {plan.num_epochs} epoch(s) x "
            f"{plan.num_mini_batches} mini-batch(es) of {micro} = {plan.mini_batch_size:,}; "
            f"{plan.num_training_steps:,} rollouts, {plan.optimizer_steps:,} optimizer steps "
            f"({plan.total_episodes:,} completions)"
        )
    else:
        plural = "" if plan.num_train_epochs == 1 else "s"
        epochs = f"{number(plan.num_train_epochs)} epoch{plural} of {plan.num_examples:,}" if plan.num_examples else ""
        lines.append(
            f"  batch  {micro} = {plan.mini_batch_size:,} {unit} per optimizer step; "
            f"{plan.optimizer_steps:,} steps ({epochs})"
        )
    step = "rollouts" if plan.is_rl else "steps"
    schedule = []
    if cfg.eval_steps and num_eval:
        schedule.append(f"eval every {cfg.eval_steps} {step} and at the end")
        if cfg.best_metric:
            schedule.append(f"best_model/ by {cfg.best_metric} ({cfg.best_metric_mode})")
    else:
        schedule.append("no eval")
    if cfg.checkpointing_steps:
        schedule.append(f"checkpoint every {cfg.checkpointing_steps} {step} (last {cfg.keep_last_n_checkpoints} kept)")
    schedule.append(f"metrics.jsonl{' + wandb' if cfg.with_tracking else ''}")
    lines.append("  run    " + "; ".join(schedule))
    return "\n".join(lines)


def end_summary(
    cfg: Any,
    rows: list[dict[str, Any]],
    counters: dict[str, Any],
    counter: str,
    seconds: float,
    tokens: float,
    token_kind: str,
    best_value: Optional[float],
    final_model: Optional[str],
) -> str:
    """The end-of-run lines: steps and time, tokens/s, the final and best value of the run's metric (best_metric,
    else the script's headline eval metric) with the step it came from, and where the models are."""
    import os

    step_word, at_word = ("rollouts", "rollout") if counter == "rollout_step" else ("optimizer steps", "step")
    rate = tokens / seconds if seconds > 0 else 0.0
    lines = [
        f"done: {counters.get(counter, 0):,} {step_word}, {counters.get('episode', 0):,} episodes in "
        f"{duration(seconds)}; {number(int(tokens))} {token_kind} ({number(round(rate))}/s)"
    ]
    metric, mode = (cfg.best_metric, cfg.best_metric_mode) if cfg.best_metric else DEFAULT_HEADLINE[cfg.script]
    evals = [r for r in rows if isinstance(r.get(metric), (int, float))]
    if evals:
        final = evals[-1]
        text = f"  {metric}: final {number(final[metric])} ({at_word} {final.get(counter, '?')})"
        if best_value is None:
            pick = max if mode == "max" else min
            best_value = pick(r[metric] for r in evals)
        # the first eval that reached it, after the step-0 baseline (which does not pick best_model) when one did
        ties = [r for r in evals if r[metric] == best_value]
        best_row = next((r for r in ties if r.get(counter)), ties[0] if ties else None)
        at = f" at {at_word} {best_row.get(counter, '?')}" if best_row is not None else ""
        text += f", best {number(best_value)}{at}"
        if cfg.best_metric:
            text += f" -> {os.path.join(cfg.output_dir, 'best_model')}"
        lines.append(text)
    if final_model:
        lines.append(f"  final_model: {final_model}")
    lines.append(f"  metrics: {os.path.join(cfg.output_dir, 'metrics.jsonl')}")
    return "\n".join(lines)
