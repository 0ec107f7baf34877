"""A pool of warm sandboxes: creation happens ahead of time, every episode gets a fresh one.

`SandboxPool` knows nothing about backends: it takes an async factory (`create_bwrap_sandbox`
with a config bound, a Docker creator, ...) and keeps `size` sandboxes created and ready. A
sandbox is handed out at most once; when the episode gives it back it is closed, never reused,
and the pool creates a replacement in the background. So a checkout is always pristine (no files,
processes or state of an earlier episode) and a warm `acquire` is a queue pop plus a liveness
check (microseconds for bwrap).

Liveness: before handing a sandbox out the pool calls `health_check(sandbox)` (default: the
sandbox's own `async healthy() -> bool` when it has one, else assume healthy). An unhealthy or
failing sandbox is closed in the background and the next one is tried; it is never handed out.

Failures to create are retried in the background with exponential backoff (100 ms doubling to
30 s, reset by a success); an `acquire` that finds nothing ready waits (up to `acquire_timeout`)
and raises `SandboxError` with the last creation error if the factory keeps failing. A
`ConfigError` from the factory is not retried (no retry fixes a configuration): it is raised at
once to every waiting and every later `acquire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes.base import Sandbox

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=Sandbox)

HealthCheck = Callable[[Sandbox], Awaitable[bool]]
"""An async predicate: may this (idle, pooled) sandbox be handed out?"""


async def default_health_check(sandbox: Sandbox) -> bool:
    """Use the sandbox's own `healthy()` when the backend offers one; otherwise assume healthy."""
    healthy = getattr(sandbox, "healthy", None)
    if healthy is None:
        return True
    return bool(await healthy())


@dataclass
class PoolStats:
    """Counters of one pool, for metrics (`sandbox/pool_*`)."""

    created: int = 0
    create_failures: int = 0
    handed_out: int = 0
    replaced_unhealthy: int = 0
    close_failures: int = 0
    warm_acquires: int = 0
    """Acquires served from a ready sandbox without waiting for a creation."""


class SandboxPool(Generic[S]):
    """Keeps `size` fresh sandboxes ready; every checkout is new and closed after use.

    Use as `async with SandboxPool(factory, size) as pool:` and then either
    `async with pool.lease() as sandbox: ...` or `sandbox = await pool.acquire()` ...
    `await pool.release(sandbox)`. A sandbox that is not given back stays the caller's to close;
    `close()` closes everything the pool created, handed out or not.
    """

    def __init__(
        self,
        factory: Callable[[], Awaitable[S]],
        size: int,
        *,
        health_check: HealthCheck | None = None,
        max_concurrent_creates: int = 2,
        acquire_timeout: float | None = 120.0,
        health_check_timeout: float = 5.0,
    ) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        if max_concurrent_creates < 1:
            raise ValueError(f"max_concurrent_creates must be >= 1, got {max_concurrent_creates}")
        self.size = size
        self.stats = PoolStats()
        self._factory = factory
        self._health_check = health_check or default_health_check
        self._health_check_timeout = health_check_timeout
        self._acquire_timeout = acquire_timeout
        self._create_slots = asyncio.Semaphore(max_concurrent_creates)
        self._ready: deque[S] = deque()
        self._waiters: deque[asyncio.Future[S]] = deque()
        self._creating = 0
        self._leased: set[S] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_error: BaseException | None = None
        self._failures_in_a_row = 0
        self._retry_at = 0.0
        self._retry_timer: asyncio.TimerHandle | None = None
        self._misconfigured: ConfigError | None = None
        self._closed = False
        self._started = False

    # -- life cycle --

    async def start(self, *, wait: bool = False) -> None:
        """Begin filling the pool; with `wait`, return once `size` sandboxes are ready (or the
        factory failed)."""
        self._check_open()
        self._started = True
        self._refill()
        if wait:
            while len(self._ready) < self.size and self._creating:
                await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
            if len(self._ready) < self.size and self._last_error is not None:
                raise SandboxError(f"could not fill the sandbox pool: {self._last_error}")

    async def __aenter__(self) -> SandboxPool[S]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every sandbox this pool created, ready or handed out, and stop refilling.

        Creations in flight are awaited (a factory is never cancelled half-way, which could leak
        what it made) and their sandboxes closed too. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(SandboxError("sandbox pool closed"))
        self._waiters.clear()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        doomed = [*self._ready, *self._leased]
        self._ready.clear()
        self._leased.clear()
        await asyncio.gather(*(self._close_quietly(s) for s in doomed))

    # -- checkouts --

    async def acquire(self) -> S:
        """A fresh, healthy sandbox for one episode; give it back with `release`.

        Raises `SandboxError` when the pool is closed or no sandbox could be created within
        `acquire_timeout`.
        """
        self._check_open()
        if not self._started:
            await self.start()
        warm = True
        deadline = (
            None if self._acquire_timeout is None else time.monotonic() + self._acquire_timeout
        )
        while True:
            if self._ready:
                sandbox = self._ready.popleft()
            else:
                warm = False
                sandbox = await self._wait_for_one(deadline)
            self._refill()
            try:
                healthy = await self._is_healthy(sandbox)
            except asyncio.CancelledError:
                # Still untouched: the next caller may have it (or it goes, if the pool did).
                if self._closed:
                    self._spawn(self._close_quietly(sandbox))
                else:
                    self._ready.appendleft(sandbox)
                raise
            if healthy:
                break
            self.stats.replaced_unhealthy += 1
            logger.warning("pooled sandbox %s is unhealthy; replacing it", sandbox.id)
            self._spawn(self._close_quietly(sandbox))
        self._leased.add(sandbox)
        self.stats.handed_out += 1
        self.stats.warm_acquires += warm
        return sandbox

    async def release(self, sandbox: S) -> None:
        """Close a sandbox from `acquire` (never reused) and let the pool replace it.

        Clean-up failures are logged and counted, not raised: the episode is over either way.
        """
        self._leased.discard(sandbox)
        self._refill()
        await asyncio.shield(self._close_quietly(sandbox))

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[S]:
        """`async with pool.lease() as sandbox:` — acquire, and release however the block ends."""
        sandbox = await self.acquire()
        try:
            yield sandbox
        finally:
            await self.release(sandbox)

    @property
    def ready(self) -> int:
        """Sandboxes created and waiting to be handed out."""
        return len(self._ready)

    # -- internals --

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        if self._misconfigured is not None:
            raise self._misconfigured

    async def _is_healthy(self, sandbox: S) -> bool:
        try:
            # Awaited in place (no task): a check that never blocks keeps a warm acquire free
            # of event-loop round trips.
            async with asyncio.timeout(self._health_check_timeout):
                return await self._health_check(sandbox)
        except Exception as err:
            logger.warning("health check of sandbox %s failed: %r", sandbox.id, err)
            return False

    async def _wait_for_one(self, deadline: float | None) -> S:
        waiter: asyncio.Future[S] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._refill()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait([waiter], timeout=timeout)  # never cancels the waiter itself
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if waiter.done():
            return waiter.result()  # raises if the pool was closed meanwhile
        self._abandon(waiter)
        cause = f": {self._last_error!r}" if self._last_error is not None else ""
        raise SandboxError(f"no sandbox ready within {self._acquire_timeout}s{cause}")

    def _abandon(self, waiter: asyncio.Future[S]) -> None:
        """Stop waiting; a sandbox handed to the waiter in the meantime goes to the next one."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            self._offer(waiter.result())
        else:
            waiter.cancel()

    def _refill(self) -> None:
        """Start as many creations as the pool is short (ready + creating < size + waiting)."""
        if self._closed or not self._started or self._misconfigured is not None:
            return
        wanted = self.size + len(self._waiters) - len(self._ready) - self._creating
        if wanted <= 0:
            return
        delay = self._retry_at - time.monotonic()
        if delay > 0:  # backing off after failures: come back when the backoff is over
            if self._retry_timer is None:
                loop = asyncio.get_running_loop()
                self._retry_timer = loop.call_later(delay, self._retry)
            return
        for _ in range(wanted):
            self._creating += 1
            self._spawn(self._create_one())

    def _retry(self) -> None:
        self._retry_timer = None
        self._refill()

    async def _create_one(self) -> None:
        error: Exception | None = None
        try:
            async with self._create_slots:
                if self._closed:
                    return
                try:
                    sandbox = await self._factory()
                except Exception as err:
                    error = err
        finally:
            self._creating -= 1
        if error is not None:
            self._record_failure(error)  # after the count: the retry must see the shortfall
            return
        self._failures_in_a_row = 0
        self._retry_at = 0.0
        self.stats.created += 1
        if self._closed:
            await self._close_quietly(sandbox)
            return
        self._offer(sandbox)
        self._refill()

    def _record_failure(self, err: BaseException) -> None:
        self.stats.create_failures += 1
        self._last_error = err
        if isinstance(err, ConfigError):
            logger.error("sandbox creation refused the configuration: %s", err)
            self._misconfigured = err
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(err)
            return
        self._failures_in_a_row += 1
        backoff = min(30.0, 0.05 * 2 ** min(self._failures_in_a_row, 10))
        self._retry_at = time.monotonic() + backoff
        logger.warning("sandbox creation failed (%r); retrying in %.2fs", err, backoff)
        self._refill()  # schedules the retry

    def _offer(self, sandbox: S) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(sandbox)
                return
        self._ready.append(sandbox)

    async def _close_quietly(self, sandbox: S) -> None:
        try:
            await sandbox.close()
        except Exception as err:
            self.stats.close_failures += 1
            logger.error("closing sandbox %s failed: %r", sandbox.id, err)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
