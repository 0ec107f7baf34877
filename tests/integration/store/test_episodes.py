"""Episodes: idempotent creation (also under races), status transitions, finishing with a
trajectory, and reading it back."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from omniloop.platform.store import (
    AlreadyExists,
    IdempotencyConflict,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    Store,
    hash_episode_request,
)
from omniloop.platform.store.models import EpisodeRow
from omniloop.trajectory import Trajectory

TrajectoryFactory = Callable[..., Trajectory]
TASK = {"prompt": "What is 2+2?", "answer": "4"}


def _count_episodes(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(EpisodeRow)).scalar_one())


def test_create_episode_without_key_always_creates(store: Store) -> None:
    store.create_run(run_id="r")
    a, created_a = store.create_episode(
        TASK, run_id="r", agent="tool_agent", sampling={"temperature": 0.7}
    )
    b, created_b = store.create_episode(TASK, run_id="r", agent="tool_agent")
    assert created_a
    assert created_b
    assert a.id != b.id
    assert a.status == "queued"
    assert a.started_at is None
    assert a.task == TASK
    assert a.agent == "tool_agent"
    assert a.sampling == {"temperature": 0.7}
    assert a.reward is None
    assert a.trajectory_id is None
    assert a.reward_info == {}
    assert store.get_episode(a.id) == a


def test_episode_without_run_is_allowed(store: Store) -> None:
    episode, _ = store.create_episode(TASK)
    assert episode.run_id is None
    assert store.get_episode(episode.id).run_id is None


def test_episode_may_start_running_but_not_finished(store: Store) -> None:
    episode, _ = store.create_episode(TASK, status="running")
    assert episode.status == "running"
    assert episode.started_at is not None
    with pytest.raises(InvalidArgument, match="starts queued or running"):
        store.create_episode(TASK, status="completed")


def test_create_episode_in_unknown_run_raises_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="run 'nope'"):
        store.create_episode(TASK, run_id="nope")
    assert _count_episodes(store) == 0


def test_caller_chosen_episode_id_is_unique(store: Store) -> None:
    store.create_episode(TASK, episode_id="e1")
    with pytest.raises(AlreadyExists, match="'e1'"):
        store.create_episode(TASK, episode_id="e1")


def test_same_key_and_request_returns_the_first_episode(store: Store) -> None:
    first, created = store.create_episode(TASK, agent="a", idempotency_key="k1")
    again, created_again = store.create_episode(TASK, agent="a", idempotency_key="k1")
    assert created
    assert not created_again
    assert again == first
    assert _count_episodes(store) == 1


def test_same_key_with_a_different_request_is_a_conflict(store: Store) -> None:
    first, _ = store.create_episode(TASK, idempotency_key="k1")
    with pytest.raises(IdempotencyConflict, match=first.id) as info:
        store.create_episode({"prompt": "other"}, idempotency_key="k1")
    assert info.value.episode_id == first.id
    with pytest.raises(IdempotencyConflict):
        store.create_episode(TASK, idempotency_key="k1", sampling={"temperature": 1.0})
    assert _count_episodes(store) == 1


def test_caller_supplied_request_hash_decides_sameness(store: Store) -> None:
    """The REST layer may hash the raw body; then that hash, not the arguments, is compared."""
    first, _ = store.create_episode(TASK, idempotency_key="k", request_hash="h1")
    again, created = store.create_episode({"prompt": "x"}, idempotency_key="k", request_hash="h1")
    assert not created
    assert again.id == first.id
    with pytest.raises(IdempotencyConflict):
        store.create_episode(TASK, idempotency_key="k", request_hash="h2")


def test_request_hash_ignores_key_order_only() -> None:
    a = hash_episode_request(task={"x": 1, "y": [1, 2]}, agent="a")
    assert a == hash_episode_request(task={"y": [1, 2], "x": 1}, agent="a")
    assert a != hash_episode_request(task={"x": 1, "y": [2, 1]}, agent="a")
    assert a != hash_episode_request(task={"x": 1, "y": [1, 2]}, agent="b")


def test_racing_creates_with_one_key_make_exactly_one_episode(db_url: str) -> None:
    """Sixteen callers on two independent stores (two pools, as two processes would have)
    submit the same request with the same key at the same moment."""
    stores = [Store(db_url), Store(db_url)]
    stores[0].migrate()
    callers = 16
    barrier = threading.Barrier(callers)

    def submit(i: int) -> tuple[str, bool]:
        barrier.wait()
        episode, created = stores[i % 2].create_episode(TASK, agent="a", idempotency_key="race-key")
        return episode.id, created

    try:
        with ThreadPoolExecutor(callers) as pool:
            results = list(pool.map(submit, range(callers)))
        assert len({episode_id for episode_id, _ in results}) == 1
        assert sum(created for _, created in results) == 1
        assert _count_episodes(stores[0]) == 1
        # The episode's creation was recorded once, by the winner.
        assert len(stores[0].list_events(results[0][0])) == 1
    finally:
        for s in stores:
            s.close()


def test_racing_creates_with_distinct_keys_all_succeed(store: Store) -> None:
    callers = 12
    barrier = threading.Barrier(callers)

    def submit(i: int) -> bool:
        barrier.wait()
        return store.create_episode(TASK, idempotency_key=f"key-{i}")[1]

    with ThreadPoolExecutor(callers) as pool:
        assert all(pool.map(submit, range(callers)))
    assert _count_episodes(store) == callers


def test_allowed_status_transitions(store: Store) -> None:
    episode, _ = store.create_episode(TASK)
    running = store.update_episode_status(episode.id, "running")
    assert running.status == "running"
    assert running.started_at is not None
    requeued = store.update_episode_status(episode.id, "queued")
    assert requeued.status == "queued"
    assert requeued.started_at is None
    store.update_episode_status(episode.id, "running")
    failed = store.update_episode_status(
        episode.id, "failed", error_type="SandboxError", error_message="container died"
    )
    assert failed.status == "failed"
    assert failed.finished_at is not None
    assert (failed.error_type, failed.error_message) == ("SandboxError", "container died")
    assert store.get_episode(episode.id) == failed

    queued, _ = store.create_episode(TASK)
    assert store.update_episode_status(queued.id, "cancelled").status == "cancelled"


def test_terminal_statuses_are_final(store: Store) -> None:
    episode, _ = store.create_episode(TASK)
    cancelled = store.update_episode_status(episode.id, "cancelled")
    # A repeated cancel is a no-op, not an error.
    assert store.update_episode_status(episode.id, "cancelled") == cancelled
    for status in ("queued", "running", "failed"):
        with pytest.raises(InvalidTransition, match=f"is 'cancelled' and cannot become '{status}'"):
            store.update_episode_status(episode.id, status)
    assert store.get_episode(episode.id) == cancelled


def test_update_episode_status_refuses_bad_requests(store: Store) -> None:
    episode, _ = store.create_episode(TASK)
    with pytest.raises(InvalidArgument, match="finish_episode"):
        store.update_episode_status(episode.id, "completed")
    with pytest.raises(InvalidArgument, match="unknown episode status"):
        store.update_episode_status(episode.id, "paused")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="error can accompany"):
        store.update_episode_status(episode.id, "running", error_type="X")
    with pytest.raises(NotFound, match="episode 'nope'"):
        store.update_episode_status("nope", "running")


def test_finish_episode_stores_trajectory_and_summary(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    store.create_run(run_id="r")
    episode, _ = store.create_episode(TASK, run_id="r")
    store.update_episode_status(episode.id, "running")
    traj = make_trajectory(episode.id, run_id="r", reward=0.75)
    done = store.finish_episode(episode.id, traj)
    assert done.status == "completed"
    assert done.finished_at is not None
    assert done.reward == 0.75
    assert done.reward_info == {"format": 0.5}
    assert done.stop_reason == "stop"
    assert done.error_type is None
    assert done.timings == {"generate": 0.25, "total": 0.5}
    assert done.num_turns == 2
    assert done.response_length == traj.response_length == 10
    assert done.trajectory_id == traj.id

    got = store.get_episode(episode.id)
    assert got.trajectory == traj
    assert got.model_copy(update={"trajectory": None}) == done
    assert store.get_episode(episode.id, with_trajectory=False).trajectory is None


def test_infrastructure_failure_finishes_as_failed(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    episode, _ = store.create_episode(TASK, status="running")
    traj = make_trajectory(
        episode.id,
        reward=None,
        stop_reason="sandbox_error",
        error=("SandboxError", "container OOM-killed"),
    )
    done = store.finish_episode(episode.id, traj)
    assert done.status == "failed"
    assert done.reward is None
    assert (done.stop_reason, done.error_type) == ("sandbox_error", "SandboxError")
    assert done.error_message == "container OOM-killed"


def test_cancelled_trajectory_finishes_as_cancelled(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    episode, _ = store.create_episode(TASK, status="running")
    done = store.finish_episode(episode.id, make_trajectory(episode.id, stop_reason="cancelled"))
    assert done.status == "cancelled"


def test_first_terminal_status_wins_and_the_trajectory_is_still_kept(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    """A cancel lands while the rollout finishes: the episode stays cancelled, with the
    trajectory of what did run."""
    episode, _ = store.create_episode(TASK, status="running")
    store.update_episode_status(episode.id, "cancelled")
    traj = make_trajectory(episode.id)
    done = store.finish_episode(episode.id, traj)
    assert done.status == "cancelled"
    assert done.trajectory_id == traj.id
    assert store.get_episode(episode.id).trajectory == traj


def test_finishing_again_is_idempotent_but_a_second_trajectory_is_refused(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    episode, _ = store.create_episode(TASK, status="running")
    first = store.finish_episode(episode.id, make_trajectory(episode.id, reward=1.0))
    assert store.finish_episode(episode.id, make_trajectory(episode.id, reward=1.0)) == first
    with pytest.raises(InvalidTransition, match="already holds trajectory"):
        # Another id for the same episode (a re-run keeps its id; another run's does not).
        store.finish_episode(episode.id, make_trajectory(episode.id, run_id="another-run"))
    assert store.get_episode(episode.id).reward == 1.0


def test_finish_episode_refuses_foreign_or_malformed_trajectories(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    episode, _ = store.create_episode(TASK, status="running")
    with pytest.raises(InvalidArgument, match="belongs to episode 'other'"):
        store.finish_episode(episode.id, make_trajectory("other"))
    with pytest.raises(InvalidArgument, match="not JSON compliant"):
        store.finish_episode(episode.id, make_trajectory(episode.id, reward=math.nan))
    broken = make_trajectory(episode.id)
    broken = broken.model_copy(update={"loss_mask": broken.loss_mask[:-1]})
    with pytest.raises(InvalidArgument, match="loss_mask has"):
        store.finish_episode(episode.id, broken)
    with pytest.raises(NotFound):
        store.finish_episode("nope", make_trajectory("nope"))
    # Nothing was stored by the refused calls.
    assert store.get_episode(episode.id).status == "running"


def test_get_unknown_episode_raises_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="episode 'nope' does not exist"):
        store.get_episode("nope")


def test_episode_task_must_be_a_json_object(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="episode task"):
        store.create_episode({"image": b"\x89PNG"})
    with pytest.raises(InvalidArgument, match="sampling options"):
        store.create_episode(TASK, sampling={"temperature": math.inf})


def test_nul_characters_survive_in_documents_and_are_replaced_in_error_text(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    """Model and tool output may hold NUL; PostgreSQL text (and jsonb) cannot."""
    episode, _ = store.create_episode({"prompt": "a\x00b"}, status="running")
    assert store.get_episode(episode.id).task == {"prompt": "a\x00b"}
    traj = make_trajectory(episode.id, stop_reason="sandbox_error", error=("E", "bad\x00byte"))
    traj.meta.task["output"] = "x\x00y"
    done = store.finish_episode(episode.id, traj)
    assert done.error_message == "bad\ufffdbyte"
    assert store.get_episode(episode.id).trajectory == traj


def test_over_long_names_are_refused_on_both_databases(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="agent name"):
        store.create_episode(TASK, agent="a" * 256)
    with pytest.raises(InvalidArgument, match="run name"):
        store.create_run("n" * 256)
    with pytest.raises(InvalidArgument, match="episode id"):
        store.create_episode(TASK, episode_id="e" * 65)
    episode, _ = store.create_episode(TASK)
    with pytest.raises(InvalidArgument, match="error type"):
        store.update_episode_status(episode.id, "failed", error_type="E" * 256)


def test_record_episodes_stores_a_runs_finished_episodes_once(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    store.create_run(run_id="train")
    done = [make_trajectory(f"step0/t{i}/0", run_id="train", reward=i / 2) for i in range(3)]
    failed = make_trajectory(
        "step0/t3/0", run_id="train", reward=None, stop_reason="engine_error",
        error=("EngineError", "connection refused"),
    )  # fmt: skip
    assert store.record_episodes("train", [*done, failed], agent="calc") == 4
    # A resumed run records the step again: nothing is added or changed.
    assert store.record_episodes("train", [*done, failed], agent="calc") == 0
    assert store.count_episodes("train")["completed"] == 3
    assert store.count_episodes("train")["failed"] == 1

    episode = store.get_episode(done[1].id)
    assert (episode.run_id, episode.agent, episode.status) == ("train", "calc", "completed")
    assert episode.task == done[1].meta.task
    assert episode.reward == 0.5
    assert episode.trajectory == done[1]
    assert episode.started_at is not None
    assert episode.finished_at is not None
    assert episode.finished_at > episode.started_at
    broken = store.get_episode(failed.id, with_trajectory=False)
    assert (broken.status, broken.error_type) == ("failed", "EngineError")
    assert [e.data["status"] for e in store.list_events(episode_id=failed.id)] == ["failed"]


def test_record_episodes_replaces_a_step_produced_again_when_asked(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    store.create_run(run_id="train")
    first = [make_trajectory(f"step0/t{i}/0", run_id="train", reward=1.0) for i in range(2)]
    assert store.record_episodes("train", first) == 2
    # The step is produced again under the same ids: one episode now fails on infrastructure.
    again = [
        make_trajectory("step0/t0/0", run_id="train", reward=0.25),
        make_trajectory(
            "step0/t1/0", run_id="train", reward=None, stop_reason="engine_error",
            error=("EngineError", "connection refused"),
        ),
    ]  # fmt: skip
    assert [t.id for t in again] == [t.id for t in first]
    assert store.record_episodes("train", again) == 0  # kept without `replace`
    assert store.get_episode(first[0].id).trajectory == first[0]
    assert store.record_episodes("train", again, replace=True) == 2
    counts = store.count_episodes("train")
    assert (counts["completed"], counts["failed"]) == (1, 1)
    assert store.get_episode(first[0].id).trajectory == again[0]
    assert store.get_episode(first[0].id).reward == 0.25
    broken = store.get_episode(first[1].id)
    assert (broken.status, broken.error_type, broken.reward) == ("failed", "EngineError", None)
    assert broken.trajectory == again[1]
    statuses = [e.data["status"] for e in store.list_events(episode_id=first[1].id)]
    assert statuses == ["completed", "failed"]


def test_record_episodes_refuses_an_unknown_run_or_a_malformed_trajectory_whole(
    store: Store, make_trajectory: TrajectoryFactory
) -> None:
    with pytest.raises(NotFound, match="run 'nope'"):
        store.record_episodes("nope", [make_trajectory("e", run_id="nope")])
    store.create_run(run_id="r")
    good = make_trajectory("e1", run_id="r")
    with pytest.raises(InvalidArgument, match="not JSON compliant"):
        store.record_episodes("r", [good, make_trajectory("e2", run_id="r", reward=math.nan)])
    assert sum(store.count_episodes("r").values()) == 0
