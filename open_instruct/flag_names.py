"""Option names researchers bring from other libraries, and what to write here instead: one table, read by the
config parser's unknown-key message (`hint`) and shown in the README's porting section (`markdown_table`; a test
checks that the README holds exactly this table, so the two cannot drift).

    python -m open_instruct.flag_names      # prints the README table

This module imports only batch_math from the project (the config module imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from open_instruct import batch_math

HF = "HF TrainingArguments"
TRL = "TRL"
OI = "open-instruct"
ORLHF = "OpenRLHF"
VERL = "verl"


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
        "run length in samples: steps x global batch (RL: completions generated = TRL's max_steps x "
        "per_device_train_batch_size x gradient_accumulation_steps x processes / num_iterations); the plan prints "
        "steps",
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
    _n("fp16", [HF, TRL], "`--mixed_precision bf16`", ["mixed_precision"], "fp16 is refused: it needs a loss scaler"),
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
    # TRL GRPO's loss and sampling knobs (trl.GRPOConfig; tests/test_porting.py reads its fields)
    _n(
        "loss_type",
        [TRL],
        "`--loss_aggregation NAME` (and `--policy_loss NAME`)",
        ["loss_aggregation", "policy_loss"],
        "TRL GRPO's dapo/bnpo = token_mean, grpo = seq_mean_token_mean, dr_grpo = seq_mean_token_sum_norm, "
        "cispo = --policy_loss cispo; sapo, luspo, vespo: write one (docs/extending.md)",
    ),
    _n(
        "scale_rewards",
        [TRL],
        "`--advantage_estimator grpo` (group) or `dr_grpo` (none)",
        ["advantage_estimator"],
        "group: divided by the group's std (grpo); none/false: centred only (dr_grpo); batch: no built-in",
    ),
    _n(
        "importance_sampling_level",
        [TRL],
        "`--policy_loss ppo` (token) or `gspo` (sequence)",
        ["policy_loss"],
        "sequence is GSPO: its sequence mean aggregation comes with it",
    ),
    _n(
        "delta",
        [TRL],
        "`--dual_clip_c X`",
        ["dual_clip_c"],
        "two-sided clipping: the ratio of a negative-advantage token is capped at X (> 1)",
    ),
    _n(
        "num_generations_eval",
        [TRL],
        "`--eval_response_length N` (eval is greedy, one answer per prompt)",
        ["eval_response_length"],
        "eval reports verifiable accuracy of one greedy answer per held-out prompt",
    ),
    _n(
        "vllm_importance_sampling_correction",
        [TRL],
        "`--truncated_importance_sampling true`",
        ["truncated_importance_sampling"],
    ),
    _n(
        "vllm_importance_sampling_mode",
        [TRL],
        "`--truncated_importance_sampling true` or `--is_mask_low/high X`",
        ["truncated_importance_sampling", "is_mask_low", "is_mask_high"],
        "token_truncate: truncated_importance_sampling with tis_cap; token_mask: is_mask_low / is_mask_high; "
        "sequence_*: no built-in",
    ),
    _n("vllm_importance_sampling_cap", [TRL], "`--tis_cap X`", ["tis_cap"]),
    _n(
        "vllm_importance_sampling_clip_max", [TRL], "`--tis_cap X` (or `--is_mask_high X`)", ["tis_cap", "is_mask_high"]
    ),
    _n("vllm_importance_sampling_clip_min", [TRL], "`--is_mask_low X`", ["is_mask_low"]),
    _n("vllm_enable_sleep_mode", [TRL], "`--vllm_enable_sleep true`", ["vllm_enable_sleep"]),
    _n("vllm_server_base_url", [TRL], "`--vllm_server_urls URL ...`", ["vllm_server_urls"]),
    _n("vllm_server_host", [TRL], "`--vllm_server_urls http://HOST:PORT`", ["vllm_server_urls"]),
    _n("vllm_server_port", [TRL], "`--vllm_server_urls http://HOST:PORT`", ["vllm_server_urls"]),
    _n(
        "log_completions",
        [TRL],
        "`--num_samples_logged N`",
        ["num_samples_logged"],
        "completions per rollout written to samples.jsonl",
    ),
    _n("num_completions_to_print", [TRL], "`--num_samples_logged N`", ["num_samples_logged"]),
    _n("max_tool_calling_iterations", [TRL], "`--max_tool_calls N`", ["max_tool_calls"]),
    _n("disable_dropout", [TRL], "always on", [], "RL and DPO turn every dropout off"),
    _n("logging_nan_inf_filter", [HF, TRL], "`--on_nonfinite skip` (or stop)", ["on_nonfinite"]),
    _n("eval_on_start", [HF, TRL], "`--eval_steps N`", ["eval_steps"], "evaluation always runs at the first step"),
    _n("data_seed", [HF, TRL], "`--seed N`", ["seed"], "one seed for data order and sampling"),
    # open-instruct grpo_fast.py
    _n(
        "num_unique_prompts_rollout",
        [OI],
        "`--local_rollout_batch_size N`",
        ["local_rollout_batch_size"],
        "prompts per process: the global count / processes",
    ),
    _n("num_samples_per_prompt_rollout", [OI], "`--num_samples_per_prompt N`", ["num_samples_per_prompt"]),
    _n("clip_higher", [OI], "`--cliprange_high X`", ["cliprange_high"]),
    _n("clip_lower", [OI], "`--cliprange_low X`", ["cliprange_low"]),
    _n("local_eval_every", [OI], "`--eval_steps N`", ["eval_steps"]),
    _n("save_freq", [OI], "`--checkpointing_steps N`", ["checkpointing_steps"]),
    _n("filter_zero_std_samples", [OI], "`--filter_zero_std_groups true`", ["filter_zero_std_groups"]),
    _n("pack_length", [OI], "`--max_tokens_per_micro_batch N`", ["max_tokens_per_micro_batch"]),
    _n("reward_aggregator", [OI], "`--turn_reward_aggregation last|sum`", ["turn_reward_aggregation"]),
    _n(
        "advantage_normalization_type",
        [OI],
        "`--advantage_estimator grpo` (standard) or `dr_grpo` (centered)",
        ["advantage_estimator"],
    ),
    _n(
        "loss_denominator",
        [OI],
        "`--loss_aggregation seq_mean_token_sum_norm --loss_norm_length N`",
        ["loss_aggregation", "loss_norm_length"],
        "a constant denominator is Dr. GRPO's",
    ),
    _n(
        "truncated_importance_sampling_ratio_cap",
        [OI],
        "`--truncated_importance_sampling true --tis_cap X`",
        ["truncated_importance_sampling", "tis_cap"],
    ),
    # OpenRLHF >= 0.10 (dotted groups)
    _n("algo.advantage.estimator", [ORLHF], "`--advantage_estimator NAME`", ["advantage_estimator"]),
    _n("algo.kl.init_coef", [ORLHF], "`--beta X`", ["beta"]),
    _n("algo.kl.estimator", [ORLHF], "`--kl_estimator k1|k2|k3`", ["kl_estimator"]),
    _n("algo.dynamic_filtering_enable", [ORLHF], "`--filter_zero_std_groups true`", ["filter_zero_std_groups"]),
    _n("train.async_enable", [ORLHF], "`--async_steps N`", ["async_steps"]),
    _n("use_kl_loss", [ORLHF, VERL], "`--algo grpo` (KL as a loss) or `--algo ppo` (KL in the reward)", ["algo"]),
    # verl (hydra keys; a nested recipe mapping is read as these dotted names)
    _n(
        "algorithm.adv_estimator",
        [VERL],
        "`--advantage_estimator NAME`",
        ["advantage_estimator"],
        "gae, grpo, rloo, reinforce_plus_plus = reinforce_pp",
    ),
    _n("algorithm.kl_ctrl.kl_coef", [VERL], "`--beta X`", ["beta"], "KL in the reward (PPO)"),
    _n("algorithm.gamma", [VERL], "`--gamma X`", ["gamma"]),
    _n("algorithm.lam", [VERL], "`--lam X`", ["lam"]),
    _n("algorithm.use_kl_in_reward", [VERL], "`--algo ppo`", ["algo"], "gae and reinforce_pp put the KL in the reward"),
    _n("algorithm.filter_groups.enable", [VERL], "`--filter_zero_std_groups true`", ["filter_zero_std_groups"]),
    _n(
        "data.train_batch_size",
        [VERL],
        "`--local_rollout_batch_size N`",
        ["local_rollout_batch_size"],
        "prompts per rollout / processes",
    ),
    _n("data.max_prompt_length", [VERL], "`--max_prompt_length N`", ["max_prompt_length"]),
    _n("data.max_response_length", [VERL], "`--response_length N`", ["response_length"]),
    _n("data.train_files", [VERL], "`--dataset_mixer_list SOURCE AMOUNT ...`", ["dataset_mixer_list"]),
    _n("data.val_files", [VERL], "`--eval_dataset_name_or_path FILES`", ["eval_dataset_name_or_path"]),
    _n("actor_rollout_ref.model.path", [VERL], "`--model_name_or_path PATH`", ["model_name_or_path"]),
    _n("actor_rollout_ref.actor.optim.lr", [VERL], "`--learning_rate LR`", ["learning_rate"]),
    _n(
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        [VERL],
        "`--gradient_accumulation_steps N`",
        ["gradient_accumulation_steps"],
        "verl counts prompts; here the global batch counts completions",
    ),
    _n(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        [VERL],
        "`--per_device_train_batch_size N`",
        ["per_device_train_batch_size"],
    ),
    _n("actor_rollout_ref.actor.ppo_epochs", [VERL], "`--num_epochs N`", ["num_epochs"]),
    _n("actor_rollout_ref.actor.clip_ratio", [VERL], "`--cliprange X`", ["cliprange"]),
    _n("actor_rollout_ref.actor.clip_ratio_low", [VERL], "`--cliprange_low X`", ["cliprange_low"]),
    _n("actor_rollout_ref.actor.clip_ratio_high", [VERL], "`--cliprange_high X`", ["cliprange_high"]),
    _n("actor_rollout_ref.actor.clip_ratio_c", [VERL], "`--dual_clip_c X`", ["dual_clip_c"]),
    _n(
        "actor_rollout_ref.actor.loss_agg_mode",
        [VERL],
        "`--loss_aggregation NAME`",
        ["loss_aggregation"],
        "token-mean, seq-mean-token-mean, seq-mean-token-sum-norm with underscores",
    ),
    _n(
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        [VERL],
        "`--policy_loss NAME`",
        ["policy_loss"],
        "vanilla = ppo, gspo, cispo",
    ),
    _n("actor_rollout_ref.actor.use_kl_loss", [VERL], "`--algo grpo`", ["algo"], "KL as a loss term"),
    _n("actor_rollout_ref.actor.kl_loss_coef", [VERL], "`--beta X`", ["beta"]),
    _n(
        "actor_rollout_ref.actor.kl_loss_type",
        [VERL],
        "`--kl_estimator k1|k2|k3`",
        ["kl_estimator"],
        "low_var_kl = k3, mse = k2, kl = k1",
    ),
    _n("actor_rollout_ref.rollout.n", [VERL], "`--num_samples_per_prompt N`", ["num_samples_per_prompt"]),
    _n("actor_rollout_ref.rollout.temperature", [VERL], "`--temperature X`", ["temperature"]),
    _n("actor_rollout_ref.rollout.top_p", [VERL], "`--top_p X`", ["top_p"]),
    _n("actor_rollout_ref.rollout.name", [VERL], "`--generation_backend vllm|vllm_server|hf`", ["generation_backend"]),
    _n(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        [VERL],
        "`--vllm_gpu_memory_utilization F`",
        ["vllm_gpu_memory_utilization"],
    ),
    _n(
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        [VERL],
        "`--vllm_tensor_parallel_size N`",
        ["vllm_tensor_parallel_size"],
    ),
    _n("critic.model.path", [VERL], "`--value_model_path PATH`", ["value_model_path"]),
    _n("critic.cliprange_value", [VERL], "`--cliprange_value X`", ["cliprange_value"]),
    _n(
        "trainer.total_epochs",
        [VERL],
        "`--total_episodes N`",
        ["total_episodes"],
        "completions: epochs x prompts x num_samples_per_prompt",
    ),
    _n(
        "trainer.total_training_steps",
        [VERL],
        "`--total_episodes N`",
        ["total_episodes"],
        "completions: steps x prompts per rollout x num_samples_per_prompt",
    ),
    _n("trainer.save_freq", [VERL], "`--checkpointing_steps N`", ["checkpointing_steps"]),
    _n("trainer.test_freq", [VERL], "`--eval_steps N`", ["eval_steps"]),
    _n("trainer.default_local_dir", [VERL], "`--output_dir DIR`", ["output_dir"]),
    _n("trainer.experiment_name", [VERL], "`--exp_name NAME`", ["exp_name"]),
    _n("trainer.project_name", [VERL], "`--wandb_project NAME`", ["wandb_project"]),
    _n("trainer.logger", [VERL], "`--with_tracking true`", ["with_tracking"]),
    _n("trainer.resume_mode", [VERL], "`--resume_from_checkpoint auto`", ["resume_from_checkpoint"]),
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


def _unsupported(reason: str, *names: str) -> dict[str, str]:
    return {name: reason for name in names}


# Options of TRL's GRPOConfig (and the HF TrainingArguments it extends) with no counterpart here, each with why: the
# unknown-key message says it, and tests/test_porting.py requires every GRPOConfig field to be accepted, in
# FOREIGN_NAMES, or here.
UNSUPPORTED: dict[str, str] = {
    **_unsupported(
        "the scripts run their own loop under Accelerate (no HF Trainer): nothing to set",
        "accelerator_config",
        "auto_find_batch_size",
        "average_tokens_across_devices",
        "batch_eval_metrics",
        "dataloader_drop_last",
        "dataloader_in_order",
        "dataloader_multiprocessing_context",
        "dataloader_num_workers",
        "dataloader_persistent_workers",
        "dataloader_pin_memory",
        "dataloader_prefetch_factor",
        "ddp_backend",
        "ddp_broadcast_buffers",
        "ddp_bucket_cap_mb",
        "ddp_find_unused_parameters",
        "ddp_static_graph",
        "ddp_timeout",
        "debug",
        "do_predict",
        "do_train",
        "eval_accumulation_steps",
        "eval_delay",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "ignore_data_skip",
        "include_for_metrics",
        "include_num_input_tokens_seen",
        "label_names",
        "length_column_name",
        "local_rank",
        "prediction_loss_only",
        "remove_unused_columns",
        "restore_callback_states_from_checkpoint",
        "save_on_each_node",
        "save_only_model",
        "skip_memory_metrics",
        "train_sampling_strategy",
        "torch_empty_cache_steps",
        "parallelism_config",
        "past_index",
        "jit_mode_eval",
        "use_ipex",
        "ray_scope",
        "split_batches",
        "dispatch_batches",
        "tpu_num_cores",
        "tpu_metrics_debug",
        "mp_parameters",
        "eval_steps_per_epoch",
        "per_gpu_train_batch_size",
        "per_gpu_eval_batch_size",
        "use_legacy_prediction_loop",
        "half_precision_backend",
        "fp16_backend",
        "fp16_opt_level",
        "save_safetensors",
        "use_mps_device",
        "enable_jit_checkpoint",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing_kwargs",
        "ds3_gather_for_generation",
        "pad_to_multiple_of",
        "shuffle_dataset",
    ),
    **_unsupported(
        "an FSDP2 accelerate config sets sharding (configs/accelerate/)",
        "fsdp_config",
        "fsdp_min_num_params",
        "fsdp_transformer_layer_cls_to_wrap",
    ),
    **_unsupported(
        "nothing is pushed: final_model/ is in HF format, upload it with `huggingface-cli upload`",
        "hub_always_push",
        "hub_model_id",
        "hub_private_repo",
        "hub_revision",
        "hub_strategy",
        "hub_token",
        "push_to_hub_model_id",
        "push_to_hub_organization",
        "push_to_hub_token",
        "log_completions_hub_repo",
    ),
    **_unsupported(
        "logging is one row per logging_steps to metrics.jsonl (and wandb with with_tracking); nothing else to set",
        "disable_tqdm",
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "logging_first_step",
        "logging_strategy",
        "logging_dir",
        "project",
        "trackio_bucket_id",
        "trackio_space_id",
        "trackio_static_space_id",
        "log_multimodal",
        "log_unique_prompts",
    ),
    **_unsupported(
        "the optimizer is AdamW (learning_rate, adam_beta1/2, adam_epsilon, weight_decay) with lr_scheduler_type",
        "optim",
        "optim_args",
        "optim_target_modules",
        "lr_scheduler_kwargs",
    ),
    **_unsupported(
        "no compiled or fused-kernel path here (the models run as transformers builds them)",
        "torch_compile",
        "torch_compile_backend",
        "torch_compile_mode",
        "use_liger_kernel",
        "liger_kernel_config",
        "tf32",
        "cast_lm_head_to_fp32",
        "cache_implementation",
        "use_cache",
    ),
    **_unsupported(
        "evaluation here runs with the training precision (mixed_precision)", "bf16_full_eval", "fp16_full_eval"
    ),
    **_unsupported("runs on CPU whenever no GPU is visible", "use_cpu", "no_cuda"),
    **_unsupported(
        "the seed makes runs repeatable up to kernel nondeterminism; no separate switch", "full_determinism"
    ),
    **_unsupported(
        "not a knob here: SFT's loss is plain cross-entropy", "label_smoothing_factor", "neftune_noise_alpha"
    ),
    **_unsupported(
        "models load with from_pretrained's defaults; set model_revision, trust_remote_code, gguf_file, "
        "attn_implementation",
        "model_init_kwargs",
    ),
    **_unsupported("no MoE router loss here", "router_aux_loss_coef"),
    **_unsupported(
        "sampling is temperature + top_p only (the trained distribution must be the sampled one)",
        "top_k",
        "min_p",
        "repetition_penalty",
        "generation_kwargs",
        "vllm_structured_outputs_regex",
    ),
    **_unsupported(
        "chat templates are rendered without extra variables; give a template with chat_template",
        "chat_template_kwargs",
    ),
    **_unsupported(
        "the vLLM engine is configured here (vllm_gpu_memory_utilization, vllm_tensor_parallel_size); its model "
        "length is max_prompt_length + response_length",
        "vllm_model_impl",
        "vllm_max_model_length",
        "vllm_group_port",
    ),
    **_unsupported(
        "generation_backend hf generates with transformers' generate",
        "use_transformers_continuous_batching",
        "transformers_continuous_batching_config",
        "use_transformers_paged",
    ),
    **_unsupported(
        "the reference model stays frozen (TR-DPO-style syncing is not built in)",
        "sync_ref_model",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
    ),
    **_unsupported(
        "no entropy bonus or entropy-quantile masking built in: add it as a policy_loss (docs/extending.md)",
        "entropy_coef",
        "use_adaptive_entropy",
        "entropy_coef_min",
        "entropy_coef_max",
        "entropy_coef_delta",
        "entropy_target",
        "top_entropy_quantile",
    ),
    **_unsupported(
        "SAPO / VESPO losses are not built in: add one as a policy_loss with algo_kwargs (docs/extending.md)",
        "sapo_temperature_neg",
        "sapo_temperature_pos",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
    ),
    **_unsupported(
        "reward functions are summed with their weights, then the estimator normalises (TRL's sum_then_normalize)",
        "multi_objective_aggregation",
    ),
    **_unsupported(
        "no sequence-KL off-policy mask; max_sequence_lag and is_mask_low/high bound off-policy tokens",
        "off_policy_mask_threshold",
        "use_bias_correction_kl",
    ),
}
_overlap = set(UNSUPPORTED) & set(_BY_NAME)
assert not _overlap, f"names both mapped and unsupported: {_overlap}"


def lookup(key: str) -> Optional[ForeignName]:
    """The table's entry for an option name (as typed, dashes read as underscores), or None."""
    return _BY_NAME.get(key.replace("-", "_"))


def hint(key: str, script_keys: Iterable[str], script: str, given: Optional[dict] = None) -> Optional[str]:
    """What to write instead of another library's option `key`, or None when the table does not know it. Says so
    when the replacement is not an option of this script (`script_keys`: its option names). `given`: every unknown
    key of the run with its value, for hints that depend on another of them (TRL's max_steps and num_iterations)."""
    entry = lookup(key)
    if entry is None:
        reason = UNSUPPORTED.get(key.replace("-", "_"))
        return f"{key!r} is TRL / HF TrainingArguments' name, not supported here: {reason}" if reason else None
    if entry.name == "max_steps" and script == "rlvr_ppo":
        return _max_steps_hint(given or {})
    text = f"{key!r} is {' / '.join(entry.libraries)}'s name; here: {entry.here.replace('`', '')}"
    if entry.note:
        text += f" ({entry.note.replace('`', '')})"
    keys = set(script_keys)
    if entry.keys and not any(k in keys for k in entry.keys):
        text += f"; {' / '.join(entry.keys)} is not an option of {script}.py"
    return text


def _number(value: object) -> Optional[float]:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _max_steps_hint(given: dict) -> str:
    """TRL's max_steps counts optimizer steps; each generated completion is trained on num_iterations times, so the
    completions generated (our total_episodes) = max_steps x global batch / num_iterations."""
    steps, iterations = _number(given.get("max_steps")), _number(given.get("num_iterations", 1)) or 1.0
    formula = (
        "total_episodes = max_steps x per_device_train_batch_size x gradient_accumulation_steps x processes / "
        "num_iterations (completions generated; each is trained on num_epochs = num_iterations times)"
    )
    text = f"'max_steps' is HF TrainingArguments / TRL's name; here: --total_episodes N, {formula}"
    per_device, accumulation = (
        _number(given.get("per_device_train_batch_size")),
        _number(given.get("gradient_accumulation_steps", 1)),
    )
    if steps and per_device and accumulation:
        episodes = steps * per_device * accumulation / iterations
        text += f"; here {steps:g} x {per_device:g} x {accumulation:g} x processes / {iterations:g} = "
        text += f"{episodes:g} x processes"
    return text


# TRL GRPOConfig's defaults where ours differ (name here, ours, TRL's, what to write for TRL's behaviour). A recipe
# with TRL's names is told these before anything loads (config.parse_config); configs/grpo_trl_defaults.yaml sets
# TRL's values in our keys.
TRL_GRPO_DIFFERENCES: tuple[tuple[str, str, str, str], ...] = (
    (
        "algo",
        "ppo (GAE with a value model, KL in the reward)",
        "GRPO (group advantages, no value model)",
        "--algo grpo",
    ),
    ("num_epochs", "4", "num_iterations 1", "--num_epochs 1"),
    ("beta", "0.05", "0.0 (no reference model)", "--beta 0"),
    ("kl_estimator", "k1", "k3", "--kl_estimator k3"),
    (
        "verification_reward",
        "10.0",
        "reward functions' own scale (1.0 for a correct answer)",
        "--verification_reward 1",
    ),
    ("loss_aggregation", "token_mean", "loss_type dapo (token mean over the global batch)", "(the same)"),
    ("cliprange_high", "cliprange (0.2)", "epsilon_high = epsilon (0.2)", "(the same)"),
    ("learning_rate", "3e-7", "1e-6", "--learning_rate 1e-6"),
    ("response_length", "256", "max_completion_length 512", "--response_length 512"),
    ("num_samples_per_prompt", "1", "num_generations 8", "--num_samples_per_prompt 8"),
    (
        "local_rollout_batch_size",
        "8 prompts per process per rollout",
        "per_device_train_batch_size x steps_per_generation completions (8: one prompt)",
        "--local_rollout_batch_size null (derived as TRL derives it; or the note's number)",
    ),
    (
        "truncated_importance_sampling",
        "off (on with async_steps)",
        "vllm_importance_sampling_correction with vLLM (sequence_mask, cap 3)",
        "--truncated_importance_sampling true",
    ),
)


# Our keys that make TRL's batch shape (batch_math.trl_grpo_shape computes their values from the recipe's numbers)
TRL_SHAPE_KEYS = ("num_samples_per_prompt", "local_rollout_batch_size", "num_epochs")
# TRL's names whose value is ours as it is: the hint's rename is enough, the shape line does not repeat them
_RENAMED_AS_IS = {"num_epochs": "num_iterations", "num_samples_per_prompt": "num_generations"}


def _set_here(key: str, given: dict) -> bool:
    """Whether the recipe sets our `key`, under our name or a foreign name the table maps to it."""
    return key in given or any(lookup(k) is not None and key in lookup(k).keys for k in given)  # type: ignore[union-attr]


def _int_of(given: dict, name: str, default: Optional[int]) -> Optional[int]:
    """The recipe's positive whole number for `name`, else `default` (a bad value gets its own error later)."""
    value = _number(given.get(name))
    return int(value) if value is not None and value >= 1 and value == int(value) else default


def trl_shape_line(given: dict) -> str:
    """TRL's batch shape for the recipe's numbers (TRL's defaults where it sets none) and the settings here that train
    the same run, those the recipe does not already write; or what cannot match."""
    shape = batch_math.trl_grpo_shape(
        per_device_train_batch_size=_int_of(given, "per_device_train_batch_size", 8),
        gradient_accumulation_steps=_int_of(given, "gradient_accumulation_steps", 1),
        num_generations=_int_of(given, "num_generations", 8),
        num_iterations=_int_of(given, "num_iterations", 1),
        steps_per_generation=_int_of(given, "steps_per_generation", None),
        generation_batch_size=_int_of(given, "generation_batch_size", None),
        max_steps=_int_of(given, "max_steps", None),
    )
    per_generation = shape.optimizer_steps_per_generation
    text = (
        "TRL's batch shape on 1 process (P processes: completions and total_episodes x P): "
        f"{shape.completions_per_generation} completions per generation (per_device_train_batch_size "
        f"{shape.per_device_train_batch_size} x steps_per_generation {shape.steps_per_generation}), "
        f"{per_generation:g} optimizer steps per generation (steps_per_generation x num_iterations "
        f"{shape.num_iterations} / gradient_accumulation_steps {shape.gradient_accumulation_steps})"
    )
    if shape.max_steps is not None:
        text += f", {shape.max_steps} optimizer steps in all"
    write = {
        k: v for k, v in shape.ours.items() if not (k in given or (k in _RENAMED_AS_IS and _RENAMED_AS_IS[k] in given))
    }
    if write:
        label = "the closest here" if shape.mismatch else "the same run here"
        text += f"\n    {label}: " + " ".join(f"--{k} {v}" for k, v in write.items())
    if shape.mismatch:
        text += f"\n    not the same run here: {shape.mismatch}"
    return text


def trl_port_notice(foreign: Iterable[str], script: str, given: Optional[dict] = None) -> Optional[str]:
    """For an RL run given TRL's GRPO names: which algorithm the recipe gets here, TRL's defaults that differ from
    ours for the settings the recipe does not set, and TRL's batch shape with the values that give it here; None
    when no TRL name was given. `given`: every key of the run (ours and foreign) with its value."""
    given = given or {}
    trl_names = [k for k in foreign if (lookup(k) and TRL in lookup(k).libraries) or k in UNSUPPORTED]  # type: ignore[union-attr]
    if script != "rlvr_ppo" or not trl_names:
        return None
    lines = [
        f"these look like TRL GRPOConfig names ({', '.join(trl_names[:4])}{', ...' if len(trl_names) > 4 else ''}): "
        "note that the default here is algo ppo (a value model), not GRPO, and these defaults differ from TRL's "
        "(configs/grpo_trl_defaults.yaml sets TRL's values in our keys):"
    ]
    for key, ours, theirs, write in TRL_GRPO_DIFFERENCES:
        if write != "(the same)" and key not in TRL_SHAPE_KEYS and not _set_here(key, given):
            lines.append(f"    {key}: here {ours}; TRL {theirs} -> {write}")
    lines.append(trl_shape_line(given))
    return "\n".join(lines)


def markdown_table() -> str:
    """The README's table of these names (tests/test_flag_names.py checks the README holds it verbatim)."""
    lines = ["| their name | where | here | note |", "|---|---|---|---|"]
    for f in FOREIGN_NAMES:
        lines.append(f"| `{f.name}` | {', '.join(f.libraries)} | {f.here} | {f.note} |")
    return "\n".join(lines)


def differences_table() -> str:
    """The porting page's table of TRL GRPO's defaults that differ from ours (TRL_GRPO_DIFFERENCES)."""
    lines = ["| here | our default | TRL GRPOConfig | to get TRL's |", "|---|---|---|---|"]
    for key, ours, theirs, write in TRL_GRPO_DIFFERENCES:
        lines.append(f"| `{key}` | {ours} | {theirs} | {write.replace('(the same)', 'the same')} |")
    return "\n".join(lines)


def unsupported_table() -> str:
    """The porting page's table of the names with no counterpart here, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in UNSUPPORTED.items():
        by_reason.setdefault(reason, []).append(name)
    lines = ["| their names | why not here |", "|---|---|"]
    for reason, names in by_reason.items():
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {reason} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
    print()
    print(unsupported_table())
