"""A treasure hunt written with the official `openai` package, trained unchanged by omniloop.

The agent asks the model where to search, runs the search the model names as a tool call, and
answers with what the search printed. It talks to whatever `base_url` it is given; omniloop
gives it an episode's gateway, which records every reply token-exactly for training.

- As a Python callable: `solve(task, endpoint)`; `build_agent` wraps it in `OpenAIAgent`
  (the configs name `agent.py:build_agent`).
- As a command (`python agent.py`): it reads `OPENAI_BASE_URL`, `OPENAI_API_KEY`,
  `OPENAI_MODEL` and the task (`OMNILOOP_TASK`) from its environment and prints its answer
  (`agent.py:build_command_agent`).

The task is the toy tool task's (`examples/toy_tool`): eight directions, one hides the
treasure, and nothing in the prompt says which. The warm-started tiny model
(`warm_start.py`) names a direction as a tool call about uniformly; only RL finds the one
that pays. The agent sends no tool schemas: the tiny model learns the call format in the warm
start, and a short prompt keeps a CPU training step short.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from typing import Any

from openai import AsyncOpenAI

DIRECTIONS = ("north", "south", "east", "west", "up", "down", "left", "right")


def search(direction: str, treasure: str) -> str:
    """What searching `direction` finds when the treasure lies in `treasure`."""
    if direction == treasure:
        return hashlib.sha256(treasure.encode()).hexdigest()[:8]
    return "nothing here"


async def hunt(client: AsyncOpenAI, model: str, prompt: str, treasure: str) -> str:
    """The agent: one question to the model, then the search it asks for."""
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=32
    )
    message = reply.choices[0].message
    if not message.tool_calls:
        return message.content or ""
    call = message.tool_calls[0]
    return search(call.function.name, treasure)  # type: ignore[union-attr]


async def solve(task: Any, endpoint: Any) -> str:
    """The agent as `OpenAIAgent` calls it. (`endpoint.http_client()` is optional: it spares
    the SDK building a TLS context per episode.)"""
    async with AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, http_client=endpoint.http_client()
    ) as client:
        return await hunt(client, endpoint.model, task.prompt, task.metadata["treasure"])


def build_agent() -> Any:
    from omniloop.gateway.agent import OpenAIAgent

    return OpenAIAgent(solve)


def build_command_agent() -> Any:
    from omniloop.gateway.agent import OpenAIAgent

    return OpenAIAgent(command=[sys.executable, os.path.abspath(__file__)], timeout_s=60)


def found_the_treasure(task: dict[str, Any], response: str) -> float:
    """1.0 when the agent's answer is the treasure's code."""
    return float(response.strip() == task["metadata"]["code"])


async def _main() -> None:
    task = json.loads(os.environ["OMNILOOP_TASK"])
    async with AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the env
        answer = await hunt(
            client, os.environ["OPENAI_MODEL"], task["prompt"], task["metadata"]["treasure"]
        )
    print(answer)


if __name__ == "__main__":
    asyncio.run(_main())
