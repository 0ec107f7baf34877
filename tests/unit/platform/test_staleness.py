"""StalenessGate: producers block exactly at the bound, the trainer refuses past it.

Synchronisation in these tests is by futures and queues only: `gate.wait()` registers its
waiter when called, so whether a producer is blocked is checked with `done()`, never by sleeping.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from pydantic import BaseModel

from omniloop.platform.control.staleness import (
    GateClosedError,
    MaxStaleness,
    StalenessGate,
    staleness_bound,
)

BOUNDS: list[int | str] = [0, 1, 3, "inf"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0.0), (2, 2.0), ("inf", math.inf), ("INF", math.inf), (math.inf, math.inf), (4.0, 4.0)],
)
def test_bound_parses_integers_and_inf(value: int | float | str, expected: float) -> None:
    assert staleness_bound(value) == expected


@pytest.mark.parametrize("value", [-1, "infinity", "2", 1.5, True, -math.inf])
def test_bound_rejects_anything_else(value: object) -> None:
    with pytest.raises(ValueError):
        staleness_bound(value)  # type: ignore[arg-type]


def test_config_type_accepts_integers_and_inf_only() -> None:
    class Cfg(BaseModel):
        max_staleness: MaxStaleness = 0

    assert Cfg(max_staleness=2).max_staleness == 2
    assert Cfg(max_staleness="inf").max_staleness == "inf"
    for bad in (-1, "infinite"):
        with pytest.raises(ValueError):
            Cfg(max_staleness=bad)


async def test_a_rewound_gate_releases_the_steps_trained_again_as_the_first_time() -> None:
    # The trainer had done 9 steps when it was lost, and is restored from its checkpoint of 6:
    # step 8, produced again, must wait for the restored trainer's step 7 (with bound 1), or its
    # samples of version 6 would reach a trainer at version 8.
    gate = StalenessGate(1, trainer_version=9)
    released = gate.wait(10)
    gate.rewind(6)
    assert released.done()  # already under way: left to run
    again = {s: gate.wait(s) for s in (6, 7, 8)}
    assert [s for s, f in again.items() if f.done()] == [6, 7]
    gate.advance(7)
    assert again[8].done()
    gate.rewind(7)  # the same version again changes nothing
    with pytest.raises(ValueError, match="rewind to trainer version 8"):
        gate.rewind(8)


@pytest.mark.parametrize("k", BOUNDS)
def test_allowed_is_step_minus_version_within_bound(k: int | str) -> None:
    gate = StalenessGate(k, trainer_version=5)
    bound = staleness_bound(k)
    for step in range(0, 30):
        assert gate.allowed(step) == (step - 5 <= bound), step


@pytest.mark.parametrize("k", [0, 1, 3])
async def test_waiter_resolves_exactly_when_the_trainer_catches_up(k: int) -> None:
    gate = StalenessGate(k)
    step = 7
    fut = gate.wait(step)
    # The step opens at trainer version step - k, not one version earlier.
    for version in range(1, step - k):
        gate.advance(version)
        assert not fut.done(), f"step {step} released at version {version} with k={k}"
        assert gate.num_waiting == 1
    gate.advance(step - k)
    assert fut.done()
    assert gate.num_waiting == 0
    await fut


async def test_inf_never_blocks() -> None:
    gate = StalenessGate("inf")
    for step in (0, 1, 10, 10_000):
        assert gate.wait(step).done()
    assert gate.num_waiting == 0


async def test_on_policy_releases_one_step_per_trainer_step() -> None:
    gate = StalenessGate(0)
    futures = {s: gate.wait(s) for s in range(4)}
    assert [s for s, f in futures.items() if f.done()] == [0]
    gate.advance(2)
    assert [s for s, f in futures.items() if f.done()] == [0, 1, 2]
    gate.advance(2)  # the same version again changes nothing
    assert not futures[3].done()


async def test_advance_skips_cancelled_waiters() -> None:
    gate = StalenessGate(0)
    cancelled = gate.wait(2)
    kept = gate.wait(2)
    cancelled.cancel()
    gate.advance(2)
    assert kept.done()
    assert kept.exception() is None
    assert cancelled.cancelled()


async def test_close_fails_pending_and_later_waiters() -> None:
    gate = StalenessGate(1)
    pending = gate.wait(5)
    gate.close()
    with pytest.raises(GateClosedError):
        await pending
    with pytest.raises(GateClosedError):
        await gate.wait(0)


def test_trainer_version_never_goes_back() -> None:
    gate = StalenessGate(1, trainer_version=3)
    with pytest.raises(ValueError, match="cannot go back"):
        gate.advance(2)
    with pytest.raises(ValueError):
        StalenessGate(1, trainer_version=-1)


@pytest.mark.parametrize("k", BOUNDS)
async def test_producer_runs_ahead_by_exactly_the_bound(k: int | str) -> None:
    """One producer/trainer pair, the same code for every k: the producer's lead over the
    trainer never exceeds k and reaches it (or the end of the run)."""
    steps = 8
    gate = StalenessGate(k)
    produced: asyncio.Queue[int] = asyncio.Queue()
    leads: list[int] = []

    async def producer() -> None:
        for step in range(steps):
            await gate.wait(step)
            leads.append(step - gate.trainer_version)
            produced.put_nowait(step)

    async def trainer() -> None:
        for expected in range(steps):
            step = await produced.get()
            assert step == expected
            gate.advance(step + 1)

    await asyncio.gather(producer(), trainer())
    bound = staleness_bound(k)
    assert max(leads) <= bound
    assert max(leads) == min(bound, steps - 1)


@pytest.mark.parametrize("k", BOUNDS)
def test_admit_refuses_beyond_the_bound(k: int | str) -> None:
    gate = StalenessGate(k)
    bound = staleness_bound(k)
    for staleness in range(0, 6):
        assert gate.admit(sample_version=10 - staleness, trainer_version=10) == (staleness <= bound)


def test_admit_uses_the_gate_version_by_default() -> None:
    gate = StalenessGate(1)
    gate.advance(4)
    assert gate.admit(3)
    assert not gate.admit(2)


def test_sample_newer_than_trainer_is_an_error() -> None:
    gate = StalenessGate("inf")
    with pytest.raises(ValueError, match="newer"):
        gate.admit(sample_version=3, trainer_version=2)


def test_histogram_counts_admitted_and_refused() -> None:
    gate = StalenessGate(2)
    for sample_version in (10, 10, 9, 8, 7, 5):
        gate.admit(sample_version, trainer_version=10)
    metrics = gate.metrics()
    assert metrics == {
        "staleness/max": 2.0,
        "staleness/mean": (0 + 0 + 1 + 2) / 4,
        "staleness/admitted": 4.0,
        "staleness/refused": 2.0,
        "staleness/count/0": 2.0,
        "staleness/count/1": 1.0,
        "staleness/count/2": 1.0,
    }


def test_metrics_reset_starts_a_new_window() -> None:
    gate = StalenessGate(0)
    gate.admit(1, trainer_version=1)
    gate.admit(1, trainer_version=2)
    assert gate.metrics(reset=True)["staleness/refused"] == 1.0
    assert gate.metrics() == {
        "staleness/max": 0.0,
        "staleness/mean": 0.0,
        "staleness/admitted": 0.0,
        "staleness/refused": 0.0,
    }
