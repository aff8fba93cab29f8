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
