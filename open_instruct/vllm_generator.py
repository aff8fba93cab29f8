"""vLLM generation backend, colocated with training (optional extra: `pip install -r requirements-vllm.txt`).

    gen = VLLMGenerator(policy, tokenizer, max_model_len=1024, gpu_memory_utilization=.5)  # or make_generator(cfg, ...)
    out = gen.generate(prompt_ids, GenerationConfig(max_new_tokens=256, temperature=1.0, n=4, seed=1))
    ...optimizer steps on `policy`...
    gen.sync_weights(policy)          # the engine now samples from the updated policy; gen.last_sync_seconds

Same contract as `generation.HFGenerator` (see generation.py): prompts and responses are token ids, `n` contiguous
rows per prompt, cut after the first EOS / stop string with the stop kept, `stopped`, `texts`. Cutting is done by
the shared `finalize_response`, so both backends cut identically and the trainer's log-probs are computed on
exactly the sampled tokens.

How it works
- One `vllm.LLM` per training process, built once. Its folder holds only the policy's config and tokenizer; the
  engine starts with dummy weights and the policy's in-memory weights are pushed right away. So a GGUF-loaded model,
  a restored checkpoint or any in-memory model works, and nothing as large as the weights is written to disk.
- The engine runs in the training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): weight sync hands tensors over
  without serialising them. Under several training processes (torchrun/accelerate) each rank gets its own engine
  (tensor_parallel_size 1) through vLLM's `external_launcher` backend, generating for that rank's prompts.
- `sync_weights(model)` streams (HF name, full tensor) pairs into vLLM's supported in-place reload path
  (`collective_rpc("reload_weights", weights_iterator=...)` -> worker -> model runner -> `reload_weights`: the vLLM
  model's `load_weights` maps HF names onto fused layers, then the processed tensors are copied into the existing
  kernel tensors, so CPU-repacked weights and captured CUDA graphs stay valid), then clears the prefix cache so no
  KV block computed with old weights is reused. Calling the model's `load_weights` directly is wrong on CPU (the
  linear weights are repacked after loading). FSDP2-sharded parameters (DTensor) are gathered one at a time with
  `full_tensor()`: every rank must call `sync_weights` together, and the peak extra memory is one full parameter.
- LoRA: merged weights by default; `lora_sync="adapter"` (`vllm_lora_sync`) builds the engine with vLLM's LoRA,
  loads the frozen base weights once and then, per sync, the adapter alone: written as a peft folder and loaded
  under a new `LoRARequest` id that every request names (vLLM 0.32 loads adapters from folders only).
- Tied input/output embeddings are untied inside the engine (see `untied_lm_head`): vLLM 0.32's reload refreshes
  only one tensor of a tied pair.
- Memory: `gpu_memory_utilization` is the fraction of the GPU the engine may take (weights + KV cache); the
  trainer gets the rest. With `enable_sleep=True` (GPU platforms only; ignored with a warning elsewhere) the engine
  sleeps after each `generate` (level 2: KV cache and weights released), `sync_weights` wakes the weights before
  loading, and `generate` wakes the KV cache. If the weights were released and not re-synced (e.g. an eval generate
  between the sync and the next rollout), `generate` re-syncs from the last model it was given first.
- On CPU (tests here) the KV cache size is `kv_cache_memory_bytes` (default 1 GiB, or VLLM_CPU_KVCACHE_SPACE GB).

A dedicated generation GPU (e.g. 7 GPUs train, 1 generates) is the other backend, `engine_client.ServerGenerator`
(`generation_backend: vllm_server`): vLLM's own server on devices of its own, weights broadcast through vLLM's
weight-transfer engines, optionally one rollout ahead of the trainer (async_steps 1). This colocated class shares
every GPU between training and generation through `gpu_memory_utilization` (and sleep mode).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import warnings
import weakref
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch

from open_instruct.distributed import unwrap_model
from open_instruct.engines import adapter_sync, vllm_max_lora_rank
from open_instruct.generation import (
    GenerationConfig,
    GenerationOutput,
    default_eos_token_ids,
    engine_budgets,
    finalize_response,
    prompt_seed,
)
from open_instruct.models import DTYPES

# Tested with 0.32. The weight-sync path (Worker.reload_weights via collective_rpc) and the CPU/V1 engine internals
# it relies on move between minor releases, so other versions are refused instead of failing mid-run.
SUPPORTED_VLLM = ((0, 32), (0, 33))  # [low, high)
ANY_VERSION_ENV = "OPEN_INSTRUCT_VLLM_ANY_VERSION"  # =1 skips the check (at your own risk)
INSTALL_HINT = "pip install -r requirements-vllm.txt"


class _QuietRotaryReload(logging.Filter):
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every in-place reload: that layer has no checkpoint
    weights (its cos/sin cache is computed and kept), so the warning says nothing on each rollout."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


class VLLMVersionError(RuntimeError):
    pass


class VLLMUnavailableError(ImportError, NotImplementedError):
    """vLLM is not installed: an ImportError, and a NotImplementedError for callers that treat a missing backend so."""


def check_vllm_version(version: Optional[str] = None) -> str:
    """Raise VLLMVersionError unless `version` (default: the installed vllm's) is in SUPPORTED_VLLM; return it."""
    if version is None:
        try:
            import vllm
        except ImportError as e:
            raise VLLMUnavailableError(
                f"generation_backend 'vllm' needs the optional vLLM extra, which is not installed: {INSTALL_HINT} "
                f"(or use generation_backend hf). Import error: {e}"
            ) from e
        version = str(getattr(vllm, "__version__", "unknown"))
    (lo, hi) = SUPPORTED_VLLM
    wanted = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    try:
        from packaging.version import Version

        release = Version(version).release
    except Exception:
        release = None
    if release is None or len(release) < 2:
        raise VLLMVersionError(
            f"cannot read the installed vLLM version {version!r}; supported: vllm {wanted} ({INSTALL_HINT})"
        )
    if not lo <= tuple(release[:2]) < hi and os.environ.get(ANY_VERSION_ENV) != "1":
        raise VLLMVersionError(
            f"installed vLLM {version} is outside the supported range {wanted}: {INSTALL_HINT}, "
            f"or set {ANY_VERSION_ENV}=1 to try it anyway"
        )
    return version


# Wrapper prefixes that torch/accelerate insert into parameter names; vLLM expects the HF checkpoint names.
_NAME_NOISE = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def _full_tensor(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter, in `dtype` (default: its own). Collective for
    DTensors: all ranks call it. The local shard is cast before the all-gather (rounding is elementwise, so the
    result is the same): a bf16 gather moves and holds half the bytes of an fp32 one on every rank."""
    from torch.distributed.tensor import DTensor

    if dtype is not None:
        t = t.to(dtype)
    if not isinstance(t, DTensor):
        return t
    mesh_device = t.device_mesh.device_type
    if (
        t.device.type != mesh_device
    ):  # FSDP2 CPU offload: shards sit in host memory, the all-gather runs on the mesh's device
        t = DTensor.from_local(
            t.to_local().to(mesh_device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return t.full_tensor()


def _clean(name: str) -> str:
    for noise in _NAME_NOISE:
        name = name.replace(noise, "")
    return name


def hf_weights(
    model: Any, untie: bool = False, dtype: Optional[torch.dtype] = None, merge_lora: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor in `dtype`, default its own) for every parameter, one at a time; a shared tensor once
    under its first name, or, with `untie`, the output embedding also under its own name (for an engine whose
    lm_head is a separate tensor). Each shard is cast before it is gathered, except under LoRA (the merge is computed
    in float64 from the fp32 weights, then cast). `merge_lora=False`: a LoRA model's base weights alone (the frozen
    W, for an engine that applies the adapter itself: adapter_weights)."""
    from open_instruct import lora

    model = unwrap_model(model)
    seen: set[int] = set()
    named = dict(model.named_parameters())
    for p in named.values():
        seen.add(id(p))
    if not merge_lora:
        named = {k: p for k, p in named.items() if lora.is_base_tensor(k)}
    if lora.is_peft(model) and merge_lora:  # LoRA: the merged W + B @ A * scaling under the base names
        pairs = lora.merged_tensors(
            {k: p.detach() for k, p in named.items()},
            lora.scalings(model),
            _full_tensor,
            lora.fan_in_fan_out_layers(model),
        )
        pairs = ((name, t if dtype is None else t.to(dtype)) for name, t in pairs)
    else:
        pairs = ((name, _full_tensor(p.detach(), dtype)) for name, p in named.items())
    for name, tensor in pairs:
        yield _clean(lora.base_name(name)), tensor
    out = model.get_output_embeddings() if untie and hasattr(model, "get_output_embeddings") else None
    if out is not None and id(out.weight) in seen:  # tied: named_parameters gave it under the input embedding's name
        name = next(n for n, m in model.named_modules() if m is out)
        yield _clean(lora.base_name(f"{name}.weight")), _full_tensor(out.weight.detach(), dtype)


def adapter_weights(model: Any, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """A LoRA model's adapter as peft saves it (name -> whole factor in `dtype`, on the host): what an engine that
    applies the adapter itself receives on each sync. Collective under FSDP2 (every rank gathers each factor)."""
    from open_instruct import lora

    named = {_clean(k): p.detach() for k, p in unwrap_model(model).named_parameters()}
    return {name: t.cpu() for name, t in lora.adapter_tensors(named, lambda t: _full_tensor(t, dtype))}


class _RNGSnapshot:
    """The global RNG states (python, numpy, torch CPU and CUDA), to undo a library that reseeds them."""

    def __init__(self) -> None:
        import random

        import numpy as np

        self.py, self.np, self.cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        import random

        import numpy as np

        random.setstate(self.py)
        np.random.set_state(self.np)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"vLLM generation dtype must be float32, bfloat16 or float16, got {dtype}")
    return names[dtype]


class VLLMGenerator:
    """Colocated vLLM engine following the policy's weights (see the module docstring)."""

    last_sync_bytes = 0  # the weights are handed over in-process, by reference
    in_flight_weight_updates = False  # the engine shares the training devices: weights change between rollouts
    version = -1  # the label of the weights it holds (sync_weights); -1 before the first sync

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: Optional[int] = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep: bool = False,
        dtype: Any = None,
        seed: int = 0,
        eos_token_ids: Optional[Sequence[int]] = None,
        kv_cache_memory_bytes: Optional[int] = None,
        enforce_eager: Optional[bool] = None,
        batch_size: Optional[int] = None,
        lora_sync: str = "merged",
        **engine_kwargs: Any,
    ) -> None:
        """`batch_size` is accepted for call compatibility with HFGenerator and unused: vLLM schedules its own
        batches. `dtype` defaults to the policy's parameter dtype; `engine_kwargs` go to `vllm.LLM`. `lora_sync`
        "adapter" (a LoRA policy only): the engine holds the base weights and applies the adapter itself, and each
        sync sends the adapter alone ("merged": the merged weights, every sync)."""
        check_vllm_version()
        if lora_sync not in ("merged", "adapter"):
            raise ValueError(f"lora_sync must be 'merged' or 'adapter', got {lora_sync!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        # In-process engine: sync_weights passes tensors by reference (a separate engine process would need them
        # serialised). external_launcher forces the same.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        policy = unwrap_model(model)
        from open_instruct import lora

        self.adapter_sync = lora_sync == "adapter"
        if self.adapter_sync and not lora.is_peft(policy):
            raise ValueError("lora_sync 'adapter' needs a LoRA (peft) policy: use_lora is off")
        policy = lora.plain_model(policy) if self.adapter_sync else policy  # its config, dtype and eos ids
        hf_config = policy.config
        self.eos_ids = [int(i) for i in eos_token_ids] if eos_token_ids else default_eos_token_ids(policy, tokenizer)
        self.max_model_len = int(max_model_len or getattr(hf_config, "max_position_embeddings", 0) or 4096)
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            self._check_cpu_head_dim(hf_config)
        self.sleep_enabled = bool(enable_sleep)
        if self.sleep_enabled and not current_platform.is_sleep_mode_available():
            warnings.warn(f"vLLM sleep mode is not available on {current_platform.device_name}: enable_sleep ignored")
            self.sleep_enabled = False

        # A folder with the config and tokenizer only: weights come from the live policy (dummy load, then sync).
        self._dir = tempfile.mkdtemp(prefix="vllm_policy_")
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # removed with the generator or at exit
        config = hf_config.__class__.from_dict(hf_config.to_dict())
        if hasattr(config, "quantization_config"):  # a GGUF-loaded config still names its quantisation
            del config.quantization_config
        # Tied input/output embeddings get separate tensors in the engine, both loaded on every sync: vLLM 0.32's
        # in-place reload refreshes only the embedding of a tied pair and keeps the old lm_head (seen on CPU with
        # SmolLM2: garbage samples). Costs one vocab x hidden matrix, small for the models that tie (<= 3B).
        self.untied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        if self.untied_lm_head:
            config.tie_word_embeddings = False
        config.save_pretrained(self._dir)
        tokenizer.save_pretrained(self._dir)

        self.weight_dtype = dtype if isinstance(dtype, torch.dtype) else None  # what sync_weights gathers in
        kwargs: dict[str, Any] = dict(
            model=self._dir,
            load_format="dummy",
            dtype=_dtype_name(dtype if dtype is not None else next(policy.parameters()).dtype),
            seed=seed,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=self.on_cpu if enforce_eager is None else enforce_eager,  # CPU: compiling costs minutes
            enable_sleep_mode=self.sleep_enabled,
            generation_config="vllm",  # ignore the model's generation_config defaults (top_k, penalties)
            # Returned log-probs of the distribution actually sampled (after temperature and top-p), like HFGenerator's.
            logprobs_mode="processed_logprobs",
        )
        if self.on_cpu and kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_memory_bytes = 1 << 30  # else vLLM takes gpu_memory_utilization of the host's RAM
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            # One engine per training rank inside the existing process group (vLLM reads the rank from the env).
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = seed + torch.distributed.get_rank()
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
            os.environ.setdefault("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
        if self.adapter_sync:  # vLLM's LoRA: one adapter at a time, the newest sync's
            rank = int(unwrap_model(model).peft_config[lora.ADAPTER].r)
            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(rank), max_loras=1)
        kwargs.update(engine_kwargs)

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietRotaryReload())
        t0 = time.perf_counter()
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        rng = _RNGSnapshot()
        try:
            self.llm = LLM(**kwargs)
        finally:
            # An in-process engine seeds the global random, numpy and torch RNGs with its seed, and vLLM's CPU worker
            # drops torch to 1 thread and disables torch.set_num_threads: give the trainer all three back.
            rng.restore()
            torch.set_num_threads = set_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        self.engine_seconds = time.perf_counter() - t0
        # Sleep level 2 releases both; each is woken only when needed (weights: to load into; KV cache: to generate).
        self._weights_released = self._kv_released = False
        self._model: Any = model
        self.last_sync_seconds = 0.0
        self.last_sync_bytes = 0  # in-process (merged): handed over by reference; adapter: the adapter written
        self.full_sync_bytes = 0  # what one merged sync moves (the base weights' bytes), for comparison
        self.lora_request: Any = None  # adapter sync: the adapter every request names (a new id per sync)
        self._base_loaded = False  # adapter sync: the engine holds the frozen base weights
        self.sync_weights(model)  # dummy weights -> the policy's

    @classmethod
    def from_config(cls, cfg: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int) -> VLLMGenerator:
        """One engine per rank, in the run's compute dtype, for rollouts and evals alike."""
        lora_sync = "adapter" if adapter_sync(cfg) else "merged"
        return cls(
            accelerator.unwrap_model(policy),
            tokenizer,
            max_model_len=max_model_len,
            dtype=DTYPES[cfg.mixed_precision],
            seed=cfg.seed,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep=cfg.vllm_enable_sleep,
            lora_sync=lora_sync,
        )

    @staticmethod
    def _check_cpu_head_dim(hf_config: Any) -> None:
        """vLLM's CPU attention kernels take only some head sizes; fail here rather than at the first generate."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"vLLM on CPU supports attention head sizes {sizes}; this model's head_dim is {head_dim} "
                f"(hidden_size {hf_config.hidden_size} / num_attention_heads {hf_config.num_attention_heads})"
            )

    # ------------------------------------------------------------------------------------------------ weights
    def sync_weights(self, model: Any, version: Optional[int] = None) -> None:
        """Load `model`'s current weights into the engine, labelled `version` (default: the last + 1). Collective
        under FSDP: call on every rank."""
        t0 = time.perf_counter()
        if self._weights_released:  # memory back, contents undefined until the reload below
            self.llm.wake_up(tags=["weights"])
            self._base_loaded = False
        if self.adapter_sync:
            self._sync_adapter(model)
        else:
            weights = hf_weights(model, untie=self.untied_lm_head, dtype=self.weight_dtype)
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._weights_released = False
        self._model = model
        self.version = self.version + 1 if version is None else int(version)
        self.last_sync_seconds = time.perf_counter() - t0

    def _sync_adapter(self, model: Any) -> None:
        """Adapter sync: the frozen base weights once (and after a sleep released them), then this sync's adapter
        written to a folder of its own and loaded under a new id (vLLM caches adapters by id); the previous one is
        dropped. Every later request names the new one."""
        from vllm.lora.request import LoRARequest

        from open_instruct import lora

        if not self._base_loaded:
            counted = []

            def counting(pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
                for name, t in pairs:
                    counted.append(t.numel() * t.element_size())
                    yield name, t

            base = counting(hf_weights(model, untie=self.untied_lm_head, dtype=self.weight_dtype, merge_lora=False))
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=base, is_checkpoint_format=True))
            self.full_sync_bytes, self._base_loaded = sum(counted), True
        previous = self.lora_request
        lora_id = previous.lora_int_id + 1 if previous is not None else 1
        folder = os.path.join(self._dir, f"adapter_{lora_id}")
        self.last_sync_bytes = lora.write_adapter(model, adapter_weights(model, self.weight_dtype), folder)
        self.lora_request = LoRARequest(f"policy_{lora_id}", lora_id, folder)
        self.llm.llm_engine.add_lora(self.lora_request)  # loaded now: a bad adapter fails the sync, not a generate
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        if previous is None and not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
            print(
                f"vLLM adapter-only weight sync: {self.last_sync_bytes:,} bytes per sync (the merged weights: "
                f"{self.full_sync_bytes:,} bytes, {self.full_sync_bytes / max(self.last_sync_bytes, 1):.1f}x)",
                flush=True,
            )

    def generation_context(self, model: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()  # the engine holds its own copy of the weights

    @torch.no_grad()
    def score_tokens(
        self, prompt_ids: Sequence[Sequence[int]], continuation_ids: Sequence[Sequence[int]], top_k: int = 0
    ) -> dict[str, Any]:
        """The engine's prompt log-probs of each continuation (vLLM's `prompt_logprobs`: the raw model, temperature
        1), with the top-k per position. Through the adapter (adapter sync), one sequence per engine step: vLLM 0.32's
        LoRA logits layer maps adapters per request, not per prompt position, and fails on a batch of prompt log-probs
        (vllm-project/vllm#16668); one request's single mapping applies to all its positions."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from open_instruct.generation_check import TokenScores

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        sequences = [TokensPrompt(prompt_token_ids=list(p) + list(c)) for p, c in zip(prompt_ids, continuation_ids)]
        batches = [[s] for s in sequences] if self.adapter_sync else [sequences]
        self._wake_for_generation()
        rng = _RNGSnapshot()
        try:
            results = [
                res
                for batch in batches
                for res in self.llm.generate(batch, params, use_tqdm=False, lora_request=self.lora_request)
            ]
        finally:
            rng.restore()
            self._sleep()
        scores = TokenScores([], [] if top_k else None)
        for res, prompt, cont in zip(results, prompt_ids, continuation_ids):
            rows = res.prompt_logprobs[len(prompt) : len(prompt) + len(cont)]
            scores.logprobs.append([float(row[int(t)].logprob) for row, t in zip(rows, cont)])
            if top_k:
                scores.top.append([{i: lp.logprob for i, lp in row.items() if lp.rank <= top_k} for row in rows])
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return {f"the colocated vLLM engine of rank {rank} (version {self.version})": scores}

    def _sleep(self) -> None:
        """Between generations: hand the GPU memory back to the trainer (level 2: nothing kept, the next sync
        rewrites the weights anyway)."""
        if self.sleep_enabled:
            self.llm.sleep(level=2)
            self._weights_released = self._kv_released = True

    def _wake_for_generation(self) -> None:
        if self._weights_released:  # no sync since the last sleep: reload from the live policy
            self.sync_weights(self._model, self.version)
        if self._kv_released:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_released = False

    # ------------------------------------------------------------------------------------------------ generation
    def _sampling_params(self, config: GenerationConfig, seed: Optional[int], max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=config.n,
            temperature=float(config.temperature),  # 0: greedy
            top_p=float(config.top_p),
            top_k=int(config.top_k),  # 0: off (generation.py conventions: only the truncation the config sets)
            min_p=float(config.min_p),
            repetition_penalty=1.0,
            max_tokens=max_tokens,
            stop=list(config.stop_strings) if config.stop_strings else None,
            stop_token_ids=list(self.eos_ids),
            include_stop_str_in_output=True,
            skip_special_tokens=False,  # stop strings are matched on the same text finalize_response decodes
            spaces_between_special_tokens=False,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob (processed: after temperature and truncation, see logprobs_mode)
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        config: GenerationConfig,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> GenerationOutput:
        budgets = engine_budgets(prompt_ids, config, max_new_tokens, self.max_model_len)
        from vllm.inputs import TokensPrompt

        # seed None: draw the base from the global torch RNG, so a caller that seeds torch gets repeatable rollouts.
        # Greedy decoding needs no seed and, as in HFGenerator, leaves the global RNG alone.
        if config.greedy:
            seeds: list[Optional[int]] = [None] * len(prompt_ids)
        else:
            base = config.seed if config.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            seeds = [prompt_seed(base, i) for i in range(len(prompt_ids))]
        params = [self._sampling_params(config, s, b) for s, b in zip(seeds, budgets)]
        self._wake_for_generation()
        rng = _RNGSnapshot()  # every request carries its own seed: the trainer's global RNGs stay untouched
        try:
            results = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids],
                params,
                use_tqdm=False,
                lora_request=self.lora_request,
            )
        finally:
            rng.restore()
            self._sleep()

        out = GenerationOutput(prompt_ids=[list(p) for p in prompt_ids])
        for i, res in enumerate(results):
            completions = sorted(res.outputs, key=lambda c: c.index)
            if len(completions) != config.n:
                raise RuntimeError(
                    f"vLLM returned {len(completions)} completions for prompt {i}, expected n={config.n}"
                )
            for c in completions:
                ids, text, stopped = finalize_response(c.token_ids, self.eos_ids, self.tokenizer, config.stop_strings)
                # vLLM matches stop strings on its incremental detokenisation; if it ended a response where the
                # one-shot decode sees no stop, the response still ended by a stop, not by max_new_tokens.
                stopped = stopped or c.finish_reason == "stop"
                out.response_ids.append(ids)
                out.texts.append(text)
                out.stopped.append(stopped)
                out.logprobs.append([float(step[t].logprob) for step, t in zip(c.logprobs, ids)])  # logprobs=0
                out.prompt_index.append(i)
                out.weight_versions.append([self.version] * len(ids))
        return out

    def close(self) -> None:
        """Shut the engine down and delete its folder. Only when the run is over: vLLM 0.32's shutdown tears down
        torch.distributed too, the trainer's default process group included (it also runs when the generator is
        garbage-collected or at interpreter exit)."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)
