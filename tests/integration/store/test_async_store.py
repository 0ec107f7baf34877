"""`AsyncStore`: every method awaitable, results identical to the sync store's, and the event
loop stays free while the database works."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from omniloop.platform.store import AsyncStore, Store
from omniloop.trajectory import Trajectory

TrajectoryFactory = Callable[..., Trajectory]


async def test_async_store_covers_the_episode_lifecycle(
    db_url: str, make_trajectory: TrajectoryFactory
) -> None:
    astore = AsyncStore.open(db_url)
    try:
        await astore.migrate()
        assert await astore.current_revision() == Store.head_revision()
        run = await astore.create_run("async", {"k": 1}, run_id="r")
        assert (await astore.get_run("r")) == run
        assert [r.id for r in (await astore.list_runs()).items] == ["r"]
        assert (await astore.update_run_status("r", "running")).status == "running"

        await astore.record_metrics("r", 0, {"loss": 1.0})
        await astore.record_metrics("r", 1, {"loss": 0.5})
        metrics = await astore.get_metrics("r", ["loss"], since_step=0)
        assert [(p.step, p.value) for p in metrics["loss"]] == [(1, 0.5)]

        # Concurrent submissions with one key: one episode, as with the sync store.
        results = await asyncio.gather(
            *(astore.create_episode({"p": 1}, run_id="r", idempotency_key="k") for _ in range(8))
        )
        assert len({e.id for e, _ in results}) == 1
        assert sum(created for _, created in results) == 1
        episode = results[0][0]

        await astore.update_episode_status(episode.id, "running")
        event_id = await astore.append_event("turn", {"turn": 0}, episode_id=episode.id)
        traj = make_trajectory(episode.id, run_id="r")
        finished = await astore.finish_episode(episode.id, traj)
        assert finished.status == "completed"
        assert (await astore.get_episode(episode.id)).trajectory == traj
        page = await astore.list_episodes("r", status="completed")
        assert [e.id for e in page.items] == [episode.id]
        later = await astore.list_events(episode.id, after_id=event_id)
        assert [e.data["status"] for e in later] == ["completed"]
        assert len(await astore.list_events(run_id="r")) == 5

        failed, _ = await astore.create_episode({"p": 2})
        cancelled = await astore.update_episode_status(
            failed.id, "cancelled", error_type="Cancelled", error_message="by user"
        )
        assert cancelled.error_message == "by user"
    finally:
        await astore.close()


async def test_async_calls_do_not_block_the_event_loop(db_url: str) -> None:
    """While a batch of store calls runs, a ticking coroutine keeps getting scheduled."""
    astore = AsyncStore(Store(db_url))
    await astore.migrate()
    await astore.create_run(run_id="r")
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        for step in range(30):
            await astore.record_metrics("r", step, {"x": float(step)})
    finally:
        stop.set()
        await task
        await astore.close()
    assert ticks >= 30
