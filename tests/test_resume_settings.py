"""Each setting is declared once (config.setting) with how a resume treats it and what it loads (issue 68): a resume
with any setting changed is refused or the setting is declared free to change, for every field of every script, and
what a setting names to load again (a teacher, a reward model, the reference, a judge's folder, the user's code) is
compared by content because of how it is declared."""

import copy
import dataclasses
import json
import shutil
import typing

import pytest
import torch

from open_instruct import checkpoint
from open_instruct.config import CONFIG_CLASSES, LOADS, RESUME_KINDS, RLVRConfig, parse_config
from open_instruct.errors import ConfigError

BASE = ["--model_name_or_path", "m", "--dataset_name_or_path", "d.jsonl"]
RL_BASE = [*BASE, "--total_episodes", "64"]


def test_every_setting_declares_how_a_resume_treats_it_and_what_it_loads():
    """A field declared without `setting` (or with a kind outside the tables) fails here, naming it."""
    undeclared = []
    for script, cls in CONFIG_CLASSES.items():
        for f in dataclasses.fields(cls):
            declared = f.metadata.get("resume") in RESUME_KINDS and f.metadata.get("loads") in (None, *LOADS)
            if not declared or (f.metadata.get("loads") and not f.metadata.get("content_key")):
                undeclared.append(f"{script}.{f.name}")
    assert undeclared == []


def _changed(value, hint):
    """Another valid-looking value of the field's type (no config check runs on it: the resume check reads values)."""
    if typing.get_origin(hint) is typing.Union:
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return next(choice for choice in typing.get_args(hint) if choice != value)
    if hint is bool:
        return not value
    if hint is int:
        return (value or 0) + 1
    if hint is float:
        return (value or 0.0) + 0.5
    if hint is str:
        return f"{value or ''}x"
    if typing.get_origin(hint) is list:
        return [*(value or []), _changed(None, typing.get_args(hint)[0])]
    if typing.get_origin(hint) is dict:
        return {**(value or {}), "scale": 2.0}
    raise AssertionError(f"no changed value for {hint}")


def _saved(tmp_path, monkeypatch, cfg):
    """A checkpoint of `cfg` as the resume check reads it (checkpoint.read_state), without weights."""
    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True, exist_ok=True)
    state = {"config": json.loads(json.dumps(vars(cfg))), "world_size": 1}
    monkeypatch.setattr(checkpoint, "read_state", lambda path: state)
    return str(step), state


# What the global batch is called in a refusal of a batch_layout setting
DERIVED = {"local_rollout_batch_size": "rollout_batch_size"}


@pytest.mark.parametrize("script", list(CONFIG_CLASSES))
def test_a_resume_with_any_setting_changed_is_refused_or_declared_free_to_change(tmp_path, monkeypatch, script):
    """Every field of the script, changed alone: refused naming it (must_match: accepted when named in
    allow_resume_changes; structural: never), refused naming the global batch it makes (batch_layout), or resumed
    (may_change)."""
    cls = CONFIG_CLASSES[script]
    saved_cfg = parse_config(cls, RL_BASE if script == "rlvr_ppo" else BASE)
    step, _ = _saved(tmp_path, monkeypatch, saved_cfg)
    hints = typing.get_type_hints(cls)
    wrong, kinds = [], {}
    for f in dataclasses.fields(cls):
        kind = f.metadata["resume"]
        kinds[kind] = kinds.get(kind, 0) + 1
        now = copy.copy(saved_cfg)
        if f.name == "allow_resume_changes":
            setattr(now, f.name, ["dataset_content"])  # any other name is refused as not a resume key
        else:
            setattr(now, f.name, _changed(getattr(saved_cfg, f.name), hints[f.name]))
        try:
            checkpoint.check_resume_compatible(step, now, 1)
            refusal = None
        except ConfigError as e:
            refusal = str(e)
        named = DERIVED.get(f.name, "mini_batch_size") if kind == "batch_layout" else f.name
        if kind == "may_change":
            if refusal is not None:
                wrong.append(f"{f.name} (may_change) refused: {refusal}")
            continue
        if refusal is None or f"\n  {named}: checkpoint " not in refusal:
            wrong.append(f"{f.name} ({kind}) not refused naming {named}: {refusal}")
            continue
        now.allow_resume_changes = [named]
        if kind == "structural":
            with pytest.raises(ConfigError, match="cannot be accepted"):
                checkpoint.check_resume_compatible(step, now, 1)
        else:
            checkpoint.check_resume_compatible(step, now, 1)  # accepted knowingly
    assert wrong == []
    assert kinds["must_match"] > 10 and kinds["may_change"] > 10 and kinds["structural"] >= 4, kinds


@pytest.mark.parametrize(
    "change,key", [(["--ptx_coef", "0.2"], "ptx_coef"), (["--ptx_dataset", "other_demos.jsonl"], "ptx_dataset")]
)
def test_a_resume_with_another_demonstrations_loss_is_refused(tmp_path, monkeypatch, change, key):
    """PPO-ptx's data and weight change what is trained: a resume that changes either is refused (it went through
    silently before these were declared)."""
    ptx = ["--ptx_dataset", "demos.jsonl", "--ptx_coef", "0.1"]
    saved_cfg = parse_config(RLVRConfig, [*RL_BASE, *ptx])
    step, _ = _saved(tmp_path, monkeypatch, saved_cfg)
    now = parse_config(RLVRConfig, [*RL_BASE, *ptx, *change, "--resume_from_checkpoint", step])
    with pytest.raises(ConfigError) as e:
        checkpoint.check_resume_compatible(step, now, 1)
    assert f"{key}: checkpoint {getattr(saved_cfg, key)!r}, now {getattr(now, key)!r}" in str(e.value)
    assert f"--allow_resume_changes {key}" in str(e.value)
    accepted = parse_config(RLVRConfig, [*RL_BASE, *ptx, *change, "--resume_from_checkpoint", step,
                                         "--allow_resume_changes", key])  # fmt: skip
    checkpoint.check_resume_compatible(step, accepted, 1)


def _replace_weights(folder):
    """Same path, same size, other weights: the final norm doubled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    model.save_pretrained(folder)


def test_a_reward_model_replaced_at_the_same_path_is_refused_on_resume(tmp_path, monkeypatch, tiny_models):
    """reward_model_path is declared to load weights: their content is recorded and compared like the teacher's."""
    folder = str(tmp_path / "rm")
    shutil.copytree(tiny_models["causal_lm"], folder)
    argv = [*RL_BASE, "--reward_model_path", folder, "--reward_model_multiplier", "1.0"]
    saved_cfg = parse_config(RLVRConfig, argv)
    step, state = _saved(tmp_path, monkeypatch, saved_cfg)
    state["input_identity"] = checkpoint.input_identity(vars(saved_cfg))
    assert [(e["key"], e["what"]) for e in state["input_identity"]] == [
        ("reward_model_weights", f"reward_model_path {folder}")
    ]
    resume = lambda *extra: checkpoint.check_resume_compatible(  # noqa: E731
        step, parse_config(RLVRConfig, [*argv, "--resume_from_checkpoint", step, *extra]), 1
    )
    resume()  # nothing changed
    _replace_weights(folder)
    with pytest.raises(ConfigError) as e:
        resume()
    assert f"reward_model_weights: reward_model_path {folder}: model.safetensors blake2b" in str(e.value)
    assert "--allow_resume_changes reward_model_weights" in str(e.value)
    resume("--allow_resume_changes", "reward_model_weights")


def test_a_judge_folder_replaced_at_the_same_path_is_refused_on_resume_and_not_reused(
    tmp_path, monkeypatch, tiny_models
):
    """A judge's local_model folder, named in the user's reward-function file, is declared by the Judge itself
    (`weight_folders`): its weights are compared on resume under the reward_functions setting, and the judge's
    reply cache is keyed by their content, not the path (a copy elsewhere reuses the replies, a replacement at the
    same path does not)."""
    from open_instruct.judge import Judge

    folder = str(tmp_path / "judge_model")
    shutil.copytree(tiny_models["causal_lm"], folder)
    judge_file = tmp_path / "my_judge.py"
    judge_file.write_text(
        f"from open_instruct.judge import Judge\nhelpful = Judge('Rate: {{completion}}', local_model={folder!r})\n"
    )
    spec = f"{judge_file}:helpful"
    argv = [*RL_BASE, "--reward_functions", spec]
    saved_cfg = parse_config(RLVRConfig, argv)
    step, state = _saved(tmp_path, monkeypatch, saved_cfg)
    state["input_identity"] = checkpoint.input_identity(vars(saved_cfg))
    assert [(e["key"], e["what"]) for e in state["input_identity"]] == [
        ("user_code_content", f"reward_functions {spec}"),
        ("user_code_content", f"reward_functions {spec} loads {folder}"),
    ]
    resume = lambda *extra: checkpoint.check_resume_compatible(  # noqa: E731
        step, parse_config(RLVRConfig, [*argv, "--resume_from_checkpoint", step, *extra]), 1
    )
    resume()  # nothing changed

    key_before = Judge("Rate: {completion}", local_model=folder).cache_key("a judge prompt")
    copied = str(tmp_path / "judge_copy")
    shutil.copytree(folder, copied)
    assert Judge("Rate: {completion}", local_model=copied).cache_key("a judge prompt") == key_before

    _replace_weights(folder)
    with pytest.raises(ConfigError) as e:
        resume()
    assert f"user_code_content: reward_functions {spec} loads {folder}: model.safetensors blake2b" in str(e.value)
    resume("--allow_resume_changes", "user_code_content")
    assert Judge("Rate: {completion}", local_model=folder).cache_key("a judge prompt") != key_before


def test_the_reliability_page_shows_how_a_resume_treats_each_setting():
    import os

    from open_instruct.config import resume_table

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "reliability.md")) as f:
        assert resume_table() in f.read()
