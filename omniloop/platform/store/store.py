"""The run store: runs, episodes, trajectories, metrics and events, in SQLite or PostgreSQL.

Every method is one short transaction on a pooled connection, so one `Store` may be shared by
any number of threads; async code calls it through `AsyncStore` (worker threads). Methods
return immutable records (`records.py`), never live ORM objects.

Guarantees on both databases:
- `create_episode` with an idempotency key creates at most one episode per key, however many
  callers race (a unique constraint decides; the losers read the winner's episode).
- Episode status only moves forward (`queued` → `running` → terminal) except for an explicit
  requeue of a running episode; the first terminal status wins.
- Event ids increase in commit order, so a reader that has seen id N and asks for events after
  N never misses one committed later (the SSE resume contract). Every status change appends a
  `status` event in the same transaction as the change.
- Listings are keyset-paginated on an insertion-ordered key, newest first: pages neither skip
  nor repeat rows while new rows arrive.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast, get_args

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from pydantic import ValidationError
from sqlalchemy import (
    Connection,
    CursorResult,
    Select,
    String,
    Table,
    and_,
    case,
    delete,
    distinct,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from omniloop.platform.store.engine import (
    WRITE_TRANSACTION,
    json_dumps,
    make_engine,
    resolve_url,
)
from omniloop.platform.store.errors import (
    AlreadyExists,
    IdempotencyConflict,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    QueueFull,
    SchemaNotReady,
    StoreError,
)
from omniloop.platform.store.models import (
    EpisodeRow,
    EventRow,
    MetricRow,
    RunRow,
    TrajectoryRow,
    utcnow,
)
from omniloop.platform.store.records import (
    EPISODE_STATUSES,
    RUN_STATUSES,
    TERMINAL_EPISODE_STATUSES,
    TERMINAL_RUN_STATUSES,
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
from omniloop.trajectory import INFRA_STOP_REASONS, Trajectory, TrajectoryMeta

MIGRATIONS_DIR = Path(__file__).with_name("migrations")

# The tables behind the ORM classes, for Core statements on hot paths.
EPISODES = cast(Table, EpisodeRow.__table__)
EVENTS = cast(Table, EventRow.__table__)
TRAJECTORIES = cast(Table, TrajectoryRow.__table__)

MAX_PAGE = 1000
"""Largest `limit` of one page of runs or episodes."""
MAX_EVENTS = 10_000
"""Largest `limit` of one `list_events` call."""
SUMMARY_METRIC = "reward/mean"
"""The metric a run summary follows for progress and reward (see `RunSummary`)."""
TREND_POINTS = 32
"""Default number of points in a run summary's reward trend (a sparkline's worth)."""
MAX_TREND_POINTS = 1000
"""Largest `trend_points` of one `run_summaries` call."""
FAULT_EVENT = "fault"
"""The type of a run event that records a fault of one of its roles (`control/faults.py`)."""
UNKNOWN_ROLE = "unknown"
"""What `role_faults` names the role of a fault event without a `role` (other values are
read as text)."""

# Event appends on PostgreSQL hold this transaction-scoped advisory lock from taking an id to
# committing. Without it a transaction that took id 7 could commit after one that took id 8,
# and an SSE client that had already resumed after 8 would never see 7.
EVENTS_LOCK_KEY = 0x6F6C2D6576656E74  # "ol-event" in ASCII

# Alembic keeps the running migration environment in module globals (`alembic.context`,
# `alembic.op`): two threads migrating at once would run each other's steps. Processes are
# serialized by the database instead (see migrations/env.py).
_MIGRATE_LOCK = threading.Lock()

# The statuses an episode may be in for `update_episode_status` to move it to the key status.
_MOVABLE_FROM: dict[str, frozenset[str]] = {
    "queued": frozenset({"running"}),  # requeue after the worker running it died
    "running": frozenset({"queued"}),
    "failed": frozenset({"queued", "running"}),
    "cancelled": frozenset({"queued", "running"}),
}


def _new_id() -> str:
    return uuid.uuid4().hex


def _json_doc(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """`value` as the plain JSON object the database will hand back (tuples become lists)."""
    if value is None:
        return {}
    try:
        doc = json.loads(json_dumps(value))
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"{what} is not a JSON document: {err}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {type(value).__name__}")
    return doc


def _check_limit(limit: int, maximum: int) -> None:
    if not 1 <= limit <= maximum:
        raise InvalidArgument(f"limit must be between 1 and {maximum}, got {limit}")


def _check_id(value: str, what: str) -> None:
    if not value or len(value) > 64:
        raise InvalidArgument(f"{what} must be 1 to 64 characters, got {value!r}")


MAX_STATUS_REASON = 4000
"""Characters of a run's `status_reason` kept (the rest of a long error is in the run's log)."""


def _check_length(value: str | None, what: str, maximum: int = 255) -> None:
    # PostgreSQL refuses an over-long VARCHAR where SQLite would store it: check for both.
    if value is not None and len(value) > maximum:
        raise InvalidArgument(f"{what} must be at most {maximum} characters, got {len(value)}")


def _text(value: str | None) -> str | None:
    """`value` storable in a PostgreSQL text column, which cannot hold NUL characters."""
    return value.replace("\x00", "\ufffd") if value is not None else None


def _decode_cursor(cursor: str | None) -> int | None:
    """The `seq` a cursor points below. Cursors are opaque to callers; this one is a number."""
    if cursor is None:
        return None
    try:
        seq = int(cursor)
    except ValueError:
        seq = 0
    if seq <= 0:
        raise InvalidArgument(f"invalid cursor {cursor!r}: pass back a next_cursor unchanged")
    return seq


def hash_episode_request(
    *,
    task: Mapping[str, Any],
    run_id: str | None = None,
    agent: str = "",
    sampling: Mapping[str, Any] | None = None,
    episode_id: str | None = None,
) -> str:
    """A stable hash of an episode request, used when `create_episode` is given no hash.

    Key order in the JSON documents does not matter; any other difference does.
    """
    doc = {
        "run_id": run_id,
        "task": task,
        "agent": agent,
        "sampling": dict(sampling or {}),
        "episode_id": episode_id,
    }
    try:
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"episode request is not a JSON document: {err}") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


def queued_count_query(at_most: int) -> Select[int]:
    """How many episodes are `queued`, counting no further than `at_most`: a range read of
    `ix_episodes_status_seq` (covering: `seq` is in the index) whose cost is bounded by
    `at_most`, however long the queue. `create_episodes`' admission count."""
    head = select(EPISODES.c.seq).where(EPISODES.c.status == "queued").limit(at_most).subquery()
    return select(func.count()).select_from(head)


def _final_status(meta: TrajectoryMeta) -> EpisodeStatus:
    if meta.stop_reason == "cancelled":
        return "cancelled"
    if meta.error is not None or meta.stop_reason in INFRA_STOP_REASONS:
        return "failed"
    return "completed"


def _trajectory_body(trajectory: Trajectory) -> str:
    """The trajectory as the JSON text the store keeps; `InvalidArgument` if it is not storable
    (fails `Trajectory.check()` or holds a non-finite number, which JSON cannot carry)."""
    try:
        trajectory.check()
        return json_dumps(trajectory.model_dump(mode="json"))
    except ValueError as err:
        raise InvalidArgument(f"cannot store trajectory {trajectory.id}: {err}") from None


def _outcome(trajectory: Trajectory) -> dict[str, Any]:
    """The episode columns a trajectory decides: reward, stop reason, error, timings, sizes."""
    meta = trajectory.meta
    return {
        "trajectory_id": trajectory.id,
        "reward": trajectory.reward,
        "reward_info": dict(trajectory.reward_info),
        "stop_reason": meta.stop_reason,
        # The trajectory is recorded whatever its error: clip rather than refuse an odd one.
        "error_type": meta.error.type[:255] if meta.error is not None else None,
        "error_message": _text(meta.error.message) if meta.error is not None else None,
        "timings": dict(meta.timings),
        "num_turns": len(meta.turns),
        "response_length": trajectory.response_length,
    }


def _trend_steps(first: int, last: int, points: int) -> list[int] | None:
    """`points` steps spread evenly from `first` to `last`, both included; None when the
    range holds no more steps than that (then all of them are read)."""
    if last - first < points:
        return None
    span = last - first
    return sorted({first + (span * i) // (points - 1) for i in range(points)})


def _finite_seconds(doc: Any) -> float | None:
    """A fault event's `recovery_seconds` when it is a finite number, else None."""
    seconds = doc.get("recovery_seconds") if isinstance(doc, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    return float(seconds) if math.isfinite(seconds) else None


def _run_record(row: RunRow) -> RunRecord:
    return RunRecord.model_validate(
        {
            "id": row.id,
            "name": row.name,
            "status": row.status,
            "config": row.config,
            "created_at": row.created_at,
            "updated_at": row.updated_at,
            "finished_at": row.finished_at,
            "status_reason": row.status_reason,
        }
    )


def _episode_record(row: EpisodeRow, trajectory: Trajectory | None = None) -> EpisodeRecord:
    return EpisodeRecord.model_validate(
        {
            "id": row.id,
            "run_id": row.run_id,
            "status": row.status,
            "task": row.task,
            "agent": row.agent,
            "sampling": row.sampling,
            "reward": row.reward,
            "reward_info": row.reward_info,
            "stop_reason": row.stop_reason,
            "error_type": row.error_type,
            "error_message": row.error_message,
            "timings": row.timings,
            "num_turns": row.num_turns,
            "response_length": row.response_length,
            "trajectory_id": row.trajectory_id,
            "idempotency_key": row.idempotency_key,
            "created_at": row.created_at,
            "updated_at": row.updated_at,
            "started_at": row.started_at,
            "finished_at": row.finished_at,
            "trajectory": trajectory,
        }
    )


def _new_episode_record(values: Mapping[str, Any]) -> EpisodeRecord:
    """The record of an episode just inserted with `values` (no trajectory, no outcome yet)."""
    return EpisodeRecord.model_validate(
        {
            **{key: value for key, value in values.items() if key != "request_hash"},
            "stop_reason": None,
            "error_type": None,
            "error_message": None,
            "num_turns": None,
            "response_length": None,
            "trajectory_id": None,
            "finished_at": None,
        }
    )


def _event_record(row: EventRow) -> EventRecord:
    return EventRecord(
        id=row.id,
        run_id=row.run_id,
        episode_id=row.episode_id,
        type=row.type,
        data=row.data,
        created_at=row.created_at,
    )


def _is_missing_table(err: OperationalError | ProgrammingError) -> bool:
    message = str(err.orig)
    return "no such table" in message or ("relation" in message and "does not exist" in message)


class Store:
    """Persistence of runs, episodes, metrics and events; see the module docstring.

    `url`: a SQLAlchemy URL (`sqlite:///path.db`, `postgresql+psycopg://user@host/db`); None
    means `$OMNILOOP_DB_URL`, else `sqlite:///runs/omniloop.db`. The schema is not created by
    the constructor: call `migrate()` once per process start (it is a no-op at head, and safe
    to run from several processes at once).
    """

    def __init__(self, url: str | None = None, *, echo: bool = False) -> None:
        self.url = resolve_url(url)
        self.engine = make_engine(self.url, echo=echo)
        self.dialect = self.engine.dialect.name
        """`sqlite` or `postgresql`."""
        # Same pool; connections taken through `_write_engine` begin with BEGIN IMMEDIATE on
        # SQLite (see engine.py).
        self._write_engine = self.engine.execution_options(**{WRITE_TRANSACTION: True})
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)

    def close(self) -> None:
        """Close every pooled connection. The store must not be used afterwards."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    # ---- schema ----

    def alembic_config(self) -> AlembicConfig:
        """An Alembic config for this database, for `alembic.command` calls (e.g. `revision`)."""
        config = AlembicConfig()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        # Alembic's config is an INI parser: a literal % in a password must be doubled.
        url = self.engine.url.render_as_string(hide_password=False)
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
        return config

    def migrate(self, revision: str = "head") -> None:
        """Upgrade the schema to `revision` (default: the newest), in one transaction.

        Safe to call from several threads and processes at once: one migrates, the others
        wait and then find the schema at `revision`.
        """
        config = self.alembic_config()
        with _MIGRATE_LOCK, self._write_engine.connect() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)

    def current_revision(self) -> str | None:
        """The schema revision the database is at; None for an empty database."""
        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    @staticmethod
    def head_revision() -> str:
        """The newest schema revision this version of omniloop knows."""
        head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
        if head is None:
            raise SchemaNotReady(f"no migrations found in {MIGRATIONS_DIR}")
        return head

    # ---- transactions ----

    @contextmanager
    def _reading(self) -> Iterator[Session]:
        try:
            with self._read() as session:
                yield session
        except (OperationalError, ProgrammingError) as err:
            if _is_missing_table(err):
                raise SchemaNotReady(
                    f"{self!r} has no omniloop schema: call Store.migrate() first"
                ) from err
            raise

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        try:
            with self._write() as session, session.begin():
                yield session
        except (OperationalError, ProgrammingError) as err:
            if _is_missing_table(err):
                raise SchemaNotReady(
                    f"{self!r} has no omniloop schema: call Store.migrate() first"
                ) from err
            raise

    @contextmanager
    def _writing_core(self) -> Iterator[Connection]:
        """A write transaction on a bare connection, for Core statements on hot paths."""
        try:
            with self._write_engine.begin() as connection:
                yield connection
        except (OperationalError, ProgrammingError) as err:
            if _is_missing_table(err):
                raise SchemaNotReady(
                    f"{self!r} has no omniloop schema: call Store.migrate() first"
                ) from err
            raise

    def _lock_events(self, session: Session | Connection) -> None:
        if self.dialect == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": EVENTS_LOCK_KEY})

    def _add_event(
        self,
        session: Session | Connection,
        type: str,
        data: dict[str, Any],
        *,
        run_id: str | None,
        episode_id: str | None,
    ) -> int:
        """Insert one event inside the caller's write transaction; return its id.

        A Core insert, not an ORM add + flush: it is on the path of every write, and the unit
        of work costs several times the insert itself. (A session executes it at once, before
        the session's pending ORM changes, which are flushed at commit in the same
        transaction.)
        """
        self._lock_events(session)
        result = session.execute(
            insert(EVENTS),
            {
                "run_id": run_id,
                "episode_id": episode_id,
                "type": type,
                "data": data,
                "created_at": utcnow(),
            },
        )
        key = cast("CursorResult[Any]", result).inserted_primary_key
        if key is None:  # only for statements that insert no row
            raise RuntimeError("the event insert reported no id")
        return int(key[0])

    @staticmethod
    def _run_exists(session: Session | Connection, run_id: str) -> bool:
        return session.scalar(select(RunRow.seq).where(RunRow.id == run_id)) is not None

    @staticmethod
    def _episode_exists(session: Session, episode_id: str) -> bool:
        return session.scalar(select(EpisodeRow.seq).where(EpisodeRow.id == episode_id)) is not None

    # ---- runs ----

    def create_run(
        self,
        name: str = "",
        config: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        status: RunStatus = "created",
    ) -> RunRecord:
        """Create a run. `run_id` defaults to a random hex id; an existing id raises
        `AlreadyExists`. `config` is the resolved configuration (a JSON object)."""
        if status not in RUN_STATUSES:
            raise InvalidArgument(f"unknown run status {status!r}; one of {sorted(RUN_STATUSES)}")
        run_id = run_id if run_id is not None else _new_id()
        _check_id(run_id, "run id")
        _check_length(name, "run name")
        now = utcnow()
        row = RunRow(
            id=run_id,
            name=name,
            status=status,
            config=_json_doc(config, "run config"),
            created_at=now,
            updated_at=now,
            finished_at=now if status in TERMINAL_RUN_STATUSES else None,
        )
        try:
            with self._writing() as session:
                session.add(row)
        except IntegrityError:
            raise AlreadyExists(f"run {run_id!r} already exists") from None
        return _run_record(row)

    def get_run(self, run_id: str) -> RunRecord:
        """The run; `NotFound` if there is none."""
        with self._reading() as session:
            row = session.scalar(select(RunRow).where(RunRow.id == run_id))
            if row is None:
                raise NotFound("run", run_id)
            return _run_record(row)

    def list_runs(
        self, *, status: RunStatus | None = None, cursor: str | None = None, limit: int = 50
    ) -> Page[RunRecord]:
        """Runs, newest first, optionally of one status; keyset-paginated by `cursor`."""
        _check_limit(limit, MAX_PAGE)
        below = _decode_cursor(cursor)
        query = select(RunRow)
        if status is not None:
            query = query.where(RunRow.status == status)
        if below is not None:
            query = query.where(RunRow.seq < below)
        query = query.order_by(RunRow.seq.desc()).limit(limit + 1)
        with self._reading() as session:
            rows = list(session.scalars(query))
        # One row more than asked tells whether another page exists.
        next_cursor = str(rows[limit - 1].seq) if len(rows) > limit else None
        return Page[RunRecord](
            items=[_run_record(r) for r in rows[:limit]], next_cursor=next_cursor
        )

    def run_summaries(
        self, run_ids: Sequence[str], *, trend_points: int = TREND_POINTS
    ) -> dict[str, RunSummary]:
        """Run id → `RunSummary` for the runs of `run_ids` that exist (others are left out).

        Two statements whatever the runs' sizes, each a handful of index lookups per run: the
        first and newest step and the newest value of `SUMMARY_METRIC` are the ends of an
        index range (metrics' primary key), the error count reads only the matching entries of
        the episodes' stop-reason index, and the trend reads `trend_points` keys per run. A
        page of runs therefore costs the same with ten steps each as with a million.
        """
        if isinstance(run_ids, str):
            raise InvalidArgument("run_ids must be a list of run ids, not one string")
        ids = list(dict.fromkeys(run_ids))
        if len(ids) > MAX_PAGE:
            raise InvalidArgument(f"at most {MAX_PAGE} run ids at once, got {len(ids)}")
        if not 2 <= trend_points <= MAX_TREND_POINTS:
            raise InvalidArgument(
                f"trend_points must be 2 to {MAX_TREND_POINTS}, got {trend_points!r}"
            )
        if not ids:
            return {}
        metric = (MetricRow.run_id == RunRow.id) & (MetricRow.name == SUMMARY_METRIC)

        def end(column: Any, newest: bool) -> Any:
            order = MetricRow.step.desc() if newest else MetricRow.step.asc()
            return select(column).where(metric).order_by(order).limit(1).scalar_subquery()

        errors = (
            select(func.count())
            .select_from(EpisodeRow)
            .where(
                EpisodeRow.run_id == RunRow.id,
                EpisodeRow.stop_reason.in_(sorted(INFRA_STOP_REASONS)),
            )
            .scalar_subquery()
        )
        ends = select(
            RunRow.id,
            end(MetricRow.step, newest=False),
            end(MetricRow.step, newest=True),
            end(MetricRow.value, newest=True),
            errors,
        ).where(RunRow.id.in_(ids))
        with self._reading() as session:
            found = list(session.execute(ends))
            wanted = []
            for run_id, first, last, _, _ in found:
                if last is None:
                    continue
                steps = _trend_steps(first, last, trend_points)
                wanted.append(
                    and_(
                        MetricRow.run_id == run_id,
                        MetricRow.name == SUMMARY_METRIC,
                        MetricRow.step.between(first, last)
                        if steps is None
                        else MetricRow.step.in_(steps),
                    )
                )
            trends: dict[str, list[MetricPoint]] = {}
            if wanted:
                points = select(
                    MetricRow.run_id, MetricRow.step, MetricRow.value, MetricRow.recorded_at
                ).where(or_(*wanted))
                for run_id, step, value, recorded_at in session.execute(points):
                    point = MetricPoint.model_construct(step=step, value=value, time=recorded_at)
                    trends.setdefault(run_id, []).append(point)
        return {
            run_id: RunSummary(
                run_id=run_id,
                steps_done=0 if last is None else last + 1,
                latest_reward=None if last is None else value,
                reward_trend=sorted(trends.get(run_id, []), key=lambda p: p.step),
                infra_errors=int(count),
            )
            for run_id, _, last, value, count in found
        }

    def update_run_status(
        self, run_id: str, status: RunStatus, reason: str | None = None
    ) -> RunRecord:
        """Set a run's status and why it is in it (`reason`, a sentence, or None when there
        is nothing to say; any status may follow any other: a finished run can resume).

        `finished_at` is set on entering `completed`, `failed` or `cancelled` and cleared on
        leaving them. A change appends a `status` event to the run's stream (with the reason
        when there is one); setting the current status and reason again changes nothing. A
        reason longer than `MAX_STATUS_REASON` characters is cut to it, marked with "…".
        """
        if status not in RUN_STATUSES:
            raise InvalidArgument(f"unknown run status {status!r}; one of {sorted(RUN_STATUSES)}")
        if reason is not None and len(reason) > MAX_STATUS_REASON:
            reason = reason[: MAX_STATUS_REASON - 1] + "…"  # an error's text can be any length
        reason = _text(reason)
        with self._writing() as session:
            row = session.scalar(
                select(RunRow).where(RunRow.id == run_id).with_for_update(key_share=True)
            )
            if row is None:
                raise NotFound("run", run_id)
            if row.status != status or row.status_reason != reason:
                now = utcnow()
                if row.status != status:
                    row.finished_at = now if status in TERMINAL_RUN_STATUSES else None
                row.status = status
                row.status_reason = reason
                row.updated_at = now
                event = {"status": status, **({"reason": reason} if reason is not None else {})}
                self._add_event(session, "status", event, run_id=run_id, episode_id=None)
            return _run_record(row)

    # ---- metrics ----

    def record_run_event(self, run_id: str, type: str, data: dict[str, Any]) -> int:
        """Append an event of `type` to a run's events (a fault of the run's roles, say);
        return its id. `NotFound` if the run does not exist."""
        with self._writing_core() as connection:
            if not self._run_exists(connection, run_id):
                raise NotFound("run", run_id)
            return self._add_event(connection, type, data, run_id=run_id, episode_id=None)

    def role_faults(self, run_ids: Sequence[str]) -> list[RoleFaults]:
        """Per run of `run_ids` and role: how many faults it has (its `fault` events, those of
        one `fault_id` counted once) and the recovery time of the newest that recovered;
        ordered by run (as given) and role. Runs without faults, and ids that name no run, are
        left out.

        Two statements, reading only the fault events of these runs (index
        `ix_events_run_type_id`), never their episodes' events: the counts and, per role, the
        id of the newest event with a `recovery_seconds`, then those events' data.
        """
        if isinstance(run_ids, str):
            raise InvalidArgument("run_ids must be a list of run ids, not one string")
        ids = list(dict.fromkeys(run_ids))
        if len(ids) > MAX_PAGE:
            raise InvalidArgument(f"at most {MAX_PAGE} run ids at once, got {len(ids)}")
        if not ids:
            return []
        role = EventRow.data["role"].as_string()
        recovered = EventRow.data["recovery_seconds"].as_string().is_not(None)
        # A fault is recorded when detected and again when recovered, under one `fault_id`;
        # an event without one (recorded before faults had ids) is a fault of its own.
        fault = func.coalesce(EventRow.data["fault_id"].as_string(), sql_cast(EventRow.id, String))
        counts = (
            select(
                EventRow.run_id,
                role,
                func.count(distinct(fault)),
                func.max(case((recovered, EventRow.id), else_=None)),
            )
            .where(EventRow.run_id.in_(ids), EventRow.type == FAULT_EVENT)
            .group_by(EventRow.run_id, role)
        )
        # Per (run, role): fault count and the id of the newest recovered fault. Roles read as
        # text; events without one are merged under `UNKNOWN_ROLE`.
        groups: dict[tuple[str, str], tuple[int, int | None]] = {}
        with self._reading() as session:
            for run_id, name, count, event_id in session.execute(counts):
                key = (run_id, name if name is not None else UNKNOWN_ROLE)
                before_count, before_id = groups.get(key, (0, None))
                newest = max((i for i in (before_id, event_id) if i is not None), default=None)
                groups[key] = (before_count + int(count), newest)
            wanted = [event_id for _, event_id in groups.values() if event_id is not None]
            docs: dict[int, Any] = {}
            if wanted:
                rows = session.execute(
                    select(EventRow.id, EventRow.data).where(EventRow.id.in_(wanted))
                )
                docs = {event_id: doc for event_id, doc in rows}
        order = {run_id: n for n, run_id in enumerate(ids)}
        return [
            RoleFaults(
                run_id=run_id,
                role=role_name,
                count=count,
                latest_recovery_seconds=(
                    None if event_id is None else _finite_seconds(docs.get(event_id))
                ),
            )
            for (run_id, role_name), (count, event_id) in sorted(
                groups.items(), key=lambda item: (order[item[0][0]], item[0][1])
            )
        ]

    def record_metrics(self, run_id: str, step: int, values: Mapping[str, float]) -> None:
        """Record `values` (metric name → number) at `step` of a run.

        Recording a name at a step it already has overwrites the value, so a run resumed from
        a checkpoint may log its steps again. NaN is stored and read back as NaN; infinities
        are kept. `NotFound` if the run does not exist.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidArgument(f"step must be an integer, got {step!r}")
        rows: list[dict[str, Any]] = []
        now = utcnow()
        for name, value in values.items():
            if not name or len(name) > 255:
                raise InvalidArgument(f"metric name must be 1 to 255 characters, got {name!r}")
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise InvalidArgument(f"metric {name!r} is not a number: {value!r}") from None
            rows.append(
                {"run_id": run_id, "name": name, "step": step, "value": number, "recorded_at": now}
            )
        with self._writing() as session:
            if not self._run_exists(session, run_id):
                raise NotFound("run", run_id)
            if not rows:
                return
            insert = pg_insert if self.dialect == "postgresql" else sqlite_insert
            statement = insert(MetricRow)
            statement = statement.on_conflict_do_update(
                index_elements=[MetricRow.run_id, MetricRow.name, MetricRow.step],
                set_={
                    "value": statement.excluded.value,
                    "recorded_at": statement.excluded.recorded_at,
                },
            )
            session.execute(statement, rows)

    def get_metrics(
        self,
        run_id: str,
        names: Sequence[str] | None = None,
        *,
        since_step: int | None = None,
    ) -> dict[str, list[MetricPoint]]:
        """A run's metrics: name → points in step order.

        `names` restricts to those metrics (names never recorded are absent from the result);
        `since_step` keeps only steps strictly after it, for polling ("what is new since the
        last step I drew"). `NotFound` if the run does not exist.
        """
        if isinstance(names, str):
            raise InvalidArgument("names must be a list of metric names, not one string")
        # Plain columns and unvalidated records: a dashboard polls thousands of points, and ORM
        # objects plus per-row validation cost ~10x the query itself.
        query = select(MetricRow.name, MetricRow.step, MetricRow.value, MetricRow.recorded_at)
        query = query.where(MetricRow.run_id == run_id)
        if names is not None:
            if not names:
                return {}
            query = query.where(MetricRow.name.in_(list(names)))
        if since_step is not None:
            query = query.where(MetricRow.step > since_step)
        query = query.order_by(MetricRow.name, MetricRow.step)
        result: dict[str, list[MetricPoint]] = {}
        with self._reading() as session:
            if not self._run_exists(session, run_id):
                raise NotFound("run", run_id)
            for name, step, value, recorded_at in session.execute(query):
                point = MetricPoint.model_construct(step=step, value=value, time=recorded_at)
                result.setdefault(name, []).append(point)
        return result

    # ---- episodes ----

    def create_episode(
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
        """Create an episode; return it and whether this call created it.

        Without `idempotency_key` every call creates an episode (a caller-chosen `episode_id`
        that exists raises `AlreadyExists`). With a key, the first call creates the episode and
        every later or concurrent call with the same key returns that episode and False, if its
        request hash matches; a different hash raises `IdempotencyConflict`. `request_hash`
        defaults to `hash_episode_request(...)` of the arguments; the REST layer may pass a hash
        of the raw request body instead. `status` is `queued` (submitted, waiting for a worker)
        or `running` (a rollout worker creating the episode it is about to run). `NotFound` if
        `run_id` names no run. Creation appends a `status` event.
        """
        values = self._episode_values(
            task,
            run_id=run_id,
            agent=agent,
            sampling=sampling,
            episode_id=episode_id,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            status=status,
        )
        try:
            with self._writing_core() as connection:
                self._insert_episode(connection, values)
            return _new_episode_record(values), True
        except IntegrityError:
            pass
        return self._existing_episode(values)

    def create_episodes(
        self, requests: Sequence[Mapping[str, Any]], *, max_queued: int | None = None
    ) -> list[tuple[EpisodeRecord, bool] | StoreError]:
        """Create several episodes in one transaction: per request, what `create_episode`
        returns, or the `StoreError` it raises.

        Each request is the keyword arguments of `create_episode` (`task` included), and gets
        exactly its guarantees: each insert runs in its own savepoint, so a clash (an
        idempotency key already used, an id taken) or a missing run affects that request only.
        What is shared is one commit, which on SQLite is most of an insert's cost; a REST
        server under load writes the submissions that queued up meanwhile this way. A
        database failure (connection lost, disk full) raises and creates none.

        `max_queued` bounds the queue (the REST API's back-pressure): a request that would
        create a `queued` episode while `max_queued` episodes (of any run or none) are queued
        gets `QueueFull` instead, in request order, and writes nothing, so its idempotency key
        stays unused. A request whose key is already used still gets that episode (or
        `IdempotencyConflict`), full queue or not. The queued episodes are counted in the same
        write transaction as the inserts (SQLite's write lock; the events lock on PostgreSQL),
        so concurrent calls, in threads or processes, never admit more than `max_queued`
        between them. The count reads at most `max_queued` entries of `ix_episodes_status_seq`.
        """
        if max_queued is not None and max_queued < 1:
            raise InvalidArgument(f"max_queued must be at least 1 (or None), not {max_queued}")
        outcomes: list[tuple[EpisodeRecord, bool] | StoreError | None] = [None] * len(requests)
        prepared: list[tuple[int, dict[str, Any]]] = []
        for index, request in enumerate(requests):
            try:
                prepared.append((index, self._episode_values(**request)))
            except StoreError as err:
                outcomes[index] = err
        clashed: list[tuple[int, dict[str, Any]]] = []
        refused: list[tuple[int, dict[str, Any]]] = []
        queued = 0
        if prepared:
            with self._writing_core() as connection:
                if max_queued is not None:
                    # Before the count: on PostgreSQL every status change holds this lock to
                    # its commit, so the count sees every other writer's episodes.
                    self._lock_events(connection)
                    queued = int(connection.scalar(queued_count_query(max_queued)) or 0)
                for index, values in prepared:
                    if (
                        max_queued is not None
                        and values["status"] == "queued"
                        and queued >= max_queued
                    ):
                        refused.append((index, values))
                        continue
                    try:
                        with connection.begin_nested():
                            self._insert_episode(connection, values)
                    except IntegrityError:
                        clashed.append((index, values))
                    except StoreError as err:
                        outcomes[index] = err
                    else:
                        outcomes[index] = (_new_episode_record(values), True)
                        if values["status"] == "queued":
                            queued += 1
        for index, values in clashed:
            try:
                outcomes[index] = self._existing_episode(values)
            except StoreError as err:
                outcomes[index] = err
        for index, values in refused:
            assert max_queued is not None
            try:
                outcomes[index] = self._refused_episode(values, max_queued, queued)
            except StoreError as err:
                outcomes[index] = err
        return [outcome for outcome in outcomes if outcome is not None]

    def _refused_episode(
        self, values: Mapping[str, Any], max_queued: int, queued: int
    ) -> tuple[EpisodeRecord, bool]:
        """A request the full queue kept out: the episode its idempotency key already names
        (a replay creates nothing, so it needs no room), else `QueueFull`."""
        if values["idempotency_key"] is not None:
            try:
                return self._existing_episode(values)
            except AlreadyExists:
                pass
        raise QueueFull(max_queued, queued)

    def _episode_values(
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
    ) -> dict[str, Any]:
        """The row of a new episode, with every argument checked (`InvalidArgument`)."""
        if status not in ("queued", "running"):
            raise InvalidArgument(f"an episode starts queued or running, not {status!r}")
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidArgument("idempotency key must be 1 to 255 characters")
        _check_length(agent, "agent name")
        task_doc = _json_doc(task, "episode task")
        sampling_doc = _json_doc(sampling, "sampling options")
        if idempotency_key is not None and request_hash is None:
            request_hash = hash_episode_request(
                task=task_doc,
                run_id=run_id,
                agent=agent,
                sampling=sampling_doc,
                episode_id=episode_id,
            )
        new_id = episode_id if episode_id is not None else _new_id()
        _check_id(new_id, "episode id")
        now = utcnow()
        return {
            "id": new_id,
            "run_id": run_id,
            "status": status,
            "task": task_doc,
            "agent": agent,
            "sampling": sampling_doc,
            "reward": None,
            "reward_info": {},
            "timings": {},
            "idempotency_key": idempotency_key,
            "request_hash": request_hash if idempotency_key is not None else None,
            "created_at": now,
            "updated_at": now,
            "started_at": now if status == "running" else None,
        }

    def _insert_episode(self, connection: Connection, values: Mapping[str, Any]) -> None:
        """Insert a new episode and its first status event (raises `IntegrityError` on a
        clash). Core statements on a bare connection: this is the REST API's submission path,
        where the ORM's session and unit of work cost more than the inserts."""
        run_id = values["run_id"]
        if run_id is not None and not self._run_exists(connection, run_id):
            raise NotFound("run", run_id)
        # Insert first, look up on failure: the unique constraint is the only arbiter that
        # holds across processes and on both databases.
        connection.execute(insert(EPISODES), values)
        self._add_event(
            connection,
            "status",
            {"status": values["status"]},
            run_id=run_id,
            episode_id=values["id"],
        )

    def _existing_episode(self, values: Mapping[str, Any]) -> tuple[EpisodeRecord, bool]:
        """After an insert of `values` clashed: the episode its idempotency key names, or
        `IdempotencyConflict` (another request used the key) or `AlreadyExists` (the id)."""
        key = values["idempotency_key"]
        if key is not None:
            # A fresh transaction: on PostgreSQL the failed one is aborted.
            with self._reading() as session:
                existing = session.scalar(
                    select(EpisodeRow).where(EpisodeRow.idempotency_key == key)
                )
            if existing is not None:
                if existing.request_hash != values["request_hash"]:
                    raise IdempotencyConflict(key, existing.id)
                return _episode_record(existing), False
        raise AlreadyExists(f"episode {values['id']!r} already exists")

    def update_episode_status(
        self,
        episode_id: str,
        status: EpisodeStatus,
        *,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> EpisodeRecord:
        """Move an episode to `status`, atomically; return the episode as it now is.

        Allowed: `queued` → `running`; `queued`/`running` → `failed` or `cancelled`;
        `running` → `queued` (requeue after its worker died). Setting the current status again
        is a no-op (so a repeated cancel succeeds). Anything else raises `InvalidTransition`;
        `completed` is reached only through `finish_episode`, which stores the trajectory.
        `error_type`/`error_message` may accompany `failed` or `cancelled`. A change appends a
        `status` event.
        """
        if status not in EPISODE_STATUSES:
            raise InvalidArgument(
                f"unknown episode status {status!r}; one of {sorted(EPISODE_STATUSES)}"
            )
        if status == "completed":
            raise InvalidArgument(
                "an episode completes with its trajectory: call finish_episode instead"
            )
        if (error_type or error_message) and status not in ("failed", "cancelled"):
            raise InvalidArgument(f"an error can accompany failed or cancelled, not {status!r}")
        _check_length(error_type, "error type")
        with self._writing() as session:
            # FOR NO KEY UPDATE, not FOR UPDATE: it does not block the key-share locks that
            # foreign-key checks of concurrent event inserts take on this row.
            row = session.scalar(
                select(EpisodeRow)
                .where(EpisodeRow.id == episode_id)
                .with_for_update(key_share=True)
            )
            if row is None:
                raise NotFound("episode", episode_id)
            if row.status == status:
                return _episode_record(row)
            if row.status not in _MOVABLE_FROM[status]:
                raise InvalidTransition(episode_id, row.status, status)
            now = utcnow()
            row.status = status
            row.updated_at = now
            if status == "running":
                row.started_at = now
            elif status == "queued":
                row.started_at = None
            else:
                row.finished_at = now
                row.error_type = error_type
                row.error_message = _text(error_message)
            data: dict[str, Any] = {"status": status}
            if error_type is not None:
                data["error_type"] = error_type
            self._add_event(session, "status", data, run_id=row.run_id, episode_id=episode_id)
            return _episode_record(row)

    def finish_episode(self, episode_id: str, trajectory: Trajectory) -> EpisodeRecord:
        """Store an episode's trajectory and its summary; return the episode as it now is.

        The summary columns (reward, reward components, stop_reason, error, timings, number of
        turns, response length) come from the trajectory. A queued or running episode becomes
        `cancelled` (stop_reason `cancelled`), `failed` (an error or an infrastructure stop
        reason) or `completed`. An episode already cancelled or failed keeps its status (the
        first terminal status wins) and gains the trajectory. Finishing again with the same
        trajectory id is a no-op, so a retried call succeeds; a different trajectory raises
        `InvalidTransition`. The trajectory must belong to this episode
        (`trajectory.meta.episode_id`), pass `Trajectory.check()`, and hold only finite numbers
        (JSON has no NaN); otherwise `InvalidArgument`. Appends a `status` event.
        """
        meta = trajectory.meta
        if meta.episode_id != episode_id:
            raise InvalidArgument(
                f"trajectory {trajectory.id} belongs to episode {meta.episode_id!r}, "
                f"not {episode_id!r}"
            )
        body = _trajectory_body(trajectory)
        with self._writing() as session:
            row = session.scalar(
                select(EpisodeRow)
                .where(EpisodeRow.id == episode_id)
                .with_for_update(key_share=True)
            )
            if row is None:
                raise NotFound("episode", episode_id)
            if row.trajectory_id is not None:
                if row.trajectory_id == trajectory.id:
                    return _episode_record(row)
                raise InvalidTransition(
                    episode_id,
                    row.status,
                    "finished",
                    f"it already holds trajectory {row.trajectory_id}, not {trajectory.id}",
                )
            if row.status == "completed":
                # Unreachable through this API (completion stores a trajectory); guards rows
                # written by other means.
                raise InvalidTransition(episode_id, row.status, "finished", "no trajectory held")
            now = utcnow()
            session.add(
                TrajectoryRow(
                    id=trajectory.id,
                    episode_id=episode_id,
                    attempt=meta.attempt,
                    segment=meta.segment,
                    body=body,
                    created_at=now,
                )
            )
            for column, value in _outcome(trajectory).items():
                # An error set by an earlier cancel or failure stays when the trajectory has none.
                if value is not None or column not in ("error_type", "error_message"):
                    setattr(row, column, value)
            row.updated_at = now
            if row.status not in TERMINAL_EPISODE_STATUSES:
                row.status = _final_status(meta)
                row.finished_at = now
            data: dict[str, Any] = {
                "status": row.status,
                "reward": row.reward,
                "stop_reason": row.stop_reason,
                "error_type": row.error_type,
                "trajectory_id": trajectory.id,
            }
            self._add_event(session, "status", data, run_id=row.run_id, episode_id=episode_id)
            return _episode_record(row)

    def record_episodes(
        self,
        run_id: str,
        trajectories: Sequence[Trajectory],
        *,
        agent: str = "",
        replace: bool = False,
    ) -> int:
        """Record episodes a run has already finished (a training step's), each with its
        trajectory, in one transaction; return how many were written.

        Each becomes an episode of `run_id` whose id is its trajectory's id (ids hash the run
        id, so they do not clash across runs) and whose status is what `finish_episode` would
        give it. An id recorded before is kept as it is, unless `replace`: then its episode
        takes the new trajectory, outcome and status (a step produced again, after a resume or
        an actor's restore, trains its new production under the same ids), with a `status`
        event. Each trajectory is checked as `finish_episode` checks it (`InvalidArgument`,
        and then nothing is recorded); `NotFound` if the run does not exist.
        """
        unique = list(dict((t.id, t) for t in trajectories).values())
        bodies = {t.id: _trajectory_body(t) for t in unique}
        with self._writing_core() as connection:
            if not self._run_exists(connection, run_id):
                raise NotFound("run", run_id)
            known = set(
                connection.scalars(select(EpisodeRow.id).where(EpisodeRow.id.in_(list(bodies))))
            )
            new = [t for t in unique if t.id not in known]
            replaced = [t for t in unique if t.id in known] if replace else []
            if not new and not replaced:
                return 0
            now = utcnow()
            outcomes = {
                t.id: {
                    **_outcome(t),
                    "status": _final_status(t.meta),
                    "started_at": now - timedelta(seconds=t.meta.timings.get("total", 0.0)),
                    "finished_at": now,
                }
                for t in [*new, *replaced]
            }
            if new:
                connection.execute(
                    insert(EPISODES),
                    [
                        {
                            **self._episode_values(
                                t.meta.task, run_id=run_id, agent=agent, episode_id=t.id
                            ),
                            **outcomes[t.id],
                        }
                        for t in new
                    ],
                )
            for trajectory in replaced:
                connection.execute(
                    update(EPISODES)
                    .where(EPISODES.c.id == trajectory.id)
                    .values(**outcomes[trajectory.id], updated_at=now)
                )
            if replaced:
                ids = [t.id for t in replaced]
                connection.execute(delete(TRAJECTORIES).where(TRAJECTORIES.c.episode_id.in_(ids)))
            connection.execute(
                insert(TRAJECTORIES),
                [
                    {
                        "id": t.id,
                        "episode_id": t.id,
                        "attempt": t.meta.attempt,
                        "segment": t.meta.segment,
                        "body": bodies[t.id],
                        "created_at": now,
                    }
                    for t in [*new, *replaced]
                ],
            )
            for episode_id, outcome in outcomes.items():
                data = {
                    key: outcome[key]
                    for key in ("status", "reward", "stop_reason", "error_type", "trajectory_id")
                }
                self._add_event(connection, "status", data, run_id=run_id, episode_id=episode_id)
        return len(new) + len(replaced)

    def claim_next_episode(self) -> EpisodeRecord | None:
        """Move the oldest `queued` episode to `running` and return it; None if none is queued.

        The queue of episodes submitted for a worker to run (the REST API's). Concurrent
        claimers, in threads or processes, never get the same episode: on SQLite the write
        transaction is exclusive; on PostgreSQL the row is locked with SKIP LOCKED, so a second
        claimer takes the next episode instead of waiting. Appends a `status` event.
        """
        query = (
            select(EpisodeRow)
            .where(EpisodeRow.status == "queued")
            .order_by(EpisodeRow.seq)
            .limit(1)
            .with_for_update(skip_locked=True, key_share=True)
        )
        with self._writing() as session:
            row = session.scalar(query)
            if row is None:
                return None
            now = utcnow()
            row.status = "running"
            row.started_at = now
            row.updated_at = now
            self._add_event(
                session, "status", {"status": "running"}, run_id=row.run_id, episode_id=row.id
            )
            return _episode_record(row)

    def requeue_running_episodes(self) -> list[str]:
        """Put every `running` episode that belongs to no run back in the queue; return their ids.

        For a REST server starting after one that died mid-episode: the episodes it was running
        would otherwise stay `running` forever. Only episodes outside any run are touched
        (training runs own theirs). Appends a `status` event per episode.
        """
        with self._writing() as session:
            rows = list(
                session.scalars(
                    select(EpisodeRow)
                    .where(EpisodeRow.status == "running", EpisodeRow.run_id.is_(None))
                    .order_by(EpisodeRow.seq)
                    .with_for_update(key_share=True)
                )
            )
            now = utcnow()
            for row in rows:
                row.status = "queued"
                row.started_at = None
                row.updated_at = now
                self._add_event(
                    session,
                    "status",
                    {"status": "queued", "requeued": True},
                    run_id=None,
                    episode_id=row.id,
                )
            return [row.id for row in rows]

    def count_episodes(self, run_id: str | None = None) -> dict[EpisodeStatus, int]:
        """How many episodes are in each status (every status present, zeros included);
        of one run when `run_id` is given, else of all."""
        query = select(EpisodeRow.status, func.count()).group_by(EpisodeRow.status)
        if run_id is not None:
            query = query.where(EpisodeRow.run_id == run_id)
        counts: dict[EpisodeStatus, int] = {status: 0 for status in get_args(EpisodeStatus)}
        with self._reading() as session:
            for status, count in session.execute(query):
                if status in counts:
                    counts[status] = int(count)
        return counts

    def get_episode(self, episode_id: str, *, with_trajectory: bool = True) -> EpisodeRecord:
        """The episode, with its trajectory when it has one and `with_trajectory` is set;
        `NotFound` if there is none."""
        with self._reading() as session:
            row = session.scalar(select(EpisodeRow).where(EpisodeRow.id == episode_id))
            if row is None:
                raise NotFound("episode", episode_id)
            body = None
            if with_trajectory and row.trajectory_id is not None:
                body = session.scalar(
                    select(TrajectoryRow.body).where(TrajectoryRow.id == row.trajectory_id)
                )
        trajectory = None
        if body is not None:
            try:
                trajectory = Trajectory.model_validate_json(body)
            except ValidationError as err:
                # Only a trajectory model change without a data migration can cause this.
                raise SchemaNotReady(
                    f"stored trajectory {row.trajectory_id} of episode {episode_id!r} does not "
                    f"match the Trajectory model: {err}"
                ) from None
        return _episode_record(row, trajectory)

    def list_episodes(
        self,
        run_id: str | None = None,
        *,
        status: EpisodeStatus | None = None,
        stop_reason: str | None = None,
        error_type: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> Page[EpisodeRecord]:
        """Episodes, newest first, without trajectories; keyset-paginated by `cursor`.

        `run_id` None lists episodes of every run and of none. Filters combine with AND. Each
        page is an index range read (see `models.EpisodeRow`), as fast at the ten-thousandth
        episode as at the first. `NotFound` if `run_id` names no run.
        """
        _check_limit(limit, MAX_PAGE)
        below = _decode_cursor(cursor)
        query = select(EpisodeRow)
        if run_id is not None:
            query = query.where(EpisodeRow.run_id == run_id)
        if status is not None:
            query = query.where(EpisodeRow.status == status)
        if stop_reason is not None:
            query = query.where(EpisodeRow.stop_reason == stop_reason)
        if error_type is not None:
            query = query.where(EpisodeRow.error_type == error_type)
        if below is not None:
            query = query.where(EpisodeRow.seq < below)
        query = query.order_by(EpisodeRow.seq.desc()).limit(limit + 1)
        with self._reading() as session:
            rows = list(session.scalars(query))
            # An empty first page of an unknown run is a 404, not an empty list.
            if not rows and run_id is not None and not self._run_exists(session, run_id):
                raise NotFound("run", run_id)
        next_cursor = str(rows[limit - 1].seq) if len(rows) > limit else None
        return Page[EpisodeRecord](
            items=[_episode_record(r) for r in rows[:limit]], next_cursor=next_cursor
        )

    # ---- events ----

    def append_event(
        self,
        type: str,
        data: Mapping[str, Any] | None = None,
        *,
        episode_id: str | None = None,
        run_id: str | None = None,
    ) -> int:
        """Append an event to an episode's stream (and its run's), or to a run's; return its id.

        At least one of `episode_id` and `run_id` is required; with only `episode_id`, the
        episode's run is filled in, so a run's stream also carries its episodes' events. Ids
        increase in commit order (see the module docstring). `NotFound` if the episode or run
        does not exist; `InvalidArgument` if `run_id` is not the episode's run.
        """
        if not type or len(type) > 64:
            raise InvalidArgument(f"event type must be 1 to 64 characters, got {type!r}")
        if episode_id is None and run_id is None:
            raise InvalidArgument("an event belongs to an episode or a run: give either id")
        doc = _json_doc(data, f"data of event {type!r}")
        with self._writing() as session:
            if episode_id is not None:
                owner = session.execute(
                    select(EpisodeRow.run_id).where(EpisodeRow.id == episode_id)
                ).first()
                if owner is None:
                    raise NotFound("episode", episode_id)
                if run_id is not None and run_id != owner.run_id:
                    raise InvalidArgument(
                        f"episode {episode_id!r} belongs to run {owner.run_id!r}, not {run_id!r}"
                    )
                run_id = owner.run_id
            elif run_id is not None and not self._run_exists(session, run_id):
                raise NotFound("run", run_id)
            return self._add_event(session, type, doc, run_id=run_id, episode_id=episode_id)

    def list_events(
        self,
        episode_id: str | None = None,
        *,
        run_id: str | None = None,
        type: str | None = None,
        after_id: int = 0,
        limit: int = 1000,
    ) -> list[EventRecord]:
        """Events of one episode or one run with id greater than `after_id`, oldest first;
        only those of `type` when given.

        Give exactly one of `episode_id` and `run_id`. An SSE server resumes a stream by
        passing the client's Last-Event-ID as `after_id`. A run's events of one type (its
        `fault` events) are read from their own index, without the run's episodes' events.
        `NotFound` if the episode or run does not exist.
        """
        if (episode_id is None) == (run_id is None):
            raise InvalidArgument("give exactly one of episode_id and run_id")
        _check_limit(limit, MAX_EVENTS)
        query = select(EventRow).where(EventRow.id > after_id)
        if episode_id is not None:
            query = query.where(EventRow.episode_id == episode_id)
        else:
            query = query.where(EventRow.run_id == run_id)
        if type is not None:
            query = query.where(EventRow.type == type)
        query = query.order_by(EventRow.id).limit(limit)
        with self._reading() as session:
            rows = list(session.scalars(query))
            if not rows:
                missing = (
                    episode_id is not None and not self._episode_exists(session, episode_id)
                ) or (run_id is not None and not self._run_exists(session, run_id))
                if missing:
                    kind, key = ("episode", episode_id) if episode_id else ("run", run_id)
                    raise NotFound(kind, str(key))
        return [_event_record(r) for r in rows]
