"""Routing generation requests over the engines in rotation, with session affinity.

`EngineRouter` is an `Engine` over several engines. Where the engines come from is a
`rotation` callable (the DCS coordinator's list in a run: engines enter it only once they hold
the current weights), read again every `refresh_s` and after a failure; when it cannot be read
the last list stands. `router.session(key)` is the `Engine` of one session (an episode): its
first request goes to the least loaded engine (fewest requests in flight from this router, then
fewest sessions), and every later one to the same engine while it stays in rotation, so a
multi-turn episode finds its history in that engine's prefix cache.

An engine that cannot be reached is set aside (until the rotation no longer lists it, or for
`set_aside_s`) and the request goes to another one; sampling is idempotent (a failed request
returned no tokens), so an episode whose engine died goes on elsewhere. With no engine to
send to, a request waits (re-reading the rotation) for up to `wait_s`, then fails as
`EngineError`. A refusal by a live engine (a bad request) is not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from omniloop.errors import EngineError
from omniloop.http_client import HttpTransportError
from omniloop.inference.base import Engine, GenerateOutput, SamplingParams
from omniloop.inference.client import EngineClient, MediaEncoder, media_fields
from omniloop.modalities.media import MediaData

log = logging.getLogger(__name__)

Rotation = Callable[[], Awaitable[Sequence[str]]]
"""Returns the base URLs of the engines requests may go to now."""

MAX_SESSIONS = 100_000
"""Sessions whose engine is remembered (the least recently used are forgotten first)."""


def unreachable(err: EngineError) -> bool:
    """Whether `err` means the engine could not be reached (not that it refused the request)."""
    return isinstance(err.__cause__, HttpTransportError)


class EngineRouter:
    """An `Engine` over the engines of a rotation (module docstring). One event loop."""

    def __init__(
        self,
        rotation: Rotation,
        *,
        refresh_s: float = 2.0,
        wait_s: float = 120.0,
        set_aside_s: float = 10.0,
        timeout_s: float = 600.0,
        media_encoder: MediaEncoder = media_fields,
    ) -> None:
        """`media_encoder`: the form its clients send media in (`EngineClient`)."""
        self._rotation = rotation
        self._media_encoder = media_encoder
        self._refresh_s = refresh_s
        self._wait_s = wait_s
        self._set_aside_s = set_aside_s
        self._timeout_s = timeout_s
        self._urls: list[str] = []
        self._read_at = -float("inf")
        self._clients: dict[str, EngineClient] = {}
        self._in_flight: dict[str, int] = {}
        self._aside: dict[str, float] = {}
        """Unreachable engines, with when they may be tried again."""
        self._sessions: OrderedDict[str, str] = OrderedDict()
        """Session key -> the URL of its engine."""
        self._held: dict[str, int] = {}
        """URL -> how many of `_sessions` are on it (kept with `_sessions`, so that a pick
        costs the same after a hundred thousand sessions as after one)."""

    @classmethod
    def over(cls, urls: Sequence[str], **kwargs: Any) -> EngineRouter:
        """A router over a fixed list of engines."""
        fixed = list(urls)

        async def rotation() -> Sequence[str]:
            return fixed

        return cls(rotation, **kwargs)

    def session(self, key: str) -> Engine:
        """The `Engine` of session `key`: its requests stay on one engine while it can."""
        return _Session(self, key)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        media: Sequence[MediaData] = (),
        *,
        top_logprobs: int = 0,
    ) -> GenerateOutput:
        """A request of no session: to the least loaded engine."""
        return await self.generate_for(None, input_ids, sampling, media, top_logprobs=top_logprobs)

    def engine_of(self, key: str) -> str | None:
        """The URL of the engine session `key` is on, if any."""
        return self._sessions.get(key)

    async def generate_for(
        self,
        key: str | None,
        input_ids: list[int],
        sampling: SamplingParams,
        media: Sequence[MediaData] = (),
        *,
        top_logprobs: int = 0,
    ) -> GenerateOutput:
        """Sample on session `key`'s engine (or the least loaded one); module docstring.
        `top_logprobs`: as `base.Engine.generate`."""
        deadline = time.monotonic() + self._wait_s
        last: EngineError | None = None
        while True:
            url = await self._pick(key)
            if url is not None:
                self._in_flight[url] = self._in_flight.get(url, 0) + 1
                try:
                    return await self._client(url).generate(
                        input_ids, sampling, media, top_logprobs=top_logprobs
                    )
                except EngineError as err:
                    if not unreachable(err):
                        raise
                    last = err
                    self._set_aside(url)
                finally:
                    self._in_flight[url] -= 1
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"no engine answered within {self._wait_s:g}s"
                    + (f" (last: {last})" if last else "")
                )
            if url is None:
                await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        """Close the HTTP clients."""
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._clients.clear()

    # -- internals --------------------------------------------------------------------------

    async def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._read_at < self._refresh_s:
            return
        self._read_at = now
        try:
            urls = [u.rstrip("/") for u in await self._rotation()]
        except Exception as err:  # the coordinator is down or busy: the last list stands
            log.debug("engine rotation not read: %r", err)
            return
        self._urls = urls
        for url in [u for u in self._clients if u not in urls and not self._in_flight.get(u)]:
            with contextlib.suppress(Exception):
                await self._clients.pop(url).aclose()
        self._aside = {u: t for u, t in self._aside.items() if u in urls and t > now}

    async def _pick(self, key: str | None) -> str | None:
        await self._refresh(force=not self._urls)
        now = time.monotonic()
        usable = [u for u in self._urls if self._aside.get(u, 0.0) <= now]
        if not usable:
            await self._refresh(force=True)
            usable = [u for u in self._urls if self._aside.get(u, 0.0) <= time.monotonic()]
            if not usable:
                return None
        if key is not None:
            url = self._sessions.get(key)
            if url in usable:
                self._sessions.move_to_end(key)
                return url
        url = min(usable, key=lambda u: (self._in_flight.get(u, 0), self._held.get(u, 0)))
        if key is not None:
            self._hold(key, url)
        return url

    def _hold(self, key: str, url: str) -> None:
        """Remember session `key` on `url` (most recently used), forgetting the least recently
        used sessions past `MAX_SESSIONS`."""
        moved_from = self._sessions.get(key)
        if moved_from is not None:
            self._held[moved_from] -= 1
        self._sessions[key] = url
        self._sessions.move_to_end(key)
        self._held[url] = self._held.get(url, 0) + 1
        while len(self._sessions) > MAX_SESSIONS:
            _, forgotten = self._sessions.popitem(last=False)
            self._held[forgotten] -= 1

    def _set_aside(self, url: str) -> None:
        log.warning("engine %s did not answer; its sessions move to other engines", url)
        self._aside[url] = time.monotonic() + self._set_aside_s
        self._read_at = -float("inf")  # read the rotation again before the next pick

    def _client(self, url: str) -> EngineClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(
                url, timeout=self._timeout_s, media_encoder=self._media_encoder
            )
        return client


class _Session:
    """One session's view of a router."""

    def __init__(self, router: EngineRouter, key: str) -> None:
        self._router = router
        self._key = key

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        media: Sequence[MediaData] = (),
        *,
        top_logprobs: int = 0,
    ) -> GenerateOutput:
        return await self._router.generate_for(
            self._key, input_ids, sampling, media, top_logprobs=top_logprobs
        )


@runtime_checkable
class SessionRouting(Protocol):
    """An engine that keeps a session's requests together (`EngineRouter`)."""

    def session(self, key: str) -> Engine:
        """The `Engine` of session `key`."""
        ...


def for_session(engine: Engine, key: str) -> Engine:
    """`engine`'s view for session `key` when it routes sessions, else `engine` itself."""
    return engine.session(key) if isinstance(engine, SessionRouting) else engine
