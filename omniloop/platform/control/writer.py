"""Where a finished episode goes, written for many episodes at once.

A rollout writes each finished episode three times: its row in the data plane (the rollout
fields, the reward and its parts, in one put), a line in the step's trajectory file, and a
record in the run store. Each write costs about the same for one episode as for thirty (a
data-plane put is three round trips to the queue; a store write is one transaction), and a
step's episodes end in bursts, so `EpisodeWriter` commits them as a group: the first episode
is written at once, and those that finish while a write is under way are written together by
the next one. A group's put and store record run side by side, and its trajectory lines
follow once both succeeded. Nothing waits for a timer, and an episode is never reported done
before it is written.

The first write of an episode is the one that stands. An attempt whose reply was lost (its
replica died after the put) may have been read already by the stages that derive fields from
its row (the advantages of its group, reference logprobs), and a new attempt may sample other
tokens (under newer weights, in another batch): a re-run asks `written_before` first, which
returns the earlier attempt's trajectory and completes its store record and trajectory line
when the put got through.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING

from omniloop.platform.control.rollout import write_trajectory
from omniloop.trajectory import Trajectory

if TYPE_CHECKING:
    from omniloop.platform.data import DataPlane
    from omniloop.platform.store import AsyncStore


class EpisodeWriter:
    """Writes finished episodes to the data plane, the trajectory files and the store.

    `write(step, trajectory)` returns once the episode is written everywhere, and raises what
    its group's write raised (the episode then counts as not written: whoever ran it may run it
    again, and since rows and records are keyed by trajectory id, a repeat replaces them). An
    infrastructure failure, or an episode without a reward, is written with reward NaN.
    """

    def __init__(
        self,
        data: DataPlane,
        store: AsyncStore | None,
        out_dir: Path,
        *,
        run_id: str,
        agent: str,
    ) -> None:
        self._data = data
        self._store = store
        self._out_dir = out_dir
        self._run_id = run_id
        self._agent = agent
        self._waiting: list[tuple[int, Trajectory, asyncio.Future[None]]] = []
        self._committing: asyncio.Task[None] | None = None

    async def write(self, step: int, trajectory: Trajectory) -> None:
        """Write `trajectory` as an episode of step `step` (class docstring)."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((step, trajectory, written))
        if self._committing is None or self._committing.done():
            self._committing = asyncio.create_task(self._commit())
        # Shielded: an episode whose caller gives up is still written with its group.
        await asyncio.shield(written)

    async def written_before(self, step: int, trajectory_id: str) -> Trajectory | None:
        """The trajectory an earlier attempt put into partition `step` under `trajectory_id`,
        or None if none did. Its store record (kept by the store if it was made) and its line
        in the step's trajectory file (if missing) are written from it, so the episode is
        written everywhere as that attempt left it."""
        trajectory = await self._data.written(step, trajectory_id)
        if trajectory is None:
            return None
        if self._store is not None:  # keeps a record it has: a no-op if it got there before
            await self._store.record_episodes(self._run_id, [trajectory], agent=self._agent)
        path = self._out_dir / f"step_{step}.jsonl"
        if trajectory_id not in _ids_in(path):
            with path.open("a") as stream:
                write_trajectory(stream, trajectory)
        return trajectory

    async def _commit(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting, []
            by_step: dict[int, list[tuple[Trajectory, asyncio.Future[None]]]] = {}
            for step, trajectory, written in group:
                by_step.setdefault(step, []).append((trajectory, written))
            for step, entries in by_step.items():
                try:
                    await self._write_group(step, [trajectory for trajectory, _ in entries])
                except Exception as err:
                    for _, written in entries:
                        if not written.done():
                            written.set_exception(err)
                else:
                    for _, written in entries:
                        if not written.done():
                            written.set_result(None)

    async def _write_group(self, step: int, trajectories: list[Trajectory]) -> None:
        rewards = [
            math.nan if t.is_infra_failure or t.reward is None else t.reward for t in trajectories
        ]
        # Side by side: the put is round trips to the queue's processes, the record a
        # transaction in a thread; neither needs the other. Both end before either's error is
        # raised, so a failed group leaves no write running.
        writes: list[Awaitable[object]] = [
            self._data.put_rollout(
                step,
                trajectories,
                # With the reward, what it was made of: a re-run that keeps this row
                # (`written_before`) records the episode from it.
                extra={"reward": rewards, "reward_info": [t.reward_info for t in trajectories]},
            )
        ]
        if self._store is not None:
            # `replace`: a step produced again (after a resume or the actor's restore) is
            # trained as produced now, under the same ids, and the store must hold that.
            writes.append(
                self._store.record_episodes(
                    self._run_id, trajectories, agent=self._agent, replace=True
                )
            )
        for outcome in await asyncio.gather(*writes, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        with (self._out_dir / f"step_{step}.jsonl").open("a") as stream:
            for trajectory in trajectories:
                write_trajectory(stream, trajectory)


def _ids_in(path: Path) -> set[str]:
    """The trajectory ids of a trajectory file's complete lines (another process may be
    appending its last one)."""
    if not path.is_file():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (ValueError, KeyError):
            continue
    return ids
