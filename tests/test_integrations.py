"""The registry of integrations (open_instruct/integrations.py): a third-party module named by its import path
registers its prefix and is then a data source for the loader, the mixture labels, the data cache, the start
checks and the planner, with no edit to the library; plain sources import nothing; a built-in integration's
verifier is imported when a row names it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from open_instruct import data, data_cache, integrations, mixture, plan, preflight
from open_instruct.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

THIRD_PARTY = """
from open_instruct.errors import ConfigError
from open_instruct.integrations import Source, register_source

IMPORTS = [0]
IMPORTS[0] += 1


def generate(spec, split):
    n = int(spec.partition(":")[2].split("?")[0])
    return [{"messages": [{"role": "user", "content": f"{split} {i}"}], "ground_truth": str(i), "dataset": "gsm8k"}
            for i in range(n)]


def check(spec, where):
    if not spec.partition(":")[2].split("?")[0].isdigit():
        raise ConfigError(f"{where}: {spec!r} names no row count")


register_source(Source(prefix=__name__, generate=generate, check=check, identity=lambda spec: [spec, "v1"],
                       size=lambda spec, split: (int(spec.partition(":")[2]), "counted by my_tasks"),
                       label=lambda spec: "mine_" + spec.partition(":")[2],
                       continues=lambda part: part.isdigit()))
"""


@pytest.fixture
def my_tasks(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(THIRD_PARTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_tasks"
    integrations.SOURCES.pop("my_tasks", None)
    sys.modules.pop("my_tasks", None)


def test_a_third_party_source_by_its_import_path(my_tasks):
    assert "my_tasks" not in sys.modules
    rows = data.load_rows("my_tasks:3", "test")
    assert [r.data["ground_truth"] for r in rows] == ["0", "1", "2"]
    assert rows[0].data["messages"][0]["content"] == "test 0" and rows[0].label == "mine_3"
    assert sys.modules["my_tasks"].IMPORTS == [1]  # imported once, when the spec was first read
    # `continues`: a bare part after one of its specs is another of them, a file is not
    assert integrations.expand_sources("my_tasks:2,4, x.jsonl") == ["my_tasks:2", "my_tasks:4", "x.jsonl"]
    assert mixture.source_labels(["my_tasks:2", "my_tasks:4"]) == ["mine_2", "mine_4"]
    assert data_cache.source_identity("my_tasks:2") == ["my_tasks:2", "v1"]
    assert plan.dataset_size("my_tasks:2,5", "train") == (7, "counted by my_tasks")
    preflight.check_dataset("my_tasks:2", "dataset_name_or_path")
    with pytest.raises(ConfigError, match=r"dataset_name_or_path: 'my_tasks:two' names no row count"):
        preflight.check_dataset("my_tasks:two", "dataset_name_or_path")


def test_a_third_party_module_that_does_not_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_tasks.py").write_text("raise RuntimeError('no server')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"importing 'broken_tasks' failed: RuntimeError: no server"):
        integrations.find("broken_tasks:1")


@pytest.mark.parametrize(
    "spec", ["data/train.jsonl", "allenai/RLVR-GSM", "my_envs.py:Guess", "/abs/file.py:Env", "tool", "gsm8k", "3"]
)
def test_plain_specs_name_no_integration(spec):
    assert integrations.prefix_of(spec) is None and integrations.find(spec) is None


def test_a_plain_run_imports_no_integration_until_a_row_names_one():
    """In a fresh interpreter: the core modules import no integration; a row's `reasoning_gym` verifier imports the
    module that registers it; a `verifiers:` spec imports the verifiers adapter."""
    code = (
        "import sys\n"
        "from open_instruct import data, environments, plan, preflight, rewards\n"
        "names = ('reasoning_gym_tasks', 'verifiers_env', 'verifiers_v1', 'verifiers_v1_play', 'openenv_env', "
        "'judge', 'lora')\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('open_instruct.') and m[14:] in names)\n"
        "assert loaded() == [], loaded()\n"
        "assert rewards.normalize_verifier_name('reasoning_gym_leg_counting') == 'reasoning_gym'\n"
        "assert loaded() == ['open_instruct.reasoning_gym_tasks'], loaded()\n"
        "from open_instruct import integrations\n"
        "assert integrations.find('verifiers:my_env.py').prefix == 'verifiers'\n"
        "print(loaded())\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "open_instruct.verifiers_v1_play" in done.stdout and "open_instruct.judge" not in done.stdout
