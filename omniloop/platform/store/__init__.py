"""Run persistence: runs, episodes, trajectories, metrics and events (DESIGN.md §8).

`Store(url)` talks to a SQLite file (the default, `sqlite:///runs/omniloop.db`, overridden by
`$OMNILOOP_DB_URL`) or PostgreSQL (`postgresql+psycopg://user@host/db`); `store.migrate()`
brings the schema to the newest Alembic revision. `AsyncStore` offers the same methods to async
code. See `store.py` for the guarantees and `models.py` for the schema.
"""

from omniloop.platform.store.aio import AsyncStore
from omniloop.platform.store.engine import DB_URL_ENV, DEFAULT_DB_URL, resolve_url
from omniloop.platform.store.errors import (
    AlreadyExists,
    Conflict,
    IdempotencyConflict,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    QueueFull,
    SchemaNotReady,
    StoreError,
)
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
from omniloop.platform.store.store import FAULT_EVENT, Store, hash_episode_request

__all__ = [
    "DB_URL_ENV",
    "DEFAULT_DB_URL",
    "FAULT_EVENT",
    "AlreadyExists",
    "AsyncStore",
    "Conflict",
    "EpisodeRecord",
    "EpisodeStatus",
    "EventRecord",
    "IdempotencyConflict",
    "InvalidArgument",
    "InvalidTransition",
    "MetricPoint",
    "NotFound",
    "Page",
    "QueueFull",
    "RoleFaults",
    "RunRecord",
    "RunStatus",
    "RunSummary",
    "SchemaNotReady",
    "Store",
    "StoreError",
    "hash_episode_request",
    "resolve_url",
]
