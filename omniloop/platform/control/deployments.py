"""How the run's roles become Ray Serve deployments, how they reach the run's engines, and what
a Serve call's failure means.

Shared by the controller (`services.service_roles`), the api replica (which launches engines
on request, and whose gateway samples from the run's engines) and the rollout replicas (which
sample from them, and whose sandbox calls classify their failures), so it imports no role's
code but the engine's light front (`engine_service.EngineServer`): the api replica runs
without torch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ray import serve
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ActorUnschedulableError,
    RayActorError,
)
from ray.serve import Application
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

from omniloop.errors import RoleLost
from omniloop.inference.router import EngineRouter
from omniloop.platform.control.engine_service import EngineServer
from omniloop.platform.control.faults import Failure
from omniloop.platform.control.run_config import RunConfig

SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
"""Serve logs a line per request at INFO; the run's console keeps to one line per step. Each
replica still writes its own log file under the Ray session's `logs/serve/`."""


def classify_failure(err: BaseException) -> tuple[Failure, str] | None:
    """A Serve call's failure as the role's (`busy`: refused; `lost`: its replica is gone, or
    a replica of a role the work used is: `RoleLost`, such as the rollout's `SandboxLost`)."""
    if isinstance(err, BackPressureError):
        return "busy", ""
    if isinstance(err, RoleLost):
        return "lost", ""
    if isinstance(
        err, ActorDiedError | ActorUnavailableError | RayActorError | ActorUnschedulableError
    ):
        actor_id = getattr(err, "actor_id", None) or ""
        return "lost", str(actor_id)
    if isinstance(err, ReplicaUnavailableError | DeploymentUnavailableError):
        return "lost", ""
    return None


def role_options(config: RunConfig, role: str) -> dict[str, Any]:
    """The deployment options of `role`'s replicas: queue bound, health checks, placement."""
    settings = config.services
    where = settings.placement.get(role)  # type: ignore[call-overload]
    # No CPU reserved: the roles share the machine's cores with the engine.
    options: dict[str, Any] = {"num_cpus": 0}
    if where is not None and where.resources:
        options["resources"] = dict(where.resources)
    out: dict[str, Any] = {
        "max_queued_requests": settings.max_queued_requests,
        "health_check_period_s": settings.health_check_period_s,
        "health_check_timeout_s": settings.health_check_timeout_s,
        # A stopping replica sleeps this long before it first counts its requests, and again
        # while any runs (Serve's default: 2 s): an idle replica of a run that ends or a role
        # that is removed stops at once, a busy one still finishes its requests.
        "graceful_shutdown_wait_loop_s": 0.2,
        "ray_actor_options": options,
    }
    if where is not None and where.max_replicas_per_node is not None:
        out["max_replicas_per_node"] = where.max_replicas_per_node
    return out


def engine_deployment(
    config: RunConfig, cwd: str, paths: list[str], *, replicas: int = 1
) -> Application:
    """`replicas` engine replicas (`EngineServer`), each launching or adopting one engine."""
    return serve.deployment(
        name="engine",
        num_replicas=replicas,
        max_ongoing_requests=1024,
        **role_options(config, "engine"),
    )(EngineServer).bind(config, str(Path(config.run_dir).resolve()), cwd, paths)


LAUNCHED = "engine+"
"""Prefix of the Serve applications of engines launched on request (`engine+1`, ...)."""
LAUNCHED_URL_TIMEOUT_S = 10.0
"""How long a launched engine's replica has to tell its URL when one is being removed."""


class ServeEngineLauncher:
    """Launches engines for a running run, each as a Serve application of its own (`engine+N`,
    one `EngineServer` replica on the engine role's placement), and undeploys them.

    Used from the run's api role. The replica attaches its engine to the actor before it
    is up, so a launched engine is in rotation, with the current weights, once `launch`
    returns. What it launched is read back from Serve each time (no state of its own), so an
    api replica that restarted still finds the engines launched before. The health monitor
    follows each application from its first healthy poll (a fault of role `engine+N` while it
    is down); Serve restarts a replica that fails."""

    def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:
        self._unusable = (
            "the run adopts the engine at rollout.engine.url; it launches none"
            if config.rollout.engine.url
            else None
        )
        self._config, self._cwd, self._paths = config, cwd, paths

    async def launch(self) -> str:
        """Start one more engine; its URL once it serves the current weights. Raises
        `EngineError` when it cannot (its application is removed again)."""
        from omniloop.errors import EngineError

        if self._unusable is not None:
            raise EngineError(self._unusable)
        taken = {int(n[len(LAUNCHED) :]) for n in self._launched() if n[len(LAUNCHED) :].isdigit()}
        name = f"{LAUNCHED}{max(taken, default=0) + 1}"
        app = engine_deployment(self._config, self._cwd, self._paths)
        try:
            handle = await asyncio.to_thread(
                serve.run, app, name=name, route_prefix=None, logging_config=SERVE_LOGGING
            )
            url: str = await handle.url.remote()
        except Exception as err:
            await asyncio.to_thread(serve.delete, name)
            raise EngineError(f"launching an engine ({name}) failed: {err}") from err
        return url

    async def stop(self, url: str) -> bool:
        """Undeploy the launched engine at `url`; False if none of them is at `url`."""
        for name in self._launched():
            try:
                # A replica that is not up would hold the call until Serve replaces it.
                served: str = await asyncio.wait_for(
                    serve.get_app_handle(name).url.remote(), LAUNCHED_URL_TIMEOUT_S
                )
            except Exception:  # not (yet, or no longer) up: not the one asked for
                continue
            if served == url:
                await asyncio.to_thread(serve.delete, name)
                return True
        return False

    @staticmethod
    def _launched() -> list[str]:
        return [n for n in serve.status().applications if n.startswith(LAUNCHED)]


def run_engines(config: RunConfig) -> EngineRouter:
    """An `Engine` over the run's rotation: the engines the actor's coordinator has given the
    current weights. While the actor is not up, calls wait (`services.engine_wait_s`) for it.
    Inside the run's Ray cluster only."""
    from ray import serve

    from omniloop.inference.models import resolve_model
    from omniloop.platform.control.rollout import media_encoder

    actor: Any = None

    async def rotation() -> list[str]:
        nonlocal actor
        if actor is None:
            try:
                actor = serve.get_app_handle("actor")
            except Exception:  # not deployed yet: no engine to send to
                return []
        urls: list[str] = await actor.engine_urls.remote()
        return urls

    rollout = config.rollout
    encoder = media_encoder(rollout.engine, resolve_model(config.model), rollout.media)
    return EngineRouter(rotation, wait_s=config.services.engine_wait_s, media_encoder=encoder)
