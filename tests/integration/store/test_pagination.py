"""Episode listing over 10,000 episodes of a run: keyset pages, filters, and index use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, insert, text

from omniloop.platform.store import EpisodeRecord, InvalidArgument, NotFound, Store
from omniloop.platform.store.models import EpisodeRow, utcnow

RUN = "big"
OTHER_RUN = "other"
N = 10_000


def _row(i: int, run_id: str | None) -> dict[str, Any]:
    """Episode `i` of a synthetic data set: statuses, stop reasons and errors in a fixed mix."""
    status = ("queued", "running", "completed", "failed")[i % 4]
    stop_reason = error_type = None
    if status == "completed":
        stop_reason = "length" if i % 3 == 0 else "stop"
    elif status == "failed":
        stop_reason = "sandbox_error"
        error_type = "SandboxError" if i % 8 == 3 else "RewardError"
    now = utcnow()
    return {
        "id": f"{run_id or 'none'}-{i:05d}",
        "run_id": run_id,
        "status": status,
        "task": {"i": i},
        "agent": "a",
        "sampling": {},
        "reward_info": {},
        "timings": {},
        "stop_reason": stop_reason,
        "error_type": error_type,
        "created_at": now,
        "updated_at": now,
    }


def _bulk_insert(store: Store, rows: list[dict[str, Any]]) -> None:
    """One multi-row INSERT batch in one transaction: seconds for 10,000 rows, not minutes."""
    with store.engine.begin() as conn:
        conn.execute(insert(EpisodeRow), rows)


def _all_pages(store: Store, limit: int, **filters: Any) -> Iterator[list[EpisodeRecord]]:
    cursor = None
    while True:
        page = store.list_episodes(cursor=cursor, limit=limit, **filters)
        yield page.items
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


@pytest.fixture(scope="module")
def big(module_db_url: str) -> Iterator[tuple[Store, list[dict[str, Any]]]]:
    """A store holding 10,000 episodes of run `big`, interleaved with 1,000 of another run and
    500 without a run; and the rows of `big` in insertion order."""
    store = Store(module_db_url)
    store.migrate()
    store.create_run(run_id=RUN)
    store.create_run(run_id=OTHER_RUN)
    rows: list[dict[str, Any]] = []
    batch: list[dict[str, Any]] = []
    for i in range(N):
        row = _row(i, RUN)
        rows.append(row)
        batch.append(row)
        if i % 10 == 0:
            batch.append(_row(i, OTHER_RUN))
        if i % 20 == 0:
            batch.append(_row(i, None))
    _bulk_insert(store, batch)
    if store.dialect == "postgresql":
        with store.engine.begin() as conn:
            conn.execute(text("ANALYZE episodes"))
    try:
        yield store, rows
    finally:
        store.close()


def _expected(rows: list[dict[str, Any]], **filters: Any) -> list[str]:
    """Ids of matching rows, newest first."""
    return [r["id"] for r in reversed(rows) if all(r[k] == v for k, v in filters.items())]


def test_keyset_pages_return_every_episode_once_newest_first(
    big: tuple[Store, list[dict[str, Any]]],
) -> None:
    store, rows = big
    pages = list(_all_pages(store, 500, run_id=RUN))
    assert len(pages) == N // 500
    assert all(len(p) == 500 for p in pages)
    assert [e.id for p in pages for e in p] == _expected(rows)


@pytest.mark.parametrize(
    "filters",
    [
        {"status": "completed"},
        {"stop_reason": "length"},
        {"error_type": "SandboxError"},
        {"status": "failed", "error_type": "RewardError"},
        {"status": "queued", "stop_reason": "stop"},  # matches nothing
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
def test_filtered_pages_return_exactly_the_matching_episodes(
    big: tuple[Store, list[dict[str, Any]]], filters: dict[str, str]
) -> None:
    store, rows = big
    got = [e.id for p in _all_pages(store, 400, run_id=RUN, **filters) for e in p]
    assert got == _expected(rows, **filters)
    assert all(e.run_id == RUN for e in store.list_episodes(RUN, **filters).items)  # type: ignore[arg-type]


def test_listing_without_run_spans_all_runs(big: tuple[Store, list[dict[str, Any]]]) -> None:
    store, _ = big
    page = store.list_episodes(limit=1000, status="queued")
    assert {e.run_id for e in page.items} == {RUN, OTHER_RUN, None}


def _captured_select(store: Store, **filters: Any) -> tuple[str, Any]:
    """The SQL and parameters `list_episodes` sends for these filters."""
    seen: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        if "FROM episodes" in statement:
            seen.append((statement, params))

    event.listen(store.engine, "before_cursor_execute", capture)
    try:
        store.list_episodes(RUN, limit=50, **filters)
    finally:
        event.remove(store.engine, "before_cursor_execute", capture)
    assert len(seen) == 1
    return seen[0]


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


@pytest.mark.parametrize(
    ("filters", "index"),
    [
        ({}, "ix_episodes_run_seq"),
        ({"status": "failed"}, "ix_episodes_run_status_seq"),
        ({"stop_reason": "length"}, "ix_episodes_run_stop_reason_seq"),
        ({"error_type": "SandboxError"}, "ix_episodes_run_error_type_seq"),
    ],
    ids=["run", "status", "stop_reason", "error_type"],
)
def test_each_filtered_page_is_an_index_range_read_without_sorting(
    big: tuple[Store, list[dict[str, Any]]], filters: dict[str, str], index: str
) -> None:
    """A page costs O(limit) whatever the run's size: the planner reads an index in key order
    and stops after `limit` rows, with no sort and no table scan. On SQLite, whose planner has no
    statistics here, it must be the filter's own index."""
    store, _ = big
    page = store.list_episodes(RUN, limit=50, **filters)  # type: ignore[arg-type]
    cursor = page.next_cursor
    assert cursor is not None
    statement, params = _captured_select(store, cursor=cursor, **filters)
    with store.engine.connect() as conn:
        if store.dialect == "sqlite":
            plan = " | ".join(
                str(row[-1])
                for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)
            )
            assert f"USING INDEX {index}" in plan, plan
            assert "TEMP B-TREE" not in plan, plan
        else:
            raw = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", params).scalar()
            doc = raw if isinstance(raw, list) else json.loads(str(raw))
            nodes = list(_plan_nodes(doc[0]["Plan"]))
            kinds = [n["Node Type"] for n in nodes]
            # PostgreSQL picks among the key-ordered indexes by statistics (with this run
            # holding most rows, walking the primary key backwards and filtering can be
            # cheapest); any of them keeps a page O(limit). A sort or a table scan would not.
            assert "Sort" not in kinds, kinds
            assert "Seq Scan" not in kinds, kinds
            assert kinds[:2] in (["Limit", "Index Scan"], ["Limit", "Index Only Scan"]), kinds


def test_rows_added_while_paging_neither_shift_nor_repeat_pages(store: Store) -> None:
    store.create_run(run_id=RUN)
    rows = [_row(i, RUN) for i in range(300)]
    _bulk_insert(store, rows)
    first = store.list_episodes(RUN, limit=100)
    _bulk_insert(store, [_row(i, RUN) for i in range(300, 350)])  # newer than every page
    seen = [e.id for e in first.items]
    cursor = first.next_cursor
    while cursor is not None:
        page = store.list_episodes(RUN, limit=100, cursor=cursor)
        seen += [e.id for e in page.items]
        cursor = page.next_cursor
    assert seen == _expected(rows)


def test_list_episodes_errors(store: Store) -> None:
    with pytest.raises(NotFound, match="run 'nope'"):
        store.list_episodes("nope")
    store.create_run(run_id="empty")
    assert store.list_episodes("empty").items == []
    with pytest.raises(InvalidArgument, match="invalid cursor"):
        store.list_episodes(cursor="-5")
    with pytest.raises(InvalidArgument, match="limit"):
        store.list_episodes(limit=5000)
