"""Checklist E35 with real bwrap sandboxes: pristine checkouts, refill, unhealthy replaced."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable

import pytest

from omniloop.errors import SandboxError
from omniloop.sandboxes.bwrap import BwrapSandbox, create_bwrap_sandbox
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.pool import SandboxPool

CONFIG = SandboxConfig(backend="bwrap", limits=SandboxLimits(memory_mb=256, pids=64, tmp_mb=16))


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool[BwrapSandbox]]:
    pool = SandboxPool(lambda: create_bwrap_sandbox(CONFIG), size=2)
    await pool.start(wait=True)
    yield pool
    await pool.close()


async def _until(predicate: Callable[[], bool], limit: float = 10.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_e35_checkouts_are_pristine_and_never_reused(
    pool: SandboxPool[BwrapSandbox],
) -> None:
    async with pool.lease() as first:
        await first.exec("echo mine > state.txt; echo mine > /tmp/state.txt")
    async with pool.lease() as second:
        listing = await second.exec("ls -A /workspace /tmp")

    assert second is not first
    assert "state.txt" not in listing.stdout
    with pytest.raises(SandboxError):
        await first.exec("true")  # given back means closed
    assert not first.root.exists()


async def test_e35_pool_refills_in_the_background(pool: SandboxPool[BwrapSandbox]) -> None:
    assert pool.ready == 2
    taken = [await pool.acquire(), await pool.acquire()]

    assert await _until(lambda: pool.ready == 2)
    assert pool.stats.warm_acquires == 2
    for sandbox in taken:
        await pool.release(sandbox)
    assert pool.stats.created >= 4


async def test_e35_unhealthy_sandboxes_are_replaced_not_handed_out(
    pool: SandboxPool[BwrapSandbox],
) -> None:
    broken = list(pool._ready)
    for sandbox in broken:  # the Daytona gotcha: pooled sandboxes that died while waiting
        launcher = sandbox._launcher
        assert launcher is not None
        assert launcher.pid() is not None
        os.kill(launcher.pid() or 0, 9)
    assert await _until(lambda: not any(s.is_healthy() for s in broken))

    sandbox = await pool.acquire()
    try:
        assert sandbox not in broken
        assert (await sandbox.exec("echo fresh")).stdout == "fresh\n"
    finally:
        await pool.release(sandbox)
    assert pool.stats.replaced_unhealthy == 2
    assert await _until(lambda: not any(s.root.exists() for s in broken))


async def test_e35_close_removes_ready_and_leased_sandboxes() -> None:
    pool = SandboxPool(lambda: create_bwrap_sandbox(CONFIG), size=1)
    await pool.start(wait=True)
    leased = await pool.acquire()
    await pool.start(wait=True)
    ready = list(pool._ready)
    await pool.close()

    assert not leased.root.exists()
    assert all(not s.root.exists() for s in ready)
    with pytest.raises(SandboxError):
        await pool.acquire()


async def test_warm_acquire_is_a_queue_pop(pool: SandboxPool[BwrapSandbox]) -> None:
    """Records warm acquire latency (printed, not asserted: the machine is shared)."""
    times = []
    for _ in range(5):
        await _until(lambda: pool.ready == 2)
        started = time.perf_counter()
        sandbox = await pool.acquire()
        times.append(time.perf_counter() - started)
        await pool.release(sandbox)

    print(f"warm acquire p50 {statistics.median(times) * 1000:.3f} ms")
    assert pool.stats.warm_acquires == 5
