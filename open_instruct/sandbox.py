"""Run untrusted (model-written) Python in a fresh, limited subprocess: the `code` verifier and the `python` tool.

One call = one `python -I -S` process, started through open_instruct/sandbox_boot.py (which documents the steps inside),
with these limits (SandboxLimits) and what reports them in SandboxResult.limit:

    wall_seconds     the supervisor ends a run after this long (the parent the call) -> "wall_time"
    cpu_seconds      the CPU time of ALL a run's processes together (the supervisor sums it: forks do not reset
                     it); RLIMIT_CPU per process besides, 1 s past it             -> "cpu_time"
    memory_mb        RLIMIT_AS: an allocation past it raises MemoryError           -> "memory"
    max_output_bytes stdout and stderr each, per run; the run is killed at the first byte over, and the parent never
                     holds more than this per stream and run                         -> "output"
    max_total_output_bytes  optional: what the parent keeps of all runs together; a run
                     whose output it cuts                                            -> "output"
    max_processes    RLIMIT_NPROC (processes + threads of the sandbox uid)         -> "processes" (fork/thread EAGAIN)
    max_file_mb      RLIMIT_FSIZE per file; the private /tmp is 4x this in total   -> "file_size" (EFBIG / ENOSPC)

Isolation (chosen once per process by `isolation()`, logged; docs/sandbox.md has the threat model and its tests):

  namespaces (Linux, root, or a user namespace when not root; `unshare` from util-linux):
      network  a new network namespace: only a loopback that is down -> no socket reaches 127.0.0.1 or outside
      files    a new mount namespace: empty read-only tmpfs over the hidden paths (run_hidden_paths: home, HF caches,
               the checkout, the cwd, the run's output_dir, data sources and caches, /sys/fs/cgroup, every top-level
               folder outside VISIBLE_TOP_LEVEL); then every mount read-only and nosuid; one private tmpfs per run on
               /tmp (4 x max_file_mb; /var/tmp and /dev/shm are folders of it) is the only writable place (the
               working dir is /tmp/work); /proc shows only the sandbox's processes; a cgroup namespace
      procs    a new pid namespace whose pid 1 is the supervisor: when it exits, the kernel kills every process
               the program left (daemons, double forks, setsid escapes)
      ipc      a new IPC namespace: SysV shared memory, semaphores, message queues and POSIX queues die with the call
      user     as root: a per-slot unprivileged uid (SANDBOX_UID_BASE + slot), no groups: RLIMIT_NPROC binds, and
               files not readable by "others" stay unreadable; not root: the caller's own uid (mapped to root of
               the user namespace), RLIMIT_NPROC = the uid's current tasks + max_processes
  uid (root without namespaces, e.g. a container whose seccomp refuses unshare):
      the per-slot uid, rlimits, a 0700 temp working dir; afterwards every process of that uid is killed.
      NOT blocked: the network, reading world-readable files, writing world-writable dirs (/tmp), IPC objects.
  rlimits (neither): rlimits, a scrubbed environment, a temp working dir, every descendant of the supervisor (a child
      subreaper: setsid daemons too) killed after each run.
      NOT blocked: network, files the trainer's user can read/write, IPC objects.

In every mode on Linux the program runs with no-new-privileges and a seccomp filter (sandbox_boot.seccomp_filter:
unix sockets and socketpairs, file locks, leases and notifications, inotify/fanotify, ptrace and process_vm_*, signals
to the supervisor or to -1, mounts and namespaces, io_uring and the keyring calls fail), and dies with its supervisor;
the call's first process gets SIGKILL when the trainer's thread that started it ends, whatever kills the trainer
(`setpriv --pdeathsig`). A call's processes and tmpfs share one memory cgroup bounded to memory_mb + its tmpfs where
this process may make one (memory_control: cgroup v2 with the memory controller delegated, else v1); otherwise the
bound is RLIMIT_AS per process: max_processes x memory_mb + the tmpfs.

The environment is scrubbed (PATH, HOME and TMPDIR = the working dir, LANG=C.UTF-8; `-I` ignores PYTHON*), the
program runs at nice 10 (training keeps the CPU), and the interpreter is the base one (standard library only, the
trainer's virtual environment and site-packages are not importable). Programs never run in the trainer's process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

SANDBOX_UID_BASE = 61000  # below 65536: mapped in most container user namespaces
MAX_SLOTS = 1024  # sandbox uids 61000 .. 62023, shared by every process on the machine
SLOTS_PER_PROCESS = 64  # concurrent calls per training process
# Each call runs as its own uid/gid SANDBOX_UID_BASE + slot, held for the call by an exclusive flock on
# <tmp>/open_instruct_sandbox_slots_<trainer uid>/<slot>.lock: no two calls on the machine share a uid at once (ranks
# of one node, two runs, two test suites), so one's fork bomb cannot use up another's RLIMIT_NPROC and the kill by uid
# after a call hits only its own processes. A process that dies drops its locks with it.
SLOT_LOCK_DIR = os.path.join(tempfile.gettempdir(), f"open_instruct_sandbox_slots_{os.getuid()}")
BOOT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
_KILL_GRACE_SECONDS = 1.0  # after the program's end or a kill: how long leftover pipe holders get to close them
_STDERR_SCAN_CHARS = 4000  # the tail of stderr read to name the limit behind a failure


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20
    max_processes: int = 32
    max_file_mb: int = 16
    # stdout and stderr of all the call's runs together that the parent keeps (None: only the per-run cap); a run
    # whose output it had to drop ends as "output"
    max_total_output_bytes: Optional[int] = None

    def validate(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "max_output_bytes", "max_processes", "max_file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_total_output_bytes is not None and not self.max_total_output_bytes > 0:
            raise ValueError(f"sandbox limit max_total_output_bytes must be > 0, got {self.max_total_output_bytes!r}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox memory_mb {self.memory_mb} is too small for a Python interpreter (>= 64)")


@dataclasses.dataclass(frozen=True)
class SandboxRun:
    """One run of a call's program: `argv[0]` (a file of the working dir: main.py or one of `files`) run as __main__
    with the rest as its arguments and `stdin`, under its own CPU and wall limits (default: the call's). The runs of a
    call run one after another, each from a fresh copy of the files on a fresh tmpfs; every process of one is killed
    before the next starts; CPU time is summed over all of a run's processes."""

    argv: tuple[str, ...] = ("main.py",)
    stdin: str = ""
    cpu_seconds: Optional[float] = None
    wall_seconds: Optional[float] = None
    max_output_bytes: Optional[int] = None  # stdout and stderr each; at most the call's limit
    # A lock-step pair (sandbox_boot.run_pair): argv[0] runs as the program's process P, and the file `test_runner`
    # (one of the call's files) as a second process T that never loads the program and reads this run's part of
    # the call's `sealed` stream, which only T ever holds; P and T talk over a pipe pair; the run's output, exit and
    # limits are T's (CPU summed over both)
    test_runner: Optional[str] = None


@dataclasses.dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]  # the program's exit status; -N = killed by signal N; None = it never ran
    limit: Optional[str]  # which limit ended it: wall_time, cpu_time, memory, output, processes, file_size
    seconds: float  # wall time of the call (of the run, in `runs`)
    cpu_seconds: float = 0.0  # of all its processes together
    setup_error: Optional[str] = None  # the sandbox itself failed (not the program's fault)
    runs: list["SandboxResult"] = dataclasses.field(default_factory=list)  # per run; the fields above: the first's

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None and self.setup_error is None


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What this machine allows (see the module docstring): `mode` is namespaces, uid or rlimits."""

    mode: str
    as_root: bool
    unshare: Optional[str] = None  # path of the unshare binary (mode namespaces)
    note: str = ""

    @property
    def drops_privileges(self) -> bool:
        return self.as_root


# --------------------------------------------------------------------------------------------------------
# Slots: one uid per concurrent call, so limits and the final kill never touch another call
# --------------------------------------------------------------------------------------------------------
_held_slots: dict[int, int] = {}  # slot -> the fd holding its lock, for calls in flight in this process
_used_slots: set[int] = set()  # every slot this process has run a call in
_slots_lock = threading.Lock()


def _try_lock_slot(slot: int) -> Optional[int]:
    """The fd of slot's lock file, locked exclusively, or None when another call holds it."""
    os.makedirs(SLOT_LOCK_DIR, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(SLOT_LOCK_DIR, f"{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def _take_slot() -> int:
    """A slot no other call on this machine holds (machine-wide by flock; the search starts at a pid-dependent
    place so concurrent processes rarely probe the same locks)."""
    with _slots_lock:
        if len(_held_slots) >= SLOTS_PER_PROCESS:
            raise RuntimeError(f"more than {SLOTS_PER_PROCESS} concurrent sandbox calls in one process")
        first = (os.getpid() * SLOTS_PER_PROCESS) % MAX_SLOTS
        for k in range(MAX_SLOTS):
            slot = (first + k) % MAX_SLOTS
            if slot in _held_slots:
                continue
            fd = _try_lock_slot(slot)
            if fd is not None:
                _held_slots[slot] = fd
                _used_slots.add(slot)
                return slot
        raise RuntimeError(f"all {MAX_SLOTS} sandbox uids of this machine are in use ({SLOT_LOCK_DIR})")


def _give_slot(slot: int) -> None:
    with _slots_lock:
        os.close(_held_slots.pop(slot))


def _tasks_of_uid(uid: int) -> list[int]:
    """Pids (Linux /proc) whose real uid is `uid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(entry))
                            break
            except (OSError, ValueError):
                continue
    return pids


def sandbox_processes() -> list[int]:
    """Pids of every process running as a sandbox uid this process has used, while no other process's call holds
    that uid (none once this process's calls have returned: what a call left behind)."""
    with _slots_lock:
        mine = set(_held_slots)
        for slot in _used_slots - mine:
            fd = _try_lock_slot(slot)
            if fd is not None:  # nobody runs a call as this uid now: whatever runs as it is a leftover
                mine.add(slot)
                os.close(fd)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            if uid - SANDBOX_UID_BASE in mine:
                found.append(int(entry))
    return found


def _count_threads_of_uid(uid: int) -> int:
    total = 0
    for pid in _tasks_of_uid(uid):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process of `uid` until none is left (a fork racing the scan is caught by the next round).
    Only for sandbox uids: never the trainer's. Returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        pids = _tasks_of_uid(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


# --------------------------------------------------------------------------------------------------------
# One call
# --------------------------------------------------------------------------------------------------------
def _base_python() -> tuple[str, str]:
    """(interpreter, prefix) of the base Python (not the venv): the program needs no trainer packages."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo: sources, configs, demo data


# What a sandboxed program sees of the host's root: these top-level folders (what the interpreter needs to start), the
# call's own /proc and /tmp; every other top-level entry (/home, /root, /work, /mnt, /srv, /opt, /var, /run, ...) is
# covered in every call, with or without a run's config (the interpreter's prefix is bound back where one holds it),
# and so are the cgroup filesystem and the paths of default_hidden_paths.
VISIBLE_TOP_LEVEL = ("bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "sys", "tmp", "usr")
# /proc/sys: machine-wide kernel counters (fs/file-nr, fs/inode-nr, fs/dentry-state) two calls could signal through
HIDDEN_SYSTEM_PATHS = ("/sys/fs/cgroup", "/proc/sys")


def _top_level_to_hide() -> list[str]:
    """Every top-level folder or file of / outside VISIBLE_TOP_LEVEL (symlinks such as /lib -> usr/lib are kept:
    they point into what stays visible or nowhere)."""
    try:
        names = os.listdir("/")
    except OSError:
        return []
    return ["/" + n for n in names if n not in VISIBLE_TOP_LEVEL and not os.path.islink("/" + n)]


def default_hidden_paths(extra: Sequence[str] = ()) -> list[str]:
    """Paths covered in the mount namespace: every top-level entry outside VISIBLE_TOP_LEVEL, the cgroup filesystem,
    the home dir, HF caches, the checkout, the trainer's cwd, and `extra` (a run's own paths: run_hidden_paths)."""
    paths = [*_top_level_to_hide(), *HIDDEN_SYSTEM_PATHS, os.path.expanduser("~"), "/root", os.getcwd(), CHECKOUT]
    for var in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME"):
        if os.environ.get(var):
            paths.append(os.environ[var])
    paths.extend(extra)
    return sorted({os.path.realpath(os.path.abspath(os.path.expanduser(p))) for p in paths if p} - {"/"})


def _local_sources(value: Any) -> list[str]:
    """The local files/folders among a config's data sources (a comma list of paths/names, or a mixer list
    [source, amount, ...]); a file's folder too (other splits sit beside it). Hub names are not paths: skipped."""
    if not value:
        return []
    tokens = [t.strip() for t in value.split(",")] if isinstance(value, str) else [str(t) for t in value[0::2]]
    found = []
    for token in tokens:
        path = os.path.expanduser(token)
        if token and os.path.exists(path):
            found.append(path)
            if os.path.isfile(path):
                found.append(os.path.dirname(os.path.abspath(path)))
    return found


def run_hidden_paths(cfg: Any) -> tuple[str, ...]:
    """THE hidden-path policy of a run, for every sandbox use (the `code` verifier and the `python` tool): the
    run's output_dir, every local data source (train and eval, paths and mixtures), the tokenized-data cache, the
    reference cache, besides default_hidden_paths() (home, HF caches, the checkout, the cwd)."""
    from open_instruct.data_cache import cache_root

    paths = [getattr(cfg, "output_dir", None), getattr(cfg, "reference_cache_dir", None)]
    for key in ("dataset_name_or_path", "eval_dataset_name_or_path", "dataset_mixer_list", "eval_dataset_mixer_list"):
        paths.extend(_local_sources(getattr(cfg, key, None)))
    if hasattr(cfg, "dataset_cache_dir"):
        paths.append(cache_root(cfg.dataset_cache_dir))
    return tuple(default_hidden_paths([p for p in paths if p]))


def tool_runtime(cfg: Any) -> Callable[[str, float], tuple[str, str, str]]:
    """The `python` tool's runtime for a run: python_runtime hiding run_hidden_paths(cfg)."""
    return functools.partial(python_runtime, hide_paths=run_hidden_paths(cfg))


def _spec(
    program: str,
    files: dict,
    runs: Sequence[SandboxRun],
    limits: SandboxLimits,
    iso: Isolation,
    slot: int,
    workdir: Optional[str],
    hide: list,
    visible: Sequence[str] = (),
    preload: Optional[dict] = None,
) -> dict:
    prefix = _base_python()[1]
    uid = gid = SANDBOX_UID_BASE + slot
    if not iso.drops_privileges:
        uid, gid = os.getuid(), os.getgid()
        nproc = _count_threads_of_uid(os.getuid()) + limits.max_processes  # NPROC counts all of this uid's tasks
    else:
        nproc = limits.max_processes
    mounted = iso.mode == "namespaces"
    cwd = "/tmp/work" if mounted else workdir
    return {
        "status_fd": None,  # filled in by the caller
        "mount_namespace": mounted,
        "workdir": workdir,
        "tmpfs_mb": 4 * limits.max_file_mb,
        "cgroup_procs": None,  # the call's memory cgroup, joined by the supervisor first (memory_control)
        "hide": hide,
        "visible": [os.path.realpath(p) for p in visible],
        "preload": preload,
        "python_prefix": prefix,
        "runs": [
            {
                "argv": list(run.argv),
                "stdin": run.stdin,
                "cpu_seconds": float(run.cpu_seconds or limits.cpu_seconds),
                "wall_seconds": float(run.wall_seconds or limits.wall_seconds),
                "max_output_bytes": int(min(run.max_output_bytes or limits.max_output_bytes, limits.max_output_bytes)),
                **({"test_runner": run.test_runner} if run.test_runner is not None else {}),
            }
            for run in runs
        ],
        "files": {"main.py": program, **files},
        **lockstep_packages(),
        "uid": uid,
        "gid": gid,
        "drop_privileges": iso.drops_privileges,
        "nice": 10,
        "rlimits": {  # per process (RLIMIT_CPU: from each run's CPU limit)
            "RLIMIT_AS": int(limits.memory_mb) << 20,
            "RLIMIT_FSIZE": int(limits.max_file_mb) << 20,
            "RLIMIT_NPROC": int(nproc),
            "RLIMIT_NOFILE": 256,
            "RLIMIT_CORE": 0,
        },
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"},
    }


# Packages a lock-step run's test process may import besides the standard library (HumanEval+'s and MBPP+'s harnesses
# call numpy.allclose): shown read-only in the sandbox, on the test process's sys.path only (the program can read them
# too; they hold nothing of the run's).
TEST_PACKAGES = ("numpy",)


@functools.lru_cache(maxsize=1)
def lockstep_packages() -> dict:
    """{"expose": the TEST_PACKAGES' folders (and their vendored libraries), "test_path": the folders holding them}
    as this interpreter finds them (without importing them), or {} when none is installed."""
    import importlib.util

    expose, roots = [], []
    for name in TEST_PACKAGES:
        found = importlib.util.find_spec(name)
        if found is None or not found.submodule_search_locations:
            continue
        folder = os.path.realpath(list(found.submodule_search_locations)[0])
        root = os.path.dirname(folder)
        expose += [p for p in (folder, os.path.join(root, f"{name}.libs")) if os.path.isdir(p)]
        roots.append(root)
    return {"expose": expose, "test_path": sorted(set(roots))} if expose else {}


def _command(iso: Isolation) -> list[str]:
    """setpriv gives the first process of the call SIGKILL when the trainer's thread that started it ends (however
    the trainer dies); unshare --kill-child passes that on to the supervisor, pid 1 of the pid namespace, whose
    death ends every process of the call."""
    setpriv = shutil.which("setpriv")
    first = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
    boot = [_base_python()[0], "-I", "-S", "-B", BOOT_SCRIPT]  # the supervisor, whose forks become the programs
    if iso.mode != "namespaces":
        return [*first, *boot]
    user = [] if iso.as_root else ["--user", "--map-root-user"]
    namespaces = ["--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]
    return [*first, iso.unshare, *user, *namespaces, *boot]


def _hit_process_limit(stderr_tail: str) -> bool:
    """fork() failing with EAGAIN (BlockingIOError) or a thread that cannot start: RLIMIT_NPROC at work."""
    return "BlockingIOError" in stderr_tail or "can't start new thread" in stderr_tail


def _name_limit(res: dict, stderr_tail: str, cpu_seconds: float) -> Optional[str]:
    """Which limit ended a program that did not exit 0 (stderr only decides when no signal did)."""
    sig = res.get("signal")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and res.get("cpu", 0.0) >= cpu_seconds - 0.05):
        return "cpu_time"
    if res.get("exit") == 0:
        return None
    if "MemoryError" in stderr_tail:
        return "memory"
    if _hit_process_limit(stderr_tail):
        return "processes"
    if "File too large" in stderr_tail or "No space left on device" in stderr_tail:
        return "file_size"
    return None


def run_in_sandbox(
    program: str,
    stdin: str = "",
    *,
    limits: SandboxLimits = SandboxLimits(),
    files: Optional[dict[str, str]] = None,
    hide_paths: Sequence[str] = (),
    deadline: Optional[float] = None,
    runs: Optional[Sequence[SandboxRun]] = None,
    visible_paths: Sequence[str] = (),
    preload: Optional[dict] = None,
    sealed: Sequence[str] = (),
) -> SandboxResult:
    """Run `program` (Python source) with `stdin` under `limits` in a fresh sandboxed process (module docstring).

    `files` ({name: text}) are written next to main.py in the empty working dir; `hide_paths` are covered besides
    default_hidden_paths(); `deadline` (time.monotonic()) cuts the wall limit short (a batch timeout). With `runs`,
    the call runs each of them in turn (SandboxRun; `stdin` is then unused) and reports each in `.runs`; the call's
    wall limit is then for all of them together. Never raises for anything the program does; returns within the wall
    limit plus about a second. `visible_paths` are bound back read-only where a hidden path covers them, and `preload`
    (sandbox_boot's docstring: the trainer's own module, never model text) runs in the supervisor before the first
    run, so that every run starts with what it imported. `sealed`: one text per lock-step run (SandboxRun.test_runner),
    in order, given only to that run's test process (the supervisor never reads it, so no fork of it holds it)."""
    limits.validate()
    for name in files or {}:
        if not name or "/" in name or name.startswith(".") or name == "main.py":
            raise ValueError(f"sandbox file name {name!r} must be a plain name other than main.py")
    runs = tuple(runs) if runs else (SandboxRun(stdin=stdin),)
    for run in runs:
        if not run.argv or run.argv[0] not in ("main.py", *(files or {})):
            raise ValueError(f"sandbox run {run.argv!r} must start with main.py or one of the call's files")
        if run.test_runner is not None and run.test_runner not in (files or {}):
            raise ValueError(f"sandbox run's test_runner {run.test_runner!r} must be one of the call's files")
    if len(sealed) != sum(run.test_runner is not None for run in runs):
        raise ValueError(
            f"{len(sealed)} sealed texts for {sum(r.test_runner is not None for r in runs)} lock-step runs"
        )
    return _call(
        isolation(), program, runs, limits, files or {}, hide_paths, deadline, visible_paths, preload, sealed
    )


# --------------------------------------------------------------------------------------------------------
# A memory bound per call (all its processes and its tmpfs): a cgroup of its own, where the machine lets us make one
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryControl:
    version: int  # 2 (unified) or 1 (the v1 memory controller)
    parent: str  # the folder this process's calls get their cgroups in (this process's own cgroup)


_memory_control: Optional[tuple[Optional[MemoryControl]]] = None


def _mount_point(fstype: str, option: Optional[str] = None) -> Optional[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if tail and tail[0] == fstype and (option is None or option in tail[-1].split(",")):
                return fields[4]
    return None


def memory_control() -> Optional[MemoryControl]:
    """How calls get a memory cgroup here (probed once): cgroup v2 where this process's cgroup delegates the memory
    controller and is writable, else the v1 memory controller where writable, else None (RLIMIT_AS per process only,
    docs/sandbox.md gives the bound that then holds)."""
    global _memory_control
    if _memory_control is None:
        found = None
        try:
            with open("/proc/self/cgroup") as f:
                lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
            v2 = _mount_point("cgroup2")
            own = next((path for hid, ctrl, path in lines if hid == "0" and ctrl == ""), None)
            if v2 and own is not None:
                folder = os.path.normpath(v2 + "/" + own)
                with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                    if "memory" in f.read().split() and os.access(folder, os.W_OK):
                        found = MemoryControl(2, folder)
            v1 = _mount_point("cgroup", "memory")
            own = next((path for _, ctrl, path in lines if "memory" in ctrl.split(",")), None)
            if found is None and v1 and own is not None:
                folder = os.path.normpath(v1 + "/" + own)
                if os.access(folder, os.W_OK) and os.path.exists(os.path.join(folder, "memory.limit_in_bytes")):
                    found = MemoryControl(1, folder)
            if found is not None and not _can_join(found):
                found = None
        except OSError:
            found = None
        _memory_control = (found,)
        if found is not None:
            remove_stale_cgroups()
        logger.info("sandbox memory bound per call: %s", f"cgroup v{found.version}" if found else "none (rlimits)")
    return _memory_control[0]


_CGROUP_PREFIX = "open_instruct_sandbox_"


def remove_stale_cgroups() -> list[str]:
    """Remove the call cgroups of trainers that no longer run (a SIGKILLed trainer cannot remove its own; their calls
    died with it, so the cgroups are empty). Done once per process by memory_control(); returns what was removed."""
    ctl = memory_control()
    removed = []
    if ctl is None:
        return removed
    for name in os.listdir(ctl.parent):
        owner = name[len(_CGROUP_PREFIX) :].split("_")[0]
        if not name.startswith(_CGROUP_PREFIX) or not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
            continue
        try:
            os.rmdir(os.path.join(ctl.parent, name))
            removed.append(name)
        except OSError:
            continue  # still populated: its processes are being reaped; a later process removes it
    return removed


def _can_join(ctl: MemoryControl) -> bool:
    """Whether a child process can move itself into a fresh cgroup under ctl.parent (as each call's supervisor does):
    a machine where it cannot gets no cgroup rather than calls that all fail to start."""
    try:
        path = _make_cgroup(ctl, MAX_SLOTS, 64 << 20)
    except OSError:
        return False
    try:
        join = f"open({os.path.join(path, 'cgroup.procs')!r}, 'w').write('0')"
        return subprocess.run([sys.executable, "-I", "-S", "-c", join], capture_output=True).returncode == 0
    finally:
        _remove_cgroup(path)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _make_cgroup(ctl: MemoryControl, slot: int, limit_bytes: int) -> str:
    """A fresh cgroup for one call, bounded to `limit_bytes` of memory (no swap beyond it)."""
    path = os.path.join(ctl.parent, f"{_CGROUP_PREFIX}{os.getpid()}_{slot}")
    if os.path.isdir(path):
        _remove_cgroup(path)
    os.mkdir(path)
    if ctl.version == 2:
        _write(os.path.join(path, "memory.max"), str(limit_bytes))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
    else:
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit_bytes))
    return path


def _oom_kills(ctl: MemoryControl, path: str) -> int:
    """Processes the kernel killed in the call's cgroup for memory."""
    name = "memory.events" if ctl.version == 2 else "memory.oom_control"
    try:
        with open(os.path.join(path, name)) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _remove_cgroup(path: str) -> None:
    for _ in range(100):  # EBUSY while the kernel finishes reaping the call's last processes
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    logger.warning("sandbox: could not remove cgroup %s", path)


def call_memory_bytes(limits: SandboxLimits) -> int:
    """The cgroup bound of one call: memory_mb for all its processes together, plus its private tmpfs."""
    return (limits.memory_mb + 4 * limits.max_file_mb) << 20


def _call(
    iso: Isolation,
    program: str,
    runs: Sequence[SandboxRun],
    limits: SandboxLimits,
    files: dict,
    hide_paths: Sequence[str],
    deadline,
    visible_paths: Sequence[str] = (),
    preload: Optional[dict] = None,
    sealed: Sequence[str] = (),
) -> SandboxResult:
    start = time.monotonic()
    wall = limits.wall_seconds if deadline is None else min(limits.wall_seconds, deadline - start)
    if wall <= 0:
        return SandboxResult("", "", None, "wall_time", 0.0)
    slot = _take_slot()
    workdir = cgroup = None
    try:
        if iso.mode != "namespaces":
            workdir = tempfile.mkdtemp(prefix="oi-sandbox-")  # the supervisor makes a folder per run in it
        spec = _spec(
            program, files, runs, limits, iso, slot, workdir, default_hidden_paths(hide_paths), visible_paths, preload
        )
        ctl = memory_control() if iso.drops_privileges else None  # the supervisor joins it as root
        if ctl is not None:
            cgroup = _make_cgroup(ctl, slot, call_memory_bytes(limits))
            spec["cgroup_procs"] = os.path.join(cgroup, "cgroup.procs")
        # the supervisor ends each run at its wall limit and reports it; the parent's own kill is the backstop
        backstop = wall + _KILL_GRACE_SECONDS if wall == limits.wall_seconds else wall
        result = _run(spec, limits, iso, backstop, start, sealed)
        if cgroup is not None and _oom_kills(ctl, cgroup):
            for run in result.runs or [result]:
                if run.limit is None and not run.ok:
                    run.limit = "memory"
            result.limit = result.runs[0].limit if result.runs else result.limit
        return result
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
        if iso.mode == "uid":
            kill_uid(SANDBOX_UID_BASE + slot)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        _give_slot(slot)


_DIAGNOSTIC_BYTES = 1 << 16  # the supervisor's (or unshare's) own stdout/stderr: messages, never the program's


class _Frames:
    """The supervisor's frames (sandbox_boot's docstring), parsed as they arrive: per run, stdout and stderr held up
    to the cap (never more, whatever arrives), all runs together up to `total` (a run cut by it: in `over_total`),
    and its end record."""

    def __init__(self, caps: Sequence[int], total: Optional[int] = None):
        self.buffer = bytearray()
        self.caps = list(caps)  # per run: bytes kept of each stream
        self.room = total  # bytes still kept of all runs together (None: no call-wide cap)
        self.over_total: set[int] = set()
        self.output = [{1: bytearray(), 2: bytearray()} for _ in self.caps]
        self.ends: dict[int, dict] = {}
        self.setup_error: Optional[str] = None
        self.pending: Optional[tuple[int, int, int]] = None  # (run, stream, bytes still to come)

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.pending is not None:
                run, stream, left = self.pending
                take = min(left, len(self.buffer))
                target = self.output[run][stream]
                keep = max(0, min(take, self.caps[run] - len(target)))
                if self.room is not None:
                    if keep > self.room:
                        self.over_total.add(run)
                    keep = min(keep, self.room)
                    self.room -= keep
                target += self.buffer[:keep]
                del self.buffer[:take]
                self.pending = (run, stream, left - take) if left > take else None
                if self.pending is not None:
                    return
                continue
            newline = self.buffer.find(b"\n")
            if newline < 0:
                if len(self.buffer) > _DIAGNOSTIC_BYTES:  # no header is this long: not the supervisor's
                    raise ValueError("malformed frame from the sandbox supervisor")
                return
            header = json.loads(bytes(self.buffer[:newline]))
            del self.buffer[: newline + 1]
            if "setup_error" in header:
                self.setup_error = str(header["setup_error"])
            elif "bytes" in header:
                run, stream = int(header["run"]), int(header["stream"])
                if not (0 <= run < len(self.output) and stream in (1, 2)):
                    raise ValueError(f"frame for run {run} stream {stream}")
                self.pending = (run, stream, int(header["bytes"]))
            else:
                self.ends[int(header["run"])] = header


def _run(
    spec: dict, limits: SandboxLimits, iso: Isolation, wall: float, start: float, sealed: Sequence[str] = ()
) -> SandboxResult:
    status_r, status_w = os.pipe()
    spec["status_fd"] = status_w
    header = json.dumps(spec).encode()
    # after the spec, on the same stdin: each lock-step run's sealed text, read only by its test process
    parts = [b"%012d" % len(header) + header]
    for text in sealed:
        data = text.encode("utf-8", "surrogateescape")
        parts.append(b"%012d" % len(data) + data)
    feed = memoryview(b"".join(parts))
    try:
        proc = subprocess.Popen(
            _command(iso),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            cwd="/",
            start_new_session=True,  # one process group to kill, away from the trainer's terminal signals
        )
    finally:
        os.close(status_w)
    frames = _Frames([run["max_output_bytes"] for run in spec["runs"]], limits.max_total_output_bytes)
    diagnostics = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in (*diagnostics, status_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    sel.register(stdin_fd, selectors.EVENT_WRITE)
    limit, deadline, killed, open_reads = None, start + wall, False, {*diagnostics, status_r}
    try:
        while open_reads:
            now = time.monotonic()
            if now >= deadline:
                if not killed:  # the wall limit of the whole call
                    limit = "wall_time"
                    _kill_call(proc, iso)
                    killed, deadline = True, now + _KILL_GRACE_SECONDS
                    continue
                break  # something (outside our reach) still holds a pipe: stop reading
            for key, _ in sel.select(deadline - now):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        feed = feed[os.write(fd, feed[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the supervisor ended before reading its spec
                        feed = feed[len(feed) :]
                    if not feed:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    open_reads.discard(fd)
                elif fd == status_r:
                    try:
                        frames.feed(chunk)
                    except (ValueError, KeyError, TypeError, RecursionError) as e:
                        frames.setup_error = f"sandbox supervisor: {e}"
                        _kill_call(proc, iso)
                        killed, deadline = True, time.monotonic() + _KILL_GRACE_SECONDS
                else:
                    diagnostics[fd] += chunk[: max(0, _DIAGNOSTIC_BYTES - len(diagnostics[fd]))]
    finally:
        sel.close()
        if proc.poll() is None:
            _kill_call(proc, iso)
        proc.wait()  # with namespaces: unshare exits after pid 1, which the kernel reaps only once all else is gone
        if not proc.stdin.closed:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
    return _result(frames, b"".join(diagnostics.values()), spec, limit, start)


def _result(frames: _Frames, diagnostics: bytes, spec: dict, limit: Optional[str], start: float) -> SandboxResult:
    """The call's result: one SandboxResult per run that started (a run without an end record was cut by the call's
    wall limit, or the supervisor died), the first run's fields on the call's."""
    runs = []
    seconds = time.monotonic() - start
    if frames.setup_error and not frames.ends:  # the sandbox could not be built: nothing of the program ran
        return SandboxResult("", "", None, limit, seconds, setup_error=frames.setup_error)
    for index, run_spec in enumerate(spec["runs"]):
        out = frames.output[index]
        stdout, stderr = (bytes(out[k]).decode("utf-8", "replace") for k in (1, 2))
        end = frames.ends.get(index)
        if end is None:  # the last run that started: cut by the call's wall limit, or the supervisor died
            if limit is None:
                why = "no report from the sandbox supervisor: " + diagnostics[-2000:].decode(errors="replace")
                runs.append(SandboxResult(stdout, stderr, None, None, 0.0, setup_error=why))
            else:
                cut = "processes" if _hit_process_limit(stderr[-_STDERR_SCAN_CHARS:]) else limit
                runs.append(SandboxResult(stdout, stderr, None, cut, 0.0))
            break
        if "setup_error" in end:
            runs.append(SandboxResult(stdout, stderr, None, None, 0.0, setup_error=str(end["setup_error"])))
            break
        run_limit = end.get("limit")
        if run_limit is None and end.get("exit") != 0:
            run_limit = _name_limit(end, stderr[-_STDERR_SCAN_CHARS:], run_spec["cpu_seconds"])
        elif run_limit in ("wall_time", "output") and _hit_process_limit(stderr[-_STDERR_SCAN_CHARS:]):
            run_limit = "processes"  # a fork/thread bomb that then hung or spammed: the cause is the process limit
        if index in frames.over_total and run_limit is None:
            run_limit = "output"  # what it printed went past the call's total: the parent kept only part of it
        seconds_used, cpu = float(end.get("seconds", 0.0)), float(end.get("cpu", 0.0))
        runs.append(SandboxResult(stdout, stderr, end.get("exit"), run_limit, seconds_used, cpu))
    first = runs[0]
    return SandboxResult(
        first.stdout, first.stderr, first.exit_code, first.limit, seconds, first.cpu_seconds, first.setup_error, runs
    )


def _children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (a /proc scan: /proc/PID/task/TID/children is not on every kernel)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _kill_call(proc: subprocess.Popen, iso: Isolation) -> None:
    """SIGKILL the call. With namespaces: the supervisor (pid 1 inside, unshare's child), so that unshare exits only
    once the kernel has killed and reaped everything in the pid namespace (killing unshare first would let the call
    return while the namespace is still being torn down). Otherwise (or before the supervisor exists): the process
    group (unshare or the supervisor, and the program unless it called setsid)."""
    if iso.mode == "namespaces":
        supervisors = _children_of(proc.pid)
        if supervisors:
            for pid in supervisors:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------------------
# What this machine allows
# --------------------------------------------------------------------------------------------------------
_isolation: Optional[Isolation] = None
_isolation_lock = threading.Lock()


def _probe(iso: Isolation) -> Optional[str]:
    """None if a trivial program runs under `iso`, else why not."""
    try:
        res = _call(iso, "print(6 * 7)", (SandboxRun(),), SandboxLimits(wall_seconds=30, cpu_seconds=30), {}, (), None)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if res.setup_error or res.stdout.strip() != "42":
        return res.setup_error or f"exit {res.exit_code}, stdout {res.stdout[:200]!r}, stderr {res.stderr[-300:]!r}"
    return None


def isolation(mode: str = "auto") -> Isolation:
    """The strongest isolation this machine allows (namespaces > uid > rlimits), probed once and logged. `mode`
    other than auto forces one (for tests and for clusters that want to fail rather than fall back)."""
    global _isolation
    with _isolation_lock:
        if _isolation is not None and mode in ("auto", _isolation.mode):
            return _isolation
        as_root = os.geteuid() == 0
        unshare = shutil.which("unshare") if sys.platform.startswith("linux") else None
        candidates = []
        if unshare:
            candidates.append(Isolation("namespaces", as_root, unshare))
        if as_root and sys.platform.startswith("linux"):
            candidates.append(Isolation("uid", True))
        candidates.append(Isolation("rlimits", False))
        if mode != "auto":
            candidates = [c for c in candidates if c.mode == mode]
            if not candidates:
                raise RuntimeError(
                    f"sandbox isolation {mode!r} is not possible here (root: {as_root}, unshare: {unshare})"
                )
        reasons = []
        for candidate in candidates:
            why = _probe(candidate)
            if why is None:
                _isolation = dataclasses.replace(candidate, note="; ".join(reasons))
                logger.info(
                    "sandbox isolation: %s (root: %s)%s",
                    candidate.mode,
                    as_root,
                    f"; fell back because {_isolation.note}" if reasons else "",
                )
                if candidate.mode != "namespaces":
                    why = "; ".join(reasons) or ("forced" if mode != "auto" else "no unshare")
                    logger.warning(
                        "sandbox: no network/mount/pid namespaces (%s): programs can reach the network and "
                        "world-readable files; see docs/sandbox.md",
                        why,
                    )
                return _isolation
            reasons.append(f"{candidate.mode}: {why}")
        raise RuntimeError("no sandbox isolation works on this machine: " + "; ".join(reasons))


def force_isolation(mode: Optional[str]) -> Isolation:
    """Re-probe with a given mode (None: forget and probe auto again). For tests and setup code."""
    global _isolation
    with _isolation_lock:
        _isolation = None
    return isolation(mode or "auto")


# --------------------------------------------------------------------------------------------------------
# Many calls at once
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SandboxCall:
    program: str
    stdin: str = ""
    files: Optional[dict[str, str]] = None
    limits: Optional[SandboxLimits] = None  # default: the pool's
    runs: Optional[tuple[SandboxRun, ...]] = None  # default: one run of main.py with `stdin`
    sealed: tuple[str, ...] = ()  # one text per lock-step run, only for its test process (run_in_sandbox)
    # SandboxPool.run starts a call of phase p only after every call of a lower phase has ended: calls that must not
    # overlap in time (one holding secrets another's program must not learn, even by timing) go in different phases
    phase: int = 0
    visible_paths: tuple[str, ...] = ()  # run_in_sandbox's
    preload: Optional[dict] = None  # run_in_sandbox's


class SandboxPool:
    """At most `workers` sandboxed programs at a time (each call waits on its subprocess in a thread), so a batch
    of 256 responses takes ~256 / workers calls' time and never more than `workers` cores from training."""

    def __init__(self, workers: int, limits: SandboxLimits = SandboxLimits(), hide_paths: Sequence[str] = ()):
        if workers < 1:
            raise ValueError(f"sandbox_workers must be >= 1, got {workers}")
        limits.validate()
        self.workers, self.limits, self.hide_paths = workers, limits, tuple(hide_paths)
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

    def run(self, calls: Sequence[SandboxCall], batch_timeout: Optional[float] = None) -> list[SandboxResult]:
        """Results in call order; the calls of one phase all end before a call of the next phase starts. With
        `batch_timeout`, calls still running at the batch deadline are killed and calls not yet started return at
        once, all with limit "wall_time"."""
        deadline = None if batch_timeout is None else time.monotonic() + batch_timeout
        results: list[Optional[SandboxResult]] = [None] * len(calls)
        for phase in sorted({c.phase for c in calls}):
            futures = {
                i: self._executor.submit(
                    run_in_sandbox,
                    c.program,
                    c.stdin,
                    limits=c.limits or self.limits,
                    files=c.files,
                    hide_paths=self.hide_paths,
                    deadline=deadline,
                    runs=c.runs,
                    visible_paths=c.visible_paths,
                    preload=c.preload,
                    sealed=c.sealed,
                )
                for i, c in enumerate(calls)
                if c.phase == phase
            }
            for i, future in futures.items():
                results[i] = future.result()
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure_call_seconds(calls: int = 4) -> float:
    """Mean wall seconds of a trivial sandboxed program (startup + teardown): the planner's per-call cost."""
    run_in_sandbox("pass")  # the first call also probes the isolation
    start = time.monotonic()
    for _ in range(calls):
        run_in_sandbox("pass")
    return (time.monotonic() - start) / calls


# --------------------------------------------------------------------------------------------------------
# The `python` tool (multi-turn tool use)
# --------------------------------------------------------------------------------------------------------
def truncate_middle(text: str, budget: int) -> str:
    """`text` if it fits in `budget` characters, else its head and tail around a marker saying how much was cut."""
    if len(text) <= budget:
        return text
    marker = f"\n... [{len(text) - budget} characters cut] ...\n"
    keep = max(0, budget - len(marker))
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2) :]


def python_tool(
    code: str, *, timeout: float = 5.0, max_output_chars: int = 4000, stdin: str = "", hide_paths: Sequence[str] = ()
) -> str:
    """The `python` tool: run `code` in the sandbox and return what a model sees: stdout, then stderr (if any)
    under a "[stderr]" line, then a "[...]" line naming a limit or a non-zero exit, all within max_output_chars
    (head and tail kept, the middle cut)."""
    if max_output_chars < 100:
        raise ValueError(f"max_output_chars must be >= 100, got {max_output_chars}")
    limits = SandboxLimits(wall_seconds=timeout, cpu_seconds=max(1, int(timeout + 0.999)))
    res = run_in_sandbox(code, stdin, limits=limits, hide_paths=hide_paths)
    if res.setup_error:
        return f"[sandbox error: {res.setup_error}]"
    parts = [res.stdout]
    if res.stderr:
        parts.append("[stderr]\n" + res.stderr)
    if res.limit:
        parts.append(f"[stopped: {res.limit} limit]")
    elif res.exit_code:
        parts.append(f"[exit status {res.exit_code}]")
    tail = parts.pop() if len(parts) > 1 and parts[-1].startswith("[") and "\n" not in parts[-1] else ""
    body = "\n".join(p.rstrip("\n") for p in parts if p)
    text = truncate_middle(body, max_output_chars - len(tail) - 1)
    return (text + "\n" + tail).strip("\n") if tail else text


def python_runtime(code: str, timeout_s: float, hide_paths: Sequence[str] = ()) -> tuple[str, str, str]:
    """The sandbox as the multi-turn environments' `python` runtime (environments.PythonRuntime): `code` run with
    `timeout_s` of wall and CPU time; returns (stdout, stderr, status), status "ok", the limit that ended the program
    (wall_time, cpu_time, memory, output, processes, file_size), "exit_<code>" for a non-zero exit, or
    "sandbox_error" when the sandbox itself could not run it."""
    limits = SandboxLimits(wall_seconds=timeout_s, cpu_seconds=max(1, int(timeout_s + 0.999)))
    res = run_in_sandbox(code, limits=limits, hide_paths=hide_paths)
    if res.setup_error:
        return res.stdout, res.setup_error, "sandbox_error"
    if res.limit:
        return res.stdout, res.stderr, res.limit
    return res.stdout, res.stderr, "ok" if res.exit_code == 0 else f"exit_{res.exit_code}"
