"""The rollout role as the controller sees it: a step's episodes, sent out group by group.

A GRPO group (the `samples_per_task` episodes of one task) is the rollout's unit of work: it is
sent as one call (`EpisodesCall`: in this process, or one Ray Serve request to a rollout
replica, whose answer streams each episode back as it is written, those written at the same
moment in one message), runs side by side in one place (its episodes share their prompt, which
an engine prefills once when they arrive together), and is what the advantage stage waits for
anyway. Per group rather than per episode, a step of the toy task costs its controller and
rollout replica 4 Serve requests instead of 32.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from omniloop.platform.control.controller import EpisodeSummary, Released, RolloutReport
from omniloop.platform.control.faults import Retry
from omniloop.platform.control.local import EpisodeCallback, uniform_rewards

EpisodesCall = Callable[[int, list[int], int], AsyncGenerator[list[tuple[int, EpisodeSummary]]]]
"""`(step, indices, attempt)`: runs episodes `indices` of step `step`'s plan as attempt
`attempt`, wherever they run, and yields `(index, summary)` for each once it is written, in
the order they end, those written at the same moment in one list (one message of a streamed
answer). What cut an episode off (its replica, or a replica of a role its work used) is raised
after the others have been yielded; the caller runs the episodes not yielded again
(`EpisodeRunner.run_group`)."""


class Slots:
    """At most `total` episodes at once. A group takes its episodes' slots together (at most
    `total`) once they are free, in the order groups asked; each slot is given back as its
    episode ends."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def take(self, count: int) -> int:
        """Wait until `count` slots (`total` if fewer) are free and take them; return how many
        were taken, each to be given back with `give_back`."""
        count = min(count, self._total)
        if not self._waiting and self._free >= count:
            self._free -= count
            return count
        taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((count, taken))
        try:
            await taken
        except asyncio.CancelledError:
            if taken.done() and not taken.cancelled():  # given the slots as it was cancelled
                self.give_back(count)
            elif (count, taken) in self._waiting:  # leave the line: hold back no one behind
                self._waiting.remove((count, taken))
                self.give_back(0)
            raise
        return count

    def give_back(self, count: int = 1) -> None:
        """Free `count` slots, and hand them to the groups waiting, first come first."""
        self._free += count
        while self._waiting and (self._waiting[0][1].done() or self._free >= self._waiting[0][0]):
            wanted, taken = self._waiting.popleft()
            if not taken.done():  # not cancelled meanwhile
                self._free -= wanted
                taken.set_result(None)


class StepRollout:
    """The rollout role as the controller sees it: a step is its plan's groups of episodes,
    each group run by `episodes` (in this process, or on a rollout replica) and its episodes
    that a failure of a replica cut off run again with `attempt + 1` when `retry` says the
    failure was the replica's, not the episode's.

    `begin(step)` runs before the step's first episode, `close(step)` once all have been
    written. `on_start(step, n)` and `on_episode(step, 1)` report progress. At most
    `concurrency` episodes run at once, across all steps in flight: a group starts once its
    episodes fit (`Slots`), and each episode's slot comes back as it ends.

    With `extra_groups` (dynamic sampling), each group of `group_size` consecutive episodes
    whose rewards are all equal (`uniform_rewards`) is followed by the next extra group of the
    plan (episodes `episodes_per_step + j * group_size ...`), while any of the step's
    `extra_groups` are left; the advantage stage drops the uniform groups from training.
    """

    def __init__(
        self,
        episodes_per_step: int,
        episodes: EpisodesCall,
        *,
        concurrency: int,
        begin: Callable[[int], Awaitable[None]],
        close: Callable[[int], Awaitable[None]],
        retry: Retry,
        on_start: EpisodeCallback,
        on_episode: EpisodeCallback,
        group_size: int = 1,
        extra_groups: int = 0,
    ) -> None:
        self._count = episodes_per_step
        self._group_size = group_size
        self._extra_groups = extra_groups
        self._episodes = episodes
        self._slots = Slots(concurrency)
        self._begin = begin
        self._close = close
        self._retry = retry
        self._on_start = on_start
        self._on_episode = on_episode

    async def generate(self, step: int, released: Released | None = None) -> RolloutReport:
        """Run step `step`'s episodes into partition `step`, then close it; each group starts
        (takes its slots) only while `released()` is done, if given."""
        started = time.perf_counter()
        await self._retry.call("rollout", lambda _: self._begin(step), what=f"step {step} start")
        self._on_start(step, self._count)
        if self._extra_groups:
            episodes, extra, dropped = await self._dynamic(step, released)
        else:
            async with asyncio.TaskGroup() as group:
                runs = [
                    group.create_task(self._group(step, first, released))
                    for first in range(0, self._count, self._group_size)
                ]
            episodes, extra, dropped = [e for run in runs for e in run.result()], 0, 0
        await self._retry.call("rollout", lambda _: self._close(step), what=f"step {step} close")
        retried = sum(e.attempt > 0 for e in episodes)
        return RolloutReport(
            step,
            episodes,
            time.perf_counter() - started,
            retried=retried,
            extra_groups=extra,
            dropped_groups=dropped,
        )

    async def _dynamic(
        self, step: int, released: Released | None
    ) -> tuple[list[EpisodeSummary], int, int]:
        """The step's groups, each uniform one followed by an extra group while the budget
        lasts; returns every episode, the extra groups run and the uniform groups."""
        budget = self._extra_groups
        dropped = 0

        async def chain(first: int) -> list[EpisodeSummary]:
            nonlocal budget, dropped
            episodes: list[EpisodeSummary] = []
            while True:
                members = await self._group(step, first, released)
                episodes += members
                rewards = [e.reward for e in members]
                if not uniform_rewards(rewards, [not e.infra_failure for e in members]):
                    return episodes
                dropped += 1
                if budget == 0:
                    return episodes
                first = self._count + (self._extra_groups - budget) * self._group_size
                budget -= 1

        async with asyncio.TaskGroup() as group:
            chains = [
                group.create_task(chain(first)) for first in range(0, self._count, self._group_size)
            ]
        episodes = [e for c in chains for e in c.result()]
        return episodes, self._extra_groups - budget, dropped

    async def _group(
        self, step: int, first: int, released: Released | None
    ) -> list[EpisodeSummary]:
        """Episodes `first ... first + group_size - 1` of step `step`, in that order."""
        indices = list(range(first, first + self._group_size))
        written: dict[int, EpisodeSummary] = {}

        async def run(attempt: int) -> None:
            left = [i for i in indices if i not in written]
            held = await self._take_released(len(left), released)
            try:
                async with contextlib.aclosing(self._episodes(step, left, attempt)) as stream:
                    async for ended in stream:
                        for index, summary in ended:
                            written[index] = summary
                            if held:
                                held -= 1
                                self._slots.give_back()
                            self._on_episode(step, 1)
            finally:
                self._slots.give_back(held)

        what = f"step {step} episodes {indices[0]}-{indices[-1]}"
        await self._retry.call("rollout", run, what=what)
        return [written[i] for i in indices]

    async def _take_released(self, count: int, released: Released | None) -> int:
        """`Slots.take`, once the step's episodes may start, and only while they still may:
        the release can be taken back (the staleness gate rewound to an older checkpoint's
        actor) while a group waits for its slots."""
        while True:
            if released is not None:
                await released()
            held = await self._slots.take(count)
            if released is None:
                return held
            still = released()
            if still.done():
                return held
            still.cancel()  # withdrawn: the next turn of the loop waits on a fresh one
            self._slots.give_back(held)
