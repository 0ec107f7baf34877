"""The control plane (DESIGN.md §1): one loop that directs the roles of a training run.

`train_loop` is the whole algorithm. It holds no model and no data; it tells the roles what to
do and in which order, and records what they report:

    for each step k:
        rollout(k) and advantages(k)   started as soon as the staleness gate allows k,
        (reference, teacher, critic)   i.e. k - steps_trained <= max_staleness (and no more
                                       steps at once than the episodes' slots can start:
                                       `production_window`)
        train(k)                       streams step k's micro-batches from the data plane
        sync(version)                  every engine serves the new weights...
        gate.advance(k + 1)            ...before any rollout that the advance releases starts
        record(k), checkpoint          metrics, trained ids; every `checkpoint_every` steps
                                       (and at the end: the last step, or `stop_when` met)

Staleness is one code path for every setting: 0 makes rollout k wait for train k-1 (on-policy:
each sample's version equals the trainer's), `k` lets rollouts run up to `k` steps ahead of
training, `inf` never waits. Why the bound holds: rollout k starts when the trainer has done
`>= k - max_staleness` steps and the engines already serve those weights (sync precedes
advance), so every token of step k was sampled by a version at most `max_staleness` behind the
one that trains on it. The actor checks this again per sample (`StalenessGate.admit`).

Roles are reached only through the small protocols below: `services` implements them over Ray
Serve deployments (the default), `local` in this process (`services.mode=in_process`). Rows
reach the actor only through the data plane, keyed by deterministic trajectory id, so a resumed
run regenerates exactly the steps after its checkpoint, with the same ids, and trains each id
once; the controller itself sees only ids, counts and metrics (`EpisodeSummary`).

A step whose share of infrastructure failures passes `faults.max_infra_error_share` fails the
run (`InfraErrorBound`): a run never ends `completed` having trained on nothing.

What a run leaves in `RUN_DIR` (`RunRecord`): `config.yaml`, `metrics.jsonl`, `trained.jsonl`
(per step: the trainer version and each trained id with the oldest version that sampled it),
`trajectories/step_{k}.jsonl`, `checkpoints/step_{k}/`, `tensorboard/`, `engine.log`.
Resuming rolls the two logs back to the checkpoint: steps after it are redone, and their
records belong to weights that no longer exist.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from omniloop.errors import OmniloopError
from omniloop.platform.control.metrics import step_metrics
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.control.staleness import StalenessGate, staleness_bound
from omniloop.trajectory import Trajectory

if TYPE_CHECKING:
    from omniloop.platform.control.health import HealthMonitor
    from omniloop.platform.control.record import RunRecord

# -- what roles report ------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeSummary:
    """What the controller learns of one finished episode: its id and the numbers behind the
    step's metrics. The trajectory itself stays in the data plane and the run store."""

    id: str
    reward: float | None
    infra_failure: bool
    stop_reason: str
    response_length: int
    turns: int
    sampled_tokens: int
    attempt: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """The episode's counted metrics (`tools/*`…), summed over the step."""

    @classmethod
    def of(cls, trajectory: Trajectory) -> EpisodeSummary:
        """The summary of a finished trajectory."""
        meta = trajectory.meta
        return cls(
            id=trajectory.id,
            reward=trajectory.reward,
            infra_failure=trajectory.is_infra_failure,
            stop_reason=str(meta.stop_reason),
            response_length=trajectory.response_length,
            turns=len(meta.turns),
            sampled_tokens=sum(trajectory.loss_mask),
            attempt=meta.attempt,
            metrics={key: float(value) for key, value in meta.metrics.items()},
        )


@dataclass
class RolloutReport:
    """The episodes of one rollout step, as written to its partition."""

    step: int
    episodes: list[EpisodeSummary]
    seconds: float
    """From the step's first episode starting to its partition being closed."""
    retried: int = 0
    """Episodes re-run because the replica running them failed."""
    extra_groups: int = 0
    """Groups run by dynamic sampling beyond the step's own."""
    dropped_groups: int = 0
    """Groups whose rewards were all equal, which dynamic sampling leaves out of training."""

    @property
    def infra_error_share(self) -> float:
        """The share of the step's episodes that ended in an infrastructure failure."""
        return sum(e.infra_failure for e in self.episodes) / max(len(self.episodes), 1)

    def metrics(self) -> dict[str, float]:
        """`reward/*`, `episodes/*`, `response_length/mean`, `perf/rollout_seconds`…"""
        return {
            **step_metrics(self.episodes),
            "perf/rollout_seconds": self.seconds,
            "episodes/retried": float(self.retried),
            "rollout/extra_groups": float(self.extra_groups),
            "rollout/dropped_groups": float(self.dropped_groups),
        }


class ActorLost(OmniloopError):
    """The actor's process died, and its weights, optimizer and data position with it."""


class InfraErrorBound(OmniloopError):
    """A step's share of infrastructure failures passed `faults.max_infra_error_share`."""


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


Released = Callable[[], asyncio.Future[None]]
"""Whether a step's episodes may start now: a future, done at once if they may, else once they
may (`StalenessGate.wait`)."""


class Rollout(Protocol):
    """Generates the episodes of a step (rewards included) into its data-plane partition."""

    async def generate(self, step: int, released: Released | None = None) -> RolloutReport:
        """Write every trajectory of `step` (rollout fields and `reward`), then close it. Each
        group of episodes starts only while `released()` is done (None: whenever it can)."""
        ...


class Advantage(Protocol):
    """Turns a step's rewards into per-token advantages, group by group."""

    async def compute(self, step: int) -> dict[str, float]:
        """Write `advantages` for every row of `step` as its group completes; return metrics."""
        ...


class Scorer(Protocol):
    """Scores a step's rows under a frozen model: the reference policy (for the KL penalty),
    or the teacher (for on-policy distillation)."""

    async def compute(self, step: int) -> dict[str, float]:
        """Write the role's logprobs field for every row of `step` as it arrives (`ref_logprobs`,
        `teacher_logprobs`); return metrics."""
        ...


class Critic(Protocol):
    """PPO's critic: values for a step's rows, then a step of its own on their returns."""

    async def compute(self, step: int) -> dict[str, float]:
        """Write `values` for every row of `step`, train on its `returns`; return metrics."""
        ...

    async def save(self, checkpoint: Path) -> None:
        """Save the critic into run checkpoint `checkpoint` (after the actor's part)."""
        ...

    async def load(self, checkpoint: Path) -> None:
        """Restore the critic of run checkpoint `checkpoint`."""
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

    async def recover(self, checkpoint: Path | None) -> int:
        """After `ActorLost`: wait until the actor serves again, restore `checkpoint` (None:
        the initial weights and an empty data position), give the engines those weights, and
        return the step to continue from."""
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
    monitor: HealthMonitor | None = None
    """Watches the roles' services while the loop runs (None for roles in this process)."""
    reference: Scorer | None = None
    """Scores the KL reference when a role does (`trainer.reference=external`)."""
    teacher: Scorer | None = None
    """Scores the distillation teacher (`trainer.teacher`)."""
    critic: Critic | None = None
    """PPO's critic (`trainer.critic`)."""


# -- the loop ---------------------------------------------------------------------------------


async def train_loop(roles: Roles, record: RunRecord, config: RunConfig, start: int) -> None:
    """Run steps `start .. config.steps - 1`, or until `config.stop_when` is met (module
    docstring); raises what a role raises."""
    if record.target_reached(start - 1):  # a resumed run that had met its target
        return
    gate = StalenessGate(config.max_staleness, trainer_version=start)

    async def produce(step: int) -> tuple[RolloutReport, dict[str, float]]:
        await gate.wait(step)  # until step - steps_trained <= max_staleness
        stages = [roles.advantage.compute(step)]
        stages += [
            s.compute(step) for s in (roles.reference, roles.teacher, roles.critic) if s is not None
        ]
        # The gate is asked again as each group starts: a restore may have rewound it since.
        rollout, *stage_metrics = await _together(
            roles.rollout.generate(step, lambda: gate.wait(step)), *stages
        )
        return rollout, {key: v for metrics in stage_metrics for key, v in metrics.items()}

    production: dict[int, asyncio.Task[tuple[RolloutReport, dict[str, float]]]] = {}
    upcoming, window, stopping = iter(range(start, config.steps)), production_window(config), False

    def launch(_: object = None) -> None:
        """Start producing the next steps while fewer than `window` are under way."""
        while not stopping and sum(not t.done() for t in production.values()) < window:
            if (k := next(upcoming, None)) is None:
                return
            production[k] = asyncio.create_task(produce(k))
            production[k].add_done_callback(launch)

    launch()
    last = time.perf_counter()

    async def train_and_publish(step: int) -> bool:
        nonlocal last
        launch()
        # The actor streams step k's rows while they are still being produced. (Shielded: if
        # the actor is lost, the step's rows are still wanted, by the restored actor.)
        trained, (rollout, advantages) = await _together(
            roles.actor.train(step), asyncio.shield(production[step])
        )
        del production[step]
        if rollout.infra_error_share > config.faults.max_infra_error_share:
            raise InfraErrorBound(_infra_cause(rollout, config.faults.max_infra_error_share))
        synced = {}
        if trained.version != trained.trained_version:
            synced = await roles.sync.publish(trained.version)
        # Only after the sync: a rollout this releases must sample the new weights.
        gate.advance(step + 1)
        now = time.perf_counter()
        await record.step(rollout, advantages, trained, synced, seconds=now - last)
        last = now
        reached = record.target_reached(step)  # `stop_when`: the run ends early
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps or reached:
            await record.checkpoint(roles.actor, step + 1, critic=roles.critic)
        return reached

    step = start
    try:
        while step < config.steps:
            try:
                if await train_and_publish(step):
                    break
            except ActorLost as lost:
                # Only the actor restarts, from its last checkpoint; rollouts go on. The gate
                # goes back to the checkpoint first, before the engines get its weights: an
                # episode that starts from then on samples them, so its step must be within
                # the bound of the checkpoint (groups of later steps wait for the restored actor
                # to catch up). The steps since the checkpoint are produced and trained again
                # (same ids), each released as the first time.
                gate.rewind(record.restore_point())
                restored = await record.restore_actor(roles.actor, step, lost)
                gate.rewind(min(restored, gate.trainer_version))
                for k in range(restored, step + 1):
                    if k not in production:  # trained and cleared by the lost actor
                        production[k] = asyncio.create_task(produce(k))
                step = restored
                continue
            step += 1
    finally:
        stopping = True
        gate.close()
        for task in production.values():
            task.cancel()
        await asyncio.gather(*production.values(), return_exceptions=True)


def production_window(config: RunConfig) -> int:
    """How many steps' production (rollout and stages) `train_loop` has under way at once:
    the steps the staleness gate can release (`max_staleness + 1`), but no more than the steps
    whose episodes `rollout.concurrency` lets run side by side, and two more (one ending, one
    starting). A step started past those would only wait: for episode slots, and its stages
    on the data plane, which the readers of every step of a long run (`max_staleness: inf`)
    would keep busy."""
    episodes = config.tasks_per_step * config.rollout.samples_per_task
    concurrent = math.ceil(config.rollout.concurrency / episodes) + 2
    return int(min(staleness_bound(config.max_staleness) + 1, concurrent))


def _infra_cause(rollout: RolloutReport, bound: float) -> str:
    failed = [e for e in rollout.episodes if e.infra_failure]
    reasons: dict[str, int] = {}
    for episode in failed:
        reasons[episode.stop_reason] = reasons.get(episode.stop_reason, 0) + 1
    causes = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
    return (
        f"step {rollout.step}: {len(failed)} of {len(rollout.episodes)} episodes failed on "
        f"infrastructure ({causes}), more than faults.max_infra_error_share={bound}; the run "
        "stops instead of training on what is left (raise the bound to go on regardless)"
    )


async def _together(*calls: Awaitable[Any]) -> list[Any]:
    """Await all; if one fails, cancel the others (no orphan keeps reading a dead step)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
