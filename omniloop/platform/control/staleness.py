"""The staleness knob (DESIGN.md §2): one integer between on-policy and fully asynchronous.

Staleness of a sample is `s = v_trainer - v_rollout`: how many optimizer steps the trainer has
taken since the weights that sampled it. `max_staleness` bounds it in two places:

- Producers throttle themselves. Rollout step `k` may start filling its partition only while
  `k - trainer_version <= max_staleness`; `StalenessGate.wait(k)` returns a future that resolves
  the moment `advance()` makes that true. No partition older than the bound keeps being filled.
- The trainer refuses samples past the bound anyway (`admit`), because a producer that skipped
  the gate, a retried write or a restored run must not slip stale data into an update. Every
  admitted sample lands in a histogram reported as `staleness/*` metrics.

`max_staleness=0` is on-policy, `k` is bounded off-policy, `"inf"` is fully asynchronous. All
three run the same code: the bound is a number compared with `<=`, and `inf` is just a bound that
is never reached.

The gate is pure asyncio logic for one event loop: call `wait`, `advance`, `rewind` and `close`
from the loop thread. It holds no data and talks to no service.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Annotated, Literal

from pydantic import Field

from omniloop.errors import OmniloopError

MaxStaleness = Annotated[int, Field(ge=0)] | Literal["inf"]
"""Config type of `max_staleness`: a non-negative integer or the string `"inf"`."""


class GateClosedError(OmniloopError):
    """The gate was closed while a producer was waiting on it (the run is shutting down)."""


def staleness_bound(max_staleness: int | float | str) -> float:
    """The bound as a number: `inf` for `"inf"`, the integer itself otherwise.

    Raises `ValueError` for negative values, non-integral numbers and any other string.
    """
    if isinstance(max_staleness, str):
        if max_staleness.strip().lower() != "inf":
            raise ValueError(
                f"max_staleness must be a non-negative integer or 'inf', got {max_staleness!r}"
            )
        return math.inf
    if isinstance(max_staleness, bool):
        raise ValueError(
            f"max_staleness must be a non-negative integer or 'inf', got {max_staleness!r}"
        )
    if isinstance(max_staleness, float) and math.isinf(max_staleness) and max_staleness > 0:
        return math.inf
    if isinstance(max_staleness, float) and not max_staleness.is_integer():
        raise ValueError(f"max_staleness must be an integer, got {max_staleness!r}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
    return float(max_staleness)


class StalenessGate:
    """Throttles producers to `max_staleness` steps ahead of the trainer and audits samples.

    `trainer_version` is the number of optimizer steps the trainer has completed (the DCS
    version of the weights it would publish next minus one, i.e. the version the rollout engines
    can have at most). It moves forward through `advance`, and back only through `rewind`, when
    the trainer was restored from a checkpoint.
    """

    def __init__(self, max_staleness: int | float | str, trainer_version: int = 0) -> None:
        self.bound = staleness_bound(max_staleness)
        """The bound as a number (`math.inf` for fully asynchronous)."""
        if trainer_version < 0:
            raise ValueError(f"trainer_version must be >= 0, got {trainer_version}")
        self._trainer_version = trainer_version
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._closed = False
        self._histogram: Counter[int] = Counter()
        self._refused = 0

    @property
    def trainer_version(self) -> int:
        """The trainer version the gate currently measures against."""
        return self._trainer_version

    @property
    def num_waiting(self) -> int:
        """How many producers are blocked in `wait` right now."""
        return sum(1 for _, fut in self._waiters if not fut.done())

    def allowed(self, step: int) -> bool:
        """Whether a producer may start filling the partition of rollout step `step` now."""
        return step - self._trainer_version <= self.bound

    def wait(self, step: int) -> asyncio.Future[None]:
        """A future that resolves as soon as `step` is allowed (at once if it already is).

        The waiter is registered when this is called, not when it is awaited, so a caller can
        check `done()` deterministically. Cancelling the future withdraws the waiter. After
        `close()` the future fails with `GateClosedError`.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self._closed:
            fut.set_exception(GateClosedError("the staleness gate is closed"))
        elif self.allowed(step):
            fut.set_result(None)
        else:
            self._waiters.append((step, fut))
        return fut

    def advance(self, trainer_version: int) -> None:
        """Record that the trainer reached `trainer_version` and release producers now allowed.

        Raises `ValueError` if the version would move backwards: weights never un-train, and a
        gate that went back could admit a producer twice for the same slot.
        """
        if trainer_version < self._trainer_version:
            raise ValueError(
                f"trainer version cannot go back from {self._trainer_version} to {trainer_version}"
            )
        self._trainer_version = trainer_version
        still_waiting: list[tuple[int, asyncio.Future[None]]] = []
        for step, fut in self._waiters:
            if fut.done():
                # Cancelled by its owner; nothing to release.
                continue
            if self.allowed(step):
                fut.set_result(None)
            else:
                still_waiting.append((step, fut))
        self._waiters = still_waiting

    def rewind(self, trainer_version: int) -> None:
        """Measure producers against `trainer_version` again, at or below the current one: the
        trainer was restored from a checkpoint of that version and trains the steps after it
        again. Each of those steps, produced again, then starts only once the restored trainer
        is within the bound of it, as the first time; a step started while the gate stood
        higher would sample the restored weights and reach the trainer past the bound.
        Producers released already are left to run (the trainer audits what they wrote)."""
        if not 0 <= trainer_version <= self._trainer_version:
            raise ValueError(
                f"rewind to trainer version {trainer_version}: it must be between 0 and the "
                f"current {self._trainer_version}"
            )
        self._trainer_version = trainer_version

    def close(self) -> None:
        """Fail every pending and future `wait` with `GateClosedError` (used at shutdown)."""
        self._closed = True
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(GateClosedError("the staleness gate was closed while waiting"))
        self._waiters = []

    def admit(self, sample_version: int, trainer_version: int | None = None) -> bool:
        """Trainer-side check of one sample; True if it may be trained on.

        `sample_version` is the oldest weight version that sampled any of its tokens;
        `trainer_version` defaults to the gate's. A sample past the bound is refused and counted
        (`staleness/refused`); an admitted one is added to the histogram. A sample newer than the
        trainer cannot exist and raises `ValueError`: it means versions are being mixed up.
        """
        version = self._trainer_version if trainer_version is None else trainer_version
        staleness = version - sample_version
        if staleness < 0:
            raise ValueError(
                f"sample weight version {sample_version} is newer than trainer version {version}"
            )
        if staleness > self.bound:
            self._refused += 1
            return False
        self._histogram[staleness] += 1
        return True

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """The staleness histogram as metrics.

        Keys: `staleness/max`, `staleness/mean` (over admitted samples; 0 when there are none),
        `staleness/admitted`, `staleness/refused` and `staleness/count/{s}` for each observed
        staleness `s`. With `reset=True` the counters start again from zero afterwards.
        """
        admitted = sum(self._histogram.values())
        total = sum(s * n for s, n in self._histogram.items())
        out: dict[str, float] = {
            "staleness/max": float(max(self._histogram, default=0)),
            "staleness/mean": total / admitted if admitted else 0.0,
            "staleness/admitted": float(admitted),
            "staleness/refused": float(self._refused),
        }
        for s in sorted(self._histogram):
            out[f"staleness/count/{s}"] = float(self._histogram[s])
        if reset:
            self._histogram.clear()
            self._refused = 0
        return out
