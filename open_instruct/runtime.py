"""Run-time pieces every training script needs: start-up checks, the Accelerator, preemption, numerical
faults, distributed sums and throughput. Kept small; the training loops themselves live in the scripts."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

from open_instruct.config import BaseConfig, parse_or_exit
from open_instruct.errors import EXIT_CONFIG, EXIT_NONFINITE, ConfigError, DataError, NonFiniteError

C = TypeVar("C", bound=BaseConfig)


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
        raise SystemExit(EXIT_CONFIG) from None
    return cfg


def run(main: Callable[..., Any], argv: Optional[Sequence[str]] = None) -> None:
    """Script entry point: configuration and data errors print one clear line and exit with status 2; a NaN/inf
    loss, gradient or weight (on_nonfinite: stop) prints one line naming the step and exits with status 3, which a
    requeue-on-failure wrapper can tell apart from a crash (resuming would only hit it again)."""
    try:
        main(argv)
    except (ConfigError, DataError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
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


class Throughput:
    """Tokens/s and episodes/s over the interval since the last report."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.episodes = 0

    def add(self, tokens: int, episodes: int) -> None:
        self.tokens += tokens
        self.episodes += episodes

    def report(self, accelerator: Any) -> dict[str, float]:
        from open_instruct.distributed import global_sums

        totals = global_sums(accelerator, {"tokens": self.tokens, "episodes": self.episodes})
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.restart()
        return {"perf/tokens_per_second": totals["tokens"] / dt, "perf/episodes_per_second": totals["episodes"] / dt}


class RunContext:
    """The bookkeeping every script's loop shares, built once the models are prepared: the four counters (restored
    with the models when resuming), the metrics logger, the best-model tracker, SIGTERM preemption, throughput, and
    the checkpoint / end-of-step / finish calls. Not a Trainer: each script keeps its own loop, its forward and
    backward, and its optimizer step in sight.

    `models`, `optimizers` and `schedulers` are dicts keyed alike ("policy", and "value" for PPO); "policy" is the
    model saved as best_model and final_model. `counter` names the step counter that paces the run
    ("optimizer_step", or "rollout_step" in RL) and `last_step` its final value."""

    def __init__(
        self,
        cfg: BaseConfig,
        accelerator: Any,
        models: dict[str, Any],
        optimizers: dict[str, Any],
        schedulers: dict[str, Any],
        tokenizer: Any,
        last_step: int,
        counter: str = "optimizer_step",
    ) -> None:
        from open_instruct.batch_math import Counters
        from open_instruct.checkpoint import BestTracker, restore_training_state
        from open_instruct.tracking import MetricsLogger

        self.cfg, self.accelerator, self.tokenizer = cfg, accelerator, tokenizer
        self.models, self.optimizers, self.schedulers = models, optimizers, schedulers
        self.last_step, self.counter = last_step, counter
        self.counters = Counters()
        main = accelerator.is_main_process
        state = restore_training_state(cfg, accelerator, models, optimizers, schedulers, self.counters, self.print)
        self.resumed = state is not None
        self.best = BestTracker(cfg, state)
        self.logger = MetricsLogger(cfg, main, last_step, counter, self.step if self.resumed else None)
        self.preemption = Preemption()
        self.throughput = Throughput()

    @property
    def step(self) -> int:
        """The current value of the pacing counter."""
        return getattr(self.counters, self.counter)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.accelerator.is_main_process:
            print(*args, **kwargs)

    def log(self, metrics: dict[str, Any]) -> None:
        """One metrics row (jsonl, wandb), stamped with the four counters."""
        self.logger.log({**self.counters.as_log(), **metrics})

    def update_is_finite(self, loss: float, **grad_norms: Any) -> bool:
        """Whether the update about to be applied is finite on every rank. When it is not: stop with
        NonFiniteError (exit 3, before any checkpoint is written) or, with `on_nonfinite: skip`, say so and
        return False so the caller skips `optimizer.step()`."""
        from open_instruct.distributed import all_finite

        if all_finite(self.accelerator, loss, *grad_norms.values()):
            return True
        norms = "".join(f", {name}={float(v)}" for name, v in grad_norms.items())
        message = f"non-finite loss/gradient (loss={loss}{norms}) at optimizer step {self.counters.optimizer_step + 1}"
        if self.cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"{message}; stopping without saving (set on_nonfinite: skip to skip such updates)")
        self.logger.write(f"{message}: update skipped (on_nonfinite=skip)")
        return False

    def count_update(self, episodes: int, num_examples: int) -> None:
        """Supervised scripts, after each optimizer step: one more step, `episodes` more examples seen."""
        self.counters.optimizer_step += 1
        self.counters.episode += episodes
        self.counters.epoch = self.counters.episode / num_examples
        self.logger.advance()

    def save_checkpoint(self) -> None:
        from open_instruct.checkpoint import save_training_state

        save_training_state(
            self.cfg,
            self.accelerator,
            self.models,
            self.optimizers,
            self.schedulers,
            self.counters,
            self.tokenizer,
            self.best.state(),
        )

    def evaluate(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Run an eval, log its row and keep best_model up to date."""
        metrics = evaluate()
        self.log(metrics)
        self.best.update(metrics, self.models["policy"], self.tokenizer, self.accelerator, self.counters)
        return metrics

    def end_of_step(self, evaluate: Optional[Callable[[], dict[str, float]]]) -> bool:
        """After every step (optimizer step, or rollout in RL), the same in every script: eval every eval_steps and
        at the last step, checkpoint every checkpointing_steps, and on SIGTERM checkpoint and stop. Returns True
        when the run must stop now (the logs are then closed)."""
        from open_instruct.batch_math import should_fire

        step = self.step
        if evaluate is not None and should_fire(
            step, self.cfg.eval_steps, self.last_step if self.cfg.eval_steps else None
        ):
            self.evaluate(evaluate)
        stopping = self.preemption.should_stop(self.accelerator)
        if should_fire(step, self.cfg.checkpointing_steps) or stopping:
            self.save_checkpoint()
        if stopping:
            self.logger.write(f"SIGTERM: checkpoint written at {self.counter.replace('_', ' ')} {step}; exiting")
            self.logger.close()
        return stopping

    def finish(self) -> None:
        """The end of a run: the final model in HF format (<output_dir>/final_model, atomic), then close the logs."""
        from open_instruct.checkpoint import save_hf_model

        if self.cfg.save_final_model:
            path = os.path.join(self.cfg.output_dir, "final_model")
            model, log = self.models["policy"], self.counters.as_log()
            save_hf_model(model, self.tokenizer, path, self.accelerator, log, getattr(self.cfg, "lora_save", "merged"))
        self.logger.close()
