"""`EpisodeWriter`: episodes that end together are written together, the data-plane put and
the store record run side by side, and a failed group's error reaches each of its episodes
with no write left running."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.writer import EpisodeWriter
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta


def _trajectory(episode: int) -> Trajectory:
    builder = TrajectoryBuilder([1, 2, 3])
    builder.add_sampled([10 + episode, 11], [-0.5, -0.25], 0)
    meta = TrajectoryMeta(run_id="run", episode_id=f"ep{episode}", task_id="t", stop_reason="stop")
    trajectory = builder.build(meta)
    trajectory.reward = float(episode)
    trajectory.reward_info = {"exact": float(episode)}
    return trajectory


class Writes:
    """The data plane and the store of one writer: each write takes `seconds` and is logged
    with when it started and ended; `fail_put` makes the data plane's put raise."""

    def __init__(self, seconds: float = 0.05, fail_put: bool = False) -> None:
        self.seconds = seconds
        self.fail_put = fail_put
        self.log: list[tuple[str, list[str], float, float]] = []
        self.rewards: list[list[float]] = []
        self.reward_infos: list[list[dict[str, float]]] = []
        self.replace: list[bool] = []
        """Each store record's `replace` flag."""
        self.rows: dict[str, Trajectory] = {}
        """What the data plane holds, by trajectory id, for `written`."""

    async def _write(self, what: str, trajectories: list[Trajectory]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(self.seconds)
        self.log.append((what, [t.id for t in trajectories], started, loop.time()))
        if what == "put" and self.fail_put:
            raise RuntimeError("the queue refused the put")

    async def put_rollout(
        self, step: int, trajectories: list[Trajectory], extra: dict[str, Any]
    ) -> None:
        self.rewards.append(list(extra["reward"]))
        self.reward_infos.append(list(extra["reward_info"]))
        await self._write("put", trajectories)

    async def record_episodes(
        self, run_id: str, trajectories: list[Trajectory], *, agent: str, replace: bool = False
    ) -> None:
        self.replace.append(replace)
        await self._write("record", trajectories)

    async def written(self, step: int, trajectory_id: str) -> Trajectory | None:
        return self.rows.get(trajectory_id)


def _writer(writes: Writes, out: Path) -> EpisodeWriter:
    return EpisodeWriter(writes, writes, out, run_id="run", agent="agent")  # type: ignore[arg-type]


def test_episodes_that_end_during_a_write_go_in_the_next_group(tmp_path: Path) -> None:
    writes = Writes()
    writer = _writer(writes, tmp_path)

    async def main() -> None:
        first = asyncio.create_task(writer.write(0, _trajectory(0)))
        await asyncio.sleep(0.01)  # the first episode's write is under way
        await asyncio.gather(first, *(writer.write(0, _trajectory(i)) for i in (1, 2, 3)))

    asyncio.run(main())
    puts = [ids for what, ids, _, _ in writes.log if what == "put"]
    assert len(puts) == 2
    assert len(puts[0]) == 1
    assert len(puts[1]) == 3
    lines = (tmp_path / "step_0.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["meta"]["episode_id"] for line in lines) == [
        "ep0",
        "ep1",
        "ep2",
        "ep3",
    ]
    assert sorted(r for group in writes.rewards for r in group) == [0.0, 1.0, 2.0, 3.0]
    # The reward's parts go with it: a re-run that keeps the row records the episode from it.
    assert sorted(i["exact"] for group in writes.reward_infos for i in group) == [0, 1, 2, 3]
    # A step's writes replace a record under the same id (the step was produced again).
    assert writes.replace == [True, True]


def test_the_put_and_the_record_run_side_by_side(tmp_path: Path) -> None:
    writes = Writes(seconds=0.2)
    asyncio.run(_writer(writes, tmp_path).write(3, _trajectory(0)))
    (_, _, put_start, put_end), (_, _, record_start, record_end) = sorted(
        writes.log, key=lambda entry: entry[0]
    )
    # Each started before the other ended.
    assert put_start < record_end
    assert record_start < put_end


def test_a_failed_put_fails_every_episode_of_its_group_after_both_writes_end(
    tmp_path: Path,
) -> None:
    writes = Writes(fail_put=True)
    writer = _writer(writes, tmp_path)

    async def main() -> list[BaseException | None]:
        results = await asyncio.gather(
            *(writer.write(1, _trajectory(i)) for i in range(3)), return_exceptions=True
        )
        return list(results)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert "refused" in str(results[0])
    # The record was not cut off by the put's error, and no trajectory line claims the group.
    assert {what for what, *_ in writes.log} == {"put", "record"}
    assert not (tmp_path / "step_1.jsonl").exists()


def test_a_writer_without_a_store_writes_the_data_plane_and_the_file(tmp_path: Path) -> None:
    writes = Writes()
    writer = EpisodeWriter(writes, None, tmp_path, run_id="run", agent="agent")  # type: ignore[arg-type]
    asyncio.run(writer.write(0, _trajectory(5)))
    assert [what for what, *_ in writes.log] == ["put"]
    assert (tmp_path / "step_0.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("infra_failure", [True, False])
def test_an_episode_without_a_usable_reward_is_written_with_nan(
    tmp_path: Path, infra_failure: bool
) -> None:
    writes = Writes()
    trajectory = _trajectory(0)
    if infra_failure:
        trajectory.meta.stop_reason = "engine_error"
    else:
        trajectory.reward = None
    asyncio.run(_writer(writes, tmp_path).write(0, trajectory))
    [[reward]] = writes.rewards
    assert reward != reward  # NaN


def test_a_rerun_finds_the_trajectory_an_earlier_attempt_put_and_completes_its_writes(
    tmp_path: Path,
) -> None:
    # The earlier attempt's put got through; its replica died before the record and the line.
    writes = Writes()
    writer = _writer(writes, tmp_path)
    earlier = _trajectory(4)
    writes.rows[earlier.id] = earlier
    assert asyncio.run(writer.written_before(2, _trajectory(5).id)) is None
    assert writes.log == []
    assert asyncio.run(writer.written_before(2, earlier.id)) == earlier
    assert asyncio.run(writer.written_before(2, earlier.id)) == earlier
    # The store keeps a record it has (`record_episodes` without `replace`); one line.
    assert [(what, ids) for what, ids, *_ in writes.log] == [("record", [earlier.id])] * 2
    assert writes.replace == [False, False]
    lines = (tmp_path / "step_2.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [earlier.id]
    assert not [what for what, *_ in writes.log if what == "put"]  # the row stands as it was
