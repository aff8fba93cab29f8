"""Issue 43's containment items, each as a hostile program (contained: reward 0 / refused) beside an honest one
(reward 1 / works): no channel between the calls of a row or the tests of a call (locks, inotify/fanotify, unix
sockets, the cgroup filesystem, ptrace or signals to the supervisor, daemons, forged records), limits per call and not
per process (CPU summed over forks, output capped in the trainer while reading, code_test_seconds over its range), and
what the standalone verifier hides. docs/sandbox.md has the table of layers."""

from __future__ import annotations

import dataclasses
import textwrap
import time
import tracemalloc

import pytest

from open_instruct import code_verifier, rewards, sandbox
from open_instruct.code_verifier import CodeSettings
from open_instruct.sandbox import SandboxCall, SandboxLimits, SandboxPool, SandboxRun, run_in_sandbox

ROOMY = SandboxLimits(wall_seconds=60.0, cpu_seconds=30, memory_mb=256, max_output_bytes=1 << 20, max_file_mb=2)
SETTINGS = CodeSettings(reward="all", test_seconds=1.0, memory_mb=256, workers=2)


def run(program: str, limits: SandboxLimits = ROOMY, **kwargs) -> sandbox.SandboxResult:
    res = run_in_sandbox(textwrap.dedent(program), limits=limits, **kwargs)
    assert res.setup_error is None, res.setup_error
    assert sandbox.sandbox_processes() == []
    return res


# Each line: a name and the call that would open a channel (or reach the supervisor); the program prints
# "<name> refused <errno>" or "<name> ALLOWED".
CHANNELS = """
    import ctypes, errno, fcntl, os, socket, struct
    libc = ctypes.CDLL(None, use_errno=True)
    stdlib = os.open(os.__file__, os.O_RDONLY)  # a read-only file every call can open
    def attempt(name, call):
        try:
            result = call()
            if isinstance(result, int) and result < 0:
                raise OSError(ctypes.get_errno(), name)
            print(name, "ALLOWED")
        except OSError as e:
            print(name, "refused", e.errno)
    attempt("flock", lambda: fcntl.flock(stdlib, fcntl.LOCK_SH | fcntl.LOCK_NB))
    attempt("fcntl F_SETLK", lambda: fcntl.lockf(stdlib, fcntl.LOCK_SH | fcntl.LOCK_NB))
    attempt("fcntl F_OFD_SETLK", lambda: fcntl.fcntl(stdlib, 37, struct.pack("hhqqi", 0, 0, 0, 0, 0)))
    attempt("fcntl F_SETLEASE", lambda: fcntl.fcntl(stdlib, 1024, 0))
    attempt("fcntl F_NOTIFY", lambda: fcntl.fcntl(os.open("/usr", os.O_RDONLY), 1026, 1))
    attempt("inotify_init1", lambda: libc.inotify_init1(0))
    attempt("fanotify_init", lambda: libc.fanotify_init(0, 0))
    attempt("socketpair AF_UNIX", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))
    attempt("socket AF_UNIX", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
    attempt("ptrace supervisor", lambda: libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH
    attempt("process_vm_readv", lambda: libc.process_vm_readv(os.getppid(), 0, 0, 0, 0, 0))
    attempt("kill supervisor", lambda: os.kill(os.getppid(), 19))  # SIGSTOP
    attempt("kill every process", lambda: os.kill(-1, 19))
    attempt("pidfd of supervisor", lambda: os.pidfd_open(os.getppid()))
    attempt("unshare", lambda: os.unshare(os.CLONE_NEWNS) if hasattr(os, "unshare") else libc.unshare(0x20000))
    attempt("umount", lambda: libc.umount2(b"/home", 2))
"""
NAMES = [line.split('"')[1] for line in CHANNELS.splitlines() if line.strip().startswith("attempt(")]


def test_every_channel_and_the_supervisor_are_out_of_reach(iso):
    res = run(CHANNELS)
    assert res.exit_code == 0, res.stderr
    verdicts = dict(line.rsplit(" ", 2)[0:2] if "refused" in line else (line.rsplit(" ", 1)[0], "ALLOWED")
                    for line in res.stdout.splitlines())  # fmt: skip
    assert sorted(verdicts) == sorted(NAMES)
    assert {name for name, verdict in verdicts.items() if verdict != "refused"} == set(), res.stdout


def test_the_filter_holds_on_the_value_and_stdio_paths(iso):
    """The same attempts as a stdio test (its expected output: every one refused by the filter, EPERM) and inside
    a value test's call (the count of EPERM refusals): each test passes only if the filter holds in that layout."""
    body = textwrap.dedent(CHANNELS)
    every_one_refused = "".join(f"{name} refused 1\n" for name in NAMES)
    value_program = (
        f"import contextlib, io\nSOURCE = {body!r}\n"
        "def refused():\n    out = io.StringIO()\n    with contextlib.redirect_stdout(out):\n"
        "        exec(SOURCE, {'__name__': 'channels'})\n    return out.getvalue().count(' refused 1\\n')\n"
    )
    truths = [[{"input": "", "output": every_one_refused}], [f"assert refused() == {len(NAMES)}"]]
    outcomes = code_verifier.score_programs([body, value_program], truths, SETTINGS)
    assert [o.statuses for o in outcomes] == [["pass"], ["pass"]]


def test_honest_programs_still_fork_thread_pipe_and_use_multiprocessing(iso):
    """The controls: what the filter leaves alone (fork, pipes, threads, signals to one's own children, a process
    pool, reading the standard library)."""
    res = run(
        """
        import multiprocessing, os, signal, threading, time
        def square(x):
            return x * x
        if __name__ == "__main__":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, b"child")
                os._exit(0)
            os.waitpid(pid, 0)
            sleeper = os.fork()
            if sleeper == 0:
                time.sleep(60)
                os._exit(0)
            os.kill(sleeper, signal.SIGKILL)
            os.waitpid(sleeper, 0)
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
            with multiprocessing.get_context("fork").Pool(2) as pool:
                print(os.read(r, 5).decode(), sum(pool.map(square, range(10))), len(open(os.__file__).read()) > 0)
        """
    )
    assert (res.stdout, res.exit_code, res.limit) == ("child 285 True\n", 0, None), res.stderr


def test_the_cgroup_filesystem_and_host_paths_are_hidden_without_a_run_config(iso):
    """The standalone call (no hidden paths given): /proc/self/cgroup names no host cgroup, /sys/fs/cgroup is empty,
    every top-level host folder outside VISIBLE_TOP_LEVEL is unreadable (the interpreter's prefix is bound back)."""
    res = run(
        """
        import os, sys
        print(open("/proc/self/cgroup").read().split("\\n")[0].rsplit(":", 1)[1])
        try:
            print(sorted(os.listdir("/sys/fs/cgroup")))
        except OSError:
            print("hidden")
        for name in sorted(os.listdir("/")):
            path = "/" + name
            if os.path.isdir(path) and not os.path.islink(path):
                try:
                    entries = os.listdir(path)
                    print("listed", path, sys.prefix.startswith(path + "/") or len(entries))
                except OSError:
                    print("hidden", path)
        """
    )
    lines = res.stdout.splitlines()
    assert lines[0] == "/" and lines[1] in ("[]", "hidden"), res.stdout
    listed = {line.split()[1]: line.split()[2] for line in lines[2:] if line.startswith("listed")}
    exposed = sandbox.lockstep_packages().get("expose", [])  # numpy for lock-step test processes, read-only
    for path, shown in listed.items():  # what stays readable: the allow-list, /tmp, the prefix's and numpy's parents
        parent_of_exposed = any(p.startswith(path + "/") for p in exposed)
        assert path.strip("/") in sandbox.VISIBLE_TOP_LEVEL or shown in ("True", "0") or parent_of_exposed, (
            path,
            shown,
        )
    assert "/home" not in listed and "/root" not in listed or listed.get("/root") == "True"


def test_proc_sys_is_hidden(iso):
    """The counter channel of issue 67: two concurrent calls of one batch signalled 96/96 bits through the machine-wide
    /proc/sys/fs/file-nr (a fresh PID/IPC namespace does not hide it). /proc/sys is an empty, unlistable tmpfs in every
    call: the counters a sender would move cannot be read (the host still reads them)."""
    with open("/proc/sys/fs/file-nr") as f:
        assert len(f.read().split()) == 3  # on the host: allocated, free, max
    res = run(
        """
        import os
        for path in ("/proc/sys/fs/file-nr", "/proc/sys/fs/inode-nr", "/proc/sys/fs/dentry-state"):
            try:
                print(path, open(path).read().split())
            except OSError as e:
                print(path, type(e).__name__)
        try:
            print(os.listdir("/proc/sys"))
        except OSError as e:
            print("/proc/sys", type(e).__name__)
        """
    )
    lines = res.stdout.splitlines()
    assert len(lines) == 4 and all(line.split()[1] in ("FileNotFoundError", "PermissionError") for line in lines), lines


# --------------------------------------------------------------------------------------------------------
# The tests of a call: no process, file or record of one reaches the next
# --------------------------------------------------------------------------------------------------------
DAEMON_THEN_LOOK = """
    import json, os, sys, time
    if sys.argv[1] == "0":
        open("/tmp/left-behind", "w").write("x")
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                while True:
                    time.sleep(1)
            os._exit(0)
        print(os.read(r, 20).decode())
        forged = json.dumps({"run": 1, "exit": 0, "cpu": 0, "limit": None, "seconds": 0})
        for fd in range(3, 256):  # a forged end record for the next test, on every fd it might have
            try:
                os.write(fd, (forged + "\\n").encode())
            except OSError:
                pass
        print(forged)
    else:  # the call's pid namespace: the supervisor (pid 1) and this test only, if test 0's daemon is gone
        others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
        print("daemon alive" if others else "daemon gone")
        print("file", os.path.exists("/tmp/left-behind"))
        raise SystemExit(3)
"""


def test_a_tests_daemon_files_and_forged_records_do_not_reach_the_next_test(iso):
    res = run(DAEMON_THEN_LOOK, runs=[SandboxRun(("main.py", "0")), SandboxRun(("main.py", "1"))])
    zero, one = res.runs
    assert zero.exit_code == 0 and zero.limit is None and zero.stdout.split()[0].isdigit()  # the daemon was up
    assert one.stdout == "daemon gone\nfile False\n", one
    assert one.exit_code == 3  # its own end, not the record test 0 forged


def test_without_namespaces_the_supervisors_channel_is_out_of_reach_too(iso):
    """The rlimits fallback (the program shares the supervisor's uid): the supervisor's fds (its channel to the
    trainer) cannot be opened through /proc; the program's own /proc entries stay readable. (As root the program's
    missing capabilities refuse it; as another user, the supervisor being non-dumpable does.)"""
    previous = sandbox.isolation().mode
    try:
        sandbox.force_isolation("rlimits")
        res = run(
            """
            import os
            print(len(os.listdir("/proc/self/fd")) >= 3)
            folder = f"/proc/{os.getppid()}/fd"
            try:
                names = os.listdir(folder)  # listable where the program's uid owns it (as root without capabilities)
            except OSError:
                names = [str(fd) for fd in range(64)]
            opened = 0
            for name in names:
                try:
                    os.close(os.open(os.path.join(folder, name), os.O_WRONLY))
                    opened += 1
                except OSError:
                    pass
            print("opened", opened)
            """
        )
        assert res.stdout.splitlines() == ["True", "opened 0"], (res.stdout, res.stderr)
    finally:
        sandbox.force_isolation(previous)


# --------------------------------------------------------------------------------------------------------
# The calls of a row: never at the same time; a lock channel between them pays nothing
# --------------------------------------------------------------------------------------------------------
def test_a_later_phase_starts_only_after_every_call_of_the_earlier_one_ended(iso):
    stamp = "import time\nprint(time.monotonic())\ntime.sleep(0.3)\nprint(time.monotonic())\n"
    calls = [SandboxCall(stamp, limits=ROOMY, phase=phase) for phase in (0, 1, 0)]
    with SandboxPool(3) as pool:
        results = pool.run(calls)
    spans = [[float(v) for v in r.stdout.split()] for r in results]
    assert spans[1][0] > max(spans[0][1], spans[2][1])


# The script call's program finds the expected value in its test's source and holds an exclusive flock on stdlib
# files for its bits; the judged call's program reads the bits by probing the locks (the reproduction).
LOCK_CHANNEL = """
import fcntl, json, os, re, time
FILES = sorted(os.path.join(os.path.dirname(os.__file__), n) for n in os.listdir(os.path.dirname(os.__file__))
               if n.endswith(".py"))[:16]
def f(x):
    try:
        runs = json.load(open("plan.json"))["runs"]
    except OSError:
        runs = []
    sources = [r["source"] for r in runs if "source" in r]
    if sources:  # the script call: publish
        value = int(re.findall(r"== \\[(\\d+)\\]", sources[0])[0])
        held = []
        for bit in range(16):
            if value >> bit & 1:
                fd = os.open(FILES[bit], os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:
                    pass
                held.append(fd)
        time.sleep(3)
        return value
    end = time.monotonic() + 3  # the judged call: listen
    while time.monotonic() < end:
        value = 0
        for bit in range(16):
            fd = os.open(FILES[bit], os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                value |= 1 << bit
            except OSError:
                pass
            os.close(fd)
        if value:
            return value
        time.sleep(0.01)
    return 0
"""


def test_rl_view_a_mixed_row_with_two_workers_pays_the_lock_channel_nothing(iso):
    # a judged test and a script test (a helper the test defines: the value path leaves it whole), scripts allowed
    truth = ["assert f(7) == 1234", "def g():\n    return [f(7)][0]\nassert g() == [1234][0]"]
    assert [code_verifier.value_check(t) is not None for t in truth] == [True, False]
    honest = "```python\ndef f(x):\n    return 1234\n```"
    settings = dataclasses.replace(SETTINGS, test_seconds=4.0, workers=2, allow_script_tests=True)
    completions = [honest, f"```python\n{LOCK_CHANNEL}```"]
    scored = rewards.score_batch(completions, [truth] * 2, "code", verification_reward=1.0, code=settings)
    assert scored.rewards == [1.0, 0.0]


# --------------------------------------------------------------------------------------------------------
# Limits per call: CPU over all processes, output in the trainer, code_test_seconds over its range
# --------------------------------------------------------------------------------------------------------
SPLIT_LOOP = """
import os
def spin(n):
    while n:
        n -= 1
def split(workers, n):  # the loop shared by forked workers: each under the per-process limit
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            spin(n // workers)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
def chain(links, n):  # each link forks the next and waits for it; each spins its share: none passes the limit alone
    first = os.getpid()
    for _ in range(links):
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            break
        spin(n // links)
    if os.getpid() != first:
        os._exit(0)
"""


def spin_steps(seconds: float) -> int:
    """Loop steps of SPLIT_LOOP's spin that take about `seconds` of CPU here (timed in this process, over at least
    0.2 s of CPU so that one descheduling or a cold cache does not skew the rate)."""
    namespace: dict = {}
    exec(SPLIT_LOOP, namespace)
    n = 200_000
    while True:
        start = time.process_time()
        namespace["spin"](n)
        used = time.process_time() - start
        if used >= 0.2:
            return int(n * seconds / used)
        n *= 2


@pytest.mark.parametrize("mode", ["namespaces", "rlimits"])
def test_cpu_time_is_summed_over_forks(iso, mode):
    """6 forked workers or a chain of 6 forks, 3.4 s of CPU together, under a 1 s CPU limit: cpu_time; the same
    work cut to 0.3 s passes (the honest control)."""
    previous = sandbox.isolation().mode
    try:
        sandbox.force_isolation(mode)
        # a wall limit no load reaches: the CPU limit, not the wall, must be what ends the big loops
        limits = dataclasses.replace(ROOMY, cpu_seconds=1, wall_seconds=600.0)
        big, small = spin_steps(3.4), spin_steps(0.3)
        for shape in ("split(6, {n})", "chain(6, {n})"):
            over = run(SPLIT_LOOP + shape.format(n=big), limits=limits)
            assert over.limit == "cpu_time", (shape, over)
            assert over.cpu_seconds < 1 + 0.5, over.cpu_seconds  # stopped near the limit, not after the work
            fine = run(SPLIT_LOOP + shape.format(n=small), limits=limits)
            assert fine.limit is None and fine.exit_code == 0, (shape, fine)
    finally:
        sandbox.force_isolation(previous)


@pytest.mark.parametrize("mode", ["namespaces", "rlimits"])
def test_a_child_that_spins_past_the_limit_fails_its_parent(iso, mode):
    """A forked child spins without end under a 1 s CPU limit while its parent waits to print the right answer: the
    run is cpu_time and the parent is ended with it. (With each process's RLIMIT_CPU at the run's limit, the kernel
    killed the child at 1.0 s, the parent printed its answer, and only the summed CPU, 1.02 s, kept the run from
    passing: a CI run on a loaded machine passed such a run.)"""
    previous = sandbox.isolation().mode
    try:
        sandbox.force_isolation(mode)
        limits = dataclasses.replace(ROOMY, cpu_seconds=1, wall_seconds=600.0)
        program = "import os\npid = os.fork()\nif pid == 0:\n    while True:\n        pass\n"
        program += "os.waitpid(pid, 0)\nprint(2)\n"
        res = run(program, limits=limits)
        # ended by the supervisor near the limit, the parent with it: it never prints its answer
        assert res.limit == "cpu_time" and res.stdout == "", res
        assert 1 <= res.cpu_seconds < 1 + 0.5, res.cpu_seconds
    finally:
        sandbox.force_isolation(previous)


def test_forked_cpu_is_refused_on_the_value_and_stdio_paths(iso):
    """Work split over forks past the CPU limit is a timeout on both paths (value: 2 s, stdio: 1 s of CPU at
    test_seconds 1); a small share passes. The big work is 4x the value path's limit: a step's CPU cost may differ
    between this process's timing and the sandboxed run (another run on the core's sibling, frequency), and at 3.4 s
    a run timed 1.7x slower here than there stayed under 2 s and passed (a CI run on a loaded 2-core machine). The
    sandbox stops it at the limit, so the size costs no time."""
    big, small = spin_steps(8.0), spin_steps(0.05)
    value_truth, stdio_truth = ["assert f(1) == 2"], [{"input": "1\n", "output": "2\n"}]
    programs = []
    for n in (big, small):
        for call in ("split(6, {n})", "chain(6, {n})"):
            work = call.format(n=n)
            programs.append((SPLIT_LOOP + f"def f(x):\n    {work}\n    return x + 1\n", value_truth))
            programs.append((SPLIT_LOOP + f"{work}\nprint(int(input()) + 1)\n", stdio_truth))
    outcomes = code_verifier.score_programs([p for p, _ in programs], [t for _, t in programs], SETTINGS)
    statuses = [o.statuses[0] for o in outcomes]
    assert statuses[:4] == ["timeout"] * 4 and statuses[4:] == ["pass"] * 4, statuses


def test_trainer_memory_is_bounded_by_the_output_cap_per_test(iso):
    """8 stdio tests each printing 1 MB of invalid UTF-8 (the worst case for escaping): the trainer holds each test's
    capped bytes and their decoded text (1 + 2 bytes a character of U+FFFD), never an escaped copy (6 bytes a byte
    before)."""
    tests = 8
    truth = [{"input": f"{i}\n", "output": "no\n"} for i in range(tests)]
    program = "import sys\nsys.stdout.buffer.write(b'\\xff' * (1 << 20))\n"
    tracemalloc.start()
    try:
        outcome = code_verifier.score_programs([program], [truth], SETTINGS)[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.statuses == ["wrong_answer"] * tests
    per_test = (1 << 20) * (1 + 2)  # the capped bytes and their decoded text
    assert peak < tests * per_test + (8 << 20), peak / tests / 2**20  # 18 MB a test before (6 bytes a byte, twice)


def test_a_run_can_have_a_lower_output_cap_than_its_call(iso):
    res = run("print('x' * 5000)", runs=[SandboxRun(max_output_bytes=1000), SandboxRun()])
    assert [(r.limit, len(r.stdout)) for r in res.runs] == [("output", 1000), (None, 5001)]


def test_a_calls_total_output_cap_cuts_the_run_that_passes_it(iso):
    """Three runs printing 5001 bytes each under a call-wide cap of 12000: the first two are kept whole, the third is
    cut to what was left (1998 bytes) and ends as "output"; nothing past the cap is held."""
    limits = dataclasses.replace(ROOMY, max_total_output_bytes=12000)
    res = run("print('x' * 5000)", limits, runs=[SandboxRun()] * 3)
    assert [(r.limit, len(r.stdout)) for r in res.runs] == [(None, 5001), (None, 5001), ("output", 1998)]


@pytest.mark.parametrize("test_seconds", [0.5, 6.0, 12.0, 30.0])
def test_code_test_seconds_over_its_range_scores_an_honest_program(iso, test_seconds):
    settings = dataclasses.replace(SETTINGS, test_seconds=test_seconds)
    truths = [["assert f(1) == 2"], [{"input": "1\n", "output": "2\n"}]]
    programs = ["def f(x):\n    return x + 1\n", "print(int(input()) + 1)\n"]
    outcomes = code_verifier.score_programs(programs, truths, settings)
    assert [o.statuses for o in outcomes] == [["pass"], ["pass"]]


def test_tool_runs_get_the_same_filter(iso):
    out, err, status = sandbox.python_runtime(textwrap.dedent(CHANNELS), 30.0)
    assert status == "ok" and "ALLOWED" not in out and out.count("refused") == len(NAMES), (out, err)
