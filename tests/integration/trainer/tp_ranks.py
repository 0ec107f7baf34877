"""One rank of a tensor-parallel megatron trainer, for `test_megatron_backend.py`.

    python tp_ranks.py RANK WORLD STORE BATCH OUT

Joins a gloo world of WORLD processes over the file STORE, builds the megatron backend of the
tiny model with `tensor_parallel=WORLD`, and on the `TrainBatch` saved in BATCH: scores, takes
two steps, scores again and gathers the weights. Rank 0 writes what it saw to OUT
(`torch.save`); the test compares it with one rank's.
"""

from __future__ import annotations

import sys

import torch

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend

CONFIG = {"device": "cpu", "backend": "megatron", "lr": 1e-3, "micro_batch_size": 2}


def run(tensor_parallel: int, data: TrainBatch) -> dict[str, object]:
    """What a rank sees of `data` (module docstring)."""
    config = TrainerConfig.model_validate(
        {**CONFIG, "megatron": {"tensor_parallel": tensor_parallel}}
    )
    trainer = TorchTrainerBackend("tiny", config)
    before = trainer.logprobs(data)
    metrics = [trainer.train_step(data) for _ in range(2)]
    return {
        "before": before,
        "after": trainer.logprobs(data),
        "grad_norms": [m["actor/grad_norm"] for m in metrics],
        "weights": dict(trainer.named_weights()),
    }


if __name__ == "__main__":
    import torch.distributed as dist

    rank, world, store, batch, out = sys.argv[1:6]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world)
    )
    seen = run(int(world), torch.load(batch, weights_only=False))
    if rank == "0":
        torch.save(seen, out)
    dist.destroy_process_group()
