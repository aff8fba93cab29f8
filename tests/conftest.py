"""Shared fixtures: tiny models and tokenizer built locally once per session (no hub access)."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def data_cache_in_tmp(tmp_path_factory):
    """The tokenized-data cache (open_instruct/data_cache.py) of every run a test starts, in-process or not, goes to
    a session folder instead of ~/.cache."""
    os.environ.setdefault("OPEN_INSTRUCT_DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"causal_lm": path, "seq_cls": path}: Llama-shaped, hidden 64, 2 layers, char-level chat tokenizer."""
    from demo.tiny import save_tiny_models

    return save_tiny_models(str(tmp_path_factory.mktemp("tiny_models")))


@pytest.fixture(scope="session")
def repo_root():
    return REPO
