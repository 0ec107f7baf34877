"""`RankedTrainer`: a `TrainerBackend` whose work runs on a group of rank processes, one Ray
actor per rank, driven in lock step. The caller (the actor role) sees one backend.

World: `trainer.data_parallel` × megatron's `tensor_parallel` × `pipeline_parallel` ranks in one
`torch.distributed` group (gloo on the CPU, NCCL on GPUs; rank 0's node address is the
rendezvous). Each data-parallel rank trains its shard of every batch (`TrainBatch.shards`: each
row by exactly one rank, balanced by tokens, rows that share an opening together) and the
ranks' gradients are summed before every optimizer step (`data_parallel.py`), so the weights
stay equal on every rank and N ranks take the step one rank would take on all rows. The
tensor-parallel ranks and pipeline stages of one data-parallel rank share its shard; they split
each layer, and the layers (megatron-core, `megatron/pipeline.py`).

The actor role reads each step's rows from the data plane once and hands each data-parallel
rank its shard through Ray's object store; the ranks do not read the data plane themselves (it
hands rows to a consumer, not by id, and the role admits rows by staleness before any rank sees
them).

Failure: a rank that dies, or an error that only some ranks raise, ends the group: the other
ranks are killed (a collective would wait for the failed one), the call raises `RanksLost`, and
`check_health` fails from then on, so that the actor role's replica is replaced and restored
from its checkpoint. An error every rank raises alike (input refused before any collective) is
raised as it is, and the group goes on. Checkpoints are written by rank 0 (every data-parallel
rank holds the same weights; model-parallel parts, and the shares of a sharded optimizer state,
are gathered to it) and read by every rank from the same path: several hosts need a shared run
folder.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from omniloop.errors import OmniloopError
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig

# How long a rank waits in a collective for the others (a dead rank is noticed by Ray first).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# After one rank raised, how long the others have to raise the same (an error of every rank).
ALIKE_FAILURE_GRACE_S = 30.0


class RanksLost(OmniloopError):
    """A rank of the trainer died or failed; the group is gone (every rank was stopped)."""


class RankWorker:
    """One rank: a `TorchTrainerBackend` in a process of its own (a Ray actor)."""

    def __init__(self, model: str, config: dict[str, Any], threads: int) -> None:
        self._model = model
        self._config = TrainerConfig.model_validate(config)
        self._threads = threads
        self._rank = 0
        self._data_rank = 0

    def rendezvous(self) -> str:
        """A `tcp://` address on this rank's node for the group to meet at (rank 0's)."""
        import ray

        from omniloop.processes import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, address: str, rank: int, world: int) -> tuple[int, int]:
        """Join the group of `world` ranks at `address` as `rank` and build the trainer; this
        rank's (data-parallel rank, data-parallel size)."""
        import torch.distributed as dist

        from omniloop.trainer.data_parallel import DistributedGroup
        from omniloop.trainer.torch_backend import TorchTrainerBackend, default_device

        torch.set_num_threads(self._threads)
        device = torch.device(self._config.device) if self._config.device else default_device()
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=address,
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self._rank = rank
        group = None
        if self._config.backend == "megatron":
            from megatron.core import parallel_state

            from omniloop.trainer.megatron.model import ensure_model_parallel

            megatron = self._config.megatron
            ensure_model_parallel(megatron.tensor_parallel, megatron.pipeline_parallel)
            group = parallel_state.get_data_parallel_group()
        ranks = DistributedGroup(group)
        self.backend = TorchTrainerBackend(self._model, self._config, ranks)
        self._data_rank = ranks.rank
        return ranks.rank, ranks.size

    def train_step(self, shard: TrainBatch) -> dict[str, float]:
        return self.backend.train_step(shard)

    def logprobs(self, shard: TrainBatch) -> Tensor:
        return self.backend.logprobs(shard)

    def weights(self) -> dict[str, Tensor] | None:
        """The whole weights in Hugging Face names on rank 0 (gathered from tensor-parallel
        ranks, which every rank joins); None on the others."""
        whole = {name: tensor.clone() for name, tensor in self.backend.named_weights()}
        return whole if self._rank == 0 else None

    def save(self, path: str, data_position: dict[str, Any] | None) -> None:
        """Rank 0 writes; the other model-parallel ranks of its data-parallel rank give their
        parts, and the other data-parallel ranks their shares of a sharded optimizer's state."""
        self.backend.save(path, data_position, write=self._rank == 0)

    def load(self, path: str) -> dict[str, Any]:
        return self.backend.load(path)

    def save_hf(self, path: str) -> None:
        if self._data_rank == 0:
            self.backend.save_hf(path, write=self._rank == 0)

    def version(self) -> int:
        return self.backend.version


def world_size(config: TrainerConfig) -> int:
    """Ranks of the trainer of `config`: data-parallel × tensor-parallel × pipeline stages."""
    if config.backend != "megatron":
        return config.data_parallel
    megatron = config.megatron
    return config.data_parallel * megatron.tensor_parallel * megatron.pipeline_parallel


class RankedTrainer:
    """A `TrainerBackend` over `world_size(config)` rank processes (module docstring). Needs Ray
    (the run's). Its calls may come from several threads (the actor's training thread, its
    weight publisher): each runs whole before the next starts, so that every rank sees the
    calls in the same order (the ranks' collectives pair up only that way)."""

    def __init__(self, model: str | Path, config: TrainerConfig) -> None:
        import ray

        self.config = config
        world = world_size(config)
        threads = max(1, (os.cpu_count() or 1) // world)
        cuda = (config.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith(
            "cuda"
        )
        # A rank's CPU share is the OS's to give (the actor role holds the run's trainer CPUs);
        # on GPUs each rank holds one.
        worker = ray.remote(num_cpus=0, num_gpus=1 if cuda else 0)(RankWorker)
        payload = config.model_dump(mode="json")
        self._calls = threading.Lock()
        self._lost: str | None = None
        self._workers: list[Any] = [
            worker.remote(str(model), payload, threads) for _ in range(world)
        ]
        try:
            address = self._get([self._workers[0].rendezvous.remote()])[0]
            placed = self._get(
                [w.start.remote(address, rank, world) for rank, w in enumerate(self._workers)]
            )
        except BaseException:
            self.close()
            raise
        self._data_rank = [rank for rank, _ in placed]
        self.data_parallel = placed[0][1]
        self.version = 0
        self.shards: list[tuple[str, ...]] = []
        """The row ids each data-parallel rank trained in the last step, by rank."""

    # -- the TrainerBackend protocol -----------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of every rank, each on its shard of `batch` (a shard may be
        empty: its ranks still take part in the step); rank 0's metrics (the step's, summed
        over the ranks) and `actor/data_parallel_rows_max` (the most rows one rank trained)."""
        import ray

        shards = [batch.select(rows) for rows in self._rows(batch)]
        with self._calls:
            refs = [ray.put(shard) for shard in shards]
            metrics = self._get([w.train_step.remote(refs[d]) for w, d in self._placed()])
            self.version = int(self._get([self._workers[0].version.remote()])[0])
        self.shards = [shard.ids for shard in shards]
        out = dict(metrics[0])
        out["actor/data_parallel_rows_max"] = float(max(len(shard) for shard in shards))
        return out

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Each data-parallel rank scores its shard; `(B, T)` in `batch`'s row order."""
        import ray

        rows = self._rows(batch)
        # The ranks of a data-parallel rank with no rows have nothing to score together.
        placed = [(w, d) for w, d in self._placed() if rows[d]]
        with self._calls:
            refs = {d: ray.put(batch.select(rows[d])) for _, d in placed}
            scored = self._get([w.logprobs.remote(refs[d]) for w, d in placed])
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for (_, data_rank), shard_scores in zip(placed, scored, strict=True):
            for i, row in enumerate(rows[data_rank]):
                out[row, : shard_scores.shape[1]] = shard_scores[i]
        return out

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Rank 0's weights (every rank's are equal), gathered from tensor-parallel ranks, when
        the iteration starts (a publisher that iterates in a thread waits there, not in its
        event loop)."""
        with self._calls:
            whole = self._get([w.weights.remote() for w in self._workers])[0]
        yield from whole.items()

    def save(self, path: str | Path, data_position: dict[str, Any] | None = None) -> None:
        with self._calls:
            self._get([w.save.remote(str(path), data_position) for w in self._workers])

    def load(self, path: str | Path) -> dict[str, Any]:
        with self._calls:
            positions = self._get([w.load.remote(str(path)) for w in self._workers])
            self.version = int(self._get([self._workers[0].version.remote()])[0])
        return dict(positions[0])

    def save_hf(self, path: str | Path) -> None:
        with self._calls:
            self._get([w.save_hf.remote(str(path)) for w in self._workers])

    # -- health --------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise `RanksLost` once a rank died or failed (the group is gone for good)."""
        if self._lost is not None:
            raise RanksLost(self._lost)

    def close(self) -> None:
        """Stop every rank."""
        import ray

        for worker in self._workers:
            ray.kill(worker)
        self._workers = []

    # -- helpers -------------------------------------------------------------------------------

    def _rows(self, batch: TrainBatch) -> list[list[int]]:
        config = self.config
        shared = config.shared_prefix_min_tokens if config.pack_sequences else 0
        return batch.shards(self.data_parallel, shared)

    def _placed(self) -> list[tuple[Any, int]]:
        """Each rank's worker with its data-parallel rank."""
        return list(zip(self._workers, self._data_rank, strict=True))

    def _get(self, refs: list[Any]) -> list[Any]:
        """Every result of `refs` (one call per rank), in order.

        An error every rank raised alike (bad input, refused by all ranks before any
        collective) is raised as it is: the group is intact. A rank that died, or an error of
        some ranks only, ends the group: every rank is stopped (the others would wait for the
        failed one in their next collective) and `RanksLost` is raised."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        self.check_health()
        pending = list(refs)
        failures: list[RayTaskError] = []
        while pending:
            timeout = ALIKE_FAILURE_GRACE_S if failures else None
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                break  # the others went on: they are waiting in a collective
            try:
                ray.get(done[0])
            except RayTaskError as error:
                failures.append(error)
            except RayActorError as error:
                self._end(error)
        if failures and len(failures) == len(refs):
            raise failures[0].as_instanceof_cause()
        if failures:
            self._end(failures[0])
        return list(ray.get(refs))

    def _end(self, error: Exception) -> NoReturn:
        self._lost = f"a trainer rank failed: {error}"
        self.close()
        raise RanksLost(self._lost) from error
