"""Min/max decimation keeps the envelope, the order and the newest point."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniloop.platform.api.downsample import decimate

values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5))


@given(st.lists(values, max_size=400), st.integers(3, 120))
def test_decimation_keeps_order_bounds_extremes_and_the_newest_point(
    series: list[float], max_points: int
) -> None:
    points = list(enumerate(float(v) for v in series))
    kept = decimate(points, max_points, lambda p: p[1])
    assert len(kept) <= max_points
    assert [p[0] for p in kept] == sorted({p[0] for p in kept})  # in order, no repeats
    assert set(kept) <= set(points)
    if points:
        assert kept[-1] == points[-1]
    finite = [v for _, v in points if math.isfinite(v)]
    kept_finite = [v for _, v in kept if math.isfinite(v)]
    if finite:
        assert min(kept_finite) == min(finite)
        assert max(kept_finite) == max(finite)


def test_a_spike_in_one_step_survives() -> None:
    points = [(step, 0.0) for step in range(10_000)]
    points[4321] = (4321, 7.0)
    kept = decimate(points, 200, lambda p: p[1])
    assert (4321, 7.0) in kept
    assert 100 <= len(kept) <= 200


def test_a_short_series_is_returned_as_it_is() -> None:
    points = [(0, 1.0), (1, 2.0)]
    assert decimate(points, 3, lambda p: p[1]) == points
    with pytest.raises(ValueError, match="max_points must be at least 3"):
        decimate(points, 2, lambda p: p[1])
