"""Built-in tools: `python`, `bash`, `read_file`, `write_file`, all run in the episode's sandbox.

Everything goes through `Sandbox.exec`, so every tool sees the sandbox's filesystem, limits
and output cap the same way, and what a command does (a non-zero exit, a traceback, a missing
file, a timeout) comes back as an ordinary observation: the output, then a note such as
`[exit code 1]` or `[timed out after 30.0s]` (`ExecResult.text()`). A command runs under the
sandbox's per-command limit (`SandboxLimits.timeout`); the toolset's timeout is only the
backstop above it.
"""

from __future__ import annotations

from omniloop.sandboxes.base import ExecResult
from omniloop.tools.base import Tool, ToolContext, tool

# The command arrives as $1 so that no quoting of model text is ever needed; bash when the
# image has it (the model usually writes bash), POSIX sh otherwise.
_SHELL = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; else exec /bin/sh -c "$1"; fi'

# Missing parent folders are created, as the tool's description promises; content arrives on
# stdin, so its size is not bounded by the argument-length limit.
_WRITE = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'


@tool
async def python(code: str, ctx: ToolContext) -> ExecResult:
    """Run a Python 3 program in the sandbox and return its stdout and stderr.

    Args:
        code: The complete program. Use print() to show results; nothing is echoed otherwise.
    """
    # The program goes in on stdin rather than `-c`: one argument is limited to 128 KiB.
    return await ctx.sandbox.exec(["python3", "-"], stdin=code)


@tool
async def bash(command: str, ctx: ToolContext) -> ExecResult:
    """Run a shell command in the sandbox and return its stdout and stderr.

    Args:
        command: The command line, run by bash (or sh when bash is not installed) in the
            working directory.
    """
    return await ctx.sandbox.exec(["/bin/sh", "-c", _SHELL, "sh", command])


@tool
async def read_file(path: str, ctx: ToolContext) -> ExecResult | str:
    """Read a text file in the sandbox.

    Args:
        path: The file's path, relative to the working directory or absolute.
    """
    result = await ctx.sandbox.exec(["cat", "--", path])
    if result.ok and not result.stdout and not result.stderr:
        return f"({path} is empty)"
    return result


@tool
async def write_file(path: str, content: str, ctx: ToolContext) -> ExecResult | str:
    """Write a text file in the sandbox, replacing it if it exists.

    Args:
        path: The file's path, relative to the working directory or absolute. Missing parent
            folders are created.
        content: The whole new content of the file.
    """
    result = await ctx.sandbox.exec(["/bin/sh", "-c", _WRITE, "sh", path], stdin=content)
    if result.ok:
        return f"Wrote {len(content.encode())} bytes to {path}"
    return result


BUILTIN_TOOLS: tuple[Tool, ...] = (python, bash, read_file, write_file)
"""Every built-in tool, for `Toolset(BUILTIN_TOOLS)`."""
