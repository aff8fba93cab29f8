"""Generation backends by name: the one place that knows every backend, so the contract (`generation.py`) and each
backend (`generation.HFGenerator`, `vllm_generator.VLLMGenerator`) never import each other.

    gen = make_generator(cfg.generation_backend, policy, tokenizer, batch_size=64)
"""

from __future__ import annotations

from typing import Any

from open_instruct.errors import ConfigError
from open_instruct.generation import Generator, HFGenerator

BACKENDS = ("hf", "vllm", "vllm_server")


def check_backend(backend: str) -> None:
    """Fail before any model loads when a backend is unknown, or is an optional extra that is missing or of an
    unsupported version (ConfigError, exit 2)."""
    if backend not in BACKENDS:
        raise ConfigError(f"generation_backend {backend!r}: choose one of {BACKENDS}")
    if backend in ("vllm", "vllm_server"):
        from open_instruct.vllm_generator import check_vllm_version

        try:
            check_vllm_version()
        except (ImportError, RuntimeError) as e:
            raise ConfigError(f"generation_backend {backend}: {e}") from None


def make_generator(backend: str, model: Any, tokenizer: Any, **kw: Any) -> Generator:
    """The generator for a backend name. Extra keywords go to the backend (vllm_server: cfg, accelerator,
    max_model_len)."""
    if backend == "hf":
        return HFGenerator(model, tokenizer, **kw)
    if backend == "vllm":  # optional extra, imported only when asked for (raises a clear error when not installed)
        from open_instruct.vllm_generator import VLLMGenerator

        return VLLMGenerator(model, tokenizer, **kw)
    if backend == "vllm_server":  # dedicated engines: started or reached per the run's config (cfg=, accelerator=)
        from open_instruct.engine_client import build

        return build(kw["cfg"], model, tokenizer, kw["accelerator"], kw["max_model_len"])
    raise ValueError(f"unknown generation backend {backend!r}; choose one of {BACKENDS}")
