"""Batch math: worked cases (numbers computed by hand here) and property-based consistency checks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from open_instruct.batch_math import Counters, rl_batch_plan, should_log, supervised_batch_plan
from open_instruct.errors import ConfigError


def test_tulu3_8b_rlvr_layout():
    # 7 training processes x local_mini_batch_size 32 (1 x 32) = 224 completions per optimizer step.
    plan = rl_batch_plan(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=32,
        world_size=7,
        local_rollout_batch_size=32,
        num_samples_per_prompt=1,
        num_epochs=4,
        total_episodes=10_000_000,
    )
    assert plan.local_mini_batch_size == 32
    assert plan.mini_batch_size == 224
    assert plan.rollout_batch_size == 224
    assert plan.episodes_per_rollout == 224
    assert plan.num_mini_batches == 1
    assert plan.num_training_steps == 44_642  # 10,000,000 // 224 = 44,642 (remainder 32)
    assert plan.optimizer_steps == 178_568  # 44,642 x 4 epochs x 1 mini-batch
    assert plan.log_rows(1) == 44_642


def test_dpo_60k_pairs_8_processes():
    plan = supervised_batch_plan(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=32,
        world_size=8,
        num_examples=60_000,
        num_train_epochs=1,
    )
    assert plan.local_mini_batch_size == 32
    assert plan.mini_batch_size == 256
    assert plan.total_episodes == 60_000
    assert plan.optimizer_steps == 234  # 60,000 // 256 = 234 (234 x 256 = 59,904)
    assert plan.log_rows(1) == 234
    assert plan.log_rows(10) == 23


def test_grpo_group_must_not_split_across_mini_batch():
    # 4 prompts x 6 samples = 24 completions per device; local mini-batch 4 would split groups of 6.
    with pytest.raises(
        ConfigError, match=r"local_mini_batch_size .* is not divisible by group size num_samples_per_prompt 6"
    ):
        rl_batch_plan(
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            world_size=2,
            local_rollout_batch_size=4,
            num_samples_per_prompt=6,
            num_epochs=1,
            total_episodes=1000,
            group_size=6,
        )
    ok = rl_batch_plan(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        world_size=2,
        local_rollout_batch_size=4,
        num_samples_per_prompt=6,
        num_epochs=1,
        total_episodes=1000,
        group_size=6,
    )
    assert ok.num_mini_batches == 4  # 48 episodes per rollout / (6 x 2)


def test_indivisible_rollout_names_the_arithmetic():
    # 3 processes x 24 prompts x 1 sample = 72 episodes; mini-batch 1 x 32 x 3 = 96 does not divide 72.
    with pytest.raises(ConfigError) as err:
        rl_batch_plan(
            per_device_train_batch_size=1,
            gradient_accumulation_steps=32,
            world_size=3,
            local_rollout_batch_size=24,
            num_samples_per_prompt=1,
            num_epochs=1,
            total_episodes=10_000,
        )
    msg = str(err.value)
    assert "episodes_per_rollout 72" in msg and "mini_batch_size 96" in msg
    assert "local_mini_batch_size 32 x world_size 3" in msg


def test_zero_steps_is_an_error():
    with pytest.raises(ConfigError, match="0 optimizer steps"):
        supervised_batch_plan(
            per_device_train_batch_size=8,
            gradient_accumulation_steps=4,
            world_size=8,
            num_examples=100,
            num_train_epochs=1,
        )


def test_logging_gate_counts_only_optimizer_steps():
    logged = [s for s in range(1, 101) if should_log(s, 10)]
    assert logged == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert not should_log(0, 1)


def test_counters_round_trip():
    c = Counters(episode=448, optimizer_step=8, rollout_step=2, epoch=0.5)
    d = Counters()
    d.load_state_dict(c.state_dict())
    assert d.as_log() == {"episode": 448, "optimizer_step": 8, "rollout_step": 2, "epoch": 0.5}


pos = st.integers(min_value=1, max_value=64)


@settings(max_examples=300, deadline=None)
@given(pos, pos, pos, st.integers(1, 100_000), st.integers(1, 4))
def test_supervised_properties(micro, accum, world, examples, epochs):
    try:
        plan = supervised_batch_plan(
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accum,
            world_size=world,
            num_examples=examples,
            num_train_epochs=epochs,
        )
    except ConfigError as e:
        assert examples * epochs < micro * accum * world and "0 optimizer steps" in str(e)
        return
    assert plan.mini_batch_size == plan.local_mini_batch_size * plan.world_size == micro * accum * world
    assert (
        plan.optimizer_steps * plan.mini_batch_size
        <= plan.total_episodes
        < (plan.optimizer_steps + 1) * plan.mini_batch_size
    )
    assert plan.total_episodes == examples * epochs


@settings(max_examples=300, deadline=None)
@given(pos, pos, st.integers(1, 8), pos, st.integers(1, 8), st.integers(1, 4), st.integers(1, 10**7), st.booleans())
def test_rl_properties(micro, accum, world, local_rollout, samples, epochs, total, grpo):
    kwargs = dict(
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        world_size=world,
        local_rollout_batch_size=local_rollout,
        num_samples_per_prompt=samples,
        num_epochs=epochs,
        total_episodes=total,
        group_size=samples if grpo else None,
    )
    episodes = local_rollout * world * samples
    mini = micro * accum * world
    try:
        plan = rl_batch_plan(**kwargs)
    except ConfigError as e:
        # Every rejection corresponds to a real inconsistency, never to rounding.
        assert (episodes % mini != 0) or (grpo and (micro * accum) % samples != 0) or total < episodes, str(e)
        return
    assert episodes % mini == 0 and plan.num_mini_batches * plan.mini_batch_size == plan.episodes_per_rollout
    assert plan.episodes_per_rollout == plan.rollout_batch_size * plan.num_samples_per_prompt
    assert plan.optimizer_steps == plan.num_training_steps * epochs * plan.num_mini_batches
    assert plan.num_training_steps == total // episodes
    if grpo:
        assert plan.local_mini_batch_size % samples == 0


@pytest.mark.parametrize("name", ["per_device_train_batch_size", "gradient_accumulation_steps", "world_size"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_non_positive_or_non_integer_rejected(name, bad):
    kwargs = dict(
        per_device_train_batch_size=1, gradient_accumulation_steps=1, world_size=1, num_examples=10, num_train_epochs=1
    )
    kwargs[name] = bad
    with pytest.raises(ConfigError, match=name):
        supervised_batch_plan(**kwargs)
