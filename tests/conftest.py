"""Shared fixtures: tiny models and tokenizer built locally once per session (no hub access)."""

import atexit
import os
import shutil
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tokenized-data cache (open_instruct/data_cache.py) of every run a test starts, in-process or not, goes to a
# folder of this process's session instead of ~/.cache; set here, before a test module copies os.environ at import
if "OPEN_INSTRUCT_DATA_CACHE" not in os.environ:
    os.environ["OPEN_INSTRUCT_DATA_CACHE"] = tempfile.mkdtemp(prefix="oi_test_data_cache_")
    atexit.register(shutil.rmtree, os.environ["OPEN_INSTRUCT_DATA_CACHE"], True)


# The files that take longest (`python tests/_test_times.py`, docs/testing.md), run first: `make test` gives each file
# whole to one pytest-xdist worker (--dist loadfile), and a long file handed out last would keep the run waiting.
SLOW_FILES = (
    "test_engine_client_runs.py",  # the vLLM suite's (make test-vllm): whole GRPO runs on dedicated engines
    "test_engine_client.py",
    "test_demo.py",  # its module fixture runs the whole demo pipeline
    "test_fsdp.py",
    "test_lora.py",
    "test_rlvr.py",
    "test_packing.py",
    "test_multiturn_rlvr.py",
    "test_tool_demo.py",
    "test_reliability.py",
    "test_bad_inputs.py",
    "test_layouts.py",
    "test_dpo.py",
)


def pytest_collection_modifyitems(config, items):
    """Slow files first, the rest in their usual order (the sort is stable); every worker sorts alike."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"causal_lm": path, "seq_cls": path}: Llama-shaped, hidden 64, 2 layers, char-level chat tokenizer."""
    from demo.tiny import save_tiny_models

    return save_tiny_models(str(tmp_path_factory.mktemp("tiny_models")))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load (from_pretrained or from_config, Auto classes or a model class) fails the test."""
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for cls in (PreTrainedModel, _BaseAutoModelClass):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(boom))
    monkeypatch.setattr(_BaseAutoModelClass, "from_config", classmethod(boom))


@pytest.fixture(scope="module")
def iso():
    """The sandbox's isolation where it is namespaces as root (what the containment tests exercise); skips, saying
    why, elsewhere."""
    import sys

    from open_instruct import sandbox

    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox's containment needs Linux")
    found = sandbox.isolation()
    if found.mode != "namespaces" or not found.as_root:
        pytest.skip(f"this machine gives isolation {found.mode!r} (root: {found.as_root}): {found.note}")
    return found


@pytest.fixture(scope="session")
def repo_root():
    return REPO


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (training subprocesses, torchrun, accelerate)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With OPEN_INSTRUCT_TEST_TIMES=DIR, each test's wall and CPU seconds (setup, call and teardown together, module
    fixtures included where they are built or torn down) go to DIR/<worker>.jsonl: CPU time does not grow when other
    jobs share the machine, wall time does. Summary: `python tests/_test_times.py DIR`."""
    out_dir = os.environ.get("OPEN_INSTRUCT_TEST_TIMES")
    if not out_dir:
        return (yield)
    import json
    import time

    wall, cpu = time.perf_counter(), _cpu_seconds()
    try:
        return (yield)
    finally:
        row = {"test": item.nodeid, "wall_s": time.perf_counter() - wall, "cpu_s": _cpu_seconds() - cpu}
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
