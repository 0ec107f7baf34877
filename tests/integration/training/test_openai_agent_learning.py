"""An agent written with the official `openai` package learns, unchanged, by RL through the
gateway: `examples/openai_agent` end to end.

One real run: the CPU engine serves the warm-started tiny model over HTTP, each episode's agent
(`examples/openai_agent/agent.py: solve`, plain `AsyncOpenAI` calls) talks to its episode's
gateway, which records the replies token-exactly; trajectories travel through TransferQueue and
the torch trainer takes one optimizer step per rollout step, one step ahead of the rollouts.
The warm start taught the tool-call format with every direction equally often: the agent finds
the treasure about one time in eight, and only RL can raise that. The run ends once its mean
reward over three steps reaches 0.7 (`stop_when`), or after `STEPS`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.config import load_config
from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.platform.control.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "openai_agent"
STEPS = 25
TARGET = 0.7


@pytest.fixture(scope="module")
def hunt_run(tmp_path_factory: pytest.TempPathFactory, example_script: Any) -> Path:
    model = example_script(EXAMPLE, "warm_start").warm_start(
        tmp_path_factory.mktemp("openai-agent") / "model"
    )
    run_dir = tmp_path_factory.mktemp("openai-agent-run")
    overrides = [
        f"model={model}",
        f"run_dir={run_dir}",
        f"database=sqlite:///{run_dir}/omniloop.db",
        "tensorboard=false",
        f"steps={STEPS}",
        f"checkpoint_every={STEPS}",
        "services.mode=in_process",
        f"stop_when.at_least={TARGET}",
    ]
    asyncio.run(run(load_config(RunConfig, EXAMPLE / "train.yaml", overrides)))
    return run_dir


def test_the_openai_sdk_agent_s_reward_rises(hunt_run: Path) -> None:
    metrics = read_jsonl(hunt_run / "metrics.jsonl")
    rewards = [m["reward/mean"] for m in metrics]
    assert 3 <= len(rewards) <= STEPS
    # Chance is 1/8: the first two steps' 64 episodes stay under 0.3 unless the warm start
    # already knew the way.
    assert sum(rewards[:2]) / 2 <= 0.3, rewards
    best = max(sum(rewards[k : k + 3]) / 3 for k in range(len(rewards) - 2))
    assert best >= TARGET, rewards
    for step in metrics:
        assert step["episodes/errors"] == 0
        assert step.get("gateway/agent_errors", 0) == 0


def test_every_trajectory_is_the_agent_s_one_call(hunt_run: Path) -> None:
    for path in sorted((hunt_run / "trajectories").glob("step_*.jsonl")):
        for trajectory in read_jsonl(path):
            assert len(trajectory["meta"]["turns"]) == 1
            assert trajectory["meta"]["metrics"]["gateway/calls"] == 1
            assert trajectory["meta"]["metrics"]["gateway/resent_calls"] == 0
            turn = trajectory["meta"]["turns"][0]
            assert sum(trajectory["loss_mask"]) == turn["num_sampled"]
