"""DAPO's dynamic sampling in a real run: groups whose rewards are all equal are not trained
and are replaced by extra groups, so that every step trains `tasks_per_step` groups.

The toy task's warm-started model finds the treasure about 1 time in 8, so at 4 samples per
task more than half of the groups fail entirely at first (P = (7/8)^4 = 0.59): every early step
drops groups and runs extra ones.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3
TASKS_PER_STEP = 8
SAMPLES = 4


@pytest.fixture(scope="module")
def run_dir(toy_config: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("dynamic")
    config = toy_config(
        run_dir,
        {
            "steps": STEPS,
            "tasks_per_step": TASKS_PER_STEP,
            "rollout.samples_per_task": SAMPLES,
            "dynamic_sampling": 64,
            "max_staleness": 0,
            "checkpoint_every": STEPS,
            "services.mode": "in_process",
        },
    )
    asyncio.run(run(config))
    return run_dir


def test_every_step_trains_its_groups_and_only_groups_with_something_to_learn(
    run_dir: Path,
) -> None:
    steps = read_jsonl(run_dir / "trained.jsonl")
    trained = {s["step"]: {i for i, _ in s["samples"]} for s in steps}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted(trained) == list(range(STEPS))
    extra_trained = 0
    for step in range(STEPS):
        groups: dict[str, dict[str, float]] = defaultdict(dict)
        for trajectory in read_jsonl(run_dir / "trajectories" / f"step_{step}.jsonl"):
            groups[trajectory["meta"]["group_id"]][trajectory["id"]] = trajectory["reward"]
        mixed = {name for name, rewards in groups.items() if len(set(rewards.values())) > 1}
        assert trained[step] == {i for name in mixed for i in groups[name]}, (
            f"step {step} trained a uniform group or left out a mixed one"
        )
        assert len(mixed) == TASKS_PER_STEP, f"step {step} is not full"
        dropped = len(groups) - len(mixed)
        assert metrics[step]["rollout/dropped_groups"] == dropped
        assert metrics[step]["rollout/extra_groups"] == len(groups) - TASKS_PER_STEP
        assert metrics[step]["actor/dropped_uniform_samples"] == dropped * SAMPLES
        extra_trained += sum(name.startswith("extra") for name in mixed)
    assert metrics[0]["rollout/dropped_groups"] > 0
    assert extra_trained > 0, "no extra group was trained"
