"""Prometheus metrics of the API server, in a registry of its own (one per app).

`omniloop_api_requests_total` and `omniloop_api_request_duration_seconds` are labelled by
the route *template* (`/v1/episodes/{episode_id}`), never by the raw path, so a scan of random
URLs cannot blow up the number of series; unmatched paths share the label `unmatched`.

Run faults (`omniloop_run_faults_total`, `omniloop_run_fault_recovery_seconds`, labelled by
run and role) are read from the store at scrape time, for a bounded set of runs: those
running (at most `MAX_RUNNING_FAULT_RUNS`) and the `metrics_recent_runs` newest. A run that
leaves that set leaves the scrape with its series.

A server may export more series read at scrape time (a run's api role: its engines' weight
updates): `create_app(..., scraped=[...])` registers each `ScrapedCollector` and refreshes it
before every scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniloop.platform.store.records import EPISODE_STATUSES, RoleFaults

if TYPE_CHECKING:
    from omniloop.platform.store import AsyncStore

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods labelled as themselves; any other is labelled `other` (bounded label values)."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

MAX_RUNNING_FAULT_RUNS = 200
"""Most running runs (the newest) whose faults a scrape exports, beside the recent ones."""
FAULT_LABELS = ["run_id", "role"]


class ScrapedCollector(Collector, Protocol):
    """A collector of series read from elsewhere when Prometheus scrapes."""

    async def refresh(self) -> None:
        """Read what the next `collect` reports; never raises (a source that cannot be read
        leaves its series out of the scrape)."""
        ...


class RunFaultsCollector(Collector):
    """The fault series of the runs a scrape covers, from the rows the last `refresh` read.

    Collected from a snapshot rather than from the store because collection is synchronous and
    the store is read in a worker thread: the `/metrics` handler awaits `refresh`, then renders
    the registry with no await in between, so a scrape shows the rows it read itself.
    """

    def __init__(self) -> None:
        self.rows: list[RoleFaults] = []

    async def refresh(self, store: AsyncStore, recent_runs: int) -> None:
        """Read the faults of the running runs and of the `recent_runs` newest; on a store
        error the fault series are left out of the scrape (readiness reports the database)."""
        try:
            running = await store.list_runs(status="running", limit=MAX_RUNNING_FAULT_RUNS)
            ids = [r.id for r in running.items]
            if recent_runs:
                ids += [r.id for r in (await store.list_runs(limit=recent_runs)).items]
            self.rows = await store.role_faults(list(dict.fromkeys(ids)))
        except Exception:
            self.rows = []

    def describe(self) -> Iterable[Metric]:
        return self._families([])

    def collect(self) -> Iterable[Metric]:
        return self._families(self.rows)

    @staticmethod
    def _families(rows: Sequence[RoleFaults]) -> list[Metric]:
        faults = CounterMetricFamily(
            "omniloop_run_faults",
            "Faults of a run's role (replicas that failed and had their work retried), from "
            "the run's fault events (read at scrape time).",
            labels=FAULT_LABELS,
        )
        recovery = GaugeMetricFamily(
            "omniloop_run_fault_recovery_seconds",
            "Seconds from detection to recovery of the role's newest recovered fault (read at "
            "scrape time; absent until one has recovered).",
            labels=FAULT_LABELS,
        )
        for row in rows:
            faults.add_metric([row.run_id, row.role], row.count)
            if row.latest_recovery_seconds is not None:
                recovery.add_metric([row.run_id, row.role], row.latest_recovery_seconds)
        return [faults, recovery]


class ApiMetrics:
    """Every metric the server exports."""

    def __init__(self, scraped: Sequence[ScrapedCollector] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.scraped = list(scraped)
        """Collectors refreshed before each scrape (module docstring)."""
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
            "POST /v1/episodes by outcome: `created`, `replayed` (an Idempotency-Key replay), "
            "or `queue_full` (refused with 503: max_queued_episodes were queued).",
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
        self.run_faults = RunFaultsCollector()
        self.registry.register(self.run_faults)
        for collector in self.scraped:
            self.registry.register(collector)


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
