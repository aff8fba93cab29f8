"""Who owns an output folder: one run at a time, never two runs' files mixed, `auto` resumes only its own run.

    <output_dir>/run.json    this run's identity, written when it first starts: run_id, script, start time, command;
                             `finished` set once final_model is written. Checkpoints record the same run_id.
    <output_dir>/.lock       held while a run uses the folder: pid, host and the process start time. A lock whose
                             process is gone (same host) is stale and taken over; a live one makes a second run
                             exit 2.

`claim` (called by `runtime.start` on the main process, before any model loads) decides what a start may do:

    folder empty (or absent)                 a new run: run.json written
    holds a run, no resume flag              exit 2, naming what is there and the ways forward
    holds a run, --resume_from_checkpoint    continue that run (its run_id); if it already finished: exit 0, nothing
        auto                                 touched; a run of another script (run.json's `script`): exit 2
    --overwrite_output_dir true              a new run; the old run's files go first: a finished run (final_model/)
                                             is moved aside to <output_dir>.replaced-<time> (one console line), an
                                             unfinished one deleted; --delete_finished_run true deletes a finished
                                             run too. `runtime.start` claims only after every start check passed.

Imports only the standard library (start-up code: no torch)."""

from __future__ import annotations

import atexit
import errno
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from open_instruct.errors import ConfigError

FAULT_ENV = "OPEN_INSTRUCT_FAULT"
_stopped_at: set[str] = set()


def fault_point(name: str, step: Optional[int] = None) -> None:
    """Testing hook, inert unless the environment asks: OPEN_INSTRUCT_FAULT=<name>[:step_<N>][:enospc|:stop] makes
    the process SIGKILL itself on reaching fault point <name> (at step N only, when given); with `enospc` it raises
    "No space left on device" instead; with `stop` it SIGSTOPs itself, once, so that a test acts on it at exactly
    this point (signal, kill, look at its files) and then SIGCONTs it: no race with the scheduler.
    Points: checkpoint_state (model/optimizer state written, no manifest yet), checkpoint_write (checkpoint complete
    in its temp folder, not yet renamed), checkpoint_prune (renamed into place, older ones not yet pruned),
    <folder>_write (an HF folder such as final_model complete in its temp folder, not yet moved into place),
    weight_sync (a generator's weights are being updated), metrics_row (a row of metrics.jsonl written; N is the
    row's counter). tests/test_reliability.py crashes runs at these points."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] != name or any(p.startswith("step_") and p != f"step_{step}" for p in parts[1:]):
        return
    if "enospc" in parts[1:]:
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAULT_ENV}={spec})")
    if "stop" in parts[1:]:
        if spec not in _stopped_at:
            _stopped_at.add(spec)
            os.kill(os.getpid(), signal.SIGSTOP)
        return
    os.kill(os.getpid(), signal.SIGKILL)


RUN_FILE = "run.json"
LOCK_FILE = ".lock"
# What a run writes into its output folder (removed by --overwrite_output_dir; anything else is left alone).
CONFIG_FILE = "config.yaml"  # the resolved config of the run's latest start (write_config)
RUN_FILES = (
    "metrics.jsonl",
    "samples.jsonl",
    "checkpoints",
    "final_model",
    "best_model",
    RUN_FILE,
    CONFIG_FILE,
    ".wandb_run_id",
)
RUN_DEBRIS_PREFIXES = (".tmp_", ".old_")  # temp files and folders of interrupted writes (checkpoint.py, tracking.py)


# ---------------------------------------------------------------------------------------------------------------------
# Folder permissions: what the user's umask allows (tempfile.mkdtemp/mkstemp create 0700/0600 whatever the umask)


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask can only be read by setting it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str) -> None:
    """Give a folder (or file) made by tempfile the mode a plain mkdir (open) would have given it."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~current_umask())


def apply_umask_tree(folder: str) -> None:
    """apply_umask on a folder and everything in it (some writers, e.g. safetensors, create files 0600)."""
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            apply_umask(os.path.join(root, name))
    apply_umask(folder)


def make_temp_dir(prefix: str, parent: str) -> str:
    """tempfile.mkdtemp with the user's umask instead of 0700, so teammates can read what is renamed into place."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    apply_umask(path)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# run.json


def read_run(output_dir: str) -> Optional[dict[str, Any]]:
    """This folder's run record, or None when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(output_dir, RUN_FILE)) as f:
            run = json.load(f)
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) and "run_id" in run else None


def run_id_of(output_dir: str) -> Optional[str]:
    run = read_run(output_dir)
    return run["run_id"] if run else None


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` atomically (temp file beside it + fsync + rename): a crash or a full disk leaves the old
    file or the new one, never half of one. The temp file a SIGKILL leaves (never read) is deleted by the next write
    of the same path, as write_hf_folder clears its own; every caller writes from the main process of a claimed run
    folder, so no other writer's temp file is in flight. The file gets the user's umask (mkstemp makes it 0600)."""
    folder, prefix = os.path.dirname(os.path.abspath(path)), f".tmp_{os.path.basename(path)}_"
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith(prefix):
            os.remove(os.path.join(folder, name))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_run(output_dir: str, run: dict[str, Any]) -> None:
    """Atomic: a crash leaves the old record or the new one, never half of one."""
    write_text_atomic(os.path.join(output_dir, RUN_FILE), json.dumps(run, indent=1))


def write_config(output_dir: str, text: str) -> None:
    """<output_dir>/config.yaml: this start's resolved config (`config.config_yaml`), written atomically (temp file +
    rename) after the folder was claimed for this run (run_dir.claim), so it never replaces another run's. A resume
    rewrites it with the settings it resumed with."""
    header = f"# resolved config of run {run_id_of(output_dir)}, written {_now()}\n"
    write_text_atomic(os.path.join(output_dir, CONFIG_FILE), header + text)


def mark_finished(output_dir: str, counters: dict[str, Any]) -> None:
    """Record that the run ended normally (final model written): `auto` then finds nothing left to do."""
    run = read_run(output_dir)
    if run is not None:
        write_run(output_dir, {**run, "finished": True, "finished_at": _now(), "final_counters": counters})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------------------------------------------------------------
# What is in the folder


def run_files(output_dir: str) -> list[str]:
    """The results of a run present in `output_dir`, for messages: metrics, samples, checkpoints (an empty
    checkpoints/ folder does not count), final and best model. run.json alone is not a result: a run that stopped
    before producing any (a bad dataset row, a crash while loading) does not block the next start."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in RUN_FILES:
        if name in (RUN_FILE, CONFIG_FILE, ".wandb_run_id"):
            continue
        path = os.path.join(output_dir, name)
        if name == "checkpoints" and os.path.isdir(path):
            steps = sorted(n for n in os.listdir(path) if n.startswith("step_"))
            if steps:
                found.append(f"checkpoints/ ({', '.join(steps)})")
        elif os.path.isdir(path):
            found.append(name + "/")
        elif os.path.exists(path):
            found.append(name)
    return found


def _run_file_names(output_dir: str) -> list[str]:
    """A run's files in the folder (and the debris of its interrupted writes), nothing else the folder holds."""
    return [
        name
        for name in sorted(os.listdir(output_dir))
        if name in RUN_FILES or name == "wandb" or name.startswith(RUN_DEBRIS_PREFIXES)
    ]


def remove_run_files(output_dir: str) -> None:
    """Delete a previous run's files (and the debris of its interrupted writes), nothing else in the folder."""
    for name in _run_file_names(output_dir):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def move_run_files_aside(output_dir: str) -> str:
    """Move a previous run's files (as remove_run_files would delete them) into a new sibling folder
    <output_dir>.replaced-<UTC time>; returns its path. Renames on one file system: nothing is copied."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = f"{os.path.abspath(output_dir).rstrip(os.sep)}.replaced-{stamp}"
    aside, n = base, 1
    while os.path.exists(aside):  # two replacements within a second
        aside, n = f"{base}-{n}", n + 1
    os.makedirs(aside)
    for name in _run_file_names(output_dir):
        os.replace(os.path.join(output_dir, name), os.path.join(aside, name))
    return aside


def clear_for_new_run(output_dir: str, delete_finished: bool) -> None:
    """What --overwrite_output_dir does to the run in the folder: a finished run (its final_model/ present) is moved
    aside, said in one line, unless `delete_finished`; anything else is deleted."""
    finished = os.path.isdir(os.path.join(output_dir, "final_model"))
    if finished and not delete_finished:
        aside = move_run_files_aside(output_dir)
        print(
            f"overwrite_output_dir: the finished run in {output_dir} was moved to {aside} (--delete_finished_run "
            "true deletes it instead)"
        )
    else:
        if finished:  # asked for: said, since nothing of it is kept
            print(f"overwrite_output_dir: --delete_finished_run true: deleting the finished run in {output_dir}")
        remove_run_files(output_dir)


def how_to_train_further(output_dir: str, checkpoints: list[tuple[int, str]]) -> str:
    """The hint for a finished run's folder: resume from the checkpoints it has, or start from its final model
    when it kept none (a run that never checkpointed must not be told to resume one)."""
    if checkpoints:
        step, newest = checkpoints[-1]
        start = (
            f"start a new run from one of its checkpoints (another --output_dir, --resume_from_checkpoint {newest} "
            "or an older one, and --allow_resume_changes naming what you change, e.g. total_episodes)"
        )
    else:
        start = (
            "it kept no checkpoints: start a new run from its final model (another --output_dir, "
            f"--model_name_or_path {os.path.join(output_dir, 'final_model')})"
        )
    return f"To train further, {start}; --overwrite_output_dir true starts this one over."


# ---------------------------------------------------------------------------------------------------------------------
# The lock


def _proc_stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (Linux): [0] the state, [19] the start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start_time(pid: int) -> Optional[str]:
    """Start time of a process in clock ticks since boot, to tell a live owner from a reused pid."""
    stat = _proc_stat(pid)
    return stat[19] if stat and len(stat) > 19 else None


def _alive(pid: int, start_time: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    stat = _proc_stat(pid)
    if stat is None:  # no /proc: trust kill(0)
        return True
    return stat[0] != "Z" and (start_time is None or _process_start_time(pid) == start_time)  # Z: dead, not reaped


@dataclass
class Lock:
    path: str
    token: str

    def release(self) -> None:
        """Remove the lock file if it is still ours (never another run's)."""
        try:
            with open(self.path) as f:
                if json.load(f).get("token") != self.token:
                    return
            os.remove(self.path)
        except (OSError, ValueError):
            pass
        if self in _held:
            _held.remove(self)


_held: list[Lock] = []


def release_all() -> None:
    """Release every lock this process holds (runtime.run calls it on the way out; atexit too)."""
    for lock in list(_held):
        lock.release()


atexit.register(release_all)


def acquire_lock(output_dir: str) -> Lock:
    """Take <output_dir>/.lock, or exit 2 (ConfigError) naming the run that holds it. A lock left by a process that
    no longer exists on this host (killed, crashed) is stale and taken over; so is one left by this very process (a
    previous in-process run, e.g. in tests or a notebook)."""
    path = os.path.join(output_dir, LOCK_FILE)
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start_time": _process_start_time(os.getpid()),
        "started_at": _now(),
        "token": uuid.uuid4().hex,
        "command": sys.argv,
    }
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None and _age_seconds(path) < 5:  # just created by a run that is writing it right now
                holder = {"pid": "?", "host": "?", "started_at": "just now"}
            if holder is not None and not _stale(holder, me):
                raise ConfigError(
                    f"output_dir {output_dir!r} is in use by another run (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {holder.get('started_at')}): two runs must not write one folder. "
                    f"Wait for it, use another --output_dir, or delete {path} if that run is gone"
                ) from None
            try:
                os.remove(path)  # stale (its process is gone) or unreadable (torn by a crash mid-write)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        lock = Lock(path, me["token"])
        _held.append(lock)
        return lock
    raise ConfigError(f"output_dir {output_dir!r}: could not take the lock {path} (another run is starting there?)")


def _read_lock(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _age_seconds(path: str) -> float:
    try:
        return time.time() - os.path.getmtime(path)
    except OSError:
        return float("inf")


def _stale(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    if holder.get("host") != me["host"]:
        return False  # cannot see another machine's processes: only the user can say it is gone
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == me["pid"]:  # unreadable, or left by this very process
        return True
    return not _alive(pid, holder.get("start_time"))


# ---------------------------------------------------------------------------------------------------------------------
# Claiming the folder at start


@dataclass
class Claim:
    """What `claim` decided: the run id, whether the folder's run is to be continued, whether it already finished."""

    run_id: str
    resuming: bool
    finished: bool
    lock: Lock


def _ways_forward(output_dir: str, what: str) -> str:
    return (
        f"output_dir {output_dir!r} holds {what}; not starting a new run over it. Either:\n"
        "  --resume_from_checkpoint auto   continue that run (if it finished: nothing to do)\n"
        "  --overwrite_output_dir true     start a new run here (a finished run is moved aside, an unfinished one "
        "deleted)\n"
        "  --output_dir <another folder>   keep them and start elsewhere"
    )


def describe(run: Optional[dict[str, Any]], files: list[str]) -> str:
    """'run 1a2b (sft, started ..., finished): metrics.jsonl, final_model/' for messages."""
    if run is None:
        return f"files of a run with no {RUN_FILE} (an unknown or older run): {', '.join(files)}"
    state = "finished" if run.get("finished") else "not finished"
    head = f"run {run['run_id']} ({run.get('script', '?')}, started {run.get('started_at', '?')}, {state})"
    return f"{head}: {', '.join(files)}"


def claim(
    output_dir: str,
    script: str,
    resume_from_checkpoint: Optional[str],
    overwrite: bool,
    checkpoint_run_id: Callable[[], Optional[str]],
    delete_finished: bool = False,
) -> Claim:
    """Lock the folder and decide whose run this is (see the module docstring). `checkpoint_run_id` is a callable
    returning the run id recorded in an explicit resume checkpoint (None for older checkpoints). Raises ConfigError
    (exit 2) with the ways forward when the folder holds another run's files."""
    os.makedirs(output_dir, exist_ok=True)
    lock = acquire_lock(output_dir)
    try:
        run, files = read_run(output_dir), run_files(output_dir)
        explicit = resume_from_checkpoint not in (None, "", "auto")
        if overwrite:
            if resume_from_checkpoint == "auto" or (
                explicit and _inside(resume_from_checkpoint, os.path.join(output_dir, "checkpoints"))
            ):
                raise ConfigError(
                    "overwrite_output_dir deletes this folder's checkpoints: it cannot be combined with "
                    f"resume_from_checkpoint {resume_from_checkpoint!r} from the same folder"
                )
            clear_for_new_run(output_dir, delete_finished)
            run, files = None, []
        if run is not None and not files and run.get("script", script) != script:
            run = None  # only the run.json of another script's run that produced nothing: no run to continue
        if resume_from_checkpoint == "auto":
            if files and run is None:
                raise ConfigError(_ways_forward(output_dir, describe(run, files)))
            if run is not None:
                check_same_script(output_dir, run, script)
                return Claim(run["run_id"], True, bool(run.get("finished")), lock)
        elif explicit:
            run_id = checkpoint_run_id() or uuid.uuid4().hex[:12]
            if files and (run is None or run["run_id"] != run_id):
                raise ConfigError(
                    _ways_forward(output_dir, describe(run, files))
                    + f"\n(the checkpoint {resume_from_checkpoint!r} belongs to run {run_id})"
                )
            if run is None:
                _start_run(output_dir, run_id, script)
            else:
                check_same_script(output_dir, run, script)
            return Claim(run_id, True, False, lock)  # explicit: resumed even if the run had finished
        elif files:
            raise ConfigError(_ways_forward(output_dir, describe(run, files)))
        run_id = uuid.uuid4().hex[:12]
        _start_run(output_dir, run_id, script)
        return Claim(run_id, False, False, lock)
    except BaseException:
        lock.release()
        raise


def check_same_script(output_dir: str, run: dict[str, Any], script: str) -> None:
    """A run is continued only by the script that started it: an SFT run must not adopt a DPO run's folder (it would
    replace that run's metrics and models). ConfigError (exit 2) naming both, before anything in the folder changes."""
    found = run.get("script")
    if found and found != script:
        raise ConfigError(
            f"output_dir {output_dir!r} holds run {run['run_id']} of script {found!r} (its {RUN_FILE}), not "
            f"{script!r}: --resume_from_checkpoint continues a run with the script that started it. Run {found} "
            "to continue it, or start this one elsewhere (another --output_dir; --overwrite_output_dir true replaces "
            "that run: moved aside if finished, else deleted)"
        )


def _start_run(output_dir: str, run_id: str, script: str) -> None:
    write_run(
        output_dir,
        {"run_id": run_id, "script": script, "started_at": _now(), "host": socket.gethostname(), "command": sys.argv},
    )


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)
