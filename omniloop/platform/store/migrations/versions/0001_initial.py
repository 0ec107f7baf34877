"""Initial schema: runs, episodes, trajectories, metrics, events.

Revision ID: 0001
Revises:
Create Date: 2026-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out rather than imported from models.py: a revision must keep creating the schema
# of its day after the models have moved on.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON_DOC = sa.JSON()  # PostgreSQL json, not jsonb: jsonb refuses \u0000 (see models.py)
DOUBLE = sa.Float(precision=53)


def _ts(name: str, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("seq", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("config", JSON_DOC, nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("seq", name="pk_runs"),
        sa.UniqueConstraint("id", name="uq_runs_id"),
    )
    op.create_index("ix_runs_status_seq", "runs", ["status", "seq"])

    op.create_table(
        "episodes",
        sa.Column("seq", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("task", JSON_DOC, nullable=False),
        sa.Column("agent", sa.String(255), nullable=False),
        sa.Column("sampling", JSON_DOC, nullable=False),
        sa.Column("reward", DOUBLE, nullable=True),
        sa.Column("reward_info", JSON_DOC, nullable=False),
        sa.Column("stop_reason", sa.String(32), nullable=True),
        sa.Column("error_type", sa.String(255), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("timings", JSON_DOC, nullable=False),
        sa.Column("num_turns", sa.Integer(), nullable=True),
        sa.Column("response_length", sa.Integer(), nullable=True),
        sa.Column("trajectory_id", sa.String(64), nullable=True),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_hash", sa.String(128), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("started_at", nullable=True),
        _ts("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("seq", name="pk_episodes"),
        sa.UniqueConstraint("id", name="uq_episodes_id"),
        sa.UniqueConstraint("idempotency_key", name="uq_episodes_idempotency_key"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_episodes_run_id_runs", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_episodes_run_seq", "episodes", ["run_id", "seq"])
    op.create_index("ix_episodes_run_status_seq", "episodes", ["run_id", "status", "seq"])
    op.create_index("ix_episodes_run_stop_reason_seq", "episodes", ["run_id", "stop_reason", "seq"])
    op.create_index("ix_episodes_run_error_type_seq", "episodes", ["run_id", "error_type", "seq"])
    op.create_index("ix_episodes_status_seq", "episodes", ["status", "seq"])

    op.create_table(
        "trajectories",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("episode_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_trajectories"),
        sa.UniqueConstraint(
            "episode_id", "attempt", "segment", name="uq_trajectories_episode_id_attempt_segment"
        ),
        sa.ForeignKeyConstraint(
            ["episode_id"],
            ["episodes.id"],
            name="fk_trajectories_episode_id_episodes",
            ondelete="CASCADE",
        ),
    )

    op.create_table(
        "metrics",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", DOUBLE, nullable=True),
        _ts("recorded_at"),
        sa.PrimaryKeyConstraint("run_id", "name", "step", name="pk_metrics"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_metrics_run_id_runs", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "events",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("episode_id", sa.String(64), nullable=True),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("data", JSON_DOC, nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_events_run_id_runs", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["episode_id"],
            ["episodes.id"],
            name="fk_events_episode_id_episodes",
            ondelete="CASCADE",
        ),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_events_episode_id", "events", ["episode_id", "id"])
    op.create_index("ix_events_run_id", "events", ["run_id", "id"])


def downgrade() -> None:
    for table in ("events", "metrics", "trajectories", "episodes", "runs"):
        op.drop_table(table)
