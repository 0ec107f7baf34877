"""sandboxd: the sandbox service, which holds sandboxes of any backend for clients over HTTP.

Clients reach it through `remote.py` (`SandboxClient`, whose `RemoteSandbox` implements the
`Sandbox` protocol). It runs standalone (`omniloop sandbox serve`) or as the `sandbox` role of
a training run (`platform/control/sandbox_service.py`), where it is the only process that
creates sandboxes: the rollout replicas hold `RemoteSandbox`es. It owns every sandbox it
creates (Docker, gVisor or bwrap), keeps a warm `SandboxPool` per (backend, image), bounds
creation concurrency, and reaps what nobody will close. Docker is connected only when a
Docker-backed sandbox is wanted, so a host with bubblewrap alone runs it too.

API (`/v1`, JSON; errors are RFC 9457 problem+json)
--------------------------------------------------
- `POST /v1/sandboxes` {episode_id, backend, image, limits, env, egress_allowlist, ...} → 201
  `SandboxInfo`. Served from the image's warm pool when the request asks for nothing but the
  defaults; created on demand otherwise. When `max_pending_creates` creations are already
  waiting or `max_sandboxes` exist: 429 with `Retry-After`.
- `POST /v1/sandboxes/{id}/exec` {request_id, command, timeout, stdin_b64, env} → `ExecResult`.
  A `request_id` seen before (running or done) is not run again: the caller gets that run's
  result, so a retry after a dropped response runs the command exactly once.
- `PUT /v1/sandboxes/{id}/files?path=…` (body: the bytes) → 204; `GET` → the bytes. Paths
  leaving the workspace and paths through symlinks are refused (400).
- `DELETE /v1/sandboxes/{id}` → 204 (idempotent: an unknown id is 204 too).
- `GET /v1/sandboxes`, `GET /healthz` (the process answers), `GET /readyz` (the default
  backend can run: the Docker daemon answers and its disk has room, or bwrap works),
  `GET /metrics` (Prometheus text), `GET /v1/metrics` (JSON).

With a bearer token (`token`) set, every endpoint but `/healthz`, `/readyz` and `/metrics`
requires it; the service refuses to bind beyond loopback without one.

Lifecycle: at start-up the reaper removes what dead processes left (a SIGKILLed predecessor
included: Docker containers by their owner labels, bwrap folders, mounts and cgroups by their
`owner.json`), then runs every `reaper_period`; sandboxes idle for `lease_timeout` (no request, no
command running) are closed, so a client that died does not leak them until their TTL. On
SIGTERM/Ctrl-C every sandbox and pool is closed before the process exits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ipaddress
import logging
import math
import shutil
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from omniloop.config import StrictModel
from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes import bwrap as bwrap_backend
from omniloop.sandboxes import docker as docker_backend
from omniloop.sandboxes.base import ExecResult, Sandbox
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.docker import DockerHost, create_docker_sandbox
from omniloop.sandboxes.images import SANDBOX_IMAGE
from omniloop.sandboxes.pool import SandboxPool
from omniloop.sandboxes.reaper import Reaper

logger = logging.getLogger(__name__)

_REQUEST_IDS_KEPT = 512
_OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
Backend = Literal["docker", "gvisor", "bwrap"]
_DOCKER_BACKENDS = ("docker", "gvisor")


class SandboxdSettings(StrictModel):
    """Configuration of the sandbox service."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(default=8765, ge=0, le=65535)
    """Port to bind (0 picks a free one)."""
    token: str | None = None
    """Bearer token required on mutating endpoints; mandatory when `host` is not loopback."""
    docker_host: str | None = None
    """Docker endpoint (`unix://…`, `tcp://…`); default: `DOCKER_HOST`."""
    default_image: str = SANDBOX_IMAGE
    """Image of sandboxes whose request names none."""
    default_backend: Backend = "docker"
    """Backend of sandboxes whose request names none. Docker is connected at start-up when it
    is `docker` or `gvisor`, else on the first request for a Docker-backed sandbox."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Limits of sandboxes whose request gives none (and of pooled sandboxes)."""
    pool_size: int = Field(default=4, ge=0)
    """Warm sandboxes kept per (backend, image); 0 disables pooling."""
    pool_images: list[str] = Field(default_factory=list)
    """Images whose pools are filled at start-up (others fill on first use)."""
    max_sandboxes: int = Field(default=256, gt=0)
    """Most sandboxes handed out at once; beyond it creation answers 429."""
    max_concurrent_creates: int = Field(default=4, gt=0)
    """Creations running against the Docker daemon at once."""
    max_pending_creates: int = Field(default=32, gt=0)
    """Creations allowed to wait or run at once; beyond it creation answers 429."""
    reaper_period: float = Field(default=30.0, gt=0)
    """Seconds between reaper passes."""
    reaper_grace: float = Field(default=60.0, ge=0)
    """Age before a stopped or unlabelled leftover counts as an orphan."""
    lease_timeout: float | None = Field(default=900.0, gt=0)
    """Close a sandbox that saw no request for this long (None: only its TTL ends it)."""
    min_free_disk_mb: int = Field(default=2048, ge=0)
    """`/readyz` fails when the Docker data root has less free space than this."""


class CreateSandboxRequest(BaseModel):
    """Body of `POST /v1/sandboxes`."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str | None = None
    backend: Backend | None = None
    image: str | None = None
    limits: SandboxLimits | None = None
    env: dict[str, str] = Field(default_factory=dict)
    egress_allowlist: list[str] | None = None
    egress_network: str | None = None
    workdir: str | None = None


class SandboxInfo(BaseModel):
    """A sandbox as the service reports it."""

    id: str
    backend: str
    image: str
    episode_id: str | None
    expires_at: float
    pooled: bool
    workdir: str
    limits: SandboxLimits


class ExecRequest(BaseModel):
    """Body of `POST /v1/sandboxes/{id}/exec`."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    command: list[str] | str
    timeout: float | None = Field(default=None, gt=0)
    stdin_b64: str | None = None
    env: dict[str, str] | None = None


@dataclass
class _Entry:
    sandbox: Sandbox
    pool: SandboxPool[Sandbox] | None
    backend: Backend
    image: str
    episode_id: str | None
    config: SandboxConfig
    expires_at: float
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0
    runs: OrderedDict[str, asyncio.Future[ExecResult]] = field(default_factory=OrderedDict)


@dataclass
class _Counters:
    created: int = 0
    create_rejected: int = 0
    create_failures: int = 0
    closed: int = 0
    lease_expired: int = 0
    execs: int = 0
    exec_retries_deduplicated: int = 0
    reaped: int = 0


class _ProblemError(Exception):
    def __init__(self, status: int, title: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.headers = headers or {}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SandboxService:
    """The state of one sandboxd process (see the module docstring)."""

    def __init__(self, settings: SandboxdSettings) -> None:
        self.settings = settings
        self.host: DockerHost | None = None
        self.reaper: Reaper | None = None
        self.entries: dict[str, _Entry] = {}
        self.pools: dict[tuple[str, str], SandboxPool[Sandbox]] = {}
        self.counters = _Counters()
        self._create_slots = asyncio.Semaphore(settings.max_concurrent_creates)
        self._pending = 0
        self._create_seconds = 1.0
        self._maintenance: asyncio.Task[None] | None = None
        self._closing = False

    # -- life cycle --

    async def start(self) -> None:
        """Reap leftovers of dead processes (connecting to Docker when the default backend
        needs it), start the reaper and the pools of `pool_images`."""
        if self.settings.default_backend in _DOCKER_BACKENDS:
            await self._docker()
        else:
            self.counters.reaped += await asyncio.to_thread(bwrap_backend.reap_stale_sandboxes)
        self._maintenance = asyncio.create_task(self._maintain())
        for image in self.settings.pool_images:
            self._pool_for(self.settings.default_backend, image)

    async def _docker(self) -> DockerHost:
        """The Docker connection, made (and its leftovers reaped) on first use."""
        if self.host is None:
            host = await asyncio.to_thread(DockerHost, self.settings.docker_host)
            if self.host is None:
                self.host = host
                host.watch_deaths()
                self.reaper = Reaper(
                    host, period=self.settings.reaper_period, grace=self.settings.reaper_grace
                )
                report = await self.reaper.reap_once()
                self.counters.reaped += report.removed
                if report.removed:
                    logger.info("start-up reaper removed %d leftovers", report.removed)
            else:
                host.close()
        return self.host

    async def _make(self, config: SandboxConfig, episode_id: str | None) -> Sandbox:
        """A new sandbox of `config.backend` (docker, gvisor or bwrap)."""
        if config.backend in _DOCKER_BACKENDS:
            host = await self._docker()
            return await create_docker_sandbox(config, episode_id=episode_id, host=host)
        return await bwrap_backend.create_bwrap_sandbox(config)

    async def stop(self) -> None:
        """Close every pool and sandbox (on SIGTERM), stop background work, drop the client."""
        self._closing = True
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        pools = list(self.pools.values())
        entries = list(self.entries.values())
        self.entries.clear()
        self.pools.clear()
        await asyncio.gather(
            *(self._close_entry(entry) for entry in entries),
            *(pool.close() for pool in pools),
        )
        if self.host is not None:
            self.host.close()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_period)
            await self._expire_leases()
            if self.reaper is None:
                continue
            try:
                report = await self.reaper.reap_once()
                self.counters.reaped += report.removed
            except SandboxError as err:
                logger.error("%s", err)

    async def _expire_leases(self) -> None:
        lease = self.settings.lease_timeout
        if lease is None:
            return
        now, wall = time.monotonic(), time.time()
        stale = [
            sid
            for sid, entry in self.entries.items()
            if (entry.active == 0 and now - entry.last_used > lease) or wall > entry.expires_at
        ]
        for sid in stale:
            entry = self.entries.pop(sid, None)
            if entry is not None:
                logger.warning("sandbox %s: lease or TTL expired; closing", sid)
                self.counters.lease_expired += 1
                await self._close_entry(entry)

    # -- pools --

    def _plain_config(self, backend: Backend, image: str) -> SandboxConfig:
        """The config of a sandbox asked for with nothing but a backend and an image."""
        return SandboxConfig(backend=backend, image=image, limits=self.settings.limits)

    def _pool_for(self, backend: Backend, image: str) -> SandboxPool[Sandbox] | None:
        if self.settings.pool_size == 0:
            return None
        key = (backend, image)
        pool = self.pools.get(key)
        if pool is None:
            config = self._plain_config(backend, image)

            async def factory() -> Sandbox:
                return await self._make(config, None)

            pool = SandboxPool(
                factory,
                self.settings.pool_size,
                max_concurrent_creates=max(1, min(2, self.settings.max_concurrent_creates)),
            )
            self.pools[key] = pool
            task = asyncio.ensure_future(pool.start())
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        return pool

    # -- requests --

    async def create(self, request: CreateSandboxRequest) -> _Entry:
        """A sandbox for one episode: from the warm pool when the request is plain, else new."""
        if self._closing:
            raise _ProblemError(503, "Shutting down", "the sandbox service is stopping")
        if len(self.entries) >= self.settings.max_sandboxes:
            self.counters.create_rejected += 1
            raise _ProblemError(
                429,
                "Too many sandboxes",
                f"{len(self.entries)} sandboxes are in use (max_sandboxes)",
                {"Retry-After": "5"},
            )
        if self._pending >= self.settings.max_pending_creates:
            self.counters.create_rejected += 1
            waves = self._pending / self.settings.max_concurrent_creates
            retry = max(1, math.ceil(waves * self._create_seconds))
            raise _ProblemError(
                429,
                "Creation queue full",
                f"{self._pending} creations are waiting or running (max_pending_creates)",
                {"Retry-After": str(retry)},
            )
        backend: Backend = request.backend or self.settings.default_backend
        image = request.image or self.settings.default_image
        plain = (
            request.limits in (None, self.settings.limits)
            and not request.env
            and request.egress_allowlist is None
            and request.workdir is None
        )
        if plain:
            config = self._plain_config(backend, image)
        else:
            options: dict[str, Any] = {}
            if request.egress_network is not None:
                options["egress_network"] = request.egress_network
            if request.workdir is not None:
                options["workdir"] = request.workdir
            config = SandboxConfig(
                backend=backend,
                image=image,
                limits=request.limits or self.settings.limits,
                env=request.env,
                egress_allowlist=request.egress_allowlist,
                **options,
            )
        self._pending += 1
        try:
            pool = self._pool_for(backend, image) if plain else None
            if pool is not None:
                sandbox = await pool.acquire()
            else:
                async with self._create_slots:
                    started = time.monotonic()
                    sandbox = await self._make(config, request.episode_id)
                    # A moving estimate of creation time, for Retry-After.
                    self._create_seconds = 0.8 * self._create_seconds + 0.2 * (
                        time.monotonic() - started
                    )
        except ConfigError as err:
            raise _ProblemError(400, "Invalid sandbox configuration", str(err)) from err
        except SandboxError as err:
            self.counters.create_failures += 1
            raise _ProblemError(502, "Sandbox creation failed", str(err)) from err
        finally:
            self._pending -= 1
        if self._closing:
            await (pool.release(sandbox) if pool is not None else sandbox.close())
            raise _ProblemError(503, "Shutting down", "the sandbox service is stopping")
        if isinstance(sandbox, docker_backend.DockerSandbox):
            sandbox.episode_id = request.episode_id
            expires_at = sandbox.expires_at
        else:
            expires_at = time.time() + config.limits.ttl
        entry = _Entry(sandbox, pool, backend, image, request.episode_id, config, expires_at)
        self.entries[sandbox.id] = entry
        self.counters.created += 1
        return entry

    def entry(self, sandbox_id: str) -> _Entry:
        """The live sandbox `sandbox_id` (404 otherwise)."""
        entry = self.entries.get(sandbox_id)
        if entry is None:
            raise _ProblemError(404, "No such sandbox", f"sandbox {sandbox_id} does not exist")
        entry.last_used = time.monotonic()
        return entry

    async def _tracked(self, entry: _Entry, work: Awaitable[Any]) -> Any:
        entry.active += 1
        try:
            return await work
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        """Run a command once per request id (see the module docstring)."""
        entry = self.entry(sandbox_id)
        run = entry.runs.get(request.request_id)
        if run is not None:
            self.counters.exec_retries_deduplicated += 1
        else:
            stdin = None
            if request.stdin_b64 is not None:
                try:
                    stdin = base64.b64decode(request.stdin_b64, validate=True)
                except ValueError as err:
                    raise _ProblemError(400, "Invalid stdin", f"stdin_b64: {err}") from err
            # A task of its own: a dropped connection must not cancel the command half-way,
            # and a retry must find its result.
            run = asyncio.ensure_future(
                entry.sandbox.exec(
                    request.command, timeout=request.timeout, stdin=stdin, env=request.env
                )
            )
            entry.runs[request.request_id] = run
            while len(entry.runs) > _REQUEST_IDS_KEPT:
                entry.runs.popitem(last=False)
            self.counters.execs += 1
        try:
            result: ExecResult = await self._tracked(entry, asyncio.shield(run))
        except SandboxError as err:
            raise _ProblemError(502, "Sandbox failed", str(err)) from err
        return result

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        entry = self.entry(sandbox_id)
        await self._file_call(entry, entry.sandbox.write_file(path, data))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        entry = self.entry(sandbox_id)
        data: bytes = await self._file_call(entry, entry.sandbox.read_file(path))
        return data

    async def _file_call(self, entry: _Entry, work: Awaitable[Any]) -> Any:
        try:
            return await self._tracked(entry, work)
        except SandboxError as err:
            text = str(err)
            refused = "refused" in text or "leaves the workspace" in text or "invalid path" in text
            if refused:
                raise _ProblemError(400, "Path refused", text) from err
            raise _ProblemError(502, "Sandbox failed", text) from err

    async def close(self, sandbox_id: str) -> None:
        """Remove a sandbox (idempotent)."""
        entry = self.entries.pop(sandbox_id, None)
        if entry is not None:
            await self._close_entry(entry)

    async def _close_entry(self, entry: _Entry) -> None:
        self.counters.closed += 1
        for run in entry.runs.values():
            run.cancel()
        if entry.pool is not None and not self._closing:
            await entry.pool.release(entry.sandbox)
        else:
            await entry.sandbox.close()

    # -- reporting --

    def info(self, entry: _Entry) -> SandboxInfo:
        return SandboxInfo(
            id=entry.sandbox.id,
            backend=entry.backend,
            image=entry.image,
            episode_id=entry.episode_id,
            expires_at=entry.expires_at,
            pooled=entry.pool is not None,
            workdir=entry.config.workdir,
            limits=entry.config.limits,
        )

    def metrics(self) -> dict[str, float]:
        """Counters under the `sandbox/` namespace."""
        pool_close_failures = sum(p.stats.close_failures for p in self.pools.values())
        values: dict[str, float] = {
            "sandbox/live": len(self.entries),
            "sandbox/created": self.counters.created,
            "sandbox/create_rejected": self.counters.create_rejected,
            "sandbox/create_failures": self.counters.create_failures,
            "sandbox/closed": self.counters.closed,
            "sandbox/lease_expired": self.counters.lease_expired,
            "sandbox/execs": self.counters.execs,
            "sandbox/exec_retries_deduplicated": self.counters.exec_retries_deduplicated,
            "sandbox/reaped": self.counters.reaped,
            "sandbox/cleanup_failures": docker_backend.cleanup_failures
            + bwrap_backend.cleanup_failures
            + pool_close_failures,
            "sandbox/pending_creates": self._pending,
        }
        for (backend, image), pool in self.pools.items():
            key = f"{backend}:{image}"
            values[f"sandbox/pool_ready/{key}"] = pool.ready
            values[f"sandbox/pool_warm_acquires/{key}"] = pool.stats.warm_acquires
            values[f"sandbox/pool_replaced_unhealthy/{key}"] = pool.stats.replaced_unhealthy
        return values

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether the default backend can run: bwrap works on this host, or the Docker daemon
        answers and its data root has `min_free_disk_mb` free."""
        checks: dict[str, Any] = {}
        if self.settings.default_backend == "bwrap":
            ok = await asyncio.to_thread(bwrap_backend.bwrap_available)
            return ok, {"bwrap": "ok" if ok else "unavailable on this host"}
        if self.host is None:
            return False, {"docker": "not connected"}
        try:
            info = await asyncio.wait_for(self.host.call(self.host.api.info), timeout=5)
        except Exception as err:
            return False, {"docker": f"unreachable: {err}"}
        checks["docker"] = "ok"
        root = str(info.get("DockerRootDir") or "")
        ok = True
        try:
            free_mb = shutil.disk_usage(root).free // (1024 * 1024)
        except OSError:
            checks["disk"] = f"{root} not visible from here; not checked"
        else:
            checks["disk_free_mb"] = free_mb
            if free_mb < self.settings.min_free_disk_mb:
                ok = False
                checks["disk"] = f"only {free_mb} MB free under {root}"
        return ok, checks


def _problem(status: int, title: str, detail: str, headers: dict[str, str] | None = None) -> Any:
    return JSONResponse(
        {"type": "about:blank", "title": title, "status": status, "detail": detail},
        status_code=status,
        media_type="application/problem+json",
        headers=headers,
    )


def create_app(settings: SandboxdSettings | None = None) -> FastAPI:
    """The sandboxd ASGI app; its lifespan starts and stops a `SandboxService`."""
    settings = settings or SandboxdSettings()
    if settings.token is None and not _is_loopback(settings.host):
        raise ConfigError(
            f"sandboxd binds {settings.host}, beyond loopback: set a token (--token or "
            "OMNILOOP_SANDBOXD_TOKEN); it controls the Docker daemon"
        )
    holder: dict[str, SandboxService] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service = SandboxService(settings)
        await service.start()
        holder["service"] = service
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="omniloop sandboxd", lifespan=lifespan)

    def service() -> SandboxService:
        return holder["service"]

    @app.exception_handler(_ProblemError)
    async def on_problem(_: Request, err: _ProblemError) -> Any:
        return _problem(err.status, err.title, err.detail, err.headers)

    @app.middleware("http")
    async def authorize(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        # Reading files is no mutation but exposes them: only probes and metrics are open.
        if settings.token is not None and request.url.path not in _OPEN_PATHS:
            expected = hashlib.sha256(f"Bearer {settings.token}".encode()).digest()
            given = hashlib.sha256(request.headers.get("authorization", "").encode()).digest()
            if given != expected:
                return _problem(401, "Unauthorized", "a valid bearer token is required")
        return await call_next(request)

    @app.post("/v1/sandboxes", status_code=201)
    async def create(request: CreateSandboxRequest) -> SandboxInfo:
        svc = service()
        return svc.info(await svc.create(request))

    @app.get("/v1/sandboxes")
    async def list_sandboxes() -> list[SandboxInfo]:
        svc = service()
        return [svc.info(entry) for entry in svc.entries.values()]

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> SandboxInfo:
        svc = service()
        return svc.info(svc.entry(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_command(sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await service().exec(sandbox_id, request)

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(sandbox_id: str, path: str, request: Request) -> Response:
        await service().write_file(sandbox_id, path, await request.body())
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def read_file(sandbox_id: str, path: str) -> Response:
        data = await service().read_file(sandbox_id, path)
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204)
    async def delete(sandbox_id: str) -> Response:
        await service().close(sandbox_id)
        return Response(status_code=204)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Any:
        ok, checks = await service().readiness()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503
        )

    @app.get("/v1/metrics")
    async def metrics_json() -> dict[str, float]:
        return service().metrics()

    @app.get("/metrics")
    async def metrics_prometheus() -> PlainTextResponse:
        lines = []
        for key, value in sorted(service().metrics().items()):
            name, _, label = key.partition("/")[2].partition("/")
            metric = f"omniloop_sandbox_{name}"
            if name not in ("live", "pending_creates") and not name.startswith("pool_ready"):
                metric += "_total"
            labels = f'{{pool="{label}"}}' if label else ""
            lines.append(f"{metric}{labels} {value}")
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


def serve(settings: SandboxdSettings, *, fd: int | None = None, log_level: str = "info") -> None:
    """Run sandboxd in the foreground until SIGTERM/SIGINT (then every sandbox is removed), on
    `settings.host:port`, or on the listening socket `fd` when given."""
    import socket

    import uvicorn

    app = create_app(settings)
    # In-flight commands get a bounded wait; then the lifespan removes every sandbox anyway.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=log_level == "info",
        timeout_graceful_shutdown=10,
        # Longer than a client keeps an idle connection (`http_client.KEEPALIVE_S`, httpx 5 s):
        # with equal times the server may close a connection the moment a client reuses it,
        # and that request fails unanswered (a run's rollout met it between two steps).
        timeout_keep_alive=30,
    )
    sockets = None if fd is None else [socket.socket(fileno=fd)]
    uvicorn.Server(config).run(sockets=sockets)
