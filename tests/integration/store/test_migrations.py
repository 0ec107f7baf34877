"""Schema migrations: from an empty database to head, repeatable, concurrent, matching models."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from omniloop.platform.store import (
    DB_URL_ENV,
    DEFAULT_DB_URL,
    InvalidArgument,
    SchemaNotReady,
    Store,
    resolve_url,
)
from omniloop.platform.store.engine import SQLITE_BUSY_TIMEOUT_MS, _sqlite_on_connect
from omniloop.platform.store.models import Base

TABLES = {"runs", "episodes", "trajectories", "metrics", "events", "alembic_version"}


def test_migrate_from_empty_database_reaches_head(db_url: str) -> None:
    with Store(db_url) as store:
        assert store.current_revision() is None
        store.migrate()
        assert store.current_revision() == Store.head_revision()
        assert set(inspect(store.engine).get_table_names()) == TABLES
        indexes = {ix["name"] for ix in inspect(store.engine).get_indexes("episodes")}
        assert {
            "ix_episodes_run_seq",
            "ix_episodes_run_status_seq",
            "ix_episodes_run_stop_reason_seq",
            "ix_episodes_run_error_type_seq",
            "ix_episodes_status_seq",
        } <= indexes


def test_migrate_twice_is_a_no_op(store: Store) -> None:
    run = store.create_run("kept")
    store.migrate()
    assert store.current_revision() == Store.head_revision()
    assert store.get_run(run.id).name == "kept"


def test_migration_creates_exactly_what_the_models_declare(store: Store) -> None:
    """If a model changes without a migration (or the reverse), this lists the difference."""
    with store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def _migrate_in_child(url: str, barrier: Any, results: Any) -> None:
    barrier.wait(timeout=30)
    try:
        with Store(url) as s:
            s.migrate()
        results.put("ok")
    except BaseException as err:
        results.put(repr(err))


def _in_processes_together(target: Any, arg: str, processes: int = 3) -> list[Any]:
    """What `target(arg, barrier, results)` put in `results`, run in `processes` forked
    processes that pass a barrier together (fork: they start with everything imported)."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    children = [ctx.Process(target=target, args=(arg, barrier, results)) for _ in range(processes)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=10)
    return outcomes


def test_concurrent_migrations_from_several_processes_all_succeed(db_url: str) -> None:
    """Services starting together each migrate; the database, not luck, must serialize them."""
    assert _in_processes_together(_migrate_in_child, db_url) == ["ok"] * 3
    with Store(db_url) as store:
        assert store.current_revision() == Store.head_revision()


def test_concurrent_migrations_from_threads_of_one_process_all_succeed(db_url: str) -> None:
    stores = [Store(db_url) for _ in range(3)]
    barrier = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def migrate(s: Store) -> None:
        barrier.wait()
        try:
            s.migrate()
        except BaseException as err:  # collected and reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=migrate, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert errors == []
        assert all(s.current_revision() == Store.head_revision() for s in stores)
    finally:
        for s in stores:
            s.close()


def test_calls_before_migrate_raise_schema_not_ready(db_url: str) -> None:
    with Store(db_url) as store:
        with pytest.raises(SchemaNotReady, match=r"migrate\(\)"):
            store.get_run("r")
        with pytest.raises(SchemaNotReady, match=r"migrate\(\)"):
            store.create_run("r")


def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'db' / 'store.db'}") as store:
        assert (tmp_path / "db").is_dir()  # the parent folder is created
        with store.engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30_000


def _connect_in_child(path: str, barrier: Any, results: Any) -> None:
    barrier.wait(timeout=30)
    try:
        # The store's own set-up of each connection, on a bare sqlite3 connection: through a
        # SQLAlchemy engine the processes rarely meet at the same instant.
        connection = sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        _sqlite_on_connect(connection, None)
        results.put(connection.execute("PRAGMA journal_mode").fetchone()[0])
        connection.close()
    except BaseException as err:  # reported by the parent
        results.put(repr(err))


def test_processes_opening_a_new_sqlite_file_together_all_get_wal(tmp_path: Path) -> None:
    """SQLite's switch to WAL takes its lock without waiting out the busy timeout: processes
    that opened a new file together were refused at once ("database is locked")."""
    for round_ in range(20):  # without the retry, about a third of such rounds failed
        path = str(tmp_path / f"round{round_}.db")
        outcomes = _in_processes_together(_connect_in_child, path)
        assert outcomes == ["wal"] * 3, f"round {round_}"


def test_url_comes_from_argument_then_environment_then_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(DB_URL_ENV, raising=False)
    assert resolve_url() == DEFAULT_DB_URL == "sqlite:///runs/omniloop.db"
    env_url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv(DB_URL_ENV, env_url)
    assert resolve_url() == env_url
    assert resolve_url("sqlite:///x.db") == "sqlite:///x.db"
    with Store() as store:
        store.migrate()
    assert (tmp_path / "env.db").is_file()


def test_unusable_urls_are_refused_with_the_reason() -> None:
    with pytest.raises(InvalidArgument, match="in-memory"):
        Store("sqlite://")
    with pytest.raises(InvalidArgument, match="in-memory"):
        Store("sqlite:///:memory:")
    with pytest.raises(InvalidArgument, match="unsupported database 'mysql'"):
        Store("mysql://u@h/db")
    with pytest.raises(InvalidArgument, match="cannot parse"):
        Store("not a url")


def test_plain_postgresql_urls_use_psycopg() -> None:
    store = Store("postgresql://user@127.0.0.1:1/db")  # no connection is made until used
    try:
        assert store.engine.url.drivername == "postgresql+psycopg"
        assert store.dialect == "postgresql"
    finally:
        store.close()


def test_alembic_commands_work_without_the_store_connection(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The path a developer takes with `alembic.command` and `Store.alembic_config()`: offline
    SQL, upgrade through env.py's own engine, and downgrade back to an empty database."""
    with Store(db_url) as store:
        config = store.alembic_config()
        command.upgrade(config, "head", sql=True)
        assert "CREATE TABLE episodes" in capsys.readouterr().out
        assert store.current_revision() is None  # offline mode touches nothing

        command.upgrade(config, "head")
        assert store.current_revision() == Store.head_revision()
        command.downgrade(config, "base")
        assert store.current_revision() is None
        assert set(inspect(store.engine).get_table_names()) == {"alembic_version"}
