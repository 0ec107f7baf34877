"""Database URL resolution and engine set-up for SQLite and PostgreSQL.

SQLite (the embedded default) is configured for a multi-threaded single process:
- WAL journal, so readers never block the writer nor the writer the readers;
- a busy timeout, so a second writer waits for the lock instead of failing at once;
- foreign keys on (SQLite leaves them off per connection unless asked);
- SQLAlchemy, not the sqlite3 module, emits BEGIN: sqlite3's legacy mode starts no transaction
  for SELECT or DDL, which breaks read consistency and transactional migrations. Write
  transactions begin with BEGIN IMMEDIATE, taking the write lock up front. A deferred BEGIN
  that reads and then writes fails with SQLITE_BUSY, without waiting, whenever another writer
  committed in between; IMMEDIATE makes writers queue on the busy timeout instead.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from omniloop.platform.store.errors import InvalidArgument

DB_URL_ENV = "OMNILOOP_DB_URL"
"""Environment variable that overrides the default database URL."""

DEFAULT_DB_URL = "sqlite:///runs/omniloop.db"
"""The default: a SQLite file under `runs/` of the working directory, beside run outputs."""

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for the write lock before failing with `database is locked`."""

WRITE_TRANSACTION = "omniloop_write_transaction"
"""Execution option marking connections whose transactions write (BEGIN IMMEDIATE on SQLite)."""

# JSON has no NaN or Infinity and PostgreSQL rejects them; refusing them on both backends keeps
# SQLite from accepting documents a PostgreSQL deployment would refuse.
json_dumps = partial(json.dumps, allow_nan=False, separators=(",", ":"))


def resolve_url(url: str | None = None) -> str:
    """The database URL to use: `url`, else `$OMNILOOP_DB_URL`, else `DEFAULT_DB_URL`."""
    return url or os.environ.get(DB_URL_ENV) or DEFAULT_DB_URL


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise InvalidArgument(f"cannot parse database URL {url!r}: {err}") from None
    # A plain libpq-style URL would select psycopg2, which omniloop does not install.
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for a SQLite file or a PostgreSQL URL, configured as the module docstring says.

    A SQLite file's parent folder is created. In-memory SQLite is refused: every pooled
    connection would see its own empty database.
    """
    parsed = _parse(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or parsed.query.get("mode") == "memory":
            raise InvalidArgument(
                f"in-memory SQLite ({url!r}) is not supported: give a file, "
                "e.g. sqlite:///runs/omniloop.db"
            )
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            echo=echo,
            json_serializer=json_dumps,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        )
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if backend == "postgresql":
        return create_engine(parsed, echo=echo, json_serializer=json_dumps, pool_pre_ping=True)
    raise InvalidArgument(
        f"unsupported database {backend!r} in {url!r}: use sqlite:///FILE or "
        "postgresql+psycopg://USER@HOST/DB"
    )


def _sqlite_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # isolation_level None: sqlite3 stops emitting BEGIN itself; `_sqlite_on_begin` does it.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        _enter_wal(cursor)
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        # In WAL mode NORMAL loses at most the last transactions on power loss, never integrity.
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def _enter_wal(cursor: Any) -> None:
    """Switch the database to WAL, trying again while it is locked, up to the busy timeout.

    The switch takes an exclusive lock without waiting on the busy timeout: processes that open
    a new database file together were refused at once (`database is locked`). Once the file is
    in WAL mode, the pragma changes nothing and takes no lock."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    pause = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _sqlite_on_begin(conn: Connection) -> None:
    write = conn.get_execution_options().get(WRITE_TRANSACTION, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
