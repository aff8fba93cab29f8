"""The RL algorithms by name, verl's `core_algos` in one file: the tables the run reads, the math (pure functions
with their formulas) and the built-in advantage estimators, policy losses and KL estimators, each one function with
its registration above it:

    @advantage_estimator("grpo", uses_groups=True)        # the row of ADVANTAGE_ESTIMATORS: name, traits, function
    def grpo(x: AdvantageInputs) -> Advantages: ...

    ADVANTAGE_ESTIMATORS["grpo"]   -> AdvantageEstimator(uses_groups=True, function=grpo)
    POLICY_LOSSES["cispo"]         -> PolicyLoss(takes_dual_clip=False, function=cispo)

A function receives a small typed input, not the run's config: `AdvantageInputs` (the rollout's tensors and the few
settings estimators read) or `LossInputs` (one micro-batch's log-probs, advantages, mask, entropy, the reference's
log-probs and the clip settings), plus the entries of `algo_kwargs` it names as keyword parameters; a KL estimator
gets (logp, ref_logp). The training script (`rlvr_ppo.py`) builds the inputs and calls the row's function;
docs/extending.md is the user's side.

Torch is imported inside the functions that use it, not at the top: the config (accepted names, the checks that
depend on the traits) and the planner read these tables before torch loads, and a bad config exits in a fraction
of a second. The config's `algo` preset picks a default row (ALGO_ESTIMATORS).

A new variant, in one file and with no library edit: a function and its row,

    @advantage_estimator("my_baseline", uses_groups=True)        # (x: AdvantageInputs, **algo_kwargs) -> Advantages
    def my_baseline(x): ...

    @policy_loss("my_loss")                                        # (x: LossInputs, **algo_kwargs)
    def my_loss(x): ...                                            #   -> (per-token loss, clipped indicator)

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
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from open_instruct.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass
class AdvantageEstimator:
    """A row of ADVANTAGE_ESTIMATORS."""

    uses_value_model: bool = False  # a learned value model (PPO's critic) is loaded, trained and fed to it
    uses_groups: bool = False  # a baseline from the prompt's group: a group never spans two ranks or mini-batches
    kl_in_reward: bool = False  # -beta * KL_t goes into the per-token reward; otherwise beta * KL is a loss term
    uses_teacher: bool = False  # a frozen teacher (teacher_model_name_or_path) scores the sampled tokens
    settings: tuple[str, ...] = ()  # run settings (config keys) it receives as keyword arguments besides algo_kwargs
    function: Optional[Callable[..., Any]] = None  # (x: AdvantageInputs, **kwargs) -> Advantages


@dataclass
class PolicyLoss:
    """A row of POLICY_LOSSES."""

    takes_dual_clip: bool = True  # dual_clip_c bounds its loss for negative advantages
    function: Optional[Callable[..., Any]] = None  # (x: LossInputs, **algo_kwargs) -> (loss, clipped)


@dataclass
class KLEstimator:
    """A row of KL_ESTIMATORS."""

    function: Optional[Callable[..., Any]] = None  # (logp, ref_logp, **algo_kwargs) -> per-token KL estimate


# Filled by the decorators below (the built-ins) and by a user's file or a copied script (new rows).
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}
KL_ESTIMATORS: dict[str, KLEstimator] = {}
# `algo` is a preset: the advantage estimator it stands for when advantage_estimator is unset.
ALGO_ESTIMATORS = {"ppo": "gae", "grpo": "grpo"}


def advantage_estimator(name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `function(x: AdvantageInputs, **kwargs) -> Advantages` is estimator `name`, with these traits
    (without traits, a name already registered keeps its row's: a copied script re-binding a built-in)."""

    def bind(function: Callable[..., Any]) -> Callable[..., Any]:
        row = ADVANTAGE_ESTIMATORS.get(name) if not traits else None
        ADVANTAGE_ESTIMATORS[name] = replace(row or AdvantageEstimator(**traits), function=function)
        return function

    return bind


def policy_loss(name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `function(x: LossInputs, **kwargs) -> (loss, clipped)` is policy loss `name`, with these traits
    (or, without, the row's already registered under `name`)."""

    def bind(function: Callable[..., Any]) -> Callable[..., Any]:
        row = POLICY_LOSSES.get(name) if not traits else None
        POLICY_LOSSES[name] = replace(row or PolicyLoss(**traits), function=function)
        return function

    return bind


def kl_estimator(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `function(logp, ref_logp, **kwargs)` is the per-token KL estimate of kl_estimator `name`."""

    def bind(function: Callable[..., Any]) -> Callable[..., Any]:
        KL_ESTIMATORS[name] = KLEstimator(function=function)
        return function

    return bind


# option -> (its table, the decorator that adds a row, the function's call)
TABLES: dict[str, tuple[dict[str, Any], str, str]] = {
    "advantage_estimator": (
        ADVANTAGE_ESTIMATORS,
        "advantage_estimator",
        "(x: AdvantageInputs, **kwargs) -> Advantages",
    ),
    "policy_loss": (POLICY_LOSSES, "policy_loss", "(x: LossInputs, **kwargs) -> (loss, clipped)"),
    "kl_estimator": (KL_ESTIMATORS, "kl_estimator", "(logp, ref_logp, **kwargs) -> per-token KL"),
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
    table, _, _ = TABLES[option]
    if isinstance(name, str) and name in table:
        return table[name]
    import difflib

    from open_instruct import user_code

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
    "advantage_estimator": (("x",), "Advantages, x an rl_algorithms.AdvantageInputs (docs/extending.md)"),
    "policy_loss": (("x",), "(per-token loss, clipped indicator), x an rl_algorithms.LossInputs (docs/extending.md)"),
    "kl_estimator": (("logp", "ref_logp"), "per-token KL estimate"),
}
FIXED_ARGS = {option: len(positional) for option, (positional, _) in CALLS.items()}


def variant_kwargs(option: str, row: Any, algo_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of algo_kwargs the function of `row` (a row of `option`'s table) takes."""
    takes = accepted_kwargs(row.function, FIXED_ARGS[option])
    settings = set(getattr(row, "settings", ()))  # passed from the run's settings, never from algo_kwargs
    return {k: v for k, v in algo_kwargs.items() if (takes is None or k in takes) and k not in settings}


def chosen_kwargs(cfg: Any, option: str) -> dict[str, Any]:
    """The algo_kwargs the function the run chose for `option` (advantage_estimator, policy_loss, kl_estimator)
    takes (`cfg`: the run's config)."""
    row = TABLES[option][0][getattr(cfg, option)]
    return variant_kwargs(option, row, cfg.algo_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# What a variant's function receives (the contract a user's function may rely on; docs/extending.md)


@dataclass
class AdvantageInputs:
    """This rank's rollout as an advantage estimator reads it. Per-token tensors are response-aligned [n, R] float32
    (column t = response token t), 0 on padding; completions of one prompt are `group_size` contiguous rows."""

    scores: torch.Tensor  # [n] sequence scores: verifiers (+ reward model) (+ penalties, custom reward functions)
    mask: torch.Tensor  # [n, R] the loss mask: 1 on the policy's tokens (multi-turn: observations are 0)
    group_size: int  # num_samples_per_prompt
    beta: float  # the KL-to-reference coefficient
    gamma: float
    lam: float
    whiten_advantages: bool
    filter_zero_std_groups: bool  # drop groups whose completions all scored the same (Advantages.keep)
    old_logp: Optional[torch.Tensor] = None  # the sampling policy's log-probs (None on-policy: not computed)
    ref_logp: Optional[torch.Tensor] = None  # the frozen reference's (None without one: beta 0)
    kl: Optional[torch.Tensor] = None  # kl_estimator(old_logp, ref_logp) per token (None without both)
    values: Optional[torch.Tensor] = None  # the value model's (uses_value_model)
    value_mask: Optional[torch.Tensor] = None  # where values are kept: mask, plus the score position under
    # score_placement after_last_token (score_index: that position per row; None: the last policy token)
    score_index: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None  # [n, R] multi-turn: each turn's reward on its last policy token
    teacher_logp: Optional[torch.Tensor] = None  # [n, R] a teacher's log-probs of the sampled tokens (uses_teacher)
    # sums a dict of floats over every process (identity on one): statistics every rank must agree on
    sum_over_ranks: Callable[[dict[str, float]], dict[str, float]] = field(default=lambda sums: dict(sums))


@dataclass
class Advantages:
    """An estimator's output: what the update trains on."""

    advantages: torch.Tensor  # [n, R]
    returns: Optional[torch.Tensor]  # [n, R] value targets (uses_value_model), else None
    kl_loss_coef: float  # beta when the KL to the reference is a loss term, 0 when it is in the reward
    keep: torch.Tensor  # [n] bool: rows the update trains on (filter_zero_std_groups drops flat groups)


@dataclass
class LossInputs:
    """One micro-batch as a policy loss reads it: [b, R] tensors of the rows being trained. Everything a loss term
    over the rollout needs is here, so an entropy bonus or a length penalty is a policy loss of your own that adds
    its term to a built-in's (docs/extending.md):

        def entropy_bonus(x, coef=0.01):
            loss, clipped = ppo(x)
            return loss - coef * x.entropy, clipped"""

    logp: torch.Tensor  # the policy's log-probs of the sampled tokens, with gradient
    old_logp: torch.Tensor  # the sampling policy's (no gradient; on-policy: logp detached)
    advantages: torch.Tensor
    mask: torch.Tensor  # the loss mask: 1 on the policy's tokens (padding, observations 0); mask.sum(1): lengths
    clip_low: float  # cliprange_low
    clip_high: float  # cliprange_high
    dual_clip_c: Optional[float] = None
    # the policy's per-token entropy at the sampling temperature, with gradient (under distill_loss jsd: without)
    entropy: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None  # the frozen reference's log-probs (None without one: beta 0)


# ---------------------------------------------------------------------------------------------------------------------
# The start's probe of a user's function: one call on a tiny synthetic batch, before any model loads


# option -> what its function must return, as the refusal names it
RETURNS = {
    "advantage_estimator": "rl_algorithms.Advantages(advantages [n, R], returns, kl_loss_coef, keep [n])",
    "policy_loss": "a pair (per-token loss [b, R], clipped indicator [b, R]) of tensors",
    "kl_estimator": "a per-token KL estimate: a tensor [n, R]",
}


def probe_inputs(option: str, cfg: Any) -> tuple[Any, ...]:
    """The positional arguments of one call of `option`'s function on a synthetic batch: 2 groups of the run's
    num_samples_per_prompt rows x 3 response tokens (the last one padding on odd rows), distinct scores, and every
    optional field a run may fill (old/reference log-probs, values, turn rewards, a teacher's log-probs)."""
    import torch

    group_size = max(int(getattr(cfg, "num_samples_per_prompt", 1) or 1), 1)
    n, length = 2 * group_size, 3
    mask = torch.ones(n, length)
    mask[1::2, -1] = 0.0
    logp = torch.full((n, length), -1.0) * mask
    ref_logp = torch.full((n, length), -1.25) * mask
    if option == "kl_estimator":
        return logp, ref_logp
    if option == "policy_loss":
        advantages = torch.linspace(-1.0, 1.0, n).unsqueeze(1) * mask
        loss_inputs = LossInputs(
            logp=logp.clone().requires_grad_(True),
            old_logp=logp,
            advantages=advantages,
            mask=mask,
            clip_low=cfg.cliprange_low,
            clip_high=cfg.cliprange_high,
            dual_clip_c=cfg.dual_clip_c,
            entropy=torch.full((n, length), 0.5) * mask,
            ref_logp=ref_logp,
        )
        return (loss_inputs,)
    x = AdvantageInputs(
        scores=torch.arange(n, dtype=torch.float32),
        mask=mask,
        group_size=group_size,
        beta=cfg.beta,
        gamma=cfg.gamma,
        lam=cfg.lam,
        whiten_advantages=cfg.whiten_advantages,
        filter_zero_std_groups=cfg.filter_zero_std_groups,
        old_logp=logp,
        ref_logp=ref_logp,
        kl=(logp - ref_logp) * mask,
        values=torch.zeros(n, length),
        value_mask=mask,
        turn_rewards=torch.zeros(n, length),
        teacher_logp=torch.full((n, length), -0.75) * mask,
    )
    return (x,)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'AEIOUaeiou' else 'a'} {noun}"


def _wrong_return(option: str, result: Any, n: int, length: int) -> Optional[str]:
    """What is wrong with a probe's result (None: the shape the run uses)."""
    import torch

    def fits(t: Any) -> bool:  # a tensor that broadcasts to [n, length] (a per-sequence [n, 1] term does)
        try:
            return isinstance(t, torch.Tensor) and torch.broadcast_shapes(t.shape, (n, length)) == (n, length)
        except RuntimeError:
            return False

    if option == "advantage_estimator":
        if not isinstance(result, Advantages):
            return _a(type(result).__name__)
        if not fits(result.advantages):
            return f"Advantages whose advantages are {getattr(result.advantages, 'shape', result.advantages)!r}"
        return None
    if option == "policy_loss":
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            single = isinstance(result, torch.Tensor)
            return "one tensor" if single else _a(type(result).__name__)
        if not all(fits(t) for t in result):
            return f"a pair of {[type(t).__name__ + str(tuple(getattr(t, 'shape', ()))) for t in result]}"
        return None
    return None if fits(result) else _a(type(result).__name__)


def probe(option: str, row: Any, cfg: Any, kwargs: dict[str, Any], what: str) -> None:
    """ConfigError (exit 2) unless `row`'s function, called once on a tiny synthetic batch (probe_inputs) with the
    run's settings its row names and its algo_kwargs, returns what the run uses (RETURNS): a wrong return would
    otherwise surface at the first rollout, after the model loaded, as a raw traceback."""
    args = probe_inputs(option, cfg)
    settings = {name: getattr(cfg, name) for name in getattr(row, "settings", ())}
    n, length = args[0].shape if option == "kl_estimator" else args[0].mask.shape
    where = f"called once on a synthetic batch ({n} rows x {length} tokens) before any model loads"
    try:
        result = row.function(*args, **settings, **kwargs)
    except Exception as e:
        raise ConfigError(
            f"{what} raised {type(e).__name__}: {e} when {where}; it must return {RETURNS[option]}"
        ) from None
    wrong = _wrong_return(option, result, n, length)
    if wrong is not None:
        raise ConfigError(f"{what} returned {wrong} when {where}; it must return {RETURNS[option]} (docs/extending.md)")


# ---------------------------------------------------------------------------------------------------------------------
# ALGO LOGIC, the math: pure functions of [batch, response_len] tensors (response-aligned, `mask` 1 on real tokens).


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all elements when None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all elements when None)."""
    return (
        masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)
        if dim is not None
        else masked_sum(x, mask) / mask.sum().clamp(min=1)
    )


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked elements: sum(mask * (x - mean)^2) / (n - 1), n = sum(mask)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    return masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    mean: Optional[torch.Tensor] = None,
    var: Optional[torch.Tensor] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked elements, 0 elsewhere.

    mean/var default to the masked mean and unbiased variance of x, taken in float64 (float32 sums of equal values
    miss their mean by a rounding step, which rsqrt(var + eps) would blow up to ~1e-3 instead of 0); the training
    loop passes statistics summed over all processes so every rank whitens with the same numbers."""
    import torch

    if mean is None:
        mean = masked_mean(x.double(), mask.double())
    if var is None:
        var = masked_var(x.double(), mask.double())
    return ((x.double() - mean) * torch.rsqrt(var + eps) * mask).to(x.dtype)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, **algo_kwargs: Any) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from a token sampled from pi: the function of `estimator`'s row of
    KL_ESTIMATORS (k1, k2, k3 below; another: a function of the user's, called with its algo_kwargs)."""
    row = KL_ESTIMATORS.get(estimator)
    if row is None or row.function is None:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return row.function(logp, ref_logp, **algo_kwargs)


def last_response_token(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last masked token of each row (0 for an empty row): the last real token of a right-padded
    response, the last policy token of an episode whose loss mask has observation holes.

    index_b = max { t : mask[b, t] > 0 }"""
    import torch

    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).max(1).values


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float, score_index: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """PPO rewards: reward_t = -beta * KL_t on every response token, and the sequence score added at one position,
    by default the last real token:

    reward[b, t] = -beta * kl[b, t] * mask[b, t]  +  scores[b] * [t == score_index(b)]
    """
    import torch

    rewards = -beta * kl * mask
    rows = torch.arange(len(scores), device=scores.device)
    index = last_response_token(mask) if score_index is None else score_index
    rewards[rows, index] += scores.to(rewards.dtype)
    return rewards


def after_last_token(mask: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tulu 3's score placement: one position after the last real token (the last one itself when the response ran
    to max_length), with a value kept there so GAE carries the score back. Returns (score index, value mask =
    mask plus that position). `mask` needs a spare column after the longest response.

    L_b = sum_t mask[b, t];   index_b = L_b if L_b < max_length else L_b - 1
    """
    import torch

    lengths = mask.sum(1).long()
    index = torch.where(lengths < max_length, lengths, lengths - 1).clamp(min=0)
    value_mask = mask.clone()
    value_mask[torch.arange(len(mask)), index] = 1.0
    return index, value_mask


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, backwards in t:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        return_t = A_t + V_t

    with V_{t+1} = A_{t+1} = 0 after the last real token (the episode ends there; padding never leaks in).
    Returns (advantages, returns), both 0 on padding."""
    import torch

    rewards, values, mask = rewards.float(), values.float(), mask.float()
    width = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(width)):
        alive_next = mask[:, t + 1] if t + 1 < width else torch.zeros_like(carry)
        next_value = values[:, t + 1] * alive_next if t + 1 < width else torch.zeros_like(carry)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        carry = delta + gamma * lam * carry * alive_next
        advantages[:, t] = carry
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO (scale=True) and Dr. GRPO (scale=False): each completion's score against its prompt's group of
    `group_size` contiguous completions:

        grpo:     A_i = (r_i - mean(group)) / (std(group) + eps)     (std with Bessel's correction, n - 1)
        dr_grpo:  A_i =  r_i - mean(group)                           (no std: no bias towards easy/hard prompts)

    A group whose completions all score the same gets exactly 0 (no signal), whatever the value: float32 means of
    equal scores can miss them by a rounding step, which / (std + eps) would turn into a push of up to ~0.06, so the
    math runs in float64 and a group of equal scores (zero_std_groups, an exact test) is set to 0 outright."""
    import torch

    if scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    groups = scores.double().view(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    advantages = centred / (groups.std(1, keepdim=True) + eps) if scale else centred
    return torch.where(zero_std_groups(scores, group_size).view_as(groups), 0.0, advantages).float().view(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each completion's score against the mean of the *other* completions of its group (leave one out):

    A_i = r_i - (sum_j r_j - r_i) / (k - 1)  =  k / (k - 1) * (r_i - mean(group)),   k = group_size >= 2

    In float64, and exactly 0 for a group of equal scores (as group_advantages)."""
    import torch

    if group_size < 2 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size} >= 2")
    groups = scores.double().view(-1, group_size)
    others_mean = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    flat = zero_std_groups(scores, group_size).view_as(groups)
    return torch.where(flat, 0.0, groups - others_mean).float().view(-1)


def multi_turn_gae(
    rewards: torch.Tensor, values: torch.Tensor, policy_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the policy tokens of response-aligned [batch, T] tensors, skipping observation tokens and padding
    (policy_mask 0). With p_1 < p_2 < ... < p_n the policy positions of a row, backwards over k:

        delta_k  = r[p_k] + gamma * V[p_{k+1}] - V[p_k]          (V[p_{n+1}] = 0: the episode ends)
        A[p_k]   = delta_k + gamma * lam * A[p_{k+1}]            (A[p_{n+1}] = 0)
        R[p_k]   = A[p_k] + V[p_k]                               (the value target)

    and A = R = 0 on every position with policy_mask 0. A reward on such a position would be silently lost, so it
    raises ValueError instead (put turn rewards on policy tokens: `episodes.token_rewards`)."""
    import torch

    rewards, values, mask = rewards.float(), values.float(), policy_mask.float()
    if bool(((rewards != 0) & (mask == 0)).any()):
        raise ValueError("a reward sits on a non-policy token (observation or padding): it would be lost")
    advantages = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        policy = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * carry
        advantages[:, t] = torch.where(policy, step, torch.zeros_like(step))
        carry = torch.where(policy, step, carry)  # observation tokens pass the recursion through unchanged
        next_value = torch.where(policy, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns over the masked tokens, backwards in t (no value model, no bootstrap). With
    p_1 < ... < p_n the masked positions of a row (an episode's policy tokens: observation tokens are skipped, as
    in episodes.multi_turn_gae):

    G[p_k] = r[p_k] + gamma * G[p_{k+1}],   G[p_{n+1}] = 0;   G = 0 where mask is 0
    """
    import torch

    rewards, mask = rewards.float(), mask.float()
    returns = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        step = (rewards[:, t] + gamma * carry) * mask[:, t]
        carry = torch.where(mask[:, t] > 0, step, carry)  # an observation token passes the return through
        returns[:, t] = step
    return returns


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score of a response of L tokens (L_max = response_length,
    B = buffer_length):

    penalty = 0                                   if L <= L_max - B
            = factor * (L_max - B - L) / B        if L_max - B < L <= L_max      (0 down to -factor)
    """
    over = (lengths.float() - (max_length - buffer_length)).clamp(min=0)
    return -factor * over / buffer_length


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (to minimise), with asymmetric clipping (clip-higher: clip_high > clip_low
    keeps low-probability tokens able to grow) and optional dual clip, and where a clipped branch is the one taken:

    ratio = exp(logp - old_logp)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    dual clip (c > 1), tokens with A < 0:  loss = min(loss, -c * A)   (bounds the loss of a huge ratio)
    """
    import torch

    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss, was_clipped = torch.maximum(unclipped, clipped), (clipped > unclipped)
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        dual = (advantages < 0) & (loss > bound)
        loss, was_clipped = torch.where(dual, bound, loss), was_clipped | dual
    return loss, was_clipped.float()


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the importance ratio of a whole sequence (geometric mean of its token ratios), clipped per sequence,
    in its token form so it aggregates like the other losses:

    s_i    = exp( sum_t m_it (logp_it - old_it) / sum_t m_it )
    s_it   = sg[s_i] * exp(logp_it - sg[logp_it])          (value s_i; gradient s_i * grad logp_it)
    loss_it = max(-A_i * s_it, -A_i * clip(s_it, 1 - clip_low, 1 + clip_high))
    dual clip (c > 1), A_i < 0:  loss_it = min(loss_it, -c * A_i)   (as in ppo_policy_loss, on the sequence ratio)
    """
    import torch

    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=1).unsqueeze(1)
    log_ratio = seq_log_ratio.detach() + logp - logp.detach()
    return ppo_policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip_low, clip_high, dual_clip_c)


def cispo_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: REINFORCE with a clipped, detached importance weight, so every token keeps a gradient (PPO's clip
    zeroes the gradient of clipped tokens):

    loss = -sg[min(exp(logp - old_logp), 1 + clip_high)] * A * logp
    """
    import torch

    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, max=1.0 + clip_high).detach()
    return -weight * advantages * logp, (ratio > 1.0 + clip_high).float()


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: the sampling engine's log-probs differ from the trainer's (another kernel,
    bf16, another engine), so each token's loss is re-weighted towards the trainer's policy, capped:

    w_t = min(exp(old_logp_t - sampler_logp_t), cap)       (no gradient)
    """
    import torch

    return torch.clamp(torch.exp(old_logp - sampler_logp), max=cap).detach()


def off_policy_mask(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    sequence_lag: Optional[torch.Tensor],
    low: Optional[float],
    high: Optional[float],
    max_sequence_lag: Optional[int],
) -> torch.Tensor:
    """Which tokens keep their policy-gradient term (1) or lose it (0), for tokens too far off-policy to correct:

    IcePop (token):   keep_t = [low <= exp(old_logp_t - sampler_logp_t) <= high]      (a bound left None: no limit)
    staleness (seq):  keep_it = [lag_i <= max_sequence_lag]   (lag_i: versions since the oldest weights of row i)

    All ones when every knob is None. A masked token still counts in the aggregation's denominator (its term is 0)."""
    import torch

    keep = torch.ones_like(old_logp)
    ratio = torch.exp(old_logp - sampler_logp)
    if low is not None:
        keep = keep * (ratio >= low).to(keep.dtype)
    if high is not None:
        keep = keep * (ratio <= high).to(keep.dtype)
    if max_sequence_lag is not None and sequence_lag is not None:
        keep = keep * (sequence_lag <= max_sequence_lag).to(keep.dtype).unsqueeze(1)
    return keep.detach()


def teacher_advantages(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reverse-KL advantage of each sampled token (0 off the mask: padding, observation tokens):

    A_t = -(log pi_student(y_t) - log pi_teacher(y_t)) * mask_t"""
    return (teacher_logp - old_logp) * mask


def aggregation_weights(
    mask: torch.Tensor, aggregation: str, loss_norm_length: float, rows: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How per-token losses l_it of a mini-batch become one number: per-token weights w and per-row units u, so that

    loss = sum_it w_it * l_it / U,     U = sum of u_i over the *global* mini-batch (all ranks, all micro-batches)

    token_mean:               w_it = m_it,          u_i = sum_t m_it    ->  sum_it l_it / (number of tokens)
    seq_mean_token_mean:      w_it = m_it / L_i,    u_i = 1             ->  mean over sequences of their token mean
    seq_mean_token_sum_norm:  w_it = m_it / C,      u_i = 1             ->  mean over sequences of sum_t l_it / C
                                                                            (Dr. GRPO; C = loss_norm_length)
    A row with no tokens (u_i = 0 in every form) adds nothing, unless `rows` ([n] bool) says which rows a sequence mean
    counts: TRL counts a completion mask_truncated_completions left out (u_i = 1, no weight). The split into ranks
    and micro-batches does not change the result: each rank backpropagates sum(w * l) * world / U and DDP/FSDP
    average the gradients."""
    mask = mask.float()
    lengths = mask.sum(1, keepdim=True)
    if aggregation == "token_mean":
        return mask, lengths.squeeze(1)
    alive = (lengths > 0).float() if rows is None else rows.float().unsqueeze(1)
    if aggregation == "seq_mean_token_mean":
        return mask / lengths.clamp(min=1), alive.squeeze(1)
    if aggregation == "seq_mean_token_sum_norm":
        return mask / loss_norm_length, alive.squeeze(1)
    raise ValueError(f"unknown loss_aggregation {aggregation!r}")


def zero_std_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per completion, True when every completion of its group scored the same (no learning signal for any group
    estimator): DAPO's dynamic-sampling filter drops these groups from the update."""
    groups = scores.view(-1, group_size)
    same = (groups == groups[:, :1]).all(1, keepdim=True)
    return same.expand_as(groups).reshape(-1)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss per token and where the clipped branch is the one taken:

    V_clip = old_V + clip(V - old_V, -cliprange_value, cliprange_value)
    loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)
    """
    import torch

    v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped, clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(old || new) between the sampling policy and the current one: 0.5 * (logp - old)^2."""
    return 0.5 * (logp - old_logp) ** 2


# ---------------------------------------------------------------------------------------------------------------------
# How far the sampler's log-probs are from the trainer's, per sampled token (the mismatch/ metrics, beside the
# truncated importance sampling above that corrects for it; docs/trusted-generation.md), and the version lags of
# async sampling (train/version_lag_*)
def mismatch_sum_keys(async_steps: int) -> tuple[str, ...]:
    """The per-rollout sums behind the mismatch/ metrics (besides the loop's tokens and sampler_abs_diff): k3 and
    tokens beyond the TIS cap; under async also |dlogp| and tokens per version lag 0..async_steps."""
    per_lag = [f"mismatch_{what}_lag_{k}" for k in range(async_steps + 1) for what in ("abs", "tokens")]
    return ("mismatch_k3_sum", "mismatch_beyond_cap", *(per_lag if async_steps else ()))


def mismatch_token_sums(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float,
    lags: Optional[torch.Tensor] = None,
    async_steps: int = 0,
) -> dict[str, torch.Tensor]:
    """Per micro-batch sums behind the mismatch/ metrics, r = trainer logp - sampler logp on the loss-mask tokens
    (policy tokens only in multi-turn episodes): k3 = exp(r) - 1 - r (an unbiased per-token estimate of
    KL(sampler || trainer) on the sampled tokens), tokens whose TIS ratio exp(r) exceeds tis_cap, max |r|, and under
    async (`lags`: [rows, >= mask width] on the device, per row the version lag of each policy token in order, -1
    after the last) |r| and tokens per lag.

    0-dim tensors on log_ratio's device, computed with masks rather than boolean indexing: no host sync (the update
    reads them once per rollout)."""
    import torch

    on = mask > 0
    r = log_ratio.float().masked_fill(~on, 0.0)
    sums = {
        "mismatch_k3_sum": (torch.expm1(r) - r).sum(),  # 0 where masked: expm1(0) - 0
        "mismatch_beyond_cap": ((r > math.log(tis_cap)) & on).sum().float(),
        "mismatch_abs_max": r.abs().max() if r.numel() else r.new_zeros(()),
    }
    if async_steps and lags is not None:
        # the i-th policy token of a row (the cumsum of its mask) takes lags[row, i]
        nth = (on.long().cumsum(dim=1) - 1).clamp(min=0)
        lag = torch.where(on, lags.gather(1, nth), -1)
        for k in range(async_steps + 1):
            at = lag == k
            sums[f"mismatch_abs_lag_{k}"] = (r.abs() * at).sum()
            sums[f"mismatch_tokens_lag_{k}"] = at.sum().float()
    return sums


def mismatch_metrics(sums: dict[str, float], abs_max: float, async_steps: int = 0) -> dict[str, float]:
    """The mismatch/ row from rollout-wide sums (tokens, sampler_abs_diff, mismatch_sum_keys) and the max |dlogp|."""
    tokens = max(sums["tokens"], 1.0)
    row = {
        "mismatch/abs_mean": sums["sampler_abs_diff"] / tokens,
        "mismatch/abs_max": abs_max,
        "mismatch/k3_kl": sums["mismatch_k3_sum"] / tokens,
        "mismatch/beyond_tis_cap": sums["mismatch_beyond_cap"] / tokens,
    }
    for k in range(async_steps + 1) if async_steps else ():
        n = sums[f"mismatch_tokens_lag_{k}"]
        row[f"mismatch/abs_mean_lag_{k}"] = sums[f"mismatch_abs_lag_{k}"] / n if n else 0.0
    return row


def mismatch_warnings(row: dict[str, float], warn_kl: float, warn_beyond_cap: float) -> list[str]:
    """Warning lines for a rollout whose mismatch crosses the documented levels."""
    lines = []
    if row["mismatch/k3_kl"] > warn_kl:
        lines.append(f"mismatch/k3_kl {row['mismatch/k3_kl']:.3g} > mismatch_warn_kl {warn_kl:g}")
    if row["mismatch/beyond_tis_cap"] > warn_beyond_cap:
        lines.append(
            f"mismatch/beyond_tis_cap {row['mismatch/beyond_tis_cap']:.3g} > mismatch_warn_beyond_cap "
            f"{warn_beyond_cap:g}"
        )
    return lines


def version_lag_stats(token_lags: list[list[int]], bound: int) -> dict[str, float]:
    """Sums for the version-lag metrics of a rollout: tokens, sum of lags, and per lag k in 0..bound the tokens with
    that lag (lag_<k>); a lag beyond the bound (never trained on: rollouts.RolloutSampler) counts in lag_<bound+1>."""
    sums = {"lag_tokens": 0.0, "lag_sum": 0.0, **{f"lag_{k}": 0.0 for k in range(bound + 2)}}
    for lags in token_lags:
        for lag in lags:
            sums["lag_tokens"] += 1
            sums["lag_sum"] += lag
            sums[f"lag_{min(max(lag, 0), bound + 1)}"] += 1
    return sums


# ---------------------------------------------------------------------------------------------------------------------
# ALGO LOGIC: the built-in variants, each one function and its row. An estimator maps AdvantageInputs to the
# Advantages `update` trains on; a policy loss gives the per-token loss and where a clip was the branch taken (the
# training script weights and aggregates it); a KL estimator gives the per-token KL to the reference.


def group_baseline(x: AdvantageInputs, advantages: torch.Tensor) -> Advantages:
    """A group baseline's per-completion advantages on every token of the completion; the KL to the reference is a
    loss term (beta); flat groups dropped from the update under filter_zero_std_groups."""
    import torch

    keep = torch.ones(len(x.scores), dtype=torch.bool)
    if x.filter_zero_std_groups:
        keep = ~zero_std_groups(x.scores, x.group_size)
    kl_loss_coef = x.beta if x.ref_logp is not None else 0.0
    return Advantages(advantages.unsqueeze(1) * x.mask, None, kl_loss_coef, keep)


@advantage_estimator("grpo", uses_groups=True)
def grpo(x: AdvantageInputs) -> Advantages:
    """Group-normalised scores (group_advantages, scale=True)."""
    return group_baseline(x, group_advantages(x.scores, x.group_size, scale=True))


@advantage_estimator("dr_grpo", uses_groups=True)
def dr_grpo(x: AdvantageInputs) -> Advantages:
    """Group-centred scores (group_advantages, scale=False)."""
    return group_baseline(x, group_advantages(x.scores, x.group_size, scale=False))


@advantage_estimator("rloo", uses_groups=True)
def rloo(x: AdvantageInputs) -> Advantages:
    """Leave-one-out baseline (rloo_advantages)."""
    return group_baseline(x, rloo_advantages(x.scores, x.group_size))


def kl_rewards(x: AdvantageInputs) -> torch.Tensor:
    """Per-token rewards: the score at its position (last token, or after it), -beta * KL_t on every token.
    Multi-turn: each turn's reward on that turn's last policy token (turn_rewards) and the rest of the score
    (penalties, reward model, custom functions: score - sum of turn rewards) on the episode's last policy token;
    KL on policy tokens only (the mask)."""
    import torch

    kl = x.kl if x.kl is not None else torch.zeros_like(x.mask)
    if x.turn_rewards is None:
        return per_token_rewards(x.scores, kl, x.mask, x.beta, x.score_index)
    rest = x.scores - x.turn_rewards.sum(1)
    return per_token_rewards(rest, kl, x.mask, x.beta) + x.turn_rewards


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, sum_over_ranks: Callable[..., Any]) -> torch.Tensor:
    """masked_whiten with the mean and unbiased variance of the real tokens of every rank, so all ranks agree.

    Two passes in float64 (the mean, then sum (x - mean)^2), not E[x^2] - E[x]^2: equal values then whiten to exactly
    0, where the one-pass form leaves a variance of rounding noise that rsqrt(var + eps) blows up to ~1e-4."""
    import torch

    x64, mask64 = x.double(), mask.double()
    m = sum_over_ranks({"s": float(masked_sum(x64, mask64)), "n": float(mask64.sum())})
    mean = m["s"] / max(m["n"], 1.0)
    ss = sum_over_ranks({"ss": float(masked_sum((x64 - mean) ** 2, mask64))})["ss"]
    var = ss / max(m["n"] - 1, 1)
    return masked_whiten(x, mask, torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64))


@advantage_estimator("reinforce_pp", kl_in_reward=True)
def reinforce_pp(x: AdvantageInputs) -> Advantages:
    """The per-token rewards -> discounted returns -> whitened over the global batch."""
    import torch

    returns = discounted_returns(kl_rewards(x), x.mask, x.gamma)
    keep = torch.ones(len(x.scores), dtype=torch.bool)
    return Advantages(whiten_over_ranks(returns, x.mask, x.sum_over_ranks), None, 0.0, keep)


@advantage_estimator("gae", uses_value_model=True, kl_in_reward=True)  # PPO, Tulu 3
def gae(x: AdvantageInputs) -> Advantages:
    """The per-token rewards -> GAE with the value model -> whitened with statistics over every rank
    (whiten_advantages); the value targets are the returns."""
    import torch

    # The episode runs over the value mask (one position longer with after_last_token); the policy trains on `mask`.
    # Multi-turn: GAE over the policy tokens only, observation tokens skipped (multi_turn_gae).
    advantage_fn = gae_advantages if x.turn_rewards is None else multi_turn_gae
    advantages, returns = advantage_fn(kl_rewards(x), x.values, x.value_mask, x.gamma, x.lam)
    advantages = advantages * x.mask
    if x.whiten_advantages:
        advantages = whiten_over_ranks(advantages, x.mask, x.sum_over_ranks)
    return Advantages(advantages, returns, 0.0, torch.ones(len(x.scores), dtype=torch.bool))


DISTILL_SETTINGS = ("distill_loss", "teacher_kl_weight", "distill_reward_weight", "distill_group_baseline")


@advantage_estimator("distill", uses_teacher=True, settings=DISTILL_SETTINGS)
def distill(
    x: AdvantageInputs,
    *,
    distill_loss: str,
    teacher_kl_weight: float,
    distill_reward_weight: float,
    distill_group_baseline: bool,
) -> Advantages:
    """On-policy distillation toward a frozen teacher (docs/distillation.md): per token, the teacher term and the
    weighted score,

        A_it = teacher_kl_weight * (teacher_logp_it - old_logp_it)      (distill_loss reverse_kl; jsd: a loss term)
             + distill_reward_weight * (s_i - mean of s over i's group)  (group mean 0 without distill_group_baseline)

    on policy tokens (the mask), no discount; the KL to the reference, when beta > 0, is a loss term."""
    import torch

    scores = group_advantages(x.scores, x.group_size, scale=False) if distill_group_baseline else x.scores
    advantages = distill_reward_weight * scores.unsqueeze(1) * x.mask
    if distill_loss == "reverse_kl":
        advantages = advantages + teacher_kl_weight * teacher_advantages(x.old_logp, x.teacher_logp, x.mask)
    kl_loss_coef = x.beta if x.ref_logp is not None else 0.0
    return Advantages(advantages, None, kl_loss_coef, torch.ones(len(x.scores), dtype=torch.bool))


@policy_loss("ppo")
def ppo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo_policy_loss(x.logp, x.old_logp, x.advantages, x.clip_low, x.clip_high, x.dual_clip_c)


@policy_loss("gspo")
def gspo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return gspo_policy_loss(x.logp, x.old_logp, x.advantages, x.mask, x.clip_low, x.clip_high, x.dual_clip_c)


@policy_loss("cispo", takes_dual_clip=False)  # its importance weight is already capped
def cispo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return cispo_policy_loss(x.logp, x.old_logp, x.advantages, x.clip_high)


@kl_estimator("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp: unbiased, can be negative (Schulman's estimators)."""
    return logp - ref_logp


@kl_estimator("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2: biased, >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


@kl_estimator("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r,  r = exp(ref_logp - logp): unbiased, >= 0 (GRPO's choice)."""
    import torch

    log_ratio = logp - ref_logp
    return torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r with log r = -log_ratio
