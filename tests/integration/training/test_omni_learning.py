"""The tiny omni model learns to tell a red picture from a blue one, by RL, end to end.

One real run of `examples/omni/learn.yaml` per staleness setting (on-policy, and rollouts up to
two steps ahead): the CPU engine serves the warm-started tiny Qwen2.5-Omni thinker over HTTP,
each prompt's picture goes to it as an image and sits in the trajectory as its placeholder
block, trajectories travel through TransferQueue, and the torch trainer computes logprobs with
the pictures' forward inputs (the vision tower in the graph) and takes one optimizer step per
rollout step. The warm start taught the answer format over eight colour words and, on pictures
of six other colours, reading a colour in general, never which word fits red or blue: the
warm-started model is right about one time in eight, and only RL can raise that. Both runs keep
the roles in this process (the omni run test covers them as services), and end once their mean
reward over three steps reaches 0.8 (`stop_when`), or after `STEPS`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from omniloop.config import load_config
from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.platform.control.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OMNI = Path(__file__).resolve().parents[3] / "examples" / "omni"
STEPS = 30
TARGET = 0.8


@pytest.fixture(scope="session")
def colour_model(tmp_path_factory: pytest.TempPathFactory, example_script: Any) -> Path:
    """`tiny-omni` warm-started by the example's script (seconds)."""
    module = example_script(OMNI, "warm_start")
    return Path(module.warm_start(tmp_path_factory.mktemp("omni-model") / "model"))


@dataclass
class ColourRun:
    max_staleness: int
    run_dir: Path
    metrics: list[dict[str, Any]]
    trained: list[dict[str, Any]]


@pytest.fixture(scope="module", params=[0, 2], ids=["staleness-0", "staleness-2"])
def colour_run(
    request: pytest.FixtureRequest, colour_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> ColourRun:
    bound = int(request.param)
    run_dir = tmp_path_factory.mktemp(f"omni-learn-s{bound}")
    overrides = [
        f"model={colour_model}",
        f"run_dir={run_dir}",
        f"database=sqlite:///{run_dir}/omniloop.db",
        "tensorboard=false",
        f"steps={STEPS}",
        f"checkpoint_every={STEPS}",
        f"max_staleness={bound}",
        "services.mode=in_process",
        f"stop_when.at_least={TARGET}",
    ]
    asyncio.run(run(load_config(RunConfig, OMNI / "learn.yaml", overrides)))
    return ColourRun(
        bound, run_dir, read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "trained.jsonl")
    )


def test_reward_rises_from_chance_to_above_0_8(colour_run: ColourRun) -> None:
    rewards = [m["reward/mean"] for m in colour_run.metrics]
    assert 3 <= len(rewards) <= STEPS
    # Chance is 1/8: the first two steps' 64 episodes stay under 0.3 unless the warm start
    # already told red from blue.
    assert sum(rewards[:2]) / 2 <= 0.3, rewards
    best = max(sum(rewards[k : k + 3]) / 3 for k in range(len(rewards) - 2))
    assert best >= TARGET, rewards


def test_every_episode_saw_its_picture_and_the_trainer_took_it(colour_run: ColourRun) -> None:
    for metrics in colour_run.metrics:
        assert metrics["episodes/errors"] == 0
        assert metrics["media/image"] == metrics["episodes/count"]
    for path in sorted((colour_run.run_dir / "trajectories").glob("step_*.jsonl")):
        for trajectory in read_jsonl(path):
            assert [e["kind"] for e in trajectory["multimodal"]] == ["image"]
            assert trajectory["multimodal"][0]["offset"] < trajectory["prompt_length"]


def test_no_trained_sample_is_older_than_max_staleness(colour_run: ColourRun) -> None:
    ages = [
        step["trainer_version"] - version
        for step in colour_run.trained
        for _, version in step["samples"]
    ]
    assert len(ages) == len(colour_run.metrics) * 32
    assert min(ages) >= 0
    assert max(ages) <= colour_run.max_staleness
    if colour_run.max_staleness:
        assert max(ages) >= 1  # rollouts did run ahead of training
