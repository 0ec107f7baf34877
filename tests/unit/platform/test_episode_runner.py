"""`EpisodeRunner.run`: a re-run episode (`attempt` > 0) asks the data plane for the row under
the id its first attempt wrote, and keeps that row instead of running again. `run_group`: a
group's episodes run side by side, each reported as it is written."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.agents.base import Task
from omniloop.errors import RoleLost
from omniloop.platform.control import local
from omniloop.platform.control.episode import EpisodeSettings
from omniloop.platform.control.local import EpisodeRunner
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig
from omniloop.trajectory import ErrorInfo, Trajectory, TrajectoryBuilder, TrajectoryMeta


class Rows:
    """A data plane holding each put row by trajectory id, logging the ids asked for."""

    def __init__(self) -> None:
        self.rows: dict[str, Trajectory] = {}
        self.asked: list[str] = []

    async def put_rollout(self, step: int, trajectories: list[Trajectory], extra: Any) -> None:
        self.rows.update((t.id, t) for t in trajectories)

    async def written(self, step: int, trajectory_id: str) -> Trajectory | None:
        self.asked.append(trajectory_id)
        return self.rows.get(trajectory_id)


@pytest.fixture
def episodes(monkeypatch: pytest.MonkeyPatch) -> list[EpisodeSettings]:
    """Stands in for `run_episode`: logs each run's settings and samples one token that says
    which attempt sampled it."""
    ran: list[EpisodeSettings] = []

    async def run_episode(agent: Any, task: Task, **kwargs: Any) -> Trajectory:
        settings: EpisodeSettings = kwargs["settings"]
        ran.append(settings)
        builder = TrajectoryBuilder([1, 2])
        builder.add_sampled([100 + settings.attempt], [-0.5], 0)
        meta = TrajectoryMeta(
            run_id=settings.run_id,
            episode_id=settings.episode_id,
            attempt=settings.attempt,
            task_id=task.id,
            stop_reason="stop",
        )
        trajectory = builder.build(meta)
        trajectory.reward = 1.0
        return trajectory

    monkeypatch.setattr(local, "run_episode", run_episode)
    return ran


def _runner(data: Rows, tmp_path: Path) -> EpisodeRunner:
    config = RunConfig(
        model="tiny",
        run_id="r",
        run_dir=str(tmp_path),
        tasks_per_step=2,
        rollout=RolloutConfig(
            tasks="unused.jsonl",
            agent="unused.py:agent",
            samples_per_task=2,
            output=str(tmp_path / "trajectories"),
        ),
    )
    tasks = [Task(id=f"t{i}", prompt=f"task {i}") for i in range(2)]
    return EpisodeRunner(
        config,
        tasks=tasks,
        agent=None,  # type: ignore[arg-type]
        rewards=[],
        chat=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        sandboxes=None,  # type: ignore[arg-type]
        data=data,  # type: ignore[arg-type]
        store=None,
    )


def test_a_rerun_keeps_the_row_its_first_attempt_wrote(
    tmp_path: Path, episodes: list[EpisodeSettings]
) -> None:
    data = Rows()
    runner = _runner(data, tmp_path)
    first = asyncio.run(runner.run(1, 3))
    assert data.asked == []  # a first attempt asks for nothing
    [row] = data.rows.values()
    # The reply was lost: the episode is asked for again, as attempt 1.
    again = asyncio.run(runner.run(1, 3, attempt=1))
    assert data.asked == [row.id]
    assert [s.attempt for s in episodes] == [0]  # not run again
    assert again == first
    assert data.rows == {row.id: row}
    assert row.input_ids[-1] == 100


def test_a_rerun_whose_first_attempt_wrote_nothing_runs_as_its_attempt(
    tmp_path: Path, episodes: list[EpisodeSettings]
) -> None:
    data = Rows()
    runner = _runner(data, tmp_path)
    asyncio.run(runner.run(0, 2, attempt=1))
    [settings] = episodes
    [row] = data.rows.values()
    assert (settings.attempt, settings.episode_id) == (1, "step0/t1/0")
    assert data.asked == [row.id]
    assert row.meta.attempt == 1
    assert row.input_ids[-1] == 101
    lines = (tmp_path / "trajectories" / "step_0.jsonl").read_text().splitlines()
    assert len(lines) == 1


def test_a_group_runs_side_by_side_and_reports_each_episode_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plan of step 1: t0/0, t0/1, t1/0, t1/1 (indices 0-3). Episode 1 ends last; episode 2's
    # sandbox replica dies under it.
    # (Gaps of 0.2 s: a loaded machine would have to hold the loop that long between two
    # episodes' starts to change the order they end in.)
    seconds = {"step1/t0/0": 0.2, "step1/t0/1": 0.6, "step1/t1/0": 0.4, "step1/t1/1": 0.0}

    async def run_episode(agent: Any, task: Task, **kwargs: Any) -> Trajectory:
        settings: EpisodeSettings = kwargs["settings"]
        await asyncio.sleep(seconds[settings.episode_id])
        builder = TrajectoryBuilder([1, 2])
        builder.add_sampled([100], [-0.5], 0)
        error = None
        if settings.episode_id == "step1/t1/0":
            error = ErrorInfo(type="SandboxLost", message="gone", failed_role="sandbox")
        meta = TrajectoryMeta(
            run_id=settings.run_id,
            episode_id=settings.episode_id,
            task_id=task.id,
            stop_reason="sandbox_error" if error else "stop",
            error=error,
        )
        return builder.build(meta)

    monkeypatch.setattr(local, "run_episode", run_episode)
    data = Rows()
    runner = _runner(data, tmp_path)

    async def main() -> tuple[list[int], BaseException | None]:
        reported: list[int] = []
        try:
            async for ended in runner.run_group(1, [0, 1, 2, 3]):
                reported += [index for index, _ in ended]
        except RoleLost as err:
            return reported, err
        return reported, None

    reported, error = asyncio.run(main())
    # In the order they ended (side by side: one after the other would be 0, 1, 3), the lost
    # one left out and raised after the others.
    assert reported == [3, 0, 1]
    assert isinstance(error, RoleLost)
    assert error.failed_role == "sandbox"
    assert len(data.rows) == 3  # the lost episode was not written


def test_a_group_closed_early_cancels_the_episodes_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cancelled: list[str] = []

    async def run_episode(agent: Any, task: Task, **kwargs: Any) -> Trajectory:
        settings: EpisodeSettings = kwargs["settings"]
        try:
            await asyncio.sleep(0 if settings.episode_id.endswith("t0/0") else 10)
        except asyncio.CancelledError:
            cancelled.append(settings.episode_id)
            raise
        builder = TrajectoryBuilder([1, 2])
        builder.add_sampled([100], [-0.5], 0)
        meta = TrajectoryMeta(
            run_id=settings.run_id,
            episode_id=settings.episode_id,
            task_id=task.id,
            stop_reason="stop",
        )
        return builder.build(meta)

    monkeypatch.setattr(local, "run_episode", run_episode)
    runner = _runner(Rows(), tmp_path)

    async def main() -> int:
        group = runner.run_group(0, [0, 1, 2])
        [(index, _)] = await anext(group)
        await group.aclose()
        return index

    assert asyncio.run(asyncio.wait_for(main(), 5)) == 0
    assert sorted(cancelled) == ["step0/t0/1", "step0/t1/0"]


def test_a_steps_plan_is_built_once_while_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    build = EpisodeRunner._build_plan

    def counted(runner: EpisodeRunner, step: int) -> list[tuple[Task, EpisodeSettings]]:
        built.append(step)
        return build(runner, step)

    monkeypatch.setattr(EpisodeRunner, "_build_plan", counted)
    runner = _runner(Rows(), tmp_path)
    first = runner.plan(0)
    assert [s.episode_id for _, s in first] == [f"step0/t{t}/{k}" for t in (0, 1) for k in (0, 1)]
    assert all(runner.plan(0) is first for _ in range(4))
    for step in range(1, local.PLANS_KEPT):  # step 0 is asked for again: the latest used
        runner.plan(step)
        runner.plan(0)
    assert built.count(0) == 1
    runner.plan(local.PLANS_KEPT)  # one more step: the least recently asked for goes
    assert runner.plan(0) is first
    assert built.count(1) == 1
    again = runner.plan(1)  # built anew, the same
    assert built.count(1) == 2
    assert [s.episode_id for _, s in again] == [f"step1/t{t}/{k}" for t in (0, 1) for k in (0, 1)]
