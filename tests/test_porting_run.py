"""A TRL GRPO recipe (docs/porting.md's, shortened to 4 optimizer steps) runs in one attempt from the porting note:
every foreign key renamed as its hint says, the note's "-> --flag value" defaults and its "the same run here:"
settings applied, and the run takes TRL's optimizer-step count (issue 69)."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)

from demo import synthetic
from open_instruct import flag_names, rlvr_ppo, run_dir, runtime
from open_instruct.config import RLVRConfig, parse_config
from open_instruct.errors import ConfigError

# TRL: 8 completions per generation (per_device_train_batch_size 8 x steps_per_generation 1), each trained
# num_iterations 2 times: 2 optimizer steps per generation, max_steps 4 = 2 generations = 16 completions
TRL_RECIPE = {"num_generations": 8, "num_iterations": 2, "per_device_train_batch_size": 8, "max_steps": 4,
              "max_completion_length": 4, "learning_rate": 1.0e-6}  # fmt: skip


def note_for(recipe_path: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(RLVRConfig, [recipe_path])
    return str(e.value)


def ported_recipe(recipe: dict, note: str) -> dict:
    """The recipe as the note says to write it: TRL's names renamed (the value as it is: the hint's `N`), max_steps
    replaced by the note's numbers, the note's defaults (`-> --flag value`) and "the same run here:" settings."""
    ported = {}
    for key, value in recipe.items():
        entry = flag_names.lookup(key)
        if entry is None:
            ported[key] = value  # ours
        elif key != "max_steps":
            ported[entry.keys[0]] = value
    for flag, value in re.findall(r"-> --(\w+) (\S+)", note):
        ported.setdefault(flag, yaml.safe_load(value))
    (same_run,) = [line for line in note.splitlines() if line.strip().startswith("the same run here:")]
    ported.update({k: yaml.safe_load(v) for k, v in re.findall(r"--(\w+) (\S+)", same_run)})
    return ported


def test_trl_grpo_recipe_runs_in_one_attempt_from_the_note_with_trls_step_count(tiny_models, tmp_path):
    files = synthetic.write_task_files(str(tmp_path / "data"), n_train=16, n_eval=4)
    recipe = {"model_name_or_path": tiny_models["causal_lm"], "dataset_name_or_path": files["rl_train"], **TRL_RECIPE}
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump(recipe))
    note = note_for(str(tmp_path / "trl.yaml"))
    assert "4 optimizer steps in all" in note and "--total_episodes 16" in note, note
    ported = ported_recipe(recipe, note)
    assert (ported["algo"], ported["total_episodes"], ported["num_epochs"]) == ("grpo", 16, 2), ported
    (tmp_path / "ported.yaml").write_text(yaml.safe_dump(ported))
    out = tmp_path / "out"
    argv = [str(tmp_path / "ported.yaml"), "--output_dir", str(out), "--save_final_model", "false",
            "--num_samples_logged", "0", "--max_prompt_length", "64"]  # fmt: skip
    try:
        runtime.run(rlvr_ppo.main, argv)
    except SystemExit as e:
        assert e.code in (0, None), e
    finally:
        run_dir.release_all()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    counters = run_dir.read_run(str(out))["final_counters"]
    assert counters["optimizer_step"] == 4, (counters, rows[-1])  # TRL's max_steps
