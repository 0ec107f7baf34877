"""The agent the dashboard tests submit episodes for (loaded by path from the server config).

The random tiny model cannot write a tool call, so the agent prefills a complete one: every
episode runs real code in a real bubblewrap sandbox and has a tool call with a result to show.
"""

from __future__ import annotations

from typing import Any

from omniloop import ToolAgent, reward
from omniloop.tools import python

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>\n'


def tool_agent() -> ToolAgent:
    return ToolAgent([python], system_prompt="Compute.", prefill=CALL)


@reward
def printed_42(task: dict, response: str, trajectory: Any) -> float:
    """1.0 when the first tool call printed 42 (the sandbox ran the code)."""
    calls = trajectory.meta.tool_calls
    return float(bool(calls) and calls[0].output.strip() == "42")


@reward
def called_a_tool(task: dict, response: str, trajectory: Any) -> float:
    """0.5 for making any tool call: a second component for the reward breakdown."""
    return 0.5 if trajectory.meta.tool_calls else 0.0
