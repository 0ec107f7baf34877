"""`StepRollout`: a step's episodes go out one call per group; a group's episodes that a lost
replica cut off (and only those) run again as the next attempt; at most `concurrency`
episodes run at once, each slot given back as its episode ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from omniloop.errors import RoleLost
from omniloop.platform.control.controller import EpisodeSummary
from omniloop.platform.control.faults import Failure, FaultTimeline, Retry
from omniloop.platform.control.run_config import FaultsConfig
from omniloop.platform.control.staleness import StalenessGate
from omniloop.platform.control.step_rollout import Slots, StepRollout


def _summary(index: int, attempt: int) -> EpisodeSummary:
    return EpisodeSummary(f"e{index}", 1.0, False, "stop", 1, 1, 1, attempt=attempt)


def _lost(err: BaseException) -> tuple[Failure, str] | None:
    return ("lost", "") if isinstance(err, RoleLost) else None


class Calls:
    """An `EpisodesCall` that logs each call, runs each episode `seconds[index]` (0.01 unless
    given), and, on a call's first attempt, loses the episodes in `lose` after the others
    have been reported."""

    def __init__(
        self, seconds: dict[int, float] | None = None, lose: set[int] | None = None
    ) -> None:
        self.seconds = seconds or {}
        self.lose = lose or set()
        self.calls: list[tuple[list[int], int]] = []
        self.running = 0
        self.most_running = 0

    async def __call__(
        self, step: int, indices: list[int], attempt: int
    ) -> AsyncGenerator[list[tuple[int, EpisodeSummary]]]:
        self.calls.append((list(indices), attempt))
        queue: asyncio.Queue[int] = asyncio.Queue()

        async def one(index: int) -> None:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            await asyncio.sleep(self.seconds.get(index, 0.01))
            self.running -= 1
            await queue.put(index)

        runs = [asyncio.ensure_future(one(i)) for i in indices]
        lost = [i for i in indices if attempt == 0 and i in self.lose]
        for _ in indices:
            index = await queue.get()
            if index not in lost:
                yield [(index, _summary(index, attempt))]
        await asyncio.gather(*runs)
        if lost:
            raise RoleLost(f"episodes {lost}: their sandbox replica died", "sandbox")


def _rollout(calls: Calls, *, episodes: int, group: int, concurrency: int) -> StepRollout:
    async def nothing(step: int) -> None:
        return None

    return StepRollout(
        episodes,
        calls,
        concurrency=concurrency,
        begin=nothing,
        close=nothing,
        retry=Retry(FaultsConfig(retry_pause_s=0.01), FaultTimeline(), _lost),
        on_start=lambda step, n: None,
        on_episode=lambda step, n: None,
        group_size=group,
    )


def test_a_step_sends_one_call_per_group_and_reports_its_episodes_in_plan_order() -> None:
    calls = Calls(seconds={0: 0.05, 5: 0.03})  # episodes end out of order
    report = asyncio.run(_rollout(calls, episodes=8, group=4, concurrency=8).generate(0))
    assert sorted(indices for indices, _ in calls.calls) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [e.id for e in report.episodes] == [f"e{i}" for i in range(8)]
    assert report.retried == 0


def test_only_the_episodes_a_lost_replica_cut_off_run_again_as_the_next_attempt() -> None:
    calls = Calls(lose={1, 6})
    report = asyncio.run(_rollout(calls, episodes=8, group=4, concurrency=8).generate(0))
    again = sorted((indices, attempt) for indices, attempt in calls.calls if attempt > 0)
    assert again == [([1], 1), ([6], 1)]
    assert [e.id for e in report.episodes] == [f"e{i}" for i in range(8)]
    assert {e.id for e in report.episodes if e.attempt == 1} == {"e1", "e6"}
    assert report.retried == 2


def test_at_most_concurrency_episodes_run_at_once_across_groups() -> None:
    calls = Calls(seconds=dict.fromkeys(range(16), 0.3))
    asyncio.run(_rollout(calls, episodes=16, group=4, concurrency=8).generate(0))
    assert 4 < calls.most_running <= 8  # groups side by side, within the bound
    assert len(calls.calls) == 4


def test_a_group_wider_than_the_concurrency_still_runs() -> None:
    calls = Calls()
    report = asyncio.run(_rollout(calls, episodes=8, group=8, concurrency=2).generate(0))
    assert len(report.episodes) == 8


def test_each_slot_comes_back_as_its_episode_ends() -> None:
    async def main() -> list[str]:
        slots = Slots(4)
        order: list[str] = []
        first = await slots.take(4)
        assert first == 4

        async def second() -> None:
            await slots.take(2)
            order.append("second group started")

        waiting = asyncio.create_task(second())
        await asyncio.sleep(0.01)
        slots.give_back()  # one episode of the first group ended: not room enough yet
        await asyncio.sleep(0.01)
        order.append("one slot back")
        slots.give_back()
        await waiting
        return order

    assert asyncio.run(main()) == ["one slot back", "second group started"]


def test_a_cancelled_wait_for_slots_takes_none() -> None:
    async def main() -> int:
        slots = Slots(2)
        await slots.take(2)
        waiting = asyncio.create_task(slots.take(2))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0.01)
        slots.give_back(2)
        return await slots.take(2)  # all free again: the cancelled wait holds nothing

    assert asyncio.run(asyncio.wait_for(main(), 5)) == 2


def test_a_cancelled_wait_holds_back_no_group_behind_it() -> None:
    async def main() -> int:
        slots = Slots(4)
        await slots.take(3)
        wide = asyncio.create_task(slots.take(4))  # waits for all 4
        await asyncio.sleep(0.01)
        narrow = asyncio.create_task(slots.take(1))  # 1 is free, but it queues behind
        await asyncio.sleep(0.01)
        wide.cancel()
        return await asyncio.wait_for(narrow, 5)

    assert asyncio.run(main()) == 1


def test_a_group_starts_only_while_its_step_is_released() -> None:
    # Step 6 with bound 1 is released at trainer version 5. Its first group holds the only
    # slots; while the second waits for them, the gate is rewound to version 4 (the actor was
    # restored from an older checkpoint): the second group, given the slots, must not start
    # until the restored actor reaches version 5 again.
    async def scenario() -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
        gate = StalenessGate(1, trainer_version=5)
        calls = Calls(seconds={0: 0.05, 1: 0.05})
        first_started, first_ended = asyncio.Event(), asyncio.Event()

        async def episodes(
            step: int, indices: list[int], attempt: int
        ) -> AsyncGenerator[list[tuple[int, EpisodeSummary]]]:
            first_started.set()
            async for ended in calls(step, indices, attempt):
                yield ended
            first_ended.set()

        rollout = _rollout(episodes, episodes=4, group=2, concurrency=2)  # type: ignore[arg-type]
        generating = asyncio.ensure_future(rollout.generate(6, lambda: gate.wait(6)))
        await first_started.wait()
        gate.rewind(4)
        await first_ended.wait()
        await asyncio.sleep(0.1)  # the second group has its slots by now
        before = list(calls.calls)
        gate.advance(5)
        await generating
        return before, calls.calls

    before, after = asyncio.run(scenario())
    assert before == [([0, 1], 0)]
    assert after == [([0, 1], 0), ([2, 3], 0)]
