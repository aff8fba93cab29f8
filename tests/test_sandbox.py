"""Hostile programs in the sandbox (open_instruct/sandbox.py): each is contained, named by the right limit, leaves no
process or file behind, and the call returns within its wall limit plus a margin. Limits are ~1-2 s to stay fast.

The containment tests need the isolation this machine gives (namespaces: as root with `unshare`); they are skipped
with the reason where the sandbox falls back (docs/sandbox.md#containment says what the fallbacks block). The
rlimits-mode test runs everywhere."""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import subprocess
import sys

import pytest

from open_instruct import sandbox
from open_instruct.sandbox import SandboxLimits, python_tool, run_in_sandbox, truncate_middle

FAST = SandboxLimits(wall_seconds=2.0, cpu_seconds=2, memory_mb=256, max_output_bytes=64 << 10, max_processes=16)
# Programs expected to finish on their own get a wall limit no machine load reaches; `res.limit is None` then shows
# they ended by themselves (not at a limit), without any timing assumption.
ROOMY = dataclasses.replace(FAST, wall_seconds=60.0, cpu_seconds=30)
BOMB = dataclasses.replace(FAST, wall_seconds=8.0)  # a bomb hits the process limit after its start, whatever the load
MARGIN = 2.0  # seconds past the wall limit a call may take to kill and reap (a loaded 2-core machine)


def contained(res, limits=FAST):
    """Returned in time, and nothing runs on as a sandbox uid this process used (uids are machine-wide: another
    process's call never runs as one this process holds or checks)."""
    assert res.setup_error is None, res.setup_error
    assert res.seconds < limits.wall_seconds + MARGIN, res.seconds
    assert sandbox.sandbox_processes() == []
    return res


def test_plain_program_reads_stdin_and_exits(iso):
    res = contained(
        run_in_sandbox("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "3 4 5\n", limits=ROOMY), ROOMY
    )
    assert (res.stdout, res.exit_code, res.limit) == ("12\n", 0, None)


def test_infinite_loop_is_stopped(iso):
    res = contained(run_in_sandbox("while True:\n    pass", limits=FAST))
    assert res.limit in ("wall_time", "cpu_time")
    assert not res.ok


def test_cpu_limit_fires_before_a_long_wall_limit(iso):
    limits = SandboxLimits(wall_seconds=30.0, cpu_seconds=1, memory_mb=256)
    res = contained(run_in_sandbox("while True:\n    pass", limits=limits), limits)
    assert res.limit == "cpu_time"  # SIGXCPU: the kernel sends it once the process has used its 1 s of CPU
    # ...so at least 1 s of wall time passed. Not rusage's cpu_seconds: its user/system times are tick-sampled and
    # scaled, and read 0.89 s for this same kill on a machine at load average 14 (1.003 s idle).
    assert limits.cpu_seconds <= res.seconds < limits.wall_seconds


def test_fork_bomb_is_contained(iso):
    res = contained(run_in_sandbox("import os\nwhile True:\n    os.fork()", limits=BOMB), BOMB)
    assert res.limit == "processes", (res.limit, res.stderr[-300:])


def test_thread_bomb_is_contained(iso):
    program = "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,)).start()"
    res = contained(run_in_sandbox(program, limits=BOMB), BOMB)
    assert res.limit == "processes", (res.limit, res.stderr[-300:])


def test_allocating_10_gb_fails_fast(iso):
    res = contained(run_in_sandbox("x = bytearray(10 * 2**30)\nprint('allocated')", limits=ROOMY), ROOMY)
    assert res.limit == "memory"  # RLIMIT_AS refused it at once: the 60 s wall limit never came into play
    assert "allocated" not in res.stdout


def test_writing_1_gb_to_stdout_is_cut_at_the_output_limit(iso):
    program = "import os\nchunk = b'x' * 65536\nfor _ in range(16384):\n    os.write(1, chunk)"
    res = contained(run_in_sandbox(program, limits=ROOMY), ROOMY)
    assert res.limit == "output"
    assert len(res.stdout) == ROOMY.max_output_bytes


def test_writes_outside_the_working_dir_do_not_land(iso, tmp_path):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    home = os.path.expanduser("~")
    targets = [str(output_dir / "pwned"), os.path.join(home, "pwned_by_sandbox"), "/tmp/pwned_by_sandbox_test"]
    program = (
        "import sys\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, e.errno)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    res = contained(run_in_sandbox(program, limits=ROOMY, hide_paths=[str(output_dir)]), ROOMY)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "fine"  # the working dir is writable
    for path in targets:
        assert not os.path.exists(path), path
    # The output dir and home are refused outright; /tmp is the call's private tmpfs (written there, gone after).
    assert f"refused {targets[0]}" in res.stdout and f"refused {targets[1]}" in res.stdout


def test_the_runs_checkpoint_and_files_cannot_be_read(iso, tmp_path, repo_root):
    ckpt = tmp_path / "run" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_text("SECRET-WEIGHTS")
    os.chmod(ckpt / "model.safetensors", 0o644)  # world-readable, as checkpoints usually are
    readme = os.path.join(repo_root, "README.md")  # the trainer's cwd holds the data and configs
    program = (
        f"for path in {[str(ckpt / 'model.safetensors'), readme]!r}:\n"
        "    try:\n"
        "        print('read', path, open(path).read()[:20])\n"
        "    except OSError as e:\n"
        "        print('refused', path, e.errno)\n"
    )
    old_cwd = os.getcwd()
    os.chdir(repo_root)
    try:
        res = contained(run_in_sandbox(program, limits=ROOMY, hide_paths=[str(tmp_path / "run")]), ROOMY)
    finally:
        os.chdir(old_cwd)
    assert "SECRET" not in res.stdout and "read " not in res.stdout, res.stdout
    assert res.stdout.count("refused") == 2


def test_no_socket_reaches_localhost_or_outside(iso):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1)\n"
        "        print('connected', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', addr)\n"
    )
    try:
        res = contained(run_in_sandbox(program, limits=ROOMY), ROOMY)
        with pytest.raises(BlockingIOError):  # nothing ever knocked on the trainer's port
            server.accept()
    finally:
        server.close()
    assert res.stdout.count("refused") == 3 and "connected" not in res.stdout, res.stdout


def test_killing_the_parent_the_trainer_or_everything_is_contained(iso):
    program = (
        "import os, signal\n"
        f"for pid in (os.getppid(), {os.getpid()}, 1, -1, 0):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print('refused', pid, e.errno)\n"
        "print('still here')\n"
    )
    res = contained(run_in_sandbox(program, limits=ROOMY), ROOMY)
    assert os.getppid() != 1  # the trainer (this process) and its parent are alive
    assert res.setup_error is None and res.limit is None


def test_a_daemon_does_not_outlive_the_call(iso):
    # The grandchild (setsid, double fork: a classic daemon) sends the program its pid namespace through a pipe; only
    # then does the program print it and exit. No sleep: the event is the message on the pipe. Afterwards no process
    # on the machine may be in that namespace.
    program = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, os.readlink('/proc/self/ns/pid').encode() + b'\\n')\n"
        "        while True:\n"
        "            time.sleep(1)\n"
        "    os._exit(0)\n"
        "print('daemon up in', os.read(r, 100).decode().strip())\n"
    )
    res = contained(run_in_sandbox(program, limits=ROOMY), ROOMY)
    assert res.stdout.startswith("daemon up in pid:[") and res.exit_code == 0, res
    assert res.limit is None  # the call ended with the program, not at the wall limit
    namespace = res.stdout.split()[-1]
    assert namespace != os.readlink("/proc/self/ns/pid")
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    left.append(entry)
            except OSError:
                pass
    assert left == []


def test_deep_recursion_crashes_only_itself(iso):
    program = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)"
    res = contained(run_in_sandbox(program, limits=ROOMY), ROOMY)
    assert res.limit in (None, "memory") and res.exit_code not in (0, None)  # a crash (SIGSEGV or MemoryError)


def test_a_program_that_never_reads_its_stdin(iso):
    res = contained(run_in_sandbox("print('done')", "x" * (8 << 20), limits=ROOMY), ROOMY)
    assert (res.stdout, res.exit_code) == ("done\n", 0)


def test_a_program_that_closes_stdout(iso):
    program = "import os, sys\nos.close(1)\nsys.stderr.write('closed\\n')\nprint('lost')\n"
    res = contained(run_in_sandbox(program, limits=ROOMY), ROOMY)
    assert res.stdout == "" and "closed" in res.stderr
    assert res.limit is None


def test_the_environment_is_scrubbed(iso, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    res = contained(run_in_sandbox("import os\nprint(sorted(os.environ))\nprint(os.getuid())", limits=ROOMY), ROOMY)
    names, uid = res.stdout.splitlines()
    assert eval(names) == ["HOME", "LANG", "PATH", "TMPDIR"]
    assert int(uid) >= sandbox.SANDBOX_UID_BASE


def test_a_batch_timeout_stops_the_whole_batch(iso):
    calls = [sandbox.SandboxCall("while True:\n    pass", limits=SandboxLimits(wall_seconds=30, cpu_seconds=30))] * 3
    with sandbox.SandboxPool(2) as pool:
        results = pool.run(calls, batch_timeout=1.0)
    assert [r.limit for r in results] == ["wall_time"] * 3
    assert max(r.seconds for r in results) < 1.0 + MARGIN
    assert sandbox.sandbox_processes() == []


def test_python_tool_output_is_truncated_to_the_budget(iso):
    text = python_tool("print('a' * 5000)\nimport sys\nsys.exit(3)", max_output_chars=300)
    assert len(text) <= 300
    assert text.startswith("aaa") and text.endswith("[exit status 3]")
    assert "characters cut" in text
    assert python_tool("print(6 * 7)") == "42"
    assert python_tool("1/0").startswith("[stderr]\nTraceback")


def test_truncate_middle_keeps_head_and_tail():
    assert truncate_middle("abc", 10) == "abc"
    cut = truncate_middle("h" * 50 + "t" * 50, 60)
    assert len(cut) == 60 and cut.startswith("h") and cut.endswith("t") and "[" in cut


def test_rlimits_mode_still_limits_and_kills_the_process_group():
    """The weakest fallback (no namespaces, no uid change): limits still fire and the call's process group dies."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    previous = sandbox.isolation()
    try:
        sandbox.force_isolation("rlimits")
        res = run_in_sandbox("while True:\n    pass", limits=FAST)
        assert res.limit in ("wall_time", "cpu_time") and res.seconds < FAST.wall_seconds + MARGIN
        assert run_in_sandbox("x = bytearray(10 * 2**30)", limits=ROOMY).limit == "memory"
        # A child left running in the call's process group is killed with the call.
        program = "import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.write(w, str(os.getpid()).encode())\n"
        program += "    while True:\n        time.sleep(1)\nprint(os.read(r, 20).decode())\n"
        res = run_in_sandbox(program, limits=ROOMY)
        child = int(res.stdout)
        try:
            pidfd = os.pidfd_open(child)
        except ProcessLookupError:
            return  # gone already
        try:  # readable once the process has exited: waits on the kernel's event, fails the test if it never comes
            assert select.select([pidfd], [], [], 10.0)[0] == [pidfd]
        finally:
            os.close(pidfd)
    finally:
        sandbox.force_isolation(previous.mode)


def test_concurrent_processes_never_share_a_sandbox_uid(iso):
    """Sandbox uids are taken machine-wide (an exclusive flock per uid), not per process: while another process holds
    the uid this process's last call ran as, the next call runs as another one; a second run or a second copy of the
    test suite on the machine cannot land on a uid whose processes the first would count or kill. (The holder takes
    one uid only: the test must not starve other sandbox users running beside it.)"""
    program = "import os\nprint(os.getuid())"
    first = int(contained(run_in_sandbox(program, limits=ROOMY), ROOMY).stdout)
    slot = first - sandbox.SANDBOX_UID_BASE
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            f"fd = os.open(os.path.join({sandbox.SLOT_LOCK_DIR!r}, '{slot}.lock'), os.O_RDWR | os.O_CREAT, 0o600)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # the holder signals once it has the lock
        second = int(contained(run_in_sandbox(program, limits=ROOMY), ROOMY).stdout)
        assert second != first and second >= sandbox.SANDBOX_UID_BASE
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_visible_folder_under_tmp_is_importable_in_the_preload_and_the_run(iso):
    """A checkout or venv under /tmp (a fresh clone there): the packages the call names visible are bound back into
    each run's private /tmp and the preload's scratch one, read-only; nothing else of the host's /tmp is there."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="oi_visible_", dir="/tmp")
    try:
        os.makedirs(os.path.join(folder, "site"))
        with open(os.path.join(folder, "site", "oi_probe_pkg.py"), "w") as f:
            f.write("VALUE = 41\n")
        with open(os.path.join(folder, "secret.txt"), "w") as f:
            f.write("not for the program")
        site = os.path.join(folder, "site")
        preload = {"name": "oi_probe_preload", "source": "import oi_probe_pkg\ndef warm():\n    pass\n",
                   "path": [site], "call": "warm", "kwargs": {}}  # fmt: skip
        program = (
            "import os, sys\nsys.path.insert(0, %r)\nimport oi_probe_pkg\n"
            "print(oi_probe_pkg.VALUE + 1, os.path.exists(%r))\n"
            "try:\n    open(os.path.join(%r, 'new.py'), 'w')\nexcept OSError:\n    print('read-only')\n"
        ) % (site, os.path.join(folder, "secret.txt"), site)
        res = contained(run_in_sandbox(program, limits=ROOMY, visible_paths=(site,), preload=preload), ROOMY)
        assert (res.stdout, res.exit_code) == ("42 False\nread-only\n", 0), (res.stdout, res.stderr)
    finally:
        shutil.rmtree(folder)
