"""An agent for the end-to-end test: its first turn opens with a complete `python` call (a
random tiny model cannot write one), so every episode runs real code in a real sandbox."""

from __future__ import annotations

from omniloop import ToolAgent, reward
from omniloop.tools import python

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>\n'


def build_agent() -> ToolAgent:
    return ToolAgent([python], system_prompt="Compute.", prefill=CALL)


@reward
def tool_said_42(task: dict, response: str, trajectory) -> float:
    """1.0 when the first tool call printed 42 (proves the sandbox ran the code)."""
    calls = trajectory.meta.tool_calls
    return float(bool(calls) and calls[0].output.strip() == "42")
