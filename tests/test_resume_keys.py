"""What a resume compares (issue 34, item 7): every setting that changes what is trained (the environment, the
reward functions, response_length, the loss ...) is a resume key, refused unless accepted with
--allow_resume_changes; the names given there are checked on every start, resumed or not."""

import json
import os

import pytest

from open_instruct import checkpoint, runtime
from open_instruct.config import RLVRConfig, parse_config
from open_instruct.errors import ConfigError

BASE = ["--model_name_or_path", "m", "--dataset_name_or_path", "d.jsonl", "--total_episodes", "64"]


def saved_checkpoint(tmp_path, cfg):
    """The JSON a checkpoint's resume check reads (checkpoint.read_state), from this config."""
    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    state = {"config": json.loads(json.dumps(vars(cfg))), "world_size": 1}
    return str(step), state


@pytest.mark.parametrize(
    "change,key",
    [
        (["--environment", "tool"], "environment"),
        (["--reward_functions", "my.py:f"], "reward_functions"),
        (["--response_length", "512"], "response_length"),
        (["--kl_estimator", "k3"], "kl_estimator"),
        (["--verification_reward", "1"], "verification_reward"),
        (["--policy_loss", "cispo"], "policy_loss"),
    ],
)
def test_a_training_setting_changed_on_resume_is_refused_unless_accepted(tmp_path, monkeypatch, change, key):
    saved_cfg = parse_config(RLVRConfig, BASE)
    step, state = saved_checkpoint(tmp_path, saved_cfg)
    monkeypatch.setattr(checkpoint, "read_state", lambda path: state)
    now = parse_config(RLVRConfig, [*BASE, *change, "--resume_from_checkpoint", step])
    with pytest.raises(ConfigError) as e:
        checkpoint.check_resume_compatible(step, now, 1)
    assert f"{key}: checkpoint {getattr(saved_cfg, key)!r}, now {getattr(now, key)!r}" in str(e.value)
    assert f"--allow_resume_changes {key}" in str(e.value)
    derived = ["loss_norm_length"] if key == "response_length" else []  # its default follows response_length
    accepted = parse_config(RLVRConfig, [*BASE, *change, "--resume_from_checkpoint", step,
                                         "--allow_resume_changes", key, *derived])  # fmt: skip
    checkpoint.check_resume_compatible(step, accepted, 1)  # accepted knowingly


def test_allow_resume_changes_names_are_checked_on_every_start(tmp_path, tiny_models):
    """A misspelt name exits 2 even when `auto` finds no checkpoint (a fresh start)."""
    from demo import synthetic

    data = synthetic.write_jsonl(str(tmp_path / "train.jsonl"), synthetic.rl_rows(8, 0))
    argv = ["--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", data, "--total_episodes",
            "64", "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", "auto"]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        runtime.start(RLVRConfig, [*argv, "--allow_resume_changes", "response_lenght"])
    assert e.value.code == 2
    with pytest.raises(ConfigError, match=r"\['response_lenght'\] are not resume keys"):
        checkpoint.check_allowed_resume_changes(
            parse_config(RLVRConfig, [*argv, "--allow_resume_changes", "response_lenght"]), 1
        )
    assert "response_length" in checkpoint.check_allowed_resume_changes(
        parse_config(RLVRConfig, [*argv, "--allow_resume_changes", "response_length"]), 1
    )
    assert not os.path.exists(tmp_path / "out" / "config.yaml")  # refused before the folder was claimed
