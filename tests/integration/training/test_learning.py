"""Learning and staleness on the toy tool task, end to end.

One real run per staleness setting (on-policy, and rollouts up to two steps ahead), the first
with the roles in this process, the second through the role services (the trainer's learning is
the same code either way; each mode is seen learning once), and a third with megatron-core's
`GPTModel` as the policy (`trainer.backend=megatron`, one step ahead, services) trained by two
data-parallel rank processes under the actor (`trainer.data_parallel=2`): the CPU engine serves
the warm-started tiny model over HTTP, every tool call runs in a bwrap sandbox,
trajectories travel through TransferQueue, the torch trainer takes one optimizer step per
rollout step and the engine loads its weights after each. The warm-started policy picks the
treasure's direction 1 time in 8; only RL can raise that. The staleness properties are read
from the same runs' `trained.jsonl` (each trained id with the weight version that sampled it).
Each run ends once its mean reward over three steps reaches 0.8 (`stop_when`), or after
`STEPS`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.platform.store import Store
from omniloop.trajectory import Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 30
TARGET = 0.8


@dataclass
class ToyRun:
    max_staleness: int
    backend: str
    run_dir: Path
    metrics: list[dict[str, Any]]
    trained: list[dict[str, Any]]


@pytest.fixture(
    scope="module",
    params=[(0, "torch"), (2, "torch"), (1, "megatron")],
    ids=["staleness-0", "staleness-2", "megatron-staleness-1"],
)
def toy_run(
    request: pytest.FixtureRequest, toy_config: Any, tmp_path_factory: pytest.TempPathFactory
) -> ToyRun:
    bound, backend = request.param
    run_dir = tmp_path_factory.mktemp(f"learn-{backend}-s{bound}")
    mode = "in_process" if bound == 0 else "services"
    config = toy_config(
        run_dir,
        {
            "max_staleness": bound,
            "steps": STEPS,
            "checkpoint_every": STEPS,
            "stop_when.at_least": TARGET,
            "services.mode": mode,
            "services.api": False,  # the tests ask nothing of it (chaos and others do)
            "trainer.backend": backend,
            "trainer.data_parallel": 2 if backend == "megatron" else 1,
        },
    )
    asyncio.run(run(config))
    metrics, trained = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "trained.jsonl")
    return ToyRun(bound, backend, run_dir, metrics, trained)


def test_reward_rises_from_chance_to_above_0_8(toy_run: ToyRun) -> None:
    # The best three consecutive steps, not the last three: at the example's learning rate
    # the tiny model can fall out of the call format again after learning it (seen once on a
    # loaded machine, a few steps before the end: the closing `>` displaced), which says
    # nothing about whether the loop learns.
    rewards = [m["reward/mean"] for m in toy_run.metrics]
    assert 3 <= len(rewards) <= STEPS
    assert rewards[0] <= 0.3, rewards
    best = max(sum(rewards[k : k + 3]) / 3 for k in range(len(rewards) - 2))
    assert best >= TARGET, rewards


def test_the_run_ends_once_its_target_is_met_with_a_checkpoint_of_the_last_step(
    toy_run: ToyRun,
) -> None:
    rewards = [m["reward/mean"] for m in toy_run.metrics]
    means = [sum(rewards[k - 2 : k + 1]) / 3 for k in range(2, len(rewards))]
    # It ran until the first step whose three-step mean met the target (or to the end).
    assert all(mean < TARGET for mean in means[:-1]), rewards
    assert means[-1] >= TARGET or len(rewards) == STEPS, rewards
    checkpoints = sorted(p.name for p in (toy_run.run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{len(rewards)}"]
    # The run's record says why it ended where it did.
    run_id = (toy_run.run_dir / "run_id").read_text().strip()
    with Store(f"sqlite:///{toy_run.run_dir}/omniloop.db") as store:
        reason = store.get_run(run_id).status_reason
    if len(rewards) < STEPS:
        assert reason == (
            f"stop_when: reward/mean averaged {means[-1]:.3f} over steps {len(rewards) - 2}-"
            f"{len(rewards)} (at least {TARGET}); the run ended after step {len(rewards)} of "
            f"{STEPS}"
        )


def test_no_trained_sample_is_older_than_max_staleness(toy_run: ToyRun) -> None:
    ages = [
        step["trainer_version"] - version
        for step in toy_run.trained
        for _, version in step["samples"]
    ]
    assert ages
    assert min(ages) >= 0
    assert max(ages) <= toy_run.max_staleness
    # The trainer's own histogram agrees with the record.
    assert max(m["staleness/max"] for m in toy_run.metrics) == max(ages)
    assert all(m["staleness/refused"] == 0 for m in toy_run.metrics)


def test_on_policy_samples_are_current_and_bounded_ones_run_ahead(toy_run: ToyRun) -> None:
    versions = {
        (step["trainer_version"], version)
        for step in toy_run.trained
        for _, version in step["samples"]
    }
    if toy_run.max_staleness == 0:
        # Every sample was drawn by exactly the weights that then trained on it.
        assert all(trainer == sample for trainer, sample in versions)
    else:
        # Rollouts did run ahead of training (otherwise the bound was never exercised).
        assert any(trainer - sample >= 1 for trainer, sample in versions)


def test_each_trajectory_is_trained_at_most_once(toy_run: ToyRun) -> None:
    ids = [traj_id for step in toy_run.trained for traj_id, _ in step["samples"]]
    assert len(ids) == len(set(ids))
    for step, metrics in zip(toy_run.trained, toy_run.metrics, strict=True):
        produced = metrics["episodes/count"] - metrics["episodes/errors"]
        assert len(step["samples"]) == produced


def test_versions_advance_one_per_step(toy_run: ToyRun) -> None:
    steps = len(toy_run.metrics)
    assert [s["trainer_version"] for s in toy_run.trained] == list(range(steps))
    assert [s["version"] for s in toy_run.trained] == list(range(1, steps + 1))


def test_metrics_report_reward_kl_entropy_staleness_and_throughput(toy_run: ToyRun) -> None:
    keys = {
        "reward/mean", "reward/std", "response_length/mean", "kl", "entropy", "staleness/max",
        "perf/step_seconds", "perf/tokens_per_second", "perf/rollout_seconds",
        "perf/train_seconds", "episodes/errors", "episodes/count", "actor/grad_norm",
    }  # fmt: skip
    for metrics in toy_run.metrics:
        assert keys <= metrics.keys()
        assert metrics["perf/step_seconds"] > 0
        assert metrics["perf/tokens_per_second"] > 0
    # Every trained step's trajectories; the rollouts of the steps after the last trained one
    # that had started when the run ended (up to max_staleness + 1) may have written theirs.
    written = {p.name for p in (toy_run.run_dir / "trajectories").glob("step_*.jsonl")}
    trained = {f"step_{k}.jsonl" for k in range(len(toy_run.metrics))}
    assert trained <= written
    assert len(written) <= len(trained) + toy_run.max_staleness + 1
    if toy_run.backend == "megatron":  # two ranks, each training its share of every step
        for metrics in toy_run.metrics:
            assert metrics["actor/data_parallel_rows_max"] < metrics["actor/num_seqs"]


def test_the_run_its_metrics_and_its_episodes_are_in_the_database(toy_run: ToyRun) -> None:
    run_id = (toy_run.run_dir / "run_id").read_text().strip()
    with Store(f"sqlite:///{toy_run.run_dir}/omniloop.db") as store:
        record = store.get_run(run_id)
        assert record.status == "completed"
        assert record.config["max_staleness"] == toy_run.max_staleness
        assert record.config["trainer"]["backend"] == toy_run.backend
        rewards = store.get_metrics(run_id, ["reward/mean"])["reward/mean"]
        assert [(p.step, p.value) for p in rewards] == [
            (step, m["reward/mean"]) for step, m in enumerate(toy_run.metrics)
        ]
        counts = store.count_episodes(run_id)
        episodes = sum(m["episodes/count"] for m in toy_run.metrics)
        errors = sum(m["episodes/errors"] for m in toy_run.metrics)
        # Besides the trained steps' episodes, those of rollouts that had started when the run
        # ended (at most max_staleness + 1 steps of 32).
        ahead = (toy_run.max_staleness + 1) * 32
        assert episodes <= sum(counts.values()) <= episodes + ahead
        assert errors <= counts["failed"] <= errors + ahead
        # The stored trajectory is the one the rollout wrote, token for token.
        written = read_jsonl(toy_run.run_dir / "trajectories" / "step_0.jsonl")[0]
        episode = store.get_episode(written["id"])
        assert episode.run_id == run_id
        assert episode.trajectory == Trajectory.model_validate(written)
        assert episode.reward == written["reward"]
