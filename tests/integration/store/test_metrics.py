"""Metrics: record per step, read by name and since a step, overwrite on re-record."""

from __future__ import annotations

import math

import pytest

from omniloop.platform.store import InvalidArgument, NotFound, Store


@pytest.fixture
def run_id(store: Store) -> str:
    return store.create_run(run_id="r").id


def test_metrics_round_trip_in_step_order(store: Store, run_id: str) -> None:
    for step in (2, 0, 1):
        store.record_metrics(run_id, step, {"reward/mean": step / 10, "perf/tok_s": 100.0 + step})
    metrics = store.get_metrics(run_id)
    assert sorted(metrics) == ["perf/tok_s", "reward/mean"]
    assert [(p.step, p.value) for p in metrics["reward/mean"]] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [p.value for p in metrics["perf/tok_s"]] == [100.0, 101.0, 102.0]


def test_since_step_returns_only_later_steps(store: Store, run_id: str) -> None:
    for step in range(10):
        store.record_metrics(run_id, step, {"loss": float(step)})
    assert [p.step for p in store.get_metrics(run_id, since_step=6)["loss"]] == [7, 8, 9]
    assert store.get_metrics(run_id, since_step=9) == {}
    assert len(store.get_metrics(run_id, since_step=-1)["loss"]) == 10


def test_names_select_metrics(store: Store, run_id: str) -> None:
    store.record_metrics(run_id, 0, {"a": 1.0, "b": 2.0, "c": 3.0})
    assert sorted(store.get_metrics(run_id, ["a", "c", "never"])) == ["a", "c"]
    assert store.get_metrics(run_id, []) == {}
    with pytest.raises(InvalidArgument, match="not one string"):
        store.get_metrics(run_id, "a")


def test_recording_a_step_again_overwrites_it(store: Store, run_id: str) -> None:
    """A run resumed from a checkpoint logs its last steps again: last write wins."""
    store.record_metrics(run_id, 5, {"loss": 1.0, "kl": 0.1})
    store.record_metrics(run_id, 5, {"loss": 0.5})
    metrics = store.get_metrics(run_id)
    assert [(p.step, p.value) for p in metrics["loss"]] == [(5, 0.5)]
    assert [(p.step, p.value) for p in metrics["kl"]] == [(5, 0.1)]


def test_non_finite_values_round_trip(store: Store, run_id: str) -> None:
    store.record_metrics(run_id, 0, {"nan": math.nan, "inf": math.inf, "ninf": -math.inf})
    metrics = store.get_metrics(run_id)
    assert math.isnan(metrics["nan"][0].value)
    assert metrics["inf"][0].value == math.inf
    assert metrics["ninf"][0].value == -math.inf


def test_metrics_of_unknown_run_raise_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.record_metrics("nope", 0, {"a": 1.0})
    with pytest.raises(NotFound):
        store.get_metrics("nope")


def test_metrics_refuse_bad_step_names_and_values(store: Store, run_id: str) -> None:
    with pytest.raises(InvalidArgument, match="step"):
        store.record_metrics(run_id, 1.5, {"a": 1.0})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="metric name"):
        store.record_metrics(run_id, 0, {"": 1.0})
    with pytest.raises(InvalidArgument, match="not a number"):
        store.record_metrics(run_id, 0, {"a": "high"})  # type: ignore[dict-item]
    store.record_metrics(run_id, 0, {})  # nothing to record is fine
    assert store.get_metrics(run_id) == {}
