"""The reference policy of the KL penalty, scored apart from the trainer (the `reference` role).

With `trainer.reference=external` and `trainer.loss.kl_coef > 0`, a run's `reference` role
writes `ref_logprobs` for every row of a step to the data plane, and the actor trains on them
(`TrainBatch.ref_logprobs`) instead of keeping a frozen copy of the policy beside its own. The
reference is the run's base model (`model`), never updated: a resumed run scores with the same
weights, so nothing of it is checkpointed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from omniloop.inference.models import resolve_model
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import Scorer, default_device, load_policy


class ReferencePolicy(Protocol):
    """A frozen policy that scores batches."""

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Per-token logprobs of `batch.input_ids`, aligned as `TrainerBackend.logprobs`:
        `(B, T)` float32 on the CPU, 0 at position 0 and on padding."""
        ...


class TorchReference:
    """`ReferencePolicy` over the policy model of `config.backend` (`load_policy`: a Hugging
    Face causal LM or multimodal conditional-generation model, media inputs scored with their
    rows, or megatron-core's `GPTModel`), scored like `TorchTrainerBackend` scores (same dtype,
    device and micro-batching, from the same `TrainerConfig`), so its logprobs equal the
    backend's `ref_logprobs` for the same base model."""

    def __init__(self, model: str | Path, config: TrainerConfig | None = None) -> None:
        self.config = config or TrainerConfig()
        device = torch.device(self.config.device) if self.config.device else default_device()
        policy = load_policy(resolve_model(str(model)), self.config)
        self.model: nn.Module = nn.Module.to(policy.module, device).eval().requires_grad_(False)
        self._scorer = Scorer(self.config, device)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return self._scorer.score(self.model, batch)
