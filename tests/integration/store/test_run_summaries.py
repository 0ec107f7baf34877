"""Run summaries (the runs list at a glance): progress, latest reward and its trend, infra
errors; and that a page of summaries is index lookups only, whatever the runs' sizes."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, insert, text

from omniloop.platform.store import InvalidArgument, Store
from omniloop.platform.store.models import EpisodeRow, MetricRow, utcnow
from omniloop.platform.store.store import SUMMARY_METRIC, TREND_POINTS


def _episode(run_id: str, n: int, stop_reason: str | None) -> dict[str, Any]:
    now = utcnow()
    return {
        "id": f"{run_id}-{n:06d}",
        "run_id": run_id,
        "status": "completed" if stop_reason in (None, "stop", "length") else "failed",
        "task": {},
        "agent": "a",
        "sampling": {},
        "reward_info": {},
        "timings": {},
        "stop_reason": stop_reason,
        "created_at": now,
        "updated_at": now,
    }


def test_summary_of_a_run_with_steps_nan_and_errors(store: Store) -> None:
    store.create_run(run_id="r")
    store.create_run(run_id="other")
    for step in range(100):
        value = math.nan if step == 66 else step / 100
        store.record_metrics("r", step, {SUMMARY_METRIC: value, "reward/std": 9.0})
    store.record_metrics("other", 5, {SUMMARY_METRIC: -1.0})
    reasons = ["stop", "length", "sandbox_error", "reward_error", "engine_error", "cancelled"]
    rows = [_episode("r", n, reason) for n, reason in enumerate(reasons * 3)]
    rows += [_episode("r", 100, None), _episode("other", 0, "sandbox_error")]
    with store.engine.begin() as conn:
        conn.execute(insert(EpisodeRow), rows)

    summary = store.run_summaries(["r"])["r"]
    assert summary.steps_done == 100
    assert summary.latest_reward == 0.99
    assert summary.infra_errors == 12  # four infra stop reasons, three times each
    trend = summary.reward_trend
    steps = [p.step for p in trend]
    assert len(steps) == TREND_POINTS
    assert steps == sorted(set(steps))
    assert (steps[0], steps[-1]) == (0, 99)
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    assert gaps <= {3, 4}, gaps  # evenly spread: 99 steps over 31 gaps
    for point in trend:
        if point.step == 66:
            assert math.isnan(point.value)
        else:
            assert point.value == point.step / 100
    assert store.run_summaries(["other"])["other"].steps_done == 6


def test_short_runs_give_every_step_and_empty_runs_zeros(store: Store) -> None:
    store.create_run(run_id="short")
    store.create_run(run_id="empty")
    for step in (3, 4, 5, 7):  # resumed runs and sparse logging leave gaps
        store.record_metrics("short", step, {SUMMARY_METRIC: float(step)})
    store.record_metrics("empty", 0, {"loss": 1.0})  # not the summary metric
    summaries = store.run_summaries(["short", "empty", "missing", "short"])
    assert sorted(summaries) == ["empty", "short"]
    short = summaries["short"]
    assert (short.steps_done, short.latest_reward) == (8, 7.0)
    trend = [(p.step, p.value) for p in short.reward_trend]
    assert trend == [(3, 3.0), (4, 4.0), (5, 5.0), (7, 7.0)]
    empty = summaries["empty"]
    assert (empty.steps_done, empty.latest_reward, empty.reward_trend) == (0, None, [])
    assert empty.infra_errors == 0
    assert store.run_summaries([]) == {}


def test_a_re_logged_step_updates_the_latest_reward(store: Store) -> None:
    store.create_run(run_id="r")
    for step in range(5):
        store.record_metrics("r", step, {SUMMARY_METRIC: 0.1})
    store.record_metrics("r", 4, {SUMMARY_METRIC: 0.5})
    summary = store.run_summaries(["r"], trend_points=3)["r"]
    assert (summary.steps_done, summary.latest_reward) == (5, 0.5)
    assert [p.step for p in summary.reward_trend] == [0, 2, 4]


def test_run_summaries_refuses_bad_arguments(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="not one string"):
        store.run_summaries("r")
    with pytest.raises(InvalidArgument, match="trend_points must be 2 to"):
        store.run_summaries(["r"], trend_points=1)
    with pytest.raises(InvalidArgument, match="at most 1000 run ids"):
        store.run_summaries([f"r{i}" for i in range(1001)])


BIG_STEPS = 20_000
BIG_EPISODES = 20_000
RUNS = 50


@pytest.fixture(scope="module")
def many(module_db_url: str) -> Iterator[Store]:
    """50 runs: one with 20,000 steps of several metrics and 20,000 episodes (a few of them
    infra failures), the others small."""
    store = Store(module_db_url)
    store.migrate()
    now = utcnow()
    for i in range(RUNS):
        store.create_run(run_id=f"run{i}")
    metrics = [
        {"run_id": "run0", "name": name, "step": step, "value": 0.5, "recorded_at": now}
        for step in range(BIG_STEPS)
        for name in (SUMMARY_METRIC, "loss", "zzz")
    ]
    metrics += [
        {"run_id": f"run{i}", "name": SUMMARY_METRIC, "step": step, "value": 0.1}
        | {"recorded_at": now}
        for i in range(1, RUNS)
        for step in range(10)
    ]
    episodes = [
        _episode("run0", n, "sandbox_error" if n % 1000 == 0 else "stop")
        for n in range(BIG_EPISODES)
    ]
    with store.engine.begin() as conn:
        conn.execute(insert(MetricRow), metrics)
        conn.execute(insert(EpisodeRow), episodes)
    if store.dialect == "postgresql":
        with store.engine.begin() as conn:
            conn.execute(text("ANALYZE metrics"))
            conn.execute(text("ANALYZE episodes"))
            conn.execute(text("ANALYZE runs"))
    try:
        yield store
    finally:
        store.close()


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_a_page_of_summaries_reads_indexes_only(many: Store) -> None:
    """The big run's summary is right, and every statement is index searches: no scan of a
    run's metrics or episodes and no sort, so the cost does not grow with a run's length."""
    seen: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, params))

    event.listen(many.engine, "before_cursor_execute", capture)
    try:
        summaries = many.run_summaries([f"run{i}" for i in range(RUNS)])
    finally:
        event.remove(many.engine, "before_cursor_execute", capture)
    big = summaries["run0"]
    assert (big.steps_done, big.latest_reward, big.infra_errors) == (BIG_STEPS, 0.5, 20)
    assert len(big.reward_trend) == TREND_POINTS
    assert all(len(summaries[f"run{i}"].reward_trend) == 10 for i in range(1, RUNS))
    assert len(seen) == 2, [s for s, _ in seen]
    with many.engine.connect() as conn:
        for statement, params in seen:
            if many.dialect == "sqlite":
                plan = [
                    str(row[-1])
                    for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)
                ]
                reads = [line for line in plan if line.startswith(("SCAN", "SEARCH"))]
                assert reads, plan
                assert all(line.startswith("SEARCH") for line in reads), plan
                assert not any("TEMP B-TREE" in line for line in plan), plan
            else:
                raw = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", params).scalar()
                doc = raw if isinstance(raw, list) else json.loads(str(raw))
                nodes = list(_plan_nodes(doc[0]["Plan"]))
                scanned = [n.get("Relation Name") for n in nodes if n["Node Type"] == "Seq Scan"]
                # 50 runs is a small table: the planner may read it whole. Metrics and
                # episodes must be index reads.
                assert set(scanned) <= {"runs"}, nodes
                assert "Sort" not in [n["Node Type"] for n in nodes], nodes
