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
]


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
