"""An MCP server written with the `mcp` package's server API, for the MCP tool tests.

python mcp_server.py                        # stdio
python mcp_server.py streamable-http PORT   # http://127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import Image, MCPServer

server = MCPServer("omniloop-test-tools")

# A 1x1 red PNG.
RED_PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def remember(note: str) -> str:
    """Append a note to notes.txt in the working folder and say how many there are."""
    path = Path("notes.txt")
    with path.open("a") as stream:
        stream.write(note + "\n")
    return f"{len(path.read_text().splitlines())} notes; pid {os.getpid()}; cwd {os.getcwd()}"


@server.tool()
def fail() -> str:
    """Always fails."""
    raise ValueError("broken on purpose")


@server.tool()
def crash() -> str:
    """Kills the server mid-call."""
    os._exit(3)


@server.tool()
def picture() -> Image:
    """A red pixel."""
    return Image(data=RED_PIXEL, format="png")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "streamable-http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
