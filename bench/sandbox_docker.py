"""Sandbox start-up and exec latency, per backend; prints ONE JSON line.

Per backend (`docker`, `gvisor` where runsc is registered, `bwrap` through the factory):

- cold_p50_ms / cold_p99_ms: create and start one sandbox (nothing pooled), and cold_ratio:
  that p50 over the p50 of `docker run --rm` of the same image (runsc for gvisor; the docker
  image for bwrap), which also starts a container and runs a command in it. Target <= 1.2.
- warm_p50_ms: `SandboxPool.acquire` from a filled pool. Target <= 5 ms.
- exec_p50_ms and exec_ratio: one `true` through sandboxd (`RemoteSandbox.exec`, HTTP) over a
  raw `docker exec` of the same profile (bwrap: its own in-process exec, no service). Target
  <= 1.5.
- execs_per_s: tool executions per second sustained by 32 concurrent episodes, each running
  `echo` in a loop in its own sandbox (through sandboxd for docker/gvisor).

Needs a Docker daemon (`DOCKER_HOST`) and the sandbox image (`omniloop sandbox build`). The
machine may be shared: numbers are noisy; CPU seconds of this process are reported beside.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from omniloop.processes import free_port
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.docker import (
    DockerHost,
    create_docker_sandbox,
    docker_available,
    gvisor_available,
    host_config_for,
)
from omniloop.sandboxes.images import SANDBOX_IMAGE, build_sandbox_image
from omniloop.sandboxes.pool import SandboxPool
from omniloop.sandboxes.remote import SandboxClient

COLD_N = 10
WARM_N = 10
EXEC_N = 30
EPISODES = 32
SUSTAIN_S = 8.0
LIMITS = SandboxLimits(memory_mb=512, tmp_mb=64, workspace_mb=64, timeout=60)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def timed_cli(command: list[str], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.monotonic()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.monotonic() - start)
    return times


async def cold(create: Callable[[], Awaitable[Sandbox]]) -> list[float]:
    times = []
    for _ in range(COLD_N):
        start = time.monotonic()
        sandbox = await create()
        times.append(time.monotonic() - start)
        await sandbox.close()
    return times


async def warm(create: Callable[[], Awaitable[Sandbox]]) -> list[float]:
    times = []
    pool: SandboxPool[Sandbox] = SandboxPool(create, 2)
    try:
        await pool.start(wait=True)
        for _ in range(WARM_N):
            deadline = time.monotonic() + 60
            while pool.ready < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the pool did not refill within 60 s")
                await asyncio.sleep(0.02)
            start = time.monotonic()
            sandbox = await pool.acquire()
            times.append(time.monotonic() - start)
            await pool.release(sandbox)
    finally:
        await pool.close()
    return times


async def exec_times(sandbox: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.monotonic()
        result = await sandbox.exec(["true"])
        times.append(time.monotonic() - start)
        assert result.ok, result
    return times


async def sustained(sandboxes: list[Any]) -> float:
    count = 0
    deadline = time.monotonic() + SUSTAIN_S

    async def loop(sandbox: Any) -> None:
        nonlocal count
        while time.monotonic() < deadline:
            result = await sandbox.exec(["echo", "tool output"])
            assert result.ok, result
            count += 1

    start = time.monotonic()
    await asyncio.gather(*(loop(s) for s in sandboxes))
    return count / (time.monotonic() - start)


def start_sandboxd(backend: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "omniloop.sandboxes.docker_cli", "serve"]
    command += ["--port", str(port), "--backend", backend, "--pool-size", "0"]
    command += ["--max-concurrent-creates", "4", "--max-pending-creates", "64"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("sandboxd did not start")


def raw_exec_times(runtime: str | None, n: int) -> list[float]:
    """`docker exec` (the CLI) of `true` in a container of the same profile."""
    host = DockerHost()
    config = SandboxConfig(image=SANDBOX_IMAGE, limits=LIMITS)
    host_config = host_config_for(host.api, config, runtime=runtime, network_mode="none")
    labels = {"omniloop.sandbox": "1", "omniloop.expires_at": str(int(time.time() + 600))}
    container = host.api.create_container(
        SANDBOX_IMAGE,
        command=["sleep", "600"],
        user="65534:65534",
        host_config=host_config,
        labels=labels,
    )["Id"]
    try:
        host.api.start(container)
        return timed_cli(["docker", "exec", "-u", "1000:1000", container, "true"], n)
    finally:
        host.api.remove_container(container, force=True)
        host.close()


async def docker_backend(name: str) -> dict[str, Any]:
    runtime = "runsc" if name == "gvisor" else None
    config = SandboxConfig(backend=name, image=SANDBOX_IMAGE, limits=LIMITS)  # type: ignore[arg-type]
    host = await asyncio.to_thread(DockerHost)

    async def create() -> Sandbox:
        return await create_docker_sandbox(config, host=host)

    run_flags = ["--runtime", runtime] if runtime else []
    run = await asyncio.to_thread(
        timed_cli,
        ["docker", "run", "--rm", "--network", "none", *run_flags, SANDBOX_IMAGE, "true"],
        COLD_N,
    )
    cold_times = await cold(create)
    warm_times = await warm(create)
    host.close()
    raw = await asyncio.to_thread(raw_exec_times, runtime, EXEC_N)
    proc, url = await asyncio.to_thread(start_sandboxd, name)
    try:
        async with SandboxClient(url) as client:
            one = await client.create(config)
            await exec_times(one, 5)
            service = await exec_times(one, EXEC_N)
            await one.close()
            episodes = await asyncio.gather(*(client.create(config) for _ in range(EPISODES)))
            rate = await sustained(list(episodes))
            await asyncio.gather(*(s.close() for s in episodes))
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 60)
    return {
        "cold_p50_ms": ms(statistics.median(cold_times)),
        "cold_p99_ms": ms(p99(cold_times)),
        "docker_run_p50_ms": ms(statistics.median(run)),
        "cold_ratio": round(statistics.median(cold_times) / statistics.median(run), 2),
        "warm_p50_ms": ms(statistics.median(warm_times)),
        "exec_p50_ms": ms(statistics.median(service)),
        "raw_docker_exec_p50_ms": ms(statistics.median(raw)),
        "exec_ratio": round(statistics.median(service) / statistics.median(raw), 2),
        "execs_per_s": round(rate, 1),
    }


async def bwrap_backend(docker_run_p50: float | None, raw_exec_p50: float | None) -> Any:
    from omniloop.sandboxes.factory import create_sandbox

    config = SandboxConfig(backend="bwrap", limits=LIMITS)

    async def create() -> Sandbox:
        return await create_sandbox(config)

    try:
        cold_times = await cold(create)
    except Exception as err:  # report why this host cannot run it, keep the other numbers
        return {"error": f"{type(err).__name__}: {err}"}
    warm_times = await warm(create)
    one = await create()
    await exec_times(one, 5)
    direct = await exec_times(one, EXEC_N)
    await one.close()
    episodes = await asyncio.gather(*(create() for _ in range(EPISODES)))
    rate = await sustained(list(episodes))
    await asyncio.gather(*(s.close() for s in episodes))
    out: dict[str, Any] = {
        "cold_p50_ms": ms(statistics.median(cold_times)),
        "cold_p99_ms": ms(p99(cold_times)),
        "warm_p50_ms": ms(statistics.median(warm_times)),
        "exec_p50_ms": ms(statistics.median(direct)),
        "execs_per_s": round(rate, 1),
        "note": "in-process (no service); ratios against docker run --rm / raw docker exec",
    }
    if docker_run_p50:
        out["cold_ratio"] = round(statistics.median(cold_times) / docker_run_p50, 2)
    if raw_exec_p50:
        out["exec_ratio"] = round(statistics.median(direct) / raw_exec_p50, 2)
    return out


async def main() -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "sandbox_docker", "cpus": os.cpu_count()}
    if not docker_available():
        result["error"] = "no Docker daemon at DOCKER_HOST"
    else:
        host = await asyncio.to_thread(DockerHost)
        await asyncio.to_thread(build_sandbox_image, host.api)
        host.close()
        result["docker"] = await docker_backend("docker")
        if gvisor_available():
            result["gvisor"] = await docker_backend("gvisor")
        else:
            result["gvisor"] = {"error": "runsc is not registered with the Docker daemon"}
    run = result.get("docker", {}).get("docker_run_p50_ms")
    raw = result.get("docker", {}).get("raw_docker_exec_p50_ms")
    if shutil.which("bwrap"):
        result["bwrap"] = await bwrap_backend(
            run / 1000 if run else None, raw / 1000 if raw else None
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 1)
    return result


if __name__ == "__main__":
    started = time.monotonic()
    report = asyncio.run(main())
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
