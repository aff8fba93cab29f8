"""Variants from the user's own file (issue 34, item 5): advantage_estimator, policy_loss and kl_estimator given as
`path/file.py:function`, written against the narrow inputs (rl_algorithms.AdvantageInputs, LossInputs; issue 42),
with algo_kwargs passed to the functions that take them; a function written for the old call (cfg, rollout,
accelerator) exits 2 showing the new one; a copy of rlvr_ppo.py runs unchanged and registers its own estimator; the
"not one of" message says how to add one."""

import json
import os
import subprocess
import sys

import pytest

from open_instruct import rl_algorithms
from open_instruct.config import RLVRConfig, parse_config
from open_instruct.errors import ConfigError
from open_instruct.rl_algorithms import chosen_kwargs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--model_name_or_path", "m", "--dataset_name_or_path", "d.jsonl", "--total_episodes", "64"]

VARIANTS_FILE = """
import torch
from open_instruct.rl_algorithms import AdvantageInputs, Advantages, LossInputs, advantage_estimator

CALLS = {"estimator": [], "loss": [], "kl": []}


@advantage_estimator("file_constant", uses_groups=False, kl_in_reward=False)
def constant(x: AdvantageInputs, level=1.0) -> Advantages:
    CALLS["estimator"].append(level)
    return Advantages(x.mask.clone() * level, None, x.beta, torch.ones(len(x.scores), dtype=torch.bool))


def scaled_ratio(x: LossInputs, scale=1.0):
    CALLS["loss"].append(scale)
    ratio = torch.exp(x.logp - x.old_logp)
    return -scale * x.advantages * ratio, torch.zeros_like(ratio)


def abs_log_ratio(logp, ref_logp, scale=1.0):
    CALLS["kl"].append(scale)
    return scale * (logp - ref_logp).abs()
"""


@pytest.fixture
def variants_file(tmp_path):
    path = tmp_path / "my_variants.py"
    path.write_text(VARIANTS_FILE)
    yield str(path)
    for table, _, _ in rl_algorithms.TABLES.values():  # the rows the specs registered
        for name in [n for n in table if str(path) in n or n == "file_constant"]:
            del table[name]


def test_unknown_variant_says_how_to_add_one():
    for option, value in [("advantage_estimator", "grpo2"), ("policy_loss", "my_loss"), ("kl_estimator", "k4")]:
        with pytest.raises(ConfigError) as e:
            parse_config(RLVRConfig, [*BASE, f"--{option}", value])
        message = str(e.value)
        assert f"{option} {value!r} is not one of [" in message
        assert f"to add one, name a function in your file: --{option} path/to/my_file.py:my_fn" in message


def test_spec_rows_keep_the_decorators_traits_and_plain_functions_get_the_defaults(variants_file):
    cfg = parse_config(RLVRConfig, [*BASE, "--advantage_estimator", f"{variants_file}:constant",
                                    "--policy_loss", f"{variants_file}:scaled_ratio",
                                    "--kl_estimator", f"{variants_file}:abs_log_ratio",
                                    "--algo_kwargs", "level=0.5", "scale=3"])  # fmt: skip
    assert not cfg.uses_value_model and not cfg.uses_groups and not cfg.kl_in_reward  # the decorator's traits
    assert rl_algorithms.POLICY_LOSSES[cfg.policy_loss].takes_dual_clip  # a plain function: the default row
    assert chosen_kwargs(cfg, "advantage_estimator") == {"level": 0.5}
    assert chosen_kwargs(cfg, "policy_loss") == {"scale": 3} == chosen_kwargs(cfg, "kl_estimator")
    with pytest.raises(ConfigError, match=r"policy_loss '.*:missing': '.*my_variants.py' has no function 'missing'"):
        parse_config(RLVRConfig, [*BASE, "--policy_loss", f"{variants_file}:missing"])


def test_variants_from_a_file_run_with_their_algo_kwargs(variants_file, tiny_models, tmp_path):
    """Advantage `level` on every token and the loss -scale * A * ratio: one epoch in one mini-batch trains on the
    weights that sampled, so ratio = 1 and loss/policy = token mean of -scale * level = -3 * 0.5 = -1.5; the KL
    function runs with scale 3 in the loss (beta > 0, KL as a loss term: the estimator's kl_in_reward is false)."""
    from demo import synthetic
    from open_instruct import rlvr_ppo, runtime

    data = synthetic.write_jsonl(str(tmp_path / "train.jsonl"), synthetic.rl_rows(16, 0))
    out = tmp_path / "out"
    runtime.run(rlvr_ppo.main, [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
        "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data, "--output_dir", str(out),
        "--total_episodes", "16", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--num_epochs", "1",
        "--response_length", "6", "--beta", "0.1", "--eval_steps", "100", "--checkpointing_steps", "100",
        "--save_final_model", "false", "--best_metric", "null",
        "--advantage_estimator", f"{variants_file}:constant", "--policy_loss", f"{variants_file}:scaled_ratio",
        "--kl_estimator", f"{variants_file}:abs_log_ratio", "--algo_kwargs", "level=0.5", "scale=3",
    ])  # fmt: skip
    calls = rl_algorithms.TABLES["kl_estimator"][0][f"{variants_file}:abs_log_ratio"].function.__globals__["CALLS"]
    assert calls["estimator"] == [0.5] * 3 and set(calls["loss"]) == {3} and set(calls["kl"]) == {3}
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "loss/policy" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    for r in train:
        assert r["loss/policy"] == pytest.approx(-1.5, abs=1e-6)
        assert "loss/kl" in r and "loss/value" not in r


COPY_ADDITION = """
from open_instruct.rl_algorithms import advantage_estimator, group_advantages, group_baseline


@advantage_estimator("copy_only", uses_groups=True)
def copy_only(x):
    CALLS.append(len(x.scores))
    return group_baseline(x, group_advantages(x.scores, x.group_size))


CALLS = []

"""


def test_a_copied_script_sees_its_own_registrations(tmp_path, tiny_models):
    """A copy of rlvr_ppo.py with its own estimator: the config check runs at the top of the file, before the
    registration below it; the name is checked once the script's definitions have run (the traits too: a group
    estimator needs num_samples_per_prompt >= 2), and a tiny run trains with it. The original script refuses the
    name, saying how to add one; copied unchanged into another folder, it runs a tiny GRPO step."""
    from demo import synthetic

    with open(os.path.join(REPO, "open_instruct", "rlvr_ppo.py")) as f:
        source = f.read()
    main_block = source.rindex('if __name__ == "__main__":')
    copy = tmp_path / "my_rlvr.py"
    copy.write_text(source[:main_block] + COPY_ADDITION + source[main_block:])
    unchanged = tmp_path / "elsewhere" / "rlvr_ppo.py"
    unchanged.parent.mkdir()
    unchanged.write_text(source)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    data = synthetic.write_jsonl(str(tmp_path / "train.jsonl"), synthetic.rl_rows(8, 0))  # a dry run reads rows too
    argv = [*BASE, "--dataset_name_or_path", data, "--advantage_estimator", "copy_only", "--output_dir",
            str(tmp_path / "out")]  # fmt: skip

    def run(script, *extra, args=argv):
        return subprocess.run([sys.executable, script, *args, *extra], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    tiny = [os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
            "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data, "--total_episodes", "8",
            "--local_rollout_batch_size", "2", "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "8",
            "--response_length", "6", "--eval_steps", "100", "--checkpointing_steps", "100"]  # fmt: skip
    for script, extra in [(unchanged, ["--algo", "grpo"]), (copy, ["--advantage_estimator", "copy_only"])]:
        out = tmp_path / f"tiny_{script.stem}"
        done = run(str(script), *extra, "--output_dir", str(out), args=tiny)
        assert done.returncode == 0, done.stderr[-3000:]
        train = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
        assert [r["rollout_step"] for r in train] == [1]
        assert "loss/kl" in train[0] and "loss/value" not in train[0]  # a group estimator: KL a loss term

    ok = run(str(copy), "--num_samples_per_prompt", "4", "--per_device_train_batch_size", "4", "--dry_run", "true")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "advantage_estimator: copy_only" in ok.stdout
    traits = run(str(copy), "--num_samples_per_prompt", "1", "--dry_run", "true")
    assert traits.returncode == 2 and "advantage_estimator copy_only needs num_samples_per_prompt >= 2" in traits.stderr
    original = run(os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), "--dry_run", "true")
    assert original.returncode == 2
    assert "advantage_estimator 'copy_only' is not one of [" in original.stderr
    assert "to add one, name a function in your file" in original.stderr


def test_nan_and_inf_knobs_and_async_bound_exit_2():
    cases = [
        (["--tis_cap", "nan"], "tis_cap must be a finite number"),
        (["--tis_cap", "inf"], "tis_cap must be a finite number"),
        (["--is_mask_low", "nan"], "is_mask_low must be a finite number"),
        (["--is_mask_high", "inf"], "is_mask_high must be a finite number"),
        (
            ["--reward_functions", "m:f", "--reward_function_weights", "nan"],
            "reward_function_weights[0] must be a finite",
        ),
        (["--async_steps", "1000", "--generation_backend", "hf"], "async_steps 1000 is more than 64"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as e:
            parse_config(RLVRConfig, [*BASE, *extra])
        assert message in str(e.value), (extra, str(e.value))


def test_the_extending_pages_example_resolves(tmp_path):
    """docs/extending.md's variants file and recipe lines, as written there."""
    import re

    import yaml

    with open(os.path.join(REPO, "docs", "extending.md")) as f:
        page = f.read()
    code = re.search(r"```python\n(# my_variants.py\n.*?)```", page, re.S).group(1)
    recipe = yaml.safe_load(re.search(r"```yaml\n# in the recipe\n(.*?)```", page, re.S).group(1))
    (tmp_path / "my_variants.py").write_text(code)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        lines = [f"{k}: {json.dumps(v)}" for k, v in recipe.items()]
        (tmp_path / "r.yaml").write_text("\n".join(lines) + "\n")
        cfg = parse_config(RLVRConfig, [str(tmp_path / "r.yaml"), *BASE, "--num_samples_per_prompt", "4"])
        assert cfg.uses_groups and not cfg.uses_value_model  # the decorator's traits
        assert chosen_kwargs(cfg, "advantage_estimator") == {"margin": 0.1}
        assert chosen_kwargs(cfg, "policy_loss") == {"cap": 3.0} and chosen_kwargs(cfg, "kl_estimator") == {
            "scale": 0.5
        }
    finally:
        os.chdir(cwd)
        for table, _, _ in rl_algorithms.TABLES.values():
            for name in [n for n in table if n.startswith("my_variants.py:") or n == "top_half"]:
                del table[name]


OLD_CALLS_FILE = """
def old_estimator(cfg, rollout, accelerator):
    raise AssertionError("never called")


def old_loss(cfg, logp, old_logp, advantages, mask):
    raise AssertionError("never called")
"""


def test_a_function_written_for_the_old_call_exits_2_showing_the_new_one(tmp_path):
    """Before issue 42 an estimator took (cfg, rollout, accelerator) and a loss (cfg, logp, old_logp, advantages,
    mask); such a function is refused when the config is checked, with the call it must now take."""
    path = tmp_path / "old_variants.py"
    path.write_text(OLD_CALLS_FILE)
    cases = [
        ("advantage_estimator", "old_estimator(cfg, rollout, accelerator)", "x an rl_algorithms.AdvantageInputs"),
        ("policy_loss", "old_loss(cfg, logp, old_logp, advantages, mask)", "x an rl_algorithms.LossInputs"),
    ]  # fmt: skip
    for option, function, call in cases:
        with pytest.raises(ConfigError) as e:
            parse_config(RLVRConfig, [*BASE, f"--{option}", f"{path}:{function.split('(')[0]}"])
        message = str(e.value)
        assert f"{function} cannot be called as (x, **algo_kwargs) -> " in message and call in message, message
        assert "docs/extending.md" in message

    @rl_algorithms.advantage_estimator("old_style")  # a copied script's own registration, old style
    def old(cfg, rollout, accelerator):
        raise AssertionError("never called")

    try:
        with pytest.raises(ConfigError, match=r"old\(cfg, rollout, accelerator\) cannot be called as \(x, \*\*algo"):
            parse_config(RLVRConfig, [*BASE, "--advantage_estimator", "old_style"])
    finally:
        del rl_algorithms.ADVANTAGE_ESTIMATORS["old_style"]


BAD_VARIANTS_FILE = """
def no_arg():
    return 0


def extra_required(x, level):
    return level


def short_loss(logp, advantages):
    return logp


def estimator(x, margin=0.0, steps: int = 2):
    from open_instruct.rl_algorithms import group_baseline

    return group_baseline(x, x.scores + margin)


def kl_with_flag(logp, ref_logp, *, strict: bool = False):
    return logp
"""


@pytest.fixture
def bad_variants_file(tmp_path):
    path = tmp_path / "bad_variants.py"
    path.write_text(BAD_VARIANTS_FILE)
    yield str(path)
    for table, _, _ in rl_algorithms.TABLES.values():
        for name in [n for n in table if str(path) in n]:
            del table[name]


def test_bad_signatures_and_algo_kwargs_types_exit_2_naming_the_function(bad_variants_file):
    """A variant that cannot be called as the run calls it, or an algo_kwargs value of another type than the
    function's parameter (its annotation, else its default), is a ConfigError when the config is checked (before
    any model loads), naming the option, the function and the expected call."""
    f = bad_variants_file
    cases = [
        (["--advantage_estimator", f"{f}:no_arg"], ["advantage_estimator", "no_arg()",
         "(x, **algo_kwargs) -> Advantages"]),
        (["--advantage_estimator", f"{f}:extra_required"], ["extra_required(x, level)",
         "missing a required argument: 'level'", "needs a default"]),
        (["--policy_loss", f"{f}:short_loss"], ["policy_loss", "short_loss(logp, advantages)",
         "(x, **algo_kwargs) -> (per-token loss, clipped indicator)"]),
        (["--advantage_estimator", f"{f}:estimator", "--algo_kwargs", "margin=abc"],
         ["algo_kwargs margin='abc' is a str", "estimator's parameter margin takes int or float (its default 0.0)"]),
        (["--advantage_estimator", f"{f}:estimator", "--algo_kwargs", '{"margin": [1, 2]}'],
         ["algo_kwargs margin=[1, 2] is a list"]),
        (["--advantage_estimator", f"{f}:estimator", "--algo_kwargs", "steps=1.5"],
         ["steps=1.5 is a float", "takes int (its annotation)"]),
        (["--kl_estimator", f"{f}:kl_with_flag", "--algo_kwargs", "strict=1"], ["strict=1 is a int", "takes bool"]),
        (["--advantage_estimator", f"{f}:estimator", "--algo_kwargs", "margn=0.5"],
         ["algo_kwargs ['margn'] is taken by none", "did you mean 'margin' for 'margn'?"]),
    ]  # fmt: skip
    for extra, messages in cases:
        with pytest.raises(ConfigError) as e:
            parse_config(RLVRConfig, [*BASE, "--num_samples_per_prompt", "4", *extra])
        for message in messages:
            assert message in str(e.value), (extra, str(e.value))
    fine = parse_config(
        RLVRConfig, [*BASE, "--advantage_estimator", f"{f}:estimator", "--algo_kwargs", "margin=1", "steps=3"]
    )  # an int where a float is the default is a number all the same
    assert chosen_kwargs(fine, "advantage_estimator") == {"margin": 1, "steps": 3}


def test_algo_kwargs_that_is_not_a_mapping_in_a_recipe_is_a_config_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo_kwargs: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"algo_kwargs in .* must be a mapping of argument names to values"):
        parse_config(RLVRConfig, [str(recipe), *BASE])


def test_a_bad_signature_exits_2_before_loading(bad_variants_file, tmp_path):
    """The script itself: exit 2 with the message, before the model path (which does not exist) is read."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    argv = [*BASE, "--policy_loss", f"{bad_variants_file}:short_loss", "--output_dir", str(tmp_path / "out")]
    run = subprocess.run([sys.executable, os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), *argv], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "short_loss(logp, advantages) cannot be called as (x, **algo_kwargs)" in run.stderr
    assert not (tmp_path / "out").exists()


def test_an_algo_kwarg_that_names_a_setting_the_function_receives_is_refused(tmp_path):
    """A row that names run settings (`settings=`) gets them from the config; the same name in algo_kwargs would be
    dropped without a word, so it is refused, naming the setting to use."""
    path = tmp_path / "with_gamma.py"
    path.write_text(
        "from open_instruct.rl_algorithms import Advantages, advantage_estimator\n\n\n"
        "@advantage_estimator('discounted_constant', settings=('gamma',))\n"
        "def discounted_constant(x, gamma, level=1.0):\n"
        "    return Advantages(x.mask * level * gamma, None, x.beta, x.scores == x.scores)\n"
    )
    spec = f"{path}:discounted_constant"
    cfg = parse_config(RLVRConfig, [*BASE, "--advantage_estimator", spec, "--algo_kwargs", "level=0.5"])
    assert chosen_kwargs(cfg, "advantage_estimator") == {"level": 0.5}
    with pytest.raises(ConfigError) as e:
        parse_config(RLVRConfig, [*BASE, "--advantage_estimator", spec, "--algo_kwargs", "gamma=0.5", "level=0.5"])
    assert str(e.value) == (
        f"algo_kwargs ['gamma']: advantage_estimator {spec!r} receives ['gamma'] from the run's settings, never from "
        "algo_kwargs; set them as settings (--gamma VALUE)"
    )


KEEPS_FLAT_GROUPS = """
import torch
from open_instruct.rl_algorithms import Advantages, advantage_estimator, group_advantages


@advantage_estimator("keeps_flat_groups", uses_groups=True, kl_in_reward=False)
def keeps_flat_groups(x):
    advantages = group_advantages(x.scores, x.group_size)
    return Advantages(advantages.unsqueeze(1) * x.mask, None, x.beta, torch.ones(len(x.scores), dtype=torch.bool))
"""


def test_an_estimator_keeping_flat_groups_under_the_filter_stops_naming_itself(tiny_models, tmp_path):
    """On-policy with a reference and filter_zero_std_groups, the rollout scores only the rows of groups with a spread
    under the reference (the KL term's rows). An estimator that keeps the other rows anyway would train on reference
    log-probs of 0: the update stops, naming the estimator and the two ways out."""
    from demo import synthetic
    from open_instruct import rlvr_ppo, runtime

    path = tmp_path / "keeps_flat.py"
    path.write_text(KEEPS_FLAT_GROUPS)
    data = synthetic.write_jsonl(str(tmp_path / "train.jsonl"), synthetic.rl_rows(16, 0))
    try:
        with pytest.raises(RuntimeError, match=r"advantage_estimator '.*keeps_flat_groups' kept rows of flat groups"):
            runtime.run(rlvr_ppo.main, [
                os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
                "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data, "--output_dir",
                str(tmp_path / "out"), "--total_episodes", "32",
                "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "4", "--per_device_train_batch_size",
                "8", "--gradient_accumulation_steps", "2", "--num_epochs", "1", "--response_length", "6", "--beta",
                "0.1", "--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false",
                "--best_metric", "null", "--filter_zero_std_groups", "true",
                "--advantage_estimator", f"{path}:keeps_flat_groups",
            ])  # fmt: skip
    finally:
        for table, _, _ in rl_algorithms.TABLES.values():
            for name in [n for n in table if str(path) in n or n == "keeps_flat_groups"]:
                del table[name]


WRONG_RETURNS_FILE = """
import torch


def wrong_sig(x):
    return x


def tensor_estimator(x, margin=0.0):
    return x.scores + margin


def one_tensor_loss(x):
    return -x.advantages * torch.exp(x.logp - x.old_logp)


def raising_estimator(x):
    return x.no_such_field


def scalar_kl(logp, ref_logp):
    return 0.0
"""


def test_a_wrong_return_is_refused_naming_the_expected_one_before_loading(tmp_path):
    """A function with a signature the run can call but the wrong return (or one that raises) is called once on a
    tiny synthetic batch when the config is checked: 2 groups of num_samples_per_prompt 2 x 3 tokens, so "4 rows x 3
    tokens"; the refusal names what it returned and the return the run needs (issue 69)."""
    path = tmp_path / "wrong_returns.py"
    path.write_text(WRONG_RETURNS_FILE)
    cases = [
        ("advantage_estimator", "wrong_sig", "returned an AdvantageInputs", "rl_algorithms.Advantages("),
        ("policy_loss", "wrong_sig", "returned a LossInputs", "a pair (per-token loss [b, R], clipped indicator"),
        ("advantage_estimator", "tensor_estimator", "returned a Tensor", "rl_algorithms.Advantages("),
        ("policy_loss", "one_tensor_loss", "returned one tensor", "a pair (per-token loss [b, R], clipped"),
        ("advantage_estimator", "raising_estimator", "raised AttributeError", "rl_algorithms.Advantages("),
        ("kl_estimator", "scalar_kl", "returned a float", "a per-token KL estimate: a tensor [n, R]"),
    ]
    try:
        for option, function, returned, expected in cases:
            with pytest.raises(ConfigError) as e:
                parse_config(RLVRConfig, [*BASE, "--num_samples_per_prompt", "2", f"--{option}", f"{path}:{function}"])
            message = str(e.value)
            assert f"{option} '{path}:{function}' {returned}" in message, message
            assert "synthetic batch (4 rows x 3 tokens) before any model loads" in message, message
            assert f"it must return {expected}" in message, message
    finally:
        for table, _, _ in rl_algorithms.TABLES.values():
            for name in [n for n in table if str(path) in n]:
                del table[name]


def test_wrong_sig_exits_2_from_the_script_before_the_model_loads(tmp_path):
    """`def wrong_sig(x): return x` as the estimator: the script exits 2 naming Advantages, before the model path
    (which does not exist) is read and before the output folder is made."""
    path = tmp_path / "wrong_returns.py"
    path.write_text(WRONG_RETURNS_FILE)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    argv = [*BASE, "--advantage_estimator", f"{path}:wrong_sig", "--output_dir", str(tmp_path / "out")]
    run = subprocess.run([sys.executable, os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), *argv], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "returned an AdvantageInputs" in run.stderr and "it must return rl_algorithms.Advantages(" in run.stderr
    assert not (tmp_path / "out").exists()
