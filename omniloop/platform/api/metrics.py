"""Prometheus metrics of the API server, in a registry of its own (one per app).

`omniloop_api_requests_total` and `omniloop_api_request_duration_seconds` are labelled by
the route *template* (`/v1/episodes/{episode_id}`), never by the raw path, so a scan of random
URLs cannot blow up the number of series; unmatched paths share the label `unmatched`.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniloop.platform.store.records import EPISODE_STATUSES

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods labelled as themselves; any other is labelled `other` (bounded label values)."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ApiMetrics:
    """Every metric the server exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "omniloop_api_requests",
            "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "omniloop_api_request_duration_seconds",
            "Time to answer a request (to the end of the response body).",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.submissions = Counter(
            "omniloop_api_episode_submissions",
            "Accepted POST /v1/episodes: `created`, or `replayed` for an Idempotency-Key replay.",
            ["outcome"],
            registry=self.registry,
        )
        self.episodes = Gauge(
            "omniloop_episodes",
            "Episodes in the store by status (read at scrape time).",
            ["status"],
            registry=self.registry,
        )
        self.running = Gauge(
            "omniloop_worker_episodes_running",
            "Episodes this server's worker is running now.",
            registry=self.registry,
        )
        self.finished = Counter(
            "omniloop_worker_episodes_finished",
            "Episodes this server's worker finished, by final status.",
            ["status"],
            registry=self.registry,
        )
        self.worker_up = Gauge(
            "omniloop_worker_up",
            "1 while the episode worker is alive (running, starting or paused), else 0.",
            registry=self.registry,
        )
        for status in sorted(EPISODE_STATUSES):
            self.episodes.labels(status)


class RequestMetricsMiddleware:
    """Counts and times every HTTP request (pure ASGI: no per-request task or body copy)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route: Any = scope.get("route")
            # `path_format` drops converters: `/v1/episodes/{episode_id}`, not `{...:path}`.
            template = getattr(route, "path_format", None) or "unmatched"
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - started)
