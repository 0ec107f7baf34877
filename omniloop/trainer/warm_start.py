"""Supervised warm starts through the RL trainer: teach a format before RL teaches a choice.

A policy-gradient step with advantage 1 on every completion token, at ratio 1 (one optimizer
step per batch, the old logprobs the policy's own), is exactly a negative log-likelihood step
on those tokens; so a warm start is the trainer's own `train_step` over rows whose completion
is what the model should learn to write. The examples' warm starts use it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from omniloop.trainer.batch import MediaInputs, TrainBatch, TrainRow
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend


def completion_row(
    row_id: str,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    prefix: Sequence[int] = (),
    media_inputs: MediaInputs | None = None,
) -> TrainRow:
    """A row that teaches `completion` after `prompt` and `prefix` (neither trained)."""
    context = [*prompt, *prefix]
    ids = [*context, *completion]
    return TrainRow(
        id=row_id,
        input_ids=ids,
        loss_mask=[0] * len(context) + [1] * len(completion),
        rollout_logprobs=[0.0] * len(ids),
        weight_version=[-1] * len(context) + [0] * len(completion),
        advantages=1.0,
        stop_reason="stop",
        media_inputs=media_inputs,
    )


def supervised_warm_start(
    model: str,
    rows: Sequence[TrainRow],
    out: Path,
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 1e-2,
    seed: int = 0,
) -> Path:
    """`steps` steps of `batch_size` rows drawn (seeded) from `rows`, on `model` (an alias or
    a folder) in fp32 on the CPU; the result saved as a Hugging Face folder at `out`."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = TrainerConfig(lr=lr, micro_batch_size=batch_size, device="cpu", weight_decay=0.0)
    backend = TorchTrainerBackend(model, config)
    for _ in range(steps):
        backend.train_step(TrainBatch.from_rows(rng.sample(list(rows), batch_size)))
    backend.save_hf(out)
    return out
