"""Episode event streams: in-process wake-ups and the Server-Sent Events generator.

The store is the source of truth (event ids increase in commit order, so resuming after id N
never misses an event committed later). `EpisodeSignals` only makes streams prompt: whoever
changes an episode in this process calls `notify`, and the streams watching it look at the
store at once instead of at their next poll. Changes made by other processes are seen within
`poll_interval`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from sse_starlette import ServerSentEvent

from omniloop.platform.store import AsyncStore, EventRecord
from omniloop.platform.store.engine import json_dumps
from omniloop.platform.store.records import TERMINAL_EPISODE_STATUSES

EVENT_BATCH = 500
"""Events read from the store per query while a stream catches up."""


@dataclass
class _Watched:
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    watchers: int = 0


class EpisodeSignals:
    """Per-episode wake-ups for the streams (and anything else) watching an episode.

    Only episodes someone watches cost anything: `notify` on an unwatched episode is a dict
    miss, so the submission path stays cheap under load.
    """

    def __init__(self) -> None:
        self._watched: dict[str, _Watched] = {}

    def notify(self, episode_id: str) -> None:
        """Wake every watcher of `episode_id` (call after its events changed)."""
        watched = self._watched.get(episode_id)
        if watched is not None:
            watched.changed.set()
            # A fresh event for the next change; watchers holding the old one see it set.
            watched.changed = asyncio.Event()

    @contextlib.contextmanager
    def watching(self, episode_id: str) -> Iterator[_Watched]:
        """Register a watcher for the block; read `.changed` *before* looking at the store,
        then wait on it, so a change between the look and the wait is not missed."""
        watched = self._watched.setdefault(episode_id, _Watched())
        watched.watchers += 1
        try:
            yield watched
        finally:
            watched.watchers -= 1
            if watched.watchers == 0:
                self._watched.pop(episode_id, None)

    def __len__(self) -> int:
        return len(self._watched)


def is_terminal(event: EventRecord) -> bool:
    """True for the status event that puts an episode in a terminal status."""
    return event.type == "status" and event.data.get("status") in TERMINAL_EPISODE_STATUSES


def event_payload(event: EventRecord) -> dict[str, Any]:
    """What an SSE `data:` line carries (as JSON)."""
    return {
        "id": event.id,
        "episode_id": event.episode_id,
        "type": event.type,
        "created_at": event.created_at.isoformat(),
        "data": event.data,
    }


def to_sse(event: EventRecord) -> ServerSentEvent:
    return ServerSentEvent(
        data=json_dumps(event_payload(event)), event=event.type, id=str(event.id)
    )


async def episode_events(
    store: AsyncStore,
    signals: EpisodeSignals,
    episode_id: str,
    *,
    after_id: int = 0,
    poll_interval: float = 1.0,
) -> AsyncIterator[ServerSentEvent]:
    """Every event of the episode after `after_id`, then new ones as they are committed,
    ending after the event that makes the episode terminal.

    If the episode is already terminal and nothing is left after `after_id`, the stream ends
    at once (a client that resumes after the last event gets an empty stream).
    """
    with signals.watching(episode_id) as watched:
        while True:
            changed = watched.changed
            events = await store.list_events(episode_id, after_id=after_id, limit=EVENT_BATCH)
            for event in events:
                yield to_sse(event)
                after_id = event.id
                if is_terminal(event):
                    return
            if len(events) == EVENT_BATCH:
                continue
            if not events:
                episode = await store.get_episode(episode_id, with_trajectory=False)
                if episode.status in TERMINAL_EPISODE_STATUSES:
                    # Its terminal event may have been committed between the two reads.
                    for event in await store.list_events(
                        episode_id, after_id=after_id, limit=EVENT_BATCH
                    ):
                        yield to_sse(event)
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), poll_interval)
