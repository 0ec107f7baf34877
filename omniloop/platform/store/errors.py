"""Errors the run store raises. The REST layer maps them to problem+json statuses.

`NotFound` → 404, the `Conflict` family → 409 (`IdempotencyConflict` → 422 where the API
prefers it), `InvalidArgument` → 400, `SchemaNotReady` and `QueueFull` → 503. Database
failures that are not the caller's fault (connection lost, disk full) propagate as
SQLAlchemy's own exceptions.
"""

from __future__ import annotations

from omniloop.errors import OmniloopError


class StoreError(OmniloopError):
    """Base class of every error the run store raises on purpose."""


class NotFound(StoreError, LookupError):
    """The run or episode named in the call does not exist."""

    def __init__(self, kind: str, key: str) -> None:
        super().__init__(f"{kind} {key!r} does not exist")
        self.kind = kind
        self.key = key


class SchemaNotReady(StoreError):
    """The database has no (or an older) schema: call `Store.migrate()` first."""


class InvalidArgument(StoreError, ValueError):
    """An argument is malformed: an unknown cursor, a limit out of range, a bad status."""


class Conflict(StoreError):
    """The call is well formed but clashes with what the store already holds."""


class AlreadyExists(Conflict):
    """A run or episode with the caller-chosen id already exists."""


class IdempotencyConflict(Conflict):
    """An idempotency key was reused with a different request body."""

    def __init__(self, key: str, episode_id: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was first used for episode {episode_id!r} with a "
            "different request; use a new key for a different request"
        )
        self.key = key
        self.episode_id = episode_id


class InvalidTransition(Conflict):
    """The episode's current status does not allow the requested change."""

    def __init__(self, episode_id: str, current: str, requested: str, why: str = "") -> None:
        detail = f": {why}" if why else ""
        super().__init__(
            f"episode {episode_id!r} is {current!r} and cannot become {requested!r}{detail}"
        )
        self.episode_id = episode_id
        self.current = current
        self.requested = requested


class QueueFull(StoreError):
    """An episode was not created because `limit` episodes are already queued (the admission
    bound of `Store.create_episodes`). Nothing was written; the same request may be retried."""

    def __init__(self, limit: int, queued: int) -> None:
        super().__init__(
            f"{queued} episodes are queued, at the limit of {limit}; nothing was created"
        )
        self.limit = limit
        self.queued = queued
