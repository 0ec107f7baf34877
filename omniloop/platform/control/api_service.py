"""The api role: the REST API and the dashboard of a run, as a Ray Serve deployment.

Each `ApiServer` replica is the app `omniloop serve` builds (`/v1`, `/metrics`, the dashboard)
over the run's store, with the run's engines at `/v1/rollout/engines` and in `/metrics`
(`engine_routes`), and OpenAI-compatible chat completions (`/v1/chat/completions`,
`omniloop.gateway`) sampled by the engines in the run's rotation (the current policy; sessions
live in the replica's memory), behind Ray Serve's HTTP proxy on
`services.api_host:services.api_port`. It runs no episodes of its own (`concurrency: 0`;
submitted episodes stay queued for an `omniloop serve` that shares the store) and leaves the
store's queue alone at start-up. Apart from adding, launching and removing engines it only
reads: a replica that dies costs nothing but the requests it was answering (and its gateway
sessions), which the proxy answers 503 until Serve has replaced it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omniloop.gateway.completions import Gateway
from omniloop.platform.control.run_config import RunConfig


class ApiServer:
    """An api replica (wrapped by `serve.ingress()` when deployed)."""

    def __init__(self, config: RunConfig, token: str | None, cwd: str, paths: list[str]) -> None:
        from sqlalchemy import create_engine

        from omniloop.platform.api.settings import ApiSettings
        from omniloop.platform.control.replica import enter_run_folder

        # The run's model may be a path relative to the controller's folder.
        enter_run_folder(cwd, paths)

        self._settings = ApiSettings.model_validate(
            {
                "host": config.services.api_host,
                "db_url": config.database,
                "api_token": token,
                "concurrency": 0,
                "recover_on_start": False,
            }
        )
        # `run` resolves the database before it deploys a role.
        assert config.database is not None
        self._ping = create_engine(config.database, pool_size=1, max_overflow=0)
        self._config, self._cwd, self._paths = config, cwd, paths

    def __serve_build_asgi_app__(self) -> Any:
        from omniloop.platform.api.app import create_app
        from omniloop.platform.api.cli import web_routes
        from omniloop.platform.control.deployments import ServeEngineLauncher
        from omniloop.platform.control.engine_routes import RunEnginesCollector, engine_router

        launcher = ServeEngineLauncher(self._config, self._cwd, self._paths)
        return create_app(
            self._settings,
            extra_routes=[engine_router(launcher), *web_routes()],
            scraped=[RunEnginesCollector()],
            gateway=FirstCallGateway(self._run_gateway),
        )

    def _run_gateway(self) -> Gateway:
        """Completions from the engines the actor's coordinator keeps at the current weights."""
        from omniloop.inference.models import load_tokenizer
        from omniloop.platform.control.deployments import run_engines

        model, max_context = self._config.model, self._config.rollout.max_context
        tokenizer = load_tokenizer(model)
        return Gateway(run_engines(self._config), tokenizer, model=model, max_context=max_context)

    async def check_health(self) -> None:
        # What the replica needs beyond its process: the store answers.
        import asyncio

        from sqlalchemy import text

        def ping() -> None:
            with self._ping.connect() as connection:
                connection.execute(text("SELECT 1"))

        await asyncio.to_thread(ping)


class FirstCallGateway:
    """`Routes` (`omniloop.gateway.app`) to one gateway, built by the first call that needs it.

    The run's gateway loads the model's tokenizer (transformers: seconds of CPU) which most
    runs never use; built at start-up, it slowed every other role starting beside it. The
    first completion waits for it instead (the replica's event loop too, once). The replica's
    token guard decides who may call before routing."""

    def __init__(self, build: Callable[[], Gateway]) -> None:
        self._build = build
        self._gateway: Gateway | None = None

    def gateway_for(self, session_id: str | None) -> Gateway | None:
        if self._gateway is None:
            self._gateway = self._build()
        return self._gateway

    def authorized(self, session_id: str | None, authorization: str) -> bool:
        return True
