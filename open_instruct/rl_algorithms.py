"""The RL algorithm tables: advantage estimators and policy losses by name, each with the traits the rest of the run
reads and the function `rlvr_ppo.py` dispatches to.

    ADVANTAGE_ESTIMATORS["grpo"]   -> AdvantageEstimator(uses_groups=True, function=<rlvr_ppo.grpo>)
    POLICY_LOSSES["cispo"]         -> PolicyLoss(takes_dual_clip=False, function=<rlvr_ppo.cispo>)

Torch-free on purpose: the config (accepted names, the checks that depend on the traits) and the planner (a value
model to budget for) read the traits before torch or the RL script loads. `rlvr_ppo.py` binds each built-in row to
its function (`@advantage_estimator("grpo")` above the function); the config's `algo` preset picks a default row.

A new variant, in one file and with no library edit: a function and its row,

    @advantage_estimator("my_baseline", uses_groups=True)        # (cfg, rollout, accelerator) -> Advantages
    def my_baseline(cfg, rollout, accelerator): ...

    @policy_loss("my_loss")                                        # (cfg, logp, old_logp, advantages, mask)
    def my_loss(cfg, logp, old_logp, advantages, mask): ...        #   -> (per-token loss, clipped indicator)

then run `rlvr_ppo.main` from that file (`runtime.run(rlvr_ppo.main)`), with `--advantage_estimator my_baseline
--policy_loss my_loss` (tests/test_rlvr_variants.py does exactly this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class AdvantageEstimator:
    """A row of ADVANTAGE_ESTIMATORS."""

    uses_value_model: bool = False  # a learned value model (PPO's critic) is loaded, trained and fed to it
    uses_groups: bool = False  # a baseline from the prompt's group: a group never spans two ranks or mini-batches
    kl_in_reward: bool = False  # -beta * KL_t goes into the per-token reward; otherwise beta * KL is a loss term
    uses_teacher: bool = False  # a frozen teacher (teacher_model_name_or_path) scores the sampled tokens
    function: Optional[Callable[..., Any]] = None  # (cfg, rollout, accelerator) -> rlvr_ppo.Advantages


@dataclass
class PolicyLoss:
    """A row of POLICY_LOSSES."""

    takes_dual_clip: bool = True  # dual_clip_c bounds its loss for negative advantages
    function: Optional[Callable[..., Any]] = None  # (cfg, logp, old_logp, advantages, mask) -> (loss, clipped)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(uses_value_model=True, kl_in_reward=True),  # PPO, Tulu 3
    "grpo": AdvantageEstimator(uses_groups=True),
    "dr_grpo": AdvantageEstimator(uses_groups=True),
    "rloo": AdvantageEstimator(uses_groups=True),
    "reinforce_pp": AdvantageEstimator(kl_in_reward=True),
    "distill": AdvantageEstimator(uses_teacher=True),  # on-policy distillation (distillation.py)
}
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(),
    "gspo": PolicyLoss(),
    "cispo": PolicyLoss(takes_dual_clip=False),  # its importance weight is already capped
}
# `algo` is a preset: the advantage estimator it stands for when advantage_estimator is unset.
ALGO_ESTIMATORS = {"ppo": "gae", "grpo": "grpo"}


def advantage_estimator(name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `function` computes the advantages of estimator `name`. With traits (a new variant) it adds the
    row; without, it binds the function to the row already in the table (the built-ins)."""

    def bind(function: Callable[..., Any]) -> Callable[..., Any]:
        if traits or name not in ADVANTAGE_ESTIMATORS:
            ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(**traits)
        ADVANTAGE_ESTIMATORS[name].function = function
        return function

    return bind


def policy_loss(name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `function` is the per-token loss of policy loss `name` (adds the row when new, as above)."""

    def bind(function: Callable[..., Any]) -> Callable[..., Any]:
        if traits or name not in POLICY_LOSSES:
            POLICY_LOSSES[name] = PolicyLoss(**traits)
        POLICY_LOSSES[name].function = function
        return function

    return bind
