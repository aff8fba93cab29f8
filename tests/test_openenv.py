"""OpenEnv servers as environments (open_instruct/openenv_env.py): an OpenEnv environment defined here, served by
openenv-core's own app on loopback (started by the adapter, or given by URL), played through OpenEnv's client; a
server that dies gives a clear error, and no server outlives the process that started it, even one SIGKILLed.
Skipped where openenv-core is not installed (an optional extra)."""

import json
import os
import select
import signal
import subprocess
import sys

import pytest

pytest.importorskip("openenv.core")

from open_instruct import openenv_env  # noqa: E402
from open_instruct.errors import ConfigError  # noqa: E402
from open_instruct.openenv_env import OpenEnvEnvironment, Server  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.concurrency
GONE_WITHIN = 60.0  # seconds to wait for a process to end: the event (pidfd) comes far sooner; scheduling slack

COUNT_ENV = '''
import json, os
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

if os.environ.get("COUNT_ENV_PIDS"):
    with open(os.environ["COUNT_ENV_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")


class CountAction(Action):
    message: str


class CountObservation(Observation):
    message: str = ""


class CountEnvironment(Environment):
    """Two turns; each turn's reward is 1 when the message's length is a multiple of 3."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.turns, self.session = 0, os.urandom(4).hex()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.turns = 0
        return CountObservation(message="Say something.", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        self.turns += 1
        reward = float(len(action.message) % 3 == 0)
        done = self.turns >= 2
        if os.environ.get("COUNT_ENV_STEPS"):
            with open(os.environ["COUNT_ENV_STEPS"], "a") as f:
                f.write(json.dumps({"session": self.session, "message": action.message, "reward": reward,
                                    "done": done}) + "\\n")
        return CountObservation(message=f"You wrote {len(action.message)} characters.", done=done, reward=reward)

    @property
    def state(self):
        return State(step_count=self.turns)


app = create_app(CountEnvironment, CountAction, CountObservation, env_name="count", max_concurrent_envs=64)
'''

USER_ENVS = """
from open_instruct.openenv_env import OpenEnvEnvironment


class Count(OpenEnvEnvironment):
    app = "count_env:app"
"""


@pytest.fixture
def env_folder(tmp_path, monkeypatch):
    (tmp_path / "count_env.py").write_text(COUNT_ENV)
    (tmp_path / "my_envs.py").write_text(USER_ENVS)
    monkeypatch.chdir(tmp_path)  # the started server imports count_env from the run's folder
    monkeypatch.setenv("COUNT_ENV_PIDS", str(tmp_path / "pids.txt"))
    yield tmp_path
    openenv_env.stop_servers()


def wait_gone(pid: int, timeout: float = GONE_WITHIN) -> bool:
    """True once process `pid` has ended (waited on as an event: its pidfd becomes readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


class Count(OpenEnvEnvironment):
    app = "count_env:app"


def test_episodes_through_a_server_the_run_started(env_folder):
    env = Count()
    assert env.reset({"messages": [{"role": "user", "content": "hi"}]}) == [
        {"role": "user", "content": "hi"}, {"role": "user", "content": "Say something."}
    ]  # fmt: skip
    first = env.step("abc")
    assert first.observation == [{"role": "user", "content": "You wrote 3 characters."}]
    assert (first.reward, first.done) == (1.0, False)
    assert env.step("abcd")[1:3] == (0.0, True)
    other = Count()  # a second episode: the same server, its own session
    assert other.server is env.server and other.reset({}) == [{"role": "user", "content": "Say something."}]
    (pid,) = map(int, open(env_folder / "pids.txt").read().split())
    assert pid == env.server.proc.pid
    openenv_env.stop_servers()  # what the process's exit does: nothing left behind
    assert wait_gone(pid)


def test_a_server_given_by_url_and_one_that_is_gone(env_folder):
    server = Server("count_env:app", startup_timeout=120.0)

    class ByUrl(OpenEnvEnvironment):
        url = server.url

    env = ByUrl()
    env.reset({})
    assert env.step("xy").reward == 0.0
    server.stop()
    with pytest.raises(RuntimeError, match=f"the OpenEnv server at {server.url} is not answering"):
        env.step("xyz")


def test_a_killed_server_gives_a_clear_error(env_folder):
    env = Count()
    env.reset({})
    os.kill(env.server.proc.pid, signal.SIGKILL)
    env.server.proc.wait()
    with pytest.raises(RuntimeError, match=r"the OpenEnv server 'count_env:app' the run started exited \(code -9\)"):
        env.step("abc")


def test_no_server_outlives_a_killed_trainer(env_folder):
    """A process that started a server is SIGKILLed (no atexit runs): the server notices and exits."""
    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys; from open_instruct.openenv_env import server_for\n"
         "server_for('count_env:app', 120.0); print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    assert starter.stdout.readline().strip() == "up"
    (pid,) = map(int, open(env_folder / "pids.txt").read().split())
    starter.kill()
    starter.wait()
    assert wait_gone(pid)


def test_an_openenv_environment_trains_for_a_few_steps(env_folder, tiny_models, monkeypatch):
    """A tiny RLVR run on the server the run starts: every episode's score is the server's reward of its last
    step (TRL's GRPO defaults: verification_reward 1, no non-stop penalty); after the run the server is gone."""
    steps_log = env_folder / "steps.jsonl"
    monkeypatch.setenv("COUNT_ENV_STEPS", str(steps_log))
    rows = env_folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Task {i}"}], "ground_truth": "0",
                                        "dataset": "arithmetic"}) + "\n"
                            for i in range(4)))  # fmt: skip
    out = env_folder / "out"
    args = [
        os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"),
        "--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", str(rows),
        "--environment", "my_envs.py:Count", "--output_dir", str(out), "--total_episodes", "16",
        "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2", "--per_device_train_batch_size", "8",
        "--response_length", "100", "--max_turn_tokens", "6", "--max_turns", "3", "--max_prompt_length", "64",
        "--logging_steps", "1", "--save_final_model", "false", "--num_samples_logged", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, *args], cwd=env_folder, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    train = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    steps = [json.loads(line) for line in open(steps_log)]
    sessions: dict[str, list] = {}
    for s in steps:
        sessions.setdefault(s["session"], []).append(s)
    played = [v for v in sessions.values() if v[-1]["done"]]  # the start-up check's one step("") never ends
    assert len(played) == 16 and all(len(v) == 2 for v in played)
    last_rewards = [v[-1]["reward"] for v in played]
    score_sum = sum(r["train/score_mean"] for r in train) * 8  # 8 episodes per rollout
    assert score_sum == pytest.approx(sum(last_rewards), abs=1e-6)
    (pid,) = map(int, open(env_folder / "pids.txt").read().split())
    assert wait_gone(pid)


def test_a_server_that_cannot_start_says_why(env_folder):
    message = "OpenEnv server 'no_such_module:app' exited with code \\d+ while starting: .*no_such_module"
    with pytest.raises(RuntimeError, match=message):  # uvicorn's own reason quoted
        Server("no_such_module:app", startup_timeout=120.0)


def test_typed_actions_and_observations_through_the_environments_own_client(env_folder, monkeypatch):
    """An environment's typed client (an EnvClient subclass, as OpenEnv packages ship): the policy's turn becomes
    the typed action, the observation comes back typed and is read by attribute."""
    from openenv.core import EnvClient
    from openenv.core.client_types import StepResult

    monkeypatch.syspath_prepend(str(env_folder))
    from count_env import CountAction, CountObservation

    class CountClient(EnvClient):
        def _step_payload(self, action):
            return action.model_dump()

        def _parse_result(self, payload):
            observation = CountObservation(**payload["observation"], done=payload["done"], reward=payload["reward"])
            return StepResult(observation=observation, reward=payload["reward"], done=payload["done"])

        def _parse_state(self, payload):
            return payload

    class TypedCount(Count):
        client_class = CountClient

        def action(self, text):
            return CountAction(message=text.upper())

    env = TypedCount()
    assert env.reset({}) == [{"role": "user", "content": "Say something."}]
    assert env.step("abcdef") == ([{"role": "user", "content": "You wrote 6 characters."}], 1.0, False, {})
    assert env.step("ab")[1:3] == (0.0, True)


@pytest.mark.parametrize(
    "url, message",
    [
        ("localhost:8000", "Echo.url 'localhost:8000' has no scheme: add http:// (http://localhost:8000)"),
        ("127.0.0.1:8000/v1", "has no scheme: add http:// (http://127.0.0.1:8000/v1)"),
        ("ftp://host:21", "'ftp://host:21' is not an http://, https://, ws://, wss:// address with a host"),
        ("http://", "'http://' is not an http://, https://, ws://, wss:// address with a host"),
    ],
)
def test_a_url_without_a_scheme_is_refused_saying_to_add_it(url, message):
    """Not "not answering" at the first episode: refused when the environment is made (issue 69)."""
    echo = type("Echo", (OpenEnvEnvironment,), {"url": url})
    with pytest.raises(ConfigError) as e:
        echo()
    assert message in str(e.value)
    openenv_env.check_url("http://localhost:8000", "url")
    openenv_env.check_url("ws://127.0.0.1:9/ws", "url")
