"""What the dedicated-engine tests share (tests/test_engine_client.py, tests/test_engine_client_runs.py, two files so
that two pytest workers run them side by side): the RL task with an SFT'd starting policy, the GRPO command on a
dedicated engine, and readers of a run's metrics and engine processes."""

import json
import os
import subprocess

import torch
from training_helpers import REPO, run_script, script_env

from demo import synthetic

SCRIPT = os.path.join(REPO, "open_instruct", "rlvr_ppo.py")
ENV = script_env()


def build_task(tmp_path_factory) -> dict:
    """RL prompt files and an SFT'd starting policy at hidden 128 (see tests/test_rlvr.py for the task)."""
    from demo.tiny import save_tiny_models

    root = str(tmp_path_factory.mktemp("rl_server"))
    models = save_tiny_models(os.path.join(root, "models"), hidden_size=128)
    files = synthetic.write_task_files(os.path.join(root, "data"), n_train=2000, n_eval=200)
    sft_data = synthetic.write_jsonl(
        os.path.join(root, "data", "sft_noisy.jsonl"), synthetic.noisy_sft_rows(2000, 0, 0.6)
    )
    sft_dir = os.path.join(root, "sft")
    run([
        os.path.join(REPO, "open_instruct", "sft.py"), os.path.join(REPO, "configs", "sft_tiny.yaml"),
        "--model_name_or_path", models["causal_lm"], "--dataset_name_or_path", sft_data,
        "--eval_dataset_name_or_path", files["sft_eval"], "--output_dir", sft_dir, "--num_train_epochs", "3",
        "--eval_steps", "1000", "--checkpointing_steps", "1000",
    ])  # fmt: skip
    return {"root": root, "policy": os.path.join(sft_dir, "final_model"), **files}


def tiny_policy(path: str, seed: int, tie: bool) -> tuple:
    """The tiny test Llama at hidden 128 (head_dim 32, what vLLM's CPU attention takes), 2 layers, seeded, saved
    with its tokenizer at `path`: (model, tokenizer)."""
    from transformers import LlamaForCausalLM

    from demo.tiny import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    cfg = tiny_llama_config(len(tokenizer), 128, 2, max_position_embeddings=256, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return run_script(args, ENV, timeout)


def grpo_args(task: dict, out_dir: str, *extra: str) -> list[str]:
    return [
        SCRIPT, os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", task["policy"], "--dataset_name_or_path", task["rl_train"],
        "--eval_dataset_name_or_path", task["rl_eval"], "--output_dir", out_dir,
        "--algo", "grpo", "--num_samples_per_prompt", "8", "--local_rollout_batch_size", "16",
        "--per_device_train_batch_size", "128", "--num_epochs", "1", "--kl_estimator", "k3",
        "--total_episodes", "1024", "--eval_steps", "4", "--checkpointing_steps", "2",
        "--generation_backend", "vllm_server", "--vllm_engine_start_timeout", "600", *extra,
    ]  # fmt: skip


def read_rows(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def evals(rows: list[dict]) -> list[float]:
    return [r["eval/correct_rate"] for r in rows if "eval/correct_rate" in r]


def read_rows_of(out_dir: str, name: str) -> list[dict]:
    with open(os.path.join(out_dir, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def group_members(leaders: list[int]) -> list[int]:
    """Processes left in the process groups of these engine servers (each engine runs in a group of its own)."""
    found = [subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout for pid in leaders]
    return [int(p) for out in found for p in out.split()]


def engine_pids(out_dir: str) -> list[int]:
    """The engine server processes started for this output folder (their command line names its engine_model)."""
    found = subprocess.run(["pgrep", "-f", os.path.join(out_dir, "engine_model")], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]
