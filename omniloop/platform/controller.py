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
import contextlib
import json
import math
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.progress import Progress, TaskID

from omniloop.errors import ConfigError
from omniloop.platform.metrics import MetricsSink, step_metrics, truncate_jsonl
from omniloop.platform.run_config import RunConfig, config_yaml
from omniloop.platform.staleness import StalenessGate
from omniloop.trajectory import Trajectory

if TYPE_CHECKING:
    from omniloop.platform.store import AsyncStore

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


class WeightSync(Protocol):
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
    sync: WeightSync


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


# -- what a run leaves behind -----------------------------------------------------------------


class RunRecord:
    """The run's files, database records and console output, one `step` call per trained step.

    The database gets each step's metrics and episodes (with their trajectories) once the step
    is trained, in one transaction each, so the dashboard shows a run as it trains.
    """

    def __init__(
        self,
        config: RunConfig,
        sink: MetricsSink,
        progress: Progress,
        store: AsyncStore,
        *,
        resume_step: int,
    ) -> None:
        assert config.run_id is not None, "the run id is resolved before the run starts"
        self.run_dir = Path(config.run_dir)
        self.trained_path = self.run_dir / "trained.jsonl"
        self.run_id = config.run_id
        self._config = config
        self._sink = sink
        self._progress = progress
        self._store = store
        self._bars: dict[int, TaskID] = {}
        for path in (self.trained_path, sink.path):
            truncate_jsonl(path, resume_step)

    def episodes_started(self, step: int, total: int) -> None:
        """A progress bar for `step` (called by the rollout when the step starts)."""
        self._bars[step] = self._progress.add_task(f"step {step + 1}", total=total)

    def episodes_done(self, step: int, count: int) -> None:
        """Advance `step`'s bar by `count` finished episodes."""
        self._progress.advance(self._bars[step], count)

    async def step(
        self,
        rollout: RolloutReport,
        advantages: dict[str, float],
        trained: TrainReport,
        synced: dict[str, float],
        *,
        seconds: float,
    ) -> dict[str, float]:
        """Append the step's trained ids and metrics, record them and its episodes in the
        database; print its summary line."""
        metrics = {**rollout.metrics(), **advantages, **trained.metrics, **synced}
        metrics["kl"] = trained.metrics.get("actor/ppo_kl", math.nan)
        metrics["entropy"] = trained.metrics.get("actor/entropy", math.nan)
        metrics["actor/trained_samples"] = float(len(trained.trained))
        metrics["perf/step_seconds"] = seconds
        metrics["perf/tokens_per_second"] = metrics["perf/sampled_tokens"] / max(seconds, 1e-9)
        with self.trained_path.open("a") as stream:
            line = {
                "step": trained.step,
                "trainer_version": trained.trained_version,
                "version": trained.version,
                "samples": trained.trained,
            }
            stream.write(json.dumps(line) + "\n")
        self._progress.remove_task(self._bars.pop(trained.step))
        await self._store.record_episodes(
            self.run_id, rollout.trajectories, agent=self._config.rollout.agent
        )
        await self._store.record_metrics(self.run_id, trained.step, metrics)
        self._sink.log(trained.step, metrics, total_steps=self._config.steps)
        return metrics

    async def checkpoint(self, actor: Actor, step: int) -> Path:
        """Save `checkpoints/step_{step}` and delete all but the newest `keep_checkpoints`."""
        path = self.run_dir / "checkpoints" / f"step_{step}"
        await actor.save(path, step)
        for old in checkpoints(self.run_dir)[: -self._config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return path


def checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    found = [
        p
        for p in (run_dir / "checkpoints").glob("step_*")
        if (p / "trainer_state.json").is_file() and p.name.removeprefix("step_").isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def seed_everything(seed: int) -> None:
    """Seed the trainer-side RNGs (sampling seeds derive from episode ids, not from these)."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


# -- a run, start to finish -------------------------------------------------------------------


async def run(config: RunConfig, *, resume: bool = False) -> Path:
    """Train as `config` says, with in-process roles; returns the run folder.

    Starts (and always stops again) the data plane, a local engine unless `rollout.engine.url`
    is given, and a sandbox pool. With `resume`, continues `config.run_dir` from its newest
    checkpoint: weights, optimizer, version, data position and consumed ids are restored, and
    the engines are given the restored weights before the first rollout. Without `resume`, a
    run folder that already holds checkpoints is refused rather than overwritten.
    """
    import torch
    from transformers.utils import logging as hf_logging

    from omniloop.agents.chat import ChatFormat
    from omniloop.inference.client import EngineClient
    from omniloop.inference.models import load_tokenizer, resolve_model
    from omniloop.platform.data import DataPlane, DataPlaneConfig
    from omniloop.platform.roles import (
        ActorWeights,
        LocalActor,
        LocalAdvantage,
        LocalRollout,
        step_tasks,
    )
    from omniloop.platform.rollout import (
        build_agent,
        build_rewards,
        console,
        engine_url,
        load_tasks,
        progress_bar,
        sandbox_pool,
    )
    from omniloop.platform.store import AsyncStore
    from omniloop.trainer.torch_backend import TorchTrainerBackend
    from omniloop.trainer.weight_sync import make_weight_sync

    # One line per step on the console; transformers' per-save progress bars would bury it.
    hf_logging.disable_progress_bar()
    run_dir = Path(config.run_dir)
    if checkpoints(run_dir) and not resume:
        raise ConfigError(
            f"{run_dir} already holds checkpoints; continue it with --resume {run_dir} "
            "or choose another run_dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml(config))
    config = with_run_id(config, resume=resume)
    if config.trainer_threads is not None:
        torch.set_num_threads(config.trainer_threads)
    seed_everything(config.seed)
    tasks = load_tasks(config.rollout.tasks, config.rollout.num_tasks)
    try:
        step_tasks(tasks, 0, config.tasks_per_step)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    agent = build_agent(config.rollout.agent)
    rewards = build_rewards(config.rollout.rewards)
    chat = ChatFormat(load_tokenizer(config.model), agent.tool_schemas)
    plane_config = DataPlaneConfig(
        ray_address=config.data_plane.ray_address,
        num_cpus=config.data_plane.num_cpus,
        ray_temp_dir=config.data_plane.ray_temp_dir,
    )

    store = AsyncStore.open(config.database)
    await store.migrate()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        await stack.enter_async_context(recorded_run(store, config, resume=resume))
        database = store.store.engine.url.render_as_string(hide_password=True)
        console.print(f"[bold]run[/bold] {config.run_id} recorded in {database}", soft_wrap=True)
        # Ray and the queue, the engine and the trainer's model start side by side.
        plane_start = asyncio.ensure_future(asyncio.to_thread(DataPlane.start, plane_config))
        stack.push_async_callback(_close_plane, plane_start)
        backend_load = asyncio.ensure_future(
            asyncio.to_thread(TorchTrainerBackend, config.model, config.trainer)
        )
        stack.push_async_callback(_settle, backend_load)
        url = await stack.enter_async_context(engine_url(config.rollout.engine, log_dir=run_dir))
        engine = await stack.enter_async_context(EngineClient(url))
        pool = await stack.enter_async_context(sandbox_pool(config.rollout.sandbox))
        backend = await backend_load
        actor_data = await plane_start
        # Every role has its own client of the queue, as a separate service would.
        rollout_data, advantage_data = DataPlane.start(), DataPlane.start()
        stack.callback(rollout_data.close)
        stack.callback(advantage_data.close)
        progress = stack.enter_context(progress_bar())
        sink = stack.enter_context(MetricsSink(run_dir, console, tensorboard=config.tensorboard))

        weight_sync = make_weight_sync(config.sync, [url], model_dir=resolve_model(config.model))
        stack.push_async_callback(weight_sync.close)
        actor = LocalActor(backend, actor_data, config)
        sync = ActorWeights(backend, weight_sync)
        start = 0
        if resume and (found := checkpoints(run_dir)):
            start = await actor.load(found[-1])
            await sync.publish(actor.version)
            console.print(
                f"[bold]resumed from[/bold] {found[-1]} (version {actor.version})", soft_wrap=True
            )
        record = RunRecord(config, sink, progress, store, resume_step=start)
        rollout = LocalRollout(
            config,
            tasks=tasks,
            agent=agent,
            rewards=rewards,
            chat=chat,
            engine=engine,
            sandboxes=pool,
            data=rollout_data,
            on_start=record.episodes_started,
            on_episode=record.episodes_done,
        )
        advantage = LocalAdvantage(
            advantage_data,
            config.trainer.advantage,
            config.rollout.samples_per_task,
            config.data_plane.read_timeout,
        )
        await train_loop(Roles(rollout, advantage, actor, sync), record, config, start)
    return run_dir


def with_run_id(config: RunConfig, *, resume: bool) -> RunConfig:
    """`config` with its run id: the one in `RUN_DIR/run_id` when resuming, else `run_id` as
    configured or a new random one, then kept in `RUN_DIR/run_id`."""
    path = Path(config.run_dir) / "run_id"
    if resume and path.is_file():
        run_id = path.read_text().strip()
        if config.run_id is not None and config.run_id != run_id:
            raise ConfigError(
                f"run_id={config.run_id!r} differs from {run_id!r}, the id of the run being "
                f"resumed (in {path}); drop the run_id override"
            )
    else:
        run_id = config.run_id or uuid.uuid4().hex
        path.write_text(run_id + "\n")
    rollout = config.rollout.model_copy(update={"run_id": run_id})
    return config.model_copy(update={"run_id": run_id, "rollout": rollout})


@contextlib.asynccontextmanager
async def recorded_run(
    store: AsyncStore, config: RunConfig, *, resume: bool
) -> AsyncIterator[None]:
    """The run's record in the database for the block: `running` during it, then `completed`,
    `cancelled` (interrupted) or `failed`. A resumed run continues its record."""
    from omniloop.platform.store import NotFound

    assert config.run_id is not None
    name = Path(config.run_dir).name
    try:
        await store.get_run(config.run_id)
    except NotFound:
        await store.create_run(name, config.model_dump(mode="json"), run_id=config.run_id)
    else:
        if not resume:
            raise ConfigError(
                f"the database already holds a run {config.run_id!r}: choose another run_id, "
                "or resume the run with --resume"
            )
    await store.update_run_status(config.run_id, "running")
    try:
        yield
    except (KeyboardInterrupt, asyncio.CancelledError):
        await asyncio.shield(store.update_run_status(config.run_id, "cancelled"))
        raise
    except BaseException:
        await asyncio.shield(store.update_run_status(config.run_id, "failed"))
        raise
    await store.update_run_status(config.run_id, "completed")


async def _settle(task: asyncio.Future[Any]) -> None:
    """Wait for a start-up task that may still run when start-up fails elsewhere."""
    await asyncio.gather(task, return_exceptions=True)


async def _close_plane(task: asyncio.Future[Any]) -> None:
    """Close the data plane once its start finished, whether or not the run got to use it."""
    results = await asyncio.gather(task, return_exceptions=True)
    plane = results[0]
    if not isinstance(plane, BaseException):
        await asyncio.to_thread(plane.close)
