"""What every weight-sync backend shares: the protocol, its error, pausing the engines around
an update, bucket planning, and running one call per engine with errors that name it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from omniloop.errors import EngineError
from omniloop.inference.client import EngineClient
from omniloop.platform.dcs.config import UpdateMode

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

T = TypeVar("T")


class WeightSyncError(EngineError):
    """Publishing weights to an engine failed; the message names the engine and the step."""


class WeightSync(Protocol):
    """Publishes weights to every engine of a run (see the module docstring's contract)."""

    async def publish(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int
    ) -> dict[str, float]:
        """Make every engine serve `named_weights` (Hugging Face names, each tied tensor once)
        as `version`; returns `weight_sync/...` metrics. Raises `WeightSyncError`."""
        ...

    async def close(self) -> None:
        """Release the engines' side (process group) and this side's resources."""
        ...


@contextlib.asynccontextmanager
async def engines_paused(
    clients: Sequence[EngineClient], mode: UpdateMode, *, failed_leaves_paused: bool
) -> AsyncIterator[dict[str, float]]:
    """With `in_place`, pause every engine (keeping its requests) for the block and continue
    them after it; with `drain`, do nothing. If the block fails, the engines are continued
    unless `failed_leaves_paused` (a failed bucketed update may have left a mix of old and new
    weights: nothing is sampled until a later publish completes). Yields a dict that holds,
    after a block that completed, `weight_sync/paused_seconds`: how long generation stood
    still."""
    stats: dict[str, float] = {}
    if mode == "drain":
        yield stats
        return
    await all_or_fail(
        [tagged(c, c.pause_generation("in_place")) for c in clients],
        "pausing generation for a weight update",
    )
    paused = time.perf_counter()
    try:
        yield stats
    except BaseException:
        if not failed_leaves_paused:
            await _continue(clients)
        raise
    await _continue(clients)
    stats["weight_sync/paused_seconds"] = time.perf_counter() - paused


async def _continue(clients: Sequence[EngineClient]) -> None:
    results = await asyncio.gather(
        *(c.continue_generation() for c in clients), return_exceptions=True
    )
    for client, result in zip(clients, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("engine %s did not continue generation: %s", client.base_url, result)


def plan_buckets(
    named: Sequence[tuple[str, Tensor]], bucket_bytes: int
) -> list[list[tuple[str, Tensor]]]:
    """Split `named` in order into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[tuple[str, Tensor]]] = []
    current: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def nbytes_of(named: Iterable[tuple[str, Tensor]]) -> int:
    """The bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for _, t in named)


def pack_into(bucket: Sequence[tuple[str, Tensor]], flat: Tensor) -> None:
    """Copy the bucket's tensors' bytes, in order and back to back, into the uint8 `flat`
    (exactly `nbytes_of(bucket)` long)."""
    import torch

    offset = 0
    for _, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        src = tensor.contiguous().reshape(-1).view(torch.uint8)
        flat[offset : offset + nbytes].copy_(src)
        offset += nbytes


def materialize(named_weights: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    named = [(name, tensor.detach()) for name, tensor in named_weights]
    if not named:
        raise ValueError("no weights to publish")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("a weight name appears twice")
    return named


async def all_or_fail(tasks: Sequence[asyncio.Future[Any]], what: str) -> list[Any]:
    """Await every task; on the first failure cancel the rest and raise `WeightSyncError`.

    Waiting for the rest would be wrong: a broadcast whose receiver failed never ends.
    """
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if errors:
        for task in pending:
            task.cancel()
        raise WeightSyncError(f"{what}: {errors[0]}") from errors[0]
    return [t.result() for t in tasks]


def tagged(client: EngineClient, call: Awaitable[T]) -> asyncio.Task[T]:
    """A task whose error names the engine it came from."""

    async def run() -> T:
        try:
            return await call
        except EngineError as err:
            raise WeightSyncError(f"engine {client.base_url}: {err}") from err

    return asyncio.ensure_future(run())
