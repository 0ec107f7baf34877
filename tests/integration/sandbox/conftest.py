"""Real bubblewrap sandboxes with small limits, and helpers to look at the host from outside."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from omniloop.sandboxes.bwrap import BwrapSandbox, create_bwrap_sandbox
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits

# Small enough to hit quickly on a loaded 2-core machine; tmp + workspace stay below memory so
# that filling them ends in ENOSPC, not an OOM kill.
SMALL_LIMITS: dict[str, Any] = {
    "timeout": 10.0,
    "kill_grace": 0.5,
    "memory_mb": 256,
    "pids": 64,
    "nofile": 256,
    "file_size_mb": 64,
    "workspace_mb": 32,
    "tmp_mb": 16,
    "output_bytes": 4096,
}

MakeSandbox = Callable[..., Awaitable[BwrapSandbox]]


@pytest.fixture
async def make_sandbox() -> AsyncIterator[MakeSandbox]:
    """`await make_sandbox(pids=8, env={...})`: a bwrap sandbox with `SMALL_LIMITS` overridden by
    the keyword arguments (limit fields, or `env`/`workdir`); all are closed after the test."""
    made: list[BwrapSandbox] = []

    async def make(**overrides: Any) -> BwrapSandbox:
        fields = {k: overrides.pop(k) for k in ("env", "workdir") if k in overrides}
        limits = SandboxLimits(**{**SMALL_LIMITS, **overrides})
        sandbox = await create_bwrap_sandbox(
            SandboxConfig(backend="bwrap", limits=limits, **fields)
        )
        made.append(sandbox)
        return sandbox

    yield make
    await asyncio.gather(*(s.close() for s in made))


@pytest.fixture
async def sandbox(make_sandbox: MakeSandbox) -> BwrapSandbox:
    return await make_sandbox()


def host_pids_running(token: str) -> list[int]:
    """Pids of host processes whose command line contains `token`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in cmdline:
            found.append(int(name))
    return found


@pytest.fixture
def host_pids() -> Callable[[str], list[int]]:
    """`host_pids("sleep 4711")`: host processes whose command line contains the text."""
    return host_pids_running


def peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


@pytest.fixture
def reset_peak_rss() -> Callable[[], int]:
    """Reset this process's peak RSS (VmHWM) and return it in KiB, to measure what a step adds."""

    def reset() -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return peak_rss_kib()

    return reset


@pytest.fixture
def peak_rss() -> Callable[[], int]:
    """This process's peak RSS (VmHWM) in KiB."""
    return peak_rss_kib
