"""Start a local CPU engine as a subprocess, for runs that are not given an engine URL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from omniloop.errors import EngineError
from omniloop.modalities.config import MediaConfig
from omniloop.processes import dying_with_parent, free_port, stop_process


def engine_command(
    model: str,
    port: int,
    threads: int | None = None,
    media: MediaConfig | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The argv that serves `model` on `host:port` with this interpreter (with `media`, the
    media settings the prompts' placeholder blocks are counted with, inline as JSON)."""
    # `omniloop engine serve`, through the engine's own command module: `omniloop`'s entry
    # point imports every component's commands first (the REST API's: over a second of CPU).
    argv = [sys.executable, "-m", "omniloop.inference.cli", "serve", "--model", model]
    argv += ["--host", host, "--port", str(port)]
    if threads:
        argv += ["--threads", str(threads)]
    if media is not None and media != MediaConfig():
        argv += ["--media", media.model_dump_json()]
    return argv


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Block until `url/health` answers 200; raise `EngineError` if the process dies first."""
    deadline = time.monotonic() + timeout
    # One client for every poll: building one costs ~30 ms of CPU (its TLS context), and an
    # engine is polled five times a second while it starts, beside the run's other processes.
    with httpx.Client(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineError(
                    f"engine process exited with {proc.returncode} before it was healthy"
                )
            with contextlib.suppress(httpx.HTTPError):
                if http.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise EngineError(f"engine at {url} was not healthy after {timeout:.0f}s")


def spawn_engine(
    model: str,
    *,
    threads: int | None = None,
    log_path: Path | None = None,
    die_with_parent: bool = False,
    media: MediaConfig | None = None,
    host: str = "127.0.0.1",
) -> tuple[subprocess.Popen[bytes], str]:
    """Start serving `model` in a child process (not yet healthy: see `wait_healthy`).

    `die_with_parent`: the child is killed when the thread that spawns it ends, so an engine
    started by a role's replica goes down with it even when the replica is SIGKILLed; spawn
    from a thread that lives as long as the engine should (an event loop's).
    `host`: the interface it listens on, and the address in its URL.
    """
    port = free_port()
    url = f"http://{host}:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = engine_command(model, port, threads, media, host)
    if die_with_parent:
        command = dying_with_parent(command)
    if log_path is None:
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
    else:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    return proc, url


def start_engine(
    model: str,
    *,
    threads: int | None = None,
    log_path: Path | None = None,
    timeout: float = 180,
    media: MediaConfig | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start serving `model` in a child process and wait until it is healthy."""
    proc, url = spawn_engine(model, threads=threads, log_path=log_path, media=media)
    try:
        wait_healthy(url, proc, timeout)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


@contextlib.asynccontextmanager
async def local_engine(
    model: str,
    *,
    threads: int | None = None,
    log_path: Path | None = None,
    startup_timeout: float = 180,
    media: MediaConfig | None = None,
) -> AsyncIterator[str]:
    """Serve `model` in a child process for the duration of the block; yields its base URL."""
    proc, url = await asyncio.to_thread(
        start_engine,
        model,
        threads=threads,
        log_path=log_path,
        timeout=startup_timeout,
        media=media,
    )
    try:
        yield url
    finally:
        await asyncio.to_thread(stop_process, proc)
