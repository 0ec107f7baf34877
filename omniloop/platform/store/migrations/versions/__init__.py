"""Alembic revisions, one file each (Alembic skips this file when it scans the folder)."""
