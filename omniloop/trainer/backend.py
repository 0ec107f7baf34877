"""The `TrainerBackend` protocol: what the control loop needs from a trainer.

Implementation: `torch_backend.TorchTrainerBackend`, a PyTorch training loop over the policy
model that `trainer.backend` names (a Hugging Face model, or megatron-core's `GPTModel`); build
it with `make_backend`.

Alignment contract (every implementation): per-token tensors are `(B, T)` like the batch, and
`logprobs(batch)[b, i] = log p(input_ids[b, i] | input_ids[b, :i])` for `i >= 1`; position 0
and padding hold 0. This is the alignment of `Trajectory.rollout_logprobs`, so trainer and
engine logprobs of the same token sit at the same index and can be compared directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig


@runtime_checkable
class TrainerBackend(Protocol):
    """A policy being trained: scores batches, takes optimizer steps, exports and checkpoints."""

    version: int
    """Weight version: the number of optimizer steps applied (restored by `load`)."""

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Per-token logprobs of `batch.input_ids` under the current weights, no gradient.

        `(B, T)` float32 on the CPU, aligned as in the module docstring.
        """
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the whole batch (gradients accumulated over micro-batches).

        Returns metrics (`actor/…`, `perf/…`). Increments `version` unless the step was skipped
        (non-finite gradient norm; reported as `actor/skipped_step`).
        """
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The weights under the model's in-memory names (`named_parameters()`), each tied
        tensor once: what an engine holding the same Hugging Face class loads by name. For
        causal LMs these are the checkpoint names; some families' checkpoints are renamed on
        load (the Qwen2.5-Omni thinker's `visual.…` is `model.visual.…` in memory)."""
        ...

    def save(self, path: str | Path, data_position: dict[str, Any] | None = None) -> None:
        """Checkpoint weights, optimizer, version and the caller's opaque data position."""
        ...

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a `save` checkpoint; returns the data position saved with it."""
        ...

    def save_hf(self, path: str | Path) -> None:
        """Write a Hugging Face model folder (weights, config, tokenizer) an engine can load."""
        ...


def make_backend(model: str | Path, config: TrainerConfig) -> TrainerBackend:
    """The trainer of `config` for `model` (anything `resolve_model` accepts): in this process,
    or, with several ranks (`trainer.data_parallel`, megatron's `tensor_parallel`,
    `pipeline_parallel`), over rank
    processes this one drives (`ranks.RankedTrainer`, in the running Ray)."""
    from omniloop.trainer.ranks import RankedTrainer, world_size
    from omniloop.trainer.torch_backend import TorchTrainerBackend

    if world_size(config) > 1:
        return RankedTrainer(model, config)
    return TorchTrainerBackend(model, config)


@runtime_checkable
class Supervised(Protocol):
    """A backend with parts that can fail on their own (rank processes): `check_health`
    raises once the backend can no longer train; `close` stops those parts."""

    def check_health(self) -> None: ...

    def close(self) -> None: ...
