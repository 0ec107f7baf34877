"""Docker exec streams (`omniloop.sandboxes.docker.exec_stream`) against a real Unix-socket
server speaking the daemon's side: the upgrade answer, then multiplexed stdio frames."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from omniloop.errors import SandboxError
from omniloop.sandboxes.docker.exec_stream import (
    CHUNK,
    BoundedBytes,
    StreamEndpoint,
    feed_stdin,
    pump,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


class Chunks:
    """A sink that keeps every chunk it is fed."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        self.chunks.append(chunk)


async def serve(tmp_path: Path, handler: Handler) -> tuple[asyncio.AbstractServer, str]:
    path = str(tmp_path / "docker.sock")
    server = await asyncio.start_unix_server(handler, path)
    return server, f"unix://{path}"


async def read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
    return head, await reader.readexactly(length)


async def test_frames_are_demultiplexed_in_bounded_chunks_until_the_stream_ends() -> None:
    big = bytes(range(256)) * (3 * CHUNK // 256 + 1)
    reader = asyncio.StreamReader()
    reader.feed_data(frame(1, b"out") + frame(2, b"err") + frame(3, b"unknown stream"))
    reader.feed_data(frame(1, big)[:100])  # a frame split across reads
    reader.feed_data(frame(1, big)[100:])
    reader.feed_data(frame(2, b"cut short")[:9])  # header and 1 of 9 bytes, then the end
    reader.feed_eof()
    out, err = Chunks(), Chunks()
    last_output = [0.0]

    await pump(reader, {1: out, 2: err}, last_output)

    assert b"".join(out.chunks) == b"out" + big
    assert b"".join(err.chunks) == b"errc"
    assert max(len(c) for c in out.chunks) <= CHUNK
    assert last_output[0] > 0.0


def test_bounded_bytes_keeps_the_first_limit_bytes_and_notes_the_overflow() -> None:
    sink = BoundedBytes(5)
    sink.feed(b"abc")
    assert not sink.overflow
    sink.feed(b"defg")
    sink.feed(b"h")

    assert bytes(sink.data) == b"abcde"
    assert sink.overflow


async def test_start_exec_upgrades_the_connection_and_half_closes_stdin(tmp_path: Path) -> None:
    seen: dict[str, bytes | str] = {}

    async def daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        seen["head"], seen["body"] = head, body
        writer.write(b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
        stdin = await reader.read()  # to the end: only a half-close gets here
        writer.write(frame(1, stdin.upper()))
        writer.close()

    server, url = await serve(tmp_path, daemon)
    async with server:
        reader, writer = await StreamEndpoint(url, "1.41", None).start_exec("abc123")
        await feed_stdin(writer, b"hello" * 20_000)
        out = BoundedBytes(1 << 20)
        await asyncio.wait_for(pump(reader, {1: out}, [0.0]), 10)
        writer.close()

    assert str(seen["head"]).startswith("POST /v1.41/exec/abc123/start HTTP/1.1\r\n")
    assert "Upgrade: tcp" in str(seen["head"])
    assert seen["body"] == b'{"Detach": false, "Tty": false}'
    assert bytes(out.data) == b"HELLO" * 20_000


async def test_start_exec_reports_the_daemons_refusal(tmp_path: Path) -> None:
    async def daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b'{"message":"No such exec instance: abc123"}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    server, url = await serve(tmp_path, daemon)
    async with server:
        with pytest.raises(SandboxError, match=r"exec start failed \(404\).*No such exec"):
            await StreamEndpoint(url, "1.41", None).start_exec("abc123")


async def test_an_unsupported_scheme_is_refused_by_name() -> None:
    with pytest.raises(SandboxError, match=r"ssh://"):
        await StreamEndpoint("ssh://user@host", "1.41", None).connect()
