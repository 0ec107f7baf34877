"""Min/max decimation of a metric series for charts.

A chart a few hundred pixels wide cannot show 10,000 steps, and sending them costs the page its
first second. Each of `max_points // 2` buckets of consecutive points is reduced to its lowest
and highest point, in step order: the curve's envelope stays exact (a spike or a dip in one
step is never averaged away, which matters for error counts), unlike plain striding or means.
The newest point is always kept, so a live chart's last value is the true one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

P = TypeVar("P")


def decimate(points: Sequence[P], max_points: int, value: Callable[[P], float]) -> list[P]:
    """At most `max_points` (>= 3) of `points`, in their order; `points` itself if it fits.

    Per bucket the points with the lowest and highest finite `value` are kept (one point when
    they coincide); a bucket of only non-finite values keeps its first point.
    """
    if max_points < 3:
        raise ValueError(f"max_points must be at least 3, got {max_points}")
    if len(points) <= max_points:
        return list(points)
    # One slot is the newest point's; the others hold two points per bucket.
    buckets = (max_points - 1) // 2
    size = math.ceil((len(points) - 1) / buckets)
    kept: list[int] = []
    for start in range(0, len(points) - 1, size):
        indices = range(start, min(start + size, len(points) - 1))
        finite = [i for i in indices if math.isfinite(value(points[i]))]
        if not finite:
            kept.append(start)
            continue
        low = min(finite, key=lambda i: value(points[i]))
        high = max(finite, key=lambda i: value(points[i]))
        kept.extend(sorted({low, high}))
    kept.append(len(points) - 1)
    return [points[i] for i in kept]
