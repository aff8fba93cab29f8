"""OpenEnv environments (openenv-core, `pip install openenv-core`): an OpenEnv server's episodes as this repo's
multi-turn environments (environments.py), through OpenEnv's own client (one WebSocket session per episode).

    # my_envs.py
    from open_instruct.openenv_env import OpenEnvEnvironment

    class Echo(OpenEnvEnvironment):
        app = "echo_env.server.app:app"        # the run starts one server for this class (or: url = "http://...")
        action_field = "message"               # the policy's turn becomes {"message": text}
        observation_field = "echoed_message"   # what of the observation the policy sees next

    --environment my_envs.py:Echo

- `url`: a running server (http:// or ws://); `app`: an ASGI app spec (`module:attribute`, importable from the
  run's folder or PYTHONPATH, e.g. an OpenEnv package's `server.app:app`): the run starts it once per process with
  uvicorn on a free loopback port, waits for `GET /health` (`startup_timeout`), and stops it when the process ends;
  the server also exits by itself when the process that started it is gone (even after a SIGKILL), so it is never
  left behind.
- Each episode (`reset`) opens a session (`client_class`, default OpenEnv's GenericEnvClient: plain dicts; give
  an environment's typed EnvClient subclass for typed actions and observations) and calls the server's reset
  with `reset_kwargs(example)`; each turn is one `step(action(text))`; the step's reward is the turn's reward (in
  verifier units: 1 = right) and its `done` ends the episode (the session is closed then, or when the environment
  object is dropped).
- Observations: `first_observation(example, observation)` (default: the row's messages, then the observation's
  text as a user turn when there is one) and `observation(observation)` (default: a user turn with the text) turn
  OpenEnv observations into chat messages; override them for anything else.
- A server that is gone (refused, closed, or the one the run started has exited) raises a RuntimeError saying so
  (the run stops naming the environment, the method and the row), never a silent reward of 0.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from typing import Any, Optional

from open_instruct.environments import Environment, Observation, StepResult
from open_instruct.errors import ConfigError

INSTALL_HINT = "OpenEnv environments need openenv-core: pip install openenv-core"
_SERVERS: dict[str, "Server"] = {}
_SERVERS_LOCK = threading.Lock()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Server:
    """One OpenEnv server process started by this process (`python -m open_instruct.openenv_env APP PORT PARENT`)."""

    def __init__(self, app: str, startup_timeout: float) -> None:
        self.app, self.port = app, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # the server's output, quoted when it fails to start
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "open_instruct.openenv_env", app, str(self.port), str(os.getpid())],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
        atexit.register(self.stop)
        deadline = time.monotonic() + startup_timeout
        while not health_ok(self.url, timeout=1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"OpenEnv server {app!r} exited with code {self.proc.returncode} while starting: {self.output()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"OpenEnv server {app!r} did not answer {self.url}/health in {startup_timeout:g} s")
            time.sleep(0.1)  # poll the health endpoint

    def output(self, chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:].strip()

    def gone(self) -> Optional[str]:
        """Why the server is unusable, or None."""
        code = self.proc.poll()
        return None if code is None else f"the OpenEnv server {self.app!r} the run started exited (code {code})"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def server_for(app: str, startup_timeout: float) -> Server:
    """The one server of `app` in this process, started on first use."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(app)
        if server is None or server.gone():
            server = _SERVERS[app] = Server(app, startup_timeout)
        return server


def stop_servers() -> None:
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


def _text(observation: Any, field: str) -> str:
    value = observation.get(field) if isinstance(observation, dict) else getattr(observation, field, None)
    return "" if value is None else str(value)


URL_SCHEMES = ("http", "https", "ws", "wss")


def check_url(url: Any, where: str) -> None:
    """ConfigError unless `url` is an http(s):// or ws(s):// address with a host: `localhost:8000` would otherwise
    read as scheme `localhost` and fail later as a server that is "not answering"."""
    if not isinstance(url, str):
        raise ConfigError(f"{where} must be a server address such as http://localhost:8000, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    if "://" not in url:
        raise ConfigError(f"{where} {url!r} has no scheme: add http:// (http://{url})")
    if parts.scheme not in URL_SCHEMES or not parts.netloc:
        raise ConfigError(f"{where} {url!r} is not an {', '.join(s + '://' for s in URL_SCHEMES)} address with a host")


class OpenEnvEnvironment(Environment):
    """An OpenEnv server's environment (module docstring). Subclasses set `url` or `app` and the fields."""

    url: Optional[str] = None
    app: Optional[str] = None
    client_class: Any = None  # default openenv.core.GenericEnvClient
    action_field: str = "message"
    observation_field: str = "message"
    startup_timeout: float = 120.0
    message_timeout: float = 60.0

    def __init__(self) -> None:
        if (self.url is None) == (self.app is None):
            raise ConfigError(f"{type(self).__name__}: set exactly one of url (a running server) and app (to start)")
        if self.url is not None:
            check_url(self.url, f"{type(self).__name__}.url")
        try:
            import openenv.core  # noqa: F401
        except ImportError:
            raise ConfigError(f"{type(self).__name__}: {INSTALL_HINT}") from None
        self.server = server_for(self.app, self.startup_timeout) if self.app else None
        self.base_url = self.server.url if self.server else self.url
        self.client: Any = None

    # ---- what a subclass may override -------------------------------------------------------------------------
    def reset_kwargs(self, example: dict[str, Any]) -> dict[str, Any]:
        return {}

    def action(self, text: str) -> Any:
        return {self.action_field: text}

    def first_observation(self, example: dict[str, Any], observation: Any) -> Observation:
        text = _text(observation, self.observation_field)
        messages = list(example.get("messages") or [])
        return messages + ([{"role": "user", "content": text}] if text else [])

    def observation(self, observation: Any) -> Observation:
        return [{"role": "user", "content": _text(observation, self.observation_field)}]

    # ---- the Environment contract -----------------------------------------------------------------------------
    def reset(self, example: dict[str, Any]) -> Observation:
        self._close()
        client_class = self.client_class
        if client_class is None:
            from openenv.core import GenericEnvClient as client_class
        try:
            self.client = client_class(base_url=self.base_url, message_timeout_s=self.message_timeout).sync()
            weakref.finalize(self, _close_client, self.client)
            result = self.client.reset(**self.reset_kwargs(example))
        except Exception as e:
            raise self._gone(e) from None
        return self.first_observation(example, result.observation)

    def step(self, action: str) -> StepResult:
        if self.client is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset")
        try:
            result = self.client.step(self.action(action))
        except Exception as e:
            raise self._gone(e) from None
        done = bool(result.done)
        reward = float(result.reward or 0.0)
        if done:
            self._close()
        return StepResult(None if done else self.observation(result.observation), reward, done, {})

    def _gone(self, error: Exception) -> RuntimeError:
        why = (self.server.gone() if self.server else None) or (
            f"the OpenEnv server at {self.base_url} is not answering" if not health_ok(self.base_url) else None
        )
        detail = f"{type(error).__name__}: {error}"
        return RuntimeError(f"{why} ({detail})" if why else f"OpenEnv session at {self.base_url} failed: {detail}")

    def _close(self) -> None:
        if self.client is not None:
            _close_client(self.client)
            self.client = None


def _close_client(client: Any) -> None:
    try:
        client.close()
    except Exception:  # a session whose server is gone has nothing to close
        pass


def _serve(app: str, port: int, parent: int) -> None:
    """The server process: uvicorn on 127.0.0.1:port, exiting when `parent` (the run's process) is gone."""
    import uvicorn

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
