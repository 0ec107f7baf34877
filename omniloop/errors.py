"""One exception hierarchy, one class per boundary.

Inside omniloop these are raised; at the episode boundary they become data: the rollout records
`error.type` and a `stop_reason` on the trajectory instead of crashing (see DESIGN.md §2).
"""

from __future__ import annotations


class OmniloopError(Exception):
    """Base class of every error omniloop raises on purpose."""


class ConfigError(OmniloopError, ValueError):
    """A configuration value is invalid; the message names the value and how to fix it."""


class SandboxError(OmniloopError):
    """The sandbox infrastructure failed (not the command inside it)."""


class SandboxLost(SandboxError):
    """The sandbox service holding a sandbox is gone (unreachable, or restarted and no longer
    knows the sandbox): the sandbox and what ran in it are lost, through no fault of the work,
    which can be run again from the start."""

    failed_role = "sandbox"
    """The role whose failure this is (`faults.Retry` files the fault under it)."""


class EngineError(OmniloopError):
    """The inference engine failed or answered with something unusable."""


class ToolError(OmniloopError):
    """A tool call could not be carried out; its message is shown to the model."""


class RewardError(OmniloopError):
    """A reward function raised or timed out."""
