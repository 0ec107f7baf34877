"""The `Sandbox` protocol: the one boundary every sandbox backend implements.

Backends (`bwrap`, `docker`, `gvisor`, a remote `sandboxd` client) differ only in how they
isolate; rollout code sees this protocol and nothing else. A command that fails inside the
sandbox is a normal `ExecResult`; `SandboxError` is raised only when the sandbox itself fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

ExecStopReason = Literal["exit", "signal", "tool_timeout", "idle_timeout", "oom"]
"""Why a command stopped: it exited, a signal killed it, it ran past its wall-clock timeout,
it printed nothing for too long, or it ran out of memory."""

TRUNCATION_MARKER = "\n[truncated {n} bytes]\n"
"""Placed between the head and the tail of output that exceeded the cap."""


class ExecResult(BaseModel):
    """The outcome of one command run in a sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exit_code: int | None
    """The process's exit status; negative for death by signal; None if it never exited itself."""
    stdout: str
    """Captured standard output (UTF-8, invalid bytes replaced), capped as head + tail."""
    stderr: str
    """Captured standard error, capped the same way."""
    truncated: bool = False
    """True when stdout or stderr exceeded the output cap and holds a truncation marker."""
    stop_reason: ExecStopReason = "exit"
    """Why the command stopped."""
    duration: float = Field(ge=0.0)
    """Wall-clock seconds from start to the end of the command."""

    @property
    def ok(self) -> bool:
        """True when the command exited by itself with status 0."""
        return self.stop_reason == "exit" and self.exit_code == 0

    def text(self) -> str:
        """Output as a tool would show it to a model: stdout, then stderr, then why it stopped."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(self.stderr)
        if self.stop_reason == "tool_timeout":
            parts.append(f"[timed out after {self.duration:.1f}s]")
        elif self.stop_reason == "idle_timeout":
            parts.append("[killed: no output for too long]")
        elif self.stop_reason == "oom":
            parts.append("[killed: out of memory]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(p for p in parts if p)


@runtime_checkable
class Sandbox(Protocol):
    """An isolated place to run an episode's tool commands.

    Contract: `exec` never raises for what the command does (non-zero exit, timeout, OOM, output
    flood); it raises `SandboxError` only when the sandbox itself is broken. Paths given to
    `read_file`/`write_file` are relative to the workspace (or absolute inside it); anything that
    resolves outside the workspace is refused with `SandboxError`. `close` is idempotent.
    """

    id: str

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `command` (argv, or a shell script when a string) inside the sandbox."""
        ...

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file in the workspace, creating parent folders."""
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file from the workspace."""
        ...

    async def close(self) -> None:
        """Destroy the sandbox and everything in it."""
        ...
