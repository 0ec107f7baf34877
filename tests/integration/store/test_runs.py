"""Runs: create, read, list newest first with keyset pages, status changes."""

from __future__ import annotations

from datetime import UTC

import pytest

from omniloop.platform.store import AlreadyExists, InvalidArgument, NotFound, Store
from omniloop.platform.store.store import MAX_STATUS_REASON


def test_create_and_get_run_round_trips_every_field(store: Store) -> None:
    created = store.create_run("grpo-calc", {"trainer": {"lr": 1e-6}, "tags": ["a"]}, run_id="r1")
    got = store.get_run("r1")
    assert got == created
    assert got.name == "grpo-calc"
    assert got.status == "created"
    assert got.config == {"trainer": {"lr": 1e-6}, "tags": ["a"]}
    assert got.created_at.tzinfo == UTC
    assert got.finished_at is None


def test_run_ids_are_generated_unique_and_duplicates_refused(store: Store) -> None:
    a, b = store.create_run(), store.create_run()
    assert a.id != b.id
    assert len(a.id) == 32
    store.create_run(run_id="same")
    with pytest.raises(AlreadyExists, match="'same'"):
        store.create_run(run_id="same")


def test_get_unknown_run_raises_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="run 'nope' does not exist") as info:
        store.get_run("nope")
    assert isinstance(info.value, LookupError)


def test_run_config_must_be_a_finite_json_object(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="not a JSON document"):
        store.create_run(config={"lr": float("nan")})
    with pytest.raises(InvalidArgument, match="not a JSON document"):
        store.create_run(config={"fn": object()})


def test_list_runs_newest_first_in_keyset_pages(store: Store) -> None:
    ids = [store.create_run(f"run{i}", run_id=f"r{i}").id for i in range(7)]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = store.list_runs(cursor=cursor, limit=3)
        seen += [r.id for r in page.items]
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == ids[::-1]
    assert pages == 3


def test_list_runs_filters_by_status(store: Store) -> None:
    for i in range(4):
        store.create_run(run_id=f"r{i}")
    store.update_run_status("r1", "running")
    store.update_run_status("r3", "running")
    page = store.list_runs(status="running")
    assert [r.id for r in page.items] == ["r3", "r1"]
    assert page.next_cursor is None


def test_list_runs_refuses_bad_cursor_and_limit(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="invalid cursor"):
        store.list_runs(cursor="abc")
    with pytest.raises(InvalidArgument, match="limit"):
        store.list_runs(limit=0)
    with pytest.raises(InvalidArgument, match="limit"):
        store.list_runs(limit=1001)


def test_update_run_status_sets_and_clears_finished_at(store: Store) -> None:
    run = store.create_run(run_id="r")
    running = store.update_run_status("r", "running")
    assert running.status == "running"
    assert running.finished_at is None
    assert running.updated_at >= run.updated_at
    done = store.update_run_status("r", "completed")
    assert done.finished_at is not None
    resumed = store.update_run_status("r", "running")  # a finished run may be resumed
    assert resumed.finished_at is None
    assert store.get_run("r") == resumed


def test_run_status_changes_are_events_and_repeats_are_not(store: Store) -> None:
    store.create_run(run_id="r")
    store.update_run_status("r", "running")
    store.update_run_status("r", "running")
    store.update_run_status("r", "failed")
    events = store.list_events(run_id="r")
    assert [(e.type, e.data) for e in events] == [
        ("status", {"status": "running"}),
        ("status", {"status": "failed"}),
    ]


def test_a_status_keeps_its_reason_until_the_next_change(store: Store) -> None:
    store.create_run(run_id="r")
    assert store.update_run_status("r", "running").status_reason is None
    failed = store.update_run_status("r", "failed", "RoleFailed: the actor was lost twice")
    assert failed.status_reason == "RoleFailed: the actor was lost twice"
    assert store.get_run("r").status_reason == failed.status_reason
    finished_at = failed.finished_at
    # The same status with another reason: the reason changes, the run did not end again.
    again = store.update_run_status("r", "failed", "ValueError: bad")
    assert (again.status_reason, again.finished_at) == ("ValueError: bad", finished_at)
    # A resumed run says nothing until it ends again; an error of any length is kept, cut.
    assert store.update_run_status("r", "running").status_reason is None
    long = store.update_run_status("r", "failed", "x" * (MAX_STATUS_REASON + 10) + "\x00")
    assert long.status_reason == "x" * (MAX_STATUS_REASON - 1) + "…"
    events = [e.data for e in store.list_events(run_id="r")]
    assert events[1:3] == [
        {"status": "failed", "reason": "RoleFailed: the actor was lost twice"},
        {"status": "failed", "reason": "ValueError: bad"},
    ]
    assert events[3] == {"status": "running"}


def test_update_run_status_refuses_unknown_run_and_status(store: Store) -> None:
    with pytest.raises(NotFound):
        store.update_run_status("nope", "running")
    store.create_run(run_id="r")
    with pytest.raises(InvalidArgument, match="unknown run status"):
        store.update_run_status("r", "paused")  # type: ignore[arg-type]
