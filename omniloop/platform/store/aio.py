"""`AsyncStore`: the run store for async code (FastAPI handlers, the rollout service).

Each call runs the synchronous `Store` method in a worker thread (`asyncio.to_thread`), so the
event loop never blocks on the database. This was chosen over SQLAlchemy's asyncio extension:
one code path and one set of drivers for both worlds, and SQLite gains nothing from an async
driver (aiosqlite is itself a thread per connection). Concurrency is bounded by the default
executor's threads and the engine's connection pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from omniloop.platform.store.errors import StoreError
from omniloop.platform.store.records import (
    EpisodeRecord,
    EpisodeStatus,
    EventRecord,
    MetricPoint,
    Page,
    RoleFaults,
    RunRecord,
    RunStatus,
    RunSummary,
)
from omniloop.platform.store.store import TREND_POINTS, Store
from omniloop.trajectory import Trajectory


class AsyncStore:
    """Awaitable twins of `Store`'s methods; the contracts are those of `Store`.

    `AsyncStore(store)` wraps an existing store (sync and async callers may share it);
    `AsyncStore.open(url)` makes one. `close()` closes the wrapped store.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    @classmethod
    def open(cls, url: str | None = None, *, echo: bool = False) -> AsyncStore:
        """An `AsyncStore` over a new `Store(url)` (no I/O happens until the first call)."""
        return cls(Store(url, echo=echo))

    async def close(self) -> None:
        await asyncio.to_thread(self.store.close)

    async def migrate(self, revision: str = "head") -> None:
        await asyncio.to_thread(self.store.migrate, revision)

    async def current_revision(self) -> str | None:
        return await asyncio.to_thread(self.store.current_revision)

    async def create_run(
        self,
        name: str = "",
        config: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        status: RunStatus = "created",
    ) -> RunRecord:
        return await asyncio.to_thread(
            self.store.create_run, name, config, run_id=run_id, status=status
        )

    async def get_run(self, run_id: str) -> RunRecord:
        return await asyncio.to_thread(self.store.get_run, run_id)

    async def list_runs(
        self, *, status: RunStatus | None = None, cursor: str | None = None, limit: int = 50
    ) -> Page[RunRecord]:
        return await asyncio.to_thread(
            self.store.list_runs, status=status, cursor=cursor, limit=limit
        )

    async def run_summaries(
        self, run_ids: Sequence[str], *, trend_points: int = TREND_POINTS
    ) -> dict[str, RunSummary]:
        return await asyncio.to_thread(self.store.run_summaries, run_ids, trend_points=trend_points)

    async def role_faults(self, run_ids: Sequence[str]) -> list[RoleFaults]:
        return await asyncio.to_thread(self.store.role_faults, run_ids)

    async def update_run_status(
        self, run_id: str, status: RunStatus, reason: str | None = None
    ) -> RunRecord:
        return await asyncio.to_thread(self.store.update_run_status, run_id, status, reason)

    async def record_run_event(self, run_id: str, type: str, data: dict[str, Any]) -> int:
        return await asyncio.to_thread(self.store.record_run_event, run_id, type, data)

    async def record_metrics(self, run_id: str, step: int, values: Mapping[str, float]) -> None:
        await asyncio.to_thread(self.store.record_metrics, run_id, step, values)

    async def get_metrics(
        self, run_id: str, names: Sequence[str] | None = None, *, since_step: int | None = None
    ) -> dict[str, list[MetricPoint]]:
        return await asyncio.to_thread(self.store.get_metrics, run_id, names, since_step=since_step)

    async def create_episode(
        self,
        task: Mapping[str, Any],
        *,
        run_id: str | None = None,
        agent: str = "",
        sampling: Mapping[str, Any] | None = None,
        episode_id: str | None = None,
        idempotency_key: str | None = None,
        request_hash: str | None = None,
        status: EpisodeStatus = "queued",
    ) -> tuple[EpisodeRecord, bool]:
        return await asyncio.to_thread(
            self.store.create_episode,
            task,
            run_id=run_id,
            agent=agent,
            sampling=sampling,
            episode_id=episode_id,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            status=status,
        )

    async def update_episode_status(
        self,
        episode_id: str,
        status: EpisodeStatus,
        *,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> EpisodeRecord:
        return await asyncio.to_thread(
            self.store.update_episode_status,
            episode_id,
            status,
            error_type=error_type,
            error_message=error_message,
        )

    async def finish_episode(self, episode_id: str, trajectory: Trajectory) -> EpisodeRecord:
        return await asyncio.to_thread(self.store.finish_episode, episode_id, trajectory)

    async def record_episodes(
        self,
        run_id: str,
        trajectories: Sequence[Trajectory],
        *,
        agent: str = "",
        replace: bool = False,
    ) -> int:
        return await asyncio.to_thread(
            self.store.record_episodes, run_id, trajectories, agent=agent, replace=replace
        )

    async def get_episode(self, episode_id: str, *, with_trajectory: bool = True) -> EpisodeRecord:
        return await asyncio.to_thread(
            self.store.get_episode, episode_id, with_trajectory=with_trajectory
        )

    async def list_episodes(
        self,
        run_id: str | None = None,
        *,
        status: EpisodeStatus | None = None,
        stop_reason: str | None = None,
        error_type: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> Page[EpisodeRecord]:
        return await asyncio.to_thread(
            self.store.list_episodes,
            run_id,
            status=status,
            stop_reason=stop_reason,
            error_type=error_type,
            cursor=cursor,
            limit=limit,
        )

    async def append_event(
        self,
        type: str,
        data: Mapping[str, Any] | None = None,
        *,
        episode_id: str | None = None,
        run_id: str | None = None,
    ) -> int:
        return await asyncio.to_thread(
            self.store.append_event, type, data, episode_id=episode_id, run_id=run_id
        )

    async def list_events(
        self,
        episode_id: str | None = None,
        *,
        run_id: str | None = None,
        type: str | None = None,
        after_id: int = 0,
        limit: int = 1000,
    ) -> list[EventRecord]:
        return await asyncio.to_thread(
            self.store.list_events,
            episode_id,
            run_id=run_id,
            type=type,
            after_id=after_id,
            limit=limit,
        )

    async def claim_next_episode(self) -> EpisodeRecord | None:
        return await asyncio.to_thread(self.store.claim_next_episode)

    async def requeue_running_episodes(self) -> list[str]:
        return await asyncio.to_thread(self.store.requeue_running_episodes)

    async def count_episodes(self, run_id: str | None = None) -> dict[EpisodeStatus, int]:
        return await asyncio.to_thread(self.store.count_episodes, run_id)

    async def create_episodes(
        self, requests: Sequence[Mapping[str, Any]], *, max_queued: int | None = None
    ) -> list[tuple[EpisodeRecord, bool] | StoreError]:
        return await asyncio.to_thread(self.store.create_episodes, requests, max_queued=max_queued)
