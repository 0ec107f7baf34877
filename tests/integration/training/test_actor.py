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
from collections.abc import Iterator

import pytest
import torch

from omniloop.platform.control.local import LocalActor, LocalReference
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.data import DataPlane, DataPlaneConfig
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import LossConfig, TrainerConfig
from omniloop.trainer.reference import TorchReference
from omniloop.trainer.torch_backend import TorchTrainerBackend
from omniloop.trajectory import StopReason, Trajectory, TrajectoryBuilder, TrajectoryMeta

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def plane() -> Iterator[DataPlane]:
    temp = tempfile.mkdtemp(prefix="omniloop-test-ray-", dir="/tmp")
    started = DataPlane.start(DataPlaneConfig(ray_temp_dir=temp, max_poll_interval_s=0.02))
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

    reference = LocalReference(plane, TorchReference("tiny", external), 2, 30.0, threads=1)
    try:
        metrics = await reference.compute(step)
    finally:
        reference.close()

    assert metrics["reference/rows"] == 5
    written = {}
    async for batch in plane.iter_micro_batches(step, ["ref_logprobs"], 8, "check"):
        written.update(zip(batch.ids, batch["ref_logprobs"], strict=True))
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
