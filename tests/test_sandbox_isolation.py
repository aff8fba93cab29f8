"""Containment gaps of issue 33, each as a program that tries it: no host directory is writable, IPC objects and
keyrings do not outlive a call, host unix sockets are unreachable, no-new-privileges holds, one memory bound covers a
call's processes and its tmpfs, and a call dies with a SIGKILLed trainer. Namespaces as root only (the other modes
block less: docs/sandbox.md)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

from open_instruct import sandbox
from open_instruct.sandbox import SandboxLimits, run_in_sandbox

ROOMY = SandboxLimits(wall_seconds=60.0, cpu_seconds=30, memory_mb=256, max_output_bytes=64 << 10, max_file_mb=2)
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")


def run(program: str, limits: SandboxLimits = ROOMY, **kwargs) -> sandbox.SandboxResult:
    res = run_in_sandbox(textwrap.dedent(program), limits=limits, **kwargs)
    assert res.setup_error is None and res.limit is None and res.exit_code == 0, res
    assert sandbox.sandbox_processes() == []
    return res


def visible_host_folder(monkeypatch) -> str:
    """A fresh folder on the host that the sandbox is made to see (its top-level folder, hidden by default, is
    added to sandbox.VISIBLE_TOP_LEVEL; not /tmp, home, the checkout or the cwd)."""
    base = next((d for d in ("/srv", "/opt", "/mnt") if os.access(d, os.W_OK)), None)
    if base is None:
        pytest.skip("no writable host folder outside /tmp, home and the checkout")
    monkeypatch.setattr(sandbox, "VISIBLE_TOP_LEVEL", (*sandbox.VISIBLE_TOP_LEVEL, base.strip("/")))
    folder = tempfile.mkdtemp(prefix="oi-sandbox-test-", dir=base)
    os.chmod(folder, 0o777)
    return folder


def test_no_host_directory_is_writable(iso):
    """Every mount but the call's own tmpfs is read-only (whatever its name: /run/lock, /var/lock, /dev, ...)."""
    res = run(
        """
        import os
        for line in open("/proc/self/mountinfo"):
            fields = line.split()
            print(fields[4], "ro" in fields[5].split(","))
        for d in ("/run/lock", "/var/lock", "/dev", "/etc", "/"):
            try:
                open(os.path.join(d, "left-behind"), "w")
                print("WROTE", d)
            except OSError as e:
                print("refused", d, e.errno)
        """
    )
    mounts = [line.split() for line in res.stdout.splitlines() if not line.startswith(("WROTE", "refused"))]
    writable = {m for m, ro in mounts if ro == "False"}
    assert writable and writable <= set(PRIVATE) | {"/tmp/work"}, writable
    assert "WROTE" not in res.stdout and res.stdout.count("refused") == 5


def test_ipc_objects_do_not_outlive_the_call(iso):
    key = 0x0A11CE00 + os.getpid() % 256
    program = f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        create = {{create}}
        shm = libc.shmget({key}, 1 << 20, (0o1000 | 0o600) if create else 0)
        sem = libc.semget({key}, 1, (0o1000 | 0o600) if create else 0)
        print(shm >= 0, sem >= 0)
    """
    assert run(program.format(create=True)).stdout.split() == ["True", "True"]  # made in the first call
    assert run(program.format(create=False)).stdout.split() == ["False", "False"]  # gone in the next
    with open("/proc/sysvipc/shm") as f:
        assert f"{key}" not in [line.split()[0] for line in f.readlines()[1:]]  # and never on the host


def test_host_unix_sockets_are_unreachable(iso, monkeypatch):
    folder = visible_host_folder(monkeypatch)
    path = os.path.join(folder, "host.sock")
    abstract = "\0oi-sandbox-test-" + str(os.getpid())  # abstract names: per network namespace
    servers = []
    try:
        for address in (path, abstract):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(address)
            server.listen(4)
            server.setblocking(False)
            servers.append(server)
        os.chmod(path, 0o777)
        res = run(
            f"""
            import os, socket
            print(os.path.exists({path!r}))
            for address in ({path!r}, {abstract!r}):
                try:
                    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(address)
                    print("connected")
                except OSError as e:
                    print("refused", e.errno)
            """
        )
        assert res.stdout.split("\n")[0] == "True"  # the socket file is in sight
        assert res.stdout.count("refused") == 2 and "connected" not in res.stdout
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            server.close()
        subprocess.run(["rm", "-rf", folder], check=True)


def test_no_keyring_no_new_privileges_no_setuid(iso):
    res = run(
        """
        import ctypes, platform
        libc = ctypes.CDLL(None, use_errno=True)
        add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
        ret = libc.syscall(add_key, b"user", b"left-behind", b"secret", 6, -4)  # -4: the user keyring
        print("add_key", ret, ctypes.get_errno())
        print("nnp", open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0])
        print("all nosuid", all("nosuid" in line.split()[5] for line in open("/proc/self/mountinfo")))
        """
    )
    assert res.stdout.split("\n")[:3] == ["add_key -1 1", "nnp 1", "all nosuid True"]


def test_one_memory_bound_covers_the_calls_processes_and_its_tmpfs(iso):
    """The three private temp dirs are one tmpfs of 4 x max_file_mb; with a cgroup (memory_control), the call's
    processes together get memory_mb plus that tmpfs: 3 children of 100 MB under memory_mb=128 cannot all live."""
    res = run(
        """
        import os
        total, dirs = 0, ("/tmp", "/var/tmp", "/dev/shm")
        for i in range(64):
            try:
                with open(dirs[i % 3] + f"/f{i}", "wb") as f:
                    f.write(b"x" * (1 << 20))
                total += 1 << 20
            except OSError:
                pass
        print(total >> 20)
        """
    )
    assert 4 * ROOMY.max_file_mb - 1 <= int(res.stdout) <= 4 * ROOMY.max_file_mb
    if sandbox.memory_control() is None:
        pytest.skip("no writable memory cgroup here: the bound is RLIMIT_AS per process (docs/sandbox.md)")
    hog = """
        import os
        r, w = os.pipe()
        kids = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                block = bytearray(100 << 20)
                for j in range(0, len(block), 4096):
                    block[j] = 1
                os.write(w, b"k")
                os.read(r, 1)  # never answered: held until the end of the call
                os._exit(0)
            kids.append(pid)
        os.close(w)
        print(sorted(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids))
    """
    limits = SandboxLimits(wall_seconds=60.0, cpu_seconds=30, memory_mb=128, max_file_mb=2)
    res = run_in_sandbox(textwrap.dedent(hog), limits=limits)
    assert res.limit == "memory" or "-9" in res.stdout, res  # the kernel killed at least one


def test_a_call_dies_with_its_sigkilled_trainer(iso):
    """A trainer-like process starts a call whose program sleeps, prints the program's pid, and is SIGKILLed: the
    program must end (waited on through a pidfd, not a sleep)."""
    trainer = textwrap.dedent(
        """
        import os, sys, threading
        from open_instruct import sandbox
        sandbox.isolation()  # its probe's program ends first: the only sandbox-uid process left is the sleeper
        limits = sandbox.SandboxLimits(wall_seconds=600, cpu_seconds=600)
        threading.Thread(target=sandbox.run_in_sandbox, args=("import time\\ntime.sleep(600)",),
                         kwargs={"limits": limits}, daemon=True).start()
        while True:
            for pid in sandbox.sandbox_processes():  # the program (the supervisor runs as root)
                print(pid, flush=True)
                threading.Event().wait()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the trainer never saw its sandboxed program start"
        pid = int(proc.stdout.readline())
        pidfd = os.pidfd_open(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone, _, _ = select.select([pidfd], [], [], 30)
        assert gone, f"sandboxed program {pid} outlived its SIGKILLed trainer"
        os.close(pidfd)
        ctl = sandbox.memory_control()
        if ctl is not None:  # the dead trainer's call cgroup is removed by the next process that probes
            prefix = f"open_instruct_sandbox_{proc.pid}_"
            assert any(n.startswith(prefix) for n in os.listdir(ctl.parent))
            assert any(n.startswith(prefix) for n in sandbox.remove_stale_cgroups())
            assert not any(n.startswith(prefix) for n in os.listdir(ctl.parent))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
