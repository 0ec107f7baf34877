"""`SandboxPool` logic against in-memory sandboxes: waiting, failures, cancellation, closing."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence

import pytest

from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes.base import ExecResult
from omniloop.sandboxes.pool import SandboxPool

_ids = itertools.count()


class FakeSandbox:
    def __init__(self) -> None:
        self.id = f"fake-{next(_ids)}"
        self.closed = False
        self.alive = True

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        return ExecResult(exit_code=0, stdout="", stderr="", duration=0.0)

    async def write_file(self, path: str, data: bytes | str) -> None:
        pass

    async def read_file(self, path: str) -> bytes:
        return b""

    async def close(self) -> None:
        self.closed = True

    async def healthy(self) -> bool:
        return self.alive and not self.closed


class Factory:
    """Makes fake sandboxes; `fail` makes the next calls raise, `gate` holds them back."""

    def __init__(self) -> None:
        self.made: list[FakeSandbox] = []
        self.fail = 0
        self.gate: asyncio.Event | None = None

    async def __call__(self) -> FakeSandbox:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("creation failed")
        sandbox = FakeSandbox()
        self.made.append(sandbox)
        return sandbox


async def test_size_zero_creates_on_demand() -> None:
    factory = Factory()
    async with SandboxPool(factory, size=0) as pool:
        sandbox = await pool.acquire()
        assert factory.made == [sandbox]
        assert pool.ready == 0
        await pool.release(sandbox)
    assert sandbox.closed


async def test_waiters_are_served_in_order_and_each_gets_its_own() -> None:
    factory = Factory()
    factory.gate = asyncio.Event()
    async with SandboxPool(factory, size=1) as pool:
        waiting = [asyncio.ensure_future(pool.acquire()) for _ in range(3)]
        await asyncio.sleep(0.01)
        factory.gate.set()
        got = await asyncio.gather(*waiting)
        assert len({s.id for s in got}) == 3
        for sandbox in got:
            await pool.release(sandbox)


async def test_creation_failures_are_retried_with_backoff() -> None:
    factory = Factory()
    factory.fail = 3
    async with SandboxPool(factory, size=1, acquire_timeout=10) as pool:
        sandbox = await pool.acquire()
        assert pool.stats.create_failures == 3
        assert not sandbox.closed
        await pool.release(sandbox)


async def test_acquire_reports_the_creation_error_when_it_gives_up() -> None:
    factory = Factory()
    factory.fail = 10**6
    async with SandboxPool(factory, size=1, acquire_timeout=0.3) as pool:
        with pytest.raises(SandboxError, match="creation failed"):
            await pool.acquire()


async def test_a_configuration_error_is_raised_at_once_and_not_retried() -> None:
    calls = 0

    async def misconfigured() -> FakeSandbox:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        raise ConfigError("limits.tmp_mb 600 + limits.workspace_mb 600 exceed memory_mb 512")

    async with SandboxPool(misconfigured, size=2, acquire_timeout=60) as pool:
        async with asyncio.timeout(5):
            waiting = [asyncio.ensure_future(pool.acquire()) for _ in range(3)]
            for task in waiting:
                with pytest.raises(ConfigError, match="exceed memory_mb 512"):
                    await task
            with pytest.raises(ConfigError, match="exceed memory_mb 512"):
                await pool.acquire()
        await asyncio.sleep(0.05)  # creations already under way end
        settled = calls
        await asyncio.sleep(0.5)  # longer than the first backoffs: nothing is retried
    assert calls == settled <= 2 + 3


async def test_unhealthy_sandbox_is_closed_and_skipped() -> None:
    factory = Factory()
    async with SandboxPool(factory, size=2) as pool:
        await pool.start(wait=True)
        first = factory.made[0]
        first.alive = False
        sandbox = await pool.acquire()
        assert sandbox is not first
        await asyncio.sleep(0)
        assert first.closed
        assert pool.stats.replaced_unhealthy == 1
        await pool.release(sandbox)


async def test_a_cancelled_acquire_loses_no_sandbox() -> None:
    factory = Factory()
    factory.gate = asyncio.Event()
    async with SandboxPool(factory, size=1) as pool:
        waiting = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        waiting.cancel()
        factory.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pool.start(wait=True)
        sandbox = await pool.acquire()
        assert not sandbox.closed
        await pool.release(sandbox)
    assert all(s.closed for s in factory.made)


async def test_close_closes_late_creations_and_fails_waiters() -> None:
    factory = Factory()
    factory.gate = asyncio.Event()
    pool = SandboxPool(factory, size=2)
    await pool.start()
    waiting = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(pool.close())
    await asyncio.sleep(0.01)
    factory.gate.set()
    await closing

    with pytest.raises(SandboxError):
        await waiting
    assert factory.made
    assert all(s.closed for s in factory.made)


async def test_release_closes_even_when_the_caller_is_cancelled() -> None:
    factory = Factory()
    async with SandboxPool(factory, size=1) as pool:
        sandbox = await pool.acquire()
        task = asyncio.ensure_future(pool.release(sandbox))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.01)
        assert sandbox.closed


async def test_pool_refills_after_failures_without_anyone_waiting() -> None:
    factory = Factory()
    factory.fail = 2
    async with SandboxPool(factory, size=1) as pool:
        for _ in range(200):
            if pool.ready == 1:
                break
            await asyncio.sleep(0.01)
        assert pool.ready == 1
        assert pool.stats.create_failures == 2
