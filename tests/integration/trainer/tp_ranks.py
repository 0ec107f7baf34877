"""One rank of a tensor-parallel megatron trainer, for `test_megatron_backend.py`.

    python tp_ranks.py RANK WORLD STORE OUT

Joins a gloo world of WORLD processes over the file STORE, builds the megatron backend of the
tiny model with `tensor_parallel=WORLD`, and on `batch()`: scores, takes two steps, scores again
and gathers the weights. Rank 0 writes what it saw to OUT (`torch.save`); the test compares it
with one rank's.
"""

from __future__ import annotations

import sys

import torch

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend

CONFIG = {"device": "cpu", "backend": "megatron", "lr": 1e-3, "micro_batch_size": 2}


def batch() -> TrainBatch:
    """Three right-padded rows of random ids, the first 4 tokens of each untrained."""
    gen = torch.Generator().manual_seed(31)
    lengths = [13, 9, 17]
    rows, width = len(lengths), max(lengths)
    ids = torch.randint(3, 2000, (rows, width), generator=gen)
    attention = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
        loss_mask[row, 4:n] = 1
    advantages = torch.tensor([1.0, -0.7, 0.4])[:, None] * loss_mask
    return TrainBatch(
        input_ids=ids * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=torch.zeros(rows, width),
        advantages=advantages,
    )


def run(tensor_parallel: int) -> dict[str, object]:
    """What a rank sees (module docstring)."""
    config = TrainerConfig.model_validate(
        {**CONFIG, "megatron": {"tensor_parallel": tensor_parallel}}
    )
    trainer = TorchTrainerBackend("tiny", config)
    data = batch()
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

    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    seen = run(world)
    if rank == 0:
        torch.save(seen, out)
    dist.destroy_process_group()
