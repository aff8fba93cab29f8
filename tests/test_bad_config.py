"""Invalid configurations: each exits with status 2 and a message naming the key, before any model loads."""

import os
import subprocess
import sys

import pytest
from training_helpers import write_fake_model

from open_instruct import runtime
from open_instruct.config import DPOConfig, RewardModelConfig, RLVRConfig, SFTConfig


@pytest.fixture()
def paths(tmp_path):
    model = tmp_path / "model"
    write_fake_model(str(model))  # config.json + a valid (tiny) safetensors file: passes the folder checks
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    return {"model": str(model), "data": str(data), "out": str(tmp_path / "out"), "tmp": tmp_path}


def base(paths):
    return [
        "--model_name_or_path",
        paths["model"],
        "--dataset_name_or_path",
        paths["data"],
        "--output_dir",
        paths["out"],
    ]


def rl(paths):
    return base(paths) + [
        "--total_episodes",
        "64",
        "--local_rollout_batch_size",
        "4",
        "--num_samples_per_prompt",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
    ]


# (config class, extra argv builder, text the message must contain)
CASES = [
    (SFTConfig, lambda p: base(p) + ["--learning_rat", "1e-5"], "learning_rate"),
    (SFTConfig, lambda p: base(p) + ["--learning_rate", "fast"], "--learning_rate"),
    (SFTConfig, lambda p: base(p) + ["--learning_rate", "-1"], "learning_rate"),
    (SFTConfig, lambda p: base(p) + ["--per_device_train_batch_size", "0"], "per_device_train_batch_size"),
    (SFTConfig, lambda p: base(p) + ["--per_device_train_batch_size", "-4"], "per_device_train_batch_size"),
    (SFTConfig, lambda p: base(p) + ["--per_device_train_batch_size", "2.5"], "--per_device_train_batch_size"),
    (SFTConfig, lambda p: base(p) + ["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps"),
    (SFTConfig, lambda p: base(p) + ["--max_seq_length", "0"], "max_seq_length"),
    (SFTConfig, lambda p: base(p) + ["--num_train_epochs", "0"], "num_train_epochs"),
    (SFTConfig, lambda p: base(p) + ["--warmup_ratio", "1.5"], "warmup_ratio"),
    (SFTConfig, lambda p: base(p) + ["--max_grad_norm", "0"], "max_grad_norm"),
    (SFTConfig, lambda p: base(p) + ["--weight_decay", "-0.1"], "weight_decay"),
    (SFTConfig, lambda p: base(p) + ["--adam_beta2", "1.0"], "adam_beta2"),
    (SFTConfig, lambda p: base(p) + ["--logging_steps", "0"], "logging_steps"),
    (SFTConfig, lambda p: base(p) + ["--lr_scheduler_type", "warmup_linear"], "--lr_scheduler_type"),
    (SFTConfig, lambda p: base(p) + ["--mixed_precision", "fp8"], "--mixed_precision"),
    (SFTConfig, lambda p: base(p) + ["--overlong", "keep"], "--overlong"),
    (SFTConfig, lambda p: base(p) + ["--skip_bad_rows", "maybe"], "--skip_bad_rows"),
    (SFTConfig, lambda p: base(p) + ["--eval_steps", "10"], "eval_steps"),
    (SFTConfig, lambda p: base(p) + ["--best_metric", "eval/loss"], "best_metric"),
    (SFTConfig, lambda p: base(p) + ["--eval_fraction", "0.95"], "eval_fraction"),
    (SFTConfig, lambda p: base(p) + ["--model_name_or_path", str(p["tmp"] / "no_such_model")], "model_name_or_path"),
    (SFTConfig, lambda p: ["--dataset_name_or_path", p["data"], "--output_dir", p["out"]], "model_name_or_path"),
    (SFTConfig, lambda p: ["--model_name_or_path", p["model"], "--output_dir", p["out"]], "dataset_name_or_path"),
    (SFTConfig, lambda p: base(p) + ["--output_dir", "/proc/forbidden/out"], "output_dir"),
    (SFTConfig, lambda p: base(p) + ["--on_nonfinite", "ignore"], "--on_nonfinite"),
    (RewardModelConfig, lambda p: base(p) + ["--keep_last_n_checkpoints", "0"], "keep_last_n_checkpoints"),
    (RewardModelConfig, lambda p: base(p) + ["--best_metric_mode", "up"], "--best_metric_mode"),
    (DPOConfig, lambda p: base(p) + ["--beta", "0"], "beta"),
    (DPOConfig, lambda p: base(p) + ["--loss_type", "kto"], "--loss_type"),
    (DPOConfig, lambda p: base(p) + ["--loss_type", "ipo", "--label_smoothing", "0.1"], "label_smoothing"),
    (DPOConfig, lambda p: base(p) + ["--loss_type", "dpo", "--gamma_beta_ratio", "0.5"], "gamma_beta_ratio"),
    (DPOConfig, lambda p: base(p) + ["--label_smoothing", "0.7"], "label_smoothing"),
    (RLVRConfig, lambda p: base(p), "total_episodes"),
    (RLVRConfig, lambda p: rl(p) + ["--temperature", "0"], "temperature"),
    (RLVRConfig, lambda p: rl(p) + ["--top_p", "0"], "top_p"),
    (RLVRConfig, lambda p: rl(p) + ["--algo", "grpo", "--num_samples_per_prompt", "1"], "num_samples_per_prompt"),
    (RLVRConfig, lambda p: rl(p) + ["--algo", "grpo", "--value_model_path", p["model"]], "value_model_path"),
    (RLVRConfig, lambda p: rl(p) + ["--reward_model_multiplier", "0.5"], "reward_model_path"),
    (RLVRConfig, lambda p: rl(p) + ["--kl_estimator", "k4"], "--kl_estimator"),
    (RLVRConfig, lambda p: rl(p) + ["--gamma", "1.5"], "gamma"),
    (RLVRConfig, lambda p: rl(p) + ["--num_epochs", "0"], "num_epochs"),
    (RLVRConfig, lambda p: rl(p) + ["--response_length", "-1"], "response_length"),
    (RLVRConfig, lambda p: rl(p) + ["--generation_backend", "sglang"], "--generation_backend"),
    # names read from the rl_algorithms tables, with the closest row suggested
    (RLVRConfig, lambda p: rl(p) + ["--advantage_estimator", "grpoo"], "advantage_estimator 'grpoo' is not one of"),
    (RLVRConfig, lambda p: rl(p) + ["--policy_loss", "gspo2"], "did you mean 'gspo'?"),
    (RLVRConfig, lambda p: rl(p) + ["--algo", "dpo"], "algo 'dpo' is not one of ['ppo', 'grpo']"),
    (RLVRConfig, lambda p: rl(p) + ["--policy_loss", "cispo", "--dual_clip_c", "3"], "policy_loss ppo/gspo, not cispo"),
    (RLVRConfig, lambda p: rl(p) + ["--value_model_path", str(p["tmp"] / "missing_rm")], "value_model_path"),
    # Batch math that only the plan can check (run by --dry_run before anything loads):
    (RLVRConfig, lambda p: rl(p) + ["--per_device_train_batch_size", "3", "--dry_run", "true"], "mini_batch_size"),
    (
        RLVRConfig,
        lambda p: (
            rl(p)
            + [
                "--algo",
                "grpo",
                "--num_samples_per_prompt",
                "3",
                "--local_rollout_batch_size",
                "4",
                "--gradient_accumulation_steps",
                "1",
                "--dry_run",
                "true",
            ]
        ),
        "group size",
    ),
    (SFTConfig, lambda p: base(p) + ["--per_device_train_batch_size", "8", "--dry_run", "true"], "0 optimizer steps"),
    # issue 22, item 11: silently accepted before (decisions: tests/test_bad_inputs.py, the issue-22 table)
    (SFTConfig, lambda p: base(p) + ["--lora_rank", "8", "--lora_target_modules", "q_proj"], "use_lora is false"),
    (SFTConfig, lambda p: base(p) + ["--learning_rate", "1e-400"], "learning_rate 1e-400 underflows to 0.0"),
    (RLVRConfig, lambda p: rl(p) + ["--num_samples_logged", "-3"], "num_samples_logged must be >= 0, got -3"),
    (SFTConfig, lambda p: base(p) + ["--seed", "-1"], "seed must be in [0, 2**32 - 1], got -1"),
    # issue 22, item 10: a value starting with '-' is read as the value (then checked), not as a missing argument
    (SFTConfig, lambda p: base(p) + ["--adam_epsilon", "-1e-8"], "adam_epsilon must be >= 0, got -1e-08"),
    # multi-turn (issue 25): the values, and the environment resolved (a user file imported) before any model loads
    (RLVRConfig, lambda p: rl(p) + ["--environment", "tool", "--max_turns", "0"], "max_turns must be > 0"),
    (RLVRConfig, lambda p: rl(p) + ["--tool_call_format", "xml"], "--tool_call_format"),
    (RLVRConfig, lambda p: rl(p) + ["--max_turn_tokens", "999"], "max_turn_tokens 999 exceeds response_length 256"),
    (RLVRConfig, lambda p: rl(p) + ["--environment", "nope"], "unknown environment 'nope'"),
    (RLVRConfig, lambda p: rl(p) + ["--environment", str(p["tmp"] / "none.py") + ":X"], "none.py' does not exist"),
    (RLVRConfig, lambda p: rl(p) + ["--environment", "tool", "--tools", "calculator", "abacus"], "tools: unknown"),
    (RLVRConfig, lambda p: rl(p) + ["--environment", "tool", "--tool_call_format", "fenced"], "add python to tools"),
    (
        RLVRConfig,
        lambda p: rl(p) + ["--environment", "tool", "--score_placement", "after_last_token"],
        "after_last_token is single-turn only",
    ),
    (RLVRConfig, lambda p: rl(p) + ["--environment", broken_env_file(p) + ":Env"], "py' failed: SyntaxError"),
]


def broken_env_file(p) -> str:
    path = p["tmp"] / "broken_env.py"
    path.write_text("class Env(:\n")
    return str(path)


@pytest.mark.parametrize("cls,argv,needle", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_invalid_config_exits_2_naming_the_key(cls, argv, needle, paths, capsys):
    with pytest.raises(SystemExit) as exc:
        runtime.start(cls, argv(paths))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_real_process_exits_2_without_loading_torch(paths, repo_root):
    code = (
        "import sys; from open_instruct import runtime; from open_instruct.config import DPOConfig\n"
        "try:\n    runtime.start(DPOConfig, sys.argv[1:])\n"
        "finally:\n    print('TORCH_LOADED', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *base(paths), "--loss_type", "ipo", "--label_smoothing", "0.1"],
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert proc.returncode == 2
    assert "label_smoothing" in proc.stderr
    assert "TORCH_LOADED False" in proc.stdout


def test_script_entry_point_exits_2(paths, repo_root):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(repo_root, "open_instruct", "sft.py"),
            *base(paths),
            "--per_device_train_batch_size",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert proc.returncode == 2 and "per_device_train_batch_size must be > 0" in proc.stderr
    assert not os.path.exists(os.path.join(paths["out"], "metrics.jsonl"))


def test_values_are_told_from_keys_and_recipes_by_position(paths):
    """Issue 22, item 10: a value starting with '-' is a value (`--stop_strings -----`, a negative float); a .yaml
    value of a scalar key is that value, not a recipe (only the first argument, or a .yaml that no key takes, is
    one); a recipe's YAML float that underflows names the key, the file and the line."""
    from open_instruct.config import parse_config
    from open_instruct.errors import ConfigError

    cfg = parse_config(RLVRConfig, rl(paths) + ["--stop_strings", "-----", "-x", "--exp_name", "ablation.yaml"])
    assert cfg.stop_strings == ["-----", "-x"] and cfg.exp_name == "ablation.yaml"
    lr = parse_config(SFTConfig, base(paths) + ["--learning_rate", "-0.5e-3", "--learning_rate", "0"]).learning_rate
    assert lr == 0  # the negative value was read as a value (the last one wins), not as a missing argument
    with pytest.raises(ConfigError, match=r"'late.yaml' looks like a recipe file after the --key value options"):
        parse_config(SFTConfig, base(paths) + ["--exp_name", "ablation", "late.yaml"])
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rat'"):  # a misspelt key is still a key
        parse_config(SFTConfig, base(paths) + ["--learning_rat", "-1"])
    recipe = paths["tmp"] / "tiny_lr.yaml"
    recipe.write_text("script: sft\nseed: 3\nlearning_rate: 2.5e-400\n")
    with pytest.raises(ConfigError, match=rf"learning_rate 2.5e-400 underflows to 0.0 .*recipe {recipe} line 3"):
        parse_config(SFTConfig, [str(recipe), *base(paths)])


def test_a_per_source_best_metric_the_run_logs_is_accepted(paths):
    """Issue 22, item 11: with a held-out set of several sources the scripts also log eval/<source>/..., so those
    names are valid best_metric values (and with one source they are not: nothing logs them)."""
    from open_instruct.config import parse_config
    from open_instruct.errors import ConfigError

    other = paths["tmp"] / "sft_eval.jsonl"
    other.write_text(open(paths["data"]).read())
    evals = ["--eval_dataset_name_or_path", f"{paths['data']},{other}", "--eval_steps", "1"]
    cfg = parse_config(SFTConfig, base(paths) + evals + ["--best_metric", "eval/sft_eval/loss"])
    assert cfg.per_source_metric_names() == ["eval/data/loss", "eval/sft_eval/loss"]
    rl_cfg = parse_config(RLVRConfig, rl(paths) + evals + ["--best_metric", "eval/data/correct_rate"])
    assert rl_cfg.per_source_metric_names() == ["eval/data/correct_rate", "eval/sft_eval/correct_rate"]
    with pytest.raises(ConfigError, match=r"'eval/sft_eval/perplexity' is not a sft eval metric"):  # not per source
        parse_config(SFTConfig, base(paths) + evals + ["--best_metric", "eval/sft_eval/perplexity"])
    one = ["--eval_dataset_name_or_path", str(other), "--eval_steps", "1", "--best_metric", "eval/sft_eval/loss"]
    with pytest.raises(ConfigError, match=r"'eval/sft_eval/loss' is not a sft eval metric"):
        parse_config(SFTConfig, base(paths) + one)


def test_gpu_on_a_cpu_real_start_is_said_to_affect_only_the_plan(paths, monkeypatch, capsys):
    """`--gpu H100` on a machine without a GPU: a real start says in one line that it only affects --dry_run and
    oi-plan, and judges the CPU it runs on; a dry run judges the H100 it was told (issue 69)."""
    from open_instruct import plan
    from open_instruct.config import parse_config

    monkeypatch.setattr(plan, "this_machine_device", lambda: "cpu")
    cfg = parse_config(RLVRConfig, rl(paths) + ["--gpu", "H100"])
    capsys.readouterr()
    real = plan.judged_layout(cfg, 1, real_start=True)
    said = capsys.readouterr().out.splitlines()
    assert said == ["gpu H100: only affects --dry_run and oi-plan; this start runs on this machine's CPU"]
    assert real.assumptions.gpu == "cpu" and not real.told
    dry = plan.judged_layout(cfg, 1, real_start=False)
    assert capsys.readouterr().out == "" and dry.assumptions.gpu == "H100" and dry.told


def test_rl_help_shows_the_spec_forms_of_the_registered_integrations():
    """--help of the RL script names each built-in prefix's form beside dataset_name_or_path and environment, from
    the registry (integrations.BUILT_IN), so the config names none (issue 69)."""
    from open_instruct import integrations
    from open_instruct.config import help_text

    text = " ".join(help_text(RLVRConfig).split())
    for prefix in integrations.BUILT_IN:
        assert text.count(f"{prefix}:<spec>[?key=value&...]") == 2, prefix
    assert "reasoning_gym:<spec>" in text and "verifiers:<spec>" in text
    assert "reasoning_gym:" not in " ".join(help_text(SFTConfig).split())
