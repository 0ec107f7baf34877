"""PPO's pi_old in a run (`trainer.loss.old_policy`): the trainer's own policy as its step
begins, with the sampling weights corrected for by truncated importance sampling, or the
engine's logprobs."""

from __future__ import annotations

import pytest
import torch

from omniloop.platform.control.local import train_rows
from omniloop.platform.data import MicroBatch
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import LossConfig, TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend

ENGINE_LOGPROB = -0.5
"""The logprob the engine sampled each token with: far above the tiny random model's (about
-7.6 over its vocabulary), as if older weights had sampled them."""


def micro_batch() -> MicroBatch:
    """Two rows as the actor reads them, 4 sampled tokens each, negative advantages."""
    return MicroBatch(
        step=0,
        consumer="actor",
        ids=["a", "b"],
        fields={
            "input_ids": [torch.tensor([5, 9, 11, 14, 3, 8]), torch.tensor([5, 9, 12, 7, 6, 2])],
            "loss_mask": [torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int8)] * 2,
            "rollout_logprobs": [torch.tensor([0.0, 0.0, *[ENGINE_LOGPROB] * 4])] * 2,
            "weight_version": [torch.tensor([-1, -1, 0, 0, 0, 0], dtype=torch.int32)] * 2,
            "prompt_length": torch.tensor([2, 2]),
            "advantages": [torch.tensor([0.0, 0.0, *[-1.0] * 4])] * 2,
            "multimodal": [[], []],
            "meta": [{"stop_reason": "stop"}] * 2,
        },
    )


def trainer() -> TorchTrainerBackend:
    return TorchTrainerBackend("tiny", TrainerConfig(device="cpu", loss=LossConfig(tis_cap=2.0)))


def test_the_trainer_s_policy_is_pi_old_and_the_engine_s_is_corrected_for() -> None:
    """`old_policy="trainer"`: the ratio is taken against the trainer's own logprobs (ratio 1:
    nothing is clipped in the step), and each token weighs min(pi_trainer / pi_engine, 2)."""
    rows = train_rows(micro_batch(), old_policy="trainer")
    assert all(row.old_logprobs is None for row in rows)
    batch = TrainBatch.from_rows(rows)
    backend = trainer()
    current = backend.logprobs(batch)
    trained = batch.loss_mask != 0
    weights = torch.exp(current - batch.rollout_logprobs)[trained].clamp(max=2.0)
    assert float(weights.max()) < 0.01  # the engine's samples are unlikely under the trainer
    metrics = backend.train_step(batch)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-4)
    assert metrics["actor/clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)


def test_with_the_engine_s_policy_the_clip_is_against_the_sampling_weights() -> None:
    """`old_policy="engine"` (the default): the ratio is pi_trainer / pi_engine, far below
    1 - 0.2, so every token of a negative advantage is clipped (no gradient), and the importance
    weight is 1."""
    assert LossConfig().old_policy == "engine"
    rows = train_rows(micro_batch())
    assert all(row.old_logprobs is not None for row in rows)
    metrics = trainer().train_step(TrainBatch.from_rows(rows))
    assert metrics["actor/tis_weight_mean"] == pytest.approx(1.0)
    assert metrics["actor/clipfrac"] == pytest.approx(1.0)
    assert metrics["actor/grad_norm"] == pytest.approx(0.0, abs=1e-9)
