"""The calculator agent that `train.yaml` (`make run`) trains: both turns start prefilled.

SmolLM2-135M needs help to earn any reward at the first step. Measured with temperature-1
sampling on the first tasks: with only `print(` prefilled, 1 call in 16 is well-formed; with
the task's expression prefilled as well, 7 in 16 are; and after a correct tool result the model
rarely states the number unprompted. So the call turn is prefilled up to the end of the
expression (the model closes the call, `)"}}`), and the answer turn starts with
`The answer is ` (the model writes the number). RL then learns to close the call cleanly and to
report the tool's result instead of a guess.

The prompt carries no tool-schema block (the call is prefilled, so the model never has to
choose a tool or recall its format): ~45 prompt tokens instead of ~240 makes an optimizer step
about three times cheaper on a CPU, for somewhat fewer well-formed calls at the start (8 in 32
against 7 in 16 with the schema, measured the same way).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omniloop import Task
from omniloop.agents.base import Session
from omniloop.agents.chat import Message
from omniloop.tools import Toolset, parse_tool_calls, python
from omniloop.tools.base import ToolContext

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent import PREFILL, SYSTEM_PROMPT

ANSWER_PREFILL = "The answer is "


class CalculatorAgent:
    """Two turns: the `python` call (its opening prefilled), then the answer."""

    def __init__(self) -> None:
        self.toolset = Toolset([python])
        self.tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[Message]:
        """The system prompt and the question."""
        return task.messages(SYSTEM_PROMPT)

    async def run(self, task: Task, session: Session, context: ToolContext) -> None:
        """The call, its result (or the parse error) as a tool message, then the answer."""
        call = await session.generate(prefill=PREFILL + str(task.metadata["expression"]))
        records = await self.toolset.execute_all(parse_tool_calls(call.text).calls, context)
        context.state.setdefault("tool_calls", []).extend(records)
        if not records:
            return
        session.add_observation([{"role": "tool", "content": r.output} for r in records])
        await session.generate(prefill=ANSWER_PREFILL)


def build_agent() -> CalculatorAgent:
    """The agent `train.yaml` names."""
    return CalculatorAgent()
