"""Rewards that misbehave on chosen episodes, for the reward-role fault tests.

`misbehave` scores 0.0, except on the episodes `BAD` names: there it crashes its process,
hangs (bounded, so a broken test cannot hang forever), or allocates memory without bound.
"""

from __future__ import annotations

import os
import time
from typing import Any

from omniloop import reward
from omniloop.trajectory import Trajectory

BAD = {
    "step0/treasure-1/0": "crash",
    "step2/treasure-2/0": "hang",
    "step4/treasure-3/0": "allocate",
}


@reward
def misbehave(task: dict[str, Any], trajectory: Trajectory | None) -> float:
    """0.0, or the misbehaviour `BAD` names for this episode."""
    what = BAD.get(trajectory.meta.episode_id if trajectory else "")
    if what == "crash":
        os._exit(3)
    if what == "hang":
        time.sleep(120)
    if what == "allocate":
        blocks = []
        for _ in range(10_000):  # ~640 GB if nothing stopped it
            blocks.append(bytearray(64 * 1024 * 1024))
    return 0.0
