"""`HttpClient`: the pooled async HTTP client of omniloop's hot paths (engine and sandboxd calls).

It sits on aiohttp, whose CPU per request is a fraction of httpx's: a rollout replica makes an
engine call per turn and several sandboxd calls per episode, and with httpx nearly half of its
event loop's time went into the client (connection-pool bookkeeping above all; the profile is
in docs/benchmarks.md). The interface is the
small part of httpx's those callers used: `request` returns a fully read `HttpResponse`, and
any failure to get an answer (refused, reset, closed early, timed out) raises
`HttpTransportError`.

Contract: one client per event loop at a time. The aiohttp session is made on the first call,
in the running loop; a call from another loop (a new `asyncio.run`) starts a fresh session and
drops the old one's pooled connections. Not thread-safe.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

KEEPALIVE_S = 4.0
"""How long an idle pooled connection is kept; servers must keep theirs longer."""


class HttpTransportError(Exception):
    """No answer came back: the connection was refused, reset or closed early, or the call
    timed out. Whether the server acted on the request is unknown."""


@dataclass(frozen=True)
class HttpResponse:
    """A read answer: status, headers (case-insensitive) and the whole body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        """The body as text (UTF-8; undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON; `ValueError` if it is not JSON."""
        return jsonlib.loads(self.content)


class HttpClient:
    """Connection pool to one server at `base_url`; paths are appended to it verbatim.

    `timeout` bounds a whole call (connecting, sending, waiting, reading) unless a call passes
    its own; `connect_timeout` bounds opening a connection."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        connect_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._headers = dict(headers or {})
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            await self._drop_session()
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections,
                    limit_per_host=0,
                    # Under uvicorn's default 5 s (SGLang's server keeps it): a server that
                    # closes an idle connection as the client reuses it fails that request
                    # unanswered, so the client must be the one to let go first.
                    keepalive_timeout=KEEPALIVE_S,
                ),
                # Our servers set no cookies; a jar would be work on every response.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._loop = loop
        return self._session

    async def _drop_session(self) -> None:
        session, loop = self._session, self._loop
        self._session = self._loop = None
        if session is None or session.closed:
            return
        if loop is asyncio.get_running_loop() or (loop is not None and loop.is_closed()):
            # A closed loop's connections are gone with it: closing only marks them so.
            await session.close()
        else:
            session.detach()  # a loop still open elsewhere: its connections are its own

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: bytes | None = None,
        timeout: float | None = None,
    ) -> HttpResponse:
        """Send one request and read the whole answer (any status is returned, not raised);
        `HttpTransportError` when no answer came back within the timeout."""
        limit = aiohttp.ClientTimeout(
            total=self.timeout if timeout is None else timeout,
            sock_connect=self._connect_timeout,
        )
        try:
            async with (await self._session_here()).request(
                method,
                self.base_url + path,
                json=json,
                params=params,
                data=content,
                timeout=limit,
            ) as response:
                body = await response.read()
                return HttpResponse(response.status, response.headers, body)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HttpTransportError(
                f"{method} {self.base_url}{path}: {type(err).__name__}: {err}"
            ) from err

    async def get(self, path: str, *, timeout: float | None = None) -> HttpResponse:
        """`request("GET", path)`."""
        return await self.request("GET", path, timeout=timeout)

    async def aclose(self) -> None:
        """Close the pooled connections (a later call opens new ones)."""
        await self._drop_session()
