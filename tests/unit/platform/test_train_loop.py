"""`train_loop`'s production window, on fake roles: how many steps it has under way at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.controller import (
    Roles,
    RolloutReport,
    TrainReport,
    production_window,
    train_loop,
)
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig


def _config(tmp_path: Path, max_staleness: int | str, *, concurrency: int, steps: int) -> RunConfig:
    return RunConfig(
        model="tiny",
        run_dir=str(tmp_path),
        steps=steps,
        tasks_per_step=2,
        max_staleness=max_staleness,
        checkpoint_every=1_000,
        rollout=RolloutConfig(
            tasks="unused.jsonl",
            agent="unused.py:agent",
            samples_per_task=4,
            concurrency=concurrency,
        ),
    )


@pytest.mark.parametrize(
    ("max_staleness", "concurrency", "window"),
    [(0, 8, 1), (1, 8, 2), (2, 8, 3), (5, 8, 3), ("inf", 8, 3), ("inf", 24, 5), ("inf", 4, 3)],
)
def test_the_window_is_what_the_gate_releases_and_the_slots_can_start(
    tmp_path: Path, max_staleness: int | str, concurrency: int, window: int
) -> None:
    # 8 episodes a step: `concurrency` lets ceil(concurrency / 8) steps' episodes run at once.
    config = _config(tmp_path, max_staleness, concurrency=concurrency, steps=10)
    assert production_window(config) == window


class _Rollout:
    def __init__(self) -> None:
        self.under_way = 0
        self.most_under_way = 0
        self.steps: list[int] = []

    async def generate(self, step: int) -> RolloutReport:
        self.under_way += 1
        self.most_under_way = max(self.most_under_way, self.under_way)
        self.steps.append(step)
        await asyncio.sleep(0)
        self.under_way -= 1
        return RolloutReport(step, [], 0.0)


class _Advantage:
    async def compute(self, step: int) -> dict[str, float]:
        return {}


class _Actor:
    def __init__(self) -> None:
        self.version = 0
        self.trained: list[int] = []

    async def train(self, step: int) -> TrainReport:
        await asyncio.sleep(0.002)  # slower than a rollout: rollouts run ahead when allowed
        self.trained.append(step)
        self.version += 1
        return TrainReport(step, self.version - 1, self.version, [])


class _Sync:
    async def publish(self, version: int) -> dict[str, float]:
        return {}


class _Record:
    def target_reached(self, step: int) -> bool:
        return False

    async def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def checkpoint(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.mark.parametrize("max_staleness", [0, 1, "inf"])
async def test_a_long_run_has_at_most_the_window_under_way(
    tmp_path: Path, max_staleness: int | str
) -> None:
    config = _config(tmp_path, max_staleness, concurrency=8, steps=60)
    rollout, actor = _Rollout(), _Actor()
    roles = Roles(rollout=rollout, advantage=_Advantage(), actor=actor, sync=_Sync())  # type: ignore[arg-type]
    await train_loop(roles, _Record(), config, start=0)  # type: ignore[arg-type]
    assert actor.trained == list(range(60))
    assert sorted(rollout.steps) == list(range(60))
    assert rollout.most_under_way == production_window(config)
