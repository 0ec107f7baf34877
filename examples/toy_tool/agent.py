"""The toy tool task: find which of eight tools, run in the sandbox, returns the treasure's code.

Eight tools, one per direction. Each runs a small search program in the episode's sandbox; the
program prints the treasure's code when it searches the direction where the treasure lies and
`nothing here` otherwise. The prompt never says which direction that is. The reward is 1 only
when the first call's sandbox run printed the code: a well-formed call in the wrong direction,
or the right direction whose run failed, earns nothing.

The task exists to show learning on the tiny random model in minutes on a CPU
(`tests/integration/training`). `warm_start.py` first teaches the call *format* with directions
drawn uniformly at random, so the warm-started policy finds the treasure about 1 time in 8, and
nothing it was shown says where the treasure is: only the reward does. Why not a different
direction per prompt: the tiny model (2 layers, width 64, 0.02 init) carries almost nothing of
the prompt to the position where it names the tool; measured, even supervised training on the
*correct* prompt-to-tool pairs stayed at 1/8 after 60 steps. A prompt-dependent mapping is
beyond what it can learn in minutes; which tool pays is not.

The agent is a custom `Agent` (one turn: the call) rather than `ToolAgent`, so that the prompt
carries no system prompt and no tool-schema block: ~30 tokens per episode instead of several
hundred keeps a CPU training step short (the 49k-token vocabulary makes every position cost as
much as a large model's output layer).
"""

from __future__ import annotations

import hashlib
from typing import Any

from omniloop.agents.base import Session, Task
from omniloop.agents.chat import Message
from omniloop.rewards import reward
from omniloop.sandboxes.base import ExecResult
from omniloop.tools import FunctionTool, Toolset, parse_tool_calls
from omniloop.tools.base import ToolContext
from omniloop.trajectory import Trajectory

DIRECTIONS = ("north", "south", "east", "west", "up", "down", "left", "right")
"""The tool names; a uniformly random choice among them is right with probability 1/8."""
PREFILL = '<tool_call>\n{"name": "'
"""The opening of the call; the model writes the direction and closes the call."""

# argv: the direction searched, the treasure's direction. Prints the code only on a hit.
_SEARCH = (
    "import hashlib, sys\n"
    "here, treasure = sys.argv[1], sys.argv[2]\n"
    "print(hashlib.sha256(treasure.encode()).hexdigest()[:8] if here == treasure "
    "else 'nothing here')\n"
)


def treasure_code(direction: str) -> str:
    """What a search prints when it finds the treasure lying in `direction`."""
    return hashlib.sha256(direction.encode()).hexdigest()[:8]


def _search_tool(direction: str) -> FunctionTool[[ToolContext], Any]:
    async def search(ctx: ToolContext) -> ExecResult:
        treasure = str(ctx.task["metadata"]["treasure"])
        return await ctx.sandbox.exec(["python3", "-c", _SEARCH, direction, treasure])

    return FunctionTool(
        search, name=direction, description=f"Search {direction} for the treasure.", timeout=30
    )


TOOLS = [_search_tool(d) for d in DIRECTIONS]


class ToyToolAgent:
    """One assistant turn that must be a tool call, run in the episode's sandbox."""

    def __init__(self) -> None:
        self.toolset = Toolset(TOOLS)
        # No schema block in the prompt (see the module docstring).
        self.tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[Message]:
        """The task's request alone: the shortest prompt (no system prompt, no schemas)."""
        return task.messages()

    async def run(self, task: Task, session: Session, context: ToolContext) -> None:
        """Sample the call (its opening prefilled) and run it in the sandbox.

        The episode ends with the call: its result is recorded with the call
        (`meta.tool_calls`, where the reward reads it) but not appended to the token stream,
        since no later turn would read it.
        """
        turn = await session.generate(prefill=PREFILL)
        calls = parse_tool_calls(turn.text).calls
        records = await self.toolset.execute_all(calls, context, turn=0)
        context.state.setdefault("tool_calls", []).extend(records)


def build_agent() -> ToyToolAgent:
    """The agent the configs name."""
    return ToyToolAgent()


@reward
def found_the_treasure(task: dict[str, Any], trajectory: Trajectory | None) -> float:
    """1.0 when the first tool call ran in the sandbox and printed the treasure's code."""
    if trajectory is None or not trajectory.meta.tool_calls:
        return 0.0
    call = trajectory.meta.tool_calls[0]
    return float(call.error is None and call.output.strip() == task["metadata"]["code"])
