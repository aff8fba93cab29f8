"""What a resume compares (issue 34, item 7): every setting that changes what is trained (the environment, the
reward functions, response_length, the loss ...) is a resume key, refused unless accepted with
--allow_resume_changes; the names given there are checked on every start, resumed or not."""

import json
import os

import pytest
import torch

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


def test_a_variant_file_edited_or_model_weights_replaced_on_resume_is_refused_unless_accepted(
    tmp_path, monkeypatch, tiny_models
):
    """A checkpoint records the bytes of the user's code files and of the teacher's and the reference's weights
    (input_identity); a resume whose files changed under the same spec or path is refused like a changed setting,
    naming the setting and the file, unless --allow_resume_changes accepts that key."""
    import shutil

    from transformers import AutoModelForCausalLM

    variants = tmp_path / "my_kl.py"
    variants.write_text("def my_kl(logp, ref_logp, scale=1.0):\n    return scale * (logp - ref_logp)\n")
    teacher, policy = str(tmp_path / "teacher"), str(tmp_path / "policy")
    shutil.copytree(tiny_models["causal_lm"], teacher)
    shutil.copytree(tiny_models["causal_lm"], policy)
    argv = [*BASE, "--model_name_or_path", policy, "--teacher_model_name_or_path", teacher, "--kl_estimator",
            f"{variants}:my_kl", "--num_samples_per_prompt", "4"]  # fmt: skip
    saved_cfg = parse_config(RLVRConfig, argv)
    step, state = saved_checkpoint(tmp_path, saved_cfg)
    state["input_identity"] = checkpoint.input_identity(vars(saved_cfg))
    assert sorted((e["key"], os.path.basename(e["path"])) for e in state["input_identity"]) == [
        ("reference_weights", "model.safetensors"),
        ("teacher_weights", "model.safetensors"),
        ("user_code_content", "my_kl.py"),
    ]
    monkeypatch.setattr(checkpoint, "read_state", lambda path: state)

    def resume(*extra):
        checkpoint.check_resume_compatible(step, parse_config(RLVRConfig, [*argv, "--resume_from_checkpoint", step,
                                                                           *extra]), 1)  # fmt: skip

    resume()  # nothing changed
    source = variants.read_text()
    variants.write_text(source.replace("scale * (logp - ref_logp)", "scale * (logp - ref_logp).abs()"))
    with pytest.raises(ConfigError) as e:
        resume()
    assert f"user_code_content: kl_estimator {variants}:my_kl: my_kl.py blake2b" in str(e.value)
    assert "--allow_resume_changes user_code_content" in str(e.value)
    resume("--allow_resume_changes", "user_code_content")
    variants.write_text(source)
    resume()  # the same bytes again

    for folder, key in ((teacher, "teacher_weights"), (policy, "reference_weights")):
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)
        model.save_pretrained(folder)  # same path, same size, other weights
        with pytest.raises(ConfigError) as e:
            resume()
        option = "teacher_model_name_or_path" if key == "teacher_weights" else "model_name_or_path"
        assert f"{key}: {option} {folder}: model.safetensors blake2b" in str(e.value), str(e.value)
        assert f"--allow_resume_changes {key}" in str(e.value)
        resume("--allow_resume_changes", key)
        state["input_identity"] = checkpoint.input_identity(vars(saved_cfg))  # the next checkpoint records them
        resume()


@pytest.mark.parametrize("data_format", ["jsonl", "save_to_disk"])
def test_an_environment_file_named_by_the_rows_is_compared_on_resume(tmp_path, monkeypatch, data_format):
    """A row's `environment` column wins over the recipe's, so the file it names is the run's code as much as
    --environment's: a resume whose file changed under the same spec is refused, naming the column and the file.
    The rows are read as training reads them: a .jsonl file, or a `save_to_disk` folder (whose .json metadata
    files are not rows)."""
    env_file = tmp_path / "my_env.py"
    env_file.write_text("class MyEnv:\n    max_turns = 2\n")
    spec = f"{env_file}:MyEnv"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "ground_truth": "1", "dataset": "arithmetic",
             "environment": spec if i % 2 else None} for i in range(4)]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if data_format == "save_to_disk":
        import datasets

        data = tmp_path / "saved_rows"
        datasets.Dataset.from_list(rows).save_to_disk(str(data))
    argv = [*BASE, "--dataset_name_or_path", str(data)]
    saved_cfg = parse_config(RLVRConfig, argv)
    assert checkpoint.row_column_specs(vars(saved_cfg), "environment") == [spec]
    step, state = saved_checkpoint(tmp_path, saved_cfg)
    state["input_identity"] = checkpoint.input_identity(vars(saved_cfg))
    assert [(e["key"], e["path"]) for e in state["input_identity"]] == [("user_code_content", str(env_file))]
    monkeypatch.setattr(checkpoint, "read_state", lambda path: state)
    resume = lambda *extra: checkpoint.check_resume_compatible(  # noqa: E731
        step, parse_config(RLVRConfig, [*argv, "--resume_from_checkpoint", step, *extra]), 1
    )
    resume()  # nothing changed
    env_file.write_text("class MyEnv:\n    max_turns = 5\n")
    with pytest.raises(ConfigError) as e:
        resume()
    assert f"user_code_content: the rows' environment column {spec}: my_env.py blake2b" in str(e.value)
    resume("--allow_resume_changes", "user_code_content")
