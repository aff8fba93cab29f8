"""Run-time pieces every training script needs: start-up checks, the Accelerator, preemption, numerical
faults, distributed sums and throughput. Kept small; the training loops themselves live in the scripts."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

from open_instruct.config import BaseConfig, config_yaml, parse_or_exit
from open_instruct.errors import EXIT_CONFIG, EXIT_NONFINITE, ConfigError, DataError, NonFiniteError
from open_instruct.gpu_stats import TRAINING_TOKENS_KEYS, StepGPUStats

C = TypeVar("C", bound=BaseConfig)
# "exit": SIGTERM ends the process at once, with no checkpoint (bench/gpu_check.py sets it: its SIGTERM is a step's
# time limit, and a checkpoint in the kill's grace would write GBs for nothing). Unset: a preemption notice.
SIGTERM_ENV = "OPEN_INSTRUCT_ON_SIGTERM"


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process_from_env() -> bool:
    """Rank 0 of the launch (torchrun/accelerate set RANK), known before the process group exists."""
    return int(os.environ.get("RANK", "0")) == 0


def check_explicit_checkpoint(path: str) -> None:
    """An explicit resume checkpoint must be a complete folder that passes its checksums (before any model loads)."""
    from open_instruct import checkpoint

    if not os.path.isdir(path):
        raise ConfigError(f"resume_from_checkpoint {path!r} is not a folder")
    reason = checkpoint.validate(path, deep=True)
    if reason is not None:
        raise ConfigError(f"resume_from_checkpoint {path!r}: {reason}")


def claim_output_dir(cfg: BaseConfig) -> None:
    """On the main process: lock the output folder, make sure it holds no other run (run_dir.claim), and check the
    checkpoint to resume against this config. Exits 0 at once when `auto` finds its run already finished."""
    from open_instruct import checkpoint, run_dir

    resume = cfg.resume_from_checkpoint
    checkpoint.check_allowed_resume_changes(cfg, world_size_from_env())  # every start, resumed or not
    explicit = resume not in (None, "", "auto")
    if explicit:
        check_explicit_checkpoint(resume)
    claim = run_dir.claim(
        cfg.output_dir,
        cfg.script,
        resume,
        cfg.overwrite_output_dir,
        lambda: checkpoint.read_state(resume).get("run_id"),
        cfg.delete_finished_run,
    )
    try:
        if claim.finished:
            run = run_dir.read_run(cfg.output_dir) or {}
            print(
                f"run {claim.run_id} in {cfg.output_dir} already finished ({run.get('final_counters')}); nothing to "
                f"do. {run_dir.how_to_train_further(cfg.output_dir, checkpoint.valid_checkpoints(cfg.output_dir))}"
            )
            raise SystemExit(0)
        if resume == "auto":  # this run's newest valid checkpoint, or none (a fresh start)
            resume = checkpoint.find_resume_checkpoint(cfg.output_dir, lambda message: None, claim.run_id)
        if resume:
            checkpoint.check_resume_compatible(resume, cfg, world_size_from_env())
    except BaseException:
        claim.lock.release()
        raise


def start_checks(cfg: Any, launcher_world: int, dry_run: bool) -> None:
    """Every check a start makes before loading a model, in one place: a real start runs it before it claims (and,
    with --overwrite_output_dir, clears) the output folder, and --dry_run runs the same and stops after it, so both
    exit 2 with the same message. Inputs (preflight.check_inputs: paths, tokenizer, template, LoRA targets,
    environment and reward-function imports), the first rows of every local or integration-made (reasoning-gym,
    `verifiers`) source in the declared format and tokenized with the run's limits and drops, each reward function
    (judges among them) called on the first training rows, the generation backend and a distillation teacher (RL), then
    the memory check of the layout judged (plan.judged_layout: the layout the recipe names, else this machine's). A
    real start checks memory on the CPU only (the host's memory): on a GPU a prediction does not refuse a start
    (docs/gpu.md); the dry run and the planner do."""
    from open_instruct import plan, preflight

    layout = plan.judged_layout(cfg, launcher_world, real_start=not dry_run)
    if cfg.script == "rlvr_ppo":  # RL batch math needs no dataset: checked first
        check_rl_run_length(cfg, cfg.batch_plan(layout.world, None))
    preflight.check_inputs(cfg)
    from open_instruct import data  # imports torch: after the checks that need none

    probe, first_rows = data.check_first_rows(cfg)
    if getattr(cfg, "reward_functions", None) and probe:
        from open_instruct.rewards import probe_line, probe_reward_functions

        if is_main_process_from_env():
            print(probe_line(cfg.reward_functions, len(probe)), flush=True)
        probe_reward_functions(cfg.reward_functions, probe, cfg.reward_function_timeout)
    if first_rows:  # tokenized as the loader will, with the run's limits and drops (the tokenizer loads only then)
        from open_instruct.models import run_tokenizer

        try:
            tokenizer = run_tokenizer(cfg)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a tokenizer that does not load is reported where the script loads it
            tokenizer = None
        if tokenizer is not None:
            data.check_first_rows_tokenized(cfg, tokenizer, first_rows)
    if cfg.script == "rlvr_ppo":
        from open_instruct.generation_backends import check_backend

        check_backend(cfg.generation_backend)  # a missing or unsupported vLLM
        if cfg.uses_teacher:  # distillation (imported only then): a teacher whose vocabulary is not the student's
            from open_instruct.distillation import check_teacher

            check_teacher(cfg)
    if dry_run or layout.assumptions.gpu == "cpu":  # a real start on a GPU is not refused by a prediction (gpu.md)
        plan.check_memory(cfg, layout)


def check_rl_run_length(cfg: Any, batch_plan: Any) -> None:
    """RL's run length is total_episodes (completions). HF's / TRL's num_train_epochs (passes over the prompts) is
    refused with the total_episodes it means, worked out on the run's prompts; a total_episodes that is not a whole
    number of rollouts trains the whole rollouts in it, said in one line (the world size decides a rollout's size, so
    a recipe stays valid on another layout)."""
    from open_instruct import plan
    from open_instruct.flag_names import epochs_as_total_episodes

    if cfg.num_train_epochs is not None:
        arithmetic = epochs_as_total_episodes(
            cfg.num_train_epochs, plan.training_size(cfg)[0], cfg.num_samples_per_prompt
        )
        raise ConfigError(
            f"num_train_epochs is HF's / TRL's run length (passes over the prompts); RL's is total_episodes, the "
            f"completions to train on: {arithmetic} (and no num_train_epochs)"
        )
    p = batch_plan
    trained = p.num_training_steps * p.episodes_per_rollout
    if trained != cfg.total_episodes and is_main_process_from_env():
        print(
            f"total_episodes {cfg.total_episodes} is not a whole number of rollouts of {p.episodes_per_rollout} "
            f"completions (rollout_batch_size {p.rollout_batch_size} x num_samples_per_prompt "
            f"{p.num_samples_per_prompt}): training {trained} ({p.num_training_steps} rollouts); --total_episodes "
            f"{trained + p.episodes_per_rollout} for one more",
            flush=True,
        )


def start(cls: type[C], argv: Optional[Sequence[str]] = None) -> C:
    """Parse the config (exit 2 on errors), run every check that needs no model (start_checks; --dry_run then
    prints the plan and exits), claim the output folder (one run at a time, no mixing with another run's files) and
    check the checkpoint to resume. Nothing heavy has been loaded when this returns; SIGTERM is caught from here on.

    After `start_before_imports(cls)`, `start(cls)` returns that config (parsed and checked once)."""
    global _started
    if argv is None and _started is not None and isinstance(_started, cls):
        cfg, _started = _started, None
        return cfg
    cfg = parse_or_exit(cls, argv)
    try:
        from open_instruct import distributed, preflight, run_dir

        if not cfg.dry_run:
            distributed.check_cpu_launch(sys.argv[0])  # `accelerate launch --num_processes N` without a GPU: 1 process
        # The same checks for a dry run and a real start, all before the output folder is claimed (and, with
        # --overwrite_output_dir, cleared): a start that fails one leaves the folder as it was.
        start_checks(cfg, world_size_from_env(), cfg.dry_run)
        if cfg.dry_run:
            from open_instruct.plan import print_dry_run

            print(f"resolved config (saved as {cfg.output_dir}/config.yaml when the run starts):")
            print(config_yaml(cfg))
            print_dry_run(cfg, world_size_from_env())
            raise SystemExit(0)
        preflight.check_output_dir_writable(cfg.output_dir)
        if is_main_process_from_env():
            claim_output_dir(cfg)
            run_dir.write_config(cfg.output_dir, config_yaml(cfg))
        elif cfg.resume_from_checkpoint == "auto" and (run_dir.read_run(cfg.output_dir) or {}).get("finished"):
            raise SystemExit(0)  # rank 0 says why and exits 0 too; waiting for it in the process group would hang
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    except DataError as e:  # a dataset's first rows (start_checks): as a real start's loader reports it
        print(f"DataError: {e}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    preemption().requested = False  # from here a SIGTERM (e.g. during the model load) is noticed, not fatal
    return cfg


_started: Optional[BaseConfig] = None  # the config `start_before_imports` parsed, handed to the script's `main`


def start_before_imports(cls: type[BaseConfig]) -> None:
    """For a script run as `__main__` whose module imports torch at the top (rlvr_ppo.py): parse and check the
    config first, so a bad one exits 2 before the slow import. The script's `main` gets this same config from
    `start(cls)`."""
    global _started
    from open_instruct import rl_algorithms

    try:
        with rl_algorithms.deferring_unknown_names():  # a copied script registers its own variants below this call
            _started = start(cls)
    except rl_algorithms.NotYetRegistered:
        _started = None  # the script's main checks the config with start(cls), after its registrations have run


def run(main: Callable[..., Any], argv: Optional[Sequence[str]] = None) -> None:
    """Script entry point: configuration and data errors print one clear line and exit with status 2; a NaN/inf
    loss, gradient or weight (on_nonfinite: stop) prints one line naming the step and exits with status 3, which a
    requeue-on-failure wrapper can tell apart from a crash (resuming would only hit it again)."""
    from open_instruct import run_dir

    try:
        main(argv)
    except (ConfigError, DataError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        exit_process(EXIT_CONFIG)
    except NonFiniteError as e:
        print(f"\nNonFiniteError: {e}", file=sys.stderr)  # on its own line, not after the progress bar's
        exit_process(EXIT_NONFINITE)
    except Preempted as e:
        print(str(e), file=sys.stderr)
        exit_process(0)
    else:
        exit_process(0)
    finally:
        run_dir.release_all()  # the output folder's lock (also released at exit; a killed run's lock is stale)


def exit_process(code: int) -> None:
    """End the script with `code`. A process of a multi-process run ends with os._exit once its output is flushed:
    left to the interpreter's teardown, a rank that had finished every step, checkpoint and final save was seen to
    abort under load ("terminate called without an active exception": torch/gloo C++ threads destroyed while the
    interpreter finalizes), turning a finished run into a failed one for the scheduler. Everything a run writes is
    closed by then (logs, checkpoints, the lock), the exit handlers run, and a peer still writing its files needs
    nothing from this one."""
    distributed = "torch" in sys.modules and _process_group_initialized()
    if not distributed:
        if code:
            raise SystemExit(code) from None
        return
    import atexit

    atexit._run_exitfuncs()  # what a normal exit runs first (the lock, temp folders, engine shutdowns, logging)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


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


class Preempted(Exception):
    """SIGTERM arrived before training started (model load, DPO reference pass): exit 0 with a message."""


class Preemption:
    """SIGTERM (a scheduler's preemption notice) asks the loop to checkpoint at the next step boundary and exit.
    One per process (`preemption()`), installed by `start` so a SIGTERM during the model load is not fatal."""

    def __init__(self) -> None:
        self.requested = False
        if os.environ.get(SIGTERM_ENV) == "exit":
            return  # SIGTERM keeps its default action: the process ends where it is
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not in the main thread (e.g. under some test runners)
            pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def should_stop(self, accelerator: Any) -> bool:
        """Agreed across ranks, so every process stops at the same step."""
        return self._agreed(accelerator)

    def stop_if_requested(self, accelerator: Any, during: str) -> None:
        """Before training starts (nothing to checkpoint yet): raise Preempted when SIGTERM has arrived."""
        if self._agreed(accelerator):
            raise Preempted(f"SIGTERM during {during}: stopped before training started; nothing new to save")

    def _agreed(self, accelerator: Any) -> bool:
        if accelerator.num_processes == 1:
            return self.requested
        import torch

        flag = torch.tensor([1.0 if self.requested else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


_preemption: Optional[Preemption] = None


def preemption() -> Preemption:
    """This process's SIGTERM handler (installed on first use)."""
    global _preemption
    handled = os.environ.get(SIGTERM_ENV) != "exit"
    if _preemption is None or (handled and signal.getsignal(signal.SIGTERM) != _preemption._handle):
        _preemption = Preemption()
    return _preemption


class Throughput:
    """Tokens/s and episodes/s over the interval since the last report."""

    def __init__(self) -> None:
        self.total_tokens = 0  # since this process started training, for the end-of-run summary
        self.restart()

    def restart(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.episodes = 0

    def add(self, tokens: int, episodes: int) -> None:
        self.total_tokens += tokens
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
        self.preemption = preemption()
        self.preemption.stop_if_requested(accelerator, "start-up (model load)")
        self.counters = Counters()
        main = accelerator.is_main_process
        state = restore_training_state(cfg, accelerator, models, optimizers, schedulers, self.counters, self.print)
        self.resumed = state is not None
        self.restored_state = state or {}  # the trainer state a resume read (empty on a fresh start)
        # name -> a function returning JSON-able state to save with each checkpoint (e.g. the rollouts in flight);
        # collective: every rank calls it at every checkpoint
        self.checkpoint_state: dict[str, Callable[[], Any]] = {}
        self.best = BestTracker(cfg, state)
        self.logger = MetricsLogger(cfg, main, last_step, counter, self.step if self.resumed else None)
        self.throughput = Throughput()
        self.gpu_stats = StepGPUStats(accelerator.device, models.values(), cfg.peak_tflops, accelerator.num_processes)
        self.started = time.perf_counter()

    @classmethod
    def for_model(
        cls,
        cfg: BaseConfig,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        tokenizer: Any,
        last_step: int,
    ) -> "RunContext":
        """The supervised scripts' case: one trained model (the "policy"), paced by optimizer steps."""
        return cls(
            cfg, accelerator, {"policy": model}, {"policy": optimizer}, {"policy": scheduler}, tokenizer, last_step
        )

    @property
    def step(self) -> int:
        """The current value of the pacing counter."""
        return getattr(self.counters, self.counter)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.accelerator.is_main_process:
            print(*args, **kwargs)

    def log(self, metrics: dict[str, Any]) -> None:
        """One metrics row (jsonl, wandb), stamped with the four counters. A train row (one carrying a training
        tokens/s) gets, on a GPU, the peak memory since the previous one and the MFU (gpu_stats.StepGPUStats)."""
        if any(key in metrics for key in TRAINING_TOKENS_KEYS):
            metrics = {**metrics, **self.gpu_stats.metrics(metrics)}
        self.logger.log({**self.counters.as_log(), **metrics})

    def apply_update(self, loss: float, grad_norm: Any, episodes: int, num_examples: int) -> bool:
        """Supervised scripts, once the step's gradients are summed and clipped: the optimizer steps if the update
        is finite on every rank (else exit 3, or with `on_nonfinite: skip` it is skipped), the scheduler steps, the
        gradients are zeroed and the step is counted. Returns whether the optimizer stepped."""
        from open_instruct.distributed import check_update_finite

        optimizer, scheduler = self.optimizers["policy"], self.schedulers["policy"]
        step_ok = check_update_finite(self, loss, grad_norm=grad_norm)
        if step_ok:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.count_update(episodes, num_examples)
        return step_ok

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
            {**self.best.state(), **{name: state() for name, state in self.checkpoint_state.items()}},
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
        """The end of a run: the final model in HF format (<output_dir>/final_model, atomic), the run marked finished
        in run.json (`auto` then has nothing left to do), then close the logs."""
        from open_instruct import run_dir
        from open_instruct.checkpoint import save_hf_model

        path = os.path.join(self.cfg.output_dir, "final_model")
        if self.cfg.save_final_model:
            model, log = self.models["policy"], self.counters.as_log()
            save_hf_model(model, self.tokenizer, path, self.accelerator, log, getattr(self.cfg, "lora_save", "merged"))
        if self.accelerator.is_main_process:
            run_dir.mark_finished(self.cfg.output_dir, self.counters.as_log())
        self.logger.close()
        self.print_summary(path if self.cfg.save_final_model else None)

    def print_summary(self, final_model: Optional[str]) -> None:
        """The end-of-run lines (console.end_summary): steps, wall time and tokens/s of this process's training (since
        the resume, for a resumed run), final and best metric, where the models are. Every rank joins the token sum."""
        from open_instruct import console
        from open_instruct.distributed import global_sums
        from open_instruct.tracking import read_jsonl

        seconds = time.perf_counter() - self.started
        tokens = global_sums(self.accelerator, {"tokens": self.throughput.total_tokens})["tokens"]
        if not self.accelerator.is_main_process:
            return
        kind = "generated tokens" if self.counter == "rollout_step" else "tokens trained"
        text = console.end_summary(
            self.cfg,
            read_jsonl(self.logger.path),
            self.counters.as_log(),
            self.counter,
            seconds,
            tokens,
            kind + (" since the resume" if self.resumed else ""),
            self.best.best,
            final_model,
        )
        print(text, flush=True)
