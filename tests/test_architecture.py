"""The shape of the code, checked with `ast`: no import cycles, no upward imports, the RL script's `main` short and
shallow, the RL script's line budgets, no sys.path hacks. Cheap (no torch import), so it runs first in spirit: a
refactor that breaks the layering fails here with the cycle spelled out. One test runs a tiny plain GRPO step in a
subprocess: the modules it imports and the modules its step runs code of are fixed sets, so features cannot creep
back into the plain path."""

from __future__ import annotations

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("open_instruct", "eval", "demo")
SCRIPTS = ("open_instruct.sft", "open_instruct.reward_model", "open_instruct.dpo", "open_instruct.rlvr_ppo")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the three packages."""
    out = {}
    for package in PACKAGES:
        for name in sorted(os.listdir(os.path.join(REPO, package))):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                out[module] = os.path.join(REPO, package, name)
    return out


def imported_modules(path: str, known: set[str]) -> set[str]:
    """Every module of ours that `path` imports anywhere (top level or inside a function, TYPE_CHECKING included):
    `from open_instruct import data` counts as open_instruct.data, `from open_instruct.data import X` likewise."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # open_instruct.models.load_tokenizer -> open_instruct.models
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imported_modules(path, set(mods)) - {m} for m, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph is acyclic (depth-first search, three colours)."""
    colour, stack = dict.fromkeys(graph, 0), []

    def visit(node: str) -> list[str]:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if colour.get(nxt) == 0:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = 2
        return []

    for node in sorted(graph):
        if colour[node] == 0:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_upward_imports():
    """The library imports neither the demos nor eval nor the tests; nothing but demos, tests and benches imports a
    training script (what two scripts share lives in a shared module)."""
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("open_instruct"):
            upward = sorted(m for m in imports if m.split(".")[0] in ("eval", "demo", "tests", "bench"))
            assert not upward, f"{module} imports {upward}"
        if module.startswith(("open_instruct", "eval")):
            scripts = sorted(imports & set(SCRIPTS))
            assert not scripts, f"{module} imports the training script(s) {scripts}"


def function_node(path: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(open(path).read(), path)
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef, ast.ClassDef)


def max_nesting(node: ast.AST, depth: int = 0) -> int:
    """How many blocks (loops, ifs, withs, trys, nested defs) the deepest statement under `node` sits in."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt):
            inner = depth + 1 if isinstance(child, BLOCKS) else depth
            deepest = max(deepest, max_nesting(child, inner) if isinstance(child, BLOCKS) else depth)
    return deepest


def test_nesting_counter():
    code = "def f():\n    for a in b:\n        if c:\n            with d:\n                x = 1\n    y = 2\n"
    assert max_nesting(ast.parse(code).body[0]) == 3


RL_SCRIPT_MAX_LINES = 850  # issues 42, 68: the algorithm top to bottom (loop, loss, advantages), in one sitting
FUNCTION_MAX_LINES = 100
COLLECT_ROLLOUT_MAX_LINES = 60  # issue 68: each decision (forwards, reference rows, masks, KL) in a part of its own


def test_the_rl_script_stays_within_its_budgets():
    path = os.path.join(REPO, "open_instruct", "rlvr_ppo.py")
    source = open(path).read()
    assert len(source.splitlines()) <= RL_SCRIPT_MAX_LINES, f"rlvr_ppo.py is {len(source.splitlines())} lines"
    tree = ast.parse(source, path)
    long = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert long["collect_rollout"] <= COLLECT_ROLLOUT_MAX_LINES, f"collect_rollout is {long['collect_rollout']} lines"
    long = {name: lines for name, lines in long.items() if lines > FUNCTION_MAX_LINES}
    assert not long, f"functions over {FUNCTION_MAX_LINES} lines: {long}"


# A plain RL run: GRPO, HF generation, synchronous; no teacher, environment, code rows, reward model or LoRA. The
# open_instruct modules it imports (the features' modules are imported only by a run that turns them on:
# distillation, episodes/environments, code_verifier/sandbox, generation_check, vLLM engines, LoRA; an integration
# only when a run names it, through the registry (integrations.py); the start checks bring plan/memory_model (the
# memory prediction) and user_code (the variants' signatures)) ...
PLAIN_RL_IMPORTS = {
    "open_instruct", "open_instruct.attention", "open_instruct.batch_math", "open_instruct.chat_render",
    "open_instruct.chat_templates", "open_instruct.checkpoint", "open_instruct.config", "open_instruct.console",
    "open_instruct.data", "open_instruct.data_cache", "open_instruct.distributed", "open_instruct.encode",
    "open_instruct.errors", "open_instruct.file_digests", "open_instruct.flag_names", "open_instruct.formats",
    "open_instruct.generation",
    "open_instruct.generation_backends", "open_instruct.gpu_stats", "open_instruct.integrations",
    "open_instruct.memory_model", "open_instruct.mixture", "open_instruct.models", "open_instruct.plan",
    "open_instruct.preflight", "open_instruct.rewards", "open_instruct.rl_algorithms",
    "open_instruct.rlvr_ppo", "open_instruct.rollouts",
    "open_instruct.run_dir", "open_instruct.runtime", "open_instruct.tracking",
    "open_instruct.user_code",
}  # fmt: skip
# ... and the modules whose code one step runs (RolloutSampler.take, collect_rollout, compute_advantages, update):
# what a reader follows (issue 42: at most 8). The algorithm: the script, rl_algorithms (estimators, losses, their
# math, the mismatch statistics), rewards; the plumbing: rollouts (the sampler), generation (the contract and its hf
# backend), models (forwards), data (micro-batches), distributed (the step's sums, over ranks; gradient sync; the
# finite-update check). Settings are read as fields, never through config's derived properties: what the step
# derives from them (packing, the score's value column) is decided once in main (rollouts.episode_layout).
PLAIN_RL_STEP = {
    "open_instruct.rlvr_ppo", "open_instruct.rl_algorithms", "open_instruct.rewards", "open_instruct.rollouts",
    "open_instruct.generation", "open_instruct.models", "open_instruct.data", "open_instruct.distributed",
}  # fmt: skip
# A multi-turn step (the calculator tool environment) adds the environments and their episodes (at most 10).
MULTI_TURN_STEP = PLAIN_RL_STEP | {"open_instruct.environments", "open_instruct.episodes"}
MULTI_TURN_ARGS = ("--environment", "tool", "--tools", "calculator", "--response_length", "60", "--max_turn_tokens",
                   "20", "--max_turns", "3", "--tool_output_max_tokens", "16")  # fmt: skip

PLAIN_RUN = """
import functools, json, sys
from open_instruct import rlvr_ppo, rollouts

stepped = set()


def profile(frame, event, arg):
    module = frame.f_globals.get("__name__", "")
    if event == "call" and module.startswith("open_instruct"):
        stepped.add(module)


def traced(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
    return run


for name in ("collect_rollout", "compute_advantages", "update"):
    setattr(rlvr_ppo, name, traced(getattr(rlvr_ppo, name)))
rollouts.RolloutSampler.take = traced(rollouts.RolloutSampler.take)
rlvr_ppo.main(sys.argv[2:])
imported = sorted(m for m in sys.modules if m == "open_instruct" or m.startswith("open_instruct."))
json.dump({"imported": imported, "stepped": sorted(stepped)}, open(sys.argv[1], "w"))
"""


def run_and_walk(tiny_models, tmp_path, *extra):
    """The open_instruct modules a tiny GRPO run imports, and those whose code its steps run."""
    import json
    import subprocess
    import sys

    from demo import synthetic

    data = synthetic.write_jsonl(str(tmp_path / "rl.jsonl"), synthetic.rl_rows(8, 0))
    argv = [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"), "--algo", "grpo", "--model_name_or_path",
        tiny_models["causal_lm"], "--dataset_name_or_path", data, "--eval_dataset_name_or_path", data,
        "--total_episodes", "8", "--local_rollout_batch_size", "2", "--num_samples_per_prompt", "4",
        "--per_device_train_batch_size", "8", "--response_length", "6", "--eval_steps", "100",
        "--checkpointing_steps", "100", "--output_dir", str(tmp_path / "out"), *extra,
    ]  # fmt: skip
    report = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-c", PLAIN_RUN, str(report), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    modules = json.loads(report.read_text())
    return set(modules["imported"]), set(modules["stepped"])


# The modules of the integrations with other packages (integrations.py imports one when a run names it) and LoRA's.
INTEGRATION_MODULES = {
    "open_instruct.reasoning_gym_tasks", "open_instruct.verifiers_env", "open_instruct.verifiers_v1",
    "open_instruct.verifiers_v1_chat", "open_instruct.verifiers_v1_play", "open_instruct.openenv_env",
    "open_instruct.judge",
}  # fmt: skip


def test_a_plain_rl_run_imports_and_steps_through_only_its_modules(tiny_models, tmp_path):
    imported, stepped = run_and_walk(tiny_models, tmp_path)
    unasked = sorted(imported & (INTEGRATION_MODULES | {"open_instruct.lora"}))
    assert not unasked, f"a plain run imported {unasked}"
    assert imported == PLAIN_RL_IMPORTS, (
        f"new: {sorted(imported - PLAIN_RL_IMPORTS)}, gone: {sorted(PLAIN_RL_IMPORTS - imported)}"
    )
    assert stepped == PLAIN_RL_STEP, f"new: {sorted(stepped - PLAIN_RL_STEP)}, gone: {sorted(PLAIN_RL_STEP - stepped)}"
    assert len(PLAIN_RL_STEP) <= 8


def test_a_multi_turn_step_adds_only_the_environments_and_their_episodes(tiny_models, tmp_path):
    imported, stepped = run_and_walk(tiny_models, tmp_path, *MULTI_TURN_ARGS)
    assert stepped == MULTI_TURN_STEP, (
        f"new: {sorted(stepped - MULTI_TURN_STEP)}, gone: {sorted(MULTI_TURN_STEP - stepped)}"
    )
    assert len(MULTI_TURN_STEP) <= 10
    features = {"open_instruct.distillation", "open_instruct.code_verifier", "open_instruct.sandbox"}
    assert not imported & features, f"a feature this run does not use was imported: {sorted(imported & features)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_is_short_and_shallow(script):
    path = os.path.join(REPO, *script.split(".")) + ".py"
    main = function_node(path, "main")
    lines = main.end_lineno - main.lineno + 1
    assert lines <= 150, f"{script}.main is {lines} lines"
    assert max_nesting(main) <= 4, f"{script}.main nests {max_nesting(main)} blocks deep"


def test_rl_phases_are_shallow():
    """Every function of the RL script, the phases included, stays within 4 nested blocks."""
    path = os.path.join(REPO, "open_instruct", "rlvr_ppo.py")
    tree = ast.parse(open(path).read(), path)
    deep = {n.name: max_nesting(n) for n in tree.body if isinstance(n, ast.FunctionDef) and max_nesting(n) > 4}
    assert not deep, f"functions nested deeper than 4 blocks: {deep}"


# Modules none of whose functions may pass 100 lines: a longer one is split by what it does (issue 42).
SHORT_FUNCTION_MODULES = ("sft.py", "dpo.py", "reward_model.py", "rlvr_ppo.py", "config.py", "plan.py", "flag_names.py")


@pytest.mark.parametrize("module", SHORT_FUNCTION_MODULES)
def test_no_function_over_100_lines(module):
    path = os.path.join(REPO, "open_instruct", module)
    tree = ast.parse(open(path).read(), path)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = {n.name: n.end_lineno - n.lineno + 1 for n in functions if n.end_lineno - n.lineno + 1 > 100}
    assert not long, f"{module}: functions over 100 lines: {long}"


def test_no_sys_path_hacks_in_the_packages():
    offenders = [m for m, path in modules().items() if "sys.path.insert" in open(path).read()]
    assert not offenders, f"sys.path.insert in {offenders}"


def test_no_private_name_imported_from_another_module():
    """`from x import _name` reaches into another module's insides: what two modules share is public."""
    offenders = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                offenders += [f"{module}: from {node.module} import {name}" for name in private]
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------------------------------
# The generation contract


def backend_classes() -> dict[str, str]:
    """generation_backends.BACKEND_CLASSES (name -> "module:class"), read without importing it."""
    path = os.path.join(REPO, "open_instruct", "generation_backends.py")
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BACKEND_CLASSES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("generation_backends.BACKEND_CLASSES not found")


def module_path(module: str) -> str:
    return os.path.join(REPO, *module.split(".")) + ".py"


def class_node(path: str, name: str) -> ast.ClassDef:
    tree = ast.parse(open(path).read(), path)
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def signature(method: ast.FunctionDef) -> tuple:
    """(positional parameter names, how many have defaults, keyword-only names, decorators): what a caller relies on."""
    args = method.args
    decorators = tuple(sorted(d.id for d in method.decorator_list if isinstance(d, ast.Name) and d.id != "torch"))
    return (tuple(a.arg for a in args.args), len(args.defaults), tuple(a.arg for a in args.kwonlyargs), decorators)


def contract_violations(path: str, name: str) -> list[str]:
    """What class `name` of the file `path` lacks of the `generation.Generator` protocol: a method, its signature
    (parameter names, which have defaults, classmethod), or an attribute the protocol declares (set in the class
    body or on `self`)."""
    protocol = class_node(module_path("open_instruct.generation"), "Generator")
    cls = class_node(path, name)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assigned = {
        t.id
        for n in cls.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in ast.walk(n)
        if isinstance(t, ast.Name)
    }
    assigned |= {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in ast.walk(n)
        if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"
    }
    problems = []
    for item in protocol.body:
        if isinstance(item, ast.FunctionDef):
            if item.name not in methods:
                problems.append(f"no method {item.name}")
            elif signature(methods[item.name]) != signature(item):
                problems.append(f"{item.name}{signature(methods[item.name])} is not {signature(item)}")
        elif isinstance(item, ast.AnnAssign) and item.target.id not in assigned:
            problems.append(f"no attribute {item.target.id}")
    return problems


def test_contract_check_finds_what_a_class_lacks(tmp_path):
    bad = "class Half:\n    last_sync_seconds = 0.0\n\n    def generate(self, prompt_ids, config):\n        pass\n"
    (tmp_path / "half.py").write_text(bad)
    problems = contract_violations(str(tmp_path / "half.py"), "Half")
    assert "no attribute last_sync_bytes" in problems and "no method sync_weights" in problems
    assert any(p.startswith("generate(") for p in problems)  # no max_new_tokens: the per-request budget


@pytest.mark.parametrize("backend", sorted(backend_classes()))
def test_every_backend_keeps_the_whole_generation_contract(backend):
    module, name = backend_classes()[backend].split(":")
    assert contract_violations(module_path(module), name) == []


def test_the_rl_script_names_no_generation_backend():
    """Which backend generates is the config's business (generation_backends.make_generator): the RL script and its
    plumbing hold no backend name and no backend-only knob."""
    names = set(backend_classes())
    for script in ("rlvr_ppo.py", "rollouts.py"):
        path = os.path.join(REPO, "open_instruct", script)
        tree = ast.parse(open(path).read(), path)
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & names, f"{script} names backend(s) {sorted(strings & names)}"
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {a for a in attributes if a.startswith("vllm_")}, f"{script} reads vLLM knobs"


def test_the_config_offers_exactly_the_backends():
    import typing

    from open_instruct.config import RLVRConfig

    offered = typing.get_args(typing.get_type_hints(RLVRConfig)["generation_backend"])
    assert offered == tuple(backend_classes())


# ---------------------------------------------------------------------------------------------------------------------
# Integrations at the edge (issue 68): the core never names one, and the import graph stays shallow

CORE_MODULES = ("data", "data_cache", "mixture", "rewards", "rollouts", "environments", "episodes", "plan",
                "preflight", "config", "runtime")  # fmt: skip
MAX_LAYERS = 13  # the longest chain of imports among the library's modules (18 when integrations sat in the core)


def layers(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain [a, b, ..., z] (a imports b, ...; z imports none of ours) of an acyclic graph."""
    longest: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in longest:
            below = [chain(nxt) for nxt in sorted(graph.get(node, ()))]
            longest[node] = [node] + max(below, key=len, default=[])
        return longest[node]

    return max((chain(node) for node in sorted(graph)), key=len, default=[])


def test_layer_counter():
    assert layers({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]


def test_the_library_import_graph_is_at_most_13_layers():
    graph = {m: {d for d in deps if d.startswith("open_instruct")} for m, deps in import_graph().items()}
    graph = {m: deps for m, deps in graph.items() if m.startswith("open_instruct")}
    chain = layers(graph)
    assert len(chain) <= MAX_LAYERS, f"{len(chain)} layers: " + " -> ".join(chain)


def integration_names() -> set[str]:
    """What names an integration: its spec prefix (`reasoning_gym:`), its verifier's name, its module's name."""
    from open_instruct import integrations

    names = {f"{prefix}:" for prefix in integrations.BUILT_IN} | set(integrations.BUILT_IN_VERIFIERS)
    return names | {m.rpartition(".")[2] for m in INTEGRATION_MODULES - {"open_instruct.judge"}} | {"Judge", "openenv"}


def word_in(name: str, text: str) -> bool:
    """`name` in `text` as a whole word (`Judge` is not in `JudgedLayout`; `verifiers:` is in `verifiers:my_env`)."""
    end = r"(?!\w)" if name[-1].isalnum() or name[-1] == "_" else ""
    return re.search(r"(?<!\w)" + re.escape(name) + end, text) is not None


def test_word_finder():
    assert word_in("Judge", "a Judge(url=...)") and not word_in("Judge", "class JudgedLayout:")
    assert word_in("verifiers:", "'verifiers:my_env.py'") and not word_in("verifiers:", "the_verifiers: x")


def test_no_core_module_names_an_integration():
    """Core modules ask the registry (integrations.py); none imports an integration module or holds its prefix,
    its verifier's name or its module's name, not even in a comment (the docs of an integration are its own)."""
    graph = import_graph()
    names = integration_names()
    assert {"reasoning_gym:", "verifiers:", "reasoning_gym", "verifiers_env", "openenv_env"} <= names
    for core in CORE_MODULES:
        module = f"open_instruct.{core}"
        imported = sorted(graph[module] & INTEGRATION_MODULES)
        assert not imported, f"{module} imports {imported}"
        source = open(module_path(module)).read()
        named = sorted(name for name in names if word_in(name, source))
        assert not named, f"{module} names the integration(s) {named}"
