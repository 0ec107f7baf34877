"""The actor's defence in depth: rows past the staleness bound and infrastructure failures that
reach it anyway (a producer that skipped the gate, a restored run) are refused and counted, and
only the rest is trained. And the reference stage: the `ref_logprobs` it writes are the frozen
copy's, and the actor waits for them and trains on them.

Rows are written straight into a real TransferQueue partition, as a misbehaving producer would.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from omniloop.platform.control.local import (
    SCORES,
    LocalActor,
    LocalAdvantage,
    LocalScorer,
    ScoringRole,
)
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.data import DataPlane, DataPlaneConfig
from omniloop.trainer.backend import TrainerBackend, make_backend
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import (
    AdvantageConfig,
    CriticConfig,
    LossConfig,
    TeacherConfig,
    TrainerConfig,
)
from omniloop.trainer.ranks import RankedTrainer, RanksLost
from omniloop.trainer.reference import TorchReference
from omniloop.trainer.torch_backend import TorchTrainerBackend
from omniloop.trajectory import StopReason, Trajectory, TrajectoryBuilder, TrajectoryMeta


def _kill(rank: ray.actor.ActorHandle) -> None:
    """Kill a trainer rank's actor and wait until it is gone: `ray.kill` returns before, and
    a call sent meanwhile may still be served."""
    ray.kill(rank)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(rank.version.remote(), timeout=30)
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed rank still answers after 30 s")


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def plane() -> Iterator[DataPlane]:
    temp = tempfile.mkdtemp(prefix="omniloop-test-ray-", dir="/tmp")
    started = DataPlane.start(
        DataPlaneConfig(ray_temp_dir=temp, min_poll_interval_s=0.005, max_poll_interval_s=0.02)
    )
    try:
        yield started
    finally:
        started.close()
        shutil.rmtree(temp, ignore_errors=True)


def sample(
    episode: str, version: int, stop: StopReason = "stop", prompt: tuple[int, ...] = (1, 2, 3, 4)
) -> Trajectory:
    builder = TrajectoryBuilder(list(prompt))
    builder.add_sampled([500, 600, 700], [-1.0, -2.0, -0.5], version)
    meta = TrajectoryMeta(run_id="actor-test", episode_id=episode, group_id="g", stop_reason=stop)
    return builder.build(meta)


async def _scored(
    plane: DataPlane, step: int, role: ScoringRole, model: TorchReference
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Run the `role` stage of `model` on partition `step`: its metrics, and the logprobs it
    wrote, by row id."""
    scorer = LocalScorer(role, plane, model, 2, 30.0, threads=1)
    try:
        metrics = await scorer.compute(step)
    finally:
        scorer.close()
    field = SCORES[role]
    written: dict[str, torch.Tensor] = {}
    async for batch in plane.iter_micro_batches(step, [field], 8, "check"):
        written.update(zip(batch.ids, batch[field], strict=True))
    return metrics, written


async def test_actor_refuses_stale_samples_and_infra_failures(plane: DataPlane) -> None:
    config = RunConfig(
        model="tiny",
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
        trainer=TrainerConfig(device="cpu", lr=1e-4, micro_batch_size=2),
        max_staleness=1,
    )
    backend = TorchTrainerBackend("tiny", config.trainer)
    backend.version = 3  # the trainer has taken three optimizer steps
    rows = [sample(f"v{v}", v) for v in range(4)] + [sample("broken", 3, "sandbox_error")]
    step = 7
    await plane.put_rollout(step, rows)
    rewards = [math.nan if t.is_infra_failure else 1.0 for t in rows]
    await plane.put_field(step, [t.id for t in rows], "reward", rewards)
    advantages = [[0.0] * 4 + [1.0] * 3 for _ in rows]
    await plane.put_field(step, [t.id for t in rows], "advantages", advantages)
    await plane.close_partition(step)

    report = await LocalActor(backend, plane, config).train(step)

    # Staleness 3 - v: v0 and v1 are past the bound of 1; v2 and v3 are trained.
    assert {i for i, _ in report.trained} == {rows[2].id, rows[3].id}
    assert dict(report.trained) == {rows[2].id: 2, rows[3].id: 3}
    assert report.metrics["staleness/refused"] == 2
    assert report.metrics["staleness/max"] == 1
    assert report.metrics["actor/excluded_infra_failures"] == 1
    assert (report.trained_version, report.version, backend.version) == (3, 4, 4)


@pytest.mark.parametrize(("max_staleness", "kept_from"), [(0, 1), (1, 0)])
async def test_a_checkpoint_forgets_the_steps_before_the_previous_one(
    plane: DataPlane, tmp_path: Path, max_staleness: int, kept_from: int
) -> None:
    """The queue keeps what marks a trained step closed only while a restore or a stage can
    still reach the step: from the previous checkpoint on, and the steps whose production may
    be under way (`max_staleness + 1` here)."""
    config = RunConfig(
        model="tiny",
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
        trainer=TrainerConfig(device="cpu", lr=1e-4, micro_batch_size=2),
        max_staleness=max_staleness,
    )
    actor = LocalActor(TorchTrainerBackend("tiny", config.trainer), plane, config)
    first = 40 + 10 * max_staleness  # steps no other test uses
    for step in range(first, first + 4):
        rows = [sample(f"s{step}-{k}", 0) for k in range(2)]
        await plane.put_rollout(step, rows, {"reward": [1.0, 0.0]})
        await plane.put_field(step, [t.id for t in rows], "advantages", [[0.0] * 4 + [1.0] * 3] * 2)
        await plane.close_partition(step)
    try:
        await actor.train(first)
        await actor.save(tmp_path / "a", first + 1)
        await actor.train(first + 1)
        await actor.train(first + 2)
        await actor.save(tmp_path / "b", first + 3)
    finally:
        actor.close()
    # The steps trained after checkpoint `a` are still reopened for a restore from it; the one
    # before it is forgotten unless its production may still be under way (the next step to
    # train being `first + 3`); the last one, produced and not trained, keeps its rows.
    assert await plane.reopen_cleared(first) == list(range(first + kept_from, first + 3))
    await plane.reopen_cleared(0)  # writes to the other tests' (lower) steps are taken again
    assert (
        len(
            [
                i
                for b in [
                    b async for b in plane.iter_micro_batches(first + 3, ["input_ids"], 8, "check")
                ]
                for i in b.ids
            ]
        )
        == 2
    )


async def test_the_reference_stage_scores_like_the_frozen_copy(plane: DataPlane) -> None:
    loss = LossConfig(kl_coef=0.1)
    external = TrainerConfig(device="cpu", micro_batch_size=2, loss=loss, reference="external")
    config = RunConfig(
        model="tiny",
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
        trainer=external,
    )
    # Rows of different lengths (padding differs by micro-batch) and one infra failure.
    rows = [sample(f"r{n}", 0, prompt=tuple(range(1, n + 2))) for n in range(5)]
    rows.append(sample("broken", 0, "engine_error"))
    step = 11
    await plane.put_rollout(step, rows)
    await plane.close_partition(step)

    metrics, written = await _scored(plane, step, "reference", TorchReference("tiny", external))
    assert metrics["reference/rows"] == 5
    assert set(written) == {t.id for t in rows}
    assert not written[rows[-1].id].any(), "an infra failure was scored"
    copy = TorchTrainerBackend("tiny", external.model_copy(update={"reference": "copy"}))
    expected = copy.ref_logprobs(TrainBatch.for_scoring([t.input_ids for t in rows[:-1]]))
    for b, trajectory in enumerate(rows[:-1]):
        got = written[trajectory.id]
        assert got.shape == (len(trajectory.input_ids),)
        assert got[1:].abs().min() > 0, "a token was left unscored"
        torch.testing.assert_close(got, expected[b, : len(got)], atol=1e-5, rtol=1e-5)

    # The actor reads the rows only with their ref_logprobs, and its policy (version 0) is the
    # reference: the KL it measures is zero.
    ids = [t.id for t in rows]
    await plane.put_field(step, ids, "reward", [1.0] * 5 + [math.nan])
    advantages = [[0.0] * (len(t.input_ids) - 3) + [1.0] * 3 for t in rows]
    await plane.put_field(step, ids, "advantages", advantages)
    backend = TorchTrainerBackend("tiny", external)
    assert backend.reference is None
    report = await LocalActor(backend, plane, config).train(step)
    assert {i for i, _ in report.trained} == {t.id for t in rows[:-1]}
    assert abs(report.metrics["actor/kl"]) < 1e-5


async def test_the_teacher_stage_scores_rows_and_the_actor_trains_on_its_signal(
    plane: DataPlane,
) -> None:
    teacher = TeacherConfig(model="tiny", coef=1.0, reward_weight=0.0)
    trainer = TrainerConfig(device="cpu", micro_batch_size=2, teacher=teacher)
    config = RunConfig(
        model="tiny",
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
        trainer=trainer,
    )
    rows = [sample(f"t{n}", 0, prompt=tuple(range(1, n + 3))) for n in range(3)]
    step = 12
    await plane.put_rollout(step, rows)
    await plane.close_partition(step)

    metrics, written = await _scored(plane, step, "teacher", TorchReference("tiny", trainer))
    assert metrics["teacher/rows"] == 3
    # The reverse KL it reports: sampling logprob minus the teacher's, over the sampled tokens.
    sampled = torch.tensor([-1.0, -2.0, -0.5])
    gaps = [float((sampled - written[t.id][-3:]).mean()) for t in rows]
    assert metrics["teacher/reverse_kl"] == pytest.approx(sum(gaps) / 3, abs=1e-5)

    # No reward advantage at all: the actor's step is the teacher's signal alone.
    ids = [t.id for t in rows]
    await plane.put_field(step, ids, "reward", [0.0] * 3)
    await plane.put_field(step, ids, "advantages", [[0.0] * len(t.input_ids) for t in rows])
    report = await LocalActor(TorchTrainerBackend("tiny", trainer), plane, config).train(step)
    assert {i for i, _ in report.trained} == set(ids)
    # With zero advantages the policy loss is exactly 0; the teacher's signal makes it not.
    assert report.metrics["actor/pg_loss"] != 0


async def test_gae_advantages_and_returns_come_from_the_critic_s_values(plane: DataPlane) -> None:
    rows = [sample(f"g{n}", 0) for n in range(2)] + [sample("gbroken", 0, "engine_error")]
    step = 13
    ids = [t.id for t in rows]
    await plane.put_rollout(step, rows)
    await plane.put_field(step, ids, "reward", [1.0, 0.0, math.nan])
    # Values 0.25, 0.5, 0.75 on the three sampled tokens (positions 4..6).
    values = [[0.0] * 4 + [0.25, 0.5, 0.75] for _ in rows]
    await plane.put_field(step, ids, "values", values)
    await plane.close_partition(step)

    critic = CriticConfig(gamma=1.0, lam=1.0)
    advantage = LocalAdvantage(plane, AdvantageConfig(estimator="gae"), 2, 30.0, critic=critic)
    await advantage.compute(step)

    written = {}
    async for batch in plane.iter_micro_batches(step, ["advantages", "returns"], 8, "check"):
        for i, row_id in enumerate(batch.ids):
            written[row_id] = (batch["advantages"][i], batch["returns"][i])
    # gamma = lambda = 1: every sampled token's advantage is the reward minus its value, and
    # its return is the reward; an infrastructure failure gets zeros.
    for row_id, reward in ((ids[0], 1.0), (ids[1], 0.0)):
        adv, ret = written[row_id]
        torch.testing.assert_close(adv[4:], reward - torch.tensor([0.25, 0.5, 0.75]))
        torch.testing.assert_close(ret[4:], torch.full((3,), reward))
        assert not adv[:4].any()
        assert not ret[:4].any()
    assert not written[ids[2]][0].any()
    assert not written[ids[2]][1].any()


async def _one_step(plane: DataPlane, step: int, config: RunConfig, backend: TrainerBackend):
    rows = [sample(f"dp{step}-{n}", 0, prompt=tuple(range(1, n + 3))) for n in range(5)]
    ids = [t.id for t in rows]
    await plane.put_rollout(step, rows)
    await plane.put_field(step, ids, "reward", [1.0] * len(rows))
    signs = [1.0, -1.0, 0.5, -0.5, 0.8]
    advantages = [
        [0.0] * (len(t.input_ids) - 3) + [s] * 3 for t, s in zip(rows, signs, strict=True)
    ]
    await plane.put_field(step, ids, "advantages", advantages)
    await plane.close_partition(step)
    return ids, await LocalActor(backend, plane, config).train(step)


@pytest.mark.parametrize(
    ("first_step", "ranks", "rows_max"),
    [
        (20, {"data_parallel": 2, "distributed_optimizer": True}, 3),
        (30, {"backend": "megatron", "megatron": {"pipeline_parallel": 2}}, 5),
    ],
    ids=["torch-data-parallel-2-sharded-optimizer", "megatron-pipeline-2"],
)
async def test_the_actor_s_ranks_train_each_row_once_as_one_rank(
    plane: DataPlane, tmp_path, first_step: int, ranks: dict[str, object], rows_max: int
) -> None:
    """Two rank processes (`RankedTrainer`) under the actor: two data-parallel ranks (their
    optimizer state sharded) split the rows of a step, every row once (two pipeline stages
    share them); the weights after the step are one rank's given every row; a checkpoint of
    the ranks loads into one rank; a rank that dies ends the group, by name."""
    single = {"device": "cpu", "lr": 1e-3, "micro_batch_size": 2}
    ranked = TrainerConfig.model_validate({**single, **ranks})
    one_rank = TrainerConfig.model_validate({**single, "backend": ranked.backend})
    config = RunConfig(
        model="tiny",
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
        trainer=ranked,
    )
    backend = make_backend("tiny", ranked)
    assert isinstance(backend, RankedTrainer)
    try:
        ids, report = await _one_step(plane, first_step, config, backend)
        alone = TorchTrainerBackend("tiny", one_rank)
        _, expected = await _one_step(plane, first_step + 1, config, alone)

        assert {i for i, _ in report.trained} == set(ids)
        trained = [row for shard in backend.shards for row in shard]
        assert sorted(trained) == sorted(ids)
        assert all(backend.shards)
        assert report.metrics["actor/num_seqs"] == 5
        assert report.metrics["actor/data_parallel_rows_max"] == rows_max
        assert report.metrics["actor/grad_norm"] == pytest.approx(
            expected.metrics["actor/grad_norm"], rel=1e-5
        )
        assert backend.version == alone.version == 1
        mine = dict(backend.named_weights())
        for name, weight in alone.named_weights():
            torch.testing.assert_close(mine[name], weight, atol=5e-5, rtol=0, msg=name)

        rows = [sample(f"score{n}", 0, prompt=tuple(range(1, n + 2))) for n in (1, 7, 3)]
        for scored in (rows, rows[:1]):  # with one row, a data-parallel rank has none to score
            batch = TrainBatch.from_trajectories(scored, None)
            torch.testing.assert_close(
                backend.logprobs(batch), alone.logprobs(batch), atol=1e-5, rtol=0
            )

        backend.save(tmp_path / "ckpt", {"step": 3})
        restored = TorchTrainerBackend("tiny", one_rank)
        assert restored.load(tmp_path / "ckpt") == {"step": 3}
        for name, weight in restored.named_weights():
            torch.testing.assert_close(mine[name], weight, atol=0, rtol=0, msg=name)

        _kill(backend._workers[1])
        with pytest.raises(RanksLost, match="a trainer rank failed"):
            dict(backend.named_weights())
        with pytest.raises(RanksLost):
            backend.check_health()
    finally:
        backend.close()
