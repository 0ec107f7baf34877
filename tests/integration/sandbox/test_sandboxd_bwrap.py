"""sandboxd with the bwrap backend: the service a run's sandbox role is, on a host without
Docker. A real sandboxd process, real bubblewrap sandboxes, the real HTTP client."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from omniloop.errors import SandboxLost
from omniloop.sandboxes.bwrap.cleanup import base_dir
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.remote import SandboxClient

pytestmark = pytest.mark.slow

BWRAP = SandboxConfig(backend="bwrap", limits=SandboxLimits(timeout=10, memory_mb=256))


@pytest.fixture
def start(tmp_path: Path, sandboxd_class: Any) -> Iterator[Any]:
    started: list[Any] = []

    def launch(*args: str) -> Any:
        service = sandboxd_class(tmp_path / f"sandboxd-{len(started)}.log", *args)
        started.append(service)
        service.wait_ready()
        return service

    yield launch
    for service in started:
        service.stop()


async def test_bwrap_sandboxes_through_the_service(start: Any) -> None:
    service = start("--backend", "bwrap", "--pool-size", "1")
    async with httpx.AsyncClient() as http:
        ready = (await http.get(f"{service.url}/readyz")).json()
    assert ready["bwrap"] == "ok"
    async with SandboxClient(service.url) as client:
        sandbox = await client.create(BWRAP, episode_id="ep-1")
        try:
            await sandbox.write_file("input.txt", "6 7\n")
            result = await sandbox.exec(
                ["python3", "-c", "a, b = open('input.txt').read().split(); print(int(a) * int(b))"]
            )
            assert result.ok, result
            assert result.stdout.strip() == "42"
            # One request id, run once however often it is sent.
            for _ in range(2):
                again = await sandbox.exec(["sh", "-c", "echo x >> runs.txt"], request_id="r1")
                assert again.ok
            assert (await sandbox.read_file("runs.txt")) == b"x\n"
            listed = (await client.request("GET", "/v1/sandboxes")).json()
            assert [(s["backend"], s["episode_id"]) for s in listed] == [("bwrap", "ep-1")]
        finally:
            await sandbox.close()


async def test_a_killed_service_loses_its_sandboxes_and_the_next_one_reaps_them(
    start: Any, still_running: Callable[..., list[int]]
) -> None:
    first = start("--backend", "bwrap", "--pool-size", "0")
    async with SandboxClient(first.url) as client:
        sandbox = await client.create(BWRAP)
        assert (await sandbox.exec(["true"])).ok
        children = psutil.Process(first.proc.pid).children(recursive=True)
        assert children, "the service holds no sandbox process"
        folder = base_dir() / sandbox.id
        assert folder.is_dir()

        first.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.proc.wait, 30)
        with pytest.raises(SandboxLost):
            await sandbox.exec(["true"])

    outlived = await asyncio.to_thread(still_running, [c.pid for c in children], 15)
    assert not outlived, "a sandbox process outlived it"

    second = start("--backend", "bwrap", "--pool-size", "0")  # ready once it has reaped
    assert not folder.exists(), "the dead service's sandbox was not reaped"
    async with SandboxClient(second.url) as client:
        # The new service does not know the old sandbox: a client holding it learns it is lost.
        sandbox.client = client
        with pytest.raises(SandboxLost):
            await sandbox.exec(["true"])
