"""What the rollout's bookkeeping costs as a run grows.

- A new session's engine (`EngineRouter`): a rollout's router remembers the engine of up to
  `MAX_SESSIONS` sessions (one per episode) and sends a new session to the engine with the
  fewest requests in flight, then the fewest remembered sessions. Timed: `_pick` of a new
  session key over two engines (no request sent) after `--sessions` earlier sessions. A run
  remembers one session per episode it has run: 100,000 is 3,125 steps of 32 episodes.
- An episode's settings (`EpisodeRunner.plan`): every episode of a step looks up its task and
  settings in the step's plan. Timed: every episode of a new step looking its own up, for
  steps of `--episodes` episodes (groups of 8).

Prints ONE JSON line: `pick_us` (sessions remembered -> microseconds per new session's pick,
the mean of `--picks`), `plan_ms_per_step` (episodes per step -> milliseconds for all of a
step's lookups, the mean of 5 steps) and the Python version.

    .venv/bin/python bench/rollout_bookkeeping.py [--sessions 1000 10000 100000]
        [--picks 2000] [--episodes 32 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from omniloop.agents.base import Task
from omniloop.inference.router import EngineRouter
from omniloop.platform.control.local import EpisodeRunner
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig

GROUP = 8
STEPS = 5


async def pick_seconds(remembered: int, picks: int) -> float:
    """Mean seconds of a new session's pick after `remembered` sessions."""
    router = EngineRouter.over(["http://engine-a", "http://engine-b"])
    for i in range(remembered):
        await router._pick(f"earlier-{i}")
    started = time.perf_counter()
    for i in range(picks):
        await router._pick(f"new-{i}")
    return (time.perf_counter() - started) / picks


def plan_seconds_per_step(episodes: int, scratch: Path) -> float:
    """Mean seconds for every episode of a step of `episodes` to look up its settings."""
    tasks_per_step = episodes // GROUP
    config = RunConfig(
        model="tiny",
        run_id="bench",
        run_dir=str(scratch),
        tasks_per_step=tasks_per_step,
        rollout=RolloutConfig(
            tasks="unused.jsonl",
            agent="unused.py:agent",
            samples_per_task=GROUP,
            output=str(scratch / "trajectories"),
        ),
    )
    runner = EpisodeRunner(
        config,
        tasks=[Task(id=f"task-{i}", prompt=f"task {i}") for i in range(tasks_per_step)],
        agent=None,  # type: ignore[arg-type]  # only the plan is used
        rewards=[],
        chat=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        sandboxes=None,  # type: ignore[arg-type]
        data=None,  # type: ignore[arg-type]
        store=None,
    )
    seconds = []
    for step in range(STEPS):
        started = time.perf_counter()
        for index in range(episodes):
            runner.plan(step)[index]
        seconds.append(time.perf_counter() - started)
    return statistics.mean(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--picks", type=int, default=2_000)
    parser.add_argument("--episodes", type=int, nargs="+", default=[32, 512])
    args = parser.parse_args()
    picks = {n: asyncio.run(pick_seconds(n, args.picks)) for n in args.sessions}
    with tempfile.TemporaryDirectory(prefix="omniloop-bench-") as scratch:
        plans = {n: plan_seconds_per_step(n, Path(scratch)) for n in args.episodes}
    print(
        json.dumps(
            {
                "bench": "rollout_bookkeeping",
                "pick_us": {str(n): round(s * 1e6, 2) for n, s in picks.items()},
                "plan_ms_per_step": {str(n): round(s * 1e3, 2) for n, s in plans.items()},
                "picks": args.picks,
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
