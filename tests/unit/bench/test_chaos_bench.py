"""bench/chaos.py: the order of its kills, and what each kill cost."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import chaos  # noqa: E402


def test_every_role_is_killed_once_before_any_twice() -> None:
    drawn = list(itertools.islice(chaos.kill_order(random.Random(3)), 3 * len(chaos.ROLES)))
    rounds = [drawn[i : i + len(chaos.ROLES)] for i in range(0, len(drawn), len(chaos.ROLES))]
    for round_ in rounds:
        assert sorted(round_) == sorted(chaos.ROLES)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes from one round to the next


def test_a_kill_costs_what_its_window_took_beyond_the_undisturbed_mean() -> None:
    steps = [1.0, 1.0, 3.0, 2.0, 1.0, 1.0, 5.0, 1.0]
    metrics = [{"time": 10.0 * i, "perf/step_seconds": s} for i, s in enumerate(steps)]
    kills = [{"t": 15.0, "role": "engine"}, {"t": 55.0, "role": "api"}, {"t": 78.0, "role": "x"}]
    # windows of 20 s: the engine's holds steps at 20 and 30, the api's 60 and 70; clean: 0,
    # 10, 40, 50 (mean 1.0); the last kill's window holds no step.
    assert chaos.kill_costs(metrics, kills, window=20.0) == [3.0, 4.0, 0.0]
