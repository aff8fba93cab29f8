"""Reliability: crash-safe training and exact resume, preemption, atomic outputs, corrupt checkpoints, full disks,
unwritable folders, NaN/inf, bad data through each script's entry point, hostile model output, safe loading.

The crash tests run every script as real processes (forked from a pre-imported zygote, see _reliability_helpers.py)
and kill them with SIGKILL at several points of one run: mid-step at a random moment, mid-generation (RLVR), inside
DPO's reference pass, inside checkpoint and final_model writes (OPEN_INSTRUCT_FAULT, open_instruct/checkpoint.py),
or preempt them with SIGTERM. After each crash the run is resumed with `--resume_from_checkpoint auto`; the end
result (metrics rows, final and best weights, RLVR sample rows) must equal an uninterrupted run's.
The random delays are drawn from RELIABILITY_SEED (printed; set it to replay a failure)."""

from __future__ import annotations

import ast
import errno
import glob
import json
import math
import os
import random
import shutil
import signal
import time

import pytest
import torch
from _reliability_helpers import Run, Zygote, assert_same_rows, assert_same_weights, read_rows, stop_at
from training_helpers import (
    TINY_PPO_ROLLOUTS,
    one_torch_thread,  # noqa: F401  (autouse fixture: one intra-op thread in this process)
    recipe_args,
)

from demo.synthetic import preference_rows, rl_rows, sft_rows, write_jsonl
from open_instruct import checkpoint, errors, run_dir, runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fixed by default so CI is deterministic; RELIABILITY_SEED=random explores new kill moments.
_seed = os.environ.get("RELIABILITY_SEED", "1234")
SEED = random.SystemRandom().randrange(10**6) if _seed == "random" else int(_seed)


@pytest.fixture(scope="module")
def rng():
    print(f"RELIABILITY_SEED={SEED}")
    return random.Random(SEED)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability_data")
    files = {
        "sft": sft_rows(64, 0),
        "sft_eval": sft_rows(16, 1),
        "pref": preference_rows(64, 2),
        "pref_eval": preference_rows(16, 3),
        "rl": rl_rows(64, 4),
        "rl_eval": rl_rows(8, 5),
    }
    return {name: write_jsonl(str(d / f"{name}.jsonl"), rows) for name, rows in files.items()}


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


# The supervised runs: 4 examples a step (2 x 2 micro-batches), a row every step, eval every 4, checkpoint every 3.
STEPS = "--per_device_train_batch_size 2 --gradient_accumulation_steps 2 --logging_steps 1 --eval_steps 4".split()
STEPS += ["--checkpointing_steps", "3"]


# 16 optimizer steps of 4 conversations (2 x 2 micro-batches), linear decay with warmup: the scheduler state matters.
def sft_argv(models, task, out, *extra):
    settings = ["--learning_rate", "1e-2", "--warmup_ratio", "0.1", "--keep_last_n_checkpoints", "2"]
    return recipe_args(
        "sft_tiny.yaml", models["causal_lm"], task["sft"], task["sft_eval"], out, *STEPS, *settings, *extra
    )


def dpo_argv(models, task, out, cache, *extra):
    settings = ["--reference_cache_dir", str(cache), *STEPS, "--per_device_eval_batch_size", "8"]
    return recipe_args("dpo_tiny.yaml", models["causal_lm"], task["pref"], task["pref_eval"], out, *settings, *extra)


# 8 rollouts of 4 prompts x 2 samples, 2 PPO mini-batches each (16 optimizer steps); checkpoints every 2 rollouts.
def rl_argv(models, task, out, *extra):
    settings = ["--total_episodes", "64", *TINY_PPO_ROLLOUTS, "--eval_steps", "4", "--checkpointing_steps", "2"]
    return recipe_args("rlvr_tiny.yaml", models["causal_lm"], task["rl"], task["rl_eval"], out, *settings, *extra)


def fault(spec: str) -> dict[str, str]:
    return {checkpoint.FAULT_ENV: spec}


def max_counter(out, counter="optimizer_step") -> int:
    return max((r[counter] for r in read_rows(str(out))), default=0)


def step_dirs(out) -> list[str]:
    return sorted(os.listdir(os.path.join(out, "checkpoints")), key=lambda n: (len(n), n))


def debris(out) -> list[str]:
    """Temp folders of interrupted writes anywhere under `out` (never read, must be cleaned up eventually)."""
    return [
        os.path.relpath(p, out)
        for p in glob.glob(os.path.join(out, "**", ".tmp_*"), recursive=True)
        + glob.glob(os.path.join(out, "**", ".old_*"), recursive=True)
    ]


def start(zygote, script, argv, out, **kw) -> Run:
    """A run of `script` as a child process, logging to <out>.<n>.log (one log per run of that output folder)."""
    return Run(zygote, script, argv, str(out) + f".{len(glob.glob(str(out) + '.*.log'))}.log", **kw)


def killed(run: Run, expect: int = -signal.SIGKILL) -> Run:
    code = run.wait()
    assert code == expect, f"exit {code}, expected {expect}:\n{run.output()[-4000:]}"
    return run


def finished(zygote, script, argv, out, **kw) -> Run:
    return killed(start(zygote, script, argv, out, **kw), expect=0)


# ---------------------------------------------------------------------------------------------------------------------
# Kill at any moment, resume, same result


@pytest.fixture(scope="module")
def sft_reference(zygote, tiny_models, task, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_reference") / "out"
    finished(zygote, "sft", sft_argv(tiny_models, task, out), out)
    return out


@pytest.mark.concurrency
@pytest.mark.slow
def test_sft_killed_at_five_points_resumes_to_the_uninterrupted_result(
    zygote, sft_reference, tiny_models, task, tmp_path, rng
):
    out = tmp_path / "out"
    argv = sft_argv(tiny_models, task, out)
    resume = argv + ["--resume_from_checkpoint", "auto"]

    # 1. SIGKILL at a random moment after the 3rd step's row (mid-step, mid-eval or mid-save: all must be survivable).
    run = start(zygote, "sft", argv, out, env=stop_at("metrics_row", 3))
    run.signal_at_stop(signal.SIGKILL, delay=rng.uniform(0, 0.03))
    killed(run)
    assert max_counter(out) < 12

    # 2. SIGKILL inside the step-12 save: the checkpoint is complete in its temp folder, not yet renamed.
    killed(start(zygote, "sft", resume, out, env=fault("checkpoint_write:step_12")))
    tmp = [d for d in os.listdir(out / "checkpoints") if d.startswith(".tmp_step_12_")]
    assert len(tmp) == 1 and os.path.exists(out / "checkpoints" / tmp[0] / checkpoint.COMPLETE)
    assert "step_12" not in step_dirs(out) and max_counter(out) == 12
    assert checkpoint.find_resume_checkpoint(str(out), lambda m: None).endswith("step_9")

    # 3. SIGTERM (preemption) after step 13: checkpoint at the next step boundary, exit 0, no final model.
    run = start(zygote, "sft", resume, out, env=stop_at("metrics_row", 13))
    run.signal_at_stop(signal.SIGTERM)
    assert run.wait() == 0, run.output()[-3000:]
    reached = max_counter(out)  # stopped right after step 13's row: the SIGTERM lands there, whatever the load
    assert reached == 13, reached
    assert f"SIGTERM: checkpoint written at optimizer step {reached}" in run.output()
    assert f"step_{reached}" in step_dirs(out) and not (out / "final_model").exists()
    assert not any(d.startswith(".tmp_") for d in os.listdir(out / "checkpoints"))  # the step-12 debris is pruned

    # 4. SIGKILL while final_model is being written (after the last step and its step-15 checkpoint).
    killed(start(zygote, "sft", resume, out, env=fault("final_model_write")))
    assert not (out / "final_model").exists() and glob.glob(str(out / ".tmp_final_model_*"))

    # 5. Resume to the end.
    last = finished(zygote, "sft", resume, out)
    latest = f"step_{max(15, reached)}"
    assert f"resumed from {out / 'checkpoints' / latest}" in last.output()

    assert_same_rows(read_rows(str(sft_reference)), read_rows(str(out)))
    assert_same_weights(sft_reference / "final_model", out / "final_model")
    assert_same_weights(sft_reference / "best_model", out / "best_model")
    assert step_dirs(out)[-1] == latest and len(step_dirs(out)) == 2
    assert debris(str(out)) == []
    assert checkpoint.validate(str(out / "final_model")) is None


@pytest.mark.concurrency
@pytest.mark.slow
def test_dpo_killed_in_reference_pass_mid_training_and_mid_save_resumes_exactly(
    zygote, tiny_models, task, tmp_path, rng
):
    ref_out, out = tmp_path / "reference" / "out", tmp_path / "crashed" / "out"
    finished(zygote, "dpo", dpo_argv(tiny_models, task, ref_out, tmp_path / "cache_a"), ref_out)
    cache = tmp_path / "cache_b"
    argv = dpo_argv(tiny_models, task, out, cache)
    resume = argv + ["--resume_from_checkpoint", "auto"]

    # 1. SIGKILL at the 3rd forward of the reference log-prob pass: no cache file may be left to be trusted.
    killed(start(zygote, "dpo", argv, out, faults={"kill_in_reference_pass": {"forward": 3}}))
    assert glob.glob(str(cache / "ref_logps_*.safetensors")) == []

    # 2. SIGKILL at a random moment after step 5 (the reference pass is recomputed first).
    run = start(zygote, "dpo", resume, out, env=stop_at("metrics_row", 5))
    run.signal_at_stop(signal.SIGKILL, delay=rng.uniform(0, 0.25))
    killed(run)
    assert "reference log-probs: computed" in run.output() and max_counter(out) < 12

    # 3. SIGKILL inside the step-12 save, after the model/optimizer state is written, before the manifest.
    run = killed(start(zygote, "dpo", resume, out, env=fault("checkpoint_state:step_12")))
    assert "reference log-probs: reused" in run.output()
    assert "step_12" not in step_dirs(out) and any(
        d.startswith(".tmp_step_12_") for d in os.listdir(out / "checkpoints")
    )

    # 4. Resume to the end.
    finished(zygote, "dpo", resume, out)
    assert_same_rows(read_rows(str(ref_out)), read_rows(str(out)))
    assert_same_weights(ref_out / "final_model", out / "final_model")
    assert_same_weights(ref_out / "best_model", out / "best_model")
    (a,), (b,) = glob.glob(str(tmp_path / "cache_a" / "*.safetensors")), glob.glob(str(cache / "*.safetensors"))
    assert os.path.basename(a) == os.path.basename(b)  # same identity hash
    from safetensors.torch import load_file

    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert debris(str(out)) == []


@pytest.mark.concurrency
@pytest.mark.slow
def test_rlvr_killed_mid_generation_preempted_and_killed_again_resumes_exactly(
    zygote, tiny_models, task, tmp_path, rng
):
    ref_out, out = tmp_path / "reference" / "out", tmp_path / "crashed" / "out"
    finished(zygote, "rlvr_ppo", rl_argv(tiny_models, task, ref_out), ref_out)
    argv = rl_argv(tiny_models, task, out)
    resume = argv + ["--resume_from_checkpoint", "auto"]

    # 1. SIGKILL at the 5th decoding step of the 3rd generate() call (1: step-0 eval, 2: rollout 1, 3: rollout 2).
    killed(start(zygote, "rlvr_ppo", argv, out, faults={"kill_in_generation": {"call": 3, "forward": 5}}))
    assert max_counter(out, "rollout_step") == 1

    # 2. SIGTERM after rollout 4's row: checkpoint at the rollout reached (named by its optimizer step), exit 0.
    run = start(zygote, "rlvr_ppo", resume, out, env=stop_at("metrics_row", 4))
    run.signal_at_stop(signal.SIGTERM)
    assert run.wait() == 0, run.output()[-3000:]
    reached = max_counter(out, "rollout_step")  # stopped right after rollout 4's row: the SIGTERM lands there
    assert reached == 4, reached
    assert f"SIGTERM: checkpoint written at rollout step {reached}" in run.output()
    assert f"step_{2 * reached}" in step_dirs(out) and not (out / "final_model").exists()

    # 3. SIGKILL at a random moment after rollout 6 (generation, scoring, PPO epochs, eval or checkpoint).
    run = start(zygote, "rlvr_ppo", resume, out, env=stop_at("metrics_row", max(6, reached + 1)))
    run.signal_at_stop(signal.SIGKILL, delay=rng.uniform(0, 0.2))
    killed(run)

    # 4. Resume to the end.
    finished(zygote, "rlvr_ppo", resume, out)
    assert_same_rows(read_rows(str(ref_out)), read_rows(str(out)))
    assert_same_rows(read_rows(str(ref_out), "samples.jsonl"), read_rows(str(out), "samples.jsonl"))
    assert_same_weights(ref_out / "final_model", out / "final_model")
    assert_same_weights(ref_out / "best_model", out / "best_model")
    assert debris(str(out)) == []


def rm_argv(models, task, out, *extra):  # 16 steps of 4 pairs
    return recipe_args("rm_tiny.yaml", models["seq_cls"], task["pref"], task["pref_eval"], out, *STEPS, *extra)


@pytest.mark.concurrency
@pytest.mark.slow
def test_reward_model_survives_sigkills_at_random_moments(zygote, tiny_models, task, tmp_path, rng):
    """Restarts SIGKILLed at random moments (start-up, restore, a step, an eval, a save or the final write: wherever
    it lands) until one gets to the end (at most 4 kills): the result equals an uninterrupted run's."""
    ref_out, out = tmp_path / "reference" / "out", tmp_path / "crashed" / "out"
    t0 = time.monotonic()
    finished(zygote, "reward_model", rm_argv(tiny_models, task, ref_out), ref_out)
    seconds = time.monotonic() - t0  # one whole run, start-up included
    resume = rm_argv(tiny_models, task, out, "--resume_from_checkpoint", "auto")
    kills, scale = 0, 1.0
    while kills < 4:
        if start(zygote, "reward_model", resume, out).kill_after(rng.uniform(0.05, 0.9) * seconds * scale):
            kills += 1
        elif kills:
            break  # a resumed run reached the end
        else:  # the first run ended before its kill (faster than the timed one, whose start-up was cold): again, sooner
            shutil.rmtree(out)
            scale /= 2
    print(f"{kills} random kills in runs of {seconds:.1f} s")
    assert kills >= 1
    if kills == 4:
        finished(zygote, "reward_model", resume, out)
    assert_same_rows(read_rows(str(ref_out)), read_rows(str(out)))
    assert_same_weights(ref_out / "final_model", out / "final_model")
    assert_same_weights(ref_out / "best_model", out / "best_model")
    assert debris(str(out)) == []


# ---------------------------------------------------------------------------------------------------------------------
# Corrupt and partial checkpoints


def flip_byte(path: str, offset: int = -20) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


DAMAGE = {
    "flipped byte in tensor data": (
        lambda d: flip_byte(os.path.join(d, "state", "__0_0.distcp")),
        "file state/__0_0.distcp fails its checksum",
    ),
    # .metadata is a pickle (torch DCP): the checksum rejects a tampered one before anything unpickles it
    "flipped byte in DCP metadata": (
        lambda d: flip_byte(os.path.join(d, "state", ".metadata"), 10),
        "file state/.metadata fails its checksum",
    ),
    "truncated trainer state": (
        lambda d: open(os.path.join(d, checkpoint.STATE), "r+b").truncate(5),
        "file trainer_state.json has 5 bytes, manifest says",
    ),
    "missing COMPLETE": (
        lambda d: os.remove(os.path.join(d, checkpoint.COMPLETE)),
        "no COMPLETE marker (the save was interrupted)",
    ),
    "garbage manifest": (
        lambda d: open(os.path.join(d, checkpoint.MANIFEST), "w").write("{not json"),
        "unreadable manifest",
    ),
    "missing file": (lambda d: os.remove(os.path.join(d, "state", "__0_0.distcp")), "missing file state/__0_0.distcp"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_skipped_with_its_reason(sft_reference, tmp_path, damage):
    shutil.copytree(sft_reference / "checkpoints", tmp_path / "checkpoints")
    apply, reason = DAMAGE[damage]
    apply(str(tmp_path / "checkpoints" / "step_15"))
    messages = []
    assert checkpoint.find_resume_checkpoint(str(tmp_path), messages.append) == str(
        tmp_path / "checkpoints" / "step_12"
    )
    assert len(messages) == 1 and messages[0].startswith(
        f"skipping checkpoint {tmp_path / 'checkpoints' / 'step_15'}: {reason}"
    )
    with pytest.raises(checkpoint.CheckpointError, match="resume_from_checkpoint"):  # an explicit path is never loaded
        checkpoint.resolve_resume(str(tmp_path / "checkpoints" / "step_15"), str(tmp_path))


def test_explicit_resume_path_that_is_incomplete_exits_2_before_any_model_loads(
    sft_reference, tiny_models, task, tmp_path, capsys, monkeypatch
):
    from open_instruct import models, sft

    shutil.copytree(sft_reference / "checkpoints" / "step_15", tmp_path / "step_15")
    os.remove(tmp_path / "step_15" / checkpoint.COMPLETE)
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    for path, reason in ((tmp_path / "step_15", "no COMPLETE marker"), (tmp_path / "nothing", "is not a folder")):
        with pytest.raises(SystemExit) as e:
            runtime.run(
                sft.main, sft_argv(tiny_models, task, tmp_path / "out") + ["--resume_from_checkpoint", str(path)]
            )
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"resume_from_checkpoint {str(path)!r}" in err and reason in err


@pytest.mark.slow
def test_resume_falls_back_past_a_corrupt_latest_checkpoint_to_the_same_result(
    zygote, sft_reference, tiny_models, task, tmp_path
):
    """End to end: the newest checkpoint has a flipped byte; auto resume says so, takes the previous one, and the
    re-run steps reproduce the uninterrupted run."""
    out = tmp_path / "out"
    os.makedirs(out)
    shutil.copytree(sft_reference / "checkpoints", out / "checkpoints")
    shutil.copy(sft_reference / "metrics.jsonl", out / "metrics.jsonl")
    run = run_dir.read_run(str(sft_reference))  # the run's identity: `auto` resumes its checkpoints only
    run_dir.write_run(str(out), {**run, "finished": False})
    flip_byte(str(out / "checkpoints" / "step_15" / "state" / "__0_0.distcp"))
    run = finished(zygote, "sft", sft_argv(tiny_models, task, out, "--resume_from_checkpoint", "auto"), out)
    assert (
        f"skipping checkpoint {out / 'checkpoints' / 'step_15'}: file state/__0_0.distcp fails its checksum"
        in run.output()
    )
    assert f"resumed from {out / 'checkpoints' / 'step_12'}" in run.output()
    assert_same_rows(read_rows(str(sft_reference)), read_rows(str(out)))
    assert_same_weights(sft_reference / "final_model", out / "final_model")


# ---------------------------------------------------------------------------------------------------------------------
# Full disk, unwritable output folder


@pytest.fixture()
def trained_step(tiny_models):
    """A tiny model + AdamW under a single-process Accelerator, and a function that takes one optimizer step."""
    from accelerate import Accelerator

    from open_instruct.models import load_causal_lm

    accelerator = Accelerator(cpu=True)
    model = load_causal_lm(tiny_models["causal_lm"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(5, 100, (2, 12))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    return accelerator, model, optimizer, step


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_during_checkpoint_save_keeps_the_previous_checkpoint_loadable(trained_step, tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    accelerator, model, optimizer, step = trained_step

    def save(n):
        checkpoint.save_checkpoint(
            str(tmp_path), n, {"policy": model}, {"policy": optimizer}, {"at": n}, accelerator, keep_last=2
        )

    save(1)
    saved = snapshot(model)
    step()

    # (a) the disk fills while tensor data is being written; (b) after everything is written, before the rename
    with monkeypatch.context() as m:
        m.setattr(dcp_fs, "_write_item", enospc)
        with pytest.raises(BaseException) as e:
            save(2)
    # DCP wraps it in a CheckpointException (a BaseException) holding each rank's (exception, traceback)
    assert [f[0].errno for f in e.value.failures.values()] == [errno.ENOSPC]
    monkeypatch.setenv(checkpoint.FAULT_ENV, "checkpoint_write:step_3:enospc")
    with pytest.raises(OSError) as e:
        save(3)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.delenv(checkpoint.FAULT_ENV)

    assert os.listdir(tmp_path / "checkpoints") == ["step_1"]  # no step_2/3, no temp folders
    assert checkpoint.find_resume_checkpoint(str(tmp_path), pytest.fail) == str(tmp_path / "checkpoints" / "step_1")
    assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
    state = checkpoint.load_checkpoint(
        str(tmp_path / "checkpoints" / "step_1"), {"policy": model}, {"policy": optimizer}
    )
    assert state["at"] == 1
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_full_disk_during_final_model_write_keeps_the_previous_copy(trained_step, tmp_path, monkeypatch):
    accelerator, model, optimizer, step = trained_step
    out = str(tmp_path / "final_model")
    checkpoint.save_hf_model(model, None, out, accelerator, {"optimizer_step": 1})
    before = open(os.path.join(out, "model.safetensors"), "rb").read()
    step()

    original = checkpoint.write_streamed_weights  # the writer of a full model's weights (checkpoint.save_hf_model)

    def half_then_full(weights, folder, max_bytes):  # the weights file is half written when the disk fills
        original(weights, folder, max_bytes)
        path = os.path.join(folder, "model.safetensors")
        os.truncate(path, os.path.getsize(path) // 2)
        enospc()

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "write_streamed_weights", half_then_full)
        with pytest.raises(OSError):
            checkpoint.save_hf_model(model, None, out, accelerator, {"optimizer_step": 2})
    monkeypatch.setenv(checkpoint.FAULT_ENV, "final_model_write:enospc")
    with pytest.raises(OSError):
        checkpoint.save_hf_model(model, None, out, accelerator, {"optimizer_step": 3})

    assert checkpoint.validate(out) is None
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["final_model"]


def test_crash_debris_of_an_hf_folder_write_is_cleared_or_restored(trained_step, tmp_path):
    """A process killed inside write_hf_folder leaves a temp copy (cleared by the next write) or, between the two
    renames of a replacement, the previous copy set aside (put back before the next write)."""
    accelerator, model, _, _ = trained_step
    out = tmp_path / "best_model"
    checkpoint.save_hf_model(model, None, str(out), accelerator)
    os.makedirs(tmp_path / ".tmp_best_model_dead")
    os.makedirs(tmp_path / ".old_best_model_dead")
    os.replace(out, tmp_path / ".old_best_model_dead" / "x")  # killed between the renames: no best_model/
    checkpoint._clear_hf_debris(str(out))
    assert sorted(os.listdir(tmp_path)) == ["best_model"] and checkpoint.validate(str(out)) is None


SCRIPTS = {
    "sft": lambda m, t, out: sft_argv(m, t, out),
    "reward_model": lambda m, t, out: rm_argv(m, t, out),
    "dpo": lambda m, t, out: dpo_argv(m, t, out, os.path.dirname(str(out))),
    "rlvr_ppo": lambda m, t, out: rl_argv(m, t, out),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_unwritable_output_dir_exits_2_before_anything_loads(script, tiny_models, task, tmp_path, capsys):
    import importlib

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        runtime.run(
            importlib.import_module(f"open_instruct.{script}").main, SCRIPTS[script](tiny_models, task, blocker / "out")
        )
    assert e.value.code == 2
    assert f"output_dir {str(blocker / 'out')!r} is not writable" in capsys.readouterr().err


def test_metrics_file_torn_by_a_crash_is_cut_back_on_resume_and_rewritten_atomically(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from open_instruct import tracking

    path = tmp_path / "metrics.jsonl"
    rows = [{"optimizer_step": i, "train/loss": 1.0 / i} for i in range(1, 7)]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"optimizer_step": 7, "train/lo'
    )  # killed mid-append
    cfg = SimpleNamespace(output_dir=str(tmp_path), with_tracking=False)

    with monkeypatch.context() as m:  # a full disk during the rewrite leaves the file as it was, and no temp file
        m.setattr(tracking.os, "fsync", enospc)
        with pytest.raises(OSError):
            tracking.MetricsLogger(cfg, True, 10, resume_step=4)
    assert path.read_text().startswith(json.dumps(rows[0])) and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]

    logger = tracking.MetricsLogger(cfg, True, 10, resume_step=4)  # resumed from checkpoint step 4
    logger.log({"optimizer_step": 5, "train/loss": float("nan")})
    logger.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4] + [
        {"optimizer_step": 5, "train/loss": "nan"}
    ]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_dpo_reference_cache_is_never_half_written_and_a_damaged_one_is_recomputed(tmp_path, monkeypatch):
    import safetensors.torch

    from open_instruct import reference_cache

    path = str(tmp_path / "cache" / "ref_logps_x.safetensors")
    tables = {"train": {"chosen_logps": torch.tensor([-1.0, -2.0]), "rejected_logps": torch.tensor([-3.0, -4.0])}}
    original = safetensors.torch.save_file

    def half_then_full(tensors, filename, metadata=None):
        original(tensors, filename, metadata)
        os.truncate(filename, os.path.getsize(filename) // 2)
        enospc()

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", half_then_full)
        with pytest.raises(OSError):
            reference_cache.write_reference_cache(path, tables, {"k": 1})
    assert os.listdir(tmp_path / "cache") == []  # neither the target nor a temp file

    reference_cache.write_reference_cache(path, tables, {"k": 1})
    os.truncate(path, os.path.getsize(path) - 7)  # damaged later (e.g. a partial copy between machines)
    messages = []
    assert reference_cache.read_reference_cache(path, {"train": []}, messages.append) is None
    assert messages and "is unreadable" in messages[0] and "recomputing" in messages[0]


# ---------------------------------------------------------------------------------------------------------------------
# Numerical faults


def nan_in_training(monkeypatch, module, name: str, at_call: int, poison):
    """Make module.name's output NaN (through the autograd graph, so the gradients are NaN too) on its at_call-th
    call with gradients enabled (a training forward; eval and rollout forwards run under no_grad)."""
    original, calls = getattr(module, name), {"n": 0}

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == at_call:
                return poison(out)
        return out

    monkeypatch.setattr(module, name, wrapped)


# 8 steps of 4, a checkpoint after every step.
SHORT_RUN = "--max_train_samples 32 --per_device_train_batch_size 4 --gradient_accumulation_steps 1".split()
SHORT_RUN += ["--checkpointing_steps", "1", "--keep_last_n_checkpoints", "10", "--eval_steps", "8"]


def short_sft(models, task, out, *extra):
    return sft_argv(models, task, out, *SHORT_RUN, *extra)


NAN_CASES = {
    "sft": (lambda m, t, out: short_sft(m, t, out), "token_loss_sum", lambda out: (out[0] * float("nan"), out[1])),
    "reward_model": (
        lambda m, t, out: rm_argv(m, t, out, *SHORT_RUN),
        "models.pair_rewards",
        lambda out: (out[0] * float("nan"), out[1]),
    ),
}


@pytest.mark.parametrize("script", list(NAN_CASES))
def test_nan_loss_stops_naming_the_step_and_saves_nothing_after_it(
    script, tiny_models, task, tmp_path, monkeypatch, capsys
):
    import importlib

    module = importlib.import_module(f"open_instruct.{script}")
    argv, name, poison = NAN_CASES[script]
    if "." in name:  # a shared module's function, imported by the script inside main
        owner, name = name.split(".")
        nan_in_training(monkeypatch, importlib.import_module(f"open_instruct.{owner}"), name, 3, poison)
    else:
        nan_in_training(monkeypatch, module, name, 3, poison)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        runtime.run(module.main, argv(tiny_models, task, out))
    assert e.value.code == errors.EXIT_NONFINITE
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "NonFiniteError: non-finite loss/gradient (loss=nan, grad_norm=nan) at optimizer step 3; stopping "
            "without saving"
        )
    )
    assert step_dirs(out) == ["step_1", "step_2"] and not (out / "final_model").exists()
    assert max_counter(out) == 2


def read_dcp(path: str, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = str(tmp_path / f"{os.path.basename(path)}.pt")
    dcp_to_torch_save(os.path.join(path, "state"), target)
    return torch.load(target, weights_only=True)


def flat_tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat_tensors(sub, f"{prefix}/{key}").items()}
    return {}


def test_on_nonfinite_skip_skips_exactly_that_update_and_training_goes_on(tiny_models, task, tmp_path, monkeypatch):
    from open_instruct import sft

    nan_in_training(monkeypatch, sft, "token_loss_sum", 3, NAN_CASES["sft"][2])
    out = tmp_path / "out"
    sft.main(short_sft(tiny_models, task, out, "--on_nonfinite", "skip"))

    train = [r for r in read_rows(str(out)) if "train/loss" in r]
    assert [r["train/skipped_update"] for r in train] == [0, 0, 1, 0, 0, 0, 0, 0]
    assert train[2]["train/loss"] == "nan" and all(math.isfinite(r["train/loss"]) for r in train[3:])
    assert train[-1]["train/loss"] < train[0]["train/loss"]  # it kept learning after the bad step
    # The skipped step changed no weight and no optimizer moment; the next one did.
    s2, s3, s4 = (flat_tensors(read_dcp(str(out / "checkpoints" / f"step_{n}"), tmp_path)) for n in (2, 3, 4))
    assert s2.keys() == s3.keys() and any("optim" in k for k in s2)
    assert all(torch.equal(s2[k], s3[k]) for k in s2)
    assert not all(torch.equal(s3[k], s4[k]) for k in s3 if k.startswith("/model"))
    from safetensors.torch import load_file

    assert all(torch.isfinite(v).all() for v in load_file(str(out / "final_model" / "model.safetensors")).values())


def test_rlvr_skip_counts_the_skipped_ppo_update(tiny_models, task, tmp_path, monkeypatch):
    from open_instruct import rlvr_ppo

    # training forwards: 2 mini-batches per rollout, so call 3 is rollout 2's first PPO update
    nan_in_training(monkeypatch, rlvr_ppo, "response_scores", 3, lambda out: out._replace(logp=out.logp * float("nan")))
    out = tmp_path / "out"
    rlvr_ppo.main(rl_argv(tiny_models, task, out, "--on_nonfinite", "skip", "--total_episodes", "32"))
    train = [r for r in read_rows(str(out)) if "train/skipped_updates" in r]
    assert [r["train/skipped_updates"] for r in train] == [0, 1, 0, 0]
    from safetensors.torch import load_file

    assert all(torch.isfinite(v).all() for v in load_file(str(out / "final_model" / "model.safetensors")).values())


def test_infinite_learning_rate_is_a_config_error(tiny_models, task, tmp_path, capsys):
    from open_instruct import sft

    with pytest.raises(SystemExit) as e:
        runtime.run(sft.main, short_sft(tiny_models, task, tmp_path / "out", "--learning_rate", "inf"))
    assert e.value.code == 2 and "learning_rate must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, what, saved",
    [
        # finite but huge weights after step 1; the step-2 forward overflows
        (
            ["--learning_rate", "1e30"],
            "non-finite loss/gradient (loss=nan, grad_norm=nan) at optimizer step 2",
            ["step_1"],
        )
    ],
    ids=["1e30"],
)
def test_overflowing_learning_rate_stops_without_a_poisoned_checkpoint(
    extra, what, saved, tiny_models, task, tmp_path, capsys
):
    from open_instruct import sft

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        runtime.run(sft.main, short_sft(tiny_models, task, out, "--lr_scheduler_type", "constant", *extra))
    assert e.value.code == errors.EXIT_NONFINITE
    assert what in capsys.readouterr().err
    assert (step_dirs(out) if (out / "checkpoints").exists() else []) == saved
    assert not (out / "final_model").exists() and not (out / "best_model").exists()
    for name in saved:
        assert all(
            torch.isfinite(v).all()
            for k, v in flat_tensors(read_dcp(str(out / "checkpoints" / name), tmp_path)).items()
            if k.startswith("/model")
        )


# ---------------------------------------------------------------------------------------------------------------------
# Bad data through each script's entry point


def chat(user="What is 2+2?", reply="4"):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


BAD_DATA = {
    # script, train rows (bytes are written as they are), where the eval file is bad instead, expected message
    "sft non-UTF-8": (
        "sft",
        [{"id": 1, "messages": chat()}, b'{"id": 2, "messages": "\xff\xfe"}\n'],
        False,
        "{path} line 2: not valid UTF-8",
    ),
    "sft empty file": ("sft", [], False, "dataset '{path}' (split 'train') is empty"),
    "sft empty messages": (
        "sft",
        [{"id": 1, "messages": chat()}, {"id": 2, "messages": []}],
        False,
        "{path} line 2: column 'messages' is an empty conversation",
    ),
    "rm all rows over-long": (
        "reward_model",
        [{"id": 1, "chosen": chat(reply="x" * 300), "rejected": chat(reply="y" * 300)}],
        False,
        "dataset '{path}': no usable rows (0/1 rows kept: 0 bad, 1 dropped as over-long",
    ),
    "dpo duplicate ids": (
        "dpo",
        [{"id": 7, "chosen": chat(), "rejected": chat(reply="5")}] * 2,
        False,
        "{path} line 2: duplicate id 7 (first at {path} line 1)",
    ),
    "dpo bad eval file": ("dpo", [b'{"id": 1, "chosen": [}\n'], True, "{path} line 1: not valid JSON"),
    "rlvr wrong column": (
        "rlvr_ppo",
        [{"id": 1, "messages": chat()[:1], "answer": "4", "dataset": "arithmetic"}],
        False,
        "{path} line 1: RL prompt column(s) ['ground_truth'] not found; columns are ['answer', 'dataset', 'id', "
        "'messages']",
    ),
    "rlvr no prompt turn": (
        "rlvr_ppo",
        [{"id": 1, "messages": [{"role": "assistant", "content": "4"}], "ground_truth": "4", "dataset": "arithmetic"}],
        False,
        "{path} line 1: column 'messages' has no prompt turn",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_exits_2_naming_file_and_row_before_any_model_loads(
    case, tiny_models, task, tmp_path, monkeypatch, capsys
):
    import importlib

    from open_instruct import models

    script, lines, in_eval, message = BAD_DATA[case]
    path = str(tmp_path / "bad.jsonl")
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
    for loader in ("load_causal_lm", "load_sequence_classifier"):
        monkeypatch.setattr(
            models, loader, lambda *a, **k: pytest.fail("a model was loaded before the data was checked")
        )
    out = tmp_path / "out"
    argv = SCRIPTS[script](tiny_models, task, out) + ["--max_seq_length", "128"] * (script != "rlvr_ppo")
    argv += ["--eval_dataset_name_or_path" if in_eval else "--dataset_name_or_path", path]
    with pytest.raises(SystemExit) as e:
        runtime.run(importlib.import_module(f"open_instruct.{script}").main, argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("DataError: " + message.format(path=path)), last
    assert not (out / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Hostile model output through the RLVR reward pipeline


def rlvr_scores(texts, ground_truths, verifiers, stopped, rm_scores, cfg):
    """What rlvr_ppo.main does with a rollout: rewards.score_batch, then combine_rewards per episode (the sequence
    score, rlvr_ppo.sequence_scores_of)."""
    from open_instruct import rewards

    scored = rewards.score_batch(
        texts, ground_truths, verifiers, verification_reward=cfg["verification_reward"], timeout=0.5
    )
    return scored, [
        rewards.combine_rewards(v, s, cfg["non_stop_penalty"], rm, cfg["rm_multiplier"])
        for v, s, rm in zip(scored.rewards, stopped, rm_scores)
    ]


GROUND_TRUTHS = [
    ("arithmetic", "7"),
    ("gsm8k", "1,000"),
    ("math", "\\frac{1}{2}"),
    ("ifeval", json.dumps({"func_name": "validate_lowercase"})),
    ("allenai/GSM8K_train", 42),
]


def test_reward_pipeline_survives_arbitrary_model_text():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    adversarial = st.sampled_from(
        [
            "",
            "\x00" * 50,
            "\\boxed{" * 200,
            "9" * 5000,
            "1e999999",
            "nan",
            "-inf",
            "\\frac{1}{0}",
            "</think>" * 30,
            "__import__('os').system('true')",
            "\\boxed{__import__('os')}",
            "```python\nimport os\n```",
            "{{7*7}}",
            "\ud800",
            "(" * 3000 + ")" * 3000,
            "x**9**9**9",
            "$$\\int_0^\\infty e^{-x^2}dx$$",
            "#### 1,000",
            "7" + " " * 20000,
        ]
    )
    text = st.one_of(
        st.text(max_size=300), adversarial, st.builds(lambda a, b: a + b, adversarial, st.text(max_size=40))
    )

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        episodes=st.lists(
            st.tuples(
                text,
                st.sampled_from(GROUND_TRUTHS),
                st.booleans(),
                st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6),
            ),
            min_size=1,
            max_size=4,
        ),
        cfg=st.fixed_dictionaries(
            {
                "verification_reward": st.sampled_from([1.0, 10.0]),
                "non_stop_penalty": st.sampled_from([0.0, -1.0, -10.0]),
                "rm_multiplier": st.sampled_from([0.0, 0.5]),
            }
        ),
    )
    def check(episodes, cfg):
        texts = [t for t, _, _, _ in episodes]
        scored, scores = rlvr_scores(
            texts,
            [gt for _, (_, gt), _, _ in episodes],
            [v for _, (v, _), _, _ in episodes],
            [s for _, _, s, _ in episodes],
            [rm for *_, rm in episodes],
            cfg,
        )
        assert len(scores) == len(texts)
        for reward, correct, (_, _, stopped, rm), score in zip(scored.rewards, scored.correct, episodes, scores):
            assert reward == (cfg["verification_reward"] if correct else 0.0)
            expected = reward + cfg["rm_multiplier"] * rm + (0.0 if stopped else cfg["non_stop_penalty"])
            assert math.isfinite(score) and score == pytest.approx(expected)

    check()


@pytest.mark.parametrize("verifier, gt", GROUND_TRUTHS[:4])
def test_model_text_is_never_executed(verifier, gt, tmp_path):
    canary = tmp_path / "pwned"
    payloads = [
        f"__import__('pathlib').Path({str(canary)!r}).touch()",
        f"exec(\"open({str(canary)!r}, 'w')\")",
        f"\\boxed{{__import__('pathlib').Path({str(canary)!r}).touch()}}",
        f"#### eval(\"open({str(canary)!r},'w')\")",
    ]
    _, scores = rlvr_scores(
        payloads,
        [gt] * 4,
        [verifier] * 4,
        [True] * 4,
        [0.0] * 4,
        {"verification_reward": 10.0, "non_stop_penalty": 0.0, "rm_multiplier": 0.0},
    )
    assert not canary.exists()
    assert all(score in (0.0, 10.0) for score in scores)


# ---------------------------------------------------------------------------------------------------------------------
# Safe loading


def test_trust_remote_code_is_off_unless_asked():
    import yaml

    from open_instruct.config import DPOConfig, RewardModelConfig, RLVRConfig, SFTConfig

    for cls in (SFTConfig, RewardModelConfig, DPOConfig, RLVRConfig):
        field = cls.__dataclass_fields__["trust_remote_code"]
        assert field.default is False, cls.__name__
    for path in glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True):
        with open(path) as f:
            assert (yaml.safe_load(f) or {}).get("trust_remote_code", False) is False, path


def test_every_model_and_tokenizer_load_in_the_scripts_passes_the_config_flag():
    """Each load_* / from_pretrained call in the four scripts hands over cfg.trust_remote_code (never a literal)."""
    loaders = {"load_tokenizer", "load_causal_lm", "load_sequence_classifier", "from_pretrained"}
    for script in ("sft", "reward_model", "dpo", "rlvr_ppo"):
        with open(os.path.join(REPO, "open_instruct", f"{script}.py")) as f:
            tree = ast.parse(f.read())
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) in loaders
        ]
        assert calls, script
        for call in calls:
            assert "cfg.trust_remote_code" in ast.unparse(call), f"{script}.py line {call.lineno}: {ast.unparse(call)}"


def test_loaders_pass_trust_remote_code_and_prefer_safetensors(tiny_models, monkeypatch):
    import transformers

    from open_instruct import models

    seen = []
    for cls in (
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForSequenceClassification,
        transformers.AutoTokenizer,
    ):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code"), kwargs.get("use_safetensors", "absent")))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    models.load_tokenizer(tiny_models["causal_lm"])
    models.load_causal_lm(tiny_models["causal_lm"])
    models.load_sequence_classifier(tiny_models["seq_cls"], trust_remote_code=True)
    assert [(name, trust) for name, trust, _ in seen] == [
        ("AutoTokenizer", False),
        ("AutoModelForCausalLM", False),
        ("AutoModelForSequenceClassification", True),
    ]
    assert all(use in (None, True) for name, _, use in seen if name != "AutoTokenizer")  # never use_safetensors=False


class _Canary:
    """Unpickling this creates a file: the proof that a pickle was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_planted_in_a_model_folder_is_never_executed(tiny_models, tmp_path):
    import pickle

    from open_instruct.models import load_causal_lm

    canary = str(tmp_path / "pwned")
    beside = tmp_path / "with_safetensors"
    shutil.copytree(tiny_models["causal_lm"], beside)
    for folder in (beside, tmp_path / "pickle_only"):
        os.makedirs(folder, exist_ok=True)
        with open(folder / "pytorch_model.bin", "wb") as f:
            pickle.dump({"model.embed_tokens.weight": _Canary(canary)}, f)
    load_causal_lm(str(beside))  # safetensors wins over the pickle next to it
    shutil.copy(os.path.join(tiny_models["causal_lm"], "config.json"), tmp_path / "pickle_only")
    with pytest.raises(Exception):
        load_causal_lm(str(tmp_path / "pickle_only"))  # refused: not unpickled with arbitrary globals
    assert not os.path.exists(canary)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def test_final_and_best_models_hold_no_pickle_and_checkpoint_pickles_are_checksummed(sft_reference):
    for folder in ("final_model", "best_model"):
        names = os.listdir(sft_reference / folder)
        assert "model.safetensors" in names
        assert all(
            n.endswith((".safetensors", ".json", ".jinja", ".txt")) or n == checkpoint.COMPLETE for n in names
        ), names
    for step in step_dirs(sft_reference):
        folder = sft_reference / "checkpoints" / step
        files = {os.path.relpath(os.path.join(r, n), folder) for r, _, ns in os.walk(folder) for n in ns}
        assert not any(f.endswith(PICKLE_SUFFIXES) for f in files), files
        # torch DCP's own formats: .metadata is a pickle and .distcp holds torch.save'd tensors. Both are listed in
        # the manifest with a sha256, which validate() checks before anything is unpickled.
        with open(folder / checkpoint.MANIFEST) as f:
            manifest = json.load(f)["files"]
        dcp_files = {f for f in files if f.startswith("state/")}
        assert dcp_files and all("sha256" in manifest[f] for f in dcp_files)


def test_no_torch_load_without_weights_only_in_the_repo():
    offenders = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("output", "__pycache__", "node_modules")]
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                    flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                    if not (isinstance(flag, ast.Constant) and flag.value is True):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert offenders == [], f"torch.load without weights_only=True: {offenders}"


def test_a_resume_removes_the_temp_file_of_a_metrics_rewrite_killed_midway(tmp_path):
    """A SIGKILL inside the resume's atomic rewrite of metrics.jsonl leaves `.tmp_metrics.jsonl_*`; the next resume
    deletes it, keeps the rows up to its step and leaves other files alone."""
    from types import SimpleNamespace

    from open_instruct.tracking import MetricsLogger

    out = tmp_path / "run"
    out.mkdir()
    rows = [{"optimizer_step": s, "loss": s / 10} for s in (1, 2, 3)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / ".tmp_metrics.jsonl_k1ll3d").write_text('{"optimizer_step": 1')  # the killed rewrite's half file
    (out / "notes.txt").write_text("mine")
    cfg = SimpleNamespace(output_dir=str(out), with_tracking=False)
    logger = MetricsLogger(cfg, is_main=True, total_steps=3, resume_step=2)
    logger.bar.close()
    assert debris(str(out)) == []
    assert [r["optimizer_step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"


def test_an_atomic_write_removes_its_own_path_s_killed_temp_file_only(tmp_path):
    """run.json and config.yaml go through the same atomic write: a SIGKILLed write's temp file of that path is gone
    after the next write of it, while another file's temp file stays until that file is written."""
    from open_instruct import run_dir

    (tmp_path / ".tmp_config.yaml_k1ll3d").write_text("resolved: half")
    (tmp_path / ".tmp_run.json_k1ll3d").write_text('{"run_id"')
    run_dir.write_text_atomic(str(tmp_path / "config.yaml"), "seed: 1\n")
    assert sorted(os.listdir(tmp_path)) == [".tmp_run.json_k1ll3d", "config.yaml"]
    assert (tmp_path / "config.yaml").read_text() == "seed: 1\n"
