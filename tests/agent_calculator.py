"""A test agent written against the `openai` client: it offers the calculator tool, runs every call it gets back
(with the repo's calculator, so it answers as the `tool` environment does) and lets the row's verifier score its
last answer. `resend_as_text` re-sends each tool-call turn as its raw text instead of `tool_calls` (a harness that
rewrites history)."""

import json

from openai import AsyncOpenAI

from open_instruct.environments import CALCULATOR_SCHEMA, calculate


async def run(base_url: str, model: str, row: dict) -> None:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["messages"])
    for _ in range(8):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR_SCHEMA])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return None


def not_async(base_url, model, row):
    return None


CALLS = [0]


async def always_calls(base_url: str, model: str, row: dict) -> None:
    """Whatever the model writes first is answered with the calculator's value of the row's question as a tool
    turn (so a random tiny model uses a tool in every episode); its second reply is the answer the row's verifier
    scores. With MT_GATE set, the MT_GATE_AT-th tool turn of the process says so with a file and waits for the
    test's release file (a SIGKILL lands inside an episode)."""
    import asyncio
    import os

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["messages"])
    reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR_SCHEMA])
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    CALLS[0] += 1
    gate = os.environ.get("MT_GATE")
    if gate and CALLS[0] == int(os.environ["MT_GATE_AT"]):
        open(gate + ".in_tool", "w").close()
        while not os.path.exists(gate + ".release"):
            await asyncio.sleep(0.01)
    messages.append({"role": "tool", "content": calculate(row["messages"][-1]["content"].rstrip("="))})
    await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR_SCHEMA])
    return None


async def hangs(base_url: str, model: str, row: dict) -> None:
    """Asks once, then never asks again nor ends (its tool hangs)."""
    import asyncio

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model=model, messages=list(row["messages"]))
    await asyncio.Event().wait()
