"""`sandbox.service: local`: the process running episodes gets its sandboxes from a sandboxd
child process and creates none itself. Real sandboxd processes, real bwrap sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from omniloop.errors import SandboxLost
from omniloop.sandboxes.bwrap.cleanup import base_dir
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.local import LocalSandboxd

pytestmark = pytest.mark.slow

BWRAP = SandboxConfig(backend="bwrap", pool_size=1, limits=SandboxLimits(timeout=10, memory_mb=256))


def _owner(sandbox_id: str) -> int:
    return int(json.loads((base_dir() / sandbox_id / "owner.json").read_text())["pid"])


async def test_sandboxes_come_from_a_child_sandboxd(
    still_running: Callable[..., list[int]],
) -> None:
    async with LocalSandboxd(BWRAP) as local:
        assert local.pid is None, "started before anyone asked for a sandbox"
        sandbox = await local.acquire()
        assert local.pid is not None
        assert _owner(sandbox.id) == local.pid != os.getpid()
        assert psutil.Process(local.pid).ppid() == os.getpid()
        result = await sandbox.exec(["python3", "-c", "print(6 * 7)"])
        assert result.ok
        assert result.stdout.strip() == "42"
        await local.release(sandbox)
        child = local.pid
    assert not still_running([child], within=15), "aclose left the sandboxd running"


async def test_a_dead_child_loses_its_sandboxes_and_the_next_acquire_starts_another(
    still_running: Callable[..., list[int]],
) -> None:
    async with LocalSandboxd(BWRAP) as local:
        sandbox = await local.acquire()
        first = local.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert not await asyncio.to_thread(still_running, [first], 15)
        with pytest.raises(SandboxLost):
            await sandbox.exec(["true"])
        again = await local.acquire()
        assert local.pid not in (None, first)
        assert (await again.exec(["true"])).ok
        await local.release(again)


def test_the_child_dies_with_its_parent(
    tmp_path: Path, still_running: Callable[..., list[int]]
) -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, sys
        from omniloop.sandboxes.config import SandboxConfig
        from omniloop.sandboxes.local import LocalSandboxd

        async def main():
            local = LocalSandboxd(SandboxConfig(backend="bwrap", pool_size=0))
            await local.acquire()
            print(local.pid, flush=True)
            await asyncio.sleep(300)

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert not still_running([child], within=15), "the sandboxd outlived its starter"
    finally:
        if parent.poll() is None:
            parent.kill()
