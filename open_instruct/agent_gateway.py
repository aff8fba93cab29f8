"""Agents as environments: an OpenAI-compatible gateway in front of the run's generator, and the agent harness whose
requests become one training episode (docs/agents.md).

    --environment 'agent:my_agent.py:run'

`run` is `async def run(base_url: str, model: str, row: dict) -> Optional[float]`: it talks to `base_url` with any
OpenAI client (`/chat/completions`, `/completions`, `/models`) as `model`, and returns the episode's score, or None
to let the row's verifier score the last assistant turn. Registered under the `agent:` prefix
(open_instruct/integrations.py), so a run that names no agent never imports this module.

    serve:  one gateway per rollout on 127.0.0.1 at a free port; episode i's base URL is `/s/<i>/v1`, so every request
            belongs to its episode without the harness sending anything special. Requests wait in rounds as the
            verifiers.v1 endpoint's do (verifiers_v1.GenerateServer: a round starts when every running agent waits
            on the model; its seed from the rollout's seed and the round), so the same episodes give the same
            rounds as `--environment`.
    record: an episode is the token stream of its first request's conversation. A request whose messages extend
            that conversation (every earlier message the same, the assistant ones as the gateway answered them)
            continues the stream: the new messages are observation tokens (the chat template's prefix difference,
            episodes.EpisodeTokenizer.observation_ids) and the history keeps the sampled ids, never re-rendered; so
            a harness that re-sends history which would re-tokenize differently still trains on what was sampled.
            A request that does not extend it (another conversation) is answered, and counted in
            truncated/untrained_turns, never trained.
    answer: the sampled ids are cut like an environment's turn (a hermes `</tool_call>` ends it when the request
            gives `tools`; the request's `stop` strings likewise), decoded, and hermes calls returned as
            `tool_calls`.

Budgets: `max_turns` trained calls, `max_turn_tokens` per call (and the request's `max_tokens`), `response_length`
for everything after the first prompt; a request past one is answered with no tokens, finish_reason "length".
`environment_timeout` bounds each stretch in which no agent asks the model or ends.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from open_instruct.environments import HERMES_CALL, HERMES_CALL_END, Environment, StepResult
from open_instruct.episodes import (
    EnvironmentRun,
    Episode,
    EpisodeBudget,
    EpisodeOutput,
    cut_at_action_end,
    environment_example,
    episode_output,
    take_turn,
    turn_seed,
)
from open_instruct.errors import ConfigError, DataError
from open_instruct.integrations import Source, register_source
from open_instruct.user_code import load_object
from open_instruct.verifiers_v1 import MODEL_NAME, Call, GenerateServer, JSONHandler

PREFIX = "agent"
_ROUTE = re.compile(r"^/s/(\d+)/v1/(chat/completions|completions|models)/?$")
_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def load_agent(spec: str, where: str = "environment") -> Any:
    """The agent function of `agent:<file.py or module>:<name>`: an async function of (base_url, model, row)."""
    target = spec.strip()[len(PREFIX) + 1 :]
    agent = load_object(target, f"{where} {spec!r}", "agent:my_agent.py:run")
    if not inspect.iscoroutinefunction(agent):
        raise ConfigError(f"{where} {spec!r}: {target} must be an async function (async def run(base_url, model, row))")
    try:
        inspect.signature(agent).bind("url", MODEL_NAME, {})
    except TypeError as e:
        raise ConfigError(f"{where} {spec!r}: {target} cannot be called as run(base_url, model, row): {e}") from None
    return agent


class AgentEnvironment(Environment):
    """What `environment_class` names for an agent spec (the config checks resolve it); AgentRun plays the
    episodes, this class never steps."""

    def reset(self, example: dict[str, Any]) -> Any:
        return list(example["messages"])

    def step(self, action: str) -> StepResult:
        raise RuntimeError("an agent's episodes are played by agent_gateway.AgentRun")


# -----------------------------------------------------------------------------------------------------------------
# One episode's conversation, as the gateway answered it


def _normal(message: dict[str, Any]) -> tuple:
    """A message as the comparison sees it: role, text, and tool calls by name and parsed arguments."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), (message.get("content") or "").strip(), tuple(calls)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as the chat template gets it (text content; a list of text parts joined)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out = {"role": message.get("role"), "content": content or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


@dataclass
class Session:
    """One agent's episode: its row, the conversation the gateway answered (the first request's messages + every
    trained reply + the observations after), its Episode, and the calls that were not trained."""

    index: int
    row: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    episode: Optional[Episode] = None
    tools: Optional[list[dict[str, Any]]] = None
    conversation: list[tuple] = field(default_factory=list)
    refused: Optional[str] = None  # the budget that refused a request (the episode ended there)
    untrained: int = 0


@dataclass
class GatewayCall(Call):
    """A request of one session: trained (it extends the episode) or not, its end markers and token cap."""

    trained: bool = False
    markers: tuple[str, ...] = ()
    cap: int = 0
    text: str = ""


def _action_end(markers: Sequence[str]) -> Any:
    def end(text: str) -> Optional[int]:
        found = [text.find(m) + len(m) for m in markers if m in text]
        return min(found) if found else None

    return end


class _Marks:
    """take_turn's view of an environment: where an action ends."""

    def __init__(self, markers: Sequence[str]):
        self.action_end = _action_end(markers)


class Gateway(GenerateServer):
    """`/s/<episode>/v1/chat/completions`, `/completions` and `/models` on loopback (GenerateServer's rounds)."""

    def __init__(self, sessions: list[Session], tokens: Any, budget: EpisodeBudget):
        self.sessions, self.tokens, self.budget = sessions, tokens, budget
        super().__init__()
        self.order = {str(s.index): s.index for s in sessions}

    def episode_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/s/{index}/v1"

    def handler_class(self) -> type:
        gateway = self

        class Handler(JSONHandler):
            def route(self) -> Optional[tuple[Session, str]]:
                match = _ROUTE.match(urllib.parse.urlparse(self.path).path)
                if match is None or int(match.group(1)) >= len(gateway.sessions):
                    self.reply(404, {"error": {"message": f"no route {self.path}"}})
                    return None
                return gateway.sessions[int(match.group(1))], match.group(2)

            def do_GET(self) -> None:
                found = self.route()
                if found is not None:
                    self.reply(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

            def do_POST(self) -> None:
                found = self.route()
                if found is None:
                    return
                session, kind = found
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    status, answer = gateway.answer(session, kind, body)
                except (ValueError, KeyError, TypeError, DataError) as e:
                    status, answer = 400, {"error": {"message": f"bad request: {e}"}}
                self.reply(status, answer)

        return Handler

    def answer(self, session: Session, kind: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One request, start to end: its prompt ids, its round, its reply (one at a time per session)."""
        if body.get("n", 1) != 1 or body.get("stream"):
            return 400, {"error": {"message": "the gateway answers n=1, non-streaming requests"}}
        if body.get("model") not in (None, MODEL_NAME):
            return 404, {"error": {"message": f"model {body.get('model')!r}: the gateway serves {MODEL_NAME!r}"}}
        stop = body.get("stop") or []
        markers = tuple([stop] if isinstance(stop, str) else stop)
        with session.lock:
            if kind == "chat/completions":
                messages = [dict(m) for m in body["messages"]]
                tools = body.get("tools") or None
                markers += (HERMES_CALL_END,) if tools else ()
                call = self.chat_call(session, messages, tools, markers, body.get("max_tokens"))
            else:
                prompt = body["prompt"]
                ids = list(self.tokens.tokenizer(prompt, add_special_tokens=False)["input_ids"])
                call = GatewayCall(str(session.index), ids, set(), body.get("max_tokens"), markers=markers)
                call.cap = min(self.budget.max_turn_tokens, int(call.max_tokens or self.budget.max_turn_tokens))
            if call.cap > 0:
                self.submit(call)
                call.done.wait()
            if call.trained and call.cap > 0:
                self.record(session, call)
        created = {"id": f"gw-{session.index}-{len(self.calls.get(call.session, []))}", "model": MODEL_NAME,
                   "created": 0, "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.ids),
                                           "total_tokens": len(call.prompt_ids) + len(call.ids)}}  # fmt: skip
        if kind == "completions":
            return 200, {**created, "object": "text_completion", "choices": [
                {"index": 0, "text": call.text, "finish_reason": call.finish_reason, "logprobs": None}]}  # fmt: skip
        message = reply_message(call.text, bool(markers and HERMES_CALL_END in markers), session, call)
        finish = "tool_calls" if message.get("tool_calls") else call.finish_reason
        content = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(call.ids, call.logprobs)]
        return 200, {**created, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "logprobs": {"content": content}}]}  # fmt: skip

    def chat_call(
        self, session: Session, messages: list[dict], tools: Any, markers: tuple, max_tokens: Any
    ) -> GatewayCall:
        """The request's prompt ids: the episode's own ids when it extends the episode's conversation (the new
        messages appended as observation tokens), else the conversation rendered afresh (not trained)."""
        call = GatewayCall(str(session.index), [], set(), max_tokens, markers=markers)
        episode, seen = session.episode, session.conversation
        extends = episode is not None and tools == session.tools and [_normal(m) for m in messages[: len(seen)]] == seen
        if episode is None:  # the first request: the episode's prompt
            ids = self.tokens.render_ids([_template_message(m) for m in messages], tools, add_generation_prompt=True)
            session.episode = Episode(prompt_ids=ids, example=environment_example(session.row))
            session.tools, episode, extends = tools, session.episode, True
        elif extends and len(messages) > len(seen) and not episode.finished:
            new = [_template_message(m) for m in messages[len(seen) :]]
            obs = self.tokens.observation_ids(new, episode.turns[-1].closed, tools)
            if len(episode.response_ids) + len(obs) >= self.budget.max_response_tokens:
                episode.end("max_response_tokens")
            else:
                episode.append_observation(obs)
                episode.turns[-1].observation_end = len(episode.response_ids)
        elif extends:
            extends = False  # the same conversation again (a retry), or one after the episode ended
        if extends and not episode.finished and len(episode.turns) >= self.budget.max_turns:
            episode.end("max_turns")
        if extends and episode.finished:
            session.refused = session.refused or episode.end_reason
            call.finish_reason = "length"
            return call  # cap 0: answered with no tokens
        if extends:
            call.trained, call.prompt_ids = True, episode.ids
            session.conversation = [_normal(m) for m in messages]
            room = self.budget.max_response_tokens - len(episode.response_ids)
            call.cap = min(self.budget.max_turn_tokens, room)
        else:
            session.untrained += 1
            call.prompt_ids = self.tokens.render_ids([_template_message(m) for m in messages], tools, True)
            call.cap = self.budget.max_turn_tokens
        if max_tokens:
            call.cap = min(call.cap, int(max_tokens))
        return call

    def record(self, session: Session, call: GatewayCall) -> None:
        """The trained reply as the conversation's next assistant message (what a re-sent history must match)."""
        message = reply_message(call.text, HERMES_CALL_END in call.markers, session, call)
        session.conversation.append(_normal(message))


def reply_message(text: str, hermes: bool, session: Session, call: GatewayCall) -> dict[str, Any]:
    """The assistant message of a reply: its text, hermes calls (when the request gave tools) as `tool_calls`."""
    if not hermes or not HERMES_CALL.search(text):
        return {"role": "assistant", "content": text}
    calls, turn = [], len(session.conversation)
    for k, body in enumerate(HERMES_CALL.findall(text)):
        try:
            parsed = json.loads(body)
            name, arguments = parsed["name"], parsed.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue  # not a call the client can run: it stays in the text
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": f"call_{session.index}_{turn}_{k}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})  # fmt: skip
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": HERMES_CALL.sub("", text).strip() or None, "tool_calls": calls}


# -----------------------------------------------------------------------------------------------------------------
# The run: each rollout's agents against one gateway


class AgentRun(EnvironmentRun):
    """episodes.EnvironmentRun for an agent: `config.n` agents per row, all at once on one event-loop thread, their
    requests served in rounds from the run's generator on the calling thread."""

    def __init__(self, cfg: Any, tokenizer: Any, verify: Any = None, step_workers: int = 1):
        super().__init__(cfg, tokenizer, verify, step_workers)
        self.spec = str(cfg.environment).strip()
        self.agent = load_agent(self.spec)

    def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        """The row's messages through the template (what the length checks measure; the agent may add tools)."""
        return self.tokens.render_ids(list(environment_example(row)["messages"]), None, add_generation_prompt=True)

    def probe_step(self, row: dict[str, Any]) -> None:
        """Nothing to probe before the model loads: the agent asks the model first."""

    @staticmethod
    def run(coroutine: Any) -> Any:
        global _LOOP
        with _LOOP_LOCK:
            if _LOOP is None:
                _LOOP = asyncio.new_event_loop()
                threading.Thread(target=_LOOP.run_forever, daemon=True, name="agents").start()
        return asyncio.run_coroutine_threadsafe(coroutine, _LOOP)

    def play(
        self, generator: Any, rows: Sequence[dict[str, Any]], config: Any, budget: Optional[EpisodeBudget] = None
    ) -> EpisodeOutput:
        budget = budget or self.budget
        sessions = [Session(i, row) for i, row in enumerate(row for row in rows for _ in range(config.n))]
        gateway = Gateway(sessions, self.tokens, budget)
        rounds = [0]

        async def one(session: Session) -> Any:
            try:
                example = environment_example(session.row)
                return await self.agent(gateway.episode_url(session.index), MODEL_NAME, example)
            finally:
                gateway.ended()

        async def all_agents() -> list[Any]:
            return await asyncio.gather(*(one(s) for s in sessions), return_exceptions=True)

        def generate_round(batch: list[GatewayCall]) -> None:
            shared = [m for m in batch[0].markers if all(m in c.markers for c in batch[1:])]
            stop_strings = list(config.stop_strings or []) + [m for m in shared if m not in (config.stop_strings or [])]
            seed = None if config.seed is None else turn_seed(config.seed, rounds[0])
            rounds[0] += 1
            turn_config = replace(config, n=1, max_new_tokens=budget.max_turn_tokens, seed=seed,
                                  stop_strings=stop_strings or None)  # fmt: skip
            out = generator.generate([c.prompt_ids for c in batch], turn_config, [c.cap for c in batch])
            for j, call in enumerate(batch):
                result = (out.response_ids[j], out.logprobs[j], out.weight_versions[j])
                if call.trained:
                    episode = sessions[int(call.session)].episode
                    marks = _Marks(call.markers)
                    call.text = take_turn(episode, marks, result, call.cap, 0, self.tokens, budget)  # type: ignore
                    turn = episode.turns[-1]
                    call.ids = episode.response_ids[turn.policy_start : turn.policy_end]
                    call.logprobs = episode.sampler_logprobs[turn.policy_start : turn.policy_end]
                    call.finish_reason = "stop" if turn.stopped else "length"
                else:
                    keep = cut_at_action_end(result[0], self.tokens.decode, _action_end(call.markers))
                    call.ids, call.logprobs = list(result[0][:keep]), list(result[1][:keep])
                    call.text = self.tokens.decode(call.ids)
                    call.finish_reason = "stop" if keep < call.cap or out.stopped[j] else "length"

        gateway.started(len(sessions))
        future = self.run(all_agents())
        try:
            gateway.serve_rounds(generate_round, self.timeout_s, f"agent {self.spec!r}")
            results = future.result(timeout=self.timeout_s)
        finally:
            future.cancel()
            gateway.close()
        episodes = [self.finish(s, result) for s, result in zip(sessions, results)]
        for start in range(0, len(episodes), config.n):
            if any(e.prompt_ids != episodes[start].prompt_ids for e in episodes[start : start + config.n]):
                raise ConfigError(f"agent {self.spec!r}: one row's agents opened with different prompts (messages "
                                  "or tools), which a group's shared prompt cannot hold")  # fmt: skip
        return episode_output(episodes, config.n, self.tokens)

    def finish(self, session: Session, result: Any) -> Episode:
        """The session's episode, ended and scored: the agent's score, or the row's verifier on its last turn."""
        where = f"agent {self.spec!r} on {session.row.get('where', 'a row')}"
        if isinstance(result, BaseException):
            raise ConfigError(f"{where}: the agent raised {type(result).__name__}: {result}") from result
        if result is not None and not isinstance(result, (int, float)):
            raise ConfigError(f"{where}: the agent returned {result!r}; a score (a number) or None")
        episode = session.episode
        if episode is None or not episode.turns:
            raise ConfigError(f"{where}: the agent never asked the model")
        if not episode.finished:
            episode.end("done")
        episode.truncations["untrained_turns"] += session.untrained
        last = episode.turns[-1]
        example = environment_example(session.row)
        if result is None:
            score, timed_out = self.verify(last.action, example.get("ground_truth"), example.get("verifier"))
            episode.verifier_timeouts += int(timed_out)
        else:
            score = float(result)
        last.reward = score
        last.info = {**last.info, "correct": score >= 1.0}
        answered = [t for t in episode.turns if t.observation_end > t.policy_end]  # turns the agent answered
        episode.tool_calls = sum(len(HERMES_CALL.findall(t.action)) for t in answered)
        return episode


# ---- registration (open_instruct/integrations.py): `agent:` environments -------------------------------------------
def _no_rows(spec: str, split: str) -> list[dict[str, Any]]:
    raise ConfigError(f"{spec!r} is an agent, not a dataset: give it as --environment, the rows as the dataset")


register_source(
    Source(
        prefix=PREFIX,
        generate=_no_rows,
        check=lambda spec, where: load_agent(spec, where),
        identity=lambda spec: [spec],
        environment_class=lambda spec: (load_agent(spec), AgentEnvironment)[1],
        environment_run=lambda spec: AgentRun,
    )
)
