"""Alembic environment of the run store.

`Store.migrate()` passes its own connection in `config.attributes["connection"]`, so migrations
run with the store's SQLite settings (WAL, foreign keys, BEGIN IMMEDIATE). Without one, the
URL comes from the `sqlalchemy.url` option or `$OMNILOOP_DB_URL` (see `Store.alembic_config`).

All revisions run in one transaction, on SQLite too (Alembic assumes SQLite cannot do
transactional DDL because the sqlite3 module's legacy mode skips BEGIN; the store's engine
emits BEGIN itself). A migration that fails leaves the schema as it was.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from omniloop.platform.store.engine import make_engine, resolve_url
from omniloop.platform.store.models import Base

# Several processes (API, controller) may migrate the same PostgreSQL database at start-up;
# a transaction-scoped advisory lock makes the second wait and then find the schema at head.
# SQLite needs nothing: the migration's BEGIN IMMEDIATE already serializes writers.
MIGRATION_LOCK_KEY = 0x6F6D6E696C6F6F70  # "omniloop" in ASCII


def _run_online(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        transactional_ddl=True,
        # SQLite cannot ALTER most things; batch mode rebuilds tables in later revisions.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        context.run_migrations()


def _run_offline() -> None:
    url = resolve_url(context.config.get_main_option("sqlalchemy.url"))
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    if context.is_offline_mode():
        _run_offline()
        return
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run_online(connection)
        return
    engine = make_engine(resolve_url(context.config.get_main_option("sqlalchemy.url")))
    try:
        with engine.connect() as conn:
            _run_online(conn)
    finally:
        engine.dispose()


_main()
