"""shared_prompt_forward: a group's prompt computed once per forward (models.shared_prefix_forward), in the no-grad
passes (old log-probs, reference, values, reward model) and in the training forward/backward, gives the unshared
run's numbers within the rounding of a reordered forward and backward (tests/tolerances.py); off, no forward shares.
The loss and gradients of one micro-batch of a multi-turn episode: tests/test_multiturn_rlvr.py."""

import pytest
import torch
from tolerances import run_rtol
from training_helpers import read_metrics, recipe_inputs

# PPO: policy, reference (KL in the reward), value model and a reward model; GRPO: policy and reference (k3 KL loss).
# num_epochs 2: off-policy, so the old log-probs get a pass of their own.
VARIANTS = {
    "ppo": ["--algo", "ppo", "--reward_model_multiplier", "0.5"],
    "grpo": ["--algo", "grpo", "--kl_estimator", "k3", "--beta", "0.05"],
}


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    from demo.synthetic import rl_rows, write_jsonl

    root = tmp_path_factory.mktemp("shared_prompt_data")
    return {"train": write_jsonl(str(root / "train.jsonl"), rl_rows(32, 0)),
            "eval": write_jsonl(str(root / "eval.jsonl"), rl_rows(4, 1))}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_runs_with_and_without_prompt_sharing_log_the_same_numbers(variant, tiny_models, rl_data, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    from open_instruct import models, rlvr_ppo, runtime

    args = [
        *recipe_inputs("rlvr_tiny.yaml", tiny_models["causal_lm"], rl_data["train"], rl_data["eval"]),
        "--reward_model_path", tiny_models["seq_cls"], "--response_length", "8",
        "--total_episodes", "32", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "4",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_epochs", "2",
        "--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false",
        "--num_samples_logged", "0", *VARIANTS[variant],
    ]  # fmt: skip
    runs, calls = {}, {}
    original = models.shared_prefix_forward
    for shared in ("true", "false"):
        seen = calls.setdefault(shared, [])

        def counted(*a, _seen=seen, **kw):  # the log-prob head's shared forwards that ran (None: the plain one)
            parts = original(*a, **kw)
            if parts is not None and isinstance(parts[0], models.TokenScores):
                _seen.append(torch.is_grad_enabled())
            return parts

        monkeypatch.setattr(models, "shared_prefix_forward", counted)
        out = tmp_path / shared
        runtime.run(rlvr_ppo.main, [*args, "--output_dir", str(out), "--shared_prompt_forward", shared])
        runs[shared] = [r for r in read_metrics(str(out)) if "loss/policy" in r]
    # on: the policy's no-grad passes and its training forward/backward share; off: none does
    assert True in calls["true"] and False in calls["true"] and calls["false"] == []
    on, off = runs["true"], runs["false"]
    assert len(on) == len(off) == 2
    assert [r["train/response_length"] for r in on] == [r["train/response_length"] for r in off]  # same samples
    keys = ("train/score_mean", "train/kl", "loss/policy", "loss/value", "loss/kl", "train/approx_kl",
            "train/entropy", "train/grad_norm", "train/value_grad_norm")  # fmt: skip
    # relative differences, absolute below 0.01 (a value near 0 has no meaningful relative difference)
    gaps = [max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-2) for k in keys if k in a) for a, b in zip(on, off)]
    from transformers import AutoConfig

    width = 96 + 8  # max_prompt_length + response_length
    # 2 rollouts x (2 epochs x 2 mini-batches) optimizer steps on micro-batches of 4 rows
    bound = run_rtol(AutoConfig.from_pretrained(tiny_models["causal_lm"]), width, 4 * width, 8)
    print(f"{variant}: shared vs unshared prompt forwards, relative differences {gaps} (bound {bound:.2e})")
    assert max(gaps) <= bound
