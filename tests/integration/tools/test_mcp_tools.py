"""Tools from a real MCP server (`mcp_server.py`, written with the `mcp` package's server API),
over stdio inside a real bubblewrap sandbox and over streamable HTTP.

What must hold:
- the server's tools are listed with its names, descriptions and input schemas;
- a call runs the server inside the episode's sandbox (its working folder is the sandbox's,
  and what it writes stays there for the next call); its answer is the observation, an image
  part comes back as media;
- arguments that do not fit the schema are `invalid_arguments`; a tool that fails and a
  server that crashes mid-call are tool errors the model reads, not episode crashes;
- an episode of `ToolAgent` with the server's tools, on the real tiny engine, runs the call.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from omniloop import Task, ToolAgent
from omniloop.agents.chat import ChatFormat
from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.episode import EpisodeSettings, run_episode
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.factory import create_sandbox
from omniloop.tools import ToolContext, Toolset, format_tool_call, parse_tool_calls
from omniloop.tools.mcp import MCPServer, MCPTool, mcp_tools
from omniloop.trajectory import ToolCallRecord

SERVER = Path(__file__).with_name("mcp_server.py")
# The server runs on the system's Python with this virtual environment's packages (which hold
# `mcp`): the sandbox sees them, and the server's folder, read-only. (The venv's own
# interpreter links into a folder of the host the sandbox's user may not enter.)
PACKAGES = sysconfig.get_paths()["purelib"]
STDIO = MCPServer(
    command=["/usr/bin/python3", str(SERVER)], env={"PYTHONPATH": PACKAGES}, timeout=30
)
SANDBOX = SandboxConfig(
    backend="bwrap",
    limits=SandboxLimits(timeout=30.0),
    read_only_paths=[PACKAGES, str(SERVER.parent)],
)


@pytest.fixture(scope="module")
def stdio_tools() -> list[MCPTool]:
    return asyncio.run(mcp_tools(STDIO))


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    box = await create_sandbox(SANDBOX)
    try:
        yield box
    finally:
        await box.close()


async def run_calls(
    tools: list[MCPTool], sandbox: Sandbox, *calls: tuple[str, dict[str, Any]]
) -> list[ToolCallRecord]:
    """Calls as the agent loop makes them: model text, parsed, executed by a `Toolset`."""
    text = "\n".join(format_tool_call(name, arguments) for name, arguments in calls)
    context = ToolContext(sandbox, task={"id": "t"}, episode_id="e")
    return await Toolset(tools).execute_all(parse_tool_calls(text).calls, context, turn=0)


def test_the_server_s_tools_are_listed_with_their_schemas(stdio_tools: list[MCPTool]) -> None:
    by_name = {tool.name: tool.schema["function"] for tool in stdio_tools}
    assert set(by_name) == {"add", "remember", "fail", "crash", "picture"}
    add = by_name["add"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["a"]["type"] == "integer"


async def test_calls_run_the_server_inside_the_sandbox(
    stdio_tools: list[MCPTool], sandbox: Sandbox
) -> None:
    added, first, second = await run_calls(
        stdio_tools, sandbox, ("add", {"a": 2, "b": 3}), ("remember", {"note": "x"}),
        ("remember", {"note": "y"}),
    )  # fmt: skip
    assert (added.error, added.output) == (None, "5")
    assert first.output.startswith("1 notes")
    assert second.output.startswith("2 notes")  # the server's state lives in the sandbox
    workspace = first.output.split("cwd ")[1]
    assert workspace != str(Path.cwd())
    assert (await sandbox.read_file("notes.txt")).decode() == "x\ny\n"
    assert not Path("notes.txt").exists()


async def test_an_image_part_comes_back_as_media(
    stdio_tools: list[MCPTool], sandbox: Sandbox
) -> None:
    (record,) = await run_calls(stdio_tools, sandbox, ("picture", {}))
    assert record.error is None
    assert [item.kind.value for item in record.media] == ["image"]
    assert record.media[0].data.startswith(b"\x89PNG")


async def test_bad_arguments_failures_and_crashes_are_tool_errors(
    stdio_tools: list[MCPTool], sandbox: Sandbox
) -> None:
    wrong, failed, crashed = await run_calls(
        stdio_tools, sandbox, ("add", {"a": "two", "b": 3}), ("fail", {}), ("crash", {})
    )
    assert wrong.error == "invalid_arguments"
    assert "'two' is not of type 'integer'" in wrong.output
    assert failed.error == "tool_error"
    assert "reported an error: Error executing tool fail" in failed.output
    assert crashed.error == "tool_error"
    assert "exited 3 without answering" in crashed.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "streamable-http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the MCP server never listened"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_a_streamable_http_server_s_tools(http_server: str, sandbox: Sandbox) -> None:
    tools = await mcp_tools(MCPServer(url=http_server, prefix="remote_"))
    assert "remote_add" in {tool.name for tool in tools}
    calls = [("remote_add", {"a": 40, "b": 2}), ("remote_fail", {})]
    added, failed = await run_calls(tools, sandbox, *calls)
    assert (added.error, added.output) == (None, "42")
    assert failed.error == "tool_error"


class Sandboxes:
    """A provider that creates a bwrap sandbox per episode."""

    async def acquire(self) -> Sandbox:
        return await create_sandbox(SANDBOX)

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.close()


async def test_an_episode_calls_the_server_s_tool(
    stdio_tools: list[MCPTool], tiny_engine_url: str
) -> None:
    # The tiny random model writes no calls of its own: the call is prefilled, every token id
    # ends the turn (so it ends after one sampled token, whichever), and the turn's text
    # (prefill + that token) goes through the agent loop's usual parse.
    call = format_tool_call("add", {"a": 20, "b": 22})
    agent = ToolAgent(stdio_tools, prefill=call)
    tokenizer = load_tokenizer("tiny")
    every_id = list(range(len(tokenizer)))
    async with EngineClient(tiny_engine_url) as engine:
        trajectory = await run_episode(
            agent,
            Task(id="t", prompt="Add 20 and 22."),
            engine=engine,
            chat=ChatFormat(tokenizer, agent.tool_schemas),
            sandbox_provider=Sandboxes(),
            rewards=[],
            settings=EpisodeSettings(
                run_id="r", episode_id="e", max_turns=2, max_context=1024,
                sampling=SamplingParams(max_new_tokens=4, seed=3, stop_token_ids=every_id),
            ),
        )  # fmt: skip
    first = trajectory.meta.tool_calls[0]
    assert (first.name, first.error, first.output) == ("add", None, "42")
    assert trajectory.meta.stop_reason in ("stop", "max_turns")
    assert not trajectory.is_infra_failure
