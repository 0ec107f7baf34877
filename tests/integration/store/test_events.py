"""Event streams: order, resume after an id (SSE Last-Event-ID), and no event missed by a
reader that polls while writers commit concurrently."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from omniloop.platform.store import InvalidArgument, NotFound, Store
from omniloop.trajectory import Trajectory

TrajectoryFactory = Callable[..., Trajectory]


def test_events_come_back_in_append_order_with_increasing_ids(store: Store) -> None:
    store.create_run(run_id="r")
    episode, _ = store.create_episode({"p": 1}, run_id="r")
    ids = [
        store.append_event("turn", {"turn": i, "text": f"step {i}"}, episode_id=episode.id)
        for i in range(5)
    ]
    assert ids == sorted(ids)
    assert len(set(ids)) == 5
    events = store.list_events(episode.id)
    # The first event is the creation's status event.
    assert next((e.type, e.data) for e in events) == ("status", {"status": "queued"})
    assert [e.id for e in events[1:]] == ids
    assert [e.data["turn"] for e in events[1:]] == list(range(5))
    assert all(e.episode_id == episode.id and e.run_id == "r" for e in events)


def test_event_data_keeps_nul_characters(store: Store) -> None:
    episode, _ = store.create_episode({"p": 1})
    event_id = store.append_event("tool", {"output": "bin\x00ary"}, episode_id=episode.id)
    assert store.list_events(episode.id)[-1].id == event_id
    assert store.list_events(episode.id)[-1].data == {"output": "bin\x00ary"}


def test_resume_after_an_id_returns_only_later_events(store: Store) -> None:
    episode, _ = store.create_episode({"p": 1})
    ids = [store.append_event("tick", {"n": i}, episode_id=episode.id) for i in range(6)]
    resumed = store.list_events(episode.id, after_id=ids[2])
    assert [e.id for e in resumed] == ids[3:]
    assert store.list_events(episode.id, after_id=ids[-1]) == []
    assert [e.id for e in store.list_events(episode.id, after_id=ids[0], limit=2)] == ids[1:3]


def test_episode_lifecycle_is_on_its_stream(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    episode, _ = store.create_episode({"p": 1})
    store.update_episode_status(episode.id, "running")
    store.append_event("turn", {"turn": 0}, episode_id=episode.id)
    store.finish_episode(episode.id, make_trajectory(episode.id, reward=0.5))
    events = store.list_events(episode.id)
    assert [(e.type, e.data.get("status")) for e in events] == [
        ("status", "queued"),
        ("status", "running"),
        ("turn", None),
        ("status", "completed"),
    ]
    assert events[-1].data["reward"] == 0.5


def test_run_stream_carries_its_episodes_events_and_its_own(store: Store) -> None:
    store.create_run(run_id="r")
    store.create_run(run_id="elsewhere")
    a, _ = store.create_episode({"p": 1}, run_id="r")
    b, _ = store.create_episode({"p": 2}, run_id="elsewhere")
    store.append_event("turn", {}, episode_id=a.id)
    store.append_event("turn", {}, episode_id=b.id)
    store.append_event("checkpoint", {"step": 3}, run_id="r")
    events = store.list_events(run_id="r")
    assert [(e.type, e.episode_id) for e in events] == [
        ("status", a.id),
        ("turn", a.id),
        ("checkpoint", None),
    ]
    assert [e.type for e in store.list_events(a.id)] == ["status", "turn"]


def test_event_arguments_are_checked(store: Store) -> None:
    store.create_run(run_id="r")
    store.create_run(run_id="other")
    episode, _ = store.create_episode({"p": 1}, run_id="r")
    with pytest.raises(InvalidArgument, match="episode or a run"):
        store.append_event("x")
    with pytest.raises(InvalidArgument, match="belongs to run 'r'"):
        store.append_event("x", episode_id=episode.id, run_id="other")
    with pytest.raises(InvalidArgument, match="event type"):
        store.append_event("", run_id="r")
    with pytest.raises(InvalidArgument, match="not a JSON document"):
        store.append_event("x", {"v": float("nan")}, run_id="r")
    with pytest.raises(NotFound, match="episode 'nope'"):
        store.append_event("x", episode_id="nope")
    with pytest.raises(NotFound, match="run 'nope'"):
        store.append_event("x", run_id="nope")
    with pytest.raises(InvalidArgument, match="exactly one"):
        store.list_events()
    with pytest.raises(InvalidArgument, match="exactly one"):
        store.list_events(episode.id, run_id="r")
    with pytest.raises(NotFound, match="episode 'nope'"):
        store.list_events("nope")
    with pytest.raises(NotFound, match="run 'nope'"):
        store.list_events(run_id="nope")
    assert store.list_events(run_id="other") == []


def test_polling_reader_never_misses_an_event_from_concurrent_writers(store: Store) -> None:
    """The SSE contract: a reader that resumes after the last id it saw, while several writers
    append, ends up with every event exactly once. Ids must become visible in id order; if a
    lower id could commit after a higher one was read, the reader would skip it for good."""
    store.create_run(run_id="r")
    writers, per_writer = 4, 40
    start = threading.Barrier(writers + 1)
    done = threading.Event()
    written: list[int] = []
    lock = threading.Lock()

    def write(w: int) -> None:
        start.wait()
        for i in range(per_writer):
            event_id = store.append_event("tick", {"w": w, "i": i}, run_id="r")
            with lock:
                written.append(event_id)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    seen: list[int] = []
    start.wait()
    last = 0
    while True:
        finished = done.is_set()
        batch = store.list_events(run_id="r", after_id=last)
        seen += [e.id for e in batch]
        if batch:
            last = batch[-1].id
        if finished and not batch:
            break
        if not any(t.is_alive() for t in threads):
            done.set()
    for t in threads:
        t.join()
    assert len(written) == writers * per_writer
    assert seen == sorted(written)
