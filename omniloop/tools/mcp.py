"""Tools from MCP servers (the `mcp` package), mounted as omniloop tools.

`mcp_tools(server)` lists a server's tools once and returns one `MCPTool` per tool, a `Tool`
like any other: its schema is the server's (name, description, input schema), its arguments
are checked against that schema (a mismatch is `invalid_arguments`, with the reason), and its
calls go to the server. What comes back is the model's observation: the text parts joined,
image and audio parts as media (`ToolResult`), a result the server marks `is_error` (or a
server that crashes, hangs past the tool's timeout, or answers nonsense) a tool error the
model reads, never an episode crash.

Where calls run (`MCPServer`):
- `url`: a running server over streamable HTTP (`mcp.Client(url)`, a connection per call).
- `command` with `in_sandbox=True` (the default): the server is started **inside the episode's
  sandbox** for each call, under a small shim (`mcp_stdio_shim.py`, run by the sandbox's
  `python3`): the exchange (initialize, the initialized notification, the call: the stdio
  transport's messages) is written to the server at once, its answers read back with the
  `mcp_types` JSON-RPC models, and its input closed once the call is answered. The sandbox's
  limits and isolation apply to the server; what it keeps between calls lives in the
  sandbox's files. The sandbox needs `python3` and the server's command (for bwrap, a
  virtual environment can be made visible with `SandboxConfig.read_only_paths`).
- `command` with `in_sandbox=False`: the server runs on the host, for each call, through the
  `mcp` package's stdio client. For servers you trust.

Listing the tools of a `command` server runs it once on the host with the `mcp` stdio client
(before any episode, with no model input): the command must exist on the host too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import mcp_types
from mcp_types.jsonrpc import JSONRPCError, JSONRPCResponse, jsonrpc_message_adapter
from mcp_types.version import LATEST_HANDSHAKE_VERSION

from omniloop.errors import ConfigError, ToolError
from omniloop.modalities.media import MediaData, MediaKind
from omniloop.tools import mcp_stdio_shim
from omniloop.tools.base import ToolArgumentError, ToolContext, ToolResult, function_schema

CLIENT_INFO = {"name": "omniloop", "version": "1"}


@dataclass(frozen=True)
class MCPServer:
    """An MCP server: a command (stdio) or a URL (streamable HTTP)."""

    command: Sequence[str] | None = None
    """The server's command line, e.g. `["python", "server.py"]`."""
    url: str | None = None
    """The server's streamable-HTTP endpoint, e.g. `http://127.0.0.1:8000/mcp`."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of a command server."""
    in_sandbox: bool = True
    """Run a command server's calls in the episode's sandbox (module docstring)."""
    prefix: str = ""
    """Put before every tool name (to keep two servers' tools apart)."""
    timeout: float = 60.0
    """Seconds a call may take."""

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ConfigError("an MCPServer takes a command or a url, exactly one")
        if self.command is not None and not self.command:
            raise ConfigError("an MCPServer's command cannot be empty")

    def client(self) -> Any:
        """A `mcp.Client` for the server, run on the host (for a command, as a subprocess)."""
        from mcp import Client, StdioServerParameters

        if self.url is not None:
            return Client(self.url, read_timeout_seconds=self.timeout)
        assert self.command is not None
        params = StdioServerParameters(
            command=self.command[0], args=list(self.command[1:]), env=dict(self.env) or None
        )
        return Client(params, read_timeout_seconds=self.timeout, mode="legacy")


async def mcp_tools(server: MCPServer) -> list[MCPTool]:
    """The server's tools, listed now (module docstring)."""
    try:
        async with server.client() as client:
            listed = await client.list_tools()
    except Exception as err:
        where = server.url or " ".join(server.command or ())
        raise ConfigError(f"cannot list the tools of the MCP server {where!r}: {err!r}") from err
    return [MCPTool(server, tool) for tool in listed.tools]


class MCPTool:
    """One tool of an MCP server (module docstring)."""

    def __init__(self, server: MCPServer, tool: mcp_types.Tool) -> None:
        self.server = server
        self.remote_name = tool.name
        self.name = server.prefix + tool.name
        self.description = tool.description or ""
        self.parameters: dict[str, Any] = dict(tool.input_schema)
        self.timeout: float | None = server.timeout
        self._validator = jsonschema.Draft202012Validator(self.parameters)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema of the server's tool."""
        return function_schema(self.name, self.description, self.parameters)

    async def call(self, arguments: Mapping[str, Any], ctx: ToolContext) -> str | ToolResult:
        """Check the arguments against the server's schema, call the tool, render its answer."""
        errors = sorted(self._validator.iter_errors(dict(arguments)), key=lambda e: list(e.path))
        if errors:
            where = ".".join(str(p) for p in errors[0].path) or "arguments"
            raise ToolArgumentError(f"{where}: {errors[0].message}")
        if self.server.command is not None and self.server.in_sandbox:
            result = await self._call_in_sandbox(dict(arguments), ctx)
        else:
            async with self.server.client() as client:
                result = await client.call_tool(self.remote_name, dict(arguments))
        return _observation(self.name, result)

    async def _call_in_sandbox(
        self, arguments: dict[str, Any], ctx: ToolContext
    ) -> mcp_types.CallToolResult:
        assert self.server.command is not None
        exchange = [
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": LATEST_HANDSHAKE_VERSION, "capabilities": {},
                "clientInfo": CLIENT_INFO,
            }},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
             "params": {"name": self.remote_name, "arguments": arguments}},
        ]  # fmt: skip
        stdin = "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in exchange)
        command = ["python3", "-c", _shim_source(), "2", *self.server.command]
        ran = await ctx.sandbox.exec(
            command, stdin=stdin, env=dict(self.server.env) or None, timeout=self.server.timeout
        )
        for line in ran.stdout.splitlines():
            with contextlib.suppress(ValueError):
                message = jsonrpc_message_adapter.validate_json(line)
                if isinstance(message, JSONRPCError) and message.id == 2:
                    raise ToolError(f"the MCP server refused the call: {message.error.message}")
                if isinstance(message, JSONRPCResponse) and message.id == 2:
                    return mcp_types.CallToolResult.model_validate(message.result)
        if ran.stop_reason in ("tool_timeout", "idle_timeout"):
            raise TimeoutError(f"the MCP server did not answer within {self.server.timeout:g} s")
        tail = (ran.stderr or ran.stdout)[-500:]
        raise ToolError(f"the MCP server exited {ran.exit_code} without answering: {tail}")


@functools.cache
def _shim_source() -> str:
    return Path(mcp_stdio_shim.__file__).read_text()


def _observation(name: str, result: mcp_types.CallToolResult) -> str | ToolResult:
    texts: list[str] = []
    media: list[MediaData] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            texts.append(block.text)
        elif isinstance(block, mcp_types.ImageContent):
            media.append(MediaData(kind=MediaKind.IMAGE, data=base64.b64decode(block.data)))
        elif isinstance(block, mcp_types.AudioContent):
            media.append(MediaData(kind=MediaKind.AUDIO, data=base64.b64decode(block.data)))
        else:
            other = block.model_dump(mode="json", by_alias=True)
            texts.append(json.dumps(other, ensure_ascii=False))
    if not texts and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(texts)
    if result.is_error:
        raise ToolError(f"tool {name!r} reported an error: {text}")
    return ToolResult(text=text, media=media) if media else text


async def _gather_tools(servers: Sequence[MCPServer]) -> list[MCPTool]:
    lists = await asyncio.gather(*(mcp_tools(s) for s in servers))
    return [tool for tools in lists for tool in tools]


def load_mcp_tools(*servers: MCPServer) -> list[MCPTool]:
    """`mcp_tools` of every server, from synchronous code (an agent factory): one list."""
    return asyncio.run(_gather_tools(servers))
