"""Data-parallel ranks of one trainer.

Each rank holds the whole policy (or, under megatron's tensor parallelism, the same shard as the
other ranks of its data-parallel group), trains on its own rows of a step, and the ranks' gradients
are summed before the optimizer step. Every rank normalizes its loss by the token and sequence
counts of the whole step (summed over the ranks first), so the summed gradient is the gradient
of the whole batch and every rank takes the same optimizer step: the ranks stay equal without
ever exchanging weights, and N ranks train as one rank given all the rows.

With `trainer.distributed_optimizer`, the optimizer's state is sharded over the ranks (ZeRO
stage 1, torch's `ZeroRedundancyOptimizer`): each rank keeps AdamW's state for its share of
the parameters (whole tensors, shares balanced by size), updates only those, and broadcasts
them to the others, so each rank holds about 1/N of the state when no tensor dominates the
model. The step is the same.

`shard_rows` splits a step's rows among the ranks: disjoint, each row exactly once, balanced by
tokens. `RankGroup` is what the trainer needs of the group: `Alone` for one process,
`DistributedGroup` over a `torch.distributed` process group (gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor, nn

T = TypeVar("T")

# Gradients travel in flat buckets of at most this many bytes: one collective per bucket
# instead of one per parameter, without a second copy of every gradient at once.
BUCKET_BYTES = 64 * 2**20


def shard_rows(tokens: Sequence[int], ranks: int) -> list[list[int]]:
    """The rows (by index into `tokens`, each row's token count) of each of `ranks` ranks.

    Every row is in exactly one shard; rows go longest first to the rank with the fewest tokens
    so far (ties to the lower rank), so no rank holds more than the lightest one plus one row's
    tokens. Deterministic: every rank computes the same split. A shard is in row order and may
    be empty (fewer rows than ranks).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    loads = [0] * ranks
    shards: list[list[int]] = [[] for _ in range(ranks)]
    for row in sorted(range(len(tokens)), key=lambda r: (-tokens[r], r)):
        rank = min(range(ranks), key=lambda k: (loads[k], k))
        shards[rank].append(row)
        loads[rank] += tokens[row]
    return [sorted(shard) for shard in shards]


class RankGroup(Protocol):
    """The collectives a data-parallel trainer step needs. Every rank of the group calls each
    method in the same order (a rank that skips one leaves the others waiting)."""

    @property
    def rank(self) -> int:
        """This process's rank in the group, from 0."""
        ...

    @property
    def size(self) -> int:
        """How many ranks the group has."""
        ...

    def sum(self, values: Tensor) -> Tensor:
        """`values` (a CPU tensor) summed elementwise over the ranks."""
        ...

    def sum_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        """Replace each parameter's gradient by the sum of the ranks' gradients; a parameter
        that has none on this rank counts as zeros."""
        ...

    def gather(self, value: T) -> list[T]:
        """Every rank's `value` (picklable), in rank order."""
        ...

    def adamw(
        self, params: list[nn.Parameter], *, sharded: bool, **settings: Any
    ) -> torch.optim.Optimizer:
        """AdamW over `params` with `settings`; `sharded`: its state sharded over the ranks
        (module docstring)."""
        ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The whole state of an optimizer `adamw` made, on rank 0 (None on the others)."""
        ...


class Alone:
    """The group of one process: every collective is the identity."""

    rank = 0
    size = 1

    def adamw(
        self, params: list[nn.Parameter], *, sharded: bool, **settings: Any
    ) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **settings)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        return optimizer.state_dict()

    def sum(self, values: Tensor) -> Tensor:
        return values

    def sum_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        return None

    def gather(self, value: T) -> list[T]:
        return [value]


class DistributedGroup:
    """The ranks of a `torch.distributed` process group (`None`: the default, whole world).
    The process group must be initialized before this is built."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "a data-parallel group needs torch.distributed initialized first "
                "(torch.distributed.init_process_group)"
            )
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def sum(self, values: Tensor) -> Tensor:
        out = values.clone()
        self._dist.all_reduce(out, group=self._group)
        return out

    def sum_gradients(self, parameters: Sequence[nn.Parameter]) -> None:
        bucket: list[Tensor] = []
        size = 0
        for param in parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            if bucket and (
                size + grad.numel() * grad.element_size() > BUCKET_BYTES
                or grad.dtype != bucket[0].dtype
                or grad.device != bucket[0].device
            ):
                self._sum_bucket(bucket)
                bucket, size = [], 0
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
        if bucket:
            self._sum_bucket(bucket)

    def _sum_bucket(self, grads: list[Tensor]) -> None:
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        self._dist.all_reduce(flat, group=self._group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def gather(self, value: T) -> list[T]:
        out: list[T | None] = [None] * self.size
        self._dist.all_gather_object(out, value, group=self._group)
        return cast(list[T], out)

    def adamw(
        self, params: list[nn.Parameter], *, sharded: bool, **settings: Any
    ) -> torch.optim.Optimizer:
        if not sharded or self.size == 1:
            return torch.optim.AdamW(params, **settings)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, process_group=self._group, **settings
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)  # every rank sends its share to rank 0
        return optimizer.state_dict() if self.rank == 0 else None
