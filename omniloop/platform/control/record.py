"""What a run leaves behind: its files, its database records, its console lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import Progress, TaskID

from omniloop.errors import ConfigError
from omniloop.platform.control.console import console
from omniloop.platform.control.controller import Actor, Critic, RolloutReport, TrainReport
from omniloop.platform.control.faults import Fault, FaultTimeline
from omniloop.platform.control.metrics import MetricsSink, read_jsonl, truncate_jsonl
from omniloop.platform.control.run_config import RunConfig

if TYPE_CHECKING:
    from omniloop.platform.store import AsyncStore


class RunRecord:
    """The run's files, database records and console output, one `step` call per trained step.

    The database gets each step's metrics once the step is trained (the rollout role records
    the episodes themselves as they finish), so the dashboard shows a run as it trains. A fault
    (`FaultTimeline`) is a run event as soon as it is detected, and again once it has recovered
    (the step that recorded it then); the finished faults also go to `RUN_DIR/faults.jsonl`
    and the step's metrics.
    """

    def __init__(
        self,
        config: RunConfig,
        sink: MetricsSink,
        progress: Progress,
        store: AsyncStore,
    ) -> None:
        assert config.run_id is not None, "the run id is resolved before the run starts"
        self.run_dir = Path(config.run_dir)
        self.trained_path = self.run_dir / "trained.jsonl"
        self.faults_path = self.run_dir / "faults.jsonl"
        self.timeline = FaultTimeline(
            settle_s=2 * config.services.health_check_period_s + 5.0,
            on_change=lambda message: console.print(f"[bold red]fault[/bold red] {message}"),
            on_open=self._fault_opened,
        )
        self.run_id = config.run_id
        self._config = config
        self._sink = sink
        self._progress = progress
        self._store = store
        self._bars: dict[int, TaskID] = {}
        self._restored_at: set[int] = set()
        self._opened: set[asyncio.Task[int]] = set()
        """Store writes of detected faults not yet awaited (`_record_faults` awaits them)."""
        self._watched: dict[int, float] = {}
        """Per recorded step, the value of the metric `stop_when` watches."""
        self._last_step = config.steps - 1
        """The step the faults found after the loop are recorded under."""
        self.ended_early: str | None = None
        """Why the run ends before its last step (its `stop_when` target, met), once it is."""

    def _fault_opened(self, fault: Fault) -> None:
        """Record `fault` as it opens, under the oldest step in production (the step that
        records it when it recovers by then), without holding up the caller."""
        # The event is the fault as detected: its fields are read now, not when the write runs.
        event = self._fault_event(min(self._bars, default=None), fault)
        write = asyncio.get_running_loop().create_task(
            self._store.record_run_event(self.run_id, "fault", event)
        )
        self._opened.add(write)
        write.add_done_callback(self._opened.discard)

    def rewind(self, step: int) -> None:
        """Drop what the logs hold from step `step` on (a resumed run redoes those steps)."""
        for path in (self.trained_path, self._sink.path):
            truncate_jsonl(path, step)
        stop_when = self._config.stop_when
        if stop_when is not None:
            logged = read_jsonl(self._sink.path) if self._sink.path.is_file() else []
            values = {line["step"]: line.get(stop_when.metric) for line in logged}
            # NaN is logged as null.
            self._watched = {k: math.nan if v is None else v for k, v in values.items()}

    def target_reached(self, step: int) -> bool:
        """Whether the run ends early after `step`: its `stop_when` target is met by the steps
        recorded up to it (printed, and kept in `ended_early`, when it is); False for a run
        without one, and at the run's last step."""
        stop_when = self._config.stop_when
        if stop_when is None or step + 1 >= self._config.steps:
            return False
        if (mean := stop_when.reached(self._watched, step)) is None:
            return False
        if stop_when.at_least is not None:
            bound = f"at least {stop_when.at_least}"
        else:
            bound = f"at most {stop_when.at_most}"
        self.ended_early = (
            f"stop_when: {stop_when.metric} averaged {mean:.3f} over steps "
            f"{step - stop_when.over_steps + 2}-{step + 1} ({bound}); the run ended after step "
            f"{step + 1} of {self._config.steps}"
        )
        console.print(f"[bold]stop_when[/bold]{self.ended_early.removeprefix('stop_when:')}")
        return True

    def episodes_started(self, step: int, total: int) -> None:
        """A progress bar for `step` (called by the rollout when the step starts)."""
        if step in self._bars:  # produced again after an actor restore
            self._progress.remove_task(self._bars.pop(step))
        self._bars[step] = self._progress.add_task(f"step {step + 1}", total=total)

    def episodes_done(self, step: int, count: int) -> None:
        """Advance `step`'s bar by `count` finished episodes; episodes past its total (dynamic
        sampling's extra groups) grow the total."""
        bar = self._bars[step]
        task = next(task for task in self._progress.tasks if task.id == bar)
        if task.total is not None and task.completed + count > task.total:
            self._progress.update(bar, total=task.completed + count)
        self._progress.advance(bar, count)

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
        faults = self.timeline.take_finished()
        metrics["faults/count"] = float(len(faults))
        recovery = [f.recovery_seconds or 0.0 for f in faults]
        metrics["faults/recovery_seconds"] = max(recovery) if recovery else 0.0
        metrics["faults/refused_calls"] = float(self.timeline.take_refused())
        if self._config.stop_when is not None:
            self._watched[trained.step] = self._config.stop_when.value(trained.step, metrics)
        self._last_step = trained.step
        await self._record_faults(trained.step, faults)
        await self._store.record_metrics(self.run_id, trained.step, metrics)
        self._sink.log(trained.step, metrics, total_steps=self._config.steps)
        return metrics

    async def _record_faults(self, step: int, faults: list[Fault]) -> None:
        # A fault's detection is stored before its recovery, which supersedes it.
        await asyncio.gather(*self._opened)
        with self.faults_path.open("a") as stream:
            for fault in faults:
                stream.write(json.dumps(self._fault_event(step, fault)) + "\n")
        for fault in faults:
            await self._store.record_run_event(self.run_id, "fault", self._fault_event(step, fault))

    @staticmethod
    def _fault_event(step: int | None, fault: Fault) -> dict[str, Any]:
        """The data of a `fault` run event: `fault` as it stands now, seen by `step`."""
        return {"step": step, **fault.to_json()}

    async def finish(self) -> None:
        """Record the faults no step has recorded yet (under the last step recorded): those
        that recovered after it, and those still open (`recovered_at` None) when the run
        ended."""
        await self._record_faults(self._last_step, self.timeline.take_all())

    def restore_point(self) -> int:
        """The step a restore of the actor continues from: the newest checkpoint's (0: none)."""
        found = checkpoints(self.run_dir)
        return int(found[-1].name.removeprefix("step_")) if found else 0

    async def restore_actor(self, actor: Actor, step: int, lost: Exception) -> int:
        """Restore a lost actor from the newest checkpoint; return the step to go on from.

        Raises `RoleFailed` when the actor is lost again at a step it was already restored for
        (a trainer that dies deterministically, out of memory say, would loop forever)."""
        from omniloop.platform.control.faults import RoleFailed

        if step in self._restored_at:
            raise RoleFailed(f"the actor was lost twice at step {step}: {lost}") from lost
        self._restored_at.add(step)
        found = checkpoints(self.run_dir)
        checkpoint = found[-1] if found else None
        since = checkpoint.name if checkpoint else "the start"
        self.timeline.failed(
            "actor", "", f"{type(lost).__name__}: {lost}", f"{since} to step {step}"
        )
        restored = await actor.recover(checkpoint)
        self.rewind(restored)
        return restored

    async def checkpoint(self, actor: Actor, step: int, critic: Critic | None = None) -> Path:
        """Save `checkpoints/step_{step}` (the actor's part, written aside and renamed into
        place, then the critic's inside it) and delete all but the newest `keep_checkpoints`."""
        path = self.run_dir / "checkpoints" / f"step_{step}"
        await actor.save(path, step)
        if critic is not None:
            await critic.save(path)
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


@dataclass
class RunEnding:
    """What the block of `recorded_run` says of a run that ends well."""

    reason: str | None = None
    """Why it ended where it did (`RunRecord.ended_early`), if there is something to say."""


@contextlib.asynccontextmanager
async def recorded_run(
    store: AsyncStore, config: RunConfig, *, resume: bool
) -> AsyncIterator[RunEnding]:
    """The run's record in the database for the block: `running` during it, then `completed`
    (with the yielded `RunEnding`'s reason), `cancelled` (interrupted) or `failed` (with the
    error as its reason). A resumed run continues its record."""
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
    ending = RunEnding()
    try:
        yield ending
    except (KeyboardInterrupt, asyncio.CancelledError):
        await asyncio.shield(store.update_run_status(config.run_id, "cancelled"))
        raise
    except BaseException as err:
        cause = f"{type(err).__name__}: {err}"
        await asyncio.shield(store.update_run_status(config.run_id, "failed", cause))
        raise
    await store.update_run_status(config.run_id, "completed", ending.reason)
