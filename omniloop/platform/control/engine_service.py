"""The engine role: each inference engine fronted by a replica of the `engine` deployment.

An engine is a server process of its own (omniloop's CPU engine, or SGLang); an
`EngineServer` replica launches one (the run's model, `rollout.engine.threads`) or adopts the
one at `rollout.engine.url`, reports its health to Ray Serve (`check_health`: the process is
alive and `/health` answers), and before it serves registers the engine with the actor, which
gives it the current weights (`WeightCoordinator.attach`). An engine it launched dies with it
(`spawn_engine(die_with_parent=True)`), so a SIGKILLed replica leaves no engine behind, and its
replacement launches a fresh one that gets the current weights before its first request.

Rollout replicas reach engines through an `EngineRouter` (`omniloop.inference.router`) over
the actor's rotation (the engines that serve the current weights) and send `/generate` there
directly (tokens do not travel through Serve), keeping each episode on one engine. When an
engine stops answering (its process died, its replica was replaced), the request goes to
another engine in rotation, or waits for the replacement to attach, for up to
`services.engine_wait_s`; sampling is idempotent (a failed request returned no tokens). Past
that wait the request fails as `EngineError`, the episode is `engine_error`, and the run's
infra-error bound decides.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx

from omniloop.inference.client import EngineClient
from omniloop.platform.control.run_config import RunConfig

REGISTRATION_CHECK_S = 2.0
"""How often an engine replica checks that the actor still has its engine attached."""

log = logging.getLogger(__name__)


class EngineServer:
    """An engine replica: launches or adopts one engine and registers it with the actor."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, config: RunConfig, log_dir: str, cwd: str, paths: list[str]
    ) -> None:
        import ray
        from ray import serve

        from omniloop.platform.control.engines import spawn_engine, wait_healthy
        from omniloop.platform.control.replica import enter_run_folder
        from omniloop.processes import stop_process

        enter_run_folder(cwd, paths)
        settings = config.rollout.engine
        self._stop = stop_process
        self._proc = None
        # One client for the replica's health checks: a new one costs ~30 ms of CPU each time.
        self._http = httpx.AsyncClient(timeout=10.0)
        if settings.url:
            self._url = settings.url.rstrip("/")
        else:
            # Spawned from this (the replica's event-loop) thread: the engine dies with it.
            # On the node's address: the rollouts may run on other nodes of the cluster.
            self._proc, self._url = spawn_engine(
                config.model,
                threads=settings.threads,
                log_path=Path(log_dir) / "engine.log",
                die_with_parent=True,
                media=config.rollout.media,
                host=ray.util.get_node_ip_address(),
            )
            await asyncio.to_thread(wait_healthy, self._url, self._proc, settings.startup_timeout)
        async with EngineClient(self._url) as engine:
            served = await engine.get_weight_version()
        # Before this replica serves: the engine gets the actor's current weights.
        self._actor = serve.get_app_handle("actor")
        await self._actor.attach_engine.remote(self._url, served)
        # An actor restored after a death has no engines: attach again whenever it lacks us.
        self._registration = asyncio.create_task(self._keep_registered())

    async def url(self) -> str:
        return self._url

    async def _keep_registered(self) -> None:
        while True:
            await asyncio.sleep(REGISTRATION_CHECK_S)
            try:
                if not await self._actor.serves.remote(self._url):
                    async with EngineClient(self._url) as engine:
                        served = await engine.get_weight_version()
                    await self._actor.attach_engine.remote(self._url, served)
            except Exception as err:  # the actor is down or busy: ask again later
                log.debug("engine %s: registration check failed: %r", self._url, err)

    async def check_health(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"engine process exited with {self._proc.returncode}")
        response = await self._http.get(f"{self._url}/health")
        if response.status_code != 200:
            raise RuntimeError(f"engine {self._url} answered /health with {response.status_code}")

    async def __del__(self) -> None:
        await self._http.aclose()
        if self._proc is not None:
            await asyncio.to_thread(self._stop, self._proc)
