"""The `/v1` endpoints and the operational ones (`/healthz`, `/readyz`, `/metrics`).

Handlers are thin: validate, call the store (or the worker), shape the answer. Every error is
raised as an `ApiProblem` or a store error and rendered as problem+json by `problems.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path as FilePath
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Header, Path, Query, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse

from omniloop.platform.api.batching import EpisodeCreator
from omniloop.platform.api.downsample import decimate
from omniloop.platform.api.events import EpisodeSignals, episode_events
from omniloop.platform.api.metrics import ApiMetrics
from omniloop.platform.api.problems import (
    PROBLEM_MEDIA_TYPE,
    ApiProblem,
    FieldError,
    problem_responses,
    validation_problem,
)
from omniloop.platform.api.schemas import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    MAX_TURNS_FIELD,
    AgentList,
    AgentOut,
    EpisodeAccepted,
    EpisodeDetail,
    EpisodeList,
    EpisodeOut,
    EpisodeRequest,
    FaultList,
    Health,
    MetricPointOut,
    Readiness,
    RunList,
    RunMetrics,
    RunOut,
    episode_detail,
    episode_href,
    episode_out,
    fault_out,
    run_out,
)
from omniloop.platform.api.settings import ApiSettings
from omniloop.platform.api.worker import RETRY_AFTER_IDLE, EpisodeWorker, LoadedAgent
from omniloop.platform.store import (
    FAULT_EVENT,
    AsyncStore,
    EpisodeRecord,
    EpisodeStatus,
    QueueFull,
    RunStatus,
)

MAX_METRIC_NAMES = 100
NO_NUL = r"^[^\x00]*$"
"""Text parameters may hold anything but NUL, which PostgreSQL cannot compare with."""
CursorQuery = Annotated[
    str | None,
    Query(
        pattern=r"^[1-9][0-9]{0,17}$",
        description="`next_cursor` of the previous page; left out for the first page.",
    ),
]
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"
"""Visible ASCII, 1 to 255 characters (what the store keeps)."""


@dataclass
class ApiState:
    """What handlers share; one per app, built by `create_app` and its lifespan."""

    settings: ApiSettings
    store: AsyncStore
    agents: dict[str, LoadedAgent]
    signals: EpisodeSignals
    metrics: ApiMetrics
    head_revision: str
    creator: EpisodeCreator
    """Writes submissions in batches (see `batching.py`)."""
    worker: EpisodeWorker | None = None
    in_flight: set[str] = field(default_factory=set)
    """Idempotency keys whose first request is being handled now (→ 409 for the others)."""


def api_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.omniloop
    return state


def _default_problem() -> dict[str, Any]:
    return {
        "description": "Any other error, as a problem document (RFC 9457)",
        "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


def responses(*statuses: int, ok: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses: problem documents for `statuses` and for anything else (`default`),
    and `ok` as the 200 response when given."""
    documented: dict[int | str, dict[str, Any]] = {
        **problem_responses(*statuses),
        "default": _default_problem(),
    }
    if ok is not None:
        documented[200] = ok
    return documented


_LOCATION = {
    "Location": {"description": "The episode's URL path", "schema": {"type": "string"}},
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds after which the request is worth retrying",
        "schema": {"type": "integer", "minimum": 1},
    },
}


def _queue_full(full: QueueFull, worker: EpisodeWorker | None) -> ApiProblem:
    """The 503 for a submission the full queue kept out: the limit, how to raise it, and when
    to come back (`EpisodeWorker.retry_after`)."""
    retry = worker.retry_after() if worker is not None else RETRY_AFTER_IDLE
    idle = ""
    if worker is None or worker.state not in ("starting", "running"):
        idle = (
            " This server's worker runs no episodes (concurrency 0, or it failed: see "
            "/readyz), so the queue drains only when another process claims episodes or "
            "queued ones are cancelled."
        )
    return ApiProblem(
        503,
        "queue-full",
        f"the episode queue is full: {full.queued} episodes are queued, at this server's "
        f"limit max_queued_episodes={full.limit}; nothing was created. Retry after {retry} s "
        "(with the same Idempotency-Key, if any), or raise the limit in the server's "
        "settings (e.g. `omniloop serve max_queued_episodes=4096`; null for no limit)." + idle,
        title="Episode queue full",
        headers={"Retry-After": str(retry)},
        max_queued_episodes=full.limit,
        queued=full.queued,
        retry_after=retry,
    )


def _next_link(request: Request, cursor: str | None) -> str | None:
    if cursor is None:
        return None
    params = dict(request.query_params)
    params["cursor"] = cursor
    return f"{request.url.path}?{urlencode(params)}"


def _paged(response: Response, link: str | None) -> None:
    if link is not None:
        response.headers["Link"] = f'<{link}>; rel="next"'


def request_hash(body: EpisodeRequest) -> str:
    """Hash of the request as parsed (key order, whitespace and spelled-out defaults do not
    matter): what an `Idempotency-Key` replay must match."""
    canonical = json.dumps(
        body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), allow_nan=False
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _field_problem(field_name: str, message: str, kind: str) -> ApiProblem:
    return validation_problem(
        [FieldError(location="body", field=field_name, message=message, type=kind)]
    )


class _RandomIds:
    """128-bit random hex ids, from one `os.urandom` call per 256 ids.

    Each syscall releases the GIL, and under load the event loop then waits to get it back
    from the store's threads: one read per id showed up as the largest cost of a submission.
    Used from the event loop's thread only.
    """

    BATCH = 256

    def __init__(self) -> None:
        self._pool = b""
        self._next = 0

    def __call__(self) -> str:
        if self._next >= len(self._pool):
            self._pool = os.urandom(16 * self.BATCH)
            self._next = 0
        start, self._next = self._next, self._next + 16
        return self._pool[start : self._next].hex()


new_episode_id = _RandomIds()


MEDIA_TYPES: dict[str, str] = {
    "png": "image/png",
    "jpeg": "image/jpeg",
    "gif": "image/gif",
    "webp": "image/webp",
    "bmp": "image/bmp",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "ogg": "audio/ogg",
    "mp3": "audio/mpeg",
    "mp4": "video/mp4",
    "matroska": "video/x-matroska",
    "avi": "video/x-msvideo",
}
"""The Content-Type of each container `modalities.media.sniff_format` names; any other format
(`unknown`) is sent as `application/octet-stream`."""
OTHER_MEDIA_TYPE = "application/octet-stream"
MEDIA_CACHE_CONTROL = "private, max-age=31536000, immutable"
"""Media are addressed by content hash: what a URL names never changes (private: it may need
the token)."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


async def _episode_media_dir(state: ApiState, record: EpisodeRecord) -> FilePath:
    """The media store of `record`'s episode: its run's `RUN_DIR/media` (the run's `run_dir`,
    relative to this process's working directory when relative, as `control.run.run_media_dir`
    has it), or the server's `media_dir` for an episode submitted over REST."""
    if record.run_id is None:
        return FilePath(state.settings.media_dir)
    run = await state.store.get_run(record.run_id)
    run_dir = run.config.get("run_dir")
    if not isinstance(run_dir, str) or not run_dir:
        raise ApiProblem(
            404,
            "media-missing",
            f"run {run.id!r} has no run_dir in its configuration, so the media store of its "
            f"episode {record.id!r} is unknown",
        )
    return FilePath(run_dir) / "media"


def _read_media(path: FilePath) -> tuple[bytes, str] | None:
    """The bytes at `path` and their SHA-256 (hex); None when there is no such file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return data, hashlib.sha256(data).hexdigest()


# -- /v1 -------------------------------------------------------------------------------------


def v1_router() -> APIRouter:
    """The `/v1` API. The token is checked before routing (`auth.TokenGuardMiddleware`).

    Ids are `path` parameters because training episodes have ids with slashes (`t0/0`); so
    the routes with a suffix (`/events`, `/cancel`, `/media/{index}`, `/metrics`, `/faults`)
    come before the bare ones.
    """
    router = APIRouter(prefix="/v1")

    @router.post(
        "/episodes",
        status_code=202,
        response_model=EpisodeAccepted,
        summary="Submit an episode",
        responses=responses(
            401,
            409,
            413,
            422,
            ok={
                "description": "An Idempotency-Key replay: the episode the first request made",
                "model": EpisodeAccepted,
                "headers": _LOCATION,
            },
        )
        | {202: {"description": "Queued", "headers": _LOCATION}}
        | {
            503: {
                **problem_responses(503)[503],
                "description": "`queue-full`: `max_queued_episodes` episodes are queued and "
                "nothing was created (retry after `Retry-After` seconds), or `not-ready`",
                "headers": _RETRY_AFTER,
            }
        },
    )
    async def submit_episode(
        body: EpisodeRequest,
        request: Request,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                pattern=IDEMPOTENCY_KEY_PATTERN,
                description="Same key and same body: the same episode. Same key, another body: "
                "422. While the first request with the key is in progress: 409.",
            ),
        ] = None,
    ) -> Response:
        """Queue an episode of `agent` on `task`: 202 with `Location`. The worker runs it
        through the rollout path; follow it at `events_href` or poll `href`. While the
        server's `max_queued_episodes` episodes are queued: 503 `queue-full` with
        `Retry-After`, and nothing is created (an Idempotency-Key stays unused)."""
        state = api_state(request)
        loaded = state.agents.get(body.agent)
        if loaded is None:
            known = ", ".join(sorted(state.agents)) or "none"
            raise _field_problem(
                "agent", f"unknown agent {body.agent!r}; this server has: {known}", "unknown_agent"
            )
        limits = state.settings.limits
        sampling = loaded.entry.sampling.model_copy(
            update=body.sampling.model_dump(exclude_none=True)
        )
        if sampling.max_new_tokens > limits.max_new_tokens:
            raise _field_problem(
                "sampling.max_new_tokens",
                f"{sampling.max_new_tokens} is over this server's limit of {limits.max_new_tokens}",
                "limit_exceeded",
            )
        max_turns = body.max_turns or loaded.entry.max_turns
        if max_turns > limits.max_turns:
            raise _field_problem(
                "max_turns",
                f"{max_turns} is over this server's limit of {limits.max_turns}",
                "limit_exceeded",
            )
        episode_id = new_episode_id()
        task = body.task.model_dump(mode="json")
        task["id"] = task.get("id") or episode_id
        options = {**sampling.model_dump(mode="json"), MAX_TURNS_FIELD: max_turns}
        if idempotency_key is not None:
            if idempotency_key in state.in_flight:
                raise ApiProblem(
                    409,
                    "idempotency-key-in-use",
                    f"a request with Idempotency-Key {idempotency_key!r} is still being "
                    "handled; retry when it has finished",
                    headers={"Retry-After": "1"},
                )
            state.in_flight.add(idempotency_key)
        try:
            record, created = await state.creator.create(
                task,
                agent=body.agent,
                sampling=options,
                episode_id=episode_id,
                idempotency_key=idempotency_key,
                request_hash=request_hash(body) if idempotency_key is not None else None,
            )
        except QueueFull as full:
            state.metrics.submissions.labels("queue_full").inc()
            raise _queue_full(full, state.worker) from None
        finally:
            if idempotency_key is not None:
                state.in_flight.discard(idempotency_key)
        href = episode_href(record.id)
        headers = {"Location": href}
        if created:
            if state.worker is not None:
                state.worker.wake()
            state.metrics.submissions.labels("created").inc()
        else:
            headers["Idempotent-Replayed"] = "true"
            state.metrics.submissions.labels("replayed").inc()
        accepted = EpisodeAccepted(
            id=record.id,
            status=record.status,
            created=created,
            href=href,
            events_href=f"{href}/events",
        )
        # Serialized here: FastAPI would validate and encode the model once more (the busiest
        # endpoint; `response_model` still documents the body).
        return Response(
            accepted.model_dump_json(),
            status_code=202 if created else 200,
            headers=headers,
            media_type="application/json",
        )

    @router.get(
        "/episodes",
        response_model=EpisodeList,
        summary="List episodes",
        responses=responses(404, 422),
    )
    async def list_episodes(
        request: Request,
        response: Response,
        status: EpisodeStatus | None = None,
        stop_reason: Annotated[str | None, Query(max_length=32, pattern=NO_NUL)] = None,
        error_type: Annotated[str | None, Query(max_length=255, pattern=NO_NUL)] = None,
        run_id: Annotated[str | None, Query(min_length=1, max_length=64, pattern=NO_NUL)] = None,
        cursor: CursorQuery = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
    ) -> EpisodeList:
        """Episodes, newest first, without trajectories. Filters combine with AND; a `run_id`
        that names no run is a 404."""
        page = await api_state(request).store.list_episodes(
            run_id,
            status=status,
            stop_reason=stop_reason,
            error_type=error_type,
            cursor=cursor,
            limit=limit,
        )
        link = _next_link(request, page.next_cursor)
        _paged(response, link)
        return EpisodeList(
            items=[episode_out(r) for r in page.items], next_cursor=page.next_cursor, next=link
        )

    @router.get(
        "/episodes/{episode_id:path}/events",
        summary="Follow an episode (Server-Sent Events)",
        response_class=EventSourceResponse,
        responses=responses(
            404,
            422,
            ok={
                "description": "An event stream: `status` and `turn` events, each with `id` "
                "(resume with Last-Event-ID) and JSON `data`; it ends after the terminal "
                "status event.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
        ),
    )
    async def episode_event_stream(
        request: Request,
        episode_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)],
        last_event_id: Annotated[
            str | None,
            Header(
                alias="Last-Event-ID",
                pattern=r"^[0-9]{1,18}$",
                description="Resume after this event id (browsers send it on reconnect).",
            ),
        ] = None,
    ) -> EventSourceResponse:
        """Every event of the episode (or those after `Last-Event-ID`), then live ones, ending
        after the event that makes the episode `completed`, `failed` or `cancelled`."""
        state = api_state(request)
        after = int(last_event_id) if last_event_id is not None else 0
        # 404 before the stream starts: after the 200 there is no way to say it.
        await state.store.get_episode(episode_id, with_trajectory=False)
        return EventSourceResponse(
            episode_events(
                state.store,
                state.signals,
                episode_id,
                after_id=after,
                poll_interval=state.settings.poll_interval,
            ),
            ping=15,
        )

    @router.post(
        "/episodes/{episode_id:path}/cancel",
        response_model=EpisodeOut,
        summary="Cancel an episode",
        responses=responses(401, 404, 409, 422),
    )
    async def cancel_episode(
        request: Request, episode_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)]
    ) -> EpisodeOut:
        """Cancel a queued or running episode (a running one's task is cancelled and its
        sandbox released). Cancelling a cancelled episode again succeeds; a completed or
        failed one is a 409."""
        state = api_state(request)
        record = await state.store.update_episode_status(episode_id, "cancelled")
        if state.worker is not None:
            state.worker.cancel(episode_id)
        state.signals.notify(episode_id)
        return episode_out(record)

    @router.get(
        "/episodes/{episode_id:path}/media/{index}",
        summary="Get a media item of an episode",
        response_class=Response,
        responses=responses(
            404,
            422,
            500,
            ok={
                "description": "The item's bytes as stored, with the Content-Type of its "
                "format (`application/octet-stream` for an `unknown` one). Content-addressed, "
                "so cacheable for good.",
                "content": {
                    media_type: {"schema": {"type": "string", "format": "binary"}}
                    for media_type in [*MEDIA_TYPES.values(), OTHER_MEDIA_TYPE]
                },
                "headers": {
                    "Cache-Control": {
                        "description": f"`{MEDIA_CACHE_CONTROL}`",
                        "schema": {"type": "string"},
                    },
                    "X-Content-Type-Options": {
                        "description": "`nosniff`",
                        "schema": {"type": "string"},
                    },
                },
            },
        ),
    )
    async def get_episode_media(
        request: Request,
        episode_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)],
        index: Annotated[
            int,
            Path(ge=0, le=2**31 - 1, description="Position of the item in `multimodal`."),
        ],
    ) -> Response:
        """The bytes of item `index` of the episode's `trajectory.multimodal` (an image, audio
        clip or video), read from the media store of the episode's run (`RUN_DIR/media`) or,
        for an episode submitted over REST, from the server's `media_dir`. 404 for an unknown
        episode, one without a trajectory, an index past its items (`media-not-found`), or
        bytes the store lacks (`media-missing`, naming the store); 500 `media-corrupt` when the
        bytes read do not hash to the item's SHA-256."""
        state = api_state(request)
        record = await state.store.get_episode(episode_id, with_trajectory=True)
        trajectory = record.trajectory
        if trajectory is None:
            raise ApiProblem(
                404,
                "no-trajectory",
                f"episode {episode_id!r} is {record.status} and has no trajectory yet",
            )
        items = trajectory.multimodal
        if index >= len(items):
            raise ApiProblem(
                404,
                "media-not-found",
                f"episode {episode_id!r} has {len(items)} media items (indexes from 0); "
                f"there is no item {index}",
            )
        item = items[index]
        sha256, kind, fmt = item.get("sha256"), item.get("kind"), item.get("format")
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise ApiProblem(
                500,
                "invalid-media-item",
                f"media item {index} of episode {episode_id!r} has no valid sha256 (64 hex "
                "digits) in its trajectory",
            )
        media_dir = await _episode_media_dir(state, record)
        read = await asyncio.to_thread(_read_media, media_dir / sha256[:2] / sha256)
        if read is None:
            raise ApiProblem(
                404,
                "media-missing",
                f"{kind}:{sha256[:12]} (item {index} of episode {episode_id!r}) is not in the "
                f"media store at {media_dir}",
                media_dir=str(media_dir),
            )
        data, digest = read
        if digest != sha256:
            raise ApiProblem(
                500,
                "media-corrupt",
                f"the media store at {media_dir} is corrupt: the file of {kind}:{sha256[:12]} "
                f"holds {len(data)} bytes whose SHA-256 is {digest}",
                media_dir=str(media_dir),
            )
        return Response(
            data,
            media_type=MEDIA_TYPES.get(str(fmt), OTHER_MEDIA_TYPE),
            headers={
                "Cache-Control": MEDIA_CACHE_CONTROL,
                "X-Content-Type-Options": "nosniff",
            },
        )

    @router.get(
        "/episodes/{episode_id:path}",
        response_model=EpisodeDetail,
        summary="Get an episode",
        responses=responses(404, 422),
    )
    async def get_episode(
        request: Request,
        episode_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)],
        trajectory: Annotated[
            bool, Query(description="Include the token-level trajectory (it can be large).")
        ] = True,
    ) -> EpisodeDetail:
        """The episode: status, request, reward and components, stop reason, error, timings,
        and (once finished) its trajectory with turns and tool calls."""
        record = await api_state(request).store.get_episode(episode_id, with_trajectory=trajectory)
        return episode_detail(record)

    @router.get("/runs", response_model=RunList, summary="List runs", responses=responses(422))
    async def list_runs(
        request: Request,
        response: Response,
        status: RunStatus | None = None,
        cursor: CursorQuery = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
    ) -> RunList:
        """Training and rollout runs, newest first, each with its progress, latest reward and
        trend, and infrastructure error count (index lookups: as fast for long runs)."""
        store = api_state(request).store
        page = await store.list_runs(status=status, cursor=cursor, limit=limit)
        summaries = await store.run_summaries([r.id for r in page.items])
        link = _next_link(request, page.next_cursor)
        _paged(response, link)
        now = datetime.now(UTC)
        return RunList(
            items=[run_out(r, summaries.get(r.id), now) for r in page.items],
            next_cursor=page.next_cursor,
            next=link,
        )

    @router.get(
        "/runs/{run_id:path}/metrics",
        response_model=RunMetrics,
        summary="Get a run's metrics",
        responses=responses(404, 422),
    )
    async def get_run_metrics(
        request: Request,
        run_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)],
        names: Annotated[
            str | None,
            Query(
                max_length=2048,
                pattern=NO_NUL,
                description="Comma-separated metric names; all metrics when left out.",
            ),
        ] = None,
        since_step: Annotated[
            int | None,
            Query(ge=-(2**63), le=2**63 - 1, description="Only steps after this one (polling)."),
        ] = None,
        max_points: Annotated[
            int | None,
            Query(
                ge=3,
                le=100_000,
                description="At most this many points per metric: longer series are reduced "
                "to the lowest and highest point of each run of consecutive steps, plus the "
                "newest (the chart's envelope stays exact). All points when left out.",
            ),
        ] = None,
    ) -> RunMetrics:
        """Metric name → points in step order; non-finite values read as null."""
        wanted = None
        if names is not None:
            wanted = [n.strip() for n in names.split(",") if n.strip()]
            if len(wanted) > MAX_METRIC_NAMES or any(len(n) > 255 for n in wanted):
                raise validation_problem(
                    [
                        FieldError(
                            location="query",
                            field="names",
                            message=f"at most {MAX_METRIC_NAMES} names of at most 255 "
                            "characters each",
                            type="limit_exceeded",
                        )
                    ]
                )
        metrics = await api_state(request).store.get_metrics(run_id, wanted, since_step=since_step)
        return RunMetrics(
            run_id=run_id,
            metrics={
                name: [
                    MetricPointOut(
                        step=p.step, value=p.value if math.isfinite(p.value) else None, time=p.time
                    )
                    for p in (
                        points
                        if max_points is None
                        else decimate(points, max_points, lambda p: p.value)
                    )
                ]
                for name, points in metrics.items()
            },
        )

    @router.get(
        "/runs/{run_id:path}/faults",
        response_model=FaultList,
        summary="List a run's faults",
        responses=responses(404, 422),
    )
    async def list_run_faults(
        request: Request,
        response: Response,
        run_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)],
        cursor: Annotated[
            str | None,
            Query(
                pattern=r"^[1-9][0-9]{0,17}$",
                description="`next_cursor` of the previous page, or the `id` of the newest "
                "fault seen (to poll for later ones); left out for the first page.",
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
    ) -> FaultList:
        """The run's fault timeline, oldest first: each failed replica of its roles with its
        cause, when it was detected and recovered, and the work retried; a fault is listed when
        detected and again, under the same `fault_id`, once recovered. Read from the run's
        `fault` events through their own index (as fast for runs with many episodes); a
        `run_id` that names no run is a 404."""
        after = int(cursor) if cursor is not None else 0
        # One more than asked tells whether another page exists.
        events = await api_state(request).store.list_events(
            run_id=run_id, type=FAULT_EVENT, after_id=after, limit=limit + 1
        )
        items = events[:limit]
        next_cursor = str(items[-1].id) if len(events) > limit else None
        link = _next_link(request, next_cursor)
        _paged(response, link)
        return FaultList(
            run_id=run_id,
            items=[fault_out(e) for e in items],
            next_cursor=next_cursor,
            next=link,
        )

    @router.get(
        "/runs/{run_id:path}",
        response_model=RunOut,
        summary="Get a run",
        responses=responses(404, 422),
    )
    async def get_run(
        request: Request, run_id: Annotated[str, Path(max_length=64, pattern=NO_NUL)]
    ) -> RunOut:
        """One run with its resolved configuration and its summary (as in the list)."""
        store = api_state(request).store
        record = await store.get_run(run_id)
        summaries = await store.run_summaries([record.id])
        return run_out(record, summaries.get(record.id))

    @router.get("/agents", response_model=AgentList, summary="List agents", responses=responses())
    async def list_agents(request: Request) -> AgentList:
        """The agents episodes may be submitted for, with their tools and defaults."""
        agents = api_state(request).agents
        return AgentList(
            items=[
                AgentOut(
                    name=name,
                    description=loaded.entry.description,
                    tools=loaded.tool_names,
                    max_turns=loaded.entry.max_turns,
                    sampling=loaded.entry.sampling.model_dump(mode="json"),
                )
                for name, loaded in sorted(agents.items())
            ]
        )

    return router


# -- operations ------------------------------------------------------------------------------


def ops_router() -> APIRouter:
    """`/healthz` (the process answers), `/readyz` (it can do work), `/metrics`."""
    router = APIRouter()

    @router.get("/healthz", response_model=Health, summary="Liveness", responses=responses())
    async def healthz() -> Health:
        """200 whenever the process serves requests."""
        return Health(status="ok")

    @router.get("/readyz", response_model=Readiness, summary="Readiness", responses=responses(503))
    async def readyz(request: Request) -> Readiness:
        """200 when the database answers with the expected schema and the episode worker is
        alive; otherwise a 503 problem whose `checks` says what is wrong."""
        state = api_state(request)
        checks: dict[str, str] = {}
        try:
            revision = await state.store.current_revision()
            checks["database"] = (
                "ok" if revision == state.head_revision else f"schema at {revision}, not head"
            )
        except Exception as err:
            checks["database"] = f"unreachable: {type(err).__name__}"
        worker = state.worker
        checks["worker"] = worker.state if worker is not None else "not started"
        if worker is not None and worker.error is not None:
            checks["worker_error"] = worker.error
        if checks["database"] != "ok" or worker is None or not worker.alive:
            raise ApiProblem(503, "not-ready", "the server cannot run episodes now", checks=checks)
        return Readiness(status="ready", checks=checks)

    @router.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=Response,
        responses=responses(
            ok={
                "description": "Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        ),
    )
    async def metrics(request: Request) -> Response:
        """Request counts and latencies, episodes by status, worker state, and the faults of
        running and recent runs by role."""
        state = api_state(request)
        try:
            counts = await state.store.count_episodes()
        except Exception:
            counts = {}
        for status, count in counts.items():
            state.metrics.episodes.labels(status).set(count)
        await state.metrics.run_faults.refresh(state.store, state.settings.metrics_recent_runs)
        for collector in state.metrics.scraped:
            await collector.refresh()
        # No await from here on: the scrape renders the rows it just read (see metrics.py).
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
