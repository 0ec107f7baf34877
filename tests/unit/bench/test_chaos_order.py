"""bench/chaos.py kills every role once before any role twice."""

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
