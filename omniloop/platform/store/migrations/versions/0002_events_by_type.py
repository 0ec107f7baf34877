"""Events of one type per run: index (run_id, type, id), for a run's faults.

Revision ID: 0002
Revises: 0001
Create Date: 2026-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_events_run_type_id", "events", ["run_id", "type", "id"])


def downgrade() -> None:
    op.drop_index("ix_events_run_type_id", table_name="events")
