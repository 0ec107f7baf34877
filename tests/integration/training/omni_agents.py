"""Agents for the omni run test (imported by the run's rollout by file path)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "examples" / "omni"))

from agent import build_agent  # noqa: E402

from omniloop.agents.base import Session, Task  # noqa: E402
from omniloop.agents.chat import Message  # noqa: E402
from omniloop.agents.tool_agent import tool_message  # noqa: E402
from omniloop.tools import ToolContext  # noqa: E402
from omniloop.tools.parser import ParsedCall  # noqa: E402


class LooksCloser:
    """Calls the media tool of the task's modality first (a random tiny model never writes a
    call, and its turns end at `max_new_tokens`, which ends the episode), then samples the
    answer: every episode has media in its prompt and in a tool result before its turn."""

    def __init__(self) -> None:
        self.inner = build_agent()
        self.tool_schemas: list[dict[str, Any]] = self.inner.tool_schemas

    def opening(self, task: Task) -> list[Message]:
        return self.inner.opening(task)

    async def run(self, task: Task, session: Session, context: ToolContext) -> None:
        kind = task.metadata["kind"]
        name, arguments = {
            "image": ("crop", {"left": 0.0, "top": 0.0, "right": 0.5, "bottom": 0.5}),
            "audio": ("spectrogram", {}),
            "video": ("clip", {"start": 0.0, "end": 1.0}),
        }[kind]
        call = ParsedCall(name=name, arguments=arguments, raw=f"<tool_call>{name}</tool_call>")
        record = await self.inner.toolset.execute(call, context, turn=0)
        context.state.setdefault("tool_calls", []).append(record)
        session.add_observation([tool_message(record)])
        await session.generate()


def build() -> LooksCloser:
    return LooksCloser()
