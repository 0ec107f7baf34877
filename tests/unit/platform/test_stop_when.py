"""`stop_when`: the target a run ends at, checked on the mean of a metric over the last steps,
and seeded from the metrics a resumed run logged before its checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.progress import Progress

from omniloop.config import load_config
from omniloop.errors import ConfigError
from omniloop.platform.control.metrics import MetricsSink
from omniloop.platform.control.record import RunRecord, recorded_run
from omniloop.platform.control.run_config import RunConfig, StopWhen
from omniloop.platform.store import AsyncStore

TOY = Path(__file__).parents[3] / "examples" / "toy_tool" / "train.yaml"


def test_the_mean_over_the_window_meets_the_target() -> None:
    when = StopWhen(at_least=0.8, over_steps=3)
    history = {0: 0.1, 1: 0.9, 2: 0.8, 3: 0.7, 4: 0.95}
    assert when.reached(history, 1) is None  # fewer than three steps
    assert when.reached(history, 2) is None  # 0.6
    assert when.reached(history, 3) == pytest.approx(0.8)
    assert when.reached(history, 4) == pytest.approx(0.8167, abs=1e-4)


def test_a_missing_or_nan_step_in_the_window_never_stops() -> None:
    when = StopWhen(at_least=0.5, over_steps=2)
    assert when.reached({0: 1.0, 2: 1.0}, 2) is None
    assert when.reached({0: 1.0, 1: math.nan, 2: 1.0}, 2) is None
    assert when.reached({0: 1.0, 1: math.nan, 2: 1.0, 3: 1.0}, 3) == 1.0


def test_at_most_watches_a_falling_metric() -> None:
    when = StopWhen(metric="kl", at_most=0.01, over_steps=1)
    assert when.reached({0: 0.02}, 0) is None
    assert when.reached({0: 0.02, 1: 0.01}, 1) == 0.01


@pytest.mark.parametrize("bounds", [{}, {"at_least": 0.8, "at_most": 0.1}])
def test_exactly_one_bound_is_required(bounds: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="exactly one of at_least and at_most"):
        load_config(RunConfig, TOY, [f"stop_when.{k}={v}" for k, v in bounds.items()] or
                    ["stop_when.metric=kl"])  # fmt: skip


def test_an_unknown_metric_is_named_with_the_step_s_metrics() -> None:
    when = StopWhen(metric="reward/mena", at_least=0.8)
    with pytest.raises(ConfigError, match=r"'reward/mena' is not a metric of step 4.*reward/mean"):
        when.value(4, {"reward/mean": 0.5, "kl": 0.0})


def test_a_resumed_run_sees_the_values_logged_before_its_checkpoint(tmp_path: Path) -> None:
    config = load_config(
        RunConfig, TOY, [f"run_dir={tmp_path}", "stop_when.at_least=0.8", "stop_when.over_steps=2"]
    )
    rewards: list[Any] = [0.1, 0.85, None, 0.9, 0.9, 0.95]  # None: a NaN step, logged as null
    lines = [json.dumps({"step": k, "reward/mean": r}) for k, r in enumerate(rewards)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with MetricsSink(tmp_path, Console(quiet=True), tensorboard=False) as sink:
        record = RunRecord(config.model_copy(update={"run_id": "r"}), sink, Progress(), None)  # type: ignore[arg-type]
        record.rewind(5)  # resumed from the checkpoint after step 4: steps 5.. are redone
        assert not record.target_reached(1)  # 0.1, 0.85
        assert not record.target_reached(2)  # 0.85, NaN
        assert record.ended_early is None
        assert record.target_reached(4)  # 0.9, 0.9
        assert record.ended_early == (
            "stop_when: reward/mean averaged 0.900 over steps 4-5 (at least 0.8); the run ended "
            f"after step 5 of {config.steps}"
        )
        assert not record.target_reached(5)  # step 5 is not logged any more
        record.rewind(4)  # an actor restored from the checkpoint after step 3
        assert not record.target_reached(4)


def test_a_run_that_meets_its_target_at_its_last_step_simply_ends(tmp_path: Path) -> None:
    config = load_config(
        RunConfig, TOY, [f"run_dir={tmp_path}", "steps=3", "stop_when.at_least=0.8"]
    )
    lines = [json.dumps({"step": k, "reward/mean": 0.9}) for k in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with MetricsSink(tmp_path, Console(quiet=True), tensorboard=False) as sink:
        record = RunRecord(config.model_copy(update={"run_id": "r"}), sink, Progress(), None)  # type: ignore[arg-type]
        record.rewind(3)
        assert not record.target_reached(2)
        assert record.ended_early is None


async def test_the_run_s_record_says_why_it_ended(tmp_path: Path) -> None:
    """`recorded_run` (real SQLite): an early end's reason on `completed`, the error on
    `failed`, nothing on a run that ran its steps."""
    store = AsyncStore.open(f"sqlite:///{tmp_path}/runs.db")
    await store.migrate()
    try:
        for run_id, reason in [("early", "stop_when: ...; the run ended after step 5 of 9"),
                               ("whole", None)]:  # fmt: skip
            config = load_config(RunConfig, TOY, [f"run_dir={tmp_path}", f"run_id={run_id}"])
            async with recorded_run(store, config, resume=False) as ending:
                assert (await store.get_run(run_id)).status == "running"
                ending.reason = reason
            record = await store.get_run(run_id)
            assert (record.status, record.status_reason) == ("completed", reason)
        config = load_config(RunConfig, TOY, [f"run_dir={tmp_path}", "run_id=broken"])
        with pytest.raises(ValueError, match="a bad step"):
            async with recorded_run(store, config, resume=False):
                raise ValueError("a bad step")
        record = await store.get_run("broken")
        assert (record.status, record.status_reason) == ("failed", "ValueError: a bad step")
    finally:
        await store.close()
