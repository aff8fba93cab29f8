"""Option names researchers bring from other libraries, and what to write here instead: one table, read by the
config parser's unknown-key message (`hint`) and shown in the README's porting section (`markdown_table`; a test
checks that the README holds exactly this table, so the two cannot drift).

    python -m open_instruct.flag_names      # prints the README table

This module imports nothing from the project (the config module imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

HF = "HF TrainingArguments"
TRL = "TRL"
OI = "open-instruct"
ORLHF = "OpenRLHF"


@dataclass(frozen=True)
class ForeignName:
    """One option name from another library: where it comes from, what to write here, and which of our keys that
    uses (`keys`: every one must be an option of some script here; tests/test_flag_names.py checks)."""

    name: str
    libraries: tuple[str, ...]
    here: str
    keys: tuple[str, ...] = ()
    note: str = ""


def _n(name: str, libraries: Iterable[str], here: str, keys: Iterable[str] = (), note: str = "") -> ForeignName:
    return ForeignName(name, tuple(libraries), here, tuple(keys), note)


FOREIGN_NAMES: tuple[ForeignName, ...] = (
    # --- run length, checkpoints, eval, logging
    _n(
        "max_steps",
        [HF, TRL],
        "`--total_episodes N`",
        ["total_episodes"],
        "run length in samples: steps x global batch (RL: rollouts x completions per rollout); the plan prints steps",
    ),
    _n("save_steps", [HF, TRL], "`--checkpointing_steps N`", ["checkpointing_steps"]),
    _n("save_strategy", [HF, TRL], "`--checkpointing_steps N`", ["checkpointing_steps"], "by steps only"),
    _n("save_total_limit", [HF, TRL], "`--keep_last_n_checkpoints N`", ["keep_last_n_checkpoints"]),
    _n("eval_strategy", [HF, TRL], "`--eval_steps N`", ["eval_steps"], "also evaluates at the first and last step"),
    _n("evaluation_strategy", [HF], "`--eval_steps N`", ["eval_steps"], "also evaluates at the first and last step"),
    _n("do_eval", [HF], "`--eval_steps N` with held-out data", ["eval_steps"]),
    _n(
        "metric_for_best_model",
        [HF],
        "`--best_metric eval/...`",
        ["best_metric"],
        "best_model/ is kept next to final_model/",
    ),
    _n(
        "load_best_model_at_end",
        [HF],
        "`--best_metric eval/...`",
        ["best_metric"],
        "best_model/ is kept next to final_model/",
    ),
    _n("greater_is_better", [HF], "`--best_metric_mode max` (or `min`)", ["best_metric_mode"]),
    _n("report_to", [HF, TRL], "`--with_tracking true`", ["with_tracking"], "wandb; metrics.jsonl is always written"),
    _n("use_wandb", [ORLHF], "`--with_tracking true`", ["with_tracking"]),
    _n("run_name", [HF, TRL], "`--exp_name NAME`", ["exp_name"]),
    _n("wandb_run_name", [ORLHF], "`--exp_name NAME`", ["exp_name"]),
    _n(
        "push_to_hub",
        [HF, TRL],
        "not done by the scripts",
        [],
        "final_model/ is in HF format: `huggingface-cli upload` it",
    ),
    # --- precision, memory, parallelism
    _n("bf16", [HF, TRL, ORLHF], "`--mixed_precision bf16`", ["mixed_precision"], "master weights stay fp32"),
    _n("fp16", [HF, TRL], "`--mixed_precision fp16`", ["mixed_precision"], "not under FSDP (use bf16)"),
    _n("torch_dtype", [TRL], "`--mixed_precision bf16`", ["mixed_precision"], "models load in fp32 (master weights)"),
    _n("dtype", [TRL], "`--mixed_precision bf16`", ["mixed_precision"], "models load in fp32 (master weights)"),
    _n(
        "gradient_checkpointing",
        [HF, TRL, OI, ORLHF],
        "`--activation_checkpointing true`",
        ["activation_checkpointing"],
    ),
    _n("flash_attn", [ORLHF], "`--attn_implementation flash_attention_2`", ["attn_implementation"]),
    _n("adam_offload", [ORLHF], "`--fsdp_cpu_offload true`", ["fsdp_cpu_offload"]),
    _n(
        "deepspeed",
        [HF, OI],
        "an FSDP2 accelerate config",
        [],
        "`accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml ...` (or `scripts/*.sh`)",
    ),
    _n(
        "zero_stage",
        [ORLHF],
        "an FSDP2 accelerate config",
        [],
        "`accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml ...` (or `scripts/*.sh`)",
    ),
    _n(
        "fsdp",
        [HF],
        "an FSDP2 accelerate config",
        [],
        "`accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml ...` (or `scripts/*.sh`)",
    ),
    # --- batch and schedule
    _n(
        "packing",
        [TRL],
        "`--max_tokens_per_micro_batch N`",
        ["max_tokens_per_micro_batch"],
        "padding-free packing of whole sequences up to N tokens per micro-batch",
    ),
    _n(
        "padding_free",
        [TRL],
        "`--max_tokens_per_micro_batch N`",
        ["max_tokens_per_micro_batch"],
        "padding-free packing of whole sequences up to N tokens per micro-batch",
    ),
    _n("warmup_steps", [HF, TRL], "`--warmup_ratio F`", ["warmup_ratio"], "a fraction of the optimizer steps"),
    _n("lr_warmup_ratio", [ORLHF], "`--warmup_ratio F`", ["warmup_ratio"]),
    _n("actor_learning_rate", [ORLHF], "`--learning_rate LR`", ["learning_rate"]),
    _n("max_norm", [ORLHF], "`--max_grad_norm X`", ["max_grad_norm"]),
    _n("micro_train_batch_size", [ORLHF], "`--per_device_train_batch_size N`", ["per_device_train_batch_size"]),
    _n("train.micro_batch_size", [ORLHF], "`--per_device_train_batch_size N`", ["per_device_train_batch_size"]),
    _n(
        "train_batch_size",
        [ORLHF],
        "`--gradient_accumulation_steps N`",
        ["gradient_accumulation_steps"],
        "the global batch is derived: per_device_train_batch_size x gradient_accumulation_steps x processes",
    ),
    _n(
        "train.batch_size",
        [ORLHF],
        "`--gradient_accumulation_steps N`",
        ["gradient_accumulation_steps"],
        "the global batch is derived: per_device_train_batch_size x gradient_accumulation_steps x processes",
    ),
    _n(
        "local_mini_batch_size",
        [OI],
        "`--gradient_accumulation_steps N`",
        ["gradient_accumulation_steps"],
        "derived: per_device_train_batch_size x gradient_accumulation_steps",
    ),
    _n(
        "num_mini_batches",
        [OI],
        "`--gradient_accumulation_steps N`",
        ["gradient_accumulation_steps"],
        "derived: completions per rollout / global batch",
    ),
    _n("max_epochs", [ORLHF], "`--num_epochs N` (RL) or `--num_train_epochs N`", ["num_epochs", "num_train_epochs"]),
    _n("train.max_epochs", [ORLHF], "`--num_epochs N`", ["num_epochs"], "passes over each rollout"),
    _n(
        "num_episodes",
        [ORLHF],
        "`--total_episodes N`",
        ["total_episodes"],
        "counted in completions here, in passes over the prompts there",
    ),
    _n(
        "train.num_episodes",
        [ORLHF],
        "`--total_episodes N`",
        ["total_episodes"],
        "counted in completions here, in passes over the prompts there",
    ),
    # --- lengths
    _n("max_length", [TRL], "`--max_seq_length N`", ["max_seq_length"]),
    _n("max_len", [ORLHF], "`--max_seq_length N`", ["max_seq_length"]),
    _n("max_token_length", [OI], "`--max_seq_length N`", ["max_seq_length"]),
    _n("max_prompt_token_length", [OI], "`--max_prompt_length N`", ["max_prompt_length"]),
    _n("prompt_max_len", [ORLHF], "`--max_prompt_length N`", ["max_prompt_length"]),
    _n("generate_max_len", [ORLHF], "`--response_length N`", ["response_length"]),
    _n("max_completion_length", [TRL], "`--response_length N`", ["response_length"]),
    _n("max_new_tokens", [TRL], "`--response_length N`", ["response_length"]),
    # --- RL
    _n("num_generations", [TRL], "`--num_samples_per_prompt N`", ["num_samples_per_prompt"]),
    _n("number_samples_per_prompt", [OI], "`--num_samples_per_prompt N`", ["num_samples_per_prompt"]),
    _n("n_samples_per_prompt", [ORLHF], "`--num_samples_per_prompt N`", ["num_samples_per_prompt"]),
    _n("rollout.n_samples_per_prompt", [ORLHF], "`--num_samples_per_prompt N`", ["num_samples_per_prompt"]),
    _n("num_iterations", [TRL], "`--num_epochs N`", ["num_epochs"], "passes over each rollout"),
    _n(
        "rollout_batch_size",
        [ORLHF],
        "`--local_rollout_batch_size N`",
        ["local_rollout_batch_size"],
        "prompts per process: the global count / processes",
    ),
    _n(
        "rollout.batch_size",
        [ORLHF],
        "`--local_rollout_batch_size N`",
        ["local_rollout_batch_size"],
        "prompts per process: the global count / processes",
    ),
    _n(
        "generation_batch_size",
        [TRL],
        "`--local_rollout_batch_size N`",
        ["local_rollout_batch_size"],
        "prompts per process; completions = that x num_samples_per_prompt",
    ),
    _n(
        "steps_per_generation",
        [TRL],
        "`--local_rollout_batch_size N`",
        ["local_rollout_batch_size"],
        "optimizer steps per rollout = completions per rollout / global batch (num_mini_batches, derived)",
    ),
    _n("kl_coef", [TRL], "`--beta X`", ["beta"]),
    _n("init_kl_coef", [ORLHF], "`--beta X`", ["beta"]),
    _n("epsilon", [TRL], "`--cliprange X`", ["cliprange"]),
    _n("epsilon_high", [TRL], "`--cliprange_high X`", ["cliprange_high"]),
    _n("eps_clip", [ORLHF], "`--cliprange X`", ["cliprange"]),
    _n("value_clip", [ORLHF], "`--cliprange_value X`", ["cliprange_value"]),
    _n("use_vllm", [TRL], "`--generation_backend vllm` (or `vllm_server`)", ["generation_backend"]),
    _n("vllm_mode", [TRL], "`--generation_backend vllm` (colocate) or `vllm_server`", ["generation_backend"]),
    _n("reward_pretrain", [ORLHF], "`--reward_model_path PATH`", ["reward_model_path"]),
    _n("critic_pretrain", [ORLHF], "`--value_model_path PATH`", ["value_model_path"]),
    _n(
        "reward_funcs",
        [TRL],
        "`--reward_functions module:function ...`",
        ["reward_functions"],
        "TRL's signature; added to the verifiers' reward, `reward_function_weights` as reward_weights",
    ),
    _n("reward_weights", [TRL], "`--reward_function_weights W ...`", ["reward_function_weights"]),
    _n(
        "remote_rm_url",
        [ORLHF],
        "`--reward_functions path/to/file.py:function`",
        ["reward_functions"],
        "a local reward file; the function takes TRL's keyword arguments",
    ),
    _n(
        "apply_verifiable_reward",
        [OI],
        "always on",
        ["verification_reward"],
        "`--verification_reward X` sets its weight (0 turns it off)",
    ),
    # --- DPO
    _n("dpo_beta", [OI], "`--beta X`", ["beta"]),
    _n("dpo_loss_type", [OI], "`--loss_type NAME`", ["loss_type"]),
    _n("dpo_label_smoothing", [OI], "`--label_smoothing X`", ["label_smoothing"]),
    # --- model, data, LoRA
    _n("pretrain", [ORLHF], "`--model_name_or_path PATH`", ["model_name_or_path"]),
    _n("dataset_name", [TRL], "`--dataset_name_or_path NAME`", ["dataset_name_or_path"]),
    _n("dataset", [ORLHF], "`--dataset_name_or_path NAME`", ["dataset_name_or_path"]),
    _n("prompt_data", [ORLHF], "`--dataset_name_or_path NAME`", ["dataset_name_or_path"]),
    _n("eval_dataset", [ORLHF], "`--eval_dataset_name_or_path NAME`", ["eval_dataset_name_or_path"]),
    _n(
        "data.prompt_dataset",
        [ORLHF],
        "`--dataset_mixer_list SOURCE AMOUNT ...`",
        ["dataset_mixer_list"],
        "sources and amounts in one list (or one --dataset_name_or_path)",
    ),
    _n(
        "data.prompt_probs",
        [ORLHF],
        "`--dataset_mixer_list SOURCE AMOUNT ...`",
        ["dataset_mixer_list"],
        "amounts are fractions or row counts per source",
    ),
    _n("dataset_mixer", [OI], "`--dataset_mixer_list SOURCE AMOUNT ...`", ["dataset_mixer_list"]),
    _n("dataset_train_split", [TRL], "`--dataset_split NAME`", ["dataset_split"]),
    _n("dataset_test_split", [TRL], "`--eval_dataset_split NAME`", ["eval_dataset_split"]),
    _n("use_peft", [TRL], "`--use_lora true`", ["use_lora"]),
    _n("lora_r", [TRL], "`--lora_rank N`", ["lora_rank"]),
    _n("target_modules", [ORLHF], "`--lora_target_modules NAME ...`", ["lora_target_modules"]),
)

_BY_NAME = {f.name: f for f in FOREIGN_NAMES}
assert len(_BY_NAME) == len(FOREIGN_NAMES), "a name is listed twice"


def lookup(key: str) -> Optional[ForeignName]:
    """The table's entry for an option name (as typed, dashes read as underscores), or None."""
    return _BY_NAME.get(key.replace("-", "_"))


def hint(key: str, script_keys: Iterable[str], script: str) -> Optional[str]:
    """What to write instead of another library's option `key`, or None when the table does not know it. Says so
    when the replacement is not an option of this script (`script_keys`: its option names)."""
    entry = lookup(key)
    if entry is None:
        return None
    text = f"{key!r} is {' / '.join(entry.libraries)}'s name; here: {entry.here.replace('`', '')}"
    if entry.note:
        text += f" ({entry.note.replace('`', '')})"
    keys = set(script_keys)
    if entry.keys and not any(k in keys for k in entry.keys):
        text += f"; {' / '.join(entry.keys)} is not an option of {script}.py"
    return text


def markdown_table() -> str:
    """The README's table of these names (tests/test_flag_names.py checks the README holds it verbatim)."""
    lines = ["| their name | where | here | note |", "|---|---|---|---|"]
    for f in FOREIGN_NAMES:
        lines.append(f"| `{f.name}` | {', '.join(f.libraries)} | {f.here} | {f.note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
