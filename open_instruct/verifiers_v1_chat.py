"""The harness a `verifiers.v1` env gets here when its taskset exports none: verifiers' own chat loop (the `null`
harness's program: the model's tool calls go to the task's MCP tool servers, a reply without a call ends the run),
run in this process on the verifiers event loop instead of as a uv-provisioned subprocess per episode.

v1's default harnesses (`bash`, `null`) install their program's dependencies with uv over the network before every
run, then start a Python process per episode that imports openai, httpx and mcp: seconds of CPU per episode, which
made a v1 rollout ~45x slower than the same task under the earlier API (docs/environments.md). The program's source
(verifiers' `CHAT_PROGRAM_SOURCE`, exactly the text the subprocess would run) is executed once per process here and
its `run_chat_loop` called per episode with one shared HTTP connection pool. What the loop does with model text is
bounded: it JSON-parses a tool call's arguments and hands them to the tool server (a subprocess, v1's runtime);
`bash`, `edit` and `search` are not offered (`bash` would run model-written commands on this machine).

v1 resolves a harness by a flat importable id, so this module is also importable as `open_instruct_chat` (HARNESS_ID).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import AsyncExitStack
from typing import Any, Optional

from verifiers.v1.harnesses.null.harness import NullHarness

HARNESS_ID = "open_instruct_chat"
V1_DEFAULT_HARNESSES = ("bash", "null")  # the ids replaced by this one (uv-provisioned programs)
MCP_CONNECT_TIMEOUT_S = 60  # the program's own limit on connecting to the tool servers

_PROGRAM: Optional[dict[str, Any]] = None
_HTTP: Any = None  # one connection pool for every episode's model calls (per process: one verifiers event loop)


def chat_program() -> dict[str, Any]:
    """The namespace of verifiers' chat program (its bundled source run once, not as __main__)."""
    global _PROGRAM
    if _PROGRAM is None:
        from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

        namespace: dict[str, Any] = {"__name__": "open_instruct_verifiers_chat_program"}
        exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
        _PROGRAM = namespace
    return _PROGRAM


def _http_client() -> Any:
    global _HTTP
    if _HTTP is None:
        import httpx

        # loopback HTTP only (the interception server): no TLS context to build (it costs ~0.1 s of CPU each)
        _HTTP = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), verify=False)
    return _HTTP


class ChatHarness(NullHarness):
    """NullHarness with its program's chat loop run in this process (module docstring)."""

    async def setup(self, runtime: Any) -> None:
        pass  # nothing to provision: the program's dependencies are installed with verifiers

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: Optional[str] = None,
    ) -> Any:
        from openai import AsyncOpenAI
        from verifiers.v1.dialects.chat import message_to_wire
        from verifiers.v1.runtimes import ProgramResult

        program = chat_program()
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        args = argparse.Namespace(
            base_url=endpoint, api_key=secret, model=ctx.model, tool_interception_url=tool_interception_url or "",
            bash=False, edit=False, search=False, serper_key="", compaction=False, summarize_at_tokens=None,
        )  # fmt: skip
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, http_client=_http_client())
        tool_client = _http_client() if tool_interception_url else None
        servers_config = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        async with AsyncExitStack() as stack:
            tools, dispatch, servers = [], {}, {}
            if servers_config:
                tools, dispatch, servers = await asyncio.wait_for(
                    program["connect_mcp"]({"mcpServers": servers_config}, stack, set()), MCP_CONNECT_TIMEOUT_S
                )
            compactor = program["Compactor"](client, ctx.model, tools, False, None)
            compactor.note_good(messages)
            await program["run_chat_loop"](args, compactor, messages, dispatch, servers, tool_client)
        return ProgramResult(0, "", "")


__all__ = ["ChatHarness"]
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
