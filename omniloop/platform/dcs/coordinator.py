"""The DCS coordinator: which engines a run publishes to, and what happens when one joins,
restarts or fails.

`WeightCoordinator` lives beside the weights (the actor's process, `actor` replica or
in-process): the bytes leave from there, so the registry, the version counter and the
membership changes are kept where a publish starts rather than one service hop away.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from torch import Tensor

from omniloop.platform.dcs.base import WeightSync, WeightSyncError


class WeightSource(Protocol):
    """What the coordinator publishes: the trainer's weights and their version."""

    @property
    def version(self) -> int:
        """The version of the weights `named_weights` returns now."""
        ...

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The weights under their Hugging Face names, each tied tensor once."""
        ...


SyncFactory = Callable[[list[str]], WeightSync]
"""Engine URLs -> the configured `WeightSync` (`distributed`, `tcp` or `disk`) for exactly
them."""


class WeightCoordinator:
    """The run's engines and the versions they serve: the actor's current weights,
    published to every engine.

    The engines may change during a run: `attach(url)` adds one (a new or restarted engine),
    drops engines that no longer answer, and, when the actor has trained past the weights an
    engine starts with, gives the new engine the current weights before returning, so that it
    never serves stale ones. A change of engines builds a new `WeightSync` (a process group's
    members are fixed) and closes the old one. Publishing and attaching are serialized with
    each other and with whatever else holds `lock` (the actor's optimizer step), so weights are
    never read mid-update.
    """

    def __init__(
        self, source: WeightSource, make_sync: SyncFactory, engine_urls: Sequence[str] = ()
    ) -> None:
        self._source = source
        self._make_sync = make_sync
        self._urls = list(engine_urls)
        self._sync: WeightSync | None = make_sync(self._urls) if self._urls else None
        self.lock = asyncio.Lock()

    @property
    def engine_urls(self) -> list[str]:
        """The engines publishes go to."""
        return list(self._urls)

    def serves(self, url: str) -> bool:
        """Whether the engine at `url` is attached."""
        return url in self._urls

    async def publish(self, version: int) -> dict[str, float]:
        """Return once every engine serves the actor's weights as `version`."""
        async with self.lock:
            return await self._publish(version)

    async def _publish(self, version: int) -> dict[str, float]:
        started = time.perf_counter()
        try:
            metrics = await self._send(version)
        except WeightSyncError:
            # An engine that fails an update leaves the rotation (it is not left serving stale
            # weights); its replacement, if any, gets the current weights when it attaches.
            if not await self._drop_dead_engines():
                raise
            metrics = await self._send(version)
        return {
            **metrics,
            "perf/sync_seconds": time.perf_counter() - started,
            "weight_sync/engines": float(len(self._urls)),
        }

    async def _send(self, version: int) -> dict[str, float]:
        if self._sync is None:
            # No engine is attached (the last one died): whichever attaches next gets the
            # current weights as it attaches.
            return {}
        return await self._sync.publish(self._source.named_weights(), version)

    async def _drop_dead_engines(self) -> bool:
        """Remove engines that no longer answer and rebuild the sync; True if any was."""
        alive = [url for url in self._urls if await _answers(url)]
        if len(alive) == len(self._urls):
            return False
        self._urls = alive
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await self._sync.close()
        self._sync = self._make_sync(alive) if alive else None
        return True

    async def attach(self, url: str, *, served_version: int = 0) -> None:
        """Add the engine at `url` (which serves `served_version`) and give every engine the
        actor's current weights if they are newer."""
        async with self.lock:
            alive = [u for u in self._urls if u != url and await _answers(u)]
            self._urls = [*alive, url]
            if self._sync is not None:
                await self._sync.close()
            self._sync = self._make_sync(self._urls)
            if self._source.version != served_version:
                await self._publish(self._source.version)

    async def close(self) -> None:
        """Close the current sync."""
        if self._sync is not None:
            await self._sync.close()
            self._sync = None


async def _answers(url: str) -> bool:
    """Whether the engine at `url` answers its health check."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False
