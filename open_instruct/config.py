"""Configuration: one dataclass per script, read from a YAML recipe plus `--key value` overrides.

    python open_instruct/dpo.py configs/dpo_8b.yaml --learning_rate 1e-6

The recipe's values and the `--key value` overrides are merged key by key (the last value wins), then every scalar
goes through transformers' HfArgumentParser as `--key=value` (its type checks and choices; a value may start with
'-'), and list values are converted by their element type. Unknown keys, wrong types and invalid values stop the
run with exit status 2 and a message naming the key, before torch or any model is imported. Each setting is declared
once (`setting`: its topic, how a resume treats it, what it loads); `--help`, the saved config.yaml and
docs/running.md#settings-by-topic group the settings by topic.
This module imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Sequence, TypeVar

import yaml

from open_instruct import flag_names, integrations, rl_algorithms
from open_instruct.batch_math import (
    BatchPlan,
    check_token_budget,
    rl_batch_plan,
    supervised_batch_plan,
    trl_rollout_batch_size,
)
from open_instruct.errors import ConfigError
from open_instruct.mixture import parse_mixer_list, source_labels
from open_instruct.rl_algorithms import ADVANTAGE_ESTIMATORS, ALGO_ESTIMATORS, POLICY_LOSSES, AdvantageEstimator

T = TypeVar("T")


# Every setting is declared once, as a field of its script's dataclass made by `setting` below: its type, default and
# --help text, its topic, how a resume treats it and what it loads. The topics' order is the order of `--help`, of the
# saved config.yaml (a comment heads each group, the keys stay one flat mapping) and of docs/running.md's table.
TOPICS: dict[str, str] = {
    "run": "which script, where its files go, the layout a dry run plans",
    "model": "what is loaded and how it runs",
    "data": "train and held-out rows, their columns and lengths",
    "batch": "samples per step and run length (docs/batch-math.md)",
    "optimizer": "AdamW and its schedule",
    "algorithm": "the loss and, for RL, the advantages, KL and distillation (docs/algorithms.md)",
    "generation": "sampling and the engines that sample",
    "rewards": "how a completion is scored",
    "environments": "multi-turn episodes and tools (docs/multi-turn.md)",
    "checks": "what stops or warns during a run (docs/trusted-generation.md)",
    "checkpointing": "checkpoints, resumes and the models written",
    "logging": "metrics, evaluation and samples",
}
# How a resume treats a setting (checkpoint.check_resume_compatible, before any model loads).
RESUME_KINDS: dict[str, str] = {
    "structural": "refused, and --allow_resume_changes cannot accept it: the saved state would not load",
    "must_match": "refused unless --allow_resume_changes names it: it changes what is trained",
    "batch_layout": "accepted while the global batch it makes (mini_batch_size, rollout_batch_size) stays the same",
    "may_change": "accepted: where files go, logging, limits and timeouts, how the same computation runs",
}
# What a setting names for the run to load again on resume, compared by content (checkpoint.input_identity): the
# weight files of a local model folder, or the file of the user's code a `file.py:name` / `module:name` spec names
# (and the weight folders that code's object declares in its `weight_folders`, e.g. a judge's local_model).
LOADS = ("weights", "code")
USER_CODE_CONTENT = "user_code_content"  # the resume key of every "code" setting's files


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    topic: str,
    resume: str,
    loads: Optional[str] = None,
    content_key: Optional[str] = None,
    per_row: bool = False,
    note: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field and everything said about it: its --help text (every option has one; tests/test_bad_inputs.py
    checks), its topic (TOPICS), how a resume treats it (RESUME_KINDS; `note` says in a refusal what it decides),
    and, for a setting that names weights or code loaded again on resume, `loads` (LOADS) with the resume key that
    accepts a change of their content (`content_key`; "code": user_code_content); `per_row`: the training rows may
    name their own in a column of the setting's name (a row's wins), and those are loaded too."""
    if topic not in TOPICS or resume not in RESUME_KINDS or (loads is not None and loads not in LOADS):
        raise ValueError(f"setting: topic {topic!r}, resume {resume!r}, loads {loads!r} must be in the tables")
    if loads == "weights" and not content_key:
        raise ValueError("setting: a setting that loads weights names the resume key of their content")
    metadata = {"help": help, "topic": topic, "resume": resume, "loads": loads, "per_row": per_row, "note": note}
    metadata["content_key"] = USER_CODE_CONTENT if loads == "code" else content_key
    return field(default=default, default_factory=default_factory, metadata=metadata)


def restated(name: str, default: Any = dataclasses.MISSING, **changes: Any) -> Any:
    """BaseConfig's setting `name` declared again in a script's dataclass with another default and/or another part
    of its declaration (help=, resume=, loads= ...): the rest stays as BaseConfig says."""
    (base,) = [f for f in dataclasses.fields(BaseConfig) if f.name == name]
    declared = {k: v for k, v in base.metadata.items() if k != "content_key" or base.metadata["loads"] == "weights"}
    if default is dataclasses.MISSING and base.default_factory is dataclasses.MISSING:
        default = base.default
    return setting(default, **{**declared, **changes})


@dataclass
class BaseConfig:
    """Knobs every script shares. Batch terms follow the glossary in open_instruct/batch_math.py."""

    # The eval metric names the script logs (best_metric must be one of them); set per script.
    eval_metrics: ClassVar[tuple[str, ...]] = ()
    # Those of them also logged per source (eval/<source>/...) when the held-out set mixes sources.
    per_source_eval_metrics: ClassVar[tuple[str, ...]] = ()

    # --- what runs
    script: str = setting(
        "", "Which script this recipe is for (sft, reward_model, dpo, rlvr_ppo).", topic="run", resume="structural"
    )
    exp_name: str = setting("run", "Run name (wandb).", topic="run", resume="may_change")
    output_dir: str = setting(
        "output/run",
        "Folder of this run: metrics.jsonl, checkpoints/, best_model/, final_model/.",
        topic="run",
        resume="may_change",
    )
    overwrite_output_dir: bool = setting(
        False,
        "Start a new run in an output_dir that holds another run (else such a folder is refused), once every start "
        "check has passed: a finished run (final_model/) is moved aside to <output_dir>.replaced-<time>, an "
        "unfinished one deleted. Command line only: a recipe (or a saved config.yaml) cannot set it.",
        topic="run",
        resume="may_change",
    )
    delete_finished_run: bool = setting(
        False,
        "With overwrite_output_dir: delete a finished run's files instead of moving them aside. Command line only.",
        topic="run",
        resume="may_change",
    )
    seed: int = setting(
        1,
        "Random seed: data order, sampling and freshly initialised heads.",
        topic="run",
        resume="must_match",
        note="the data order",
    )
    dry_run: bool = setting(
        False,
        "Run every start check that needs no model (paths, first data rows, reward functions, memory), print the "
        "plan and exit: 0 if a real start would get past them, else 2 with the same message.",
        topic="run",
        resume="may_change",
    )
    gpu: Optional[str] = setting(
        None,
        "GPU the memory check judges a layout on (a name of the planner's table, e.g. H100, A100, H200); unset: "
        "this machine's (H100 where a GPU is present, the CPU otherwise). With gpu_memory_gb alone: H100. A planner "
        "setting: a real start on a machine without a GPU says so and judges its CPU.",
        topic="run",
        resume="may_change",
    )
    gpu_memory_gb: Optional[float] = setting(
        None,
        "Memory of one training GPU for the memory check, in GB; unset: the gpu's (H100: 80).",
        topic="run",
        resume="may_change",
    )
    num_processes: Optional[int] = setting(
        None,
        "Training processes a --dry_run plans for (the launcher's --num_processes); unset: WORLD_SIZE of the "
        "launch, else 1. A real start takes the launcher's world size and refuses a different one.",
        topic="run",
        resume="may_change",
    )

    # --- model
    model_name_or_path: str = setting(
        "", "Hub model name or local model folder (with config.json) to start from.", topic="model", resume="may_change"
    )
    tokenizer_name_or_path: Optional[str] = setting(
        None, "Tokenizer to use (default: the model's).", topic="model", resume="must_match"
    )
    model_revision: Optional[str] = setting(
        None, "Hub revision (branch, tag or commit) of the model.", topic="model", resume="may_change"
    )
    gguf_file: Optional[str] = setting(
        None, "Load weights from this GGUF file in the model folder.", topic="model", resume="may_change"
    )
    trust_remote_code: bool = setting(
        False,
        "Allow model code from the hub to run (off: only transformers' own code).",
        topic="model",
        resume="may_change",
    )
    chat_template: Optional[str] = setting(
        None,
        "Chat template replacing the tokenizer's: a name (tulu, chatml, zephyr, llama-3), a path to a Jinja file, "
        "or Jinja text (open_instruct/chat_templates.py).",
        topic="model",
        resume="must_match",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = setting(
        "no", "Compute precision (master weights stay fp32).", topic="model", resume="must_match"
    )
    attn_implementation: Optional[Literal["sdpa", "sdpa_varlen", "eager", "flash_attention_2"]] = setting(
        None,
        "Attention kernel of every model loaded (transformers' attn_implementation); unset: sdpa_varlen with packing "
        "(sdpa one packed sequence at a time, open_instruct/attention.py), else transformers' default (sdpa). "
        "flash_attention_2 (GPU, flash-attn installed) runs packed rows with its varlen kernel.",
        topic="model",
        resume="may_change",
    )
    activation_checkpointing: bool = setting(
        False, "Recompute activations in the backward pass to save memory.", topic="model", resume="may_change"
    )
    fsdp_cpu_offload: bool = setting(
        False,
        "Under FSDP: keep parameters, gradients and optimizer state in host memory.",
        topic="model",
        resume="may_change",
    )
    distributed_timeout_minutes: float = setting(
        60.0,
        "Minutes a collective (NCCL/gloo) may wait for the slowest rank before the run fails; rank 0 alone may spend "
        "long stretches starting engines or writing a full model while the others wait (torch's default is 10).",
        topic="model",
        resume="may_change",
    )

    # --- LoRA (peft; open_instruct/lora.py)
    use_lora: bool = setting(
        False,
        "Train LoRA adapters (peft) instead of all weights: the trained model (the RL policy and PPO "
        "value model too) gets low-rank adapters, a scalar head stays fully trained.",
        topic="model",
        resume="structural",
        note="adapters or the whole model in the saved state",
    )
    lora_rank: int = setting(16, "LoRA rank r.", topic="model", resume="structural", note="the saved adapters' shapes")
    lora_alpha: float = setting(
        32.0,
        "LoRA alpha: the update B@A is scaled by alpha / r.",
        topic="model",
        resume="must_match",
        note="the adapters' scale alpha / r",
    )
    lora_dropout: float = setting(
        0.0,
        "Dropout on the LoRA input (DPO and RL turn all dropout off, this one too).",
        topic="model",
        resume="must_match",
    )
    lora_target_modules: Optional[list[str]] = setting(
        None,
        "Module names to adapt (e.g. q_proj v_proj); unset: every linear layer but the output head.",
        topic="model",
        resume="structural",
        note="the saved adapters' shapes",
    )
    lora_save: Literal["merged", "adapter"] = setting(
        "merged",
        "final_model/ and best_model/ hold the merged model (plain HF format, no peft needed) or only "
        "the adapter (load with peft).",
        topic="model",
        resume="may_change",
    )

    # --- data
    dataset_name_or_path: str = setting(
        "",
        "Hub dataset name, or local .jsonl/.json/.parquet file(s), comma separated. Or use dataset_mixer_list.",
        topic="data",
        resume="must_match",
    )
    dataset_mixer_list: Optional[list[str]] = setting(
        None,
        "A mixture instead of dataset_name_or_path: source, amount, source, amount, ... An amount with a decimal "
        "point is a fraction of that source (1.0 = all rows), an integer >= 2 a row count (above the size: repeats). "
        "Rows are drawn from the seed; see open_instruct/mixture.py.",
        topic="data",
        resume="must_match",
    )
    dataset_split: str = setting("train", "Split of a hub training dataset.", topic="data", resume="must_match")
    eval_dataset_name_or_path: Optional[str] = setting(
        None, "Held-out dataset (same forms as dataset_name_or_path).", topic="data", resume="may_change"
    )
    eval_dataset_mixer_list: Optional[list[str]] = setting(
        None, "The held-out set as a mixture (same form as dataset_mixer_list).", topic="data", resume="may_change"
    )
    eval_dataset_split: str = setting("test", "Split of a hub eval dataset.", topic="data", resume="may_change")
    eval_fraction: float = setting(
        0.0,
        "Hold out this fraction of the train set for eval (only when no eval dataset is given).",
        topic="data",
        resume="must_match",
    )
    train_order: Literal["shuffled", "as_written"] = setting(
        "shuffled",
        "The order training rows are consumed in: shuffled (each epoch a permutation drawn from the seed) or "
        "as_written (the file's order, every epoch: a curriculum written into the data, e.g. easy rows first).",
        topic="data",
        resume="must_match",
    )
    max_train_samples: Optional[int] = setting(
        None, "Use only the first N training rows.", topic="data", resume="must_match", note="the data order"
    )
    max_eval_samples: Optional[int] = setting(
        None, "Use only the first N held-out rows.", topic="data", resume="may_change"
    )
    max_seq_length: int = setting(
        2048, "Longest tokenized example kept (see overlong).", topic="data", resume="must_match"
    )
    overlong: Literal["drop", "truncate"] = setting(
        "drop", "What to do with examples longer than max_seq_length.", topic="data", resume="must_match"
    )
    skip_bad_rows: bool = setting(
        False,
        "Skip (and count) malformed rows instead of stopping with the file and row.",
        topic="data",
        resume="must_match",
    )
    string_rows: Literal["raw", "chat_template"] = setting(
        "raw",
        "Rows whose prompt/completion/chosen/rejected are strings: raw (TRL's convention: prompt + completion "
        "concatenated as written, EOS appended, no template) or chat_template (the prompt becomes a user turn, the "
        "completion an assistant turn, rendered with the chat template). Message lists always use the template.",
        topic="data",
        resume="must_match",
    )
    dataset_num_proc: Optional[int] = setting(
        None,
        "Processes tokenizing the data (forked workers); unset: the CPU count (at most 16) from 10k rows.",
        topic="data",
        resume="may_change",
    )
    dataset_cache_dir: Optional[str] = setting(
        None,
        "Folder of the tokenized-data cache, keyed by data + tokenizer + template + lengths + code version, reused "
        "by later runs and resumes; unset: $OPEN_INSTRUCT_DATA_CACHE or ~/.cache/open_instruct/tokenized; 'none': "
        "no cache.",
        topic="data",
        resume="may_change",
    )

    # --- optimisation
    learning_rate: float = setting(1e-5, "Peak AdamW learning rate.", topic="optimizer", resume="must_match")
    lr_scheduler_type: Literal["linear", "constant", "cosine", "constant_with_warmup"] = setting(
        "linear", "Learning-rate schedule over the run.", topic="optimizer", resume="must_match"
    )
    warmup_ratio: float = setting(
        0.0,
        "Fraction of the optimizer steps spent warming up the learning rate.",
        topic="optimizer",
        resume="must_match",
    )
    weight_decay: float = setting(
        0.0, "AdamW weight decay (not on biases and norms).", topic="optimizer", resume="must_match"
    )
    adam_beta1: float = setting(0.9, "AdamW beta1.", topic="optimizer", resume="must_match")
    adam_beta2: float = setting(0.999, "AdamW beta2.", topic="optimizer", resume="must_match")
    adam_epsilon: float = setting(1e-8, "AdamW epsilon (>= 0).", topic="optimizer", resume="must_match")
    max_grad_norm: float = setting(
        1.0, "Clip the global gradient norm to this.", topic="optimizer", resume="must_match"
    )
    per_device_train_batch_size: int = setting(
        1, "Micro batch: samples per forward/backward on one device.", topic="batch", resume="batch_layout"
    )
    gradient_accumulation_steps: int = setting(
        1, "Micro batches per optimizer step on one device.", topic="batch", resume="batch_layout"
    )
    per_device_eval_batch_size: int = setting(
        8, "Samples per eval forward on one device.", topic="batch", resume="may_change"
    )
    max_tokens_per_micro_batch: Optional[int] = setting(
        None,
        "Padding-free packing: every forward/backward (and eval, reference and scoring forward) takes ONE row per "
        "device of whole sequences concatenated up to this many tokens, attention kept inside each sequence. The "
        "samples per optimizer step stay per_device_train_batch_size x gradient_accumulation_steps per device; the "
        "split into micro-batches is by tokens. Must hold the longest sequence (a preference pair: both). Unset or 0: "
        "off (padded micro-batches of per_device_train_batch_size rows).",
        topic="batch",
        resume="may_change",
    )
    num_train_epochs: float = setting(
        1.0,
        "Passes over the training data (SFT/RM/DPO, when total_episodes is unset).",
        topic="batch",
        resume="must_match",
    )
    total_episodes: Optional[int] = setting(
        None, "Samples to train on (RL: completions; required there).", topic="batch", resume="must_match"
    )
    on_nonfinite: Literal["stop", "skip"] = setting(
        "stop",
        "On a NaN/inf loss or gradient: stop the run (exit 3), or skip that update.",
        topic="checks",
        resume="may_change",
    )

    # --- logging, eval, checkpoints
    logging_steps: int = setting(
        1, "Log a metrics row every N optimizer steps (RL: rollouts).", topic="logging", resume="may_change"
    )
    peak_tflops: Optional[float] = setting(
        None,
        "Dense bf16 TFLOP/s of one GPU, the denominator of perf/mfu (default: the published peak of the detected "
        "H100 SXM/PCIe/NVL, H200, A100 ...; none known: no perf/mfu).",
        topic="logging",
        resume="may_change",
    )
    eval_steps: Optional[int] = setting(
        None, "Evaluate every N steps (and at the first and last step).", topic="logging", resume="may_change"
    )
    checkpointing_steps: Optional[int] = setting(
        None, "Write a checkpoint every N steps (RL: rollouts).", topic="checkpointing", resume="may_change"
    )
    keep_last_n_checkpoints: int = setting(
        2, "How many checkpoints to keep.", topic="checkpointing", resume="may_change"
    )
    best_metric: Optional[str] = setting(
        None,
        "Eval metric that picks best_model/ (one of the script's eval metrics).",
        topic="checkpointing",
        resume="may_change",
    )
    best_metric_mode: Literal["max", "min"] = setting(
        "max", "Whether a higher or lower best_metric is better.", topic="checkpointing", resume="may_change"
    )
    resume_from_checkpoint: Optional[str] = setting(
        None,
        "'auto' (this output_dir's run: its latest valid checkpoint) or a checkpoint path.",
        topic="checkpointing",
        resume="may_change",
    )
    allow_resume_changes: Optional[list[str]] = setting(
        None,
        "Resume keys whose change from the checkpoint a resume accepts (e.g. num_train_epochs learning_rate "
        "dataset_content user_code_content teacher_weights reference_weights reward_model_weights); any other "
        "difference (docs/reliability.md: the settings a resume compares, the batch layout, what they load) exits 2.",
        topic="checkpointing",
        resume="may_change",
    )
    save_final_model: bool = setting(
        True, "Write final_model/ (HF format) at the end.", topic="checkpointing", resume="may_change"
    )
    with_tracking: bool = setting(False, "Log to wandb as well as metrics.jsonl.", topic="logging", resume="may_change")
    wandb_project: str = setting("open_instruct", "wandb project.", topic="logging", resume="may_change")
    wandb_entity: Optional[str] = setting(None, "wandb entity (team or user).", topic="logging", resume="may_change")

    def __post_init__(self) -> None:
        self.resolve_defaults()
        self.validate()
        check_token_budget(self.max_tokens_per_micro_batch, *self.longest_packed_item())  # after every field check

    @property
    def packing(self) -> bool:
        """Padding-free micro-batches (max_tokens_per_micro_batch set and > 0)."""
        return bool(self.max_tokens_per_micro_batch)

    @property
    def attention_kernel(self) -> Optional[str]:
        """The attn_implementation models load with: the recipe's; unset, sdpa_varlen when packing (no [T, T] mask
        over a packed row: attention within each sequence), else transformers' default."""
        return self.attn_implementation or ("sdpa_varlen" if self.packing else None)

    def longest_packed_item(self) -> tuple[int, str]:
        """The most tokens one item a micro-batch cannot split can have, and how that number comes about."""
        return self.max_seq_length, f"max_seq_length {self.max_seq_length}"

    def resolve_defaults(self) -> None:
        """Fill the fields whose unset value means "derived from other fields", once, before `validate` (which only
        checks). Subclasses extend it."""

    def validate(self) -> None:
        """Value checks that need no dataset and no model, by topic. Subclasses extend it."""
        if not 0 <= self.seed < 2**32:  # Python's random seeds with abs(seed) (-1 = 1); numpy takes 32 bits
            raise ConfigError(f"seed must be in [0, 2**32 - 1], got {self.seed}")
        for name in ("gpu_memory_gb", "num_processes"):  # the layout a dry run plans
            if getattr(self, name) is not None:
                _check_positive(self, name)
        if self.delete_finished_run and not self.overwrite_output_dir:
            raise ConfigError("delete_finished_run applies with --overwrite_output_dir true only; pass both or neither")
        self._validate_model()
        self._validate_data_sources()
        self._validate_batch_and_optimizer()
        self._validate_logging_and_checkpoints()

    def _validate_model(self) -> None:
        if not self.model_name_or_path:
            raise ConfigError("model_name_or_path is required (a hub name or a local folder)")
        _check_positive(self, "distributed_timeout_minutes")
        if self.mixed_precision == "fp16":
            # fp16 needs loss scaling: accelerate's GradScaler turns an overflow into an inf gradient norm and a
            # skipped step, which the scripts' non-finite guard and clipping do not take part in (docs/gpu-support.md)
            raise ConfigError(
                "mixed_precision fp16 is not supported (it needs a loss scaler the scripts do not use): "
                "use bf16 (Ampere GPUs and newer, and CPUs) or no"
            )
        _check_positive(self, "lora_rank")
        _check_positive(self, "lora_alpha")
        _check_range(self, "lora_dropout", 0.0, 1.0, high_open=True)
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise ConfigError("lora_target_modules must name at least one module (or be unset: all linear layers)")
        if not self.use_lora:  # LoRA settings alone would train every weight, which the recipe did not mean
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            lora_keys = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_save")
            changed = [f"{k} {getattr(self, k)!r}" for k in lora_keys if getattr(self, k) != defaults[k]]
            if changed:
                raise ConfigError(
                    f"{', '.join(changed)} set but use_lora is false: every weight would be trained, without "
                    "adapters; set use_lora true, or remove the LoRA settings"
                )

    def _validate_batch_and_optimizer(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size"):
            _check_positive(self, name)
        _check_positive(self, "max_seq_length")
        if self.num_train_epochs is not None:  # RL: unset (its run length is total_episodes)
            _check_positive(self, "num_train_epochs")
        for name in ("total_episodes", "max_train_samples", "max_eval_samples", "dataset_num_proc"):
            if getattr(self, name) is not None:
                _check_positive(self, name)
        _check_positive(self, "learning_rate", allow_zero=True)
        _check_range(self, "warmup_ratio", 0.0, 1.0)
        _check_range(self, "adam_beta1", 0.0, 1.0, high_open=True)
        _check_range(self, "adam_beta2", 0.0, 1.0, high_open=True)
        _check_positive(self, "weight_decay", allow_zero=True)
        _check_positive(self, "adam_epsilon", allow_zero=True)
        if self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")

    def _validate_logging_and_checkpoints(self) -> None:
        """Logging, evaluation (its data and best_metric) and checkpoints."""
        _check_positive(self, "logging_steps")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"peak_tflops must be > 0 (dense bf16 TFLOP/s of one GPU), got {self.peak_tflops}")
        _check_positive(self, "keep_last_n_checkpoints")
        for name in ("eval_steps", "checkpointing_steps"):
            if getattr(self, name) is not None:
                _check_positive(self, name)
        if self.allow_resume_changes and not self.resume_from_checkpoint:
            raise ConfigError(
                f"allow_resume_changes {self.allow_resume_changes} applies to a resume: set resume_from_checkpoint "
                "(auto or a checkpoint path)"
            )
        _check_range(self, "eval_fraction", 0.0, 0.9)
        if self.train_order == "as_written" and self.dataset_mixer_list:
            raise ConfigError(
                "train_order as_written with dataset_mixer_list: a mixture's sources are interleaved evenly, so it "
                "has no written order; write the curriculum into one file (dataset_name_or_path)"
            )
        logged = [*self.eval_metrics, *self.per_source_metric_names()]
        if self.best_metric and self.eval_metrics and self.best_metric not in logged:  # '' = none
            close = difflib.get_close_matches(self.best_metric, logged, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"best_metric {self.best_metric!r} is not a {self.script} eval metric{hint} (choose one of {logged})"
            )
        if self.best_metric is not None and not self.eval_steps:
            raise ConfigError(f"best_metric {self.best_metric!r} needs eval_steps (evaluation never runs without it)")
        held_out = self.eval_dataset_name_or_path or self.eval_dataset_mixer_list
        if held_out and self.eval_fraction > 0:
            key = "eval_dataset_name_or_path" if self.eval_dataset_name_or_path else "eval_dataset_mixer_list"
            raise ConfigError(
                f"eval_fraction {self.eval_fraction} and {key} {held_out!r} are both set: eval_fraction would be "
                "ignored; keep one"
            )
        if self.eval_steps and not (held_out or self.eval_fraction > 0):
            raise ConfigError(
                "eval_steps is set but there is no eval data: set eval_dataset_name_or_path, eval_dataset_mixer_list "
                "or eval_fraction"
            )

    def eval_source_labels(self) -> list[str]:
        """The source labels (mixture.source_labels) of a held-out set drawn from several sources: an eval mixture,
        comma-separated eval files, or eval_fraction of a train set drawn from several. [] for one source."""
        if self.eval_dataset_mixer_list:
            sources = [str(s) for s in self.eval_dataset_mixer_list[0::2]]
        elif self.eval_dataset_name_or_path:
            sources = [p.strip() for p in self.eval_dataset_name_or_path.split(",") if p.strip()]
        elif self.eval_fraction > 0 and self.dataset_mixer_list:
            sources = [str(s) for s in self.dataset_mixer_list[0::2]]
        elif self.eval_fraction > 0:
            sources = [p.strip() for p in self.dataset_name_or_path.split(",") if p.strip()]
        else:
            sources = []
        return source_labels(sources) if len(sources) > 1 else []

    def per_source_metric_names(self) -> list[str]:
        """The per-source eval metrics the script logs for this held-out set: eval/<label>/<name>."""
        return [
            f"eval/{label}/{name.removeprefix('eval/')}"
            for label in self.eval_source_labels()
            for name in self.per_source_eval_metrics
        ]

    def _validate_data_sources(self) -> None:
        """One way to name the train data (a path/name or a mixture), mixtures well formed, before anything loads."""
        if self.dataset_mixer_list is not None and self.dataset_name_or_path:
            raise ConfigError("set dataset_name_or_path or dataset_mixer_list, not both")
        if self.eval_dataset_mixer_list is not None and self.eval_dataset_name_or_path:
            raise ConfigError("set eval_dataset_name_or_path or eval_dataset_mixer_list, not both")
        if self.dataset_mixer_list is None and not self.dataset_name_or_path:
            raise ConfigError(
                "dataset_name_or_path or dataset_mixer_list is required (a hub name or local .jsonl/.json/.parquet "
                "files)"
            )
        if self.dataset_mixer_list is not None:
            parse_mixer_list(self.dataset_mixer_list, "dataset_mixer_list")
            if self.max_train_samples is not None:
                raise ConfigError(
                    "max_train_samples would cut a mixture in list order; give smaller amounts in dataset_mixer_list"
                )
        if self.eval_dataset_mixer_list is not None:
            parse_mixer_list(self.eval_dataset_mixer_list, "eval_dataset_mixer_list")
            if self.max_eval_samples is not None:
                raise ConfigError(
                    "max_eval_samples would cut a mixture in list order; give smaller amounts in "
                    "eval_dataset_mixer_list"
                )

    def batch_plan(self, world_size: int, num_examples: Optional[int]) -> BatchPlan:
        return supervised_batch_plan(
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            world_size=world_size,
            num_examples=num_examples,
            num_train_epochs=self.num_train_epochs,
            total_episodes=self.total_episodes,
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch or None,
        )


@dataclass
class SFTConfig(BaseConfig):
    eval_metrics: ClassVar[tuple[str, ...]] = ("eval/loss", "eval/perplexity")
    per_source_eval_metrics: ClassVar[tuple[str, ...]] = ("eval/loss",)
    script: str = restated("script", "sft")
    messages_column: str = setting(
        "messages", "Column holding the chat (a list of {role, content}).", topic="data", resume="must_match"
    )
    learning_rate: float = restated("learning_rate", 5e-6)


@dataclass
class PreferenceDataConfig(BaseConfig):
    """Preference rows: `chosen`/`rejected` message lists, or `prompt` + `chosen` + `rejected` strings."""

    chosen_column: str = setting(
        "chosen", "Column of the preferred response (messages or a string).", topic="data", resume="must_match"
    )
    rejected_column: str = setting(
        "rejected", "Column of the dispreferred response (messages or a string).", topic="data", resume="must_match"
    )
    prompt_column: str = setting(
        "prompt", "Column of the prompt, for rows whose chosen/rejected are strings.", topic="data", resume="must_match"
    )

    def longest_packed_item(self) -> tuple[int, str]:
        """A pair: its chosen and rejected sequences go into the same micro-batch (the pair's loss needs both)."""
        return (
            2 * self.max_seq_length,
            f"a preference pair, chosen + rejected = 2 x max_seq_length {self.max_seq_length}",
        )


# The statistics reward_model.py logs (train/<k>, eval/<k>, eval/<source>/<k>), here so best_metric is checked
# against them before torch loads.
RM_METRICS = ("loss", "accuracy", "chosen_reward", "rejected_reward", "margin", "center_loss", "target_margin")
# The statistics dpo.py sums and logs (train/<k>, eval/<k>, eval/<source>/<k>).
DPO_STATS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margin",
    "rewards/accuracy",
    "logps/chosen",
    "logps/rejected",
)


@dataclass
class RewardModelConfig(PreferenceDataConfig):
    eval_metrics: ClassVar[tuple[str, ...]] = tuple(f"eval/{k}" for k in RM_METRICS)
    per_source_eval_metrics: ClassVar[tuple[str, ...]] = eval_metrics
    script: str = restated("script", "reward_model")
    learning_rate: float = restated("learning_rate", 3e-6)
    margin_column: Optional[str] = setting(
        None,
        "Column holding a per-pair target margin m (a number): loss -log sigmoid(r_c - r_r - m), as TRL's `margin` "
        "column. Unset: m = 0. Every row must then carry a finite number.",
        topic="data",
        resume="must_match",
    )
    center_rewards_coefficient: float = setting(
        0.0,
        "Adds coef * mean((r_chosen + r_rejected)^2) to the loss (TRL's center_rewards_coefficient; 0.01 is the "
        "value in its docs), keeping rewards centred on 0. 0 = off.",
        topic="algorithm",
        resume="must_match",
    )

    def validate(self) -> None:
        super().validate()
        _check_positive(self, "center_rewards_coefficient", allow_zero=True)


@dataclass
class DPOConfig(PreferenceDataConfig):
    eval_metrics: ClassVar[tuple[str, ...]] = tuple(f"eval/{k}" for k in DPO_STATS)
    per_source_eval_metrics: ClassVar[tuple[str, ...]] = eval_metrics
    script: str = restated("script", "dpo")
    model_name_or_path: str = restated(
        "model_name_or_path", resume="must_match", loads="weights", content_key="reference_weights"
    )  # the reference is loaded from it again on resume
    learning_rate: float = restated("learning_rate", 5e-7)
    loss_type: Literal["dpo", "dpo_norm", "ipo", "simpo", "wpo"] = setting(
        "dpo_norm", "Preference loss (formulas in dpo.py).", topic="algorithm", resume="must_match"
    )
    beta: float = setting(
        5.0, "Inverse temperature of the preference loss (> 0).", topic="algorithm", resume="must_match"
    )
    label_smoothing: float = setting(
        0.0, "Conservative DPO: assumed probability that a label is flipped.", topic="algorithm", resume="must_match"
    )
    gamma_beta_ratio: float = setting(
        0.0, "SimPO target margin gamma, as a ratio of beta.", topic="algorithm", resume="must_match"
    )
    reference_cache_dir: Optional[str] = setting(
        None,
        "Where reference log-probs are cached (default: <output_dir>/ref_cache). A sweep over beta, lr or loss type "
        "can share one folder: the file name is a hash of model, data and precision.",
        topic="algorithm",
        resume="may_change",
    )

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0, got {self.beta}")
        _check_range(self, "label_smoothing", 0.0, 0.5, high_open=True)
        if self.label_smoothing and self.loss_type not in ("dpo", "dpo_norm"):
            raise ConfigError(f"label_smoothing applies to loss_type dpo/dpo_norm only, not {self.loss_type!r}")
        if self.gamma_beta_ratio and self.loss_type != "simpo":
            raise ConfigError(f"gamma_beta_ratio applies to loss_type simpo only, not {self.loss_type!r}")


MAX_ASYNC_STEPS = 64  # rollouts in flight at most: past this, staleness and held memory are no longer a sane recipe


@dataclass
class GenerationEngineConfig:
    """The generation-engine knobs of an RL run (`generation.py`'s backends), one group. A mixin of RLVRConfig: its
    fields stay flat keys of the recipe and of `--key value`."""

    generation_backend: Literal["hf", "vllm", "vllm_server"] = setting(
        "hf",
        "Generate with transformers, a vLLM engine inside each training process, or dedicated vLLM servers.",
        topic="generation",
        resume="may_change",
    )
    vllm_gpu_memory_utilization: float = setting(
        0.5, "Fraction of GPU memory the vLLM engine may take.", topic="generation", resume="may_change"
    )
    vllm_enable_sleep: bool = setting(
        False, "Let the vLLM engine sleep during training (frees its memory).", topic="generation", resume="may_change"
    )
    vllm_lora_sync: Literal["merged", "adapter"] = setting(
        "merged",
        "With use_lora and generation_backend vllm or vllm_server: send the engines the merged weights on every "
        "sync, or the base weights once and then only the adapter (vLLM's LoRA: fewer bytes per sync, slower "
        "generation; dedicated engines read each adapter's folder under output_dir).",
        topic="generation",
        resume="may_change",
    )
    # vllm_server: dedicated engines (`vllm serve`), weights broadcast after each rollout's updates
    vllm_num_engines: int = setting(
        1, "vllm_server: engines (each vllm_tensor_parallel_size devices).", topic="generation", resume="may_change"
    )
    vllm_tensor_parallel_size: int = setting(
        1, "vllm_server: devices per engine (tensor parallel).", topic="generation", resume="may_change"
    )
    vllm_server_urls: Optional[list[str]] = setting(
        None,
        "vllm_server: URLs of engines already running (other nodes); default: start them on this node.",
        topic="generation",
        resume="may_change",
    )
    vllm_engine_devices: Optional[list[int]] = setting(
        None,
        "vllm_server: GPUs of the engines started here (default: those after the training processes').",
        topic="generation",
        resume="may_change",
    )
    vllm_weight_transfer: Literal["auto", "nccl", "gloo"] = setting(
        "auto",
        "vllm_server: weight broadcast transport (auto: nccl with CUDA, gloo on CPU).",
        topic="generation",
        resume="may_change",
    )
    vllm_server_timeout: float = setting(
        600.0,
        "vllm_server: seconds an engine may take to answer before the run stops.",
        topic="generation",
        resume="may_change",
    )
    vllm_engine_start_timeout: float = setting(
        900.0, "vllm_server: seconds an engine may take to start.", topic="generation", resume="may_change"
    )
    generation_micro_batch_size: Optional[int] = setting(
        None,
        "hf: sequences per generate call (one KV cache each); unset: as many as hold 131072 tokens of prompt + "
        "response, at most the rank's whole rollout. Seeded samples depend on it; greedy outputs do not.",
        topic="generation",
        resume="may_change",
    )
    async_steps: int = setting(
        0,
        "Rollouts generated ahead of training (0: synchronous; N: up to N in flight, every token at most N weight "
        "versions older than the trainer that trains on it).",
        topic="generation",
        resume="must_match",
        note="rollouts in flight, saved with the checkpoint",
    )
    # generation_check.py: the generator must reproduce the trainer's log-probs (docs/trusted-generation.md)
    generation_check: Literal["stop", "warn", "off"] = setting(
        "stop",
        "Launch and post-sync probe checks: stop the run beyond the limits, warn and go on, or skip them.",
        topic="checks",
        resume="may_change",
    )
    generation_check_scale: float = setting(
        1.0, "Multiplies the probe check's dtype-derived limits.", topic="checks", resume="may_change"
    )
    weight_sync_timeout: float = setting(
        600.0,
        "Seconds a weight sync may take before the run stops naming the engine.",
        topic="generation",
        resume="may_change",
    )
    mismatch_warn_kl: float = setting(
        1e-3,
        "Warn when a rollout's mismatch/k3_kl (sampler vs trainer) exceeds this.",
        topic="checks",
        resume="may_change",
    )
    mismatch_warn_beyond_cap: float = setting(
        0.01,
        "Warn when a rollout's share of tokens with TIS ratio beyond tis_cap exceeds this.",
        topic="checks",
        resume="may_change",
    )

    def resolve_defaults(self) -> None:
        super().resolve_defaults()  # type: ignore[misc]
        if self.vllm_server_urls:  # engines started apart: as many as URLs
            self.vllm_num_engines = len(self.vllm_server_urls)

    def validate(self) -> None:
        """Dedicated vLLM engines and async rollouts: counts, URLs, and async only where generation has its own
        devices (a colocated engine or HF generation shares the trainer's, so there is nothing to overlap)."""
        super().validate()  # type: ignore[misc]
        _check_range(self, "vllm_gpu_memory_utilization", 0.0, 1.0, low_open=True)
        for name in ("vllm_num_engines", "vllm_tensor_parallel_size"):
            _check_positive(self, name)
        for name in ("vllm_server_timeout", "vllm_engine_start_timeout", "weight_sync_timeout"):
            _check_positive(self, name)
        for name in ("generation_check_scale", "mismatch_warn_kl", "mismatch_warn_beyond_cap"):
            _check_positive(self, name)
        _check_positive(self, "async_steps", allow_zero=True)
        if self.generation_micro_batch_size is not None:
            _check_positive(self, "generation_micro_batch_size")
        if self.async_steps > MAX_ASYNC_STEPS:
            raise ConfigError(
                f"async_steps {self.async_steps} is more than {MAX_ASYNC_STEPS}: every rollout in flight holds its "
                f"completions in memory and trains on tokens up to async_steps weight versions old (open-instruct's "
                f"default is 8)"
            )
        if self.async_steps and self.generation_backend == "vllm":
            raise ConfigError(
                f"async_steps {self.async_steps} needs generation_backend vllm_server (dedicated engines, weights "
                f"updated in flight) or hf (a copy of the policy generating in a background thread); the colocated "
                f"vllm engine shares the training devices"
            )
        use_lora = getattr(self, "use_lora", False)  # BaseConfig's, beside this mixin in RLVRConfig
        if self.vllm_lora_sync == "adapter" and not (use_lora and self.generation_backend in ("vllm", "vllm_server")):
            raise ConfigError(
                f"vllm_lora_sync adapter needs use_lora true and generation_backend vllm or vllm_server (use_lora is "
                f"{use_lora}, generation_backend {self.generation_backend}): the adapter is loaded by a vLLM engine"
            )
        if self.vllm_server_urls is not None:
            if self.generation_backend != "vllm_server":
                raise ConfigError("vllm_server_urls is set but generation_backend is not vllm_server")
            if not self.vllm_server_urls or any(
                not (isinstance(u, str) and u.startswith(("http://", "https://"))) for u in self.vllm_server_urls
            ):
                raise ConfigError(f"vllm_server_urls must be a list of http(s):// URLs, got {self.vllm_server_urls!r}")
        if self.vllm_engine_devices is not None:
            need = self.vllm_num_engines * self.vllm_tensor_parallel_size
            if len(self.vllm_engine_devices) != need or any(d < 0 for d in self.vllm_engine_devices):
                raise ConfigError(
                    f"vllm_engine_devices {self.vllm_engine_devices} must list {need} GPU ids (vllm_num_engines "
                    f"{self.vllm_num_engines} x vllm_tensor_parallel_size {self.vllm_tensor_parallel_size})"
                )


@dataclass
class RLVRConfig(GenerationEngineConfig, BaseConfig):
    eval_metrics: ClassVar[tuple[str, ...]] = (
        "eval/correct_rate",
        "eval/score_mean",
        "eval/response_length",
        "eval/non_stop_rate",
    )
    per_source_eval_metrics: ClassVar[tuple[str, ...]] = ("eval/correct_rate",)
    script: str = restated("script", "rlvr_ppo")
    num_train_epochs: Optional[float] = restated(
        "num_train_epochs",
        None,
        help="Not RL's run length (HF's / TRL's name): a run given it is refused at start with the total_episodes "
        "it means (epochs x prompts x num_samples_per_prompt).",
    )
    model_name_or_path: str = restated(
        "model_name_or_path", resume="must_match", loads="weights", content_key="reference_weights"
    )  # the reference is loaded from it again on resume
    algo: str = setting(
        "ppo",
        "Preset (rl_algorithms.ALGO_ESTIMATORS): ppo = gae advantages (value model), KL in the reward; grpo = group "
        "advantages, KL loss.",
        topic="algorithm",
        resume="must_match",
    )
    learning_rate: float = restated("learning_rate", 3e-7)
    # data: prompt messages, ground truth and verifier name per row
    messages_column: str = setting("messages", "Column of the prompt messages.", topic="data", resume="must_match")
    ground_truth_column: str = setting(
        "ground_truth", "Column of the answer the verifier checks against.", topic="data", resume="must_match"
    )
    verifier_column: str = setting(
        "dataset",
        "Column naming each row's verifier (gsm8k, math, ifeval, arithmetic, code).",
        topic="data",
        resume="must_match",
    )
    max_prompt_length: int = setting(512, "Longest prompt in tokens.", topic="data", resume="must_match")
    # rollouts
    local_rollout_batch_size: Optional[int] = setting(
        8,
        "Prompts per device per rollout; null: TRL GRPO's generation batch, per_device_train_batch_size x "
        "gradient_accumulation_steps / num_samples_per_prompt (one optimizer step per rollout and epoch).",
        topic="batch",
        resume="batch_layout",
    )
    num_samples_per_prompt: int = setting(
        1, "Completions per prompt (the GRPO group size).", topic="batch", resume="must_match"
    )
    shared_prompt_forward: bool = setting(
        True,
        "Run each group's prompt once per forward (old log-probs, reference, values, reward model and the training "
        "forward/backward) and its completions on its key/value cache, when a micro-batch holds whole groups of one "
        "prompt in one process, padded; same numbers as the plain forward within float rounding (docs/packing.md). "
        "false: every completion recomputes its prompt.",
        topic="model",
        resume="may_change",
    )
    shared_prompt_generation: bool = setting(
        True,
        "HF generation: in each generate call a prompt's samples share one prefill of the prompt (its key/value "
        "cache repeated per sample). Same next-token distributions within float rounding, so a sampled token can "
        "differ from the unshared prefill's only where rounding moves it across a sampling boundary "
        "(docs/packing.md). false: every sample prefills its prompt (the computation before this setting).",
        topic="generation",
        resume="may_change",
    )
    num_epochs: int = setting(4, "PPO/GRPO passes over each rollout.", topic="batch", resume="must_match")
    response_length: int = setting(256, "Most new tokens per completion.", topic="generation", resume="must_match")
    temperature: float = setting(1.0, "Sampling temperature (> 0).", topic="generation", resume="must_match")
    top_p: float = setting(1.0, "Nucleus sampling threshold, in (0, 1].", topic="generation", resume="must_match")
    top_k: int = setting(
        0,
        "Sample among the k most likely tokens only (0 = off). With top_k, top_p or min_p the trainer's log-probs of "
        "the ratio, TIS and mismatch/ are the truncated distribution's (docs/algorithms.md).",
        topic="generation",
        resume="must_match",
    )
    min_p: float = setting(
        0.0,
        "Drop tokens less likely than min_p x the most likely one before sampling, in [0, 1) (0 = off).",
        topic="generation",
        resume="must_match",
    )
    stop_strings: Optional[list[str]] = setting(
        None, "Strings that end a completion (besides EOS).", topic="generation", resume="must_match"
    )
    # rewards
    verification_reward: float = setting(
        10.0, "Score of a completion the verifier accepts.", topic="rewards", resume="must_match"
    )
    non_stop_penalty: float = setting(
        0.0,
        "Added to the score when no EOS/stop string ended the response (Tulu 3: -10). 0 = off.",
        topic="rewards",
        resume="must_match",
    )
    reward_model_path: Optional[str] = setting(
        None,
        "A trained reward model (sequence classifier with a trained score head) added to the score.",
        topic="rewards",
        resume="must_match",
        loads="weights",
        content_key="reward_model_weights",
    )
    reward_model_multiplier: float = setting(
        0.0, "Weight of the reward model's score.", topic="rewards", resume="must_match"
    )
    reward_functions: Optional[list[str]] = setting(
        None,
        "Custom reward functions added to the verifier's reward: module:function or path/to/file.py:function, "
        "called as TRL's reward_funcs, fn(prompts, completions, completion_ids, **every column of the row) -> a "
        "list of float or None per completion (docs/extending.md). Rows then need no verifier column. Each is called "
        "once on real rows before any model loads.",
        topic="rewards",
        resume="must_match",
        loads="code",
    )
    reward_function_timeout: float = setting(
        60.0,
        "Seconds one reward-function call (a batch of completions) may take before the run stops (exit 2).",
        topic="rewards",
        resume="may_change",
    )
    reward_function_weights: Optional[list[float]] = setting(
        None,
        "Weight of each reward function (default 1.0 each): reward += sum of weight x value.",
        topic="rewards",
        resume="must_match",
    )
    verifier_timeout: float = setting(
        2.0, "Seconds a verifier may take per completion.", topic="rewards", resume="may_change"
    )
    code_reward: Literal["all", "fraction"] = setting(
        "all", "code verifier: 1 iff all tests pass, or the fraction passed.", topic="rewards", resume="must_match"
    )
    code_test_seconds: float = setting(
        2.0,
        "code verifier: CPU seconds each test case may use (sandboxed), in (0, 60].",
        topic="rewards",
        resume="may_change",
    )
    code_memory_mb: int = setting(
        1024, "code verifier: address-space limit of a sandboxed program, MiB.", topic="rewards", resume="may_change"
    )
    code_max_tests: int = setting(
        1024,
        "code verifier: most tests a row may have (a row with more stops the run, exit 2).",
        topic="rewards",
        resume="may_change",
    )
    code_allow_script_tests: bool = setting(
        False,
        "code verifier: run tests it cannot judge outside the program (a helper, a random input...) whole after the "
        "program. NOT hack-proof: the program can fake their verdict (docs/sandbox.md). Off: such a row is refused.",
        topic="rewards",
        resume="may_change",
    )
    sandbox_workers: int = setting(
        2,
        "Sandboxed programs run at once per training process (CPU cores they may take).",
        topic="rewards",
        resume="may_change",
    )
    sandbox_batch_timeout: Optional[float] = setting(
        600.0,
        "Seconds to run all of a rollout's code tests; tests still running then fail as timeouts (null: no cap).",
        topic="rewards",
        resume="may_change",
    )
    non_stop_penalty_mode: Literal["add", "replace"] = setting(
        "add",
        "add the penalty to the score, or replace the score with it (Tulu 3).",
        topic="rewards",
        resume="must_match",
    )
    mask_truncated_completions: bool = setting(
        False,
        "TRL's: a completion no EOS/stop string ended within response_length is left out of the loss (its tokens get "
        "no weight); it still counts in its group's baseline (docs/porting.md).",
        topic="algorithm",
        resume="must_match",
    )
    # PPO / GRPO and their variants (formulas in rlvr_ppo.py)
    advantage_estimator: Optional[str] = setting(
        None,
        "A row of rl_algorithms.ADVANTAGE_ESTIMATORS: gae (value model), grpo, dr_grpo, rloo (group baselines), "
        "reinforce_pp, or your own as path/to/file.py:function or module:function; default: from algo.",
        topic="algorithm",
        resume="structural",
        loads="code",
    )
    policy_loss: str = setting(
        "ppo",
        "A row of rl_algorithms.POLICY_LOSSES: ppo (token ratio, clip), gspo (sequence ratio, clip), cispo (clipped "
        "IS weight), or your own as path/to/file.py:function or module:function.",
        topic="algorithm",
        resume="must_match",
        loads="code",
    )
    cliprange_low: Optional[float] = setting(
        None, "Lower clip 1 - low (default: cliprange).", topic="algorithm", resume="must_match"
    )
    cliprange_high: Optional[float] = setting(
        None,
        "Upper clip 1 + high (default: cliprange); > low is DAPO's clip-higher.",
        topic="algorithm",
        resume="must_match",
    )
    dual_clip_c: Optional[float] = setting(
        None, "Dual-clip bound c > 1 for A < 0 (off: null).", topic="algorithm", resume="must_match"
    )
    loss_aggregation: Optional[Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]] = setting(
        None,
        "How token losses become the mini-batch loss (see aggregation_weights); unset: seq_mean_token_mean with "
        "policy_loss gspo (the GSPO paper's sequence mean), else token_mean.",
        topic="algorithm",
        resume="must_match",
    )
    loss_norm_length: Optional[int] = setting(
        None,
        "C of seq_mean_token_sum_norm (Dr. GRPO); default: response_length.",
        topic="algorithm",
        resume="must_match",
    )
    score_placement: Literal["last_token", "after_last_token"] = setting(
        "last_token",
        "gae: the score at the last response token, or one after it with a value there (Tulu 3).",
        topic="algorithm",
        resume="must_match",
    )
    filter_zero_std_groups: bool = setting(
        False,
        "Drop groups whose completions all scored the same from the update.",
        topic="algorithm",
        resume="must_match",
    )
    overlong_buffer_length: int = setting(
        0,
        "DAPO soft overlong punishment over the last N tokens of response_length (0: off).",
        topic="rewards",
        resume="must_match",
    )
    overlong_penalty_factor: float = setting(
        1.0, "Largest overlong punishment (at the limit).", topic="rewards", resume="must_match"
    )
    truncated_importance_sampling: Optional[bool] = setting(
        None,
        "Weight token losses by min(exp(trainer_logp - sampler_logp), tis_cap); default: on with async.",
        topic="algorithm",
        resume="must_match",
    )
    tis_cap: float = setting(
        2.0, "Cap of the truncated importance-sampling weight.", topic="algorithm", resume="must_match"
    )
    is_mask_low: Optional[float] = setting(
        None,
        "IcePop: drop the policy-gradient term of tokens whose exp(trainer_logp - sampler_logp) is below this.",
        topic="algorithm",
        resume="must_match",
    )
    is_mask_high: Optional[float] = setting(
        None,
        "IcePop: drop the policy-gradient term of tokens whose exp(trainer_logp - sampler_logp) is above this.",
        topic="algorithm",
        resume="must_match",
    )
    max_sequence_lag: Optional[int] = setting(
        None,
        "Drop the policy-gradient term of completions with a token sampled more than this many versions ago.",
        topic="algorithm",
        resume="must_match",
    )
    value_model_path: Optional[str] = setting(
        None,
        "Initialise the value model from this (reward) model; default: the policy.",
        topic="algorithm",
        resume="must_match",
    )
    beta: float = setting(0.05, "KL coefficient.", topic="algorithm", resume="must_match")
    kl_estimator: str = setting(
        "k1",
        "KL estimator: Schulman's k1/k2/k3, or your own (logp, ref_logp) -> KL as file.py:function.",
        topic="algorithm",
        resume="must_match",
        loads="code",
    )
    algo_kwargs: dict[str, Any] = setting(
        help="Keyword arguments for your own advantage_estimator / policy_loss / kl_estimator (each gets the "
        "ones its function takes): a YAML mapping, or --algo_kwargs name=value ... (docs/extending.md).",
        default_factory=dict,
        topic="algorithm",
        resume="must_match",
    )
    gamma: float = setting(1.0, "PPO discount.", topic="algorithm", resume="must_match")
    lam: float = setting(0.95, "PPO GAE lambda.", topic="algorithm", resume="must_match")
    cliprange: float = setting(0.2, "Policy ratio clip range.", topic="algorithm", resume="must_match")
    cliprange_value: float = setting(0.2, "Value clip range.", topic="algorithm", resume="must_match")
    vf_coef: float = setting(0.1, "Value loss coefficient.", topic="algorithm", resume="must_match")
    whiten_advantages: bool = setting(
        True, "Whiten PPO advantages over the rollout.", topic="algorithm", resume="must_match"
    )
    # eval: greedy verifiable accuracy on held-out prompts
    eval_response_length: Optional[int] = setting(
        None, "Most new tokens per eval answer (default: response_length).", topic="generation", resume="may_change"
    )
    num_samples_logged: int = setting(
        4, "Completions per rollout written to samples.jsonl.", topic="logging", resume="may_change"
    )
    correct_rate_by: Optional[str] = setting(
        None,
        "Log train/correct_rate/<group> per group of prompts: a prompt column (a dotted path reaches into a nested "
        "one, e.g. problem.shape) or `source` (the dataset each prompt came from).",
        topic="logging",
        resume="may_change",
    )
    # multi-turn episodes (environments.py, episodes.py; docs/multi-turn.md)
    environment: Optional[str] = setting(
        None,
        "Play multi-turn episodes against this environment: a registered name (tool, multi_turn) or an import path "
        "package.module:Class or /path/file.py:Class (null: single-turn completions). A row's `environment` wins.",
        topic="environments",
        resume="must_match",
        loads="code",
        per_row=True,
    )
    tools: list[str] = setting(
        help="Tools of the tool environment (calculator, python: the sandbox); a row's `tools` narrow them.",
        default_factory=lambda: ["calculator"],
        topic="environments",
        resume="must_match",
    )
    tool_call_format: Literal["hermes", "fenced"] = setting(
        "hermes",
        "hermes: <tool_call>{json}</tool_call> (Qwen templates); fenced: ```python blocks (ReTool).",
        topic="environments",
        resume="must_match",
    )
    max_turns: int = setting(
        8, "Policy turns (generation calls) per episode at most.", topic="environments", resume="must_match"
    )
    max_tool_calls: int = setting(
        8,
        "Tool calls per episode at most (a call over it is answered with an error).",
        topic="environments",
        resume="must_match",
    )
    tool_output_max_tokens: int = setting(
        256,
        "Tool output tokens shown to the policy at most (the rest is cut).",
        topic="environments",
        resume="must_match",
    )
    tool_timeout: float = setting(
        10.0,
        "Seconds a python tool call may run (the sandbox's wall and CPU limit).",
        topic="environments",
        resume="may_change",
    )
    max_turn_tokens: Optional[int] = setting(
        None,
        "New tokens per turn at most (null: response_length, the budget of the whole episode's response).",
        topic="environments",
        resume="must_match",
    )
    environment_timeout: float = setting(
        300.0,
        "Seconds an environment's constructor, reset or step may take before the run stops (exit 2, naming the "
        "class and the row); a step may run tools, up to max_tool_calls x tool_timeout.",
        topic="environments",
        resume="may_change",
    )
    turn_reward_aggregation: Literal["sum", "last"] = setting(
        "last",
        "Episode reward: the last turn's reward (the outcome), or the sum of every turn's.",
        topic="environments",
        resume="must_match",
    )
    # PPO-ptx: a supervised loss on demonstrations beside the RL loss (ptx.py, docs/algorithms.md)
    ptx_dataset: Optional[str] = setting(
        None,
        "SFT rows (any SFT format, e.g. the cold-start demonstrations) whose next-token loss on assistant tokens is "
        "added to the RL loss, weighted by ptx_coef (InstructGPT's PPO-ptx); each at most max_prompt_length + "
        "response_length tokens (overlong: drop or truncate).",
        topic="algorithm",
        resume="must_match",
    )
    ptx_coef: float = setting(
        0.0,
        "Weight of ptx_dataset's mean NLL per token in each optimizer step's loss (0: off; OpenRLHF's 0.05).",
        topic="algorithm",
        resume="must_match",
    )
    # on-policy distillation (advantage_estimator distill; distillation.py, docs/distillation.md)
    teacher_model_name_or_path: Optional[str] = setting(
        None,
        "A frozen teacher (any causal LM with the student's tokenizer) the student is distilled towards on its own "
        "samples; setting it alone picks advantage_estimator distill. An http(s):// URL: a running vLLM server of "
        "the teacher (docs/distillation.md).",
        topic="algorithm",
        resume="must_match",
        loads="weights",
        content_key="teacher_weights",
    )
    teacher_models: dict[str, str] = setting(
        help="Named teachers for multi-teacher distillation (TRL's MOPD): name -> local folder, hub name or the "
        "URL of a running vLLM server of it, e.g. "
        "{math: path/a, code: path/b} or --teacher_models math=path/a code=path/b; with two or more, each training "
        "row's teacher_column names its teacher (one scores every row). Instead of teacher_model_name_or_path.",
        default_factory=dict,
        topic="algorithm",
        resume="must_match",
        loads="weights",
        content_key="teacher_weights",
    )
    teacher_column: str = setting(
        "teacher_id",
        "The row field naming each row's teacher among teacher_models (TRL's teacher_id; a dotted path reaches into "
        "a nested column, `source` is the dataset the row came from).",
        topic="algorithm",
        resume="must_match",
    )
    distill_loss: Literal["reverse_kl", "jsd"] = setting(
        "reverse_kl",
        "reverse_kl: A_t = teacher_kl_weight * (log pi_teacher(y_t) - log pi_student(y_t)) through the policy loss; "
        "jsd: teacher_kl_weight x the full-distribution generalized JSD as a loss term.",
        topic="algorithm",
        resume="must_match",
    )
    teacher_kl_weight: float = setting(
        1.0,
        "Weight of the teacher term (the reverse-KL advantage or the JSD loss).",
        topic="algorithm",
        resume="must_match",
    )
    distill_reward_weight: float = setting(
        0.0,
        "Weight of the verifiable score added to every token's advantage (0: distillation alone).",
        topic="algorithm",
        resume="must_match",
    )
    distill_group_baseline: Optional[bool] = setting(
        None,
        "Centre the score on its prompt's group mean (default: when num_samples_per_prompt >= 2).",
        topic="algorithm",
        resume="must_match",
    )
    distill_jsd_beta: float = setting(
        1.0,
        "jsd: TRL's beta, 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher), else JSD.",
        topic="algorithm",
        resume="must_match",
    )
    distill_top_k: Optional[int] = setting(
        None,
        "jsd: restrict both distributions to the teacher's k likeliest tokens, renormalised (null: all).",
        topic="algorithm",
        resume="must_match",
    )

    def longest_packed_item(self) -> tuple[int, str]:
        longest = self.max_prompt_length + self.response_length
        return (
            longest,
            f"an episode, max_prompt_length {self.max_prompt_length} + response_length {self.response_length}",
        )

    @property
    def estimator(self) -> AdvantageEstimator:
        """The advantage estimator's row of rl_algorithms.ADVANTAGE_ESTIMATORS (its traits and function)."""
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator]

    @property
    def uses_value_model(self) -> bool:
        """A learned value model (gae); every other built-in estimator is value-free."""
        return self.estimator.uses_value_model

    @property
    def uses_groups(self) -> bool:
        """Group baselines (grpo, dr_grpo, rloo): a prompt's completions must stay together."""
        return self.estimator.uses_groups

    @property
    def uses_teacher(self) -> bool:
        """On-policy distillation (distill): a frozen teacher scores the sampled tokens."""
        return self.estimator.uses_teacher

    @property
    def has_teacher(self) -> bool:
        """A teacher is named: teacher_model_name_or_path or teacher_models."""
        return bool(self.teacher_model_name_or_path or self.teacher_models)

    def teacher_settings(self) -> list[tuple[str, str]]:
        """(the setting naming it, its path) of every teacher: teacher_model_name_or_path's, or each of
        teacher_models as `teacher_models <name>`."""
        if self.teacher_models:
            return [(f"teacher_models {name}", path) for name, path in self.teacher_models.items()]
        single = self.teacher_model_name_or_path
        return [("teacher_model_name_or_path", single)] if single else []

    def loaded_teacher_settings(self) -> list[tuple[str, str]]:
        """teacher_settings without the teachers a server scores (is_teacher_server): those loaded beside the
        policy, which the memory and time plans count."""
        return [(key, path) for key, path in self.teacher_settings() if not is_teacher_server(path)]

    @property
    def kl_in_reward(self) -> bool:
        """-beta * KL_t in the per-token reward (gae, reinforce_pp); otherwise beta * KL is a loss term."""
        return self.estimator.kl_in_reward

    def resolve_defaults(self) -> None:
        super().resolve_defaults()
        if self.advantage_estimator is None and self.has_teacher:  # a teacher alone: distillation
            self.advantage_estimator = "distill"
        if self.distill_group_baseline is None:
            self.distill_group_baseline = self.num_samples_per_prompt >= 2
        if self.local_rollout_batch_size is None:  # TRL's default steps_per_generation = gradient_accumulation_steps
            self.local_rollout_batch_size = trl_rollout_batch_size(
                self.per_device_train_batch_size, self.gradient_accumulation_steps, self.num_samples_per_prompt
            )
        if self.advantage_estimator is None and self.algo in ALGO_ESTIMATORS:  # the preset
            self.advantage_estimator = ALGO_ESTIMATORS[self.algo]
        for name in ("cliprange_low", "cliprange_high"):
            if getattr(self, name) is None:
                setattr(self, name, self.cliprange)
        if self.loss_norm_length is None:
            self.loss_norm_length = self.response_length
        if self.loss_aggregation is None:  # unset, not "set to token_mean": GSPO's objective is a sequence mean
            self.loss_aggregation = "seq_mean_token_mean" if self.policy_loss == "gspo" else "token_mean"
        if self.truncated_importance_sampling is None:  # off-policy by construction when generation runs ahead
            self.truncated_importance_sampling = self.async_steps > 0

    def validate(self) -> None:
        """By topic: batch, sampling, algorithm, rewards, environments, distillation (the engines: the mixin's)."""
        super().validate()
        self._validate_batch()
        self._validate_sampling()
        self._validate_algorithm()
        self._validate_off_policy()
        self._validate_rewards()
        self._validate_environment()
        self._validate_distillation()
        self._validate_ptx()

    def _validate_batch(self) -> None:
        for name in ("local_rollout_batch_size", "num_samples_per_prompt", "num_epochs", "max_prompt_length"):
            _check_positive(self, name)
        if self.total_episodes is None:
            raise ConfigError("total_episodes is required for RLVR (completions to train on)")
        _check_positive(self, "num_samples_logged", allow_zero=True)

    def _validate_sampling(self) -> None:
        _check_positive(self, "response_length")
        if self.eval_response_length is not None:
            _check_positive(self, "eval_response_length")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 for sampling, got {self.temperature}")
        _check_range(self, "top_p", 0.0, 1.0, low_open=True)
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _check_range(self, "min_p", 0.0, 1.0, high_open=True)

    def _validate_algorithm(self) -> None:
        """The estimator, the policy loss and their knobs, and the settings that only some estimators use."""
        _check_range(self, "gamma", 0.0, 1.0)
        _check_range(self, "lam", 0.0, 1.0)
        for name in ("cliprange", "cliprange_value"):
            _check_positive(self, name)
        if self.beta < 0 or self.vf_coef < 0:
            raise ConfigError(f"beta and vf_coef must be >= 0, got beta={self.beta}, vf_coef={self.vf_coef}")
        _check_choice(self, "algo", ALGO_ESTIMATORS)
        self._validate_variants()
        for name in ("cliprange_low", "cliprange_high"):
            _check_positive(self, name)
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ConfigError(f"dual_clip_c must be > 1 (or null to turn it off), got {self.dual_clip_c}")
        if self.dual_clip_c is not None and not POLICY_LOSSES[self.policy_loss].takes_dual_clip:
            takers = "/".join(n for n, row in POLICY_LOSSES.items() if row.takes_dual_clip and ":" not in n)
            raise ConfigError(
                f"dual_clip_c applies to policy_loss {takers}, not {self.policy_loss} (its weight is already capped)"
            )
        _check_positive(self, "loss_norm_length")
        if self.uses_groups and self.num_samples_per_prompt < 2:
            raise ConfigError(
                f"advantage_estimator {self.advantage_estimator} needs num_samples_per_prompt >= 2 (group baselines "
                f"of a group of {self.num_samples_per_prompt} are all zero)"
            )
        if self.score_placement == "after_last_token" and not self.uses_value_model:
            raise ConfigError(
                f"score_placement after_last_token needs an advantage estimator with a value model (gae: a value "
                f"there carries the score back), not {self.advantage_estimator}"
            )
        if self.filter_zero_std_groups and not self.uses_groups:
            groups = ", ".join(n for n, row in ADVANTAGE_ESTIMATORS.items() if row.uses_groups and ":" not in n)
            raise ConfigError(
                f"filter_zero_std_groups needs a group estimator ({groups}), not {self.advantage_estimator}"
            )
        if self.mask_truncated_completions and self.uses_value_model:
            raise ConfigError(
                f"mask_truncated_completions is TRL's GRPO option: it needs an estimator without a value model (grpo, "
                f"dr_grpo, rloo, ...), not {self.advantage_estimator}, whose value targets would still train on a "
                "masked completion"
            )
        if not self.uses_value_model and self.value_model_path:
            raise ConfigError(
                f"value_model_path is set but advantage_estimator {self.advantage_estimator} uses no value model"
            )

    def _validate_off_policy(self) -> None:
        """Corrections for tokens sampled by another policy: truncated IS, IcePop masks, the lag limit."""
        _check_positive(self, "tis_cap")
        if self.tis_cap < 1:
            raise ConfigError(
                f"tis_cap must be >= 1 (a weight cap below 1 would shrink every token), got {self.tis_cap}"
            )
        for name in ("is_mask_low", "is_mask_high"):
            if getattr(self, name) is not None:
                _check_positive(self, name, allow_zero=True)
        if self.is_mask_low is not None and not 0 <= self.is_mask_low <= 1:
            raise ConfigError(f"is_mask_low must be in [0, 1] (the ratio masked below), got {self.is_mask_low}")
        if self.is_mask_high is not None and self.is_mask_high < 1:
            raise ConfigError(f"is_mask_high must be >= 1 (the ratio masked above), got {self.is_mask_high}")
        if self.max_sequence_lag is not None:
            _check_positive(self, "max_sequence_lag", allow_zero=True)

    def _validate_rewards(self) -> None:
        for name in (
            "verifier_timeout",
            "reward_function_timeout",
            "code_test_seconds",
            "sandbox_workers",
            "code_max_tests",
        ):
            _check_positive(self, name)
        _check_range(self, "code_test_seconds", 0.0, 60.0, low_open=True)
        if self.code_memory_mb < 64:
            raise ConfigError(f"code_memory_mb must be >= 64 (for a Python interpreter), got {self.code_memory_mb}")
        if self.sandbox_batch_timeout is not None:
            _check_positive(self, "sandbox_batch_timeout")
        _check_positive(self, "overlong_buffer_length", allow_zero=True)
        if self.overlong_buffer_length > self.response_length:
            raise ConfigError(
                f"overlong_buffer_length {self.overlong_buffer_length} exceeds response_length {self.response_length}"
            )
        _check_positive(self, "overlong_penalty_factor", allow_zero=True)
        for i, weight in enumerate(self.reward_function_weights or []):
            if not math.isfinite(weight):
                raise ConfigError(f"reward_function_weights[{i}] must be a finite number, got {weight}")
        if self.reward_function_weights is not None and len(self.reward_function_weights) != len(
            self.reward_functions or []
        ):
            raise ConfigError(
                f"reward_function_weights has {len(self.reward_function_weights)} entries but reward_functions has "
                f"{len(self.reward_functions or [])}: give one weight per function"
            )
        if self.reward_model_multiplier and not self.reward_model_path:
            raise ConfigError(
                f"reward_model_multiplier {self.reward_model_multiplier} is set but reward_model_path is not"
            )

    def _validate_variants(self) -> None:
        """advantage_estimator, policy_loss and kl_estimator name registered rows or the user's functions (imported
        now); every algo_kwargs key is taken by one of them."""
        import difflib

        from open_instruct import user_code

        taken: set[str] = set()
        for option, (positional, returns) in rl_algorithms.CALLS.items():
            row = rl_algorithms.resolve(option, getattr(self, option))
            if row.function is None:
                continue
            what = f"{option} {getattr(self, option)!r}"
            clash = sorted(set(self.algo_kwargs) & set(getattr(row, "settings", ())))
            if clash:  # the run's setting is what the function gets: an algo_kwargs entry would be dropped unseen
                flags = " ".join(f"--{k} VALUE" for k in clash)
                raise ConfigError(
                    f"algo_kwargs {clash}: {what} receives {clash} from the run's settings, never from algo_kwargs; "
                    f"set them as settings ({flags})"
                )
            user_code.check_signature(row.function, what, positional, returns, getattr(row, "settings", ()))
            kwargs = rl_algorithms.variant_kwargs(option, row, self.algo_kwargs)
            user_code.check_keyword_types(row.function, kwargs, what)
            if getattr(row.function, "__module__", None) != rl_algorithms.__name__:  # the user's: probe its return
                rl_algorithms.probe(option, row, self, kwargs, what)
            takes = rl_algorithms.accepted_kwargs(row.function, len(positional))
            taken |= set(self.algo_kwargs) if takes is None else takes
        unused = sorted(set(self.algo_kwargs) - taken)
        if unused:
            chosen = ", ".join(f"{o} {getattr(self, o)}" for o in rl_algorithms.CALLS)
            close = {k: difflib.get_close_matches(k, sorted(taken), n=1, cutoff=0.6) for k in unused}
            hints = "".join(f"; did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
            raise ConfigError(
                f"algo_kwargs {unused} is taken by none of {chosen}{hints}: the built-ins take none; a function of "
                "your own takes them as keyword parameters (def my_loss(x, alpha=1.0)): docs/extending.md"
            )

    def _validate_ptx(self) -> None:
        """A demonstrations' loss needs both its data and a weight (ptx.py)."""
        _check_positive(self, "ptx_coef", allow_zero=True)
        if self.ptx_coef > 0 and not self.ptx_dataset:
            raise ConfigError(f"ptx_coef {self.ptx_coef} needs ptx_dataset (the SFT rows whose loss it weighs)")
        if self.ptx_dataset and self.ptx_coef == 0:
            raise ConfigError(f"ptx_dataset {self.ptx_dataset!r} is set but ptx_coef is 0: give its loss a weight > 0")

    def _validate_teacher_models(self) -> None:
        """teacher_models: one way of naming teachers, each a path; several route rows, under reverse_kl."""
        if not self.teacher_models:
            return
        if self.teacher_model_name_or_path:
            raise ConfigError(
                "teacher_model_name_or_path and teacher_models are both set: name one teacher with the first, or "
                "every teacher (the single one too) in teacher_models"
            )
        bad = {name: path for name, path in self.teacher_models.items() if not isinstance(path, str) or not path}
        if bad:
            raise ConfigError(f"teacher_models must map each teacher name to a model path, got {bad}")
        if len(self.teacher_models) > 1 and self.distill_loss != "reverse_kl":
            raise ConfigError(
                f"teacher_models with {len(self.teacher_models)} teachers needs distill_loss reverse_kl (each row's "
                f"own teacher's log-probs as its advantage), not {self.distill_loss}: the JSD loss term reads one "
                "teacher"
            )

    def _validate_distillation(self) -> None:
        """The teacher and its estimator go together; the objective's knobs in range (distillation.check_teacher
        compares the vocabularies, before any model loads)."""
        teachers = ", ".join(name for name, row in ADVANTAGE_ESTIMATORS.items() if row.uses_teacher)
        named = "teacher_models" if self.teacher_models else "teacher_model_name_or_path"
        if self.teacher_model_name_or_path is not None and not self.teacher_model_name_or_path.strip():
            # an empty value would otherwise read as "no teacher" and train plain GRPO
            raise ConfigError(
                f"teacher_model_name_or_path is empty ({self.teacher_model_name_or_path!r}): give the teacher's hub "
                "name or local folder, or leave it unset for a run without a teacher"
            )
        if self.uses_teacher and not self.has_teacher:
            raise ConfigError(
                f"advantage_estimator {self.advantage_estimator} needs teacher_model_name_or_path (or teacher_models)"
            )
        if self.has_teacher and not self.uses_teacher:
            raise ConfigError(
                f"{named} is set but advantage_estimator {self.advantage_estimator} uses no "
                f"teacher: use {teachers} (or leave advantage_estimator unset)"
            )
        self._validate_teacher_models()
        served = [key for key, path in self.teacher_settings() if is_teacher_server(path)]
        if served and self.distill_loss != "reverse_kl":
            raise ConfigError(
                f"{served[0]} is a teacher server, which returns the sampled tokens' log-probs only: distill_loss "
                f"{self.distill_loss} reads the teacher's whole distribution; use reverse_kl or a local teacher"
            )
        if served and self.temperature != 1.0:
            raise ConfigError(
                f"{served[0]} is a teacher server, whose log-probs of given tokens vLLM computes at temperature 1 "
                f"(prompt tokens skip its sampling processors), while this run samples and scores at temperature "
                f"{self.temperature}: sample at temperature 1.0, or load the teacher (a folder or hub name)"
            )
        _check_range(self, "distill_jsd_beta", 0.0, 1.0)
        _check_positive(self, "teacher_kl_weight", allow_zero=True)
        _check_positive(self, "distill_reward_weight", allow_zero=True)
        if self.distill_top_k is not None:
            _check_positive(self, "distill_top_k")
            if self.distill_loss != "jsd":
                raise ConfigError(f"distill_top_k applies to distill_loss jsd, not {self.distill_loss}")
        if self.uses_teacher and self.distill_group_baseline and self.num_samples_per_prompt < 2:
            raise ConfigError(
                f"distill_group_baseline needs num_samples_per_prompt >= 2 (a group of "
                f"{self.num_samples_per_prompt} centres every score to 0)"
            )

    def _validate_environment(self) -> None:
        """The multi-turn knobs (their values; preflight.py resolves the environment and its tools)."""
        if self.environment is not None and (not isinstance(self.environment, str) or not self.environment.strip()):
            raise ConfigError(f"environment must be a registered name or an import path, got {self.environment!r}")
        if not self.tools or any(not isinstance(t, str) or not t.strip() for t in self.tools):
            raise ConfigError(f"tools must be a non-empty list of tool names, got {self.tools!r}")
        _check_positive(self, "max_turns")
        _check_positive(self, "max_tool_calls", allow_zero=True)
        _check_positive(self, "tool_output_max_tokens")
        _check_positive(self, "tool_timeout")
        _check_positive(self, "environment_timeout")
        for name in ("max_turns", "max_tool_calls", "tool_output_max_tokens"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_turn_tokens is not None:
            _check_positive(self, "max_turn_tokens")
            if self.max_turn_tokens > self.response_length:
                raise ConfigError(
                    f"max_turn_tokens {self.max_turn_tokens} exceeds response_length {self.response_length} (the "
                    f"budget of the whole response, observations included)"
                )
        if self.environment is not None and self.score_placement == "after_last_token":
            raise ConfigError(
                "score_placement after_last_token is single-turn only: with an environment the rewards sit on each "
                "turn's last policy token (turn_reward_aggregation)"
            )

    def batch_plan(self, world_size: int, num_examples: Optional[int]) -> BatchPlan:
        return rl_batch_plan(
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            world_size=world_size,
            local_rollout_batch_size=self.local_rollout_batch_size,
            num_samples_per_prompt=self.num_samples_per_prompt,
            num_epochs=self.num_epochs,
            total_episodes=self.total_episodes,
            num_examples=num_examples,
            group_size=self.num_samples_per_prompt if self.uses_groups else None,
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch or None,
        )


CONFIG_CLASSES: dict[str, type[BaseConfig]] = {
    "sft": SFTConfig,
    "reward_model": RewardModelConfig,
    "dpo": DPOConfig,
    "rlvr_ppo": RLVRConfig,
}


def settings_by_topic(cls: type) -> list[tuple[str, str, list[str]]]:
    """[(topic, what it covers, the script's setting names in declaration order), ...] in TOPICS' order, topics
    without a setting of this script left out. A field declared without `setting` comes last under "other" (never
    hidden; tests/test_config_plan.py fails for it)."""
    by_topic: dict[str, list[str]] = {}
    for f in dataclasses.fields(cls):
        by_topic.setdefault(f.metadata.get("topic", "other"), []).append(f.name)
    groups = [(topic, about, by_topic[topic]) for topic, about in TOPICS.items() if topic in by_topic]
    return groups + ([("other", "settings without a topic yet", by_topic["other"])] if "other" in by_topic else [])


def declared_settings(cls: type, **metadata: Any) -> list[str]:
    """The names of cls's settings declared with these metadata values, e.g. resume="must_match", loads="code"."""
    return [f.name for f in dataclasses.fields(cls) if all(f.metadata.get(k) == v for k, v in metadata.items())]


class _RecipeDumper(yaml.SafeDumper):
    """One key a line (block style), a list value on its key's line: `stop_strings: [a, b]`."""


_RecipeDumper.add_representer(
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True)
)


def config_yaml(cfg: Any) -> str:
    """The resolved config (every option, defaults and derived values filled in) as a recipe: `script.py
    config.yaml` repeats the run. One flat mapping, its keys grouped by topic, a comment heading each group. The
    decisions of one command (NOT_SAVED) are left out: what --dry_run prints is the file the run it planned saves."""
    values = dataclasses.asdict(cfg)
    parts = []
    for topic, about, keys in settings_by_topic(type(cfg)):
        saved = [k for k in keys if k not in NOT_SAVED]
        if not saved:
            continue
        body = yaml.dump({k: values[k] for k in saved}, Dumper=_RecipeDumper, sort_keys=False, width=120)
        parts.append(f"# --- {topic}: {about}\n{body}")
    return "\n".join(parts)


def _declared_by(part: str) -> dict[tuple[str, Any], list[str]]:
    """(setting, what its declaration says for `part`, e.g. its topic) -> the scripts declaring it so, the settings
    in reading order (those of the first script first)."""
    found: dict[tuple[str, Any], list[str]] = {}
    for script, cls in CONFIG_CLASSES.items():
        for f in dataclasses.fields(cls):
            found.setdefault((f.name, f.metadata.get(part)), []).append(script)
    return found


def _settings_cell(settings: list[tuple[str, list[str]]]) -> str:
    """Settings with the scripts that have them: those every script has first, then those of some after their
    names."""
    by_scripts: dict[str, list[str]] = {}
    for name, scripts in settings:
        prefix = "" if len(scripts) == len(CONFIG_CLASSES) else " and ".join(scripts) + ": "
        by_scripts.setdefault(prefix, []).append(f"`{name}`")
    return "; ".join(prefix + ", ".join(names) for prefix, names in sorted(by_scripts.items()))


def settings_table() -> str:
    """docs/running.md's table of every setting by topic: those every script has first, then those of some scripts
    after the scripts' names (tests/test_config_plan.py checks the page holds this table)."""
    declared = _declared_by("topic")
    lines = ["| topic | what it covers | settings |", "|---|---|---|"]
    for topic, about in TOPICS.items():
        cell = _settings_cell([(name, scripts) for (name, value), scripts in declared.items() if value == topic])
        lines.append(f"| {topic} | {about} | {cell} |")
    return "\n".join(lines)


def resume_table() -> str:
    """docs/reliability.md's tables of how a resume treats each setting and of the settings whose loaded files it
    compares by content, from their declarations (tests/test_resume_settings.py checks the page holds them)."""
    declared = _declared_by("resume")
    lines = ["| a change on resume is | settings |", "|---|---|"]
    for kind, about in RESUME_KINDS.items():
        cell = _settings_cell([(name, scripts) for (name, value), scripts in declared.items() if value == kind])
        lines.append(f"| `{kind}`: {about} | {cell} |")
    lines += ["", "| setting | loads again on resume | resume key of their content |", "|---|---|---|"]
    for (name, loads), scripts in _declared_by("loads").items():
        if loads:
            (key,) = [
                f.metadata["content_key"] for f in dataclasses.fields(CONFIG_CLASSES[scripts[0]]) if f.name == name
            ]
            lines.append(f"| {_settings_cell([(name, scripts)])} | {loads} | `{key}` |")
    return "\n".join(lines)


def _all_settings() -> list[str]:
    return list(dict.fromkeys(name for cls in CONFIG_CLASSES.values() for name in _field_names(cls)))


def help_text(cls: type) -> str:
    """`--help`: every setting of the script with its type, default and help text, grouped by topic."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(
        prog=f"{_script_of(cls)}.py",
        usage="%(prog)s [RECIPE.yaml] [--key value ...]",
        description=(
            "Options come from the YAML recipe (first argument, optional) and then from --key value overrides (the "
            "last value wins). Booleans take true/false; `null` unsets an optional key. Every option, by topic:"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
    )
    for topic, about, keys in settings_by_topic(cls):
        group = parser.add_argument_group(topic, about)
        for key in keys:
            f = fields[key]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            flags = [f"--{key}"] + ([f"--{key.replace('_', '-')}"] if "_" in key else [])  # both are accepted
            about_key = f.metadata["help"]
            if key in ("dataset_name_or_path", "environment") and "environment" in fields:  # the RL scripts'
                about_key += " " + integrations.spec_forms()
            group.add_argument(*flags, metavar=_metavar(hints[key]), default=default, help=about_key)
            negated = f"no_{key}"  # a boolean that defaults to true also takes --no_<key>
            if negated in _accepted_keys(cls):
                group.add_argument(
                    f"--{negated}", action="store_true", default=argparse.SUPPRESS, help=f"--{key} false."
                )
    return parser.format_help()


def _metavar(hint: Any) -> str:
    """How --help shows a setting's value: its choices, type, or a list of them."""
    types = [t for t in (typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,))]
    types = [t for t in types if t is not type(None)]
    (kind,) = types
    if typing.get_origin(kind) is Literal:
        return "{" + ",".join(map(str, typing.get_args(kind))) + "}"
    if typing.get_origin(kind) is list:
        return f"{_metavar(typing.get_args(kind)[0])} [...]"
    if kind is dict or typing.get_origin(kind) is dict:
        return "NAME=VALUE [...]"
    return getattr(kind, "__name__", str(kind)).upper()


# ---------------------------------------------------------------------------------------------------------------------
# Checks


def is_teacher_server(teacher: Any) -> bool:
    """A distillation teacher given as the URL of a running server (teacher_server.py) rather than a model."""
    return isinstance(teacher, str) and teacher.strip().startswith(("http://", "https://"))


def _check_positive(cfg: Any, name: str, allow_zero: bool = False) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_choice(cfg: Any, name: str, table: dict[str, Any]) -> None:
    """ConfigError unless the field names a row of `table` (the closest row suggested)."""
    value = getattr(cfg, name)
    if value not in table:
        close = difflib.get_close_matches(str(value), list(table), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name} {value!r} is not one of {list(table)}{hint}")


def _check_range(cfg: Any, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    value = getattr(cfg, name)
    ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ConfigError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}")


# ---------------------------------------------------------------------------------------------------------------------
# Parsing


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _unknown_key_line(key: str, valid: Sequence[str], where: str, script: str, given: dict[str, Any]) -> str:
    """Names other libraries use get the porting table's answer (flag_names.py); others the closest valid key."""
    known = flag_names.hint(key, valid, script, given)
    if known:
        return f"unknown key {key!r} in {where}: {known}"
    close = difflib.get_close_matches(key, valid, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown key {key!r} in {where}{hint}"


def _unknown_keys_error(unknown: list[tuple[str, str]], valid: Sequence[str], script: str, given: dict) -> ConfigError:
    """One error listing every unknown key of the run (recipe and command line), each with its hint, and for a
    TRL GRPO recipe what differs here (flag_names.trl_port_notice): a port takes one pass, not one run per key."""
    lines = [_unknown_key_line(key, valid, where, script, given) for key, where in unknown]
    notice = flag_names.trl_port_notice([key for key, _ in unknown], script, given)
    text = lines[0] if len(lines) == 1 else f"{len(lines)} unknown keys:\n  " + "\n  ".join(lines)
    return ConfigError(text + (f"\n{notice}" if notice else ""))


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested recipe mapping (verl's hydra groups) as dotted keys, so each gets its own hint."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _yaml_value_tokens(key: str, value: Any) -> list[str]:
    """One recipe value as the argv tokens after `--key` (so argparse type-checks recipe and command line alike)."""
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, dict):
        raise ConfigError(f"key {key!r}: nested mappings are not supported in recipes, got {value!r}")
    return [str(value)]


def _scalar(text: str) -> Any:
    """A command-line value as YAML reads it, with `3e-1` a number (YAML 1.1 wants `3.0e-1`)."""
    value = yaml.safe_load(text) if text else ""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _mapping_value(key: str, value: Any, where: str) -> dict[str, Any]:
    """A mapping option (algo_kwargs): a YAML mapping, or on the command line `name=value ...` or one JSON/YAML
    mapping `{name: value}`; values read as YAML scalars (numbers, booleans, strings)."""
    if isinstance(value, dict):
        mapping = value
    else:
        tokens = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(t, str) for t in tokens):
            raise ConfigError(
                f"{key} in {where} must be a mapping of argument names to values (e.g. {{alpha: 0.5}}, or on the "
                f"command line --{key} alpha=0.5), got {value!r}"
            )
        if len(tokens) == 1 and tokens[0].strip().startswith("{"):
            try:
                mapping = json.loads(tokens[0])
            except ValueError:
                mapping = None
            try:
                mapping = yaml.safe_load(tokens[0]) if mapping is None else mapping
            except yaml.YAMLError as e:
                raise ConfigError(f"{key} in {where}: not a mapping: {e}") from None
        else:
            mapping = {}
            for token in tokens:
                name, sep, text = token.partition("=")
                if not sep or not name.isidentifier():
                    raise ConfigError(f"{key} in {where}: {token!r} is not name=value (e.g. --{key} alpha=0.5)")
                mapping[name] = _scalar(text)
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and k.isidentifier() for k in mapping):
        raise ConfigError(f"{key} in {where} must map argument names to values, got {value!r}")
    return mapping


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last value silently)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(
                f"recipe {key_node.start_mark.name}: key {key!r} is given twice (line {seen[key]} and line {line})"
            )
        seen[key] = line
        if value_node.tag == "tag:yaml.org,2002:float":  # `1.0e-400` reads as 0.0
            _check_no_underflow(str(key), value_node.value, f"recipe {key_node.start_mark.name} line {line}")
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


# Decisions about one command, never a recipe's: refused in a recipe file (set true), left out of the saved
# config.yaml (so is dry_run: the saved config and the --dry_run print repeat the run, not the dry run).
COMMAND_LINE_ONLY = ("overwrite_output_dir", "delete_finished_run")
NOT_SAVED = (*COMMAND_LINE_ONLY, "dry_run")


def load_recipe(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"recipe file {path!r} does not exist")
    with open(path) as f:
        try:
            recipe = yaml.load(f, Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path}: not valid YAML: {e}") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {path}: top level must be a mapping of key: value, got {type(recipe).__name__}")
    for key in COMMAND_LINE_ONLY:  # a recipe never deletes a run; `false` (an older saved config.yaml) is harmless
        if recipe.get(key) not in (None, False):
            raise ConfigError(
                f"recipe {path} sets {key}: {recipe[key]!r}, which only the command line may set (a recipe or a "
                f"saved config.yaml replayed must not clear a run): remove it and pass --{key} true if you mean it"
            )
        recipe.pop(key, None)
    return recipe


def _is_key(token: str) -> bool:
    """`--name` or `--name=value` (a value may start with dashes too: `-----`, `-1e-8`)."""
    return re.match(r"--[A-Za-z_][\w.-]*(=|$)", token) is not None


def _value_kinds(cls: type) -> dict[str, str]:
    """Each field's kind of value: "list" (takes every token up to the next key), "mapping" (likewise, read as
    name=value pairs), "float", or "one"."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        types = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
        if any(typing.get_origin(t) is list for t in types):
            kinds[name] = "list"
        elif any(t is dict or typing.get_origin(t) is dict for t in types):
            kinds[name] = "mapping"
        else:
            kinds[name] = "float" if float in types else "one"
    return kinds


def _misplaced_recipe(argv: Sequence[str], kinds: dict[str, str]) -> Optional[str]:
    """A .yaml/.yml token that no scalar key takes as its value: a recipe placed after the options (only the first
    argument is read as one). `--exp_name ablation.yaml` is a value; in a list key's values it is not (a stop string
    or module named x.yaml is far less likely than a misplaced recipe)."""
    takes = 0  # tokens the current key still takes: 1 (a scalar), -1 (a list: up to the next key), 0 (none)
    for token in argv:
        if _is_key(token):
            key = _option_key(token)
            takes = 0 if "=" in token or key not in kinds else (-1 if kinds[key] in ("list", "mapping") else 1)
            continue
        is_recipe = token.endswith((".yaml", ".yml"))
        if takes == 1:
            takes = 0
            continue
        if is_recipe:
            return token
    return None


def _check_no_underflow(key: str, text: str, where: str) -> None:
    """A float written with non-zero digits that reads as 0.0 (`1e-400`) is refused, not silently zero."""
    try:
        value = float(text)
    except ValueError:
        return  # argparse names the bad value
    if value == 0 and re.search(r"[1-9]", re.split(r"[eE]", text)[0]):
        raise ConfigError(f"{key} {text} underflows to 0.0 in floating point ({where}); write 0 if 0 is meant")


def _option_key(token: str) -> str:
    """`--learning-rate=1e-4` -> `learning_rate` (the dashed aliases that --help lists are accepted)."""
    return token[2:].split("=", 1)[0].replace("-", "_")


def _accepted_keys(cls: type) -> set[str]:
    """Field names, plus `no_<name>` for booleans that default to True (HfArgumentParser adds those flags)."""
    fields = dataclasses.fields(cls)
    return {f.name for f in fields} | {f"no_{f.name}" for f in fields if f.type in ("bool", bool) and f.default is True}


def _script_of(cls: type) -> str:
    return next(f.default for f in dataclasses.fields(cls) if f.name == "script")


def _parser(cls: type) -> Any:
    """transformers' HfArgumentParser for `cls`: it converts and checks each scalar value (types, choices,
    booleans). Errors raise argparse.ArgumentError (exit_on_error=False) instead of exiting."""
    from transformers import HfArgumentParser  # light: does not import torch

    # The parser passes a field's metadata on to argparse, which takes its help only: it reads a copy of the
    # dataclass whose fields carry that alone (the declaration's other parts are this module's).
    hints = typing.get_type_hints(cls)
    plain = dataclasses.make_dataclass(
        cls.__name__,
        [
            (f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory, metadata={"help": ""}))
            for f in dataclasses.fields(cls)
        ],
    )
    return HfArgumentParser(plain, prog=f"{_script_of(cls)}.py", exit_on_error=False)


def _cli_assignments(argv: Sequence[str]) -> list[tuple[str, str, list[str]]]:
    """`--key v1 v2 --flag --other=v` -> [(key, flag as written, values), ...] in order; `--key=value` is the flag
    with one value. Tokens before the first key are kept under key "" (argparse reports them)."""
    out: list[tuple[str, str, list[str]]] = []
    for token in argv:
        if _is_key(token):
            flag, sep, value = token.partition("=")
            out.append((_option_key(flag), flag, [value] if sep else []))
        elif out:
            out[-1][2].append(token)
        else:
            out.append(("", "", [token]))
    return out


NULL_TOKENS = ("null", "None", "none", "~")


@dataclass
class _Sources:
    """What a run was given: the recipe (its path and mapping) and the command line's assignments in order."""

    recipe_path: Optional[str]
    recipe: dict[str, Any]
    cli: list[tuple[str, str, list[str]]]


def _read_sources(cls: type, argv: list[str]) -> _Sources:
    """The recipe (the first argument, if not an option) and the `--key value` assignments after it; a recipe placed
    after the options, or one written for another script, is refused."""
    recipe: dict[str, Any] = {}
    recipe_path = None
    if argv and not argv[0].startswith("-"):
        recipe_path = argv.pop(0)
        recipe = load_recipe(recipe_path)
    late_recipe = _misplaced_recipe(argv, _value_kinds(cls))
    if late_recipe is not None:
        raise ConfigError(
            f"{late_recipe!r} looks like a recipe file after the --key value options: the recipe comes first "
            f"(script.py {late_recipe} [--key value ...])"
        )
    script = _script_of(cls)
    if recipe.get("script", script) != script:
        raise ConfigError(f"recipe {recipe_path} is for script {recipe['script']!r}, not {script!r}")
    return _Sources(recipe_path, recipe, _cli_assignments(argv))


def _check_known_keys(cls: type, sources: _Sources) -> None:
    """Every unknown key at once, recipe (nested groups as dotted names) and command line, with every value given,
    so that hints which depend on another foreign key (max_steps and num_iterations) can use it."""
    valid = _field_names(cls)
    accepted = _accepted_keys(cls)
    unknown: list[tuple[str, str]] = []
    given: dict[str, Any] = {}
    for key, value in sources.recipe.items():
        if key not in valid:
            flat = _flatten(value, f"{key}.") if isinstance(value, dict) and value else {key: value}
            unknown += [(k, f"recipe {sources.recipe_path}") for k in flat]
            given.update(flat)
        else:
            given[key] = value
    for key, _, values in sources.cli:
        if key and key not in accepted:
            unknown.append((key, "command-line overrides"))
        given[key] = values[0] if len(values) == 1 else values
    if unknown:
        raise _unknown_keys_error(list(dict.fromkeys(unknown)), valid, _script_of(cls), given)


# One key's assignment: ("tokens", flag as written, value tokens) for the parser to convert, or ("value", a Python
# value) set as it is.
_Assignment = tuple


def _recipe_assignment(key: str, value: Any, kind: str, where: str) -> _Assignment:
    if value is None or kind == "mapping":
        return ("value", None if value is None else _mapping_value(key, value, where))
    if isinstance(value, list) and kind != "list":
        raise ConfigError(f"{where}: key {key!r} takes one value, got the list {value!r}")
    if isinstance(value, str) and kind == "float":  # `1e-400` (YAML reads it as a string)
        _check_no_underflow(key, value, where)
    return ("tokens", f"--{key}", _yaml_value_tokens(key, value))


def _cli_assignment(key: str, flag: str, values: list[str], kind: Optional[str], optional: bool) -> _Assignment:
    if kind == "float" and values:  # 1e-400 would silently become 0.0
        _check_no_underflow(key, values[0], "command line")
    if optional and len(values) == 1 and values[0] in NULL_TOKENS:
        return ("value", None)
    if kind == "mapping":
        return ("value", _mapping_value(key, values, "the command line"))
    return ("tokens", flag, values)


def _merged_assignments(cls: type, sources: _Sources) -> tuple[dict[str, _Assignment], list[str]]:
    """key -> its last assignment: the recipe's first, then the command line's in order, each replacing the key's
    earlier one (`null` unsets an optional key). Also the stray tokens before the first --key."""
    kinds = _value_kinds(cls)
    hints = typing.get_type_hints(cls)
    # From the class annotations, not Field.type: HfArgumentParser rewrites Field.type in place (Optional[str] ->
    # str), so a second parse in the same process would no longer see which keys are optional.
    optional = {f.name for f in dataclasses.fields(cls) if type(None) in typing.get_args(hints[f.name])}
    merged: dict[str, _Assignment] = {}
    for key, value in sources.recipe.items():
        merged[key] = _recipe_assignment(key, value, kinds[key], f"recipe {sources.recipe_path}")
    stray: list[str] = []
    for key, flag, values in sources.cli:
        if not key:
            stray += values
            continue
        base = key[3:] if key not in kinds and key.startswith("no_") else key
        merged.pop(base, None)  # dict order follows the last assignment
        merged[base] = _cli_assignment(key, flag, values, kinds.get(key), key in optional)
    return merged, stray


def _list_value(key: str, tokens: list[str], hint: Any) -> list[Any]:
    """A list option's tokens as its element type (argparse's wording for a bad one). Converted here, not by
    argparse, which would read a token starting with '-' (`--stop_strings -----`) as an option."""
    if not tokens:
        raise ConfigError(f"argument {_argument_name(key)}: expected at least one argument")
    (item,) = typing.get_args(next(t for t in (*typing.get_args(hint), hint) if typing.get_origin(t) is list))
    try:
        return [item(t) for t in tokens]
    except ValueError:
        bad = next(t for t in tokens if not _converts(item, t))
        raise ConfigError(f"argument {_argument_name(key)}: invalid {item.__name__} value: {bad!r}") from None


def _argument_name(key: str) -> str:
    """How argparse names an option in its errors: the flag, then its dashed alias after a slash."""
    return f"--{key}" + (f"/--{key.replace('_', '-')}" if "_" in key else "")


def _converts(convert: Any, token: str) -> bool:
    try:
        convert(token)
    except ValueError:
        return False
    return True


def _build(cls: type[T], merged: dict[str, _Assignment], stray: list[str]) -> T:
    """The config from the merged assignments: python values and lists set as they are, every scalar converted and
    checked by the parser. A scalar goes in as `--key=value`, so a value starting with '-' (`-1e-8`, `-----`) stays
    a value."""
    kinds = _value_kinds(cls)
    hints = typing.get_type_hints(cls)
    preset: dict[str, Any] = {}
    tokens: list[str] = list(stray)
    for key, entry in merged.items():
        if entry[0] == "value":
            preset[key] = entry[1]
        elif kinds.get(key) == "list":
            preset[key] = _list_value(key, entry[2], hints[key])
        elif len(entry[2]) == 0:
            tokens.append(entry[1])  # a flag alone: `--dry_run`, `--no_save_final_model`
        else:
            tokens += [f"{entry[1]}={entry[2][0]}", *entry[2][1:]]  # extra values: reported as not used

    parser = _parser(cls)
    parser.set_defaults(**preset)  # set as they are (argparse converts only tokens)
    try:
        (values,) = parser.parse_args_into_dataclasses(args=tokens)
        config = cls(**vars(values))
    except ConfigError:  # a check of the config itself (__post_init__)
        raise
    except (argparse.ArgumentError, TypeError, ValueError) as e:  # a value the parser could not convert
        raise ConfigError(str(e)) from None
    return config


def parse_config(cls: type[T], argv: Optional[Sequence[str]] = None) -> T:
    """Parse `[RECIPE.yaml] [--key value ...]` into `cls`. Raises ConfigError (see `parse_or_exit`); `-h`/`--help`
    prints every option, grouped by topic, with its help text and exits 0.

    The recipe's values come first and each `--key value` (or `--key=value`) after them replaces the key's earlier
    value: the last one wins, `null` included (it unsets an optional key). Every unknown key of the recipe and of
    the command line is reported in one error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(cls))
        raise SystemExit(0)
    sources = _read_sources(cls, argv)
    _check_known_keys(cls, sources)
    merged, stray = _merged_assignments(cls, sources)
    return _build(cls, merged, stray)


def parse_or_exit(cls: type[T], argv: Optional[Sequence[str]] = None) -> T:
    """Script entry point: parse, and on any configuration error print it and exit with status 2."""
    try:
        return parse_config(cls, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
