"""Episode creation in batches: one hand-off to a store thread and one commit for many.

Under load, what a submission costs is dominated not by its insert but by the commit (SQLite
writes every page the insert touched: the episode, its indexes, its event) and by handing the
insert to a worker thread and taking the GIL back afterwards; and when several threads insert at
once, a writer that finds SQLite's lock taken sleeps in steps of milliseconds. `EpisodeCreator`
queues the submissions that arrive while a batch is being written and writes them all with the
next `Store.create_episodes`: one thread hop and one transaction, each submission in its own
savepoint with `create_episode`'s guarantees (idempotency keys, events). An idle server writes
a submission at once, in a batch of one.

`max_queued` is the queue bound (`ApiSettings.max_queued_episodes`): each batch is written with
`Store.create_episodes(..., max_queued=...)`, which counts the queue and inserts in one
transaction, so the submissions of a burst are admitted in arrival order up to the bound and
the rest get `QueueFull` (nothing written for them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omniloop.platform.store import EpisodeRecord, Store

MAX_BATCH = 128
"""Most submissions written in one hand-off (bounds how long the first of them waits)."""


@dataclass
class _Pending:
    task: Mapping[str, Any]
    options: Mapping[str, Any]
    answer: asyncio.Future[tuple[EpisodeRecord, bool]]


class EpisodeCreator:
    """`await creator.create(...)` is `Store.create_episode(...)`, written in batches."""

    def __init__(self, store: Store, *, max_queued: int | None = None) -> None:
        self.store = store
        self.max_queued = max_queued
        """At most this many queued episodes; a submission past it gets `QueueFull`."""
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None

    async def create(self, task: Mapping[str, Any], **options: Any) -> tuple[EpisodeRecord, bool]:
        """Create an episode (see `Store.create_episode`); raises what it raises, and
        `QueueFull` when `max_queued` episodes are already queued."""
        answer: asyncio.Future[tuple[EpisodeRecord, bool]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.append(_Pending(task, options, answer))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="omniloop-episode-creator")
        return await answer

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            requests = [{"task": p.task, **p.options} for p in batch]
            try:
                outcomes: list[Any] = await asyncio.to_thread(
                    self.store.create_episodes, requests, max_queued=self.max_queued
                )
            except Exception as err:  # the database failed: every submission of the batch did
                outcomes = [err] * len(batch)
            for pending, outcome in zip(batch, outcomes, strict=True):
                if pending.answer.done():  # the request went away
                    continue
                if isinstance(outcome, BaseException):
                    pending.answer.set_exception(outcome)
                else:
                    pending.answer.set_result(outcome)
