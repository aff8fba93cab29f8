"""Run the training scripts as real processes, cheaply, and crash them at chosen moments (tests/test_reliability.py).

A `Zygote` is a Python process that imports torch, transformers and the four training scripts once (~15-20 s on a
loaded 2-core machine) and then forks one fresh child per run. Each child is a real OS process running the script's
entry point, `runtime.run(main, argv)` (what `python open_instruct/<script>.py ...` runs), with its own stdout/stderr
log, so a SIGKILL or SIGTERM sent to it behaves as on a cluster node. The zygote itself is single-threaded and never
runs a torch op, so forking it is safe; each child starts from the same freshly imported state.

Crash points inside a child come from two places:
  - `OPEN_INSTRUCT_FAULT` in the child's environment (open_instruct/run_dir.py `fault_point`: during checkpoint
    and final_model writes, weight syncs, metrics rows); with `:stop` the child stops itself at that point instead
    (`stop_at`, `wait_until_stopped`, `Run.signal_at_stop`), so a signal lands exactly there, not wherever the
    scheduler let the run get to;
  - `faults` installed in the child before the script starts (test-only wrappers, nothing in the product code):
    `{"kill_in_generation": {"call": k, "forward": m}}` SIGKILLs the child at the m-th model forward (decoding step)
    of its k-th generate() call; `{"kill_in_reference_pass": {"forward": m}}` at the m-th forward of DPO's reference
    log-prob pass.

    python tests/_reliability_helpers.py --zygote     # the server side (started by Zygote())
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("sft", "reward_model", "dpo", "rlvr_ppo")


# ---------------------------------------------------------------------------------------------------------------------
# Test side


def stop_at(point: str, step: Optional[int] = None) -> dict[str, str]:
    """The environment that makes a run SIGSTOP itself at fault point `point` (at `step`, when given), once."""
    return {"OPEN_INSTRUCT_FAULT": f"{point}{f':step_{step}' if step is not None else ''}:stop"}


def process_state(pid: int) -> Optional[str]:
    """The state letter of /proc/<pid>/stat (R, S, T for stopped, Z ...), None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def wait_until_stopped(pid: int, timeout: float = 600.0, log: Callable[[], str] = lambda: "") -> None:
    """Wait for the event "the run stopped itself at its fault point" (`stop_at`); fails if it ends first."""
    deadline = time.monotonic() + timeout
    while (state := process_state(pid)) not in ("T", "t"):
        if state in (None, "Z", "X"):
            raise AssertionError(f"process {pid} ended before its stop point; log:\n{log()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not reach its stop point in {timeout:.0f} s; log:\n{log()[-3000:]}")
        time.sleep(0.01)


def signal_stopped(pid: int, sig: int, delay: float = 0.0) -> None:
    """Send `sig` to a run stopped at its fault point. SIGKILL: `delay` s after letting it go on (a random moment
    after the point); any other signal is queued while it is stopped, so it lands exactly at the point."""
    if sig == signal.SIGKILL:
        os.kill(pid, signal.SIGCONT)
        time.sleep(delay)
        os.kill(pid, sig)
    else:
        assert delay == 0.0, "a signal other than SIGKILL lands at the stop point itself"
        os.kill(pid, sig)
        os.kill(pid, signal.SIGCONT)


class Zygote:
    def __init__(self, start_timeout: float = 600.0) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "offline",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("OPEN_INSTRUCT_FAULT", None)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
            text=True,
            bufsize=1,
        )
        reply = self._read(start_timeout)
        assert reply.get("ready"), reply

    def _read(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"zygote did not answer within {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"zygote exited (code {self.proc.poll()})")
        return json.loads(line)

    def _ask(self, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def spawn(
        self,
        script: str,
        argv: list[str],
        log: str,
        env: Optional[dict[str, str]] = None,
        faults: Optional[dict[str, Any]] = None,
    ) -> int:
        """Start `script` (one of SCRIPTS) in a fresh child; its stdout and stderr go to `log`. Returns its pid."""
        return self._ask(
            {"op": "spawn", "script": script, "argv": argv, "log": log, "env": env or {}, "faults": faults or {}}
        )["pid"]

    def wait(self, pid: int, timeout: float) -> Optional[int]:
        """Exit code of child `pid` (negative: killed by that signal), or None if still running after `timeout`."""
        return self._ask({"op": "wait", "pid": pid, "timeout": timeout}, timeout + 60)["returncode"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # its loop ends; its children have all been waited for
            try:
                self.proc.wait(2)  # interpreter shutdown with torch loaded can take seconds on a loaded machine
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Run:
    """One child process of a Zygote."""

    def __init__(
        self,
        zygote: Zygote,
        script: str,
        argv: list[str],
        log: str,
        env: Optional[dict[str, str]] = None,
        faults: Optional[dict[str, Any]] = None,
    ) -> None:
        self.zygote, self.log = zygote, log
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        self.pid = zygote.spawn(script, argv, log, env, faults)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float = 300.0) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, timeout)
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            self.zygote.wait(self.pid, 30)
            raise TimeoutError(f"run {self.pid} still going after {timeout:.0f} s; log:\n{self.output()[-3000:]}")
        return self.returncode

    def kill_after(self, seconds: float) -> bool:
        """SIGKILL the run if it is still going after `seconds`; True if it was killed, False if it had ended (0)."""
        self.returncode = self.zygote.wait(self.pid, seconds)
        if self.returncode is not None:
            assert self.returncode == 0, self.output()[-3000:]
            return False
        os.kill(self.pid, signal.SIGKILL)
        self.returncode = self.zygote.wait(self.pid, 60)
        if self.returncode == 0:  # it ended on its own between the wait's timeout and the kill (seen in CI)
            return False
        assert self.returncode == -signal.SIGKILL, (self.returncode, self.output()[-3000:])
        return True

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def signal_at_stop(self, sig: int, delay: float = 0.0, timeout: float = 300.0) -> None:
        """The run was started with `stop_at(...)`: wait until it stops there, then `signal_stopped`."""
        wait_until_stopped(self.pid, timeout, self.output)
        signal_stopped(self.pid, sig, delay)


def read_rows(output_dir: str, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """Complete rows of a jsonl file being appended to (a torn last line is not a row yet)."""
    path = os.path.join(output_dir, name)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            rows.append(json.loads(line))
    return rows


def assert_same_rows(expected: list[dict[str, Any]], got: list[dict[str, Any]], rel: float = 1e-6) -> None:
    """training_helpers.assert_rows_match, imported here lazily: the zygote process sets sys.path up first."""
    from training_helpers import assert_rows_match

    assert_rows_match(expected, got, rel)


def assert_same_weights(a_dir: str, b_dir: str, atol: float = 1e-6) -> None:
    """training_helpers.assert_weights_match, imported lazily as in assert_same_rows."""
    from training_helpers import assert_weights_match

    assert_weights_match(a_dir, b_dir, atol)


# ---------------------------------------------------------------------------------------------------------------------
# Server side (runs in the zygote and its children)


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _install_faults(faults: dict[str, Any]) -> None:
    """Test-only crash points inside a child (see the module docstring)."""

    def kill_at_forward(model: Any, n: int) -> None:
        seen = {"n": 0}

        def hook(module: Any, args: Any, output: Any) -> None:
            seen["n"] += 1
            if seen["n"] >= n:
                os.kill(os.getpid(), signal.SIGKILL)

        model.register_forward_hook(hook)

    if "kill_in_generation" in faults:
        from open_instruct import generation

        spec, original, calls = faults["kill_in_generation"], generation.HFGenerator.generate, {"n": 0}

        def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == spec["call"]:
                kill_at_forward(self.model, spec["forward"])
            return original(self, *args, **kwargs)

        generation.HFGenerator.generate = generate
    if "kill_in_reference_pass" in faults:
        from open_instruct import reference_cache

        spec, original_ref = faults["kill_in_reference_pass"], reference_cache.compute_reference

        def compute_reference(model: Any, *args: Any, **kwargs: Any) -> Any:
            kill_at_forward(model, spec["forward"])
            return original_ref(model, *args, **kwargs)

        reference_cache.compute_reference = compute_reference


def _child(request: dict[str, Any], modules: dict[str, Any]) -> None:
    code = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # never read the zygote's request pipe
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.update(request["env"])
        _install_faults(request["faults"])
        from open_instruct import runtime

        try:
            runtime.run(modules[request["script"]].main, request["argv"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    sys.path.insert(0, REPO)
    import importlib

    import torch  # noqa: F401  (imported once here, inherited by every child)
    import transformers  # noqa: F401

    modules = {name: importlib.import_module(f"open_instruct.{name}") for name in SCRIPTS}
    import transformers.models.llama.modeling_llama  # noqa: F401

    import open_instruct.checkpoint  # noqa: F401
    import open_instruct.generation  # noqa: F401

    _send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, modules)
            _send({"pid": pid})
        elif request["op"] == "wait":
            deadline = time.monotonic() + request["timeout"]
            while True:
                done, status = os.waitpid(request["pid"], os.WNOHANG)
                if done:
                    _send({"returncode": os.waitstatus_to_exitcode(status)})
                    break
                if time.monotonic() >= deadline:
                    _send({"returncode": None})
                    break
                time.sleep(0.02)


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _serve()
