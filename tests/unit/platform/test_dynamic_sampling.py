"""Dynamic sampling in the rollout's step: a group whose rewards are all equal is followed by
an extra group of the step's plan while the step's budget lasts; and the step's plan."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from omniloop.agents.base import Task
from omniloop.platform.control.controller import EpisodeSummary
from omniloop.platform.control.faults import FaultTimeline, Retry, never_retry
from omniloop.platform.control.local import step_tasks, uniform_rewards
from omniloop.platform.control.run_config import FaultsConfig
from omniloop.platform.control.step_rollout import StepRollout

SIZE = 2
GROUPS = 2


def _rollout(rewards: dict[int, float], extra_groups: int) -> tuple[StepRollout, list[int]]:
    """A step of `GROUPS` groups of `SIZE`; episode `i` earns `rewards.get(i, i % 2)` (a group
    is mixed unless `rewards` says otherwise)."""
    asked: list[int] = []

    async def episodes(
        step: int, indices: list[int], attempt: int
    ) -> AsyncGenerator[list[tuple[int, EpisodeSummary]]]:
        for index in indices:
            asked.append(index)
            await asyncio.sleep(0)
            reward = rewards.get(index, float(index % 2))
            yield [(index, EpisodeSummary(f"e{index}", reward, False, "stop", 1, 1, 1))]

    async def nothing(step: int) -> None:
        return None

    rollout = StepRollout(
        GROUPS * SIZE,
        episodes,
        concurrency=8,
        begin=nothing,
        close=nothing,
        retry=Retry(FaultsConfig(), FaultTimeline(settle_s=1.0), never_retry),
        on_start=lambda step, n: None,
        on_episode=lambda step, n: None,
        group_size=SIZE,
        extra_groups=extra_groups,
    )
    return rollout, asked


def test_a_uniform_group_is_replaced_until_the_step_has_its_groups() -> None:
    # Group 0 (episodes 0, 1) all fail; its replacement, extra group 0 (4, 5), all succeed;
    # the next, extra group 1 (6, 7), is mixed. Group 1 (2, 3) is mixed.
    rewards = {0: 0.0, 1: 0.0, 4: 1.0, 5: 1.0}
    rollout, asked = _rollout(rewards, extra_groups=3)
    report = asyncio.run(rollout.generate(0))
    assert sorted(asked) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (report.extra_groups, report.dropped_groups) == (2, 2)
    assert report.metrics()["rollout/extra_groups"] == 2
    assert report.metrics()["rollout/dropped_groups"] == 2
    assert len(report.episodes) == 8


def test_the_budget_bounds_the_extra_groups() -> None:
    rollout, asked = _rollout(dict.fromkeys(range(20), 1.0), extra_groups=3)
    report = asyncio.run(rollout.generate(0))
    # Every group is uniform: the two of the step and the three extra ones are all dropped.
    assert sorted(asked) == list(range(GROUPS * SIZE + 3 * SIZE))
    assert (report.extra_groups, report.dropped_groups) == (3, 5)


def test_without_dynamic_sampling_every_group_runs_once() -> None:
    rollout, asked = _rollout(dict.fromkeys(range(20), 1.0), extra_groups=0)
    report = asyncio.run(rollout.generate(0))
    assert sorted(asked) == [0, 1, 2, 3]
    assert (report.extra_groups, report.dropped_groups) == (0, 0)


@pytest.mark.parametrize(
    ("rewards", "valid", "uniform"),
    [
        ([1.0, 1.0], [True, True], True),
        ([1.0, 0.0], [True, True], False),
        ([1.0, None], [True, False], True),  # an infra failure is not a reward
        ([None, None], [False, False], True),
    ],
)
def test_uniform_rewards(rewards: list[float | None], valid: list[bool], uniform: bool) -> None:
    assert uniform_rewards(rewards, valid) is uniform


def test_the_extra_groups_take_the_tasks_after_the_step_s_own() -> None:
    tasks = [Task(id=f"t{i}", prompt="p") for i in range(5)]
    assert [t.id for t in step_tasks(tasks, 1, 2, extra=4)] == ["t2", "t3", "t4", "t0", "t1", "t2"]
