"""The DCS coordinator: which engines a run publishes to, and what happens when one joins,
restarts or fails.

`WeightCoordinator` lives beside the weights (the actor's process, `actor` replica or
in-process): the bytes leave from there, so the registry, the version counter and the
membership changes are kept where a publish starts rather than one service hop away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from torch import Tensor

from omniloop.platform.dcs.base import WeightSync, WeightSyncError

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """What the coordinator publishes: the trainer's weights and their version."""

    @property
    def version(self) -> int:
        """The version of the weights `named_weights` returns now."""
        ...

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The weights under their Hugging Face names, each tied tensor once."""
        ...


@dataclasses.dataclass
class EngineUpdates:
    """What the weight updates of one member engine amounted to, since it became a member."""

    weight_version: int
    """The version of the weights it serves (known from its last update, or from what it
    reported when it joined)."""
    updates: int = 0
    """Weight updates it received."""
    bytes: int = 0
    """Bytes of weights those updates delivered to it."""
    update_seconds: float = 0.0
    """Seconds of the publishes that updated it, summed (a broadcast updates every member in
    the same seconds)."""
    last_update_seconds: float | None = None
    """Seconds of its newest update."""

    def updated(self, version: int, nbytes: float, seconds: float) -> None:
        self.weight_version = version
        self.updates += 1
        self.bytes += int(nbytes)
        self.update_seconds += seconds
        self.last_update_seconds = seconds


SyncFactory = Callable[[list[str]], WeightSync]
"""Engine URLs -> the configured `WeightSync` (`distributed`, `tcp` or `disk`) for exactly
them."""


class WeightCoordinator:
    """The run's engines, which of them are in rotation, and the weights they serve.

    Publishes go to every member engine; the rotation (`engine_urls`, what rollouts route
    requests to) holds only members that serve the actor's current weights. The engines may
    change during a run:

    - `attach(url)` makes an engine a member (a new or restarted one, or one added by hand),
      drops members that no longer answer, and gives it the current weights when it serves
      older ones; it enters the rotation only once it holds them, so it never serves stale
      weights.
    - A publish that fails is tried again without the members that no longer answer; if it
      fails again, each member is published to alone, and those that fail leave the members
      and the rotation (left paused, admitting nothing, never serving stale weights
      silently); the publish fails only when every member does.
    - `detach(url)` takes an engine out of the rotation at once (rollouts send it no new
      request), then, after `drain_s` for the requests it was serving, out of the members;
      until an explicit `attach`, it stays out.

    A change of members builds a new `WeightSync` (a process group's members are fixed) and
    closes the old one. Publishing, attaching and detaching are serialized with each other and
    with whatever else holds `lock` (the actor's optimizer step), so weights are never read
    mid-update.
    """

    def __init__(
        self, source: WeightSource, make_sync: SyncFactory, engine_urls: Sequence[str] = ()
    ) -> None:
        self._source = source
        self._make_sync = make_sync
        self._urls = list(engine_urls)
        self._ready = set(self._urls)
        """Members known to serve the current weights (the rotation)."""
        self._sync: WeightSync | None = make_sync(self._urls) if self._urls else None
        self._removed: set[str] = set()
        """Engines detached by hand: their replicas' re-registration does not bring them back."""
        self._updates = {u: EngineUpdates(source.version) for u in self._urls}
        self.dropped = 0
        """Members dropped because they failed an update while answering."""
        self.lock = asyncio.Lock()

    @property
    def engine_urls(self) -> list[str]:
        """The rotation: members that serve the current weights."""
        return [u for u in self._urls if u in self._ready]

    @property
    def members(self) -> list[str]:
        """Every engine publishes go to (the rotation, and engines still being given the
        current weights or draining)."""
        return list(self._urls)

    def serves(self, url: str) -> bool:
        """Whether the engine at `url` is a member (or was detached by hand: it is known)."""
        return url in self._urls or url in self._removed

    def table(self) -> list[dict[str, object]]:
        """Each member: `url`, `in_rotation` (it serves the current weights), and its
        `EngineUpdates` fields."""
        return [
            {"url": u, "in_rotation": u in self._ready, **dataclasses.asdict(self._updates[u])}
            for u in self._urls
        ]

    async def publish(self, version: int) -> dict[str, float]:
        """Return once every member serves the actor's weights as `version`."""
        async with self.lock:
            return await self._publish(version)

    async def _publish(self, version: int) -> dict[str, float]:
        started = time.perf_counter()
        try:
            metrics = await self._send(version)
        except WeightSyncError:
            if await self._drop_dead_engines():
                metrics = await self._send_or_isolate(version)
            else:
                metrics = await self._isolate_failures(version)
        # Every member now holds `version`; one being detached stays out of the rotation.
        self._ready = set(self._urls) - self._removed
        return {
            **metrics,
            "perf/sync_seconds": time.perf_counter() - started,
            "weight_sync/engines": float(len(self._urls)),
            "weight_sync/dropped_engines": float(self.dropped),
        }

    async def _send(self, version: int) -> dict[str, float]:
        if self._sync is None:
            # No engine is attached (the last one died): whichever attaches next gets the
            # current weights as it attaches.
            return {}
        started = time.perf_counter()
        metrics = await self._sync.publish(self._source.named_weights(), version)
        seconds = time.perf_counter() - started
        for url in self._urls:
            self._updates[url].updated(version, metrics.get("weight_sync/bytes", 0.0), seconds)
        return metrics

    async def _send_or_isolate(self, version: int) -> dict[str, float]:
        try:
            return await self._send(version)
        except WeightSyncError:
            return await self._isolate_failures(version)

    async def _isolate_failures(self, version: int) -> dict[str, float]:
        """Publish to each member alone; drop those that fail (raise if all do)."""
        good: list[str] = []
        failures: dict[str, WeightSyncError] = {}
        for url in self._urls:
            sync = self._make_sync([url])
            try:
                started = time.perf_counter()
                metrics = await sync.publish(self._source.named_weights(), version)
                self._updates[url].updated(
                    version, metrics.get("weight_sync/bytes", 0.0), time.perf_counter() - started
                )
                good.append(url)
            except WeightSyncError as err:
                failures[url] = err
            finally:
                with contextlib.suppress(Exception):
                    await sync.close()
        if not good:
            raise next(iter(failures.values()))
        for url, failure in failures.items():
            log.warning(
                "engine %s failed weight update v%d and leaves the run: %s", url, version, failure
            )
        self.dropped += len(failures)
        await self._set_members(good)
        return {}

    async def _set_members(self, urls: list[str], served_version: int = 0) -> None:
        """Make `urls` the members; one new among them serves `served_version`."""
        self._updates = {u: self._updates.get(u) or EngineUpdates(served_version) for u in urls}
        self._urls = urls
        self._ready &= set(urls)
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await self._sync.close()
        self._sync = self._make_sync(urls) if urls else None

    async def _drop_dead_engines(self) -> bool:
        """Remove engines that no longer answer and rebuild the sync; True if any was."""
        alive = [url for url in self._urls if await _answers(url)]
        if len(alive) == len(self._urls):
            return False
        await self._set_members(alive)
        return True

    async def attach(self, url: str, *, served_version: int = 0, explicit: bool = True) -> bool:
        """Make the engine at `url` (which serves `served_version`) a member; it enters the
        rotation once it serves the actor's current weights. An engine detached earlier is
        attached again only `explicit`ly (by hand, not by its replica re-registering it);
        returns whether it is a member now."""
        url = url.rstrip("/")
        if url in self._removed and not explicit:
            return False
        self._removed.discard(url)
        async with self.lock:
            alive = [u for u in self._urls if u != url and await _answers(u)]
            self._ready.discard(url)
            self._updates.pop(url, None)  # a restarted engine starts its count again
            await self._set_members([*alive, url], served_version)
            if self._source.version != served_version:
                await self._publish(self._source.version)
            self._ready.add(url)
        return True

    async def detach(self, url: str, *, drain_s: float = 5.0) -> bool:
        """Take the engine at `url` out of the rotation, wait `drain_s` for the requests it
        serves, then out of the members; False if it was not a member."""
        url = url.rstrip("/")
        if url not in self._urls:
            return False
        self._removed.add(url)
        self._ready.discard(url)
        await asyncio.sleep(drain_s)
        async with self.lock:
            if url in self._urls:
                await self._set_members([u for u in self._urls if u != url])
        return True

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
