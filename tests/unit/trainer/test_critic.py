"""PPO's critic: the clipped value loss, and the value model on the tiny model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import AdvantageConfig, CriticConfig, TrainerConfig
from omniloop.trainer.critic import TorchCritic, value_loss


def test_the_value_loss_is_half_the_larger_squared_error_of_the_clipped_and_the_plain() -> None:
    values = torch.tensor([[0.0, 1.0, 0.5, 9.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 9.0]])
    returns = torch.tensor([[0.0, 2.0, -1.0, 7.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    # Token 1: plain (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24; token 2: plain 2.25, clipped 1.44.
    expected = 0.5 * (3.24 + 2.25) / 2
    assert float(value_loss(values, old, returns, mask, 0.2)) == pytest.approx(expected)
    assert float(value_loss(values, old, returns, mask, None)) == pytest.approx(0.5 * 3.25 / 2)


def _batch() -> TrainBatch:
    scoring = TrainBatch.for_scoring([[1, 2, 3, 4, 5], [6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    return dataclasses.replace(scoring, loss_mask=mask)


def test_the_critic_starts_at_zero_and_learns_the_returns(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = TrainerConfig(device="cpu", micro_batch_size=1)
    critic = TorchCritic("tiny", trainer, CriticConfig(lr=1e-2, value_clip=None))
    batch = _batch()
    values = critic.values(batch)
    assert values.shape == (2, 5)
    assert not values.any(), "a zero head scores every state 0"
    returns = batch.loss_mask * 1.5
    losses = []
    for _ in range(15):
        old = critic.values(batch)
        losses.append(critic.train_step(batch, old, returns)["critic/value_loss"])
    assert losses[0] == pytest.approx(0.5 * 1.5**2)
    assert losses[-1] < 0.2 * losses[0], losses
    learned = critic.values(batch)
    assert learned[0, 0] == 0, "position 0 holds 0"
    assert not learned[1, 3:].any(), "padding holds 0"

    critic.save(tmp_path / "critic")
    again = TorchCritic("tiny", trainer, CriticConfig(lr=1e-2))
    again.load(tmp_path / "critic")
    torch.testing.assert_close(again.values(batch), learned)
    assert again.steps == 15


def test_gae_and_the_critic_come_together() -> None:
    with pytest.raises(ValidationError, match="estimator=gae needs a critic"):
        TrainerConfig(advantage=AdvantageConfig(estimator="gae"))
    with pytest.raises(ValidationError, match=r"trainer\.critic is set but"):
        TrainerConfig(critic=CriticConfig())
    TrainerConfig(advantage=AdvantageConfig(estimator="gae"), critic=CriticConfig())


def test_the_critic_runs_packed_as_it_runs_padded() -> None:
    """Two rows sharing their first four tokens beside a third: packed, the backbone embeds
    fewer tokens, and the values and the step are the padded batch's."""
    scoring = TrainBatch.for_scoring([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [12, 13, 14]])
    mask = scoring.attention_mask.float()
    mask[:, :2] = 0
    batch = dataclasses.replace(scoring, loss_mask=mask)
    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    results = {}
    for packed in (True, False):
        trainer = TrainerConfig(
            device="cpu", micro_batch_size=3, pack_sequences=packed, shared_prefix_min_tokens=2
        )
        critic = TorchCritic("tiny", trainer, CriticConfig(lr=1e-2))
        with torch.no_grad():  # a head that reads the hidden states (a fresh one reads nothing)
            critic.head.weight.copy_(head[:, : critic.head.in_features])
        embedded: list[int] = []
        critic.backbone.get_input_embeddings().register_forward_hook(
            lambda _module, args, _out, seen=embedded: seen.append(args[0].numel())
        )
        old = critic.values(batch)
        critic.train_step(batch, old, batch.loss_mask * 1.5)
        results[packed] = (old, critic.values(batch), embedded[0])
    (packed_old, packed_after, packed_tokens), (old, after, tokens) = results[True], results[False]
    assert packed_tokens < tokens == 3 * 6  # 10 distinct tokens in packed rows, padding included
    torch.testing.assert_close(packed_old, old, atol=1e-5, rtol=0)
    # After the step the values are near 50, where float32's spacing is 4e-6: the packed and
    # padded sums, added in another order, differ by a few such steps (CPU-dependent), so the
    # tolerance is float32's relative default there.
    torch.testing.assert_close(packed_after, after)
    assert (packed_after - packed_old).abs().max() > 1e-3, "the step moved the values"
