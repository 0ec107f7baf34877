"""A reward that holds episodes at the test's gate, so a run cannot outpace what a test does.

The test copies this module into its run folder; `GATE` is the file `gate` beside the copy,
which the test writes whole (renamed into place). While the gate holds a step number, `hold`
keeps each episode of that step or a later one waiting (rollouts, and so the run, go no further
than the step before); with no gate, every episode passes. It always scores 0.0, so the run's
own rewards are unchanged.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from omniloop import reward
from omniloop.trajectory import Trajectory

GATE = Path(__file__).with_name("gate")
LONGEST_HOLD_S = 480.0
"""A broken test cannot hold a run longer than this."""


def held_from() -> int | None:
    """The first step the gate holds; None when there is no gate."""
    try:
        return int(GATE.read_text())
    except (FileNotFoundError, ValueError):
        return None


@reward(timeout=LONGEST_HOLD_S + 60)
async def hold(trajectory: Trajectory | None) -> float:
    """0.0, once the gate lets this episode's step through."""
    episode = trajectory.meta.episode_id if trajectory else ""
    step = int(episode.split("/")[0].removeprefix("step") or 0)
    deadline = time.monotonic() + LONGEST_HOLD_S
    while time.monotonic() < deadline:
        gate = held_from()
        if gate is None or step < gate:
            break
        await asyncio.sleep(0.2)
    return 0.0
