"""One data-parallel rank of a trainer, for `test_data_parallel.py`.

    python dp_ranks.py RANK WORLD STORE BATCH BACKEND OUT SHARDED

Joins a gloo world of WORLD processes over the file STORE, builds the BACKEND (`torch` or
`megatron`) trainer of the tiny model as one rank of a data-parallel group of WORLD ranks (with
its optimizer state sharded over them if SHARDED is `1`), takes two steps on its shard of the
`TrainBatch` saved in BATCH, and checkpoints into OUT.checkpoint. Each rank writes what it saw
to OUT with its rank appended (`torch.save`); the test compares them with one rank given the
whole batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.data_parallel import Alone, DistributedGroup, RankGroup
from omniloop.trainer.torch_backend import TorchTrainerBackend


def run(
    backend: str,
    data: TrainBatch,
    ranks: RankGroup,
    sharded: bool = False,
    checkpoint: Path | None = None,
) -> dict[str, object]:
    """What a rank sees: its rows' ids, its steps' metrics, the weights after two steps, the
    bytes of optimizer state it holds."""
    config = TrainerConfig.model_validate(
        {
            "device": "cpu",
            "backend": backend,
            "lr": 1e-3,
            "micro_batch_size": 2,
            "distributed_optimizer": sharded,
        }
    )
    if backend == "megatron" and ranks.size > 1:
        from megatron.core import parallel_state

        from omniloop.trainer.megatron.model import ensure_model_parallel

        ensure_model_parallel(1)
        ranks = DistributedGroup(parallel_state.get_data_parallel_group())
    trainer = TorchTrainerBackend("tiny", config, ranks)
    shard = data.shard(ranks.rank, ranks.size)
    metrics = [trainer.train_step(shard) for _ in range(2)]
    if checkpoint is not None:
        trainer.save(checkpoint, {"step": 2}, write=ranks.rank == 0)
    held = getattr(trainer.optimizer, "optim", trainer.optimizer).state  # a sharded one's share
    return {
        "ids": list(shard.ids),
        "metrics": metrics,
        "weights": dict(trainer.named_weights()),
        "after": trainer.logprobs(data),
        "optimizer_bytes": sum(
            t.numel() * t.element_size()
            for entry in held.values()
            for t in entry.values()
            if isinstance(t, torch.Tensor)
        ),
    }


def alone(backend: str, data: TrainBatch) -> dict[str, object]:
    """One rank given every row."""
    return run(backend, data, Alone())


if __name__ == "__main__":
    from gloo_world import gloo_world  # a sibling of this script

    rank, world, store, batch, backend, out, sharded = sys.argv[1:8]
    with gloo_world(rank, world, store):
        data = torch.load(batch, weights_only=False)
        seen = run(backend, data, DistributedGroup(), sharded == "1", Path(f"{out}.checkpoint"))
        torch.save(seen, f"{out}.{rank}")
