"""The client of dedicated vLLM engines (`generation_backend: vllm_server`; `engines.py` starts them): generation
requests over HTTP, weights broadcast from the trainer.

    gen = ServerGenerator(urls, tokenizer, eos_ids, policy, transfer="gloo", ...)   # every trainer rank
    gen.sync_weights(policy, version=3)     # collective: FSDP gathers, rank 0 broadcasts to every engine worker
    out = gen.generate(prompt_ids, GenerationConfig(...))   # this rank's prompts, spread over the engines
    out.weight_versions                     # per response token: the version of the weights that sampled it (3)

Same contract as the other backends (generation.py): token-id prompts in, per response `response_ids` cut after the
first stop (the shared `finalize_response`), `texts`, `stopped`, `prompt_index`, and `logprobs` = the engine's
log-probs of the sampled tokens after temperature and top-p (`--logprobs-mode processed_logprobs`).

Generation: each prompt is one request to vLLM's token-in/token-out route `/inference/v1/generate` (n samples,
a per-prompt seed), sent concurrently from a thread pool; prompt i of rank r goes to engine (r + i) mod N, so all
ranks spread over all engines. vLLM batches concurrent requests itself.

Weights: vLLM's weight-transfer protocol, driven by vLLM's own trainer engine (`WeightTransferTrainerFactory`):
init once (a process group of trainer rank 0 + every worker of every engine; engine k's workers at ranks
1 + k*T ...), then per sync `start_weight_update` -> `update_weights` (the engines receive while rank 0 broadcasts
one parameter or packed bucket at a time; every trainer rank iterates the parameters, so FSDP2 gathers one full
parameter at a time and never the whole model) -> `finish_weight_update(weight_version)`. Around it each engine is
paused (`/pause?mode=wait`: in-flight requests finish, new ones queue, the prefix cache is cleared, as its blocks hold
KV of the old weights) and resumed, and every trainer rank waits at a barrier until rank 0 has finished the update.
NCCL on GPUs, the gloo backend of `vllm_gloo_transfer` on CPU. vLLM labels every generated token with the weight
version it was sampled with; `generate` checks every response was sampled by the version last sent, so an engine
that missed an update is caught, not trained on.

Failures: an engine that refuses a request, dies, or does not answer within `timeout` seconds raises EngineError
naming it (the run stops; checkpoints already written are untouched). This module imports vLLM (the trainer-side
weight-transfer engine): a `vllm_server` trainer runs in the vLLM venv.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch

from open_instruct.engines import EngineError, free_port
from open_instruct.generation import GenerationConfig, GenerationOutput, engine_budgets, finalize_response, prompt_seed


class EngineFleet:
    """vLLM's weight-sync client protocol (init / start / update / finish) fanned out to every engine over HTTP.

    `update_weights` must reach all engines at once (their workers all sit in the same broadcast), so every call
    goes to all engines concurrently. `init_weight_transfer_engine` gives engine k's workers their own ranks."""

    def __init__(self, urls: Sequence[str], tensor_parallel_size: int, timeout: float) -> None:
        self.urls, self.tp, self.timeout = list(urls), tensor_parallel_size, timeout
        self.next_version: Optional[str] = None
        self.keep_in_flight = False  # pause with requests frozen in place (mode keep) rather than drained (wait)
        self.pool = ThreadPoolExecutor(max_workers=max(len(self.urls), 1), thread_name_prefix="engine-sync")

    def post(
        self,
        index: int,
        route: str,
        payload: Optional[dict] = None,
        timeout: Optional[float] = None,
        params: Optional[dict] = None,
    ) -> Any:
        import requests

        url = self.urls[index]
        try:
            response = requests.post(f"{url}/{route}", json=payload, params=params, timeout=timeout or self.timeout)
        except requests.Timeout:
            raise EngineError(
                f"vLLM engine {index} ({url}) did not answer /{route} within vllm_server_timeout "
                f"{timeout or self.timeout:.0f}s"
            ) from None
        except requests.ConnectionError as e:
            raise EngineError(f"vLLM engine {index} ({url}) is unreachable (/{route}): {e}") from None
        if response.status_code != 200:
            raise EngineError(f"vLLM engine {index} ({url}) refused /{route}: {response.status_code} {response.text}")
        return response.json() if "json" in response.headers.get("content-type", "") else response.text

    def _each(self, call: Callable[[int], Any]) -> None:
        """call(k) for every engine k concurrently; the first error is raised once all have been submitted."""
        for future in [self.pool.submit(call, k) for k in range(len(self.urls))]:
            future.result()

    def _all(self, route: str, payloads: Optional[list[Optional[dict]]] = None, params: Optional[dict] = None) -> None:
        payloads = payloads or [None] * len(self.urls)
        self._each(lambda k: self.post(k, route, payloads[k], params=params))

    def post_all(self, route: str, payload: dict) -> None:
        """POST the same `payload` to `route` of every engine, concurrently (EngineError naming the first refusal)."""
        self._all(route, [payload] * len(self.urls))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offset = int(init_info.get("rank_offset", 1))
        self._all(
            "init_weight_transfer_engine",
            [{"init_info": {**init_info, "rank_offset": offset + k * self.tp}} for k in range(len(self.urls))],
        )

    def start_weight_update(self) -> None:
        # Pause first, so no request runs on half-loaded layers (that kills the engine); new requests queue until
        # /resume. Nothing in flight ("wait"): in-flight requests finish on the old weights and the KV/prefix cache is
        # cleared, since blocks computed with the old weights would be reused for any prompt sharing a prefix with an
        # earlier one. Requests in flight (async_steps > 0, `keep_in_flight`): they are frozen where they are and go
        # on with the new weights after /resume, their tokens so far and their KV kept (vLLM labels each token with
        # the version that sampled it); such engines run without a prefix cache (engines.engine_specs).
        mode = "keep" if self.keep_in_flight else "wait"
        self._all("pause", params={"mode": mode, "clear_cache": "true"})
        self._each(self._start_on)

    def _start_on(self, index: int) -> None:
        try:
            self.post(index, "start_weight_update")
        except EngineError as e:
            if "already active" not in str(e):
                raise
            # An engine started apart whose previous trainer was killed mid-update still holds that update open, and
            # vLLM refuses a new one until it is finished: finish it (vLLM puts back the layers' tensors that were not
            # reloaded; this update then replaces every one of them) and start again.
            warnings.warn(f"vLLM engine {index} ({self.urls[index]}) had a weight update left open: closed it")
            self.post(index, "finish_weight_update")
            self.post(index, "start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", [{"update_info": update_info}] * len(self.urls))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        version = weight_version if weight_version is not None else self.next_version
        payload = {"weight_version": version} if version is not None else None
        self._all("finish_weight_update", [payload] * len(self.urls))
        self._all("resume")


class PolicyWeights:
    """vLLM `WeightSource` over the policy: (HF name, full tensor in the engine's dtype) one parameter at a time,
    as `vllm_generator.hf_weights` streams them (wrappers unwrapped, LoRA merged, lm_head untied when the engine's
    is separate). The metadata is read from one pass at the first sync and kept (every rank runs it: a gather)."""

    def __init__(self, model: Any, dtype: torch.dtype, untie: bool, merge_lora: bool = True) -> None:
        self.model, self.dtype, self.untie, self.merge_lora = model, dtype, untie, merge_lora
        self._meta: Optional[list] = None
        self.bytes_sent = 0

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        if self._meta is None:
            self._meta = [ParamMeta(name, self.dtype, tuple(t.shape)) for name, t in self._tensors()]
        return self._meta

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from open_instruct.vllm_generator import hf_weights

        # cast before the gather; merge_lora False: a LoRA model's base weights (the engines apply the adapter)
        for name, tensor in hf_weights(self.model, untie=self.untie, dtype=self.dtype, merge_lora=self.merge_lora):
            yield name, tensor.detach()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.bytes_sent = 0
        for name, tensor in self._tensors():
            self.bytes_sent += tensor.numel() * tensor.element_size()
            yield name, tensor

    def held_names(self) -> None:
        return None

    def groups(self) -> list[list[str]]:
        from vllm.distributed.weight_transfer.base import layerwise_groups

        return layerwise_groups([m.name for m in self.metadata()])

    def iter_groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        from vllm.distributed.weight_transfer.base import WeightSource

        return WeightSource.iter_groups(self)


def _weight_source(model: Any, dtype: torch.dtype, untie: bool, merge_lora: bool = True) -> Any:
    """A PolicyWeights registered as vLLM's WeightSource (its ABC), without importing vLLM at module import."""
    from vllm.distributed.weight_transfer.base import WeightSource

    WeightSource.register(PolicyWeights)
    return PolicyWeights(model, dtype, untie, merge_lora)


def token_versions(spans: Optional[Sequence[dict]], num_tokens: int, default: int) -> list[int]:
    """Per response token, the weight version that sampled it, from vLLM's spans ({"version", "start", "end"}:
    tokens [start, end) sampled by `version`); `default` for tokens no span covers (an engine that reports none).

    A response cut after its first stop keeps the first `num_tokens` entries."""
    versions = [default] * num_tokens
    for span in spans or []:
        for t in range(max(int(span["start"]), 0), min(int(span["end"]), num_tokens)):
            versions[t] = int(span["version"])
    return versions


class ServerGenerator:
    """The `vllm_server` backend: see the module docstring. Build it on every trainer rank (same arguments).

    Weights may be updated while generate() runs in another thread (`in_flight_weight_updates`): the engines are
    paused with their requests kept, take the new weights and resume, and a response then spans versions.

    `adapter_dir` (adapter-only sync, a LoRA policy; engines started with LoRA on: engines.engine_specs' lora_rank):
    the first sync broadcasts the frozen base weights; every sync writes the adapter to a folder of its own under
    `adapter_dir` (which the engines must read: the same node, or a shared file system) and loads it on every engine
    as `policy_<version>` (/v1/load_lora_adapter); each request names the newest adapter when it is sent, so its
    tokens are all that version's (an in-flight request keeps its adapter: the adapters `keep_adapters` versions back
    stay loaded, older ones are unloaded and their folders removed)."""

    in_flight_weight_updates = True

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer: Any,
        eos_ids: Sequence[int],
        model: Any,
        *,
        rank: int,
        num_ranks: int,
        transfer: str,
        tensor_parallel_size: int = 1,
        dtype: torch.dtype = torch.float32,
        untie: bool = False,
        max_model_len: int = 4096,
        timeout: float = 600.0,
        transfer_address: str = "127.0.0.1",
        local_engines: Any = None,
        adapter_dir: Optional[str] = None,
        keep_adapters: int = 1,
    ) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.urls, self.tokenizer, self.eos_ids = list(urls), tokenizer, [int(i) for i in eos_ids]
        self.rank, self.num_ranks, self.timeout, self.max_model_len = rank, num_ranks, timeout, max_model_len
        self.local_engines = local_engines
        self.fleet = EngineFleet(self.urls, tensor_parallel_size, timeout)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="engine-generate")
        self.source = _weight_source(model, dtype, untie, merge_lora=adapter_dir is None)
        self.dtype, self.adapter_dir, self.keep_adapters = dtype, adapter_dir, keep_adapters
        self.adapters: dict[int, str] = {}  # adapter sync: version -> folder of the adapters loaded on the engines
        self.full_sync_bytes = 0  # adapter sync: the base weights' bytes, sent once
        self.version: Optional[int] = None
        self.sent_versions: set[int] = set()  # every version broadcast: the only labels a token may carry
        self.generating = 0  # generate() calls in flight (threads): a sync then keeps their requests paused in place
        self.last_sync_seconds, self.last_sync_bytes = 0.0, 0
        if transfer == "gloo":
            from open_instruct.vllm_gloo_transfer import GlooTrainerInitInfo as InitInfo
            from open_instruct.vllm_gloo_transfer import register

            register()
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo as InitInfo
        world = 1 + len(self.urls) * tensor_parallel_size  # trainer rank 0 + every worker of every engine
        port = free_port() if rank == 0 else 0  # only rank 0 hosts the group's store
        info = InitInfo(master_address=transfer_address, master_port=port, world_size=world, rank=rank)
        if transfer == "gloo":
            info.timeout_s = timeout
        self.transfer = WeightTransferTrainerFactory.trainer_init(info, client=self.fleet, source=self.source)

    @classmethod
    def from_config(
        cls, cfg: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int
    ) -> ServerGenerator:
        return build(cfg, policy, tokenizer, accelerator, max_model_len)

    # ------------------------------------------------------------------------------------------------ weights
    def sync_weights(self, model: Any, version: Optional[int] = None) -> None:
        """Broadcast the policy's weights to every engine, labelled `version` (default: the last + 1). Collective:
        every trainer rank calls it (FSDP gathers); rank 0 sends."""
        t0 = time.perf_counter()
        self.source.model = model
        version = (self.version or 0) + 1 if version is None else int(version)
        self._check_engines()
        if self.adapter_dir is None or not self.sent_versions:  # merged weights; adapter sync: the base once
            self.fleet.next_version = str(version)
            self.fleet.keep_in_flight = self.generating > 0
            self._send_on_every_rank()
            self.full_sync_bytes = self.last_sync_bytes = self.source.bytes_sent
        if self.adapter_dir is not None:
            self.last_sync_bytes = self._load_adapter(model, version)
        self.sent_versions.add(version)
        self.version = version
        self.last_sync_seconds = time.perf_counter() - t0

    def _load_adapter(self, model: Any, version: int) -> int:
        """Adapter sync: this version's adapter to a new folder and onto every engine (rank 0; every rank gathers the
        factors under FSDP and waits until the engines hold it); the adapters more than keep_adapters versions old
        unloaded. Its bytes."""
        import shutil

        from open_instruct import lora
        from open_instruct.vllm_generator import adapter_weights

        tensors = adapter_weights(model, self.dtype)  # collective under FSDP
        written = sum(t.numel() * t.element_size() for t in tensors.values())  # every rank's count, rank 0 writes
        if self.rank == 0:
            folder = os.path.join(self.adapter_dir, f"adapter_{version}")
            shutil.rmtree(folder, ignore_errors=True)  # a resumed run's earlier copy of this version
            lora.write_adapter(model, tensors, folder)
            # in place: engines started apart may hold this name from a run resumed since
            load = {"lora_name": adapter_name(version), "lora_path": folder, "load_inplace": True}
            self.fleet.post_all("v1/load_lora_adapter", load)
            if not self.adapters:
                print(
                    f"vLLM adapter-only weight sync: {written:,} bytes per sync (the merged weights: "
                    f"{self.full_sync_bytes:,} bytes, {self.full_sync_bytes / max(written, 1):.1f}x)",
                    flush=True,
                )
            self.adapters[version] = folder
            for old in [v for v in self.adapters if v < version - self.keep_adapters]:
                self.fleet.post_all("v1/unload_lora_adapter", {"lora_name": adapter_name(old)})
                shutil.rmtree(self.adapters.pop(old), ignore_errors=True)
        if self.num_ranks > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank names the adapter before every engine holds it
        return written

    def _send_on_every_rank(self) -> None:
        """vLLM's trainer engine returns on the non-sending ranks as soon as their share of the gathers is done,
        before rank 0 has finished the update: a barrier keeps every rank here until it has, so none sends requests
        to an engine still loading. (If rank 0 fails, its exit breaks the barrier and the launcher stops the rest.)"""
        try:
            self.transfer.send_weights()
        except EngineError:
            raise
        except Exception as e:  # the transport failed (e.g. an engine died mid-broadcast): name the engines
            self._check_engines()  # a dead local engine: its index and log
            engines = ", ".join(f"vLLM engine {k} ({url})" for k, url in enumerate(self.urls))
            raise EngineError(f"the weight broadcast to {engines} failed: {type(e).__name__}: {e}") from e
        if self.num_ranks > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    # ------------------------------------------------------------------------------------------------ generation
    def _check_engines(self) -> None:
        if self.local_engines is not None:
            self.local_engines.check_alive()

    def _request(
        self,
        engine: int,
        prompt: Sequence[int],
        config: GenerationConfig,
        seed: Optional[int],
        max_tokens: int,
        adapter: Optional[str] = None,
    ) -> dict:
        n = 1 if config.greedy else config.n  # vLLM refuses n > 1 with greedy sampling: the copies are identical
        sampling = {
            "n": n,
            "temperature": float(config.temperature),
            "top_p": float(config.top_p),
            "top_k": int(config.top_k),
            "min_p": float(config.min_p),
            "repetition_penalty": 1.0,
            "max_tokens": max_tokens,
            "stop_token_ids": self.eos_ids,
            "logprobs": 0,
            "seed": seed,
        }
        if config.stop_strings:  # matched by vLLM on its detokenisation; finalize_response re-cuts on ours
            sampling.update(stop=list(config.stop_strings), include_stop_str_in_output=True)
        body = {"token_ids": list(prompt), "sampling_params": sampling, "output_mode": "tokens"}
        if adapter is not None:  # adapter sync: sampled by the base weights and this adapter
            body["model"] = adapter
        reply = self.fleet.post(engine, "inference/v1/generate", body)
        if adapter is not None and reply.get("model") != adapter:
            raise EngineError(f"vLLM engine {engine} ({self.urls[engine]}) answered as {reply.get('model')!r}, not "
                              f"the adapter {adapter!r} the request named")  # fmt: skip
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        return {"engine": engine, "choices": choices * (config.n if n == 1 and config.n > 1 else 1)}

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        config: GenerationConfig,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> GenerationOutput:
        budgets = engine_budgets(prompt_ids, config, max_new_tokens, self.max_model_len)
        self._check_engines()
        self.generating += 1
        try:
            return self._generate(prompt_ids, config, budgets)
        finally:
            self.generating -= 1

    def _generate(
        self, prompt_ids: Sequence[Sequence[int]], config: GenerationConfig, budgets: list[int]
    ) -> GenerationOutput:
        first = self.version  # the oldest version a token of this call may carry
        # adapter sync: every request of this call names the adapter of the version it starts from
        adapter = adapter_name(first) if self.adapter_dir is not None and first is not None else None
        base = None  # greedy needs no seed and leaves the global RNG alone
        if not config.greedy:
            base = config.seed if config.seed is not None else int(torch.randint(0, 2**62, (1,)))
        futures = [
            self.pool.submit(
                self._request,
                (self.rank + i) % len(self.urls),
                p,
                config,
                None if base is None else prompt_seed(base, i),
                budgets[i],
                adapter,
            )
            for i, p in enumerate(prompt_ids)
        ]
        out = GenerationOutput(prompt_ids=[list(p) for p in prompt_ids])
        for i, future in enumerate(futures):
            reply = future.result()
            if len(reply["choices"]) != config.n:
                engine, got = reply["engine"], len(reply["choices"])
                raise EngineError(f"vLLM engine {engine} ({self.urls[engine]}) returned {got} samples, not {config.n}")
            for choice in reply["choices"]:
                self._append(out, i, reply["engine"], choice, config, first)
        return out

    def _append(
        self, out: GenerationOutput, i: int, engine: int, choice: dict, config: GenerationConfig, first: Optional[int]
    ) -> None:
        ids, text, stopped = finalize_response(choice["token_ids"], self.eos_ids, self.tokenizer, config.stop_strings)
        stopped = stopped or choice.get("finish_reason") == "stop"
        default = self.version if self.version is not None else -1
        if self.adapter_dir is not None:  # every token is the version of the adapter its request named (checked)
            versions = [default if first is None else first] * len(ids)
        else:
            versions = token_versions(choice.get("weight_versions"), len(ids), default if first is None else first)
        # every label must be a version sent since this call began: an older one means the engine missed an update
        expected = {v for v in self.sent_versions if first is None or v >= first}
        if self.version is not None and set(versions) - expected:
            raise EngineError(
                f"vLLM engine {engine} ({self.urls[engine]}) sampled with weight version(s) "
                f"{sorted(set(versions) - expected)}, not one of {sorted(expected)} it was sent while generating: "
                f"it missed a weight update"
            )
        content = (choice.get("logprobs") or {}).get("content") or []
        out.response_ids.append(ids)
        out.texts.append(text)
        out.stopped.append(stopped)
        out.logprobs.append([float(step["logprob"]) for step in content[: len(ids)]])
        out.prompt_index.append(i)
        out.weight_versions.append(versions)

    def generation_context(self, model: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()  # the engines hold their own copy of the weights

    def score_tokens(
        self, prompt_ids: Sequence[Sequence[int]], continuation_ids: Sequence[Sequence[int]], top_k: int = 0
    ) -> dict[str, Any]:
        """Every engine's prompt log-probs of each continuation (`prompt_logprobs` on the token-in route: the raw
        model, temperature 1), with the top-k per position; engines asked concurrently."""
        from open_instruct.generation_check import TokenScores

        adapter = adapter_name(self.version) if self.adapter_dir is not None and self.version is not None else None

        def one(engine: int, prompt: Sequence[int], cont: Sequence[int]) -> tuple[list[float], list[dict]]:
            sampling = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k, "stop_token_ids": self.eos_ids}
            body = {"token_ids": list(prompt) + list(cont), "sampling_params": sampling, "output_mode": "tokens"}
            if adapter is not None:
                body["model"] = adapter
            rows = self.fleet.post(engine, "inference/v1/generate", body)["prompt_logprobs"]
            rows = [{int(i): v for i, v in (row or {}).items()} for row in rows[len(prompt) : len(prompt) + len(cont)]]
            logprobs = [float(row[int(t)]["logprob"]) if int(t) in row else -math.inf for row, t in zip(rows, cont)]
            tops = [{i: float(v["logprob"]) for i, v in row.items() if int(v["rank"]) <= top_k} for row in rows]
            return logprobs, tops

        pairs = list(zip(prompt_ids, continuation_ids))
        # adapter sync: one sequence at a time (vLLM batches prompt log-probs under LoRA wrongly: vllm#16668)
        chunks = [pairs] if adapter is not None else [[pair] for pair in pairs]

        def rows_of(engine: int, chunk: list) -> list[tuple[list[float], list[dict]]]:
            return [one(engine, p, c) for p, c in chunk]

        futures = {k: [self.pool.submit(rows_of, k, chunk) for chunk in chunks] for k in range(len(self.urls))}
        out = {}
        for k, fs in futures.items():
            scores = TokenScores([], [] if top_k else None)
            for logprobs, tops in (row for f in fs for row in f.result()):
                scores.logprobs.append(logprobs)
                if top_k:
                    scores.top.append(tops)
            out[f"vLLM engine {k} ({self.urls[k]}, version {self.version})"] = scores
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.local_engines is not None:
            self.local_engines.close()
            self.local_engines = None


def adapter_name(version: int) -> str:
    """The name an adapter-only sync loads version `version` under (what requests name as their model)."""
    return f"policy_{version}"


def build(cfg: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int) -> ServerGenerator:
    """The recipe's engines (started here on rank 0 when vllm_server_urls is unset) and a ServerGenerator on every
    rank. Collective: every rank calls it (`ServerGenerator.from_config`)."""

    from accelerate.utils import broadcast_object_list

    from open_instruct import engines
    from open_instruct.distributed import unwrap_model
    from open_instruct.errors import ConfigError
    from open_instruct.generation import default_eos_token_ids
    from open_instruct.models import DTYPES

    on_gpu = torch.cuda.is_available()
    transfer = engines.weight_transfer_backend(cfg.vllm_weight_transfer, on_gpu)
    model_dir = os.path.join(cfg.output_dir, "engine_model")
    untie = bool(getattr(unwrap_model(policy).config, "tie_word_embeddings", False))
    local, urls = None, list(cfg.vllm_server_urls or [])
    if not urls:  # start the engines on this node, on the devices after the training processes'
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        if local_world != accelerator.num_processes:
            raise ConfigError(
                f"training spans several nodes ({accelerator.num_processes} processes, {local_world} here): start the "
                f"engines with `python -m open_instruct.engines <recipe>` on the generation node(s) and pass "
                f"--vllm_server_urls"
            )
        shared: list[Any] = [None]
        if accelerator.is_main_process:
            try:
                engines.write_engine_model(cfg.model_name_or_path, model_dir, cfg.trust_remote_code, cfg.gguf_file)
                devices = engines.free_generation_devices(local_world) if on_gpu else None
                if on_gpu and cfg.vllm_engine_devices is not None:  # device 0 only with gloo transfer (see
                    # generation_backends.same_gpu_nccl_problem)
                    devices = list(cfg.vllm_engine_devices)
                specs = engines.specs_for_config(
                    cfg, model_dir, devices, "127.0.0.1", engines.free_port(), max_model_len
                )
                local = engines.LocalEngines(  # ports of our own choosing: another free one if taken meanwhile
                    specs, os.path.join(cfg.output_dir, "engine_logs"), cfg.vllm_engine_start_timeout, repick_ports=True
                )
                shared = [local.urls]
            except Exception as e:  # every rank must leave the broadcast: tell them, then raise here
                shared = [f"{type(e).__name__}: {e}"]
                broadcast_object_list(shared)
                raise
        broadcast_object_list(shared)
        if isinstance(shared[0], str):
            raise engines.EngineError(f"rank 0 could not start the vLLM engines: {shared[0]}")
        urls = shared[0]
    address = "127.0.0.1" if local is not None or not cfg.vllm_server_urls else None
    address = os.environ.get("OI_WEIGHT_TRANSFER_ADDR") or address or os.environ.get("MASTER_ADDR") or socket.getfqdn()
    return ServerGenerator(
        urls,
        tokenizer,
        default_eos_token_ids(unwrap_model(policy), tokenizer),
        policy,
        rank=accelerator.process_index,
        num_ranks=accelerator.num_processes,
        transfer=transfer,
        tensor_parallel_size=cfg.vllm_tensor_parallel_size,
        dtype=DTYPES[cfg.mixed_precision],
        untie=untie,
        max_model_len=max_model_len,
        timeout=cfg.vllm_server_timeout,
        transfer_address=address,
        local_engines=local,
        adapter_dir=os.path.join(cfg.output_dir, "engine_adapters") if engines.adapter_sync(cfg) else None,
        keep_adapters=cfg.async_steps + 1,
    )
