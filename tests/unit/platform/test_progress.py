"""A step's progress bar: one tick per finished episode, and episodes past the step's count
(dynamic sampling's extra groups) grow its total instead of running past it."""

from __future__ import annotations

from pathlib import Path

from rich.progress import Progress

from omniloop.platform.control.record import RunRecord
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig


def test_extra_episodes_grow_the_step_s_total(tmp_path: Path) -> None:
    config = RunConfig(
        model="tiny",
        run_id="r",
        run_dir=str(tmp_path),
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
    )
    progress = Progress(disable=True)
    record = RunRecord(config, None, progress, None)  # type: ignore[arg-type]
    record.episodes_started(0, 4)
    for _ in range(6):
        record.episodes_done(0, 1)
    [bar] = progress.tasks
    assert (bar.completed, bar.total) == (6, 6)
