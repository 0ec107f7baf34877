"""Submitted episodes: created in batches, claimed from the queue, requeued after a crash,
counted by status."""

from __future__ import annotations

import threading

from omniloop.platform.store import (
    AlreadyExists,
    IdempotencyConflict,
    InvalidArgument,
    NotFound,
    Store,
)


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
