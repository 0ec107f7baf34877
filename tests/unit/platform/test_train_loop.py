"""`train_loop` on fake roles: how many steps it has under way at once, and what it produces
again after the actor was restored."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.controller import (
    ActorLost,
    Released,
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

    async def generate(self, step: int, released: Released | None = None) -> RolloutReport:
        if released is not None:
            await released()
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


class _LosingActor(_Actor):
    """Lost once, training step `lost_at`."""

    def __init__(self, lost_at: int) -> None:
        super().__init__()
        self.lost_at: int | None = lost_at

    async def train(self, step: int) -> TrainReport:
        if step == self.lost_at:
            self.lost_at = None
            raise ActorLost(f"lost training step {step}")
        return await super().train(step)


class _Restoring(_Record):
    """Restores the actor from its checkpoint of step `checkpoint`."""

    def __init__(self, checkpoint: int) -> None:
        self.checkpoint_step = checkpoint

    def restore_point(self) -> int:
        return self.checkpoint_step

    async def restore_actor(self, actor: _Actor, step: int, lost: Exception) -> int:
        actor.version = self.checkpoint_step
        return self.checkpoint_step


class _VersionedRollout(_Rollout):
    """Records the actor's version as each step's production starts."""

    def __init__(self, actor: _Actor) -> None:
        super().__init__()
        self.actor = actor
        self.started: list[tuple[int, int]] = []

    async def generate(self, step: int, released: Released | None = None) -> RolloutReport:
        self.started.append((step, self.actor.version))
        return await super().generate(step, released)


async def test_the_steps_trained_again_after_a_restore_keep_the_staleness_bound(
    tmp_path: Path,
) -> None:
    # Lost training step 9, restored from the checkpoint of step 6: steps 6 to 9 are produced
    # and trained again, and step 8 may start only once step 6 is (bound 1), or it would sample
    # version 6 and reach a trainer at version 8.
    config = _config(tmp_path, 1, concurrency=8, steps=12)
    actor = _LosingActor(lost_at=9)
    rollout = _VersionedRollout(actor)
    roles = Roles(rollout=rollout, advantage=_Advantage(), actor=actor, sync=_Sync())  # type: ignore[arg-type]
    await train_loop(roles, _Restoring(checkpoint=6), config, start=0)  # type: ignore[arg-type]
    assert actor.trained == [*range(9), *range(6, 12)]
    assert [s for s, _ in rollout.started if s in (6, 7, 8)] == [6, 7, 8, 6, 7, 8]
    assert all(step - version <= 1 for step, version in rollout.started), rollout.started
