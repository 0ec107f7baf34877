"""Exec streams: a command's stdin, stdout and stderr over a hijacked Docker API connection.

`DockerHost.start_exec` asks the daemon to start a created exec with `Connection: Upgrade`; the
same connection then carries stdin one way and Docker's multiplexed stdout/stderr frames (an
8-byte header: stream, 0, 0, 0, big-endian size) the other. `pump` reads them a bounded chunk
at a time (at most `CHUNK` bytes) into the sinks, noting when output last came; `feed_stdin`
writes the input and half-closes the connection, so the command sees end of input while its
output keeps flowing. Everything runs on the event loop: a running command holds no thread.

Why not a library: the Docker SDK's socket API (`exec_start(socket=True)`, then
`docker.utils.socket.frames_iter`) reads with blocking calls, so every running command would
hold a thread, and the TLS socket it hands over cannot be adopted by asyncio; that raw socket
also sits below a buffered HTTP reader that may already hold the first frames (reported lost
in docker/docker-py#3332). aiodocker (0.27) reads exec frames asynchronously but cannot
half-close stdin (its stream's `close()` ends the whole connection), which a command reading
its input to the end needs (`cat > file`, as `write_file` runs). What is left here is the
upgrade request and Docker's frame headers.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlparse

from omniloop.errors import SandboxError

CHUNK = 64 * 1024
"""The most bytes read from or written to an exec stream at a time."""


class Sink(Protocol):
    """Where one output stream of a command goes."""

    def feed(self, chunk: bytes) -> None: ...


class BoundedBytes:
    """Collects a stream whole, up to `limit` bytes; notes an overflow instead of growing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.overflow = False

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.overflow = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk


def _ssl_context(tls: Any) -> ssl.SSLContext | None:
    """The TLS context of the SDK's `TLSConfig` (`DOCKER_TLS_VERIFY`, `DOCKER_CERT_PATH`)."""
    if not tls:
        return None
    context = ssl.create_default_context(cafile=tls.ca_cert) if tls.verify else None
    if context is None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if tls.cert:
        context.load_cert_chain(*tls.cert)
    return context


class StreamEndpoint:
    """Where a daemon's exec streams connect: `unix://`, `tcp://` or `https://`, with the
    SDK's TLS settings (`tls`: its `TLSConfig`, or None)."""

    def __init__(self, base_url: str, api_version: str, tls: Any) -> None:
        self.base_url = base_url
        self.api_version = api_version
        self._ssl = _ssl_context(tls)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fresh raw connection to the daemon (for one exec stream)."""
        url = urlparse(self.base_url)
        if url.scheme in ("unix", "http+unix"):
            return await asyncio.open_unix_connection(url.path, limit=CHUNK)
        if url.scheme in ("tcp", "http", "https"):
            use_ssl = self._ssl if (self._ssl is not None or url.scheme == "https") else None
            if url.scheme == "https" and use_ssl is None:
                use_ssl = ssl.create_default_context()
            return await asyncio.open_connection(
                url.hostname, url.port or 2375, ssl=use_ssl, limit=CHUNK
            )
        raise SandboxError(f"exec streams over {url.scheme}:// are not supported ({self.base_url})")

    async def start_exec(self, exec_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Start a created exec and return the hijacked connection carrying its stdio."""
        reader, writer = await self.connect()
        try:
            body = b'{"Detach": false, "Tty": false}'
            writer.write(
                f"POST /v{self.api_version}/exec/{exec_id}/start HTTP/1.1\r\n"
                "Host: docker\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            status = int(status_line.split(" ")[1])
            if status not in (101, 200):
                headers = dict(line.split(":", 1) for line in header_lines if ":" in line)
                length = int(
                    next((v for k, v in headers.items() if k.lower() == "content-length"), "0")
                )
                detail = (await reader.read(min(length, 4096))).decode(errors="replace")
                raise SandboxError(f"exec start failed ({status}): {detail.strip()}")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
            writer.close()
            raise SandboxError(f"exec start failed: {err}") from err
        except BaseException:
            writer.close()
            raise
        return reader, writer


async def pump(
    reader: asyncio.StreamReader, sinks: Mapping[int, Sink], last_output: list[float]
) -> None:
    """Demultiplex Docker's stdio frames into the sinks (by stream number: 1 stdout, 2
    stderr), a bounded chunk at a time, until the stream ends; `last_output[0]` is set to the
    `time.monotonic()` of the latest chunk."""
    while True:
        try:
            header = await reader.readexactly(8)
        except asyncio.IncompleteReadError:
            return
        sink = sinks.get(header[0])
        size = int.from_bytes(header[4:8], "big")
        while size:
            chunk = await reader.read(min(size, CHUNK))
            if not chunk:
                return
            size -= len(chunk)
            last_output[0] = time.monotonic()
            if sink is not None:
                sink.feed(chunk)


async def feed_stdin(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write `data` to the command's stdin, then end it (half-close: output keeps flowing)."""
    try:
        for start in range(0, len(data), CHUNK):
            writer.write(data[start : start + CHUNK])
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        # The command exited without reading all of its input; that is its business.
        pass
