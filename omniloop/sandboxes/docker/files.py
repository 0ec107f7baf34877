"""Workspace file access of a Docker sandbox, for `read_file` / `write_file`.

A transfer is one command, `sh` as the sandbox user running `FILE_SCRIPT`: it walks the path one
component at a time and refuses symlinks, then reads a regular file to stdout or replaces one
from stdin. Paths are normalised first and must stay inside the workspace. The checks run as
the sandbox user, so a race against a command of the sandbox can at worst reach what that user
reaches anyway.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Literal, Protocol

from omniloop.errors import SandboxError
from omniloop.sandboxes.base import ExecStopReason
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.docker.exec_stream import BoundedBytes, Sink

_MIB = 1024 * 1024

# Walks the path one component at a time and refuses symlinks, then reads or replaces a regular
# file. Arguments: workspace, target (normalised, absolute, inside the workspace), mode.
FILE_SCRIPT = r"""
W=$1; T=$2; M=$3
rel=${T#"$W"/}; cur=$W; set -f; IFS=/
for part in $rel; do
  cur=$cur/$part
  if [ -L "$cur" ]; then echo "symlink on the path: $cur" >&2; exit 97; fi
  if [ "$cur" != "$T" ] && [ -e "$cur" ] && [ ! -d "$cur" ]; then
    echo "not a directory: $cur" >&2; exit 98
  fi
done
unset IFS
if [ -e "$T" ] && [ ! -f "$T" ]; then echo "not a regular file: $T" >&2; exit 98; fi
if [ "$M" = read ]; then
  [ -f "$T" ] || { echo "no such file: $T" >&2; exit 96; }
  exec cat -- "$T"
fi
mkdir -p -- "${T%/*}" || exit 98
exec cat > "$T"
"""
FILE_ERRORS = {96: FileNotFoundError, 97: PermissionError, 98: PermissionError}


def resolve_workspace_path(workdir: str, path: str) -> str:
    """The absolute, normalised path of `path` (relative to `workdir`, or absolute inside it);
    raise `SandboxError` for anything that leaves the workspace or names the workspace itself."""
    if not path or "\x00" in path:
        raise SandboxError(f"invalid path {path!r}")
    root = posixpath.normpath(workdir)
    resolved = posixpath.normpath(posixpath.join(root, path))
    if not resolved.startswith(root.rstrip("/") + "/"):
        raise SandboxError(f"path {path!r} leaves the workspace {workdir}")
    return resolved


class CommandRunner(Protocol):
    """Runs `argv` in the sandbox with its output into `sinks`; returns (exit code, why it
    stopped, duration) as `DockerSandbox._run` does."""

    async def __call__(
        self,
        argv: list[str],
        *,
        sinks: Mapping[int, Sink],
        timeout: float,
        idle_timeout: float | None,
        stdin: bytes | None,
        env: Mapping[str, str] | None,
    ) -> tuple[int | None, ExecStopReason, float]: ...


async def transfer(
    run: CommandRunner,
    config: SandboxConfig,
    path: str,
    mode: Literal["read", "write"],
    data: bytes | None,
) -> bytes:
    """Read (`data` None) or write the workspace file `path` through `run`; return what was
    read (b"" for a write). Raises `SandboxError` for a refused, failed or oversized transfer."""
    target = resolve_workspace_path(config.workdir, path)
    limit = config.limits.file_size_mb * _MIB
    out, err = BoundedBytes(limit), BoundedBytes(4096)
    workspace = posixpath.normpath(config.workdir)
    exit_code, reason, _ = await run(
        ["/bin/sh", "-c", FILE_SCRIPT, "sh", workspace, target, mode],
        sinks={1: out, 2: err},
        timeout=config.limits.timeout,
        idle_timeout=None,
        stdin=data,
        env=None,
    )
    message = err.data.decode(errors="replace").strip()
    if reason != "exit":
        raise SandboxError(f"{mode} of {path!r} stopped: {reason}")
    if exit_code in FILE_ERRORS:
        raise SandboxError(f"{mode} of {path!r} refused: {message}")
    if exit_code != 0:
        raise SandboxError(f"{mode} of {path!r} failed (exit {exit_code}): {message}")
    if out.overflow:
        raise SandboxError(f"{path!r} is larger than the {limit} byte read limit")
    return bytes(out.data)
