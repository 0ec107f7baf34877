"""Alembic migrations of the run store; applied by `Store.migrate()`."""
