"""`create_app`: the REST server as one FastAPI application.

What the lifespan does, in order: migrate the store's schema, put episodes a dead server left
`running` back in the queue (`recover_on_start`), start the episode worker (which starts or
connects to the engine and fills the sandbox pool in the background, so `/healthz` answers at
once and `/readyz` reports `starting` meanwhile). On shutdown the worker stops first (running
episodes go back to the queue), then the store closes if the app opened it.

Extra routes (the dashboard): pass them as `extra_routes`; they are added after the API's, so
`/v1/...`, `/healthz`, `/readyz`, `/metrics` and `/openapi.json` always win, e.g.

    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles
    create_app(settings, extra_routes=[Mount("/", StaticFiles(directory=..., html=True))])

An `APIRouter` in `extra_routes` is included (its routes appear in the OpenAPI document); any
other Starlette route (a `Mount`, a `Route`) is appended as is. `omniloop serve` mounts
`omniloop.web.routes()` when the web package provides that function (see `cli.py`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute

import omniloop
from omniloop.gateway.app import Routes, gateway_router
from omniloop.platform.api.auth import AccessPolicy, TokenGuardMiddleware
from omniloop.platform.api.batching import EpisodeCreator
from omniloop.platform.api.events import EpisodeSignals
from omniloop.platform.api.gateway import WorkerGateway
from omniloop.platform.api.limits import BodyLimitMiddleware
from omniloop.platform.api.metrics import ApiMetrics, RequestMetricsMiddleware, ScrapedCollector
from omniloop.platform.api.problems import Problem, install_problem_handlers, problem_responses
from omniloop.platform.api.routes import ApiState, ops_router, v1_router
from omniloop.platform.api.settings import ApiLimits, ApiSettings
from omniloop.platform.api.worker import EpisodeWorker, load_agents
from omniloop.platform.store import AsyncStore, Store

logger = logging.getLogger(__name__)

DESCRIPTION = """\
omniloop's REST API: submit agent episodes that run through the training rollout path, follow
them live (Server-Sent Events), and browse runs, episodes and metrics.

Errors are RFC 9457 problem documents (`application/problem+json`). Lists are keyset-paginated
(`cursor` + `limit`; follow `next`). When the server has a token, every POST needs
`Authorization: Bearer <token>`; on a server bound beyond loopback, so does every `/v1` request
(reads and event streams included), and `/metrics` unless the server turned that off. The
operations that need it here are marked with the bearer scheme.
"""


def create_app(
    settings: ApiSettings,
    *,
    store: Store | None = None,
    extra_routes: Sequence[APIRouter | BaseRoute] = (),
    scraped: Sequence[ScrapedCollector] = (),
    gateway: Routes | None = None,
) -> FastAPI:
    """The API server for `settings`.

    `store`: use this store (the caller closes it) instead of opening `settings.db_url`.
    `extra_routes`: routers and mounts served beside the API (see the module docstring).
    `scraped`: more series for `/metrics`, each refreshed before a scrape (`metrics.py`).
    `gateway`: where OpenAI-compatible completions go (`omniloop.gateway.app.Routes`); None:
    to the episode worker's engine (`gateway.py`), when `settings.gateway` is on.
    Agents are imported here, so a bad agent or reward path raises `ConfigError` before the
    server starts.
    """
    agents = load_agents(settings)
    own_store = store is None
    sync_store = store if store is not None else Store(settings.db_url)
    state = ApiState(
        settings=settings,
        store=AsyncStore(sync_store),
        agents=agents,
        signals=EpisodeSignals(),
        metrics=ApiMetrics(scraped),
        head_revision=Store.head_revision(),
        creator=EpisodeCreator(sync_store, max_queued=settings.max_queued_episodes),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker: EpisodeWorker | None = None
        try:
            await state.store.migrate()
            if settings.recover_on_start:
                requeued = await state.store.requeue_running_episodes()
                if requeued:
                    logger.warning(
                        "requeued %d episodes a stopped server left running", len(requeued)
                    )
            worker = EpisodeWorker(state.store, settings, agents, state.signals, state.metrics)
            worker.start()
            state.worker = worker
            yield
        finally:
            if worker is not None:
                await worker.stop()
            if own_store:
                await state.store.close()

    app = FastAPI(
        title="omniloop",
        version=omniloop.__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.omniloop = state
    app.include_router(v1_router())
    app.include_router(ops_router())
    if gateway is None and settings.gateway:
        gateway = WorkerGateway(lambda: state.worker)
    if gateway is not None:
        # OpenAI's API, documented by OpenAI: not in this server's OpenAPI document.
        app.include_router(gateway_router(gateway, include_in_schema=False))
    for route in extra_routes:
        if isinstance(route, APIRouter):
            app.include_router(route)
        else:
            app.router.routes.append(route)
    install_problem_handlers(app)
    # Starlette runs the middleware added last outermost: metrics see every request (401s and
    # 413s included), CORS answers preflights (and labels 401s, so a page can read them) before
    # the token guard looks, and the guard refuses a request before its body is read.
    policy = AccessPolicy.from_settings(settings)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(TokenGuardMiddleware, policy=policy)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            expose_headers=["Location", "Link", "Idempotent-Replayed"],
        )
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    _complete_openapi(app, sorted(agents), settings.limits, policy)
    return app


def _set_maximum(schema: dict[str, Any], maximum: int) -> None:
    """Lower the `maximum` of an integer schema (or of the integer branch of an `anyOf`)."""
    for branch in [schema, *schema.get("anyOf", [])]:
        if branch.get("type") == "integer":
            branch["maximum"] = min(branch.get("maximum", maximum), maximum)


def _complete_openapi(
    app: FastAPI, agent_names: list[str], limits: ApiLimits, policy: AccessPolicy
) -> None:
    """Add what only this server knows to the OpenAPI document: the `Problem` schema that
    error responses reference, its agents as the values `agent` may take (not where reads need
    the token: the document itself is open, and the agents are `GET /v1/agents`'s to tell),
    its limits, and the bearer scheme on every operation `policy` guards."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            _, definitions = models_json_schema(
                [(Problem, "serialization")], ref_template="#/components/schemas/{model}"
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(definitions.get("$defs", {}))
            request = components["EpisodeRequest"]["properties"]
            if agent_names and not policy.reads_need_token:
                request["agent"]["enum"] = agent_names
            _set_maximum(request["max_turns"], limits.max_turns)
            sampling = components["SamplingOptions"]["properties"]
            _set_maximum(sampling["max_new_tokens"], limits.max_new_tokens)
            _declare_auth(schema, policy)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _declare_auth(schema: dict[str, Any], policy: AccessPolicy) -> None:
    """Mark each operation that needs the token with the bearer scheme and its 401."""
    if policy.token is None:
        return
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["HTTPBearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The server's token (`$OMNILOOP_API_TOKEN`).",
    }
    unauthorized = problem_responses(401)[401]
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if policy.needs_token(method, path):
                operation["security"] = [{"HTTPBearer": []}]
                operation.setdefault("responses", {}).setdefault("401", unauthorized)
