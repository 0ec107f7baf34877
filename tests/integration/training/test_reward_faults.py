"""A reward that crashes its process, hangs, or allocates without bound costs only its replica.

One real run of the toy task with the roles as Ray Serve deployments and a second reward,
`misbehaving_rewards.misbehave`, that crashes its process on one episode of step 0, hangs on
one of step 2 and allocates memory without bound on one of step 4. Each of those episodes ends
`reward_error` (an infrastructure failure: recorded, counted, never trained); the run goes on
and completes; the reward role's failures are on the fault timeline.

The same run floods the rollout role: its one replica takes one group of 4 episodes at once
(`services.rollout_groups_per_replica`) and queues 2 more (`services.max_queued_requests`),
while the controller sends a step's 4 groups at once. The calls past that are refused
(back-pressure) and retried; none is lost, and none counts as a fault.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.config import import_object
from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.platform.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 6
REWARDS = Path(__file__).with_name("misbehaving_rewards.py")
BAD: dict[str, str] = import_object(f"{REWARDS}:BAD")


@pytest.fixture(scope="module")
def reward_run(toy_config: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reward-faults")
    config = toy_config(
        run_dir,
        {
            "steps": STEPS,
            "tasks_per_step": 4,
            "rollout.samples_per_task": 4,
            "checkpoint_every": STEPS,
            "services.mode": "services",
            "services.api": False,  # the test asks nothing of it; no proxy port to bind
            "services.reward_memory_mb": 768,
            "services.rollout_replicas": 1,
            "services.rollout_groups_per_replica": 1,
            "services.reward_replicas": 2,
            "services.max_queued_requests": 2,
            "rollout.concurrency": 16,
            "rollout.reward_timeout": 3.0,
            "rollout.rewards": [
                str(Path(__file__).parents[3] / "examples/toy_tool/agent.py:found_the_treasure"),
                f"{REWARDS}:misbehave",
            ],
        },
    )
    asyncio.run(run(config))
    return run_dir


def _trajectories(run_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        for trajectory in read_jsonl(path):
            out[trajectory["meta"]["episode_id"]] = trajectory
    return out


@pytest.mark.parametrize("episode", sorted(BAD), ids=[BAD[k] for k in sorted(BAD)])
def test_the_misbehaving_episode_is_a_reward_error(reward_run: Path, episode: str) -> None:
    trajectory = _trajectories(reward_run)[episode]
    assert trajectory["meta"]["stop_reason"] == "reward_error"
    message = trajectory["meta"]["error"]["message"]
    # The replica hung or died under every reward it was evaluating: the episode's error is
    # the first of them to fail, `misbehave` or the other one.
    assert "misbehave" in message or "found_the_treasure" in message, message
    if BAD[episode] == "hang":
        assert "did not finish" in message, message
    else:
        assert "ActorDiedError" in message or "died" in message, message


def test_the_run_goes_on_and_most_episodes_are_scored(reward_run: Path) -> None:
    trajectories = _trajectories(reward_run)
    assert len(trajectories) == STEPS * 16
    scored = [t for t in trajectories.values() if t["meta"]["stop_reason"] != "reward_error"]
    # Besides the three, only what the dying replicas were scoring at that moment may fail.
    assert len(scored) >= len(trajectories) - 3 - 12
    trained = read_jsonl(reward_run / "trained.jsonl")
    assert [s["step"] for s in trained] == list(range(STEPS))
    with Store(f"sqlite:///{reward_run}/omniloop.db") as store:
        run_id = (reward_run / "run_id").read_text().strip()
        assert store.get_run(run_id).status == "completed"


def test_a_flooded_role_refuses_calls_which_are_retried_not_lost(reward_run: Path) -> None:
    metrics = read_jsonl(reward_run / "metrics.jsonl")
    assert sum(m["faults/refused_calls"] for m in metrics) > 0, "the rollout was never flooded"
    faults = read_jsonl(reward_run / "faults.jsonl")
    assert not [f for f in faults if f["role"] == "rollout"], "a refusal counted as a fault"
    trained = read_jsonl(reward_run / "trained.jsonl")
    # Every episode was run and written once: refused calls were neither dropped nor doubled.
    ids = [traj_id for step in trained for traj_id, _ in step["samples"]]
    assert len(ids) == len(set(ids))
    assert len(_trajectories(reward_run)) == STEPS * 16


def test_the_reward_role_failures_are_on_the_fault_timeline(reward_run: Path) -> None:
    faults = read_jsonl(reward_run / "faults.jsonl")
    reward_faults = [f for f in faults if f["role"] == "reward"]
    assert reward_faults, faults
    # The last one may still be open when the run ends (a hung replica is replaced only once
    # its health check notices); it is recorded all the same, without a recovery time.
    assert reward_faults[0]["recovery_seconds"] is not None, reward_faults
