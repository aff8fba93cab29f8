"""The inside of one sandbox call (see open_instruct/sandbox.py): started as `python -I -S sandbox_boot.py`, as the
trainer's user, possibly as pid 1 of fresh network/mount/pid namespaces made by `unshare`.

Protocol: stdin starts with a 12-digit length and a JSON spec of that many bytes; the rest of stdin is the program's.
The spec's `status_fd` (a pipe the parent reads) receives one JSON line: {"exit": code, "signal": n, "cpu": s} when
the program ends, or {"setup_error": "..."} when the sandbox could not be built (nothing of the program ran).

Steps, in this order (the supervisor is this process; the program is its forked child):
  0. join the call's memory cgroup (spec `cgroup_procs`, when the trainer made one): the bound covers every
     process of the call and the pages of its tmpfs.
  1. (mount namespace only) an empty read-only tmpfs over every path in `hide` (the run's output_dir, data, home,
     caches...); the interpreter's prefix bind-mounted back, read-only, at its own path when a hidden path contains
     it (so `python` and libpython still load); then EVERY mount read-only and nosuid (mount_setattr, recursive: no
     host directory of any name stays writable), and last one private size-limited tmpfs on /tmp, with /var/tmp and
     /dev/shm bound to folders of it (one size limit for all three): the only writable place.
  2. fork; the child lowers its priority, sets the rlimits, drops to the sandbox uid/gid (no supplementary groups),
     sets no-new-privileges and the parent-death signal (SIGKILL), installs a seccomp filter (socket(AF_UNIX),
     io_uring and the keyring calls fail: no host unix socket can be reached, no keyring survives a call), enters
     the working directory, writes the program's files and execs python on them with a scrubbed environment.
  3. the supervisor waits for the child, reports its status and exits; as pid 1 of the pid namespace its exit makes
     the kernel kill everything the program left behind.

Standard library only: this runs before and outside the trainer's environment.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = 1, 2, -100, 0x8000, 442
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
# (audit arch, socket, add_key, request_key, keyctl, io_uring_setup) per machine
_SYSCALLS = {"x86_64": (0xC000003E, 41, 248, 249, 250, 425), "aarch64": (0xC00000B7, 198, 217, 218, 219, 425)}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


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


def seccomp_filter():
    """A classic-BPF seccomp filter: socket(AF_UNIX, ...), io_uring_setup and add_key/request_key/keyctl fail with
    EPERM; a foreign syscall ABI (x32, i386 on x86_64) is refused; everything else is allowed."""
    machine = platform.machine()
    if machine not in _SYSCALLS:
        raise OSError(f"no seccomp filter for machine {machine!r}")
    arch, sys_socket, *denied = _SYSCALLS[machine]
    ld_w_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    prog = [
        (ld_w_abs, 0, 0, 4),  # arch
        (jeq, 1, 0, arch),
        (ret, 0, 0, eperm),
        (ld_w_abs, 0, 0, 0),  # syscall number
        (jge, 0, 1, 0x40000000),  # x32
        (ret, 0, 0, eperm),
    ]
    for nr in denied:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [
        (jeq, 1, 0, sys_socket),
        (ret, 0, 0, allow),
        (ld_w_abs, 0, 0, 16),  # socket's first argument (the domain), low 32 bits
        (jeq, 0, 1, 1),  # AF_UNIX
        (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
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


def build_mounts(spec):
    """Step 1: hidden paths, the interpreter re-exposed, all read-only, then the private temp dir. Returns the
    working directory."""
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700,nr_inodes=64")  # staging only
    prefix = spec["python_prefix"]
    stage = "/tmp/.prefix"
    hide = sorted({p for p in spec["hide"] if os.path.lexists(p) and p != "/" and not _is_within(p, "/tmp")}, key=len)
    covering = [p for p in hide if _is_within(prefix, p) and p != prefix]
    if covering:
        os.mkdir(stage, 0o755)
        _mount(prefix, stage, None, MS_BIND | MS_REC, None)
    done = []
    for path in hide:
        if any(_is_within(path, parent) for parent in done):
            continue  # already under a hidden parent
        if _is_within(path, prefix):
            continue  # hiding part of the interpreter would break it; say so in the docs, not here
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755,nr_inodes=64")
            if path in covering:
                os.makedirs(prefix, 0o755, exist_ok=True)  # the parents of the prefix, on the fresh tmpfs
                _mount(stage, prefix, None, MS_BIND | MS_REC, None)
                _mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
            else:
                os.chmod(path, 0)
            _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k")
        else:
            _mount("/dev/null", path, None, MS_BIND, None)
        done.append(path)
    if covering:
        _umount(stage)
        os.rmdir(stage)
    _umount("/tmp")
    read_only_everywhere()
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmpfs_mb']}m,mode=1777,nr_inodes=4096")
    for extra in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(extra):
            inside = "/tmp/." + extra.rsplit("/", 1)[1]
            os.mkdir(inside, 0o1777)
            os.chmod(inside, 0o1777)
            _mount(inside, extra, None, MS_BIND, None)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    os.chown(workdir, spec["uid"], spec["gid"])
    return workdir


def run_child(spec, workdir, status_fd, supervisor):
    """Step 2, in the forked child: never returns (execs the program, or exits 127 after reporting why not)."""
    try:
        os.nice(spec["nice"])
        for name, value in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value) if name != "RLIMIT_CPU" else (value, value + 1))
        if spec["drop_privileges"]:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        if sys.platform.startswith("linux"):
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it: dies with the supervisor
            if os.getppid() != supervisor:
                raise OSError("the supervisor ended before the program started")
            seccomp_filter()  # sets no-new-privileges first
        os.chdir(workdir)
        for name, content in spec["files"].items():
            with open(name, "x", encoding="utf-8") as f:
                f.write(content)
        os.umask(0o077)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a program writing to a closed pipe dies as usual
        os.execve(spec["python"], [spec["python"], *spec["python_args"], spec["main"]], spec["env"])
    except BaseException as e:  # noqa: BLE001 - anything here is a setup failure, reported to the parent
        try:
            os.write(status_fd, json.dumps({"setup_error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        finally:
            os._exit(127)


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
    if sys.platform.startswith("linux"):  # without namespaces: dies with the trainer's thread that started it
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    spec = read_spec()
    status_fd = spec["status_fd"]
    try:
        if spec.get("cgroup_procs"):  # before anything else: every process of the call and its tmpfs count there
            with open(spec["cgroup_procs"], "w") as f:
                f.write("0")
        workdir = build_mounts(spec) if spec["mount_namespace"] else spec["workdir"]
    except BaseException as e:  # noqa: BLE001
        os.write(status_fd, json.dumps({"setup_error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        sys.exit(127)
    os.set_inheritable(status_fd, False)  # closed by the child's exec; open in it only to report a setup failure
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        run_child(spec, workdir, status_fd, supervisor)
    for fd in (0, 1, 2):  # the supervisor holds no end of the program's pipes
        os.close(fd)
    _, status, usage = os.wait4(pid, 0)
    report = {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    os.write(status_fd, json.dumps(report).encode() + b"\n")


if __name__ == "__main__":
    main()
