"""The harness a `verifiers.v1` env gets here when its taskset exports none: verifiers' own chat loop (the `null`
harness's program: the model's tool calls go to the task's MCP tool servers, a reply without a call ends the run),
run as a subprocess by this interpreter instead of a uv-provisioned one. v1's default harnesses (`bash`, `null`)
install their program's dependencies with uv over the network before every run; the program's dependencies are
verifiers' own, already installed here, so offline runs need no uv. `bash`'s shell tool is not offered: it would run
model-written commands on this machine (v1's subprocess runtime is not a sandbox).

v1 resolves a harness by a flat importable id, so this module is also importable as `open_instruct_chat` (HARNESS_ID).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from verifiers.v1.harnesses.null.harness import NullHarness

HARNESS_ID = "open_instruct_chat"
V1_DEFAULT_HARNESSES = ("bash", "null")  # the ids replaced by this one (uv-provisioned programs)


class _ThisInterpreter:
    """A runtime whose PEP 723 scripts run with this interpreter (their dependencies are verifiers' own)."""

    def __init__(self, runtime: Any):
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: Any, env: Any = None, *, activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f".open-instruct-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]


class ChatHarness(NullHarness):
    """NullHarness with its program run by this interpreter (module docstring)."""

    async def setup(self, runtime: Any) -> None:
        pass  # nothing to provision: the program's dependencies are installed with verifiers

    async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kwargs: Any) -> Any:
        return await super().launch(ctx, trace, _ThisInterpreter(runtime), *args, **kwargs)


__all__ = ["ChatHarness"]
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
