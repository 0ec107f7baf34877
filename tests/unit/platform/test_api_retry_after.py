"""`estimate_retry_after`: the `Retry-After` of a full queue, from recent episode durations
and the worker's concurrency."""

from __future__ import annotations

import math

from omniloop.platform.api.worker import (
    RETRY_AFTER_IDLE,
    RETRY_AFTER_MAX,
    RETRY_AFTER_UNKNOWN,
    estimate_retry_after,
)


def test_one_slot_frees_every_median_duration_over_the_concurrency():
    assert estimate_retry_after([10.0, 12.0, 14.0], 1) == 12
    assert estimate_retry_after([10.0, 12.0, 14.0], 4) == 3  # 12 / 4
    assert estimate_retry_after([10.0, 12.0, 14.0], 5) == 3  # 2.4, rounded up
    assert estimate_retry_after([0.01, 0.02], 2) == 1  # never below one second


def test_one_stuck_or_instant_episode_does_not_swing_it():
    assert estimate_retry_after([8.0, 8.0, 9.0, 3600.0], 1) == 9  # median of four: 8.5
    assert estimate_retry_after([8.0, 8.0, 8.0, 0.0], 1) == 8


def test_bounds_and_the_cases_without_an_estimate():
    assert estimate_retry_after([10_000.0], 1) == RETRY_AFTER_MAX
    assert estimate_retry_after([], 4) == RETRY_AFTER_UNKNOWN
    assert estimate_retry_after([math.nan, -1.0, math.inf], 4) == RETRY_AFTER_UNKNOWN
    assert estimate_retry_after([5.0], 0) == RETRY_AFTER_IDLE
