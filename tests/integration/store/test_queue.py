"""Submitted episodes: created in batches (bounded by `max_queued` when asked), claimed from
the queue, requeued after a crash, counted by status."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from omniloop.platform.store import (
    AlreadyExists,
    IdempotencyConflict,
    InvalidArgument,
    NotFound,
    QueueFull,
    Store,
)
from omniloop.platform.store.store import queued_count_query


def test_claims_take_the_oldest_queued_episode_once(store):
    first, _ = store.create_episode({"id": "a"}, agent="x")
    second, _ = store.create_episode({"id": "b"}, agent="x")
    store.create_episode({"id": "c"}, agent="x", status="running")
    claimed = store.claim_next_episode()
    assert claimed.id == first.id
    assert claimed.status == "running"
    assert claimed.started_at is not None
    assert store.claim_next_episode().id == second.id
    assert store.claim_next_episode() is None
    events = store.list_events(first.id)
    assert [e.data["status"] for e in events] == ["queued", "running"]


def test_a_cancelled_episode_is_never_claimed(store):
    episode, _ = store.create_episode({"id": "a"}, agent="x")
    store.update_episode_status(episode.id, "cancelled")
    assert store.claim_next_episode() is None


def test_concurrent_claimers_never_share_an_episode(db_url):
    stores = [Store(db_url) for _ in range(4)]
    stores[0].migrate()
    ids = {stores[0].create_episode({"id": str(i)}, agent="x")[0].id for i in range(40)}
    claimed: list[str] = []
    lock = threading.Lock()

    def claim_all(store: Store) -> None:
        while (episode := store.claim_next_episode()) is not None:
            with lock:
                claimed.append(episode.id)

    threads = [threading.Thread(target=claim_all, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for s in stores:
        s.close()
    assert sorted(claimed) == sorted(ids)


def test_requeue_returns_running_episodes_outside_runs_to_the_queue(store):
    run = store.create_run()
    orphan, _ = store.create_episode({"id": "a"}, agent="x")
    in_run, _ = store.create_episode({"id": "b"}, agent="x", run_id=run.id, status="running")
    store.claim_next_episode()
    assert store.requeue_running_episodes() == [orphan.id]
    assert store.get_episode(orphan.id).status == "queued"
    assert store.get_episode(orphan.id).started_at is None
    assert store.get_episode(in_run.id).status == "running"
    assert store.list_events(orphan.id)[-1].data == {"status": "queued", "requeued": True}
    assert store.requeue_running_episodes() == []


def test_counts_by_status_include_zeros_and_filter_by_run(store):
    run = store.create_run()
    assert store.count_episodes() == dict.fromkeys(
        ("queued", "running", "completed", "failed", "cancelled"), 0
    )
    store.create_episode({"id": "a"}, agent="x")
    store.create_episode({"id": "b"}, agent="x", run_id=run.id, status="running")
    failed, _ = store.create_episode({"id": "c"}, agent="x", run_id=run.id)
    store.update_episode_status(failed.id, "failed", error_type="EngineError")
    counts = store.count_episodes()
    assert (counts["queued"], counts["running"], counts["failed"]) == (1, 1, 1)
    in_run = store.count_episodes(run.id)
    assert (in_run["queued"], in_run["running"], in_run["failed"]) == (0, 1, 1)


def test_create_episodes_gives_each_request_what_create_episode_would(store):
    run = store.create_run()
    taken, _ = store.create_episode({"id": "k"}, agent="x", idempotency_key="k1")
    outcomes = store.create_episodes(
        [
            {"task": {"id": "a"}, "agent": "x"},
            {"task": {"id": "k"}, "agent": "x", "idempotency_key": "k1"},  # a replay
            {"task": {"id": "other"}, "agent": "x", "idempotency_key": "k1"},  # another body
            {"task": {"id": "b"}, "agent": "x", "run_id": "no-such-run"},
            {"task": {"id": "c"}, "agent": "x", "status": "completed"},
            {"task": {"id": "d"}, "agent": "x", "run_id": run.id, "idempotency_key": "k2"},
            {"task": {"id": "d"}, "agent": "x", "run_id": run.id, "idempotency_key": "k2"},
        ]
    )
    created, replay, conflict, no_run, bad, first, second = outcomes
    assert isinstance(created, tuple)
    assert created[1] is True
    assert store.get_episode(created[0].id).task == {"id": "a"}
    assert replay == (store.get_episode(taken.id, with_trajectory=False), False)
    assert isinstance(conflict, IdempotencyConflict)
    assert conflict.episode_id == taken.id
    assert isinstance(no_run, NotFound)
    assert isinstance(bad, InvalidArgument)
    # Two requests with one key in one batch: the first creates, the second replays it.
    assert first[1] is True
    assert second == (store.get_episode(first[0].id, with_trajectory=False), False)
    assert store.count_episodes()["queued"] == 3
    assert [e.data for e in store.list_events(created[0].id)] == [{"status": "queued"}]


def test_an_id_clash_in_a_batch_is_that_requests_outcome_only(store):
    store.create_episode({"id": "a"}, agent="x", episode_id="same")
    outcomes = store.create_episodes(
        [
            {"task": {"id": "b"}, "agent": "x"},
            {"task": {"id": "c"}, "agent": "x", "episode_id": "same"},
        ]
    )
    assert isinstance(outcomes[1], AlreadyExists)
    assert outcomes[0][1] is True
    assert store.count_episodes()["queued"] == 2


def test_a_bounded_batch_admits_up_to_max_queued_in_request_order(store):
    run = store.create_run()
    store.create_episode({"id": "old"}, agent="x")
    store.create_episode({"id": "in-run"}, agent="x", run_id=run.id)  # queued: counts
    store.create_episode({"id": "live"}, agent="x", status="running")  # not queued: does not
    outcomes = store.create_episodes(
        [
            {"task": {"id": "a"}, "agent": "x"},
            {"task": {"id": "b"}, "agent": "x", "idempotency_key": "kb"},
            {"task": {"id": "c"}, "agent": "x", "idempotency_key": "kc"},
            {"task": {"id": "d"}, "agent": "x"},
            {"task": {"id": "e"}, "agent": "x", "status": "running"},  # takes no queue room
        ],
        max_queued=4,
    )
    a, b, c, d, e = outcomes
    assert a[1] is True
    assert b[1] is True
    for refused in (c, d):
        assert isinstance(refused, QueueFull)
        assert (refused.limit, refused.queued) == (4, 4)
        assert "at the limit of 4" in str(refused)
    assert e[1] is True
    assert store.count_episodes()["queued"] == 4
    queued_tasks = [r.task["id"] for r in store.list_episodes(status="queued").items]
    assert sorted(queued_tasks) == ["a", "b", "in-run", "old"]
    # Nothing was written for the refused requests: no episode, no event, no key.
    assert all(r.task["id"] not in ("c", "d") for r in store.list_episodes(limit=100).items)
    assert [ev.data for ev in store.list_events(b[0].id)] == [{"status": "queued"}]


def test_a_full_queue_still_replays_used_keys_and_keeps_refused_keys_unused(store):
    first, _ = store.create_episode({"id": "a"}, agent="x", idempotency_key="used")
    full = store.create_episodes(
        [
            {"task": {"id": "a"}, "agent": "x", "idempotency_key": "used"},  # a replay
            {"task": {"id": "other"}, "agent": "x", "idempotency_key": "used"},  # another body
            {"task": {"id": "n"}, "agent": "x", "idempotency_key": "new"},
        ],
        max_queued=1,
    )
    replay, conflict, refused = full
    assert replay == (store.get_episode(first.id, with_trajectory=False), False)
    assert isinstance(conflict, IdempotencyConflict)
    assert conflict.episode_id == first.id
    assert isinstance(refused, QueueFull)
    # The queue drains: the refused key, sent again, creates its episode, once.
    assert store.claim_next_episode().id == first.id
    retry = {"task": {"id": "n"}, "agent": "x", "idempotency_key": "new"}
    (created,) = store.create_episodes([retry], max_queued=1)
    assert created[1] is True
    (again,) = store.create_episodes([retry], max_queued=1)
    assert again == (store.get_episode(created[0].id, with_trajectory=False), False)


def test_max_queued_must_be_positive(store):
    with pytest.raises(InvalidArgument, match="max_queued must be at least 1"):
        store.create_episodes([{"task": {"id": "a"}}], max_queued=0)
    assert store.count_episodes()["queued"] == 0


def test_concurrent_bounded_batches_never_admit_more_than_max_queued(db_url):
    """Stores in threads, each with its own connections (as separate processes would be),
    racing batches against one bound: exactly the bound is admitted between them."""
    stores = [Store(db_url) for _ in range(4)]
    stores[0].migrate()
    outcomes: list[object] = []
    lock = threading.Lock()
    start = threading.Barrier(len(stores))

    def submit(store: Store, which: int) -> None:
        start.wait()
        for batch in range(3):
            requests = [{"task": {"id": f"{which}-{batch}-{i}"}, "agent": "x"} for i in range(5)]
            result = store.create_episodes(requests, max_queued=23)
            with lock:
                outcomes.extend(result)

    threads = [threading.Thread(target=submit, args=(s, n)) for n, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        created = [o for o in outcomes if isinstance(o, tuple)]
        refused = [o for o in outcomes if isinstance(o, QueueFull)]
        assert len(created) == 23
        assert len(refused) == 4 * 3 * 5 - 23
        assert stores[0].count_episodes()["queued"] == 23
    finally:
        for s in stores:
            s.close()


def test_the_admission_count_reads_the_status_index(store):
    """The bound is checked on every batch of submissions, so its count must be an index
    range read, never a scan of the episodes table."""
    for i in range(5):
        store.create_episode({"id": str(i)}, agent="x")
    query = queued_count_query(3)
    with store.engine.connect() as connection:
        assert connection.scalar(query) == 3
        compiled = query.compile(connection, compile_kwargs={"literal_binds": True})
        if store.dialect == "postgresql":
            # A tiny table is cheaper to scan; forbid that to see which index the plan uses.
            connection.execute(text("SET LOCAL enable_seqscan = off"))
            plan = connection.execute(text(f"EXPLAIN {compiled}")).scalars().all()
        else:
            plan = [row[-1] for row in connection.execute(text(f"EXPLAIN QUERY PLAN {compiled}"))]
    assert any("ix_episodes_status_seq" in line for line in plan), plan
