"""A TRL GRPO port trains TRL's run (issue 41, item 3): the port notice gives the settings that make the resolved batch
shape here TRL's (completions per generation, optimizer steps per generation, optimizer steps in all), checked
against TRL's own arithmetic, or says what cannot match; it lists only the settings the recipe does not set."""

import os
import re

import pytest
import yaml

from open_instruct.config import RLVRConfig, parse_config
from open_instruct.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trl_run(pd=8, ga=1, num_generations=8, num_iterations=1, steps_per_generation=None, generation_batch_size=None,
            max_steps=None, processes=1):  # fmt: skip
    """TRL 1.16's numbers, re-implemented from its source:

    trl/trainer/grpo_config.py GRPOConfig.__post_init__:
        neither set:                steps_per_generation = gradient_accumulation_steps
                                    generation_batch_size = per_device_train_batch_size x num_processes x steps_per_gen
        generation_batch_size set:  steps_per_generation = generation_batch_size // (per_device x num_processes)
        steps_per_generation set:   generation_batch_size = per_device x num_processes x steps_per_generation
    trl/trainer/grpo_trainer.py _prepare_inputs: one generation every `steps_per_generation x num_iterations` calls of
    training_step (one per micro-batch); the Trainer makes an optimizer step every gradient_accumulation_steps calls.
    Returns (completions per generation, optimizer steps per generation, optimizer steps, completions generated)."""
    if steps_per_generation is None and generation_batch_size is None:
        steps_per_generation = ga
        generation_batch_size = pd * processes * steps_per_generation
    elif steps_per_generation is None:
        assert generation_batch_size % (pd * processes) == 0
        steps_per_generation = generation_batch_size // (pd * processes)
    else:
        generation_batch_size = pd * processes * steps_per_generation
    micro_steps_per_generation = steps_per_generation * num_iterations
    optimizer_steps_per_generation = micro_steps_per_generation / ga
    generations = max_steps * ga / micro_steps_per_generation if max_steps else None
    completions = generations * generation_batch_size if generations else None
    return generation_batch_size, optimizer_steps_per_generation, max_steps, completions


# TRL settings: the GRPOConfig keys a recipe writes (TRL's names), then what TRL's run is
SETTINGS = [
    {"num_generations": 8, "max_steps": 100},  # TRL's defaults: per_device_train_batch_size 8, one prompt
    {"per_device_train_batch_size": 8, "num_generations": 8, "num_iterations": 2, "max_steps": 100},
    {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "num_generations": 8, "max_steps": 60},
    {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_generations": 4,
        "steps_per_generation": 8,
        "num_iterations": 3,
        "max_steps": 120,
    },  # fmt: skip
    {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "num_generations": 4,
        "generation_batch_size": 16,
        "max_steps": 40,
    },  # fmt: skip
]
# TRL's name -> our key, the value as it is (what the hints say)
RENAMES = {"num_generations": "num_samples_per_prompt", "num_iterations": "num_epochs"}
DROPPED = ("max_steps", "steps_per_generation", "generation_batch_size")  # the notice's numbers replace them


def port_error(tmp_path, trl_keys):
    recipe = tmp_path / "trl.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "m", "dataset_name_or_path": "d.jsonl", **trl_keys}))
    with pytest.raises(ConfigError) as e:
        parse_config(RLVRConfig, [str(recipe)])
    return str(e.value)


def same_run_flags(message):
    """The `--key value` pairs of the notice's "the same run here:" line."""
    (line,) = [x for x in message.splitlines() if x.strip().startswith("the same run here:")]
    return dict(re.findall(r"--(\w+) (\S+)", line.split(":", 1)[1]))


@pytest.mark.parametrize("trl_keys", SETTINGS)
def test_port_with_the_notices_settings_has_trls_batch_shape(tmp_path, trl_keys):
    message = port_error(tmp_path, trl_keys)
    assert "not the same run here" not in message
    flags = same_run_flags(message)
    ported = {"model_name_or_path": "m", "dataset_name_or_path": "d.jsonl", "algo": "grpo"}
    for key, value in trl_keys.items():
        if key not in DROPPED:
            ported[RENAMES.get(key, key)] = value
    ported.update({k: int(v) for k, v in flags.items()})
    (tmp_path / "ported.yaml").write_text(yaml.safe_dump(ported))
    plan = parse_config(RLVRConfig, [str(tmp_path / "ported.yaml")]).batch_plan(1, None)

    completions, steps_per_generation, steps, generated = trl_run(
        pd=trl_keys.get("per_device_train_batch_size", 8),
        ga=trl_keys.get("gradient_accumulation_steps", 1),
        num_generations=trl_keys["num_generations"],
        num_iterations=trl_keys.get("num_iterations", 1),
        steps_per_generation=trl_keys.get("steps_per_generation"),
        generation_batch_size=trl_keys.get("generation_batch_size"),
        max_steps=trl_keys["max_steps"],
    )
    assert plan.episodes_per_rollout == completions
    assert plan.num_epochs * plan.num_mini_batches == steps_per_generation
    assert plan.optimizer_steps == steps
    assert plan.total_episodes == generated
    assert f"{completions} completions per generation" in message
    assert f"{steps_per_generation:g} optimizer steps per generation" in message


def test_trl_arithmetic_above_is_grpo_configs():
    """The re-implementation's generation batch and steps per generation against GRPOConfig itself."""
    trl = pytest.importorskip("trl")
    for keys in SETTINGS:
        given = {k: v for k, v in keys.items() if k != "max_steps"}
        config = trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **given)
        names = {"per_device_train_batch_size": "pd", "gradient_accumulation_steps": "ga"}
        completions, *_ = trl_run(**{names.get(k, k): v for k, v in given.items()})
        assert config.world_size == 1
        assert config.generation_batch_size == completions, keys
        spg = keys.get("steps_per_generation") or completions // config.per_device_train_batch_size
        assert config.steps_per_generation == spg


def test_a_shape_with_no_equivalent_is_named_with_the_reason(tmp_path):
    # 4 completions per process per generation cannot hold whole groups of 8 on one process
    message = port_error(tmp_path, {"per_device_train_batch_size": 4, "num_generations": 8, "max_steps": 10})
    assert "not the same run here: a process generates per_device_train_batch_size 4 x steps_per_generation 1 = " \
        "4 completions, not whole groups of num_generations (num_samples_per_prompt) 8" in message  # fmt: skip
    # a generation that fills half an optimizer step
    message = port_error(
        tmp_path,
        {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_generation": 1,
         "num_generations": 8},
    )  # fmt: skip
    assert "steps_per_generation 1 is not a multiple of gradient_accumulation_steps 2" in message


def test_note_lists_only_settings_the_recipe_does_not_set(tmp_path):
    unset = port_error(tmp_path, {"num_generations": 8, "max_steps": 10})
    for line in ("    beta: here 0.05", "    learning_rate: here 3e-7", "    response_length: here 256"):
        assert line in unset
    message = port_error(
        tmp_path,
        {"num_generations": 8, "max_steps": 10, "kl_coef": 0.0, "learning_rate": 1e-6, "max_completion_length": 128,
         "num_iterations": 2, "per_device_train_batch_size": 8},
    )  # fmt: skip
    for line in ("    beta:", "    learning_rate:", "    response_length:", "    num_epochs:"):
        assert line not in message
    # renamed as they are (num_iterations -> num_epochs) or ours already: not repeated; derived ones are
    assert same_run_flags(message) == {
        "gradient_accumulation_steps": "1", "local_rollout_batch_size": "1", "total_episodes": "40"
    }  # fmt: skip


@pytest.mark.parametrize("pd,ga,group", [(8, 1, 8), (8, 4, 8), (16, 2, 4), (2, 4, 8)])
def test_trl_defaults_recipe_resolves_to_trls_shape(pd, ga, group):
    """configs/grpo_trl_defaults.yaml with TRL's batch settings changed (our names): local_rollout_batch_size null
    is derived as TRL derives its generation batch, so the plan is TRL's run; max_steps 12 there is total_episodes
    12 x per_device_train_batch_size x gradient_accumulation_steps here."""
    base = os.path.join(REPO, "configs", "grpo_trl_defaults.yaml")
    argv = [base, "--model_name_or_path", "m", "--dataset_name_or_path", "d.jsonl",
            "--per_device_train_batch_size", str(pd), "--gradient_accumulation_steps", str(ga),
            "--num_samples_per_prompt", str(group), "--total_episodes", str(12 * pd * ga)]  # fmt: skip
    plan = parse_config(RLVRConfig, argv).batch_plan(1, None)
    completions, steps_per_generation, steps, generated = trl_run(pd=pd, ga=ga, num_generations=group, max_steps=12)
    assert (plan.episodes_per_rollout, plan.num_epochs * plan.num_mini_batches) == (completions, steps_per_generation)
    assert (plan.optimizer_steps, plan.total_episodes) == (steps, generated)


def test_trl_defaults_recipe_says_when_the_generation_batch_splits_a_group():
    base = os.path.join(REPO, "configs", "grpo_trl_defaults.yaml")
    with pytest.raises(ConfigError) as e:
        parse_config(RLVRConfig, [base, "--model_name_or_path", "m", "--dataset_name_or_path", "d.jsonl",
                                  "--total_episodes", "64", "--per_device_train_batch_size", "4"])  # fmt: skip
    assert str(e.value) == (
        "local_rollout_batch_size null (TRL's generation batch) cannot be derived: a process generates "
        "per_device_train_batch_size 4 x steps_per_generation 1 = 4 completions, not whole groups of num_generations "
        "(num_samples_per_prompt) 8 (here each process holds whole groups); set local_rollout_batch_size (prompts per "
        "process per rollout)"
    )
