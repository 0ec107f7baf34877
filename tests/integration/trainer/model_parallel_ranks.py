"""One rank of a model-parallel megatron trainer, for `test_megatron_backend.py`.

    python model_parallel_ranks.py RANK WORLD STORE BATCH OUT CHECKPOINTS STAGES

Joins a gloo world of WORLD processes over the file STORE, builds the megatron backend of the
tiny model with STAGES pipeline stages of WORLD / STAGES tensor-parallel ranks, and on the
`TrainBatch` saved in BATCH: scores, takes two steps, scores again, gathers the weights and
checkpoints them into CHECKPOINTS/tp{T}pp{P}; then loads the one-rank checkpoint
CHECKPOINTS/tp1pp1 and gathers the weights again. Rank 0 writes what it saw to OUT
(`torch.save`); the test compares it with one rank's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend

CONFIG = {"device": "cpu", "backend": "megatron", "lr": 1e-3, "micro_batch_size": 2}


def run(
    tensor_parallel: int,
    pipeline_parallel: int,
    data: TrainBatch,
    checkpoints: Path,
    rank: int = 0,
) -> dict[str, object]:
    """What a rank sees of `data` (module docstring)."""
    parallel = {"tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel}
    config = TrainerConfig.model_validate({**CONFIG, "megatron": parallel})
    trainer = TorchTrainerBackend("tiny", config)
    before = trainer.logprobs(data)
    metrics = [trainer.train_step(data) for _ in range(2)]
    seen = {
        "before": before,
        "after": trainer.logprobs(data),
        "grad_norms": [m["actor/grad_norm"] for m in metrics],
        # Copies: a weight that is not split is the parameter itself, which `load` overwrites.
        "weights": {name: tensor.clone() for name, tensor in trainer.named_weights()},
    }
    trainer.save(
        checkpoints / f"tp{tensor_parallel}pp{pipeline_parallel}", {"step": 2}, write=rank == 0
    )
    if tensor_parallel * pipeline_parallel > 1:
        trainer.load(checkpoints / "tp1pp1")
        seen["loaded"] = dict(trainer.named_weights())
    return seen


if __name__ == "__main__":
    from gloo_world import gloo_world  # a sibling of this script

    rank, world, store, batch, out, checkpoints, stages = sys.argv[1:8]
    with gloo_world(rank, world, store):
        data = torch.load(batch, weights_only=False)
        tensor_parallel = int(world) // int(stages)
        seen = run(tensor_parallel, int(stages), data, Path(checkpoints), int(rank))
        if rank == "0":
            torch.save(seen, out)
