"""A run's fault events: read by type from their own index, and summed up per role."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, inspect

from omniloop.platform.store import FAULT_EVENT, InvalidArgument, NotFound, RoleFaults, Store


def _fault(role: Any, recovery: Any, **extra: Any) -> dict[str, Any]:
    return {"step": 0, "role": role, "replica": "r1", "recovery_seconds": recovery, **extra}


def test_a_runs_events_of_one_type_oldest_first_after_an_id(store: Store) -> None:
    store.create_run(run_id="r")
    store.create_run(run_id="other")
    episode, _ = store.create_episode({"p": 1}, run_id="r")
    faults = []
    for n in range(4):
        store.append_event("turn", {"turn": n}, episode_id=episode.id)
        faults.append(store.record_run_event("r", FAULT_EVENT, _fault("rollout", n)))
    store.record_run_event("other", FAULT_EVENT, _fault("actor", 1.0))
    listed = store.list_events(run_id="r", type=FAULT_EVENT)
    assert [e.id for e in listed] == faults
    assert [e.data["recovery_seconds"] for e in listed] == [0, 1, 2, 3]
    assert all(e.type == FAULT_EVENT and e.run_id == "r" for e in listed)
    resumed = store.list_events(run_id="r", type=FAULT_EVENT, after_id=faults[1], limit=1)
    assert [e.id for e in resumed] == [faults[2]]
    assert store.list_events(run_id="r", type=FAULT_EVENT, after_id=faults[-1]) == []
    # Without a type the run's stream still holds everything.
    assert len(store.list_events(run_id="r")) > len(faults)
    # A run with no such events reads as empty; one that does not exist is NotFound.
    assert store.list_events(run_id="r", type="nothing") == []
    with pytest.raises(NotFound, match="run 'nope'"):
        store.list_events(run_id="nope", type=FAULT_EVENT)


@contextmanager
def _statements(store: Store) -> Iterator[list[tuple[str, Any]]]:
    """The SQL statements (with parameters) the store sends while the block runs."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *rest: Any) -> None:
        seen.append((statement, params))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", record)


def _plan(store: Store, statement: str, params: Any) -> str:
    with store.engine.connect() as conn:
        if store.dialect == "sqlite":
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params).all()
            return " ".join(str(row[-1]) for row in rows)
        # A tiny table is read whole by PostgreSQL whatever its indexes: ask what it would do
        # without sequential scans, which is what a large table gets.
        conn.exec_driver_sql("SET enable_seqscan = off")
        rows = conn.exec_driver_sql(f"EXPLAIN {statement}", params).all()
        return " ".join(str(row[0]) for row in rows)


@pytest.mark.parametrize(
    "read",
    [
        lambda s: s.list_events(run_id="r", type=FAULT_EVENT, limit=10),
        lambda s: s.role_faults(["r"]),
    ],
    ids=["list_events", "role_faults"],
)
def test_fault_reads_use_the_run_type_index(store: Store, read: Callable[[Store], object]) -> None:
    assert any(
        ix["name"] == "ix_events_run_type_id" and ix["column_names"] == ["run_id", "type", "id"]
        for ix in inspect(store.engine).get_indexes("events")
    )
    store.create_run(run_id="r")
    episode, _ = store.create_episode({"p": 1}, run_id="r")
    for n in range(20):
        store.append_event("turn", {"turn": n}, episode_id=episode.id)
    store.record_run_event("r", FAULT_EVENT, _fault("rollout", 1.0))
    with _statements(store) as seen:
        read(store)
    first, params = next((s, p) for s, p in seen if "FROM events" in s)
    assert "ix_events_run_type_id" in _plan(store, first, params)


def test_role_faults_counts_per_role_with_the_newest_recovery(store: Store) -> None:
    for run_id in ("a", "b", "quiet"):
        store.create_run(run_id=run_id)
    episode, _ = store.create_episode({"p": 1}, run_id="a")
    store.append_event("turn", {"turn": 0}, episode_id=episode.id)
    store.record_run_event("a", FAULT_EVENT, _fault("advantage", 7.5))
    store.record_run_event("a", FAULT_EVENT, _fault("rollout", 2.0))
    store.record_run_event("a", FAULT_EVENT, _fault("rollout", 3.25))
    store.record_run_event("a", FAULT_EVENT, _fault("rollout", None))  # still down
    store.record_run_event("a", FAULT_EVENT, _fault("actor", None))
    store.record_run_event("a", "status", {"status": "running"})  # not a fault
    store.record_run_event("b", FAULT_EVENT, {"cause": "no role"})
    store.record_run_event("b", FAULT_EVENT, _fault("rollout", True))
    store.record_run_event("b", FAULT_EVENT, _fault("advantage", "soon"))
    # Recorded when detected and again when recovered: one fault.
    store.record_run_event("a", FAULT_EVENT, _fault("rollout", None, fault_id="f1"))
    store.record_run_event("a", FAULT_EVENT, _fault("rollout", 1.5, fault_id="f1"))
    store.record_run_event("a", FAULT_EVENT, _fault("actor", None, fault_id="f2"))
    found = store.role_faults(["b", "a", "quiet", "missing", "a"])
    assert found == [
        RoleFaults(run_id="b", role="advantage", count=1, latest_recovery_seconds=None),
        RoleFaults(run_id="b", role="rollout", count=1, latest_recovery_seconds=None),
        RoleFaults(run_id="b", role="unknown", count=1, latest_recovery_seconds=None),
        RoleFaults(run_id="a", role="actor", count=2, latest_recovery_seconds=None),
        RoleFaults(run_id="a", role="advantage", count=1, latest_recovery_seconds=7.5),
        RoleFaults(run_id="a", role="rollout", count=4, latest_recovery_seconds=1.5),
    ]
    assert store.role_faults([]) == []


def test_role_faults_arguments_are_checked(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="not one string"):
        store.role_faults("a")
    with pytest.raises(InvalidArgument, match="at most 1000 run ids"):
        store.role_faults([f"r{n}" for n in range(1001)])
