"""Configuration: one dataclass per script, read from a YAML recipe plus `--key value` overrides.

    python open_instruct/dpo.py configs/dpo_8b.yaml --learning_rate 1e-6

Parsing uses transformers' HfArgumentParser. YAML values are turned into command-line tokens placed before the
user's overrides, so both go through the same argparse type checks and the last value wins. Unknown keys,
wrong types and invalid values stop the run with exit status 2 and a message naming the key, before torch or
any model is imported. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, TypeVar

import yaml

from open_instruct.batch_math import BatchPlan, rl_batch_plan, supervised_batch_plan
from open_instruct.errors import ConfigError
from open_instruct.mixture import parse_mixer_list

T = TypeVar("T")


@dataclass
class BaseConfig:
    """Knobs every script shares. Batch terms follow the glossary in open_instruct/batch_math.py."""

    # --- what runs
    script: str = field(
        default="", metadata={"help": "Which script this recipe is for (sft, reward_model, dpo, rlvr_ppo)."}
    )
    exp_name: str = "run"
    output_dir: str = "output/run"
    seed: int = 1
    dry_run: bool = field(default=False, metadata={"help": "Print the plan (batch math, steps, time) and exit."})

    # --- model
    model_name_or_path: str = ""
    tokenizer_name_or_path: Optional[str] = None
    model_revision: Optional[str] = None
    gguf_file: Optional[str] = field(
        default=None, metadata={"help": "Load weights from this GGUF file in the model folder."}
    )
    trust_remote_code: bool = False
    chat_template: Optional[str] = field(
        default=None, metadata={"help": "Jinja chat template to use if the tokenizer has none."}
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    activation_checkpointing: bool = False
    fsdp_cpu_offload: bool = field(
        default=False, metadata={"help": "Under FSDP: keep parameters, gradients and optimizer state in host memory."}
    )

    # --- LoRA (peft; open_instruct/lora.py)
    use_lora: bool = field(
        default=False,
        metadata={
            "help": "Train LoRA adapters (peft) instead of all weights: the trained model (the RL policy and PPO "
            "value model too) gets low-rank adapters, a scalar head stays fully trained."
        },
    )
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha: the update B@A is scaled by alpha / r."})
    lora_dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the LoRA input (DPO and RL turn all dropout off, this one too)."}
    )
    lora_target_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Module names to adapt (e.g. q_proj v_proj); unset: every linear layer but the output head."},
    )
    lora_save: Literal["merged", "adapter"] = field(
        default="merged",
        metadata={
            "help": "final_model/ and best_model/ hold the merged model (plain HF format, no peft needed) or only "
            "the adapter (load with peft)."
        },
    )

    # --- data
    dataset_name_or_path: str = field(
        default="",
        metadata={
            "help": "Hub dataset name, or local .jsonl/.json/.parquet file(s), comma separated (all rows of each). "
            "Or use dataset_mixer_list."
        },
    )
    dataset_mixer_list: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "A mixture instead of dataset_name_or_path: source, amount, source, amount, ... An amount with "
            "a decimal point is a fraction of that source (1.0 = all rows), an integer >= 2 a row count (above "
            "the size: repeats). Rows are drawn from the seed; see open_instruct/mixture.py."
        },
    )
    dataset_split: str = "train"
    eval_dataset_name_or_path: Optional[str] = None
    eval_dataset_mixer_list: Optional[list[str]] = field(
        default=None, metadata={"help": "The held-out set as a mixture (same form as dataset_mixer_list)."}
    )
    eval_dataset_split: str = "test"
    eval_fraction: float = field(
        default=0.0,
        metadata={"help": "Hold out this fraction of the train set for eval when no eval dataset is given."},
    )
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    max_seq_length: int = 2048
    overlong: Literal["drop", "truncate"] = "drop"
    skip_bad_rows: bool = False

    # --- optimisation
    learning_rate: float = 1e-5
    lr_scheduler_type: Literal["linear", "constant", "cosine", "constant_with_warmup"] = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    per_device_eval_batch_size: int = 8
    num_train_epochs: float = 1.0
    total_episodes: Optional[int] = None
    on_nonfinite: Literal["stop", "skip"] = field(
        default="stop", metadata={"help": "On a NaN/inf loss or gradient: stop the run, or skip that update."}
    )

    # --- logging, eval, checkpoints
    logging_steps: int = 1
    eval_steps: Optional[int] = None
    checkpointing_steps: Optional[int] = None
    keep_last_n_checkpoints: int = 2
    best_metric: Optional[str] = field(
        default=None, metadata={"help": "Eval metric that picks the best checkpoint (e.g. eval/accuracy)."}
    )
    best_metric_mode: Literal["max", "min"] = "max"
    resume_from_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "'auto' (latest valid in output_dir) or a checkpoint path."}
    )
    save_final_model: bool = True
    with_tracking: bool = False
    wandb_project: str = "open_instruct"
    wandb_entity: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Value checks that need no dataset and no model. Subclasses extend it."""
        _check_positive(self, "learning_rate", allow_zero=True)
        _check_positive(self, "per_device_train_batch_size")
        _check_positive(self, "gradient_accumulation_steps")
        _check_positive(self, "per_device_eval_batch_size")
        _check_positive(self, "max_seq_length")
        _check_positive(self, "num_train_epochs")
        _check_positive(self, "logging_steps")
        _check_positive(self, "keep_last_n_checkpoints")
        for name in ("total_episodes", "eval_steps", "checkpointing_steps", "max_train_samples", "max_eval_samples"):
            if getattr(self, name) is not None:
                _check_positive(self, name)
        _check_range(self, "warmup_ratio", 0.0, 1.0)
        _check_range(self, "eval_fraction", 0.0, 0.9)
        _check_range(self, "adam_beta1", 0.0, 1.0, high_open=True)
        _check_range(self, "adam_beta2", 0.0, 1.0, high_open=True)
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        _check_positive(self, "lora_rank")
        _check_positive(self, "lora_alpha")
        _check_range(self, "lora_dropout", 0.0, 1.0, high_open=True)
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise ConfigError("lora_target_modules must name at least one module (or be unset: all linear layers)")
        if self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not self.model_name_or_path:
            raise ConfigError("model_name_or_path is required (a hub name or a local folder)")
        self._validate_data_sources()
        if self.best_metric is not None and not self.eval_steps:
            raise ConfigError(f"best_metric {self.best_metric!r} needs eval_steps (evaluation never runs without it)")
        if self.eval_steps and not (
            self.eval_dataset_name_or_path or self.eval_dataset_mixer_list or self.eval_fraction
        ):
            raise ConfigError(
                "eval_steps is set but there is no eval data: set eval_dataset_name_or_path, eval_dataset_mixer_list "
                "or eval_fraction"
            )

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
        )


@dataclass
class SFTConfig(BaseConfig):
    script: str = "sft"
    messages_column: str = "messages"
    learning_rate: float = 5e-6


@dataclass
class PreferenceDataConfig(BaseConfig):
    """Preference rows: `chosen`/`rejected` message lists, or `prompt` + `chosen` + `rejected` strings."""

    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    prompt_column: str = "prompt"


@dataclass
class RewardModelConfig(PreferenceDataConfig):
    script: str = "reward_model"
    learning_rate: float = 3e-6
    margin_column: Optional[str] = field(
        default=None,
        metadata={
            "help": "Column holding a per-pair target margin m (a number): loss -log sigmoid(r_c - r_r - m), as "
            "TRL's `margin` column. Unset: m = 0. Every row must then carry a finite number."
        },
    )
    center_rewards_coefficient: float = field(
        default=0.0,
        metadata={
            "help": "Adds coef * mean((r_chosen + r_rejected)^2) to the loss (TRL's center_rewards_coefficient; "
            "0.01 is the value in its docs), keeping rewards centred on 0. 0 = off."
        },
    )

    def validate(self) -> None:
        super().validate()
        _check_positive(self, "center_rewards_coefficient", allow_zero=True)


@dataclass
class DPOConfig(PreferenceDataConfig):
    script: str = "dpo"
    learning_rate: float = 5e-7
    loss_type: Literal["dpo", "dpo_norm", "ipo", "simpo", "wpo"] = "dpo_norm"
    beta: float = 5.0
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Conservative DPO: assumed probability that a label is flipped."}
    )
    gamma_beta_ratio: float = field(default=0.0, metadata={"help": "SimPO target margin gamma, as a ratio of beta."})
    reference_cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Where reference log-probs are cached (default: <output_dir>/../.ref_cache)."}
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


@dataclass
class RLVRConfig(BaseConfig):
    script: str = "rlvr_ppo"
    algo: Literal["ppo", "grpo"] = field(
        default="ppo",
        metadata={
            "help": "Preset: ppo = gae advantages (value model), KL in the reward; grpo = group advantages, KL loss."
        },
    )
    learning_rate: float = 3e-7
    # data: prompt messages, ground truth and verifier name per row
    messages_column: str = "messages"
    ground_truth_column: str = "ground_truth"
    verifier_column: str = "dataset"
    max_prompt_length: int = 512
    # rollouts
    local_rollout_batch_size: int = 8
    num_samples_per_prompt: int = 1
    num_epochs: int = field(default=4, metadata={"help": "PPO/GRPO passes over each rollout."})
    response_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: Optional[list[str]] = None
    generation_backend: Literal["hf", "vllm"] = "hf"
    vllm_gpu_memory_utilization: float = 0.5
    vllm_enable_sleep: bool = False
    # rewards
    verification_reward: float = 10.0
    non_stop_penalty_mode: Literal["add", "replace"] = field(
        default="add", metadata={"help": "add the penalty to the score, or replace the score with it (Tulu 3)."}
    )
    non_stop_penalty: float = field(
        default=0.0,
        metadata={"help": "Added to the score when no EOS/stop string ended the response (Tulu 3: -10). 0 = off."},
    )
    reward_model_path: Optional[str] = None
    reward_model_multiplier: float = 0.0
    verifier_timeout: float = 2.0
    # PPO / GRPO and their variants (formulas in rlvr_ppo.py)
    advantage_estimator: Optional[Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"]] = field(
        default=None,
        metadata={
            "help": "gae (value model), grpo, dr_grpo, rloo (group baselines), reinforce_pp; default: from algo."
        },
    )
    policy_loss: Literal["ppo", "gspo", "cispo"] = field(
        default="ppo",
        metadata={"help": "ppo (token ratio, clip), gspo (sequence ratio, clip), cispo (clipped IS weight)."},
    )
    cliprange_low: Optional[float] = field(default=None, metadata={"help": "Lower clip 1 - low (default: cliprange)."})
    cliprange_high: Optional[float] = field(
        default=None, metadata={"help": "Upper clip 1 + high (default: cliprange); > low is DAPO's clip-higher."}
    )
    dual_clip_c: Optional[float] = field(
        default=None, metadata={"help": "Dual-clip bound c > 1 for A < 0 (off: null)."}
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = field(
        default="token_mean",
        metadata={"help": "How token losses become the mini-batch loss (see aggregation_weights)."},
    )
    loss_norm_length: Optional[int] = field(
        default=None, metadata={"help": "C of seq_mean_token_sum_norm (Dr. GRPO); default: response_length."}
    )
    score_placement: Literal["last_token", "after_last_token"] = field(
        default="last_token",
        metadata={"help": "gae: the score at the last response token, or one after it with a value there (Tulu 3)."},
    )
    filter_zero_std_groups: bool = field(
        default=False, metadata={"help": "Drop groups whose completions all scored the same from the update."}
    )
    overlong_buffer_length: int = field(
        default=0,
        metadata={"help": "DAPO soft overlong punishment over the last N tokens of response_length (0: off)."},
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"help": "Largest overlong punishment (at the limit)."}
    )
    truncated_importance_sampling: bool = field(
        default=False, metadata={"help": "Weight token losses by min(exp(trainer_logp - sampler_logp), tis_cap)."}
    )
    tis_cap: float = field(default=2.0, metadata={"help": "Cap of the truncated importance-sampling weight."})
    value_model_path: Optional[str] = field(
        default=None, metadata={"help": "Initialise the value model from this (reward) model; default: the policy."}
    )
    beta: float = field(default=0.05, metadata={"help": "KL coefficient."})
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    whiten_advantages: bool = True
    # eval: greedy verifiable accuracy on held-out prompts
    eval_response_length: Optional[int] = None
    num_samples_logged: int = 4

    @property
    def uses_value_model(self) -> bool:
        """GAE needs a learned value model; every other estimator is value-free."""
        return self.advantage_estimator == "gae"

    @property
    def uses_groups(self) -> bool:
        """Group baselines (grpo, dr_grpo, rloo): a prompt's completions must stay together."""
        return self.advantage_estimator in ("grpo", "dr_grpo", "rloo")

    @property
    def kl_in_reward(self) -> bool:
        """gae and reinforce_pp put -beta * KL_t in the per-token reward; group estimators add beta * KL as a loss."""
        return self.advantage_estimator in ("gae", "reinforce_pp")

    def validate(self) -> None:
        super().validate()
        for name in (
            "local_rollout_batch_size",
            "num_samples_per_prompt",
            "num_epochs",
            "response_length",
            "max_prompt_length",
        ):
            _check_positive(self, name)
        if self.total_episodes is None:
            raise ConfigError("total_episodes is required for RLVR (completions to train on)")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 for sampling, got {self.temperature}")
        _check_range(self, "top_p", 0.0, 1.0, low_open=True)
        _check_range(self, "gamma", 0.0, 1.0)
        _check_range(self, "lam", 0.0, 1.0)
        _check_range(self, "vllm_gpu_memory_utilization", 0.0, 1.0, low_open=True)
        for name in ("cliprange", "cliprange_value", "verifier_timeout"):
            _check_positive(self, name)
        if self.beta < 0 or self.vf_coef < 0:
            raise ConfigError(f"beta and vf_coef must be >= 0, got beta={self.beta}, vf_coef={self.vf_coef}")
        if self.advantage_estimator is None:  # the preset
            self.advantage_estimator = "gae" if self.algo == "ppo" else "grpo"
        for name in ("cliprange_low", "cliprange_high"):
            if getattr(self, name) is None:
                setattr(self, name, self.cliprange)
            _check_positive(self, name)
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ConfigError(f"dual_clip_c must be > 1 (or null to turn it off), got {self.dual_clip_c}")
        if self.dual_clip_c is not None and self.policy_loss == "cispo":
            raise ConfigError("dual_clip_c applies to policy_loss ppo/gspo, not cispo (its weight is already capped)")
        if self.loss_norm_length is None:
            self.loss_norm_length = self.response_length
        _check_positive(self, "loss_norm_length")
        _check_positive(self, "overlong_buffer_length", allow_zero=True)
        if self.overlong_buffer_length > self.response_length:
            raise ConfigError(
                f"overlong_buffer_length {self.overlong_buffer_length} exceeds response_length {self.response_length}"
            )
        _check_positive(self, "overlong_penalty_factor", allow_zero=True)
        if self.tis_cap < 1:
            raise ConfigError(
                f"tis_cap must be >= 1 (a weight cap below 1 would shrink every token), got {self.tis_cap}"
            )
        if self.uses_groups and self.num_samples_per_prompt < 2:
            raise ConfigError(
                f"advantage_estimator {self.advantage_estimator} needs num_samples_per_prompt >= 2 (group baselines "
                f"of a group of {self.num_samples_per_prompt} are all zero)"
            )
        if self.score_placement == "after_last_token" and self.advantage_estimator != "gae":
            raise ConfigError(
                f"score_placement after_last_token needs advantage_estimator gae (a value there carries the score "
                f"back), not {self.advantage_estimator}"
            )
        if self.filter_zero_std_groups and not self.uses_groups:
            raise ConfigError(
                f"filter_zero_std_groups needs a group estimator (grpo, dr_grpo, rloo), not {self.advantage_estimator}"
            )
        if not self.uses_value_model and self.value_model_path:
            raise ConfigError(
                f"value_model_path is set but advantage_estimator {self.advantage_estimator} uses no value model"
            )
        if self.reward_model_multiplier and not self.reward_model_path:
            raise ConfigError(
                f"reward_model_multiplier {self.reward_model_multiplier} is set but reward_model_path is not"
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
        )


CONFIG_CLASSES: dict[str, type[BaseConfig]] = {
    "sft": SFTConfig,
    "reward_model": RewardModelConfig,
    "dpo": DPOConfig,
    "rlvr_ppo": RLVRConfig,
}


# ---------------------------------------------------------------------------------------------------------------------
# Checks


def _check_positive(cfg: Any, name: str, allow_zero: bool = False) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


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


def _unknown_key_error(key: str, valid: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown key {key!r} in {where}{hint}")


def _yaml_to_tokens(recipe: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """YAML mapping -> argv tokens (so argparse type-checks them); None values become parser defaults."""
    tokens: list[str] = []
    none_defaults: dict[str, Any] = {}
    for key, value in recipe.items():
        if value is None:
            none_defaults[key] = None
        elif isinstance(value, list):
            tokens += [f"--{key}", *[str(v) for v in value]]
        elif isinstance(value, dict):
            raise ConfigError(f"key {key!r}: nested mappings are not supported in recipes, got {value!r}")
        else:
            tokens += [f"--{key}", str(value)]
    return tokens, none_defaults


def load_recipe(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"recipe file {path!r} does not exist")
    with open(path) as f:
        try:
            recipe = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path}: not valid YAML: {e}") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {path}: top level must be a mapping of key: value, got {type(recipe).__name__}")
    return recipe


def parse_config(cls: type[T], argv: Optional[Sequence[str]] = None) -> T:
    """Parse `[RECIPE.yaml] [--key value ...]` into `cls`. Raises ConfigError (see `parse_or_exit`)."""
    from transformers import HfArgumentParser  # light: does not import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    recipe: dict[str, Any] = {}
    recipe_path = None
    if argv and not argv[0].startswith("-"):
        recipe_path = argv.pop(0)
        recipe = load_recipe(recipe_path)
    expected_script = next(f.default for f in dataclasses.fields(cls) if f.name == "script")
    if recipe.get("script", expected_script) != expected_script:
        raise ConfigError(f"recipe {recipe_path} is for script {recipe['script']!r}, not {expected_script!r}")
    valid = _field_names(cls)
    for key in recipe:
        if key not in valid:
            raise _unknown_key_error(key, valid, f"recipe {recipe_path}")
    for token in argv:
        if token.startswith("--"):
            key = token[2:].split("=", 1)[0]
            if key not in valid:
                raise _unknown_key_error(key, valid, "command-line overrides")

    # `--key null` / `--key None` unsets an optional key (argparse would read it as the string "null").
    # From the class annotations, not Field.type: HfArgumentParser rewrites Field.type in place (Optional[str] ->
    # str), so a second parse in the same process would no longer see which keys are optional.
    hints = typing.get_type_hints(cls)
    optional = {f.name for f in dataclasses.fields(cls) if type(None) in typing.get_args(hints[f.name])}
    for i, token in enumerate(argv[:-1]):
        key = token[2:]
        if token.startswith("--") and key in optional and argv[i + 1] in ("null", "None", "none", "~"):
            recipe[key] = None
            argv[i : i + 2] = [None, None]
    argv = [t for t in argv if t is not None]
    recipe_tokens, none_defaults = _yaml_to_tokens(recipe)
    parser = HfArgumentParser(cls)
    parser.set_defaults(**none_defaults)
    for action in parser._actions:  # recipe values satisfy required fields
        if action.dest in recipe:
            action.required = False
    errors: list[str] = []
    parser.error = lambda message: errors.append(message) or (_ for _ in ()).throw(ConfigError(message))  # type: ignore[method-assign]
    try:
        (config,) = parser.parse_args_into_dataclasses(args=recipe_tokens + argv)
    except SystemExit:  # argparse exits on --help
        raise
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return config


def parse_or_exit(cls: type[T], argv: Optional[Sequence[str]] = None) -> T:
    """Script entry point: parse, and on any configuration error print it and exit with status 2."""
    try:
        return parse_config(cls, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
