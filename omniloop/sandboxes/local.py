"""Sandbox providers over sandboxd: a running one (`RemoteSandboxes`), or one of the process's
own (`LocalSandboxd`), so that the process running episodes never creates sandboxes itself.

`LocalSandboxd` starts sandboxd as a child process on its first `acquire`: on loopback, on a
socket the parent bound (no port race), with a bearer token made for it, and with the
config's backend, image, limits and warm pool. The child is sent SIGKILL by the kernel when the
thread that started it ends (the event loop's), so it never outlives a parent that was killed;
its bwrap sandboxes die with it and the next sandboxd's start-up reaper removes what they left
(Docker containers included). `aclose` stops it with SIGTERM, which removes every sandbox.

An episode whose sandboxd died sees `SandboxLost` (a `SandboxError`): it is recorded as
`sandbox_error`, and the next `acquire` starts a new child.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from omniloop.errors import SandboxError
from omniloop.processes import dying_with_parent, stop_process
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.remote import SandboxClient

_SETTINGS_ENV = "OMNILOOP_SANDBOXD_SETTINGS"
_FD_ENV = "OMNILOOP_SANDBOXD_FD"
TOKEN_ENV = "OMNILOOP_SANDBOXD_TOKEN"
"""Where a sandboxd's bearer token is read from (the `serve` command and `sandbox.service`)."""


class RemoteSandboxes:
    """The `SandboxProvider` over one sandboxd: `acquire` creates a sandbox there with `config`,
    `release` removes it (the service's warm pool refills)."""

    def __init__(self, client: SandboxClient, config: SandboxConfig) -> None:
        self.client = client
        self._config = config

    async def acquire(self) -> Sandbox:
        return await self.client.create(self._config)

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.close()

    async def aclose(self) -> None:
        await self.client.aclose()


class LocalSandboxd:
    """The `SandboxProvider` over a sandboxd child process of this one (module docstring)."""

    def __init__(
        self,
        config: SandboxConfig,
        *,
        log_path: Path | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        if config.backend == "auto":
            raise ValueError("LocalSandboxd needs a resolved backend, not `auto`")
        self._config = config
        self._log_path = log_path
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._sandboxes: RemoteSandboxes | None = None
        self._retired: list[RemoteSandboxes] = []
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The child's process id once started."""
        return None if self._proc is None else self._proc.pid

    async def acquire(self) -> Sandbox:
        return await (await self._started()).acquire()

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.close()

    async def aclose(self) -> None:
        """Stop the child (SIGTERM: it removes every sandbox first)."""
        async with self._lock:
            for sandboxes in [*self._retired, *([self._sandboxes] if self._sandboxes else [])]:
                await sandboxes.aclose()
            self._sandboxes, self._retired = None, []
            proc, self._proc = self._proc, None
        if proc is not None:
            await asyncio.to_thread(_stop, proc)

    async def __aenter__(self) -> LocalSandboxd:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _started(self) -> RemoteSandboxes:
        async with self._lock:
            if self._sandboxes is None or (
                self._proc is not None and self._proc.poll() is not None
            ):
                self._sandboxes = await self._start()
            return self._sandboxes

    async def _forget(self, sandboxes: RemoteSandboxes) -> None:
        async with self._lock:
            if (
                self._sandboxes is sandboxes
                and self._proc is not None
                and self._proc.poll() is None
            ):
                return  # the service still runs: the loss was of one request, not of it
            if self._sandboxes is sandboxes:
                self._sandboxes = None

    async def _start(self) -> RemoteSandboxes:
        if self._proc is not None:
            await asyncio.to_thread(_stop, self._proc)
        self._proc, url, token = await start_sandboxd(
            self._config,
            host="127.0.0.1",
            log_path=self._log_path,
            startup_timeout=self._startup_timeout,
        )
        return RemoteSandboxes(SandboxClient(url, token=token), self._config)


async def start_sandboxd(
    config: SandboxConfig,
    *,
    host: str,
    log_path: Path | None = None,
    startup_timeout: float = 60.0,
) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start sandboxd as a child process serving `config`'s backend, image, limits and warm
    pool on `host`, on a socket bound here (no port race), with a bearer token made for it;
    return it once ready, with its URL and token. Call it from the thread the child should
    die with (an event loop's): the kernel sends the child SIGKILL when that thread ends."""
    from omniloop.sandboxes.service import SandboxdSettings

    if config.backend == "auto":
        raise ValueError("sandboxd needs a resolved backend, not `auto`")
    token = secrets.token_urlsafe(24)
    settings = SandboxdSettings(
        host=host,
        port=0,
        token=token,
        default_image=config.image,
        default_backend=config.backend,
        limits=config.limits,
        pool_size=config.pool_size,
        pool_images=[config.image] if config.pool_size else [],
    )
    with socket.socket() as listener:
        listener.bind((host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        env = {
            **os.environ,
            _SETTINGS_ENV: settings.model_dump_json(),
            _FD_ENV: str(listener.fileno()),
        }
        command = [sys.executable, "-m", "omniloop.sandboxes.local"]
        if log_path is not None:
            with log_path.open("ab") as log:
                proc = _spawn(command, env, listener.fileno(), log)
        else:
            proc = _spawn(command, env, listener.fileno(), None)
    url = f"http://{host}:{port}"
    await _wait_ready(url, proc, startup_timeout, log_path)
    return proc, url, token


async def _wait_ready(
    url: str, proc: subprocess.Popen[bytes], timeout: float, log_path: Path | None
) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            if proc.poll() is not None:
                where = f"; see {log_path}" if log_path else ""
                raise SandboxError(f"sandboxd exited with {proc.returncode} while starting{where}")
            try:
                response = await http.get(f"{url}/readyz")
                if response.status_code == 200:
                    return
                why = response.text[:300]
            except httpx.HTTPError as err:
                why = repr(err)
            if time.monotonic() > deadline:
                await asyncio.to_thread(_stop, proc)
                raise SandboxError(f"sandboxd at {url} was not ready after {timeout:.0f}s: {why}")
            await asyncio.sleep(0.1)


def _spawn(
    command: list[str], env: dict[str, str], fd: int, log: IO[bytes] | None
) -> subprocess.Popen[bytes]:
    # Without a log, warnings go to this process's stderr.
    return subprocess.Popen(
        dying_with_parent(command),
        env=env,
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL if log is None else log,
        stderr=log,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, grace=20.0)


def main() -> None:
    """The child's side: serve the settings and socket the parent handed over."""
    from omniloop.sandboxes.service import SandboxdSettings, serve

    settings = SandboxdSettings.model_validate_json(os.environ.pop(_SETTINGS_ENV))
    serve(settings, fd=int(os.environ.pop(_FD_ENV)), log_level="warning")


if __name__ == "__main__":
    main()
