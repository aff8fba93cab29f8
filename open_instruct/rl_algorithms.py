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
--policy_loss my_loss` (tests/test_rlvr_variants.py does exactly this). Or, without a script of your own, name the
function by file: `--advantage_estimator path/to/my_file.py:my_baseline` (or `my_package.module:my_baseline`); the
file is imported before the config is checked, its decorator's traits are the row's (a plain function gets the
default traits). The same holds for `--policy_loss` and `--kl_estimator` ((logp, ref_logp) -> per-token KL).
`algo_kwargs: {name: value}` passes keyword arguments to the variants whose functions take them.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from open_instruct.errors import ConfigError


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


@dataclass
class KLEstimator:
    """A row of KL_ESTIMATORS; the built-ins' formulas are rlvr_ppo.kl_penalty's."""

    function: Optional[Callable[..., Any]] = None  # (logp, ref_logp, **algo_kwargs) -> per-token KL estimate


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": KLEstimator(), "k2": KLEstimator(), "k3": KLEstimator()}
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


def kl_estimator(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `function(logp, ref_logp)` is the per-token KL estimate of kl_estimator `name`."""

    def bind(function: Callable[..., Any]) -> Callable[..., Any]:
        KL_ESTIMATORS[name] = KLEstimator(function=function)
        return function

    return bind


# option -> (its table, the decorator that adds a row, the function's call)
TABLES: dict[str, tuple[dict[str, Any], str, str]] = {
    "advantage_estimator": (ADVANTAGE_ESTIMATORS, "advantage_estimator", "(cfg, rollout, accelerator) -> Advantages"),
    "policy_loss": (POLICY_LOSSES, "policy_loss", "(cfg, logp, old_logp, advantages, mask) -> (loss, clipped)"),
    "kl_estimator": (KL_ESTIMATORS, "kl_estimator", "(logp, ref_logp) -> per-token KL"),
}
_ROW_TYPES = {"advantage_estimator": AdvantageEstimator, "policy_loss": PolicyLoss, "kl_estimator": KLEstimator}


class NotYetRegistered(Exception):
    """A variant name not in its table while a script's own registrations have not run yet (deferring_unknown_names);
    not a ConfigError: runtime.start_before_imports defers the config check to the script's main."""


_deferring = False


@contextlib.contextmanager
def deferring_unknown_names() -> Iterator[None]:
    """While active, an unknown variant name raises NotYetRegistered instead of a ConfigError: a copy of
    rlvr_ppo.py checks its config before the `@advantage_estimator(...)` lines below it have run."""
    global _deferring
    _deferring = True
    try:
        yield
    finally:
        _deferring = False


def how_to_add(option: str) -> str:
    """The unknown-name message's way forward for `option`."""
    _, decorator, call = TABLES[option]
    return (
        f"to add one, name a function in your file: --{option} path/to/my_file.py:my_fn (or my_package.module:my_fn), "
        f"a function {call}, optionally decorated with @rl_algorithms.{decorator}(name, **traits) for its traits; "
        "see docs/extending.md"
    )


def resolve(option: str, name: Any) -> Any:
    """The row `name` names in `option`'s table: a registered name, or a `file.py:function` / `module:function` spec
    (its module imported now and the row registered under the spec). ConfigError saying how to add one otherwise."""
    import difflib

    from open_instruct import user_code

    table, _, _ = TABLES[option]
    if isinstance(name, str) and name in table:
        return table[name]
    if user_code.is_spec(name):
        function = user_code.load_object(name, option, f"my_variants.py:my_{option}")
        if not callable(function):
            raise ConfigError(f"{option} {name!r} is a {type(function).__name__}, not a function")
        if inspect.iscoroutinefunction(function):
            raise ConfigError(f"{option} {name!r} is async; give a plain function")
        row = next((r for r in table.values() if r.function is function), None)  # registered by its decorator
        table[name] = row if row is not None else _ROW_TYPES[option](function=function)
        return table[name]
    if _deferring:
        raise NotYetRegistered(f"{option} {name!r}")
    names = [n for n in table if ":" not in n]  # registered names (a file spec registers its own row too)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{option} {name!r} is not one of {names}{hint}; {how_to_add(option)}")


def accepted_kwargs(function: Optional[Callable[..., Any]], fixed: int) -> Optional[set[str]]:
    """The keyword arguments `function` takes beyond its `fixed` leading positional ones (None: any, **kwargs)."""
    if function is None:
        return set()
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[fixed:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


# option -> the positional arguments the run calls its function with, in order, and what the function returns
CALLS: dict[str, tuple[tuple[str, ...], str]] = {
    "advantage_estimator": (("cfg", "rollout", "accelerator"), "rlvr_ppo.Advantages"),
    "policy_loss": (("cfg", "logp", "old_logp", "advantages", "mask"), "(per-token loss, clipped indicator)"),
    "kl_estimator": (("logp", "ref_logp"), "per-token KL estimate"),
}
FIXED_ARGS = {option: len(positional) for option, (positional, _) in CALLS.items()}


def variant_kwargs(option: str, row: Any, algo_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of algo_kwargs the function of `row` (a row of `option`'s table) takes."""
    takes = accepted_kwargs(row.function, FIXED_ARGS[option])
    return dict(algo_kwargs) if takes is None else {k: v for k, v in algo_kwargs.items() if k in takes}
