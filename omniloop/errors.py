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


class RoleLost(OmniloopError):
    """A replica of another role died, and with it the caller's work, through no fault of the
    work, which can be run again from the start (`faults.Retry` re-runs it and files the fault
    under `failed_role`)."""

    failed_role = ""
    """The role whose failure this is."""

    def __init__(self, message: str, failed_role: str | None = None) -> None:
        super().__init__(message)
        if failed_role is not None:
            self.failed_role = failed_role


class SandboxLost(SandboxError, RoleLost):
    """The sandbox service holding a sandbox is gone (unreachable, or restarted and no longer
    knows the sandbox): the sandbox and what ran in it are lost."""

    failed_role = "sandbox"


class EngineError(OmniloopError):
    """The inference engine failed or answered with something unusable."""


class ToolError(OmniloopError):
    """A tool call could not be carried out; its message is shown to the model."""


class MediaError(OmniloopError, ValueError):
    """A media item cannot be used: unreadable, empty, over a configured bound, or of a kind
    the model does not take. The message names the item (its kind and content hash or source)
    and the bound or setting to change."""


class RewardError(OmniloopError):
    """A reward function raised or timed out."""
