"""The sandbox role: sandboxd as a Ray Serve deployment, and the rollout's side of it.

Each `SandboxServer` replica launches one sandboxd (`sandboxes/service.py`: its warm pools,
reaper, exactly-once `exec`) as a child process, as an engine replica launches its engine, on
a port of its own node, behind a bearer token made for it; the replica reports its health and
hands out its endpoint. sandboxd is the only process of a run that creates sandboxes (Docker,
gVisor or bwrap). It runs in a process of its own rather than in the replica's event loop,
which it would share with Ray's and Serve's threads: there, in the toy run's bursts of 32
episodes on 2 cores, a tool call (sandbox created, command run) took 0.65-0.73 s at the median,
against 0.45 s from a process of its own. A rollout replica asks the deployment for an
`endpoint` (Ray Serve picks a live replica), creates the sandbox there, and from then on talks
to that sandboxd directly over HTTP (`RemoteSandbox`): a sandbox lives in one replica's
sandboxd, which a handle call could not be pinned to.

What a dead replica costs: its sandboxd dies with it (the kernel's parent-death signal), and
the sandboxes with sandboxd (bwrap's die-with-parent; Docker containers are removed by the
replacement's start-up reaper, which finds their owner gone).
An episode that was using one sees `SandboxLost`, and the rollout re-runs it from the start as
`attempt + 1` under the same trajectory id (`EpisodeRunner.run`). An episode that asks for a
sandbox while no replica answers waits up to `services.sandbox_wait_s` for the replacement.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
from ray.serve.handle import DeploymentHandle

from omniloop.errors import SandboxLost
from omniloop.platform.control.run_config import RunConfig
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.remote import SandboxClient

_START_TIMEOUT_S = 60.0


class SandboxServer:
    """A sandbox replica: launches one sandboxd, reachable at `endpoint()`, and dies with it."""

    async def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:  # type: ignore[misc]
        import ray

        from omniloop.platform.control.replica import enter_run_folder
        from omniloop.sandboxes.factory import resolve_backend
        from omniloop.sandboxes.local import start_sandboxd

        enter_run_folder(cwd, paths)
        sandbox = config.rollout.sandbox
        resolved = sandbox.model_copy(update={"backend": resolve_backend(sandbox)})
        # Started from this (the replica's event-loop) thread: sandboxd, and with it every
        # sandbox, dies with the replica.
        self._proc, self._url, self._token = await start_sandboxd(
            resolved,
            host=ray.util.get_node_ip_address(),
            log_path=Path(config.run_dir) / "sandboxd.log",
            startup_timeout=_START_TIMEOUT_S,
        )
        self._http = httpx.AsyncClient(base_url=self._url, timeout=10.0)

    async def endpoint(self) -> tuple[str, str]:
        """This replica's sandboxd: its URL and bearer token."""
        return self._url, self._token

    async def check_health(self) -> None:
        # Through HTTP, as clients see it: the process answers and the backend can run.
        if self._proc.poll() is not None:
            raise RuntimeError(f"sandboxd exited with {self._proc.returncode}")
        response = await self._http.get("/readyz")
        if response.status_code != 200:
            raise RuntimeError(f"sandboxd is not ready: {response.text[:300]}")

    async def __del__(self) -> None:
        # Serve's graceful stop: SIGTERM, on which sandboxd closes every sandbox and pool.
        from omniloop.processes import stop_process

        if not hasattr(self, "_http"):
            return  # the constructor failed: no sandboxd was started
        await asyncio.to_thread(stop_process, self._proc, 20.0)
        await self._http.aclose()


class ServiceSandboxes:
    """The `SandboxProvider` of a rollout replica: sandboxes from the sandbox role.

    `acquire` creates the sandbox at a live replica's endpoint, which it asks the deployment
    for at most every `ENDPOINT_REUSE_S` (a step's burst of episodes costs one Serve call, which
    the acquires that arrive while it is under way share, and sandboxes still spread over the
    replicas), waiting up to `wait_s` while no replica answers (one is being replaced).
    `release` removes the sandbox (the replica's warm pool refills).
    One HTTP client per replica endpoint is kept; one that reported its replica lost is no
    longer handed out (sandboxes still holding it fail with `SandboxLost` too) and is closed
    with the provider.
    """

    ENDPOINT_REUSE_S = 2.0

    def __init__(self, handle: DeploymentHandle, config: SandboxConfig, wait_s: float) -> None:
        self._handle = handle
        self._config = config
        self._wait_s = wait_s
        self._clients: dict[str, SandboxClient] = {}
        self._retired: list[SandboxClient] = []
        self._latest: tuple[SandboxClient, float] | None = None
        """The client of the endpoint the deployment named last, and when (monotonic)."""
        self._asking: asyncio.Future[tuple[str, str]] | None = None
        """The Serve call for an endpoint under way, which concurrent acquires share."""

    async def acquire(self) -> Sandbox:
        deadline = time.monotonic() + self._wait_s
        while True:
            client: SandboxClient | None = None
            try:
                client = await self._client(max(1.0, deadline - time.monotonic()))
                return await client.create(self._config)
            except SandboxLost:
                if client is not None:
                    self._forget(client)
                if time.monotonic() > deadline:
                    raise
            except Exception as err:
                # The deployment itself did not answer (its only replica is down).
                from omniloop.platform.control.deployments import classify_failure

                if classify_failure(err) is None and not isinstance(err, TimeoutError):
                    raise
                if time.monotonic() > deadline:
                    raise SandboxLost(
                        f"no sandbox replica answered within services.sandbox_wait_s="
                        f"{self._wait_s:g}s: {err}"
                    ) from err
            await asyncio.sleep(0.5)

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.close()

    async def _client(self, timeout: float) -> SandboxClient:
        if self._latest is not None and time.monotonic() - self._latest[1] < self.ENDPOINT_REUSE_S:
            return self._latest[0]
        # One question at a time: the episodes of a burst that all find the endpoint stale
        # wait for the same answer instead of each sending a Serve call.
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(_awaited(self._handle.endpoint.remote()))
            # Retrieved here too, for when every waiter gave up before the call failed.
            self._asking.add_done_callback(lambda task: task.cancelled() or task.exception())
        url, token = await asyncio.wait_for(asyncio.shield(self._asking), timeout)
        client = self._clients.get(url) or SandboxClient(url, token=token)
        self._clients[url] = client
        self._latest = (client, time.monotonic())
        return client

    def _forget(self, client: SandboxClient) -> None:
        if self._latest is not None and self._latest[0] is client:
            self._latest = None
        if self._clients.get(client.base_url) is client:
            del self._clients[client.base_url]
            self._retired.append(client)

    async def aclose(self) -> None:
        """Close every client (the sandboxes are the service's to close)."""
        clients = [*self._clients.values(), *self._retired]
        self._clients, self._retired = {}, []
        for client in clients:
            await client.aclose()


async def _awaited(response: Any) -> Any:
    """A Serve response as a coroutine (`asyncio.wait_for` takes awaitables it can cancel)."""
    return await response
