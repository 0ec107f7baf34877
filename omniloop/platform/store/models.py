"""Tables of the run store (SQLAlchemy 2 typed declarative).

Schema decisions:
- Runs and episodes have an internal integer `seq` primary key and a public string `id`.
  `seq` gives a total, insertion-ordered key for keyset pagination on both SQLite (where only
  an INTEGER PRIMARY KEY autoincrements) and PostgreSQL; the string id is what callers see and
  what foreign keys reference.
- Trajectories live inline as JSON in their own table, keyed by the trajectory's deterministic
  id (DESIGN.md §2). Inline, so the embedded single-process default needs no object store; in
  a separate table, so listing episodes never reads megabytes of token arrays, and so an episode
  can later hold several segments (unique on episode, attempt, segment).
- JSON columns are PostgreSQL `json`, not `jsonb`: jsonb refuses the escape `\u0000`, and tool
  output (which event data carries) may hold NUL characters. Nothing queries inside them yet;
  an expression index can be added when something does. The trajectory body is text the store
  serializes itself: a 32k-token trajectory then costs one serialization on write and one
  pydantic JSON parse on read.
- Timestamps are timezone-aware UTC in Python on both databases (see `UTCDateTime`).
- No CHECK constraints on status columns: the store validates them, and new statuses then need
  no table rebuild on SQLite.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Deterministic constraint names, so later migrations can address them on both databases."""

BigIntPK: TypeEngine[int] = BigInteger().with_variant(Integer(), "sqlite")
"""64-bit ids on PostgreSQL; on SQLite only INTEGER PRIMARY KEY is the autoincrementing rowid."""

JsonDoc: TypeEngine[Any] = JSON()


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python.

    Naive datetimes are refused on the way in (their zone is unknown). SQLite has no zone-aware
    type, so values are stored there as naive UTC text, whose text order is time order.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: give timestamps in UTC with tzinfo")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class NanFloat(TypeDecorator[float]):
    """A double that round-trips NaN on both databases, as NULL.

    SQLite silently turns a bound NaN into NULL, while PostgreSQL stores it; mapping NaN to NULL
    everywhere keeps the two backends identical. The column is nullable for that reason only.
    """

    impl = Float(precision=53)
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> float | None:
        if value is None or math.isnan(value):
            return None
        return float(value)

    def process_result_value(self, value: float | None, dialect: Dialect) -> float:
        return math.nan if value is None else float(value)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class RunRow(Base):
    __tablename__ = "runs"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict[str, Any]] = mapped_column(JsonDoc)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    status_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_runs_status_seq", "status", "seq"),)


class EpisodeRow(Base):
    __tablename__ = "episodes"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE")
    )
    status: Mapped[str] = mapped_column(String(16))
    task: Mapped[dict[str, Any]] = mapped_column(JsonDoc)
    agent: Mapped[str] = mapped_column(String(255))
    sampling: Mapped[dict[str, Any]] = mapped_column(JsonDoc)
    reward: Mapped[float | None] = mapped_column(Float(precision=53))
    reward_info: Mapped[dict[str, float]] = mapped_column(JsonDoc)
    stop_reason: Mapped[str | None] = mapped_column(String(32))
    error_type: Mapped[str | None] = mapped_column(String(255))
    error_message: Mapped[str | None] = mapped_column(Text)
    timings: Mapped[dict[str, float]] = mapped_column(JsonDoc)
    num_turns: Mapped[int | None] = mapped_column(Integer)
    response_length: Mapped[int | None] = mapped_column(Integer)
    trajectory_id: Mapped[str | None] = mapped_column(String(64))
    # Unique, NULLs allowed (several per table on both databases): the key is optional.
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_hash: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    # One index per filter the episode browser offers, each ending in `seq`, so that a filtered
    # page is an index range read in key order: no sort, no scan of the run's other episodes.
    __table_args__ = (
        Index("ix_episodes_run_seq", "run_id", "seq"),
        Index("ix_episodes_run_status_seq", "run_id", "status", "seq"),
        Index("ix_episodes_run_stop_reason_seq", "run_id", "stop_reason", "seq"),
        Index("ix_episodes_run_error_type_seq", "run_id", "error_type", "seq"),
        # Across runs by status: the REST worker's queue of submitted episodes.
        Index("ix_episodes_status_seq", "status", "seq"),
    )


class TrajectoryRow(Base):
    __tablename__ = "trajectories"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    episode_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("episodes.id", ondelete="CASCADE")
    )
    attempt: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)
    """The trajectory as JSON text, serialized by the store (never queried inside)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())

    __table_args__ = (UniqueConstraint("episode_id", "attempt", "segment"),)


class MetricRow(Base):
    __tablename__ = "metrics"

    run_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[float] = mapped_column(NanFloat(), nullable=True)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # The primary key (run_id, name, step) is the index a chart query reads.


class EventRow(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("runs.id", ondelete="CASCADE")
    )
    episode_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("episodes.id", ondelete="CASCADE")
    )
    type: Mapped[str] = mapped_column(String(64))
    data: Mapped[dict[str, Any]] = mapped_column(JsonDoc)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())

    __table_args__ = (
        Index("ix_events_episode_id", "episode_id", "id"),
        Index("ix_events_run_id", "run_id", "id"),
        # A run's events of one type (its faults) without reading its episodes' events.
        Index("ix_events_run_type_id", "run_id", "type", "id"),
        # AUTOINCREMENT: SQLite never reuses an id, even after the newest events are deleted,
        # so an SSE client's Last-Event-ID can never point at a different event later.
        {"sqlite_autoincrement": True},
    )
