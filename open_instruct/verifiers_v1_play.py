"""Playing a `verifiers.v1` environment's episodes (verifiers_v1.py: the spec, the rows, the endpoint): `V1Run` is
episodes.EnvironmentRun for a run whose environment is a v1 env, picked under verifiers 0.4 by the `verifiers:`
registration at the end (for either API: open_instruct/integrations.py). Each rollout starts every episode's
harness on one event-loop thread, serves the endpoint's rounds from the run's generator on the calling thread, and
builds each episode from its trace (verifiers_v1.py's docstring).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from dataclasses import replace
from importlib.metadata import version
from typing import Any, Optional, Sequence

from open_instruct import verifiers_env, verifiers_v1
from open_instruct.data_cache import code_identity, source_identity
from open_instruct.episodes import (
    EnvironmentRun,
    Episode,
    EpisodeOutput,
    Turn,
    environment_example,
    episode_output,
    turn_seed,
)
from open_instruct.errors import ConfigError
from open_instruct.integrations import Source, register_source
from open_instruct.verifiers_v1 import MODEL_NAME, Call, GenerateServer, cut_at_stop, load, task_messages, task_of

_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


class V1Run(EnvironmentRun):
    """A run's v1 environment (episodes.EnvironmentRun's interface: prompt_ids, probe_step, play, sample_rows): each
    rollout's episodes, played by the env's harness against an endpoint served for that rollout."""

    def __init__(self, cfg: Any, tokenizer: Any, verify: Any = None, step_workers: int = 1):
        super().__init__(cfg, tokenizer, verify, step_workers)
        self.spec = str(cfg.environment).strip()
        self.tokenizer = tokenizer
        self.source = load(self.spec)
        self._renderer: Any = None

    def probe_step(self, row: dict[str, Any]) -> None:
        """Nothing to probe before the model loads: the harness asks the model first (the env loaded already)."""
        task_of(self.source, row)

    # --- prompts, before any model loads --------------------------------------------------------------------------

    def renderer(self) -> Any:
        """The renderer the training client renders with (the same config), for the prompt length checks."""
        if self._renderer is None:
            from renderers import create_renderer
            from renderers.base import load_tokenizer

            self._renderer = create_renderer(load_tokenizer(self.cfg.model_name_or_path), self.renderer_config())
        return self._renderer

    def renderer_config(self) -> Any:
        if not self.source.renderer:
            return None
        from pydantic import TypeAdapter
        from renderers import RendererConfig

        try:
            return TypeAdapter(RendererConfig).validate_python({"name": "default", **self.source.renderer})
        except ValueError as e:
            raise ConfigError(f"environment {self.spec!r}: renderer.* arguments: {e}") from None

    def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        """The task's opening prompt as the renderer renders it (without tool schemas: those come with the
        harness), what the length checks measure."""
        messages = task_messages(task_of(self.source, row), row.get("where", "a row"))
        return list(self.renderer().render(messages, add_generation_prompt=True).token_ids)

    # --- the rollout -----------------------------------------------------------------------------------------------

    @staticmethod
    def run(coroutine: Any) -> Any:
        """A future of `coroutine` on the process's one verifiers event loop (a daemon thread): verifiers keeps
        process-wide state (renderer pools, their locks) bound to the loop that first used it."""
        global _LOOP
        with _LOOP_LOCK:
            if _LOOP is None:
                _LOOP = asyncio.new_event_loop()
                threading.Thread(target=_LOOP.run_forever, daemon=True, name="verifiers-v1").start()
        return asyncio.run_coroutine_threadsafe(coroutine, _LOOP)

    def context(self, config: Any, server: GenerateServer) -> Any:
        import verifiers.v1 as vf

        client = vf.TrainClientConfig(
            base_url=server.base_url,
            renderer_model_name=self.cfg.model_name_or_path,
            renderer=self.renderer_config(),
            api_key_var="OPEN_INSTRUCT_UNUSED_KEY",  # the endpoint wants no key
        )
        sampling = vf.SamplingConfig(temperature=config.temperature, top_p=config.top_p)
        return vf.ModelContext(model=MODEL_NAME, client=client, sampling=sampling)

    def play(
        self, generator: Any, rows: Sequence[dict[str, Any]], config: Any, budget: Optional[Any] = None
    ) -> EpisodeOutput:
        """`config.n` episodes per row, played by their harnesses against the endpoint, in row order (each row's n
        contiguous), scored, their metrics on the last turn."""
        return episode_output(self.play_episodes(generator, rows, config, budget or self.budget), config.n, self.tokens)

    def play_episodes(self, generator: Any, rows: Sequence[dict[str, Any]], config: Any, budget: Any) -> list[Episode]:
        # one server per rollout: nothing of an earlier (maybe failed) one is left
        server, n = GenerateServer(self.splice), config.n
        tasks = [task_of(self.source, row) for row in rows for _ in range(n)]
        ctx = self.context(config, server)
        env = self.source.env
        rounds = [0]

        def minted(index: int) -> Any:
            def on_trace(trace: Any) -> None:  # the trace id is the session its requests carry
                with server.cond:
                    server.order[trace.id] = index

            return on_trace

        async def one(index: int, task: Any) -> Any:
            try:
                return await env.run_episode(task, ctx, on_trace=minted(index))
            finally:
                server.ended()

        async def all_episodes() -> list[Any]:
            async with env.serving():
                return await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))

        def generate_round(batch: list[Call]) -> None:
            caps = [self.cap(server, call, budget) for call in batch]
            live = [i for i, cap in enumerate(caps) if cap > 0]  # a call past its budget gets no tokens
            if not live:
                return
            seed = None if config.seed is None else turn_seed(config.seed, rounds[0])
            rounds[0] += 1
            turn_config = replace(config, n=1, max_new_tokens=budget.max_turn_tokens, seed=seed, stop_strings=None)
            out = generator.generate([batch[i].prompt_ids for i in live], turn_config, [caps[i] for i in live])
            for j, i in enumerate(live):
                call, ids = batch[i], out.response_ids[j]
                keep = cut_at_stop(ids, call.stop_ids)
                call.ids, call.logprobs = list(ids[:keep]), list(out.logprobs[j][:keep])
                call.versions = list(out.weight_versions[j][:keep])
                stopped = bool(keep) and call.ids[-1] in call.stop_ids or out.stopped[j]
                call.finish_reason = "stop" if stopped else "length"

        server.started(len(tasks))
        future = self.run(all_episodes())
        try:
            server.serve_rounds(generate_round, self.timeout_s, f"verifiers environment {self.spec!r}")
            results = future.result(timeout=self.timeout_s)
            episodes = [
                self.episode(server, row, result, budget, str(row.get("where", "a row")))
                for row, result in zip([r for r in rows for _ in range(n)], results)
            ]
        finally:
            future.cancel()  # a no-op once done; else the harnesses still running are cancelled
            server.close()
        for start in range(0, len(episodes), n):
            group = episodes[start : start + n]
            if any(e.prompt_ids != group[0].prompt_ids for e in group):
                raise ConfigError(f"verifiers environment {self.spec!r}: one task's episodes started from different "
                                  "prompt ids (its harness's opening differs between episodes), which a group's "
                                  "shared prompt cannot hold")  # fmt: skip
        return episodes

    def cap(self, server: GenerateServer, call: Call, budget: Any) -> int:
        """New tokens this call may have: max_turn_tokens, the request's own max_tokens, what is left of the
        episode's response_length after its first prompt; 0 once the episode made max_turns calls."""
        earlier = server.calls.get(call.session, [])
        if len(earlier) >= budget.max_turns:
            return 0
        first = len(earlier[0].prompt_ids) if earlier else len(call.prompt_ids)
        left = budget.max_response_tokens - (len(call.prompt_ids) - first)
        cap = min(budget.max_turn_tokens, left)
        if call.max_tokens:
            cap = min(cap, int(call.max_tokens))
        return max(cap, 0)

    def splice(self, call: Call, last: Call) -> Optional[list[int]]:
        """The ids to generate `call` from when it re-sends its session's last answer: the client's ids extend what it
        sent last, and the first stop id after that (the template's turn close) ends the answer as re-rendered; when
        that text is the sampled answer's text, the sampled ids stand in for it (a truncated answer keeps the
        template's close). None (generate as sent; the answer then goes untrained) when the history changed."""
        sent = last.sent_ids
        if not last.ids or call.sent_ids[: len(sent)] != sent:
            return None
        rest = call.sent_ids[len(sent) :]
        close = next((i for i, token in enumerate(rest) if token in last.stop_ids), None)
        if close is None:
            return None
        stopped = last.ids[-1] in last.stop_ids
        if self.text(last.ids[:-1] if stopped else last.ids) != self.text(rest[:close]):
            return None
        return last.prompt_ids + last.ids + rest[close + 1 if stopped else close :]

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).strip()

    def episode(self, server: GenerateServer, row: dict[str, Any], result: Any, budget: Any, where: str) -> Episode:
        """One Episode from the episode's single trainable agent run: the stream of its first request's conversation
        (each request's ids extend the previous one's prompt and answer; `splice` makes a re-sent history the sampled
        one), from the first request's prompt on: the answers are policy tokens, the ids between them
        (tool results, user turns, template scaffolding) observation tokens. An answer off that chain (a harness
        that rewrote its history) is counted (truncated/untrained_turns), not trained."""
        name = f"verifiers environment {self.spec!r} on {where}"
        if result.errors:
            first = result.errors[0]
            raise ConfigError(f"{name}: the episode failed: {first.type}: {first.message}")
        trainable = [t for t in result.traces if t.agent.trainable]
        if len(trainable) != 1:
            raise ConfigError(f"{name}: the episode has {len(trainable)} trainable agent runs; one is supported "
                              "(multi-agent envs are not)")  # fmt: skip
        trace = trainable[0]
        if trace.errors:
            raise ConfigError(f"{name}: the agent run failed: {trace.errors[0].type}: {trace.errors[0].message}")
        calls = server.calls.get(trace.id, [])
        answered = [c for c in calls if c.ids]
        if not answered:
            raise ConfigError(f"{name}: the harness never asked the model")
        chain = _chain(answered)
        episode = Episode(prompt_ids=list(chain[0].prompt_ids), example=environment_example(row))
        room, stream, cut = budget.max_response_tokens, list(chain[0].prompt_ids), False
        for call in chain:
            if len(episode.response_ids) >= room:
                cut = True
                break
            episode.append_observation(call.prompt_ids[len(stream) :][: room - len(episode.response_ids)])
            if episode.turns:  # the observation answers the previous turn
                episode.turns[-1].observation_end = len(episode.response_ids)
            keep = max(0, min(len(call.ids), room - len(episode.response_ids)))
            start = len(episode.response_ids)
            episode.append_policy(call.ids[:keep], call.logprobs[:keep], call.versions[:keep])
            closed = bool(keep) and call.ids[keep - 1] == self.tokens.turn_end_id
            stopped = call.finish_reason == "stop" and keep == len(call.ids)
            episode.turns.append(Turn(start, start + keep, start + keep, "", closed, stopped))
            if not stopped:
                episode.truncations["max_turn_tokens" if keep == len(call.ids) else "max_response_tokens"] += 1
            cut = keep < len(call.ids)
            stream = call.prompt_ids + call.ids
        if len(chain) < len(answered):
            episode.truncations["untrained_turns"] += len(answered) - len(chain)
        budget_cut = [c for c in calls if not c.ids and c.finish_reason == "length"]
        if cut:
            episode.end("max_response_tokens")
        elif budget_cut:
            episode.end("max_turns" if len(calls) > budget.max_turns else "max_response_tokens")
        else:
            episode.end("done")
        last = episode.turns[-1]
        last.reward = float(trace.reward)
        metrics = {key: float(r.score) for key, r in trace.rewards.items() if r is not None}
        metrics.update({key: float(v) for key, v in trace.metrics.items() if v is not None})
        last.info = {"metrics": metrics}
        return episode


def _chain(answered: list[Call]) -> list[Call]:
    """The first request's conversation: the answered calls, in order, each extending the previous one's prompt and
    answer (a call that does not, e.g. a harness that rewrote its history, is left out)."""
    chain = answered[:1]
    for call in answered[1:]:
        stream = chain[-1].prompt_ids + chain[-1].ids
        if call.prompt_ids[: len(stream)] == stream:
            chain.append(call)
    return chain


# ---- registration (open_instruct/integrations.py): `verifiers:` sources and environments, either API ----------------
def _api() -> Any:
    """The module that loads a `verifiers:` spec with the installed verifiers: verifiers_v1 under 0.4, else
    verifiers_env (the earlier API)."""
    return verifiers_v1 if verifiers_env.v1_installed() else verifiers_env


def _identity(source: str) -> list[Any]:
    """What the tokenized-data cache keys on: the spec, verifiers' version, its module's file and this adapter's."""
    target = source.strip()[len(verifiers_env.PREFIX) :].partition("?")[0]
    found = None if target.endswith(".py") else importlib.util.find_spec(target.split(".")[0])
    adapter = code_identity([verifiers_env.__file__, verifiers_v1.__file__])
    return [source, version("verifiers"), source_identity(found.origin if found and found.origin else target), adapter]


def _size(source: str, split: str) -> tuple[None, str]:
    return None, "a verifiers environment's dataset is counted when the run loads it"


register_source(
    Source(
        prefix=verifiers_env.PREFIX.rstrip(":"),
        generate=lambda source, split: _api().generate(source, split),
        check=lambda source, where: _api().load(source, where),
        identity=_identity,
        size=_size,
        needs_environment=True,
        environment_class=verifiers_env.environment_class,
        environment_run=lambda spec: V1Run if verifiers_env.v1_installed() else None,
    )
)
