"""Run-time pieces every training script needs: start-up checks, the Accelerator, preemption, numerical
faults, distributed sums and throughput. Kept small; the training loops themselves live in the scripts."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

from open_instruct.config import BaseConfig, parse_or_exit
from open_instruct.utils import ConfigError

C = TypeVar("C", bound=BaseConfig)


class NonFiniteError(RuntimeError):
    pass


def check_output_dir_writable(output_dir: str) -> None:
    """Fail before any model loads when the output folder cannot be created or written."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"output_dir {output_dir!r} is not writable: {e.strerror or e}") from None


def check_model_path(name_or_path: str, what: str = "model_name_or_path") -> None:
    """Fail early (before any weights load) when a path-looking model location does not exist."""
    looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 2)[-1]
    if looks_local and not os.path.exists(os.path.expanduser(name_or_path)):
        raise ConfigError(f"{what} {name_or_path!r} does not exist")


def check_resume_path(resume_from_checkpoint: Optional[str]) -> None:
    """An explicit checkpoint path must exist and be complete before any model loads (its checksums are verified
    when it is restored). `auto` needs no check: it falls back to older checkpoints, or a fresh start."""
    if not resume_from_checkpoint or resume_from_checkpoint == "auto":
        return
    if not os.path.isdir(resume_from_checkpoint):
        raise ConfigError(f"resume_from_checkpoint {resume_from_checkpoint!r} is not a folder")
    from open_instruct.checkpoint import validate

    reason = validate(resume_from_checkpoint, deep=False)
    if reason is not None:
        raise ConfigError(f"resume_from_checkpoint {resume_from_checkpoint!r}: {reason}")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def start(cls: type[C], argv: Optional[Sequence[str]] = None) -> C:
    """Parse the config (exit 2 on errors), print the plan and exit on --dry_run, check the output folder
    and the model path. Nothing heavy has been loaded when this returns."""
    cfg = parse_or_exit(cls, argv)
    try:
        if cfg.dry_run:
            from open_instruct.plan import print_dry_run

            print_dry_run(cfg, world_size_from_env())
            raise SystemExit(0)
        check_model_path(cfg.model_name_or_path)
        for key in ("value_model_path", "reward_model_path"):
            if getattr(cfg, key, None):
                check_model_path(getattr(cfg, key), key)
        check_output_dir_writable(cfg.output_dir)
        check_resume_path(cfg.resume_from_checkpoint)
        if hasattr(cfg, "local_rollout_batch_size"):  # RL batch math needs no dataset: check it now
            cfg.batch_plan(world_size_from_env(), None)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


EXIT_NONFINITE = 3


def run(main: Callable[..., Any], argv: Optional[Sequence[str]] = None) -> None:
    """Script entry point: configuration and data errors print one clear line and exit with status 2; a NaN/inf
    loss, gradient or weight (on_nonfinite: stop) prints one line naming the step and exits with status 3, which a
    requeue-on-failure wrapper can tell apart from a crash (resuming would only hit it again)."""
    from open_instruct.data import DataError

    try:
        main(argv)
    except (ConfigError, DataError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except NonFiniteError as e:
        print(f"\nNonFiniteError: {e}", file=sys.stderr)  # on its own line, not after the progress bar's
        raise SystemExit(EXIT_NONFINITE) from None


def make_accelerator(cfg: BaseConfig) -> Any:
    import warnings

    import torch
    import transformers

    from open_instruct.distributed import build_accelerator

    transformers.utils.logging.disable_progress_bar()  # weight-loading bars drown the training bar
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    accelerator = build_accelerator(cfg)  # FSDP2 from the accelerate config + recipe flags; launch checks
    torch.manual_seed(cfg.seed)
    return accelerator


class Preemption:
    """SIGTERM (a scheduler's preemption notice) asks the loop to checkpoint at the next step boundary and exit."""

    def __init__(self) -> None:
        self.requested = False
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not in the main thread (e.g. under some test runners)
            pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def should_stop(self, accelerator: Any) -> bool:
        """Agreed across ranks, so every process stops at the same step."""
        if accelerator.num_processes == 1:
            return self.requested
        import torch

        flag = torch.tensor([1.0 if self.requested else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def is_finite(accelerator: Any, *values: Any) -> bool:
    """True when every value (tensor or float) is finite on every rank."""
    import torch

    bad = 0.0
    for v in values:
        t = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        if not torch.isfinite(t).all():
            bad = 1.0
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(torch.tensor([bad], device=accelerator.device), reduction="sum").item()
    return bad == 0


def handle_nonfinite(cfg: BaseConfig, step: int, what: str, log: Any) -> None:
    """Stop (default) or skip the update, by `on_nonfinite`. Stopping raises before any checkpoint is written."""
    message = f"non-finite {what} at optimizer step {step}"
    if cfg.on_nonfinite == "stop":
        raise NonFiniteError(f"{message}; stopping without saving (set on_nonfinite: skip to skip such updates)")
    log(f"{message}: update skipped (on_nonfinite=skip)")


def global_sum(accelerator: Any, value: float) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    import torch

    t = torch.tensor([float(value)], device=accelerator.device, dtype=torch.float64)
    return float(accelerator.reduce(t, reduction="sum").item())


def global_sums(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """Sum a dict of floats over ranks in one collective."""
    if accelerator.num_processes == 1 or not values:
        return {k: float(v) for k, v in values.items()}
    import torch

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], device=accelerator.device, dtype=torch.float64)
    t = accelerator.reduce(t, reduction="sum")
    return {k: float(x) for k, x in zip(keys, t.tolist())}


class Throughput:
    """Tokens/s and episodes/s over the interval since the last report."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.episodes = 0

    def add(self, tokens: int, episodes: int) -> None:
        self.tokens += tokens
        self.episodes += episodes

    def report(self, accelerator: Any) -> dict[str, float]:
        totals = global_sums(accelerator, {"tokens": self.tokens, "episodes": self.episodes})
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.__init__()
        return {"perf/tokens_per_second": totals["tokens"] / dt, "perf/episodes_per_second": totals["episodes"] / dt}


def step_boundary(
    cfg: BaseConfig,
    step: int,
    last_step: int,
    counter_name: str,
    evaluate: Optional[Callable[[], dict[str, float]]],
    checkpoint: Callable[[], None],
    accelerator: Any,
    counters: Any,
    logger: Any,
    best: Any,
    model: Any,
    tokenizer: Any,
    preemption: Preemption,
) -> bool:
    """What happens after every step (optimizer step, or rollout in RL), the same in every script: eval every
    eval_steps and at the last step (keeping best_model), checkpoint every checkpointing_steps, and on SIGTERM
    checkpoint and stop. Returns True when the run must stop now."""
    from open_instruct.utils import should_fire

    if evaluate is not None and should_fire(step, cfg.eval_steps, last_step if cfg.eval_steps else None):
        metrics = evaluate()
        logger.log({**counters.as_log(), **metrics})
        best.update(metrics, model, tokenizer, accelerator, counters)
    stopping = preemption.should_stop(accelerator)
    if should_fire(step, cfg.checkpointing_steps) or stopping:
        checkpoint()
    if stopping:
        logger.write(f"SIGTERM: checkpoint written at {counter_name} {step}; exiting")
    return stopping


def finish(cfg: BaseConfig, model: Any, tokenizer: Any, accelerator: Any, counters: Any, logger: Any) -> None:
    """The end of a run: the final model in HF format (<output_dir>/final_model, atomic), then close the logs."""
    from open_instruct.checkpoint import save_hf_model

    if cfg.save_final_model:
        save_hf_model(model, tokenizer, os.path.join(cfg.output_dir, "final_model"), accelerator, counters.as_log())
    logger.close()


def apply_update(
    cfg: BaseConfig, accelerator: Any, optimizer: Any, scheduler: Any, loss: float, grad_norm: Any, counters: Any,
    episodes: int, num_examples: int, logger: Any,
) -> bool:
    """One supervised optimizer step after the gradients are in: refuse a non-finite loss/gradient (stop, or skip
    the update by `on_nonfinite`), step optimizer and schedule, advance the counters. Returns whether it updated."""
    step_ok = is_finite(accelerator, loss, grad_norm)
    if not step_ok:
        handle_nonfinite(cfg, counters.optimizer_step + 1, f"loss/gradient (loss={loss}, grad_norm={float(grad_norm)})", logger.write)
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    counters.optimizer_step += 1
    counters.episode += episodes
    counters.epoch = counters.episode / num_examples
    logger.advance()
    return step_ok
