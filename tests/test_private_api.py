"""Private torch / accelerate attributes appear in one place only: `distributed.fsdp2_reshard_settings`, the adapter
over FSDP2 internals that handles every supported torch version (2.11-2.14). Private names move between releases
(torch 2.11 keeps `FSDPState._fsdp_param_group`, 2.13 `_fsdp_param_groups`), and an access outside the adapter breaks
a GPU run on the version it was not written against. Also checks the adapter on both shapes of that state."""

from __future__ import annotations

import ast
import pathlib
import re
from types import SimpleNamespace

import pytest

from open_instruct import distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("open_instruct", "bench", "eval", "demo")
ADAPTER = ("open_instruct/distributed.py", "fsdp2_reshard_settings")
# FSDP2 / torch.distributed / accelerate internals, whatever object they are read from
PRIVATE_NAME = re.compile(r"^_(fsdp\w*|get_fsdp_state|lazy_init|auto_reshard_after_forward|shared_state|comm_ctx\w*)$")
LIBRARIES = ("torch", "accelerate")


def _library_names(tree: ast.Module) -> set[str]:
    """Names this module binds to torch / accelerate objects (`import torch`, `from accelerate import X as Y`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_accesses(path: pathlib.Path, source: str) -> list[str]:
    """`file:line name` for each private torch/accelerate attribute read or written outside the adapter: a known
    internal name on any object, `getattr(x, "<that name>")`, or any `_name` on a torch/accelerate object."""
    tree = ast.parse(source)
    library = _library_names(tree)
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    allowed: set[int] = set()
    if rel == ADAPTER[0]:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == ADAPTER[1]:
                allowed.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        name = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if PRIVATE_NAME.match(node.attr) or _root_name(node.value) in library:
                name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and PRIVATE_NAME.match(node.args[1].value)
        ):
            name = node.args[1].value
        if name:
            found.append(f"{rel}:{node.lineno} {name}")
    return sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0])))


def test_no_private_torch_or_accelerate_access_outside_the_adapter():
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 50  # the scan really ran over the packages
    found = [hit for p in files for hit in private_accesses(p, p.read_text())]
    assert found == [], "private torch/accelerate attributes outside distributed.fsdp2_reshard_settings:\n" + "\n".join(
        found
    )


def test_the_scan_names_file_and_line_of_each_kind_of_access():
    source = (
        "import torch\n"
        "from accelerate import PartialState\n"
        "def adapter_lookalike(unit):\n"
        "    return unit._get_fsdp_state()._fsdp_param_groups\n"  # line 4: two internal names
        "PartialState._shared_state['x'] = 1\n"  # line 5
        "torch.distributed._functional_collectives\n"  # line 6: private on a torch object
        "getattr(state, '_fsdp_param_group', None)\n"  # line 7
        "self_made._private = 1\n"  # the project's own private names are not torch's
    )
    hits = private_accesses(pathlib.Path("open_instruct/example.py"), source)
    assert hits == [
        "open_instruct/example.py:4 _fsdp_param_groups",
        "open_instruct/example.py:4 _get_fsdp_state",
        "open_instruct/example.py:5 _shared_state",
        "open_instruct/example.py:6 _functional_collectives",
        "open_instruct/example.py:7 _fsdp_param_group",
    ]


def test_the_adapter_is_the_only_exemption():
    source = "def fsdp2_reshard_settings(model, units):\n    return units[0]._get_fsdp_state()\n"
    assert private_accesses(pathlib.Path("open_instruct/distributed.py"), source) == []
    assert private_accesses(pathlib.Path("open_instruct/models.py"), source) == [
        "open_instruct/models.py:2 _get_fsdp_state"
    ]


# ---------------------------------------------------------------------------------------------------------------------
# The adapter on stubs shaped like each torch version's FSDPState (a real FSDP2 run: tests/test_fsdp.py)


class _Unit:
    def __init__(self, state: SimpleNamespace) -> None:
        self.state = state

    def _get_fsdp_state(self) -> SimpleNamespace:
        return self.state


def _group(info: object) -> SimpleNamespace:
    return SimpleNamespace(post_forward_mesh_info=info)


def _clobber(state: SimpleNamespace, groups: list[SimpleNamespace]) -> None:
    """What set_reshard_after_forward(False) does to a unit."""
    state._auto_reshard_after_forward = False
    for g in groups:
        g.post_forward_mesh_info = None


def test_adapter_restores_torch_2_11_single_group_states():
    root_info, layer_info = object(), object()
    layer_group = _group(layer_info)
    root = SimpleNamespace(_auto_reshard_after_forward=True, _fsdp_param_group=_group(root_info))
    layer = SimpleNamespace(_auto_reshard_after_forward=False, _fsdp_param_group=layer_group)
    empty = SimpleNamespace(_auto_reshard_after_forward=True, _fsdp_param_group=None)  # a unit without parameters
    restore = distributed.fsdp2_reshard_settings(object(), [_Unit(root), _Unit(layer), _Unit(empty)])
    for state in (root, layer, empty):
        group = state._fsdp_param_group
        _clobber(state, [group] if group is not None else [])
    restore()
    assert (root._auto_reshard_after_forward, root._fsdp_param_group.post_forward_mesh_info) == (True, root_info)
    assert (layer._auto_reshard_after_forward, layer_group.post_forward_mesh_info) == (False, layer_info)
    assert (empty._auto_reshard_after_forward, empty._fsdp_param_group) == (True, None)


def test_adapter_restores_torch_2_13_group_list_states():
    infos = [object(), object()]
    groups = [_group(i) for i in infos]
    state = SimpleNamespace(_auto_reshard_after_forward=True, _fsdp_param_groups=groups)
    restore = distributed.fsdp2_reshard_settings(object(), [_Unit(state)])
    _clobber(state, groups)
    restore()
    assert state._auto_reshard_after_forward is True
    assert [g.post_forward_mesh_info for g in groups] == infos


def test_adapter_names_the_supported_versions_when_torch_moved_the_groups_again():
    state = SimpleNamespace(_auto_reshard_after_forward=True)
    with pytest.raises(RuntimeError, match=r"neither _fsdp_param_groups nor _fsdp_param_group.*2\.11-2\.14"):
        distributed.fsdp2_reshard_settings(object(), [_Unit(state)])
