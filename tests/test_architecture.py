"""The shape of the code, checked with `ast`: no import cycles, no upward imports, the RL script's `main` short and
shallow, no sys.path hacks. Cheap (no torch import), so it runs first in spirit: a refactor that breaks the layering
fails here with the cycle spelled out."""

from __future__ import annotations

import ast
import os

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


def test_no_sys_path_hacks_in_the_packages():
    offenders = [m for m, path in modules().items() if "sys.path.insert" in open(path).read()]
    assert not offenders, f"sys.path.insert in {offenders}"
