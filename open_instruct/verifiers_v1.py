"""`verifiers.v1` environments (verifiers 0.4.x: an `Env` of `Task`s from a `Taskset`, played by an agent `Harness`
through a model client), run as this repo's RL episodes. The earlier API (0.1-0.3) is verifiers_env.py; the same
spec picks this module when the installed verifiers is 0.4.x:

    --dataset_name_or_path 'verifiers:my_env.py?num_tasks=200' --environment 'verifiers:my_env.py?num_tasks=200'

`verifiers:<module or path/to/file.py>[?key=value&...]`: the module (its Taskset exported through `__all__`, the
v1 plugin rule; a Harness it exports is the taskset's default harness, else verifiers_v1_chat.py's offline chat
harness) is loaded as the env's taskset, on v1's subprocess runtime. A key without
a dot is a field of the taskset's config (`num_tasks=200`); a dotted key is a path in the env's config
(`agent.harness.id=my_harness`, `agent.timeout.rollout=60`); `renderer.<field>` sets the client's renderer config
(`renderer.name=default&renderer.tool_parser=qwen3`).

Unlike the earlier API, v1's harness owns the episode loop (its program asks the model through verifiers'
interception server and its training client, which renders each request with a `renderers` renderer and calls a
vLLM-style `POST /inference/v1/generate` with token ids). So the run serves that endpoint itself
(`GenerateServer`, loopback, a free port) from its own generator, and plays episodes the other way round:

    play:   every row's n episodes start together (Env.run_episode on one event-loop thread); each request the
            harnesses send waits until every running episode is waiting on the model or has ended, then they are
            generated as one generator.generate call (a round; its seed from the rollout's seed and the round), each
            cut after its first stop token id; the sampled ids and log-probs go back as the endpoint's answer
    splice: a request that re-sends its session's last answer (v1's default renderer re-renders the whole history
            from its text every turn, and sampled ids need not re-tokenize to themselves) is generated from the
            history as sampled: where the client's ids extend what it sent last and the re-rendered answer has the
            sampled answer's text, the sampled ids stand in for it (verifiers_v1_play.V1Run.splice)
    build:  each episode is the stream of its first request's conversation, from the endpoint's own records
            (verifiers_v1_play.py): the first request's prompt ids are the prompt; each answer the generator
            sampled is policy tokens (its log-probs and weight versions), the ids between answers (tool results,
            user turns, template scaffolding) observation tokens; an answer off that stream (a harness that rewrote
            its history) is counted (truncated/untrained_turns), not trained
    score:  the trace's rewards (v1's weighted `@reward` functions: the score is their weighted sum) on the last
            turn; each reward's score and each `@metric` logged as `train/metric_<name>`

Budgets are the endpoint's: a request past `max_turns` calls or with no room left in `response_length` is answered
with no tokens and finish_reason "length" (the episode ends as the harness ends it, marked by the budget);
`max_turn_tokens` caps each call. `environment_timeout` bounds each stretch in which no episode asks the model or
ends (the environment's own work: setup, tools, the harness, scoring).
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional, Sequence

from open_instruct.errors import ConfigError, DataError
from open_instruct.user_code import load_module
from open_instruct.verifiers_env import VERIFIER, parse

MODEL_NAME = "policy"  # the model name the harnesses ask for (the endpoint serves only the run's policy)
SESSION_HEADER = "X-Session-ID"  # verifiers' training client sends the trace id with every request
LOCAL_RUNTIME = "subprocess"  # v1's runtime on this machine; the others are remote services or pull images

# An environment written against the earlier API (0.1-0.3) under 0.4, which has only verifiers.v1
EARLIER_API_HINT = ("install verifiers==0.3.1 for this style, or port it to v1 "
                    "(docs/environments.md#porting-an-earlier-api-environment-to-v1)")  # fmt: skip

_LOADED: dict[str, "Source"] = {}
_LOCK = threading.Lock()


# -----------------------------------------------------------------------------------------------------------------
# Loading: the spec -> the env config, the env, its tasks as rows


@dataclass
class Source:
    """One spec's loaded env: the env, its tasks (in load order) and the client's renderer config."""

    spec: str
    env: Any
    tasks: list[Any]
    renderer: Optional[dict[str, Any]] = None


def _nested(pairs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def load(spec: str, where: str = "environment") -> Source:
    """The spec's env, loaded once per process: its module imported, its taskset built and iterated, the harness
    on v1's subprocess runtime (others are refused), the offline chat harness when the module exports none."""
    spec = spec.strip()
    with _LOCK:
        if spec in _LOADED:
            return _LOADED[spec]
        import verifiers.v1 as vf

        from open_instruct.verifiers_v1_chat import HARNESS_ID, V1_DEFAULT_HARNESSES

        target, kwargs = parse(spec, where)
        try:
            module = load_module(target, f"{where} {spec!r}")
        except ConfigError as e:
            if "'verifiers'" in str(e):  # `vf.Rubric` / `from verifiers import SingleTurnEnv`: the earlier API's names
                raise ConfigError(f"{e}; {EARLIER_API_HINT}") from None
            raise
        exported = [getattr(module, name, None) for name in getattr(module, "__all__", [])]
        if not any(isinstance(obj, type) and issubclass(obj, vf.Taskset) for obj in exported):
            if callable(getattr(module, "load_environment", None)):
                raise ConfigError(f"{where} {spec!r}: {target} is an environment in verifiers' earlier API "
                                  f"(load_environment() returning a SingleTurnEnv, MultiTurnEnv or ToolEnv), which "
                                  f"verifiers {vf_version()} does not have: {EARLIER_API_HINT}")  # fmt: skip
            raise ConfigError(f"{where} {spec!r}: {target} exports no verifiers.v1 Taskset subclass in __all__ "
                              "(v1's plugin rule: __all__ = ['MyTaskset'])")  # fmt: skip
        renderer = {k[len("renderer.") :]: v for k, v in kwargs.items() if k.startswith("renderer.")}
        taskset = {k: v for k, v in kwargs.items() if "." not in k}
        env_keys = _nested({k: v for k, v in kwargs.items() if "." in k and not k.startswith("renderer.")})
        runtime = env_keys.get("agent", {}).get("runtime", {}).get("type", LOCAL_RUNTIME)
        if runtime != LOCAL_RUNTIME:
            raise ConfigError(f"{where} {spec!r}: agent.runtime.type {runtime}: runs here are offline and use v1's "
                              "subprocess runtime (prime, modal and e2b are remote services; docker, podman and "
                              "apptainer pull images)")  # fmt: skip
        data = {**env_keys, "taskset": {**env_keys.get("taskset", {}), **taskset, "id": module.__name__}}
        agent = data.setdefault("agent", {})
        agent.setdefault("runtime", {"type": "subprocess"})
        harness = agent.get("harness", {}).get("id")
        if harness in V1_DEFAULT_HARNESSES:
            raise ConfigError(f"{where} {spec!r}: agent.harness.id {harness} provisions its program with uv over the "
                              "network; leave it unset for the offline chat harness")  # fmt: skip
        if harness is None and not any(isinstance(obj, type) and issubclass(obj, vf.Harness) for obj in exported):
            agent["harness"] = {**agent.get("harness", {}), "id": HARNESS_ID}  # the taskset's own harness wins
        try:
            env = vf.load_environment(vf.resolve_env_config(data))
            tasks = list(env.taskset)
        except Exception as e:
            raise ConfigError(f"{where} {spec!r}: loading the env raised {type(e).__name__}: {e}") from None
        if not tasks:
            raise ConfigError(f"{where} {spec!r}: the taskset has no tasks")
        _check_offline(env, f"{where} {spec!r}")
        source = Source(spec, env, tasks, renderer or None)
        _LOADED[spec] = source
        return source


def vf_version() -> str:
    from importlib.metadata import version

    return version("verifiers")


def _check_offline(env: Any, where: str) -> None:
    """Refuse tool servers on another runtime than the subprocess one (remote services need tunnels and an
    account; container runtimes pull images)."""
    task_cls = type(env.taskset).task_type()
    for server in task_cls.toolsets(env.taskset.config.task):
        config = server.config
        if getattr(config, "url", None) or getattr(config, "colocated", False):
            continue
        if config.runtime.type != LOCAL_RUNTIME:
            raise ConfigError(f"{where}: tool server {type(server).__name__} runs on runtime "
                              f"{config.runtime.type!r}; runs here use v1's subprocess runtime")  # fmt: skip


def task_messages(task: Any, where: str) -> list[dict[str, str]]:
    """A task's opening conversation (its system prompt and prompt) as chat messages."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        for m in prompt:
            content = m.content if isinstance(m.content, str) else None
            if content is None:
                raise DataError(f"{where}: a {m.role!r} message whose content is not text (images are not supported)")
            messages.append({"role": m.role, "content": content})
    if not messages:
        raise DataError(f"{where}: the task has no prompt (a harness that opens the conversation is not supported)")
    return messages


def generate(source: str, split: str) -> list[dict[str, Any]]:
    """The rows of `source`: one per task of its taskset (v1 tasksets have no splits: an eval split gives the same
    tasks; a taskset with a split field takes it as an argument, `?split=test`). Each row's `messages` are the task's
    prompt (for the length checks and the samples), `ground_truth` the JSON of its index."""
    loaded = load(source, "dataset_name_or_path")
    rows = []
    for index, task in enumerate(loaded.tasks):
        where = f"verifiers environment {source!r} task {index}"
        rows.append({"messages": task_messages(task, where), "ground_truth": json.dumps({"task": index}),
                     "dataset": VERIFIER, "environment": source.strip(),
                     "id": f"{source.strip()}-{task.data.id or task.data.idx or index}"})  # fmt: skip
    return rows


def task_of(source: Source, row: dict[str, Any]) -> Any:
    example = row.get("example", row)
    try:
        index = json.loads(example["ground_truth"])["task"]
        return source.tasks[index]
    except (KeyError, TypeError, ValueError, IndexError):
        raise DataError(f"{row.get('where', 'a row')}: not a row of verifiers environment {source.spec!r}") from None


# -----------------------------------------------------------------------------------------------------------------
# The endpoint: POST /inference/v1/generate and GET /v1/models from the run's generator


@dataclass
class Call:
    """One request the endpoint answers: the prompt ids, its stop ids and cap; the result once generated."""

    session: str
    prompt_ids: list[int]  # what is generated from: the request's ids, or its history spliced to the sampled ids
    stop_ids: set[int]
    max_tokens: Optional[int]
    sent_ids: list[int] = field(default_factory=list)  # the ids the client sent (v1's rendering)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    done: threading.Event = field(default_factory=threading.Event)


class JSONHandler(BaseHTTPRequestHandler):
    """A loopback endpoint's handler: JSON replies, no per-request lines in the run's log."""

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class GenerateServer:
    """The vLLM-style endpoint v1's training client calls, on 127.0.0.1 at a free port (stdlib ThreadingHTTPServer:
    one thread per request, each waiting on its Call). The rounds themselves run on the thread that called
    `serve_rounds` (the trainer's: the generator is used where it always is)."""

    def __init__(self, splice: Optional[Callable[[Call, Call], Optional[list[int]]]] = None) -> None:
        self.splice = splice  # (request, the session's previous call) -> the ids to generate from, or None: as sent
        self.cond = threading.Condition()
        self.pending: list[Call] = []
        self.running = 0  # episodes started and not yet ended
        self.events = 0  # requests and episode ends so far (the environment-deadline clock resets on each)
        self.calls: dict[str, list[Call]] = {}  # per session (trace id): its answered calls, in order
        self.order: dict[str, int] = {}  # session -> its episode's index (rounds are generated in this order)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler_class())
        self.httpd.daemon_threads = True
        # shutdown() waits for serve_forever's next poll: the default 0.5 s cost every rollout up to half a second
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True, name="verifiers-v1-endpoint"
        )
        self.thread.start()

    def handler_class(self) -> type:
        """The request handler (a subclass serves other routes: agent_gateway.py's OpenAI-style ones)."""
        server = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                if urllib.parse.urlparse(self.path).path.rstrip("/") in ("/v1/models", "/models"):
                    self.reply(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
                else:
                    self.reply(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                if urllib.parse.urlparse(self.path).path != "/inference/v1/generate":
                    self.reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    params = body.get("sampling_params") or {}
                    stop_ids = {int(t) for t in params.get("stop_token_ids") or []}
                    prompt_ids = [int(t) for t in body["token_ids"]]
                    call = Call(self.headers.get(SESSION_HEADER, ""), prompt_ids, stop_ids, params.get("max_tokens"),
                                sent_ids=prompt_ids)  # fmt: skip
                except (ValueError, KeyError, TypeError) as e:
                    self.reply(400, {"error": f"bad generate request: {e}"})
                    return
                server.continue_session(call)
                server.submit(call)
                call.done.wait()
                content = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(call.ids, call.logprobs)]
                self.reply(200, {"request_id": f"{call.session}-{len(server.calls.get(call.session, []))}",
                                 "prompt_token_ids": call.sent_ids,
                                 "choices": [{"index": 0, "token_ids": call.ids, "logprobs": {"content": content},
                                              "finish_reason": call.finish_reason}]})  # fmt: skip

        return Handler

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def continue_session(self, call: Call) -> None:
        """A request that re-sends its session's history is generated from the history as sampled (the recorded ids
        win over the client's re-rendering of them), so the episode stays one stream of every sampled turn."""
        with self.cond:
            earlier = self.calls.get(call.session)
        if self.splice is not None and earlier:
            spliced = self.splice(call, earlier[-1])
            if spliced is not None:
                call.prompt_ids = spliced

    def submit(self, call: Call) -> None:
        with self.cond:
            self.pending.append(call)
            self.events += 1
            self.cond.notify_all()

    def started(self, count: int) -> None:
        with self.cond:
            self.running += count
            self.cond.notify_all()

    def ended(self) -> None:
        with self.cond:
            self.running -= 1
            self.events += 1
            self.cond.notify_all()

    def serve_rounds(self, generate_round: Any, timeout_s: float, where: str) -> None:
        """Generate rounds until every episode has ended: a round starts when every running episode waits on the
        model (requests >= running episodes), as rollout_episodes batches its rounds. A stretch of timeout_s with
        no request and no episode end (the environment's own work: tools, harness, scoring) stops the run."""
        while True:
            with self.cond:
                seen = self.events
                ready = self.cond.wait_for(
                    lambda: self.running == 0 or (self.pending and len(self.pending) >= self.running)
                    or self.events != seen,
                    timeout=timeout_s,
                )  # fmt: skip
                if not ready:
                    raise ConfigError(
                        f"{where}: no episode asked the model or ended within {timeout_s:g} s (environment_timeout): "
                        "the environment's tools, harness or scoring hung"
                    )
                if self.running == 0 and not self.pending:
                    return
                if not self.pending or len(self.pending) < self.running:
                    continue
                batch = sorted(self.pending, key=lambda c: self.order.get(c.session, 1 << 30))
                self.pending = []
            generate_round(batch)
            for call in batch:
                self.calls.setdefault(call.session, []).append(call)
                call.done.set()

    def fail_pending(self) -> None:
        """Answer whatever still waits (with no tokens) so the handler threads end, e.g. after a run error."""
        with self.cond:
            for call in self.pending:
                call.done.set()
            self.pending = []

    def close(self) -> None:
        self.fail_pending()
        self.httpd.shutdown()
        self.httpd.server_close()


def cut_at_stop(ids: Sequence[int], stop_ids: set[int]) -> int:
    """How many of `ids` a stop id leaves: through the first stop id (kept, as vLLM returns it), else all."""
    for i, token in enumerate(ids):
        if token in stop_ids:
            return i + 1
    return len(ids)
