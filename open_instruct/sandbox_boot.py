"""The inside of one sandbox call (see open_instruct/sandbox.py): started as `python -I -S sandbox_boot.py`, as the
trainer's user, possibly as pid 1 of fresh network/mount/pid/IPC namespaces made by `unshare`.

Protocol: stdin holds a 12-digit length and a JSON spec of that many bytes, then (lock-step runs) each such run's
sealed text, framed the same way. The spec's `status_fd` (a pipe the parent
reads; no program ever holds it) carries everything back, as frames: a JSON header line, then `bytes` raw bytes when
the header has them:
    {"run": i, "stream": 1 or 2, "bytes": n}             n bytes of run i's stdout (1) or stderr (2)
    {"run": i, "exit": code, "signal": n, "cpu": s, "limit": name or null, "seconds": s}   run i ended
    {"setup_error": "..."}                                the sandbox could not be built (that run did not start)
A program cannot forge a frame: only this supervisor writes them, keyed by the run it started.

Steps, in this order (the supervisor is this process; each run of the program is a forked child of it):
  0. join the call's memory cgroup (spec `cgroup_procs`, when the trainer made one): the bound covers every process
     of the call and the pages of its tmpfs; then (namespaces) a new cgroup namespace: the program's
     /proc/self/cgroup names no host cgroup (nor the trainer's pid in it).
  1. (mount namespace only) an empty read-only tmpfs over every path in `hide` (the run's output_dir, data, home,
     caches, /sys/fs/cgroup...); the interpreter's prefix bind-mounted back, read-only, at its own path when a hidden
     path contains it (so `python` and libpython still load); then EVERY mount read-only and nosuid (mount_setattr,
     recursive: no host directory of any name stays writable).
  2. per run, one after another (runs never overlap): a fresh private size-limited tmpfs on /tmp (/var/tmp and
     /dev/shm bound to folders of it) is the only writable place (a fresh temp dir without a mount namespace); fork;
     the child takes its own session, closes every other fd (the channel too), lowers its priority, sets the
     rlimits, drops to the sandbox uid/gid (no supplementary groups; as the root of a user namespace: no capabilities,
     none regained by an exec), sets no-new-privileges and the parent-death signal (SIGKILL), installs the seccomp
     filter (seccomp_filter), enters the working directory, writes the program's files and runs the run's file as
     __main__ with a scrubbed environment: a fork taken before any program code ran, as clean as a new interpreter.
     The supervisor feeds the run's stdin, forwards its stdout/stderr (each capped: over the cap the run is killed,
     limit "output"), and ends the run at its wall limit or once the CPU time of ALL the run's processes together
     (the reaped ones through RUSAGE_CHILDREN, the live ones from /proc) passes its CPU limit; RLIMIT_CPU bounds each
     process besides. When the run's first process ends, every other process of the run is killed and reaped (the
     supervisor is pid 1 of the pid namespace, or a child subreaper: orphans come back to it) before the next run
     starts; the run's tmpfs is unmounted with it.
     A run with a `test_runner` is a lock-step pair (run_pair): two such forks, the test's process first (it reads the
     run's sealed text from the rest of stdin, which the supervisor itself never reads) and the program's once the
     test's holds it, joined by two pipes; the run's output and exit status are the test process's.
  3. the supervisor exits; as pid 1 of the pid namespace its exit makes the kernel kill anything still there.

Optional spec keys: `visible`, folders bound back read-only where a hidden path covers them (as the interpreter's
prefix is: a package folder a trusted preload imports from); `preload` ({"name", "source", "path", "call",
"kwargs"}), the trainer's own module source (never model text), executed in the supervisor after step 1 and before
the first run as module `name` with `path` in front of sys.path, then `name.call(**kwargs)`: every run is a fork taken
after it, so it starts with what the preload imported and built (reasoning-gym scoring: one import per call).

Standard library only: this runs before and outside the trainer's environment.
"""

import builtins
import ctypes
import json
import os
import platform
import resource
import runpy
import select
import shutil
import signal
import struct
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = 1, 2, -100, 0x8000, 442
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
PR_SET_DUMPABLE, PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER = 4, 28, 36
SECBIT_NOROOT_AND_LOCK = 0x3  # uid 0 gains no capabilities across exec, locked
CLONE_NEWCGROUP = 0x02000000
AF_UNIX = 1
# fcntl commands that lock, lease or watch a file (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_NOTIFY):
# each is a channel between two programs that can only open the same read-only files
FCNTL_CHANNELS = (6, 7, 37, 38, 1024, 1026)
# Syscall numbers per machine. Refused outright: keyrings (outlive a call), io_uring (bypasses this filter), flock,
# inotify/fanotify (channels through shared read-only files), ptrace, process_vm_readv/writev and pidfd_getfd (reach
# into another process of the same uid), mounts, namespaces and chroot (undo the mount setup as a user namespace's
# root).
# fmt: off
_SYSCALLS = {
    "x86_64": {
        "arch": 0xC000003E,
        "denied": (248, 249, 250, 425, 73, 253, 254, 294, 300, 301, 101, 310, 311, 438, 165, 166, 155, 161, 272, 308,
                   428, 429, 430, 431, 432, 433, 442),
        "socket": 41, "socketpair": 53, "fcntl": 72,
        "signals": (62, 200, 234, 129, 297, 434),  # kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo, pidfd_open
    },
    "aarch64": {
        "arch": 0xC00000B7,
        "denied": (217, 218, 219, 425, 32, 26, 27, 262, 263, 117, 270, 271, 438, 40, 39, 41, 51, 97, 268,
                   428, 429, 430, 431, 432, 433, 442),
        "socket": 198, "socketpair": 199, "fcntl": 25,
        "signals": (129, 130, 131, 138, 240, 434),
    },
}
# fmt: on
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_TICK = 0.05  # seconds between two looks at a run's total CPU time
_CLK_TCK = os.sysconf("SC_CLK_TCK")
PROGRAM = object()  # what run_one returns in the forked child that becomes the program


def _check(ret, what):
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _prctl(option, arg):
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def read_only_everywhere():
    """Every mount of this (private) mount namespace read-only and nosuid, recursively (Linux >= 5.12)."""
    attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, len(attr))
    _check(0 if ret == 0 else -1, "mount_setattr / read-only, recursive")


def seccomp_program(machine, supervisor):
    """The classic-BPF program of seccomp_filter, as (code, jt, jf, k) tuples."""
    if machine not in _SYSCALLS:
        raise OSError(f"no seccomp filter for machine {machine!r}")
    nr = _SYSCALLS[machine]
    ld_w_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1

    def arg(i):  # the low 32 bits of argument i (little-endian machines)
        return (ld_w_abs, 0, 0, 16 + 8 * i)

    def refuse_when(syscall, index, values):
        """syscall(..., arg index in values, ...) fails; any other call of it is allowed (the block ends either way)."""
        body = [arg(index)]
        for v in values:
            body += [(jeq, 0, 1, v & 0xFFFFFFFF), (ret, 0, 0, eperm)]
        body.append((ret, 0, 0, allow))
        return [(jeq, 0, len(body), syscall), *body]

    prog = [
        (ld_w_abs, 0, 0, 4),  # arch
        (jeq, 1, 0, nr["arch"]),
        (ret, 0, 0, eperm),
        (ld_w_abs, 0, 0, 0),  # syscall number
        (jge, 0, 1, 0x40000000),  # x32
        (ret, 0, 0, eperm),
    ]
    for denied in nr["denied"]:
        prog += [(jeq, 0, 1, denied), (ret, 0, 0, eperm)]
    # each block below loads an argument, so each ends in a verdict; the syscall number is reloaded before the next
    blocks = [refuse_when(nr["socket"], 0, [AF_UNIX]), refuse_when(nr["socketpair"], 0, [AF_UNIX])]
    blocks.append(refuse_when(nr["fcntl"], 1, FCNTL_CHANNELS))
    # no signal to the supervisor, to its process group, or to every process (-1); no pidfd of the supervisor
    blocks += [refuse_when(s, 0, [supervisor, -supervisor, -1]) for s in nr["signals"]]
    for block in blocks:
        prog += [*block, (ld_w_abs, 0, 0, 0)]
    prog.append((ret, 0, 0, allow))
    return prog


def seccomp_filter(supervisor):
    """Install the seccomp filter (after no-new-privileges): what it refuses (EPERM) is listed at _SYSCALLS, plus
    socket/socketpair(AF_UNIX) (no host unix socket can be reached, by name or by sendto from a socketpair), the fcntl
    locks, leases and directory notifications (FCNTL_CHANNELS), a signal or pidfd aimed at the supervisor, its group
    or every process; a foreign syscall ABI (x32, i386 on x86_64) is refused; everything else is allowed."""
    prog = seccomp_program(platform.machine(), supervisor)
    # a jump never skips past a block, but check that no offset overflowed the 8-bit fields
    if any(jt > 255 or jf > 255 for _, jt, jf, _ in prog):
        raise OSError("seccomp program jump out of range")
    # note: blocks end in "ret"; the reload after each is reached only through a block's "skip the body" jump
    code = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp filter")


def _mount(source, target, fstype, flags, options):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, options)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or 'bind'} {source} on {target}: {os.strerror(errno)}")


def _umount(target):
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"umount {target}: {os.strerror(errno)}")


def _is_within(path, parent):
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _kept_folders(spec):
    """The interpreter's prefix and spec's `visible` and `expose` folders, none inside another."""
    wanted = [spec["python_prefix"], *spec.get("visible", ()), *spec.get("expose", ())]
    kept = [p for p in dict.fromkeys(wanted) if p == spec["python_prefix"] or os.path.isdir(p)]
    return [p for p in kept if not any(_is_within(p, q) and p != q for q in kept)]  # inside a kept one: comes with it


def build_mounts(spec):
    """Step 1: hidden paths, the interpreter (and spec's `expose` folders: the test processes' numpy) re-exposed
    read-only at their own paths, then every mount read-only (the private temp dir comes per run: fresh_workdir)."""
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700,nr_inodes=64")  # staging only
    hide = sorted({p for p in spec["hide"] if os.path.lexists(p) and p != "/" and not _is_within(p, "/tmp")}, key=len)
    kept = _kept_folders(spec)
    stages = {}  # a kept folder under a hidden one -> where it waits while the hidden one is covered
    for i, path in enumerate(kept):
        if any(_is_within(path, p) and p != path for p in hide):
            stages[path] = f"/tmp/.keep{i}"
            os.mkdir(stages[path], 0o755)
            _mount(path, stages[path], None, MS_BIND | MS_REC, None)
    done = []
    for path in hide:
        if any(_is_within(path, parent) for parent in done):
            continue  # already under a hidden parent
        if any(_is_within(path, k) for k in kept):
            continue  # hiding part of the interpreter would break it; say so in the docs, not here
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755,nr_inodes=64")
            inside = [k for k in stages if _is_within(k, path)]
            for k in inside:
                os.makedirs(k, 0o755, exist_ok=True)  # its parents, on the fresh tmpfs
                _mount(stages[k], k, None, MS_BIND | MS_REC, None)
                _mount(None, k, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
            if not inside:
                os.chmod(path, 0)
            _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k")
        else:
            _mount("/dev/null", path, None, MS_BIND, None)
        done.append(path)
    for stage in stages.values():
        _umount(stage)
        os.rmdir(stage)
    _umount("/tmp")
    read_only_everywhere()


PRIVATE_EXTRAS = ("/var/tmp", "/dev/shm")


def mount_private_tmp(spec, options):
    """A new tmpfs on /tmp, with the kept folders inside /tmp (a checkout or venv there: the interpreter's packages)
    bound back read-only at their own paths, through fds opened before the tmpfs covers them, as build_mounts
    binds them back under a hidden folder. Returns those paths (unmounted before /tmp)."""
    inside = [p for p in _kept_folders(spec) if _is_within(p, "/tmp") and os.path.isdir(p)]
    handles = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in inside]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
    for path, fd in handles:
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(fd)
    return inside


def fresh_workdir(spec, index):
    """A run's empty working directory, on storage no earlier run touched: (namespaces) a new tmpfs on /tmp, with
    /var/tmp and /dev/shm bound to folders of it (one size limit for all three); else a new folder in spec's workdir.
    Returns (the working directory, the cleanup to call after the run)."""
    if not spec["mount_namespace"]:
        workdir = os.path.join(spec["workdir"], str(index))
        os.mkdir(workdir, 0o700)
        os.chown(workdir, spec["uid"], spec["gid"])
        return workdir, lambda: shutil.rmtree(workdir, ignore_errors=True)
    bound = mount_private_tmp(spec, f"size={spec['tmpfs_mb']}m,mode=1777,nr_inodes=4096")
    for extra in PRIVATE_EXTRAS:
        if os.path.isdir(extra):
            inside = "/tmp/." + extra.rsplit("/", 1)[1]
            os.mkdir(inside, 0o1777)
            os.chmod(inside, 0o1777)
            _mount(inside, extra, None, MS_BIND, None)
            bound.append(extra)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    os.chown(workdir, spec["uid"], spec["gid"])

    def cleanup():
        for path in (*bound, "/tmp"):
            _umount(path)

    return workdir, cleanup


def _drop_capabilities():
    """No capability left in this process (capset: effective, permitted and inheritable all empty)."""
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two __user_cap_data_struct of zeros
    _check(_libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)), "capset")


def become_program(spec, run, workdir, fds, setup_w, supervisor, keep=0, write_files=True):
    """In the forked child: become the run's program (a fork of the supervisor taken before any program code ran:
    as clean as a fresh interpreter, 20-30 ms cheaper), or exit 127 after writing why not to setup_w. Returns only
    when every bound is in place and every fd but 0, 1, 2 is closed (the supervisor's channel included); the caller
    then runs the program. `keep`: fds 3 .. 3 + keep - 1 stay open too (a lock-step pair's pipes, placed there by
    run_pair); `write_files`: False for a pair's test process, which must not touch the program's files."""
    try:
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
        os.closerange(3 + keep, setup_w)
        os.closerange(setup_w + 1, 1 << 16)
        os.setsid()  # its own session and group, away from the supervisor's
        os.nice(spec["nice"])
        cpu = max(1, int(run["cpu_seconds"] + 0.999))
        for name, value in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        # One process's backstop, a second past the run's limit: the supervisor (a look every _TICK) ends an
        # over-limit run first and names it. At the run's limit itself, a forked child killed by SIGXCPU at exactly
        # the limit let its parent go on and pass, its run's summed CPU a hair under or over the limit.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu + 1, cpu + 2))
        if spec["drop_privileges"]:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        elif os.geteuid() == 0:  # the root of a user namespace (or root without one): no capabilities in the program
            _prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_AND_LOCK)  # none regained by an exec either
            _drop_capabilities()
        if sys.platform.startswith("linux"):
            _prctl(PR_SET_DUMPABLE, 1)  # its own /proc entries its own again (the supervisor's stay out of reach)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it: dies with the supervisor
            if os.getppid() != supervisor:
                raise OSError("the supervisor ended before the program started")
            seccomp_filter(supervisor)  # sets no-new-privileges first
        os.chdir(workdir)
        for name, content in spec["files"].items() if write_files else ():
            with open(name, "x", encoding="utf-8") as f:
                f.write(content)
        os.umask(0o077)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a program writing to a closed pipe dies as usual
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in any interpreter
        os.environ.clear()
        os.environ.update({**spec["env"], "HOME": workdir, "TMPDIR": workdir})
        sys.argv = list(run["argv"])
        builtins.exit = builtins.quit = sys.exit  # `-S` skipped site, which defines them; contest programs call them
    except BaseException as e:  # noqa: BLE001 - anything here is a setup failure, reported to the supervisor
        try:
            os.write(setup_w, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(127)
    os.close(setup_w)  # empty and closed: the program starts


def _stat_fields(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def _others(me):
    """Every process of the call but the supervisor: all of the pid namespace's other processes when it is pid 1,
    else its descendants (a child subreaper: orphans come back to it, so none is lost by a double fork)."""
    entries = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != me]
    if me == 1:
        return entries
    children = {}
    for pid in entries:
        try:
            children.setdefault(int(_stat_fields(pid)[1]), []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [me]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _live_cpu(me):
    """CPU seconds of the call's live processes, each with its reaped children (fork chains included)."""
    total = 0
    for pid in _others(me):
        try:
            fields = _stat_fields(pid)
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            continue
    return total / _CLK_TCK


def _kill_others(me):
    if me == 1:
        try:
            os.kill(-1, signal.SIGKILL)  # from pid 1 of a pid namespace: every other process in it
        except ProcessLookupError:
            pass
        return
    for pid in _others(me):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _end_all(me, first):
    """Kill and reap every process of the run; returns the wait status of `first` (None if it was reaped before)."""
    status = None
    while True:
        _kill_others(me)
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        if pid == first:
            status = wait_status


class Channel:
    """The frames of the module docstring, on the status pipe."""

    def __init__(self, fd):
        self.fd = fd

    def send(self, header, data=b""):
        frame = json.dumps(header).encode() + b"\n" + data
        view = memoryview(frame)
        while view:
            view = view[os.write(self.fd, view) :]


def run_one(spec, index, run, channel, me):
    """Run `run` (one entry of spec["runs"]) to its end; sends its output and its end frames. Returns whether the
    next run may start, or PROGRAM in the forked child, which then runs the program."""
    workdir, cleanup = fresh_workdir(spec, index)
    child = False
    try:
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
        setup_r, setup_w = os.pipe2(os.O_CLOEXEC)
        cpu_before, start = _children_cpu(), time.monotonic()
        pid = os.fork()
        if pid == 0:
            child = True
            become_program(spec, run, workdir, (pipes[0][0], pipes[1][1], pipes[2][1]), setup_w, me)
            return PROGRAM
        os.close(setup_w)
        for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
            os.close(fd)
        why = _setup_failure(setup_r)
        return _finish_run(run, index, pid, pipes, channel, me, cpu_before, start, why)
    finally:
        if not child:  # (the program's process leaves the run's storage alone)
            cleanup()


TEST = object()  # what run_pair returns in the forked child that becomes a pair's test process


def _place(fds, first):
    """dup2 `fds` onto first, first + 1, ... (through copies above them, so that no source is overwritten)."""
    copies = [_dup_above(fd, 512) for fd in fds]
    for target, fd in enumerate(copies, first):
        os.dup2(fd, target)
        os.close(fd)


def _dup_above(fd, lowest):
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)


def _read_sealed(fd):
    """A lock-step run's sealed text: a 12-digit length and that many bytes (read only by the test process)."""

    def exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError("sealed text cut short")
            buf += chunk
        return bytes(buf)

    return exact(int(exact(12))).decode("utf-8", "surrogateescape")


def _fork_setup(spec, run, workdir, fds, extra, supervisor, write_files, before=None):
    """Fork a process of a pair: (pid, setup_r) in the supervisor; in the child, (None, result of `before`) once it
    is bound (become_program) with `extra` pipes placed on fds 3, 4."""
    setup_r, setup_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid:
        os.close(setup_w)
        return pid, setup_r
    os.close(setup_r)
    got = None
    try:
        got = before() if before else None  # (the test process reads its sealed text before anything else)
        setup_w = _dup_above(setup_w, 3 + len(extra))  # out of the way of what goes on 0 .. 3 + len(extra) - 1
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
        _place(extra, 3)
    except BaseException as e:  # noqa: BLE001
        os.write(setup_w, f"{type(e).__name__}: {e}".encode())
        os._exit(127)
    become_program(spec, run, workdir, (0, 1, 2), setup_w, supervisor, keep=len(extra), write_files=write_files)
    return None, got


def _setup_failure(setup_r):
    """What a forked run wrote on its setup pipe before it became the program (empty: it started), read to the end
    and the pipe closed."""
    why = b""
    while True:
        chunk = os.read(setup_r, 4096)
        if not chunk:
            break
        why += chunk
    os.close(setup_r)
    return why


def run_pair(spec, index, run, channel, me, sealed_fd):
    """A lock-step run: P, the program's process (argv[0] as __main__: it loads the program and answers calls),
    and T, the test's process (the file run["test_runner"], given the run's sealed text, which only T reads from
    the call's stdin): two forks of this supervisor, taken before any program code ran, bound alike (become_program),
    joined by two pipes (T's requests on P's stdin, P's answers on its stdout; T holds them as fds 3 and 4). T is
    made non-dumpable, so P (same uid) cannot open /proc/T/mem or its fds. The run's output, exit status and end are
    T's; CPU and wall are summed and watched over both (and anything they start). Returns as run_one, or PROGRAM /
    (TEST, source, sealed) in the forked children."""
    workdir, cleanup = fresh_workdir(spec, index)
    child = False
    try:
        requests, answers = os.pipe(), os.pipe()
        pipes = [os.pipe() for _ in range(3)]  # T's stdin, stdout, stderr
        devnull = os.open(os.devnull, os.O_RDWR)
        cpu_before, start = _children_cpu(), time.monotonic()
        # T first, and P only once T holds its text: no program code runs before T has read it
        pid_t, setup_t = _fork_setup(
            spec,
            run,
            workdir,
            (pipes[0][0], pipes[1][1], pipes[2][1]),
            (answers[0], requests[1]),
            me,
            False,
            before=lambda: _read_sealed(sealed_fd),
        )
        if pid_t is None:
            child = True
            _prctl(PR_SET_DUMPABLE, 0)  # P runs as the same uid: no /proc/T/mem, /proc/T/fd for it
            return TEST, spec["files"][run["test_runner"]], setup_t
        why = _setup_failure(setup_t)
        if not why:
            pid_p, setup_p = _fork_setup(spec, run, workdir, (requests[0], answers[1], devnull), (), me, True)
            if pid_p is None:
                child = True
                return PROGRAM
            why = _setup_failure(setup_p)
        for fd in (requests[0], requests[1], answers[0], answers[1], devnull, pipes[0][0], pipes[1][1], pipes[2][1]):
            os.close(fd)
        return _finish_run(run, index, pid_t, pipes, channel, me, cpu_before, start, why)
    finally:
        if not child:
            cleanup()


def _finish_run(run, index, pid, pipes, channel, me, cpu_before, start, why):
    """The supervisor's side of a started run (its first process `pid`): a setup failure (`why`) reported, else the
    run supervised to its end and its end sent (CPU, the limit that ended it, exit status); False on a setup
    failure."""
    if why:
        _end_all(me, pid)
        for fd in (pipes[0][1], pipes[1][0], pipes[2][0]):
            os.close(fd)
        channel.send({"run": index, "setup_error": why.decode("utf-8", "replace")})
        return False
    limit = _supervise(run, index, pid, pipes, channel, me, cpu_before, start)
    status = _end_all(me, pid)
    for fd in (pipes[1][0], pipes[2][0]):
        os.close(fd)
    cpu = _children_cpu() - cpu_before
    if limit is None and cpu > run["cpu_seconds"]:
        limit = "cpu_time"  # its processes ended between two looks, past the limit together
    end = {"run": index, "cpu": cpu, "limit": limit, "seconds": time.monotonic() - start}
    if status is not None:
        end["exit"] = os.waitstatus_to_exitcode(status)
        if os.WIFSIGNALED(status):
            end["signal"] = os.WTERMSIG(status)
    channel.send(end)
    return True


def _supervise(run, index, pid, pipes, channel, me, cpu_before, start):
    """Feed stdin, forward stdout/stderr (capped), watch the wall and the run's CPU time; return the limit that ended
    the run, or None when its first process ended by itself. Output still in the pipes is forwarded afterwards."""
    feed = memoryview(run.get("stdin", "").encode("utf-8", "surrogateescape"))
    stdin_w, out_r, err_r = pipes[0][1], pipes[1][0], pipes[2][0]
    for fd in (stdin_w, out_r, err_r):
        os.set_blocking(fd, False)
    pidfd = os.pidfd_open(pid)
    cap, sent = run["max_output_bytes"], {out_r: 0, err_r: 0}
    streams = {out_r: 1, err_r: 2}
    deadline, next_look = start + run["wall_seconds"], start + _TICK
    reading, writing = [out_r, err_r, pidfd], [stdin_w] if feed else []
    if not feed:
        os.close(stdin_w)
    limit = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                limit = "wall_time"
                break
            if now >= next_look:
                if _children_cpu() - cpu_before + _live_cpu(me) > run["cpu_seconds"]:
                    limit = "cpu_time"
                    break
                next_look = now + _TICK
            readable, writable, _ = select.select(reading, writing, [], max(0.0, min(deadline, next_look) - now))
            if writable:
                try:
                    feed = feed[os.write(stdin_w, feed[: 1 << 16]) :]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    feed = feed[:0]
                if not feed:
                    writing = []
                    os.close(stdin_w)
            for fd in readable:
                if fd == pidfd:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    reading.remove(fd)
                    continue
                room = cap - sent[fd]
                if chunk[:room]:
                    channel.send({"run": index, "stream": streams[fd], "bytes": len(chunk[:room])}, chunk[:room])
                sent[fd] += len(chunk)
                if sent[fd] > cap:
                    limit = "output"
            if limit or pidfd in readable:
                break
    finally:
        os.close(pidfd)
        if writing:
            os.close(stdin_w)
    _kill_others(me)
    for fd in (out_r, err_r):  # what the run wrote before it ended, up to the cap (every writer is dead now)
        while sent[fd] < cap and fd in reading:
            try:
                chunk = os.read(fd, min(1 << 16, cap - sent[fd]))
            except BlockingIOError:
                break
            if not chunk:
                break
            channel.send({"run": index, "stream": streams[fd], "bytes": len(chunk)}, chunk)
            sent[fd] += len(chunk)
    return limit


def run_preload(spec):
    """The spec's `preload` (module docstring): the trainer's module, run in the supervisor before the first run, with
    a scratch tmpfs on /tmp (mount namespace) that is gone before the first run (libraries that want a cache dir)."""
    import types

    preload, mounted = spec["preload"], spec["mount_namespace"]
    bound = mount_private_tmp(spec, "size=64m,mode=0700") if mounted else []
    try:
        sys.path[:0] = list(preload.get("path", ()))
        module = types.ModuleType(preload["name"])
        sys.modules[preload["name"]] = module
        exec(compile(preload["source"], preload["name"], "exec"), module.__dict__)
        getattr(module, preload["call"])(**preload.get("kwargs", {}))
    finally:
        if mounted:
            for path in (*bound, "/tmp"):
                _umount(path)


def read_spec():
    def read_exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(0, n - len(buf))
            if not chunk:
                raise EOFError("sandbox spec cut short")
            buf += chunk
        return bytes(buf)

    return json.loads(read_exact(int(read_exact(12))))


def main():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 takes only signals it handles: it handles none
    if sys.platform.startswith("linux"):  # without namespaces: dies with the trainer's thread that started it
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(PR_SET_DUMPABLE, 0)  # no process of its uid may open /proc/<supervisor>/fd (the channel) or ptrace it
    spec = read_spec()
    channel = Channel(spec["status_fd"])
    os.set_inheritable(channel.fd, False)
    me = os.getpid()
    try:
        if spec.get("cgroup_procs"):  # before anything else: every process of the call and its tmpfs count there
            with open(spec["cgroup_procs"], "w") as f:
                f.write("0")
        if spec["mount_namespace"]:
            _check(_libc.unshare(CLONE_NEWCGROUP), "unshare(CLONE_NEWCGROUP)")
            build_mounts(spec)
        elif me != 1:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the program come back here: counted, killed, reaped
    except BaseException as e:  # noqa: BLE001
        channel.send({"setup_error": f"{type(e).__name__}: {e}"})
        sys.exit(127)
    sealed_fd = os.dup(0)  # the rest of stdin: the lock-step runs' sealed texts, which only their test processes read
    if spec.get("preload"):
        try:
            run_preload(spec)
        except BaseException as e:  # noqa: BLE001 - the trainer's own code failed: no run starts
            channel.send({"setup_error": f"preload {spec['preload'].get('name')}: {type(e).__name__}: {e}"})
            sys.exit(127)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # the supervisor holds no end of the trainer's pipes but its channel (and sealed_fd)
    os.close(devnull)
    for index, run in enumerate(spec["runs"]):
        if "test_runner" in run:
            outcome = run_pair(spec, index, run, channel, me, sealed_fd)
        else:
            outcome = run_one(spec, index, run, channel, me)
        if outcome is PROGRAM:  # the run's process: the program runs as __main__, then the interpreter ends as usual
            runpy.run_path(sys.argv[0], run_name="__main__")
            return
        if isinstance(outcome, tuple) and outcome[0] is TEST:  # a pair's test process: the runner, given its text
            _, source, sealed = outcome
            sys.path.extend(spec.get("test_path", ()))  # (numpy, for test harnesses that use it)
            exec(compile(source, run["test_runner"], "exec"), {"__name__": "__main__", "SEALED": sealed})
            return
        if not outcome:
            sys.exit(127)


if __name__ == "__main__":
    main()
