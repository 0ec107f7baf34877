"""Agents the API tests submit episodes for (loaded by path, as a server config names them).

The random tiny model cannot write a tool call, so `tool_agent` prefills a complete one: every
episode runs real code in a real sandbox. `waiting_agent` samples one turn and then waits on
its environment for a minute, which gives cancellation and shutdown something to interrupt.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omniloop import Session, Task, ToolAgent, reward
from omniloop.agents.chat import Message
from omniloop.tools import python

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>\n'


def tool_agent() -> ToolAgent:
    return ToolAgent([python], system_prompt="Compute.", prefill=CALL)


@reward
def tool_said_42(task: dict, response: str, trajectory: Any) -> float:
    """1.0 when the first tool call printed 42 (the sandbox ran the code)."""
    calls = trajectory.meta.tool_calls
    return float(bool(calls) and calls[0].output.strip() == "42")


class WaitingAgent:
    """Samples one turn, then waits 60 s for an environment that never answers."""

    tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[Message]:
        return task.messages()

    async def run(self, task: Task, session: Session, context: Any) -> None:
        await session.generate()
        await asyncio.sleep(60)


def waiting_agent() -> WaitingAgent:
    return WaitingAgent()


class BrokenAgent:
    """An agent with a bug: it raises after its first turn."""

    tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[Message]:
        return task.messages()

    async def run(self, task: Task, session: Session, context: Any) -> None:
        await session.generate()
        raise RuntimeError("the agent has a bug")


def broken_agent() -> BrokenAgent:
    return BrokenAgent()
