"""Generation backends by name: the one place that knows every backend, so the contract (`generation.py`), each
backend (`generation.HFGenerator`, `vllm_generator.VLLMGenerator`, `engine_client.ServerGenerator`) and the RL
script never import each other or name one.

    check_backend(cfg.generation_backend)                 # before anything loads: known, its extra installed
    check_before_loading(cfg, max_model_len)              # engines started apart answer and fit the run
    gen = make_generator(cfg, policy, tokenizer, accelerator, max_model_len)   # the backend cfg names

A new backend: a class keeping the whole `generation.Generator` contract (tests/test_architecture.py checks it),
and one row in BACKEND_CLASSES.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

from open_instruct.distributed import fsdp_requested
from open_instruct.errors import ConfigError
from open_instruct.generation import Generator

# name -> "module:class". Imported only when asked for: the vLLM backends are an optional extra.
BACKEND_CLASSES = {
    "hf": "open_instruct.generation:HFGenerator",
    "vllm": "open_instruct.vllm_generator:VLLMGenerator",
    "vllm_server": "open_instruct.engine_client:ServerGenerator",
}
BACKENDS = tuple(BACKEND_CLASSES)
NEEDS_VLLM = ("vllm", "vllm_server")


def check_backend(backend: str) -> None:
    """Fail before any model loads when a backend is unknown, or is an optional extra that is missing or of an
    unsupported version (ConfigError, exit 2)."""
    if backend not in BACKENDS:
        raise ConfigError(f"generation_backend {backend!r}: choose one of {BACKENDS}")
    if backend in NEEDS_VLLM:
        from open_instruct.vllm_generator import check_vllm_version

        try:
            check_vllm_version()
        except (ImportError, RuntimeError) as e:
            raise ConfigError(f"generation_backend {backend}: {e}") from None


def check_before_loading(cfg: Any, max_model_len: int) -> None:
    """Engines started apart (`vllm_server_urls`; the config ties them to their backend) are reached and checked
    against the run before any model loads: they answer, max_model_len fits, the dtype and weight transfer match.
    Async hf generation keeps a whole copy of the policy per version: one process only (not a sharded policy)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.async_steps and cfg.generation_backend == "hf" and world > 1:
        raise ConfigError(
            f"async_steps {cfg.async_steps} with generation_backend hf runs in one process (it generates from whole "
            f"copies of the policy), not {world}: use generation_backend vllm_server for async training on several"
        )
    if cfg.async_steps and cfg.generation_backend == "hf" and fsdp_requested():
        # torch refuses to deep-copy an FSDP2 module ("FSDP does not support deepcopy"), even on one process
        raise ConfigError(
            f"async_steps {cfg.async_steps} with generation_backend hf generates from frozen copies of the policy, "
            "and an FSDP-sharded policy cannot be copied: launch without the FSDP accelerate config (one process, "
            "`python open_instruct/rlvr_ppo.py ...`), or use generation_backend vllm_server, or async_steps 0"
        )
    import torch

    on_gpu = torch.cuda.is_available()
    problem = same_gpu_nccl_problem(cfg, on_gpu)
    if problem:
        raise ConfigError(problem)
    if on_gpu and cfg.generation_backend == "hf":  # HF generation that cannot fit is refused before any load
        from open_instruct.plan import check_hf_generation_fits

        memory_gb = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 1e9
        check_hf_generation_fits(cfg, world, memory_gb, fsdp_requested())
    if not cfg.vllm_server_urls:
        return
    from open_instruct import engines  # the vLLM engines' module, imported only by a run that uses them

    engines.check_running_engines(
        cfg.vllm_server_urls,
        cfg.vllm_tensor_parallel_size,
        max_model_len,
        dtype=engines.engine_dtype(cfg.mixed_precision),
        transfer=engines.weight_transfer_backend(cfg.vllm_weight_transfer, on_gpu),
        lora_rank=cfg.lora_rank if engines.adapter_sync(cfg) else None,
    )


def same_gpu_nccl_problem(cfg: Any, on_gpu: bool) -> Optional[str]:
    """Why the vllm_server engines this run starts cannot take NCCL weight transfer (None: they can). The weights go
    from trainer rank 0, on CUDA device 0 of this node, to every engine worker over one NCCL group; an engine listed
    in vllm_engine_devices on device 0 joins that group from the same physical GPU, which NCCL refuses ("Duplicate
    GPU detected", ncclInvalidUsage) only after the engine has loaded."""
    if cfg.generation_backend != "vllm_server" or cfg.vllm_server_urls or cfg.vllm_engine_devices is None:
        return None  # engines started apart, or on the GPUs after the trainer's (the default)
    from open_instruct import engines

    if not on_gpu or engines.weight_transfer_backend(cfg.vllm_weight_transfer, on_gpu) != "nccl":
        return None
    if 0 not in cfg.vllm_engine_devices:
        return None
    return (
        f"vllm_engine_devices {cfg.vllm_engine_devices} puts a vLLM engine on GPU 0, the GPU of trainer rank 0, and "
        f"NCCL weight transfer (vllm_weight_transfer {cfg.vllm_weight_transfer}) cannot join two ranks on one GPU. "
        "Use the colocated engine (generation_backend vllm), give the engines GPUs the trainer does not use "
        "(vllm_engine_devices, or unset it: the GPUs after the training processes'), or vllm_weight_transfer gloo "
        "(host-staged, slower)"
    )


def backend_class(backend: str) -> type:
    """The class of a backend name (imports it: the vLLM ones need the optional extra)."""
    if backend not in BACKEND_CLASSES:
        raise ValueError(f"unknown generation backend {backend!r}; choose one of {BACKENDS}")
    module, name = BACKEND_CLASSES[backend].split(":")
    return getattr(importlib.import_module(module), name)


def make_generator(cfg: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int) -> Generator:
    """The generator `cfg.generation_backend` names, built from the run's config (collective: every rank calls it).
    `policy` is the prepared model; `max_model_len` the longest prompt + response it must hold."""
    return backend_class(cfg.generation_backend).from_config(cfg, policy, tokenizer, accelerator, max_model_len)


def generator_for(backend: str, model: Any, tokenizer: Any, **kw: Any) -> Generator:
    """A backend built straight from a model, outside an RL run (the eval entry points); `kw` go to its class
    (hf: batch_size; vllm: max_model_len, seed, ...)."""
    return backend_class(backend)(model, tokenizer, **kw)


def make_checker(cfg: Any, generator: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int) -> Any:
    """The generation check of `generator` (generation_check.GenerationChecker: every weight sync under a deadline,
    the first checking the generator against the trainer, the others the weights it got), or None when it samples
    synchronously with the trainer's own module (hf without async_steps): nothing is copied, nothing to check."""
    samples_with = getattr(generator, "model", None)  # hf: the trainer's module (unwrapped from DDP)
    if not cfg.async_steps and (samples_with is policy or samples_with is accelerator.unwrap_model(policy)):
        return None
    from open_instruct.generation_check import GenerationChecker

    return GenerationChecker.from_config(cfg, generator, policy, tokenizer, accelerator, max_model_len)
