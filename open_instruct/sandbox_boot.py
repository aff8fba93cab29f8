"""The inside of one sandbox call (see open_instruct/sandbox.py): started as `python -I -S sandbox_boot.py`, as the
trainer's user, possibly as pid 1 of fresh network/mount/pid namespaces made by `unshare`.

Protocol: stdin starts with a 12-digit length and a JSON spec of that many bytes; the rest of stdin is the program's.
The spec's `status_fd` (a pipe the parent reads) receives one JSON line: {"exit": code, "signal": n, "cpu": s} when
the program ends, or {"setup_error": "..."} when the sandbox could not be built (nothing of the program ran).

Steps, in this order (the supervisor is this process; the program is its forked child):
  1. (mount namespace only) a private size-limited tmpfs on /tmp, /var/tmp and /dev/shm; an empty read-only tmpfs
     over every path in `hide` (the run's output_dir, home, caches...); the interpreter's prefix bind-mounted back,
     read-only, at its own path when a hidden path contains it (so `python` and libpython still load).
  2. fork; the child lowers its priority, sets the rlimits, drops to the sandbox uid/gid (no supplementary groups),
     enters the working directory, writes the program's files and execs python on them with a scrubbed environment.
  3. the supervisor waits for the child, reports its status and exits; as pid 1 of the pid namespace its exit makes
     the kernel kill everything the program left behind.

Standard library only: this runs before and outside the trainer's environment.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MNT_DETACH = 2
_libc = None


def _mount(source, target, fstype, flags, options):
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
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
    """Step 1: private temp dirs, hidden paths, the interpreter re-exposed. Returns the working directory."""
    tmp_opts = f"size={spec['tmpfs_mb']}m,mode=1777,nr_inodes=4096"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
    for extra in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(extra):
            _mount("tmpfs", extra, "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
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
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    os.chown(workdir, spec["uid"], spec["gid"])
    return workdir


def run_child(spec, workdir, status_fd):
    """Step 2, in the forked child: never returns (execs the program, or exits 127 after reporting why not)."""
    try:
        os.nice(spec["nice"])
        for name, value in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value) if name != "RLIMIT_CPU" else (value, value + 1))
        if spec["drop_privileges"]:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
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
    spec = read_spec()
    status_fd = spec["status_fd"]
    try:
        workdir = build_mounts(spec) if spec["mount_namespace"] else spec["workdir"]
    except BaseException as e:  # noqa: BLE001
        os.write(status_fd, json.dumps({"setup_error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        sys.exit(127)
    os.set_inheritable(status_fd, False)  # closed by the child's exec; open in it only to report a setup failure
    pid = os.fork()
    if pid == 0:
        run_child(spec, workdir, status_fd)
    for fd in (0, 1, 2):  # the supervisor holds no end of the program's pipes
        os.close(fd)
    _, status, usage = os.wait4(pid, 0)
    report = {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    os.write(status_fd, json.dumps(report).encode() + b"\n")


if __name__ == "__main__":
    main()
