"""The built-in tools against a real bubblewrap sandbox, driven the way the agent loop drives
them: model text → `parse_tool_calls` → `Toolset.execute`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.bwrap import bwrap_available
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.factory import create_sandbox
from omniloop.tools import (
    BUILTIN_TOOLS,
    ToolContext,
    Toolset,
    format_tool_call,
    parse_tool_calls,
)
from omniloop.trajectory import ToolCallRecord


@pytest.fixture(autouse=True, scope="module")
def _bwrap_runs_here() -> None:
    # Never skipped: make test installs bubblewrap, so a host without it is a set-up failure.
    assert bwrap_available(), "bubblewrap cannot run on this host (scripts/setup.sh installs it)"


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    box = await create_sandbox(SandboxConfig(backend="bwrap", limits=SandboxLimits(timeout=2.0)))
    try:
        yield box
    finally:
        await box.close()


@pytest.fixture
def run(sandbox: Sandbox) -> Any:
    toolset = Toolset(BUILTIN_TOOLS)
    ctx = ToolContext(sandbox, task={"id": "t"}, episode_id="e")

    async def run_calls(*calls: tuple[str, dict[str, Any]]) -> list[ToolCallRecord]:
        text = "Let me check.\n" + "\n".join(format_tool_call(n, a) for n, a in calls)
        parsed = parse_tool_calls(text)
        assert all(c.ok for c in parsed.calls)
        return await toolset.execute_all(parsed.calls, ctx, turn=0)

    return run_calls


async def test_python_returns_stdout_and_stderr(run):
    [record] = await run(
        ("python", {"code": "import sys\nprint('out')\nprint('err', file=sys.stderr)"})
    )
    assert record.error is None
    assert record.output.splitlines()[0] == "out"
    assert "err" in record.output
    assert "[exit code" not in record.output


async def test_python_exception_is_a_normal_observation_with_the_exit_code(run):
    [record] = await run(("python", {"code": "1/0"}))
    assert record.error is None
    assert "ZeroDivisionError: division by zero" in record.output
    assert record.output.endswith("[exit code 1]")


async def test_python_program_larger_than_one_argument_runs(run):
    code = "x = 1\n" * 40_000 + "print(len('" + "a" * 200_000 + "'))"
    [record] = await run(("python", {"code": code}))
    assert record.output.strip() == "200000"


async def test_bash_runs_bash_with_pipes_and_reports_the_exit_code(run):
    [record] = await run(
        ("bash", {"command": "[[ 2 -gt 1 ]] && echo yes | tr a-z A-Z; pwd; exit 3"})
    )
    assert record.error is None
    lines = record.output.splitlines()
    assert lines[:2] == ["YES", "/workspace"]
    assert lines[-1] == "[exit code 3]"


async def test_bash_command_past_the_sandbox_timeout_is_stopped_and_noted(run):
    [record] = await run(("bash", {"command": "echo started; sleep 30"}))
    assert record.error is None
    assert record.output.startswith("started")
    assert "[timed out after" in record.output
    assert record.duration < 15


async def test_write_then_read_round_trips_text_exactly(run):
    content = "héllo $HOME `id` '\"\\ \n\tend\n"
    write, read = await run(
        ("write_file", {"path": "deep/er/notes.txt", "content": content}),
        ("read_file", {"path": "deep/er/notes.txt"}),
    )
    assert write.output == f"Wrote {len(content.encode())} bytes to deep/er/notes.txt"
    assert read.output == content


async def test_files_are_shared_between_tools_of_an_episode(run):
    _, record = await run(
        ("write_file", {"path": "data.csv", "content": "a,b\n1,2\n3,4\n"}),
        ("python", {"code": "print(sum(1 for _ in open('data.csv')))"}),
    )
    assert record.output.strip() == "3"


async def test_reading_a_missing_file_is_a_normal_observation(run):
    [record] = await run(("read_file", {"path": "missing.txt"}))
    assert record.error is None
    assert "No such file or directory" in record.output
    assert record.output.endswith("[exit code 1]")


async def test_paths_that_look_like_options_are_paths(run):
    write, read = await run(
        ("write_file", {"path": "-n", "content": ""}),
        ("read_file", {"path": "-n"}),
    )
    assert write.output == "Wrote 0 bytes to -n"
    assert read.output == "(-n is empty)"


async def test_writing_where_the_sandbox_forbids_is_a_normal_observation(run):
    [record] = await run(("write_file", {"path": "/usr/evil.txt", "content": "x"}))
    assert record.error is None
    assert "[exit code" in record.output
