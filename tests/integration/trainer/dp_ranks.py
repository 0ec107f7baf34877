"""One data-parallel rank of a trainer, for `test_data_parallel.py`.

    python dp_ranks.py RANK WORLD STORE BATCH BACKEND OUT

Joins a gloo world of WORLD processes over the file STORE, builds the BACKEND (`torch` or
`megatron`) trainer of the tiny model as one rank of a data-parallel group of WORLD ranks, and
takes two steps on its shard of the `TrainBatch` saved in BATCH. Each rank writes what it saw
to OUT with its rank appended (`torch.save`); the test compares them with one rank given the
whole batch.
"""

from __future__ import annotations

import sys

import torch

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.data_parallel import Alone, DistributedGroup, RankGroup
from omniloop.trainer.torch_backend import TorchTrainerBackend


def run(backend: str, data: TrainBatch, ranks: RankGroup) -> dict[str, object]:
    """What a rank sees: its rows' ids, its steps' metrics, the weights after two steps."""
    config = TrainerConfig.model_validate(
        {"device": "cpu", "backend": backend, "lr": 1e-3, "micro_batch_size": 2}
    )
    if backend == "megatron" and ranks.size > 1:
        from megatron.core import parallel_state

        from omniloop.trainer.megatron.model import ensure_model_parallel

        ensure_model_parallel(1)
        ranks = DistributedGroup(parallel_state.get_data_parallel_group())
    trainer = TorchTrainerBackend("tiny", config, ranks)
    shard = data.shard(ranks.rank, ranks.size)
    metrics = [trainer.train_step(shard) for _ in range(2)]
    return {
        "ids": list(shard.ids),
        "metrics": metrics,
        "weights": dict(trainer.named_weights()),
        "after": trainer.logprobs(data),
    }


def alone(backend: str, data: TrainBatch) -> dict[str, object]:
    """One rank given every row."""
    return run(backend, data, Alone())


if __name__ == "__main__":
    import torch.distributed as dist

    rank, world, store, batch, backend, out = sys.argv[1:7]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world)
    )
    seen = run(backend, torch.load(batch, weights_only=False), DistributedGroup())
    torch.save(seen, f"{out}.{rank}")
    dist.destroy_process_group()
