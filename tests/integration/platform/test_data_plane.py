"""DataPlane on a real Ray instance and a real TransferQueue.

One queue serves the whole module (starting Ray and TransferQueue takes ~10 s on a small
machine); each test writes to its own rollout steps so tests cannot see each other's rows. The
last test closes that queue and checks that nothing is left running.
Writers use a second client attached to the same queue, as a separate role process would.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import psutil
import pytest
import ray
import torch

from omniloop.platform.data import (
    DataPlane,
    DataPlaneConfig,
    DataPlaneTimeoutError,
    MicroBatch,
    PartitionClosedError,
    UnknownRowsError,
)
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta

pytestmark = pytest.mark.timeout(180)

ROLLOUT = ["input_ids", "loss_mask", "rollout_logprobs", "weight_version", "meta"]
READ_TIMEOUT_S = 30.0

_steps = itertools.count(100)


def make_trajectory(episode: int, version: int = 0, run: str = "dp-test") -> Trajectory:
    """A two-turn trajectory whose length and contents depend on `episode`."""
    builder = TrajectoryBuilder([1, 2, 3 + episode])
    for turn in range(2):
        n = 2 + (episode + turn) % 4
        ids = [100 + episode * 10 + turn * 3 + j for j in range(n)]
        builder.add_sampled(ids, [-0.1 * (j + 1) - episode for j in range(n)], version)
        builder.add_observation([7, 8 + turn])
    meta = TrajectoryMeta(
        run_id=run, episode_id=f"ep{episode}", task_id=f"t{episode % 3}", stop_reason="stop"
    )
    return builder.build(meta)


@pytest.fixture(scope="module")
def ray_temp_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="omniloop-test-ray-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def plane(ray_temp_dir: str) -> Iterator[DataPlane]:
    """The reader side; it starts (and owns) the module's Ray instance and queue."""
    assert not ray.is_initialized()
    started = DataPlane.start(
        DataPlaneConfig(
            ray_temp_dir=ray_temp_dir, min_poll_interval_s=0.005, max_poll_interval_s=0.02
        )
    )
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def writer(plane: DataPlane) -> Iterator[DataPlane]:
    """A second client on the same queue, standing in for the rollout/reward roles."""
    attached = DataPlane.start()
    try:
        yield attached
    finally:
        attached.close()


@pytest.fixture
def step() -> int:
    return next(_steps)


async def collect(
    plane: DataPlane,
    step: int,
    fields: list[str],
    micro_batch_size: int,
    consumer: str = "actor",
) -> list[MicroBatch]:
    return [
        mb
        async for mb in plane.iter_micro_batches(
            step, fields, micro_batch_size, consumer, timeout_s=READ_TIMEOUT_S
        )
    ]


def ids_of(batches: list[MicroBatch]) -> list[str]:
    return [i for mb in batches for i in mb.ids]


async def test_fields_from_different_writers_are_read_together(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e, version=3) for e in range(6)]
    ids = await writer.put_rollout(step, trajs)
    assert ids == [t.id for t in trajs]
    # Reward and advantage stages write their own fields, in a different order of rows.
    order = ids[::-1]
    by_id = {t.id: t for t in trajs}
    rewards = {i: float(k) / 2 for k, i in enumerate(order)}
    await writer.put_field(step, order, "reward", [rewards[i] for i in order])
    advantages = {i: [0.5 * k] * len(by_id[i].input_ids) for k, i in enumerate(order)}
    await plane.put_field(step, order, "advantages", [advantages[i] for i in order])
    await writer.close_partition(step)

    fields = [*ROLLOUT, "reward", "advantages"]
    batches = await collect(plane, step, fields, micro_batch_size=4)
    assert [len(mb) for mb in batches] == [4, 2]
    assert sorted(ids_of(batches)) == sorted(ids)
    for mb in batches:
        assert mb.step == step
        assert mb.consumer == "actor"
        assert mb["reward"].shape == (len(mb),)
        for k, traj_id in enumerate(mb.ids):
            traj = by_id[traj_id]
            assert mb["input_ids"][k].tolist() == traj.input_ids
            assert mb["input_ids"][k].dtype == torch.int64
            assert mb["loss_mask"][k].tolist() == traj.loss_mask
            assert mb["weight_version"][k].tolist() == traj.weight_version
            assert torch.allclose(mb["rollout_logprobs"][k], torch.tensor(traj.rollout_logprobs))
            assert mb["meta"][k] == traj.meta.model_dump(mode="json")
            assert mb["reward"][k].item() == rewards[traj_id]
            assert mb["advantages"][k].tolist() == advantages[traj_id]


async def test_each_consumer_gets_every_row_once(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(5)]
    await writer.put_rollout(step, trajs)
    await writer.close_partition(step)
    for consumer in ("reward", "reference"):
        batches = await collect(plane, step, ["input_ids"], 2, consumer)
        assert sorted(ids_of(batches)) == sorted(t.id for t in trajs)
    # A second pass of the same consumer finds the step drained.
    assert await collect(plane, step, ["input_ids"], 2, "reward") == []


async def test_rows_wait_for_every_requested_field(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(4)]
    ids = await writer.put_rollout(step, trajs)
    await writer.put_field(step, ids[:2], "reward", [1.0, 2.0])
    await writer.close_partition(step)

    received: list[MicroBatch] = []
    first = asyncio.Event()

    async def read() -> None:
        async for mb in plane.iter_micro_batches(
            step, ["input_ids", "reward"], 2, timeout_s=READ_TIMEOUT_S
        ):
            received.append(mb)
            first.set()

    reader = asyncio.create_task(read())
    await asyncio.wait_for(first.wait(), READ_TIMEOUT_S)
    # Only the rewarded rows came out; the others are held back although the step is closed.
    assert sorted(received[0].ids) == sorted(ids[:2])
    assert not reader.done()
    await writer.put_field(step, ids[2:], "reward", [3.0, 4.0])
    await asyncio.wait_for(reader, READ_TIMEOUT_S)
    assert sorted(ids_of(received)) == sorted(ids)


async def test_micro_batches_stream_while_rollout_is_still_writing(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    """The producer holds back its last writes until the reader has a micro-batch: if the
    reader waited for the whole step, this would time out."""
    trajs = [make_trajectory(e) for e in range(8)]
    events: list[str] = []
    first_batch = asyncio.Event()

    async def produce() -> None:
        for k, traj in enumerate(trajs):
            if k == 4:
                await asyncio.wait_for(first_batch.wait(), READ_TIMEOUT_S)
            await writer.put_rollout(step, [traj])
            events.append(f"write {k}")
        await writer.close_partition(step)
        events.append("close")

    async def consume() -> list[MicroBatch]:
        out = []
        async for mb in plane.iter_micro_batches(step, ROLLOUT, 2, timeout_s=READ_TIMEOUT_S):
            events.append(f"batch {len(out)}")
            out.append(mb)
            first_batch.set()
        return out

    _, batches = await asyncio.gather(produce(), consume())
    assert events.index("batch 0") < events.index("write 7")
    assert [len(mb) for mb in batches] == [2, 2, 2, 2]
    assert sorted(ids_of(batches)) == sorted(t.id for t in trajs)


async def test_repeated_writes_do_not_duplicate_rows(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(3)]
    await writer.put_rollout(step, trajs)
    # A retried write, and a batch that carries the same trajectory twice.
    await writer.put_rollout(step, trajs)
    assert await writer.put_rollout(step, [trajs[0], trajs[0]]) == [trajs[0].id]
    ids = [t.id for t in trajs]
    await writer.put_field(step, ids, "reward", [0.0, 0.0, 0.0])
    await writer.put_field(step, [ids[1], ids[1]], "reward", [5.0, 6.0])
    await writer.close_partition(step)
    await writer.close_partition(step)

    batches = await collect(plane, step, ["input_ids", "reward"], 2)
    rows = {i: mb["reward"][k].item() for mb in batches for k, i in enumerate(mb.ids)}
    assert sorted(ids_of(batches)) == sorted(ids)
    assert rows == {ids[0]: 0.0, ids[1]: 6.0, ids[2]: 0.0}


async def test_a_rollout_writes_its_reward_in_the_same_put(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(3)]
    # The same trajectory twice: the last one's reward wins, as its rollout fields do.
    ids = await writer.put_rollout(
        step, [*trajs, trajs[1]], extra={"reward": [1.0, 2.0, float("nan"), 4.0]}
    )
    assert ids == [t.id for t in trajs]
    with pytest.raises(ValueError, match="3 trajectories but 2 values for 'reward'"):
        await writer.put_rollout(step, trajs, extra={"reward": [1.0, 2.0]})
    await writer.close_partition(step)

    batches = await collect(plane, step, ["input_ids", "reward"], 3)
    rows = {i: mb["reward"][k].item() for mb in batches for k, i in enumerate(mb.ids)}
    assert rows[ids[0]] == 1.0
    assert rows[ids[1]] == 4.0
    assert rows[ids[2]] != rows[ids[2]]  # NaN: an infrastructure failure's reward


async def test_a_written_row_reads_back_as_its_trajectory_without_being_consumed(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    # What a re-run episode finds when an earlier attempt's put got through.
    scored, failed, unscored = (make_trajectory(e) for e in range(3))
    scored.reward, scored.reward_info = 0.5, {"exact": 1.0, "short": 0.0}
    assert await plane.written(step, scored.id) is None  # no partition yet
    await writer.put_rollout(
        step,
        [scored, failed],
        extra={"reward": [0.5, float("nan")], "reward_info": [scored.reward_info, {}]},
    )
    await writer.put_rollout(step, [unscored])  # a row without its reward is not complete
    back = await plane.written(step, scored.id)
    assert back is not None
    # Logprobs are stored as fp32, as the engines compute them.
    fp32 = torch.tensor(scored.rollout_logprobs, dtype=torch.float32).tolist()
    assert back.model_dump() == scored.model_copy(update={"rollout_logprobs": fp32}).model_dump()
    again = await plane.written(step, failed.id)
    assert again is not None
    assert again.reward is None
    assert (again.input_ids, again.meta) == (failed.input_ids, failed.meta)
    assert await plane.written(step, unscored.id) is None
    assert await plane.written(step, "no-such-trajectory") is None
    # Read back, not handed out: a consumer still gets every row.
    await writer.put_field(step, [unscored.id], "reward", [1.0])
    await writer.close_partition(step)
    batches = await collect(plane, step, ["input_ids", "reward"], 2)
    assert sorted(ids_of(batches)) == sorted(t.id for t in (scored, failed, unscored))


async def test_exactly_once_across_a_restore(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(10)]
    all_ids = {t.id for t in trajs}
    await writer.put_rollout(step, trajs)
    await writer.close_partition(step)

    trainer = DataPlane.start()  # the trainer process before the crash
    try:
        async with aclosing(trainer.iter_micro_batches(step, ROLLOUT, 2)) as it:
            trained = await anext(it)
            checkpoint = json.loads(json.dumps(trainer.consumed_state()))
            lost = await anext(it)  # taken after the checkpoint, never trained: must come back
    finally:
        trainer.close()
    assert set(checkpoint["consumers"]["actor"][f"step_{step}"]) == set(trained.ids)

    resumed = DataPlane.start()
    try:
        resumed.restore_consumed(checkpoint)
        after = await collect(resumed, step, ROLLOUT, 2)
        again = await collect(resumed, step, ROLLOUT, 2)
        state = resumed.consumed_state()
    finally:
        resumed.close()
    after_ids = ids_of(after)
    assert len(after_ids) == len(set(after_ids)) == 8
    assert set(after_ids) == all_ids - set(trained.ids)
    assert set(lost.ids) <= set(after_ids)
    assert again == []
    assert set(state["consumers"]["actor"][f"step_{step}"]) == all_ids


async def test_rows_taken_before_a_timeout_are_not_lost(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(2)]
    ids = await writer.put_rollout(step, trajs)
    reader = DataPlane.start()
    try:
        # After a restore that already counts ids[0], the reader takes both rows from the
        # queue, keeps ids[1] and waits for a second row that never comes.
        reader.restore_consumed({"format": 1, "consumers": {"actor": {f"step_{step}": [ids[0]]}}})
        with pytest.raises(DataPlaneTimeoutError, match=r"2 rows, 2 with all of .* not closed"):
            async for _ in reader.iter_micro_batches(step, ["input_ids"], 2, timeout_s=0.3):
                pass
        await writer.close_partition(step)
        batches = [mb async for mb in reader.iter_micro_batches(step, ["input_ids"], 2)]
    finally:
        reader.close()
    assert ids_of(batches) == [ids[1]]


async def test_a_reader_cancelled_mid_fetch_loses_no_row(
    plane: DataPlane, writer: DataPlane, step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    trajs = [make_trajectory(e) for e in range(4)]
    ids = await writer.put_rollout(step, trajs)
    await writer.close_partition(step)
    reader = DataPlane.start()
    try:
        # Hold the data read of the first fetch: by then the queue has marked its rows consumed.
        client = reader._client
        real_get_data = client.async_get_data
        entered, release = asyncio.Event(), asyncio.Event()

        async def held_get_data(meta: object) -> object:
            entered.set()
            await release.wait()
            return await real_get_data(meta)

        monkeypatch.setattr(client, "async_get_data", held_get_data)
        first = asyncio.ensure_future(anext(reader.iter_micro_batches(step, ["input_ids"], 2)))
        await asyncio.wait_for(entered.wait(), READ_TIMEOUT_S)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        release.set()
        batches = await collect(reader, step, ["input_ids"], 2)
    finally:
        reader.close()
    assert sorted(ids_of(batches)) == sorted(ids)


def test_restore_rejects_a_malformed_state(plane: DataPlane) -> None:
    other = DataPlane.start()
    try:
        for bad in ({}, {"format": 2, "consumers": {}}, {"format": 1, "consumers": {"a": [1]}}):
            with pytest.raises(ValueError):
                other.restore_consumed(bad)
        assert other.consumed_state() == {"format": 1, "consumers": {}}
    finally:
        other.close()


async def test_partitions_do_not_mix(plane: DataPlane, writer: DataPlane) -> None:
    a, b = next(_steps), next(_steps)
    trajs_a = [make_trajectory(e) for e in range(3)]
    trajs_b = [make_trajectory(e, run="other-run") for e in range(3, 7)]
    ids_a = await writer.put_rollout(a, trajs_a)
    # The same trajectory id in two steps is two rows, one per partition.
    ids_b = await writer.put_rollout(b, [*trajs_b, trajs_a[0]])
    await writer.put_field(a, ids_a, "reward", [1.0] * len(ids_a))
    await writer.put_field(b, ids_b, "reward", [2.0] * len(ids_b))
    await writer.close_partition(a)
    await writer.close_partition(b)

    got_a = await collect(plane, a, ["input_ids", "reward"], 4)
    got_b = await collect(plane, b, ["input_ids", "reward"], 4)
    assert sorted(ids_of(got_a)) == sorted(ids_a)
    assert sorted(ids_of(got_b)) == sorted(ids_b)
    assert {r for mb in got_a for r in mb["reward"].tolist()} == {1.0}
    assert {r for mb in got_b for r in mb["reward"].tolist()} == {2.0}


async def test_writes_that_break_the_contract_are_refused(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(2)]
    ids = await writer.put_rollout(step, trajs)
    with pytest.raises(UnknownRowsError, match="1 of 2 ids"):
        await writer.put_field(step, [ids[0], "no-such-id"], "reward", [1.0, 2.0])
    with pytest.raises(ValueError, match="not one of the known fields"):
        await writer.put_field(step, ids, "score", [1.0, 2.0])
    with pytest.raises(ValueError, match="stored as 'scalar'"):
        await writer.put_field(step, ids, "reward", [[1.0], [2.0]], kind="tokens")
    with pytest.raises(ValueError, match="2 ids but 1 values"):
        await writer.put_field(step, ids, "reward", [1.0])
    broken = make_trajectory(9).model_copy(update={"loss_mask": [1]})
    with pytest.raises(ValueError, match="loss_mask"):
        await writer.put_rollout(step, [broken])
    await writer.close_partition(step)
    with pytest.raises(PartitionClosedError):
        await writer.put_rollout(step, [make_trajectory(5)])


async def test_new_fields_round_trip_with_an_explicit_kind(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(3)]
    ids = await writer.put_rollout(step, trajs)
    teacher = [[-1.0] * len(t.input_ids) for t in trajs]
    await writer.put_field(step, ids, "teacher_logprobs", teacher, kind="tokens")
    await writer.put_field(
        step, ids, "judge", [{"score": k, "why": "ok"} for k in range(3)], kind="json"
    )
    await writer.put_field(step, ids, "passed", [1, 0, 1], kind="scalar")
    await writer.close_partition(step)
    (mb,) = await collect(plane, step, ["teacher_logprobs", "judge", "passed"], 3)
    pos = {i: k for k, i in enumerate(mb.ids)}
    for k, traj_id in enumerate(ids):
        assert mb["teacher_logprobs"][pos[traj_id]].tolist() == teacher[k]
        assert mb["judge"][pos[traj_id]] == {"score": k, "why": "ok"}
        assert mb["passed"][pos[traj_id]].item() == [1, 0, 1][k]


async def test_clear_drops_rows_and_their_consumption_record(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    trajs = [make_trajectory(e) for e in range(3)]
    await writer.put_rollout(step, trajs)
    await writer.close_partition(step)
    assert len(ids_of(await collect(plane, step, ["input_ids"], 3))) == 3
    assert f"step_{step}" in plane.consumed_state()["consumers"]["actor"]
    await plane.clear(step)
    # A trained step costs the record, and the checkpoints that save it, nothing more.
    assert f"step_{step}" not in plane.consumed_state()["consumers"]["actor"]
    # The step stays closed: a stage that reads it again (its replica died after its last
    # write) finds it finished instead of waiting out its timeout, and a late write is refused.
    assert await collect(plane, step, ["input_ids"], 3) == []
    with pytest.raises(PartitionClosedError):
        await writer.put_rollout(step, [make_trajectory(11)])
    # Reopened (for an actor restored from a checkpoint older than the step, whose weights
    # never saw it), the step is trained again, whole.
    assert await writer.reopen_cleared(step) == [step]
    await writer.put_rollout(step, [trajs[0], make_trajectory(11)])
    await writer.close_partition(step)
    assert sorted(ids_of(await collect(plane, step, ["input_ids"], 3))) == sorted(
        [trajs[0].id, make_trajectory(11).id]
    )


async def test_a_stage_forgets_the_steps_cleared_since_at_its_next_reread(
    plane: DataPlane, writer: DataPlane
) -> None:
    # A stage (its own client, as in its replica) computes steps one after the other; the actor
    # (`plane`) trains and clears each. Steps no other test uses, below those that the
    # reopening test below reopens.
    first = 5_000
    for k in range(first, first + 3):
        await writer.put_rollout(k, [make_trajectory(k)])
        await writer.close_partition(k)
    stage = DataPlane.start()
    try:
        for k in range(first, first + 3):
            await stage.reread(k, "advantage")
            assert len(ids_of(await collect(stage, k, ["input_ids"], 1, "advantage"))) == 1
            # The steps cleared before this one are gone from its record.
            assert set(stage.consumed_state()["consumers"]["advantage"]) == {f"step_{k}"}
            assert len(ids_of(await collect(plane, k, ["input_ids"], 1))) == 1
            await plane.clear(k)
        assert not {f"step_{k}" for k in range(first, first + 3)} & set(
            plane.consumed_state()["consumers"]["actor"]
        )
        # A step not cleared yet stays in the record across a reread of another.
        await writer.put_rollout(first + 3, [make_trajectory(first + 3)])
        await writer.close_partition(first + 3)
        await stage.reread(first + 3, "advantage")
        await collect(stage, first + 3, ["input_ids"], 1, "advantage")
        await writer.put_rollout(first + 4, [make_trajectory(first + 4)])
        await stage.reread(first + 4, "advantage")
        assert set(stage.consumed_state()["consumers"]["advantage"]) == {f"step_{first + 3}"}
    finally:
        stage.close()


async def test_only_cleared_steps_from_the_restored_one_on_are_reopened(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    # `checkpoint` is the checkpoint's step; the lost actor had trained it and the next; the
    # one after was produced and closed, not trained. (Steps no other test uses.)
    before = 10_000 + 10 * step
    checkpoint, trained, produced = before + 1, before + 2, before + 3
    for k in (before, checkpoint, trained, produced):
        await writer.put_rollout(k, [make_trajectory(k)])
        await writer.close_partition(k)
    for k in (before, checkpoint, trained):
        await writer.clear(k)
    assert await plane.reopen_cleared(checkpoint) == [checkpoint, trained]
    await writer.put_rollout(checkpoint, [make_trajectory(20)])  # open again
    with pytest.raises(PartitionClosedError):
        await writer.put_rollout(before, [make_trajectory(21)])
    with pytest.raises(PartitionClosedError):
        await writer.put_rollout(produced, [make_trajectory(22)])
    assert ids_of(await collect(plane, produced, ["input_ids"], 2)) == [
        make_trajectory(produced).id
    ]


async def test_only_cleared_steps_before_the_given_one_are_forgotten(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    # (Steps no other test uses, below those the reopening test above reopens.)
    cleared, untrained, later = 6_000 + 10 * step, 6_001 + 10 * step, 6_002 + 10 * step
    for k in (cleared, untrained, later):
        await writer.put_rollout(k, [make_trajectory(k)])
        await writer.close_partition(k)
    for k in (cleared, later):
        await writer.clear(k)
    forgotten = await plane.forget_cleared(later + 1)  # other tests' cleared steps too
    assert {cleared, later} <= set(forgotten)
    assert untrained not in forgotten
    assert await plane.forget_cleared(later + 1) == []
    # Forgotten, a step stays closed: a late write to it or to any step before it is refused.
    for k in (cleared, later, 100):
        with pytest.raises(PartitionClosedError):
            await writer.put_rollout(k, [make_trajectory(20)])
    await writer.put_rollout(later + 1, [make_trajectory(20)])
    # A late close of a forgotten step leaves no marker behind: nothing more to forget.
    await writer.close_partition(cleared)
    assert await plane.forget_cleared(later + 1) == []
    # A closed step whose rows are not trained yet is not forgotten.
    with pytest.raises(PartitionClosedError):
        await writer.put_rollout(untrained, [make_trajectory(21)])
    assert ids_of(await collect(plane, untrained, ["input_ids"], 2)) == [
        make_trajectory(untrained).id
    ]
    # A restore from before them opens the forgotten steps again (and the other tests' steps).
    await plane.reopen_cleared(100)
    await writer.put_rollout(cleared, [make_trajectory(22)])
    await writer.clear(cleared)


async def test_an_attached_client_closes_without_stopping_the_queue(
    plane: DataPlane, step: int
) -> None:
    other = DataPlane.start()
    await other.put_rollout(step, [make_trajectory(1)])
    other.close()
    assert ray.is_initialized()
    await plane.close_partition(step)
    assert len(ids_of(await collect(plane, step, ["input_ids"], 1))) == 1


async def test_reader_keeps_the_callers_torch_thread_count(
    plane: DataPlane, writer: DataPlane, step: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        await writer.put_rollout(step, [make_trajectory(2)])
        await writer.close_partition(step)
        await collect(plane, step, ["input_ids"], 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# Its own Ray instance (this module's has a queue already), in a child process.
_REPLICA_WAITS = """
import time, ray
from omniloop.platform.data import DataPlane

ray.init(address="local", num_cpus=2, include_dashboard=False)

@ray.remote(num_cpus=0)
class Replica:
    def ready(self):
        return True

    def join(self):
        plane = DataPlane.start()
        owned = plane._owns_queue
        plane.close()
        return owned

replica = Replica.remote()
ray.get(replica.ready.remote(), timeout=120)
joined = replica.join.remote()
time.sleep(2)  # the replica looks for the queue first; a replica used to start its own
driver = DataPlane.start()
print("replica owns the queue:", ray.get(joined, timeout=120))
print("driver owns the queue:", driver._owns_queue)
driver.close()
ray.shutdown()
"""


def test_a_replica_waits_for_the_queue_its_driver_starts(tmp_path: Path) -> None:
    """A Ray actor (a role's replica) never starts the queue, which would end with that
    replica: it waits for the one the run's driver starts."""
    done = subprocess.run(
        [sys.executable, "-c", _REPLICA_WAITS],
        capture_output=True, text=True, timeout=170, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replica owns the queue: False" in done.stdout, done.stdout
    assert "driver owns the queue: True" in done.stdout, done.stdout


def test_closing_the_owner_stops_the_queue_and_ray(plane: DataPlane, ray_temp_dir: str) -> None:
    """Last in the module on purpose: it shuts down the module's queue and Ray instance."""
    procs = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(ray_temp_dir in part for part in (p.info["cmdline"] or []))
    ]
    assert procs, "expected Ray processes running under the plane's temp dir"
    plane.close()
    plane.close()  # idempotent
    assert not ray.is_initialized()
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, [(p.pid, p.info["cmdline"][:2]) for p in alive]
