"""`ToolAgent`: the multi-turn tool loop (ReAct over the model's chat template).

Each turn: sample; parse Hermes/Qwen `<tool_call>` blocks; if there are none, the turn is the
answer and the episode ends; otherwise run the calls in order in the episode's sandbox and
append their results as `tool` messages. Malformed calls, unknown tools and bad arguments come
back to the model as error messages (and are counted); odd output (undecodable text, NUL,
bytes, non-text values, floods) is rendered, cleaned and capped by the toolset (and counted);
a broken sandbox ends the episode as `sandbox_error` (raised by the toolset, recorded by the
rollout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from omniloop.agents.base import EpisodeEnd, Session, Task
from omniloop.agents.chat import Message
from omniloop.tools import DEFAULT_MAX_OUTPUT_CHARS, Tool, ToolContext, Toolset, parse_tool_calls
from omniloop.trajectory import ToolCallRecord


class ToolAgent:
    """An agent that answers by calling tools until it writes a turn without a tool call."""

    def __init__(
        self,
        tools: Iterable[Tool] = (),
        *,
        system_prompt: str | None = None,
        prefill: str | Callable[[Task], str] = "",
        prefill_every_turn: bool = False,
        max_tool_timeouts: int = 2,
        tool_timeout: float | None = 300.0,
        max_tool_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        """
        Args:
            tools: The tools the model may call.
            system_prompt: Shown before the task (the chat template adds the tool list).
            prefill: Text the assistant turn starts with, as if the model wrote it (mask 0),
                or a function of the task giving it; small models that never call tools
                unprompted need e.g. `<tool_call>\\n`.
            prefill_every_turn: Prefill every turn, not only the first.
            max_tool_timeouts: End the episode as `tool_timeout` after this many timed-out calls.
            tool_timeout: Backstop seconds per tool call when a tool sets none.
            max_tool_output_chars: Characters of one tool result the model is shown; longer
                results keep their head and tail around a truncation marker.
        """
        self.toolset = Toolset(
            tools, default_timeout=tool_timeout, max_output_chars=max_tool_output_chars
        )
        self.tool_schemas: list[dict[str, Any]] = self.toolset.schemas()
        self.system_prompt = system_prompt
        self.prefill = prefill
        self.prefill_every_turn = prefill_every_turn
        self.max_tool_timeouts = max_tool_timeouts

    def opening(self, task: Task) -> list[Message]:
        """The system prompt (if any) and the task's prompt."""
        return task.messages(self.system_prompt)

    async def run(self, task: Task, session: Session, context: ToolContext) -> None:
        """Alternate model turns and tool results until a turn makes no tool call."""
        records = context.state.setdefault("tool_calls", [])
        timeouts = 0
        while True:
            first = session.num_turns == 0
            prefill = ""
            if first or self.prefill_every_turn:
                prefill = self.prefill(task) if callable(self.prefill) else self.prefill
            turn = await session.generate(prefill=prefill)
            calls = parse_tool_calls(turn.text).calls
            if not calls:
                return
            results = await self.toolset.execute_all(calls, context, turn=session.num_turns - 1)
            records.extend(results)
            timeouts += sum(r.error == "tool_timeout" for r in results)
            if timeouts >= self.max_tool_timeouts:
                raise EpisodeEnd("tool_timeout", f"{timeouts} tool calls timed out")
            session.add_observation([tool_message(r) for r in results])


def tool_message(record: ToolCallRecord) -> Message:
    """The `tool` message of a call's result: its text, then its media as parts."""
    if not record.media:
        return {"role": "tool", "content": record.output}
    parts: list[dict[str, Any]] = [{"type": "text", "text": record.output}]
    parts += [{"type": item.kind.value, item.kind.value: item} for item in record.media]
    return {"role": "tool", "content": parts}
