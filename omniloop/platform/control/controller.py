"""The control plane (DESIGN.md §1): one loop that directs the roles of a training run.

`train_loop` is the whole algorithm. It holds no model and no data; it tells the roles what to
do and in which order, and records what they report:

    for each step k:
        rollout(k) and advantages(k)   started as soon as the staleness gate allows k,
                                       i.e. k - steps_trained <= max_staleness
        train(k)                       streams step k's micro-batches from the data plane
        sync(version)                  every engine serves the new weights...
        gate.advance(k + 1)            ...before any rollout that the advance releases starts
        record(k), checkpoint          metrics, trained ids; every `checkpoint_every` steps

Staleness is one code path for every setting: 0 makes rollout k wait for train k-1 (on-policy:
each sample's version equals the trainer's), `k` lets rollouts run up to `k` steps ahead of
training, `inf` never waits. Why the bound holds: rollout k starts when the trainer has done
`>= k - max_staleness` steps and the engines already serve those weights (sync precedes
advance), so every token of step k was sampled by a version at most `max_staleness` behind the
one that trains on it. The actor checks this again per sample (`StalenessGate.admit`).

Roles are reached only through the small protocols below, the interfaces their Ray Serve
services have; `run` builds in-process implementations (`roles.py`). Rows reach the actor only
through the data plane, keyed by deterministic trajectory id, so a resumed run regenerates
exactly the steps after its checkpoint, with the same ids, and trains each id once.

What a run leaves in `RUN_DIR` (`RunRecord`): `config.yaml`, `metrics.jsonl`, `trained.jsonl`
(per step: the trainer version and each trained id with the oldest version that sampled it),
`trajectories/step_{k}.jsonl`, `checkpoints/step_{k}/`, `tensorboard/`, `engine.log`.
Resuming rolls the two logs back to the checkpoint: steps after it are redone, and their
records belong to weights that no longer exist.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from omniloop.platform.control.metrics import step_metrics
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.control.staleness import StalenessGate
from omniloop.trajectory import Trajectory

if TYPE_CHECKING:
    from omniloop.platform.control.record import RunRecord

# -- what roles report ------------------------------------------------------------------------


@dataclass
class RolloutReport:
    """The episodes of one rollout step, as written to its partition."""

    step: int
    trajectories: list[Trajectory]
    seconds: float
    """From the step's first episode starting to its partition being closed."""

    def metrics(self) -> dict[str, float]:
        """`reward/*`, `episodes/*`, `response_length/mean`, `perf/rollout_seconds`…"""
        return {**step_metrics(self.trajectories), "perf/rollout_seconds": self.seconds}


@dataclass
class TrainReport:
    """What the actor did with one step's samples."""

    step: int
    trained_version: int
    """The weight version the samples were trained against (before the update)."""
    version: int
    """The weight version after the step (unchanged when no optimizer step was taken)."""
    trained: list[tuple[str, int]]
    """(trajectory id, oldest weight version that sampled it) of every trained sample."""
    metrics: dict[str, float] = field(default_factory=dict)


# -- the roles' interfaces --------------------------------------------------------------------


class Rollout(Protocol):
    """Generates the episodes of a step (rewards included) into its data-plane partition."""

    async def generate(self, step: int) -> RolloutReport:
        """Write every trajectory of `step` (rollout fields and `reward`), then close it."""
        ...


class Advantage(Protocol):
    """Turns a step's rewards into per-token advantages, group by group."""

    async def compute(self, step: int) -> dict[str, float]:
        """Write `advantages` for every row of `step` as its group completes; return metrics."""
        ...


class Actor(Protocol):
    """The trainer: consumes a step's rows from the data plane exactly once."""

    @property
    def version(self) -> int:
        """Optimizer steps applied so far (the weight version it would publish)."""
        ...

    async def train(self, step: int) -> TrainReport:
        """Take one optimizer step on `step`'s admitted samples."""
        ...

    async def save(self, path: Path, step: int) -> None:
        """Checkpoint the trainer and its data position (`step` is the next step to train)."""
        ...

    async def load(self, path: Path) -> int:
        """Restore a checkpoint; return the step to continue from."""
        ...


class Weights(Protocol):
    """Delivers the actor's weights to every engine."""

    async def publish(self, version: int) -> dict[str, float]:
        """Return once every engine serves `version`; metrics (`perf/sync_seconds`…)."""
        ...


@dataclass
class Roles:
    """The roles one run directs."""

    rollout: Rollout
    advantage: Advantage
    actor: Actor
    sync: Weights


# -- the loop ---------------------------------------------------------------------------------


async def train_loop(roles: Roles, record: RunRecord, config: RunConfig, start: int) -> None:
    """Run steps `start .. config.steps - 1` (module docstring); raises what a role raises."""
    gate = StalenessGate(config.max_staleness, trainer_version=start)

    async def produce(step: int) -> tuple[RolloutReport, dict[str, float]]:
        await gate.wait(step)  # until step - steps_trained <= max_staleness
        rollout, advantages = await _together(
            roles.rollout.generate(step), roles.advantage.compute(step)
        )
        return rollout, advantages

    production = {k: asyncio.create_task(produce(k)) for k in range(start, config.steps)}
    last = time.perf_counter()
    try:
        for step in range(start, config.steps):
            # The actor streams step k's rows while they are still being produced.
            trained, (rollout, advantages) = await _together(
                roles.actor.train(step), production[step]
            )
            del production[step]
            synced = {}
            if trained.version != trained.trained_version:
                synced = await roles.sync.publish(trained.version)
            # Only after the sync: a rollout this releases must sample the new weights.
            gate.advance(step + 1)
            now = time.perf_counter()
            await record.step(rollout, advantages, trained, synced, seconds=now - last)
            last = now
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                await record.checkpoint(roles.actor, step + 1)
    finally:
        gate.close()
        for task in production.values():
            task.cancel()
        await asyncio.gather(*production.values(), return_exceptions=True)


async def _together(first: Awaitable[Any], second: Awaitable[Any]) -> tuple[Any, Any]:
    """Await both; if one fails, cancel the other (no orphan keeps reading a dead step)."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        a, b = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return a, b
