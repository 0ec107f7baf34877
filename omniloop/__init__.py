"""omniloop: agentic, multi-turn, omni-modal RL post-training.

The public API, loaded on first use so `import omniloop` stays cheap:

    from omniloop import tool, reward, Agent, ToolAgent, Task, ToolContext, Session, Trajectory
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "tool": "omniloop.tools",
    "ToolContext": "omniloop.tools",
    "Toolset": "omniloop.tools",
    "reward": "omniloop.rewards",
    "Agent": "omniloop.agents.base",
    "Session": "omniloop.agents.base",
    "Task": "omniloop.agents.base",
    "EpisodeEnd": "omniloop.agents.base",
    "ToolAgent": "omniloop.agents.tool_agent",
    "Trajectory": "omniloop.trajectory",
    "ExecResult": "omniloop.sandboxes.base",
    "Sandbox": "omniloop.sandboxes.base",
    "SamplingParams": "omniloop.inference.base",
}

__all__ = [
    "Agent",
    "EpisodeEnd",
    "ExecResult",
    "SamplingParams",
    "Sandbox",
    "Session",
    "Task",
    "ToolAgent",
    "ToolContext",
    "Toolset",
    "Trajectory",
    "reward",
    "tool",
]

if TYPE_CHECKING:
    from omniloop.agents.base import Agent, EpisodeEnd, Session, Task
    from omniloop.agents.tool_agent import ToolAgent
    from omniloop.inference.base import SamplingParams
    from omniloop.rewards import reward
    from omniloop.sandboxes.base import ExecResult, Sandbox
    from omniloop.tools import ToolContext, Toolset, tool
    from omniloop.trajectory import Trajectory


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'omniloop' has no attribute {name!r}")
