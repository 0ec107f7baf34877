"""The `distributed` backend: a torch.distributed broadcast in buckets with SGLang's protocol
(`/init_weights_update_group`, `/update_weights_from_distributed`); gloo on CPU, NCCL on GPU,
the same code."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Iterable, Sequence
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from omniloop.errors import ConfigError
from omniloop.inference.client import EngineClient
from omniloop.inference.weight_groups import (
    dtype_name,
    in_daemon_thread,
    new_weight_update_group,
    weight_update_store,
)
from omniloop.platform.dcs.base import (
    all_or_fail,
    engines_paused,
    materialize,
    nbytes_of,
    pack_into,
    plan_buckets,
    tagged,
)
from omniloop.platform.dcs.config import UpdateMode

log = logging.getLogger(__name__)


class DistributedWeightSync:
    """Publishes by torch.distributed broadcast from this process (rank 0) to every engine.

    The process group is built on the first `publish` and kept for the next ones; its members
    are fixed, so a run that adds or removes engines makes a new sync (and closes the old).
    Memory: two bucket-sized packing buffers here (on the GPU for NCCL) and, on omniloop's
    engine, two bucket-sized receive buffers, all kept between publishes. Not for use from
    several event loops; concurrent `publish` calls are serialized.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        backend: Literal["gloo", "nccl"] = "gloo",
        bucket_mb: float = 256.0,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str | None = None,
        flattened: bool = False,
        ranks_per_engine: int = 1,
        timeout_s: float = 600.0,
        update_mode: UpdateMode = "in_place",
    ) -> None:
        if not engine_urls:
            raise ValueError("no engines to publish to")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        self._clients = [EngineClient(url, timeout=timeout_s) for url in engine_urls]
        self._update_mode = update_mode
        self.backend = backend
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.master_addr = master_addr
        self._port = master_port
        self._base_name = group_name or f"omniloop-weights-{uuid.uuid4().hex[:12]}"
        self.flattened = flattened
        self._ranks_per_engine = ranks_per_engine
        self._timeout = timedelta(seconds=timeout_s)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self._group_name = self._base_name
        self._groups_built = 0
        self._staging: list[Tensor | None] = [None, None]
        """Two packing buffers of flattened buckets, used in turn: the next bucket is packed
        while the current one is on the wire. Reused (no page faults, no allocator churn)."""
        self._lock = asyncio.Lock()

    @property
    def group_name(self) -> str:
        """The name of the current (or next) process group."""
        return self._group_name

    @property
    def world_size(self) -> int:
        return 1 + len(self._clients) * self._ranks_per_engine

    async def _forget_group(self) -> None:
        """Best effort: have the engines drop the failed group (a blocked receive in it ends
        at the timeout, and only then can an engine let go of it)."""
        calls = [c.destroy_weights_update_group(self._group_name) for c in self._clients]
        try:
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=5.0)
        except TimeoutError:
            log.warning("engines still hold weight-update group %r", self._group_name)

    async def _connect(self) -> None:
        """Build the process group: rank 0 here, each engine joining over HTTP meanwhile."""
        if self._groups_built:
            # A group that failed may still have a broadcast blocked in it: start afresh.
            await self._forget_group()
            self._group_name = f"{self._base_name}-{self._groups_built}"
        store = await asyncio.to_thread(
            weight_update_store,
            self.master_addr,
            self._port,
            rank=0,
            world_size=self.world_size,
            timeout=self._timeout,
        )
        port = store.port
        join = asyncio.ensure_future(
            in_daemon_thread(
                new_weight_update_group,
                store,
                backend=self.backend,
                rank=0,
                world_size=self.world_size,
                group_name=self._group_name,
                timeout=self._timeout,
            )
        )
        inits = [
            tagged(
                c,
                c.init_weights_update_group(
                    self.master_addr,
                    port,
                    1 + i * self._ranks_per_engine,
                    self.world_size,
                    group_name=self._group_name,
                    backend=self.backend,
                ),
            )
            for i, c in enumerate(self._clients)
        ]
        self._groups_built += 1
        group, *_ = await all_or_fail(
            [join, *inits], f"building weight-update group {self._group_name!r}"
        )
        assert isinstance(group, dist.ProcessGroup)
        self._group, self._store = group, store

    def _pack(self, bucket: list[tuple[str, Tensor]], slot: int) -> Tensor:
        """The bucket's bytes as one contiguous uint8 tensor on the broadcast device."""
        if len(bucket) == 1:
            tensor = bucket[0][1].to(self._device)
            if tensor.is_contiguous():
                return tensor.reshape(-1).view(torch.uint8)  # no copy
        total = nbytes_of(bucket)
        staging = self._staging[slot]
        if staging is None or staging.numel() < total:
            self._staging[slot] = None  # free the old buffer before allocating the larger one
            staging = torch.empty(total, dtype=torch.uint8, device=self._device)
            self._staging[slot] = staging
        flat = staging[:total]
        pack_into(bucket, flat)
        return flat

    def _broadcast(self, bucket: list[tuple[str, Tensor]], flat: Tensor | None) -> float:
        """Send one bucket as rank 0 (blocking; runs on a worker thread); returns seconds."""
        start = time.perf_counter()
        group = self._group
        assert group is not None
        if flat is not None:
            dist.broadcast(flat, src=0, group=group)
        else:
            works = [
                dist.broadcast(t.to(self._device).contiguous(), src=0, group=group, async_op=True)
                for _, t in bucket
            ]
            for work in works:
                if work is not None:
                    work.wait()
        return time.perf_counter() - start

    async def _send_bucket(
        self,
        bucket: list[tuple[str, Tensor]],
        packing: Awaitable[Tensor] | None,
        version: int | None,
    ) -> float:
        """Announce and broadcast one bucket (`packing`: its flattened bytes, still being
        packed); returns the seconds the broadcast took."""
        names = [name for name, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        posts = [
            tagged(
                c,
                c.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    group_name=self._group_name,
                    weight_version=version,
                    flattened=self.flattened,
                ),
            )
            for c in self._clients
        ]

        async def broadcast() -> float:
            # The engines are told first: they wait in the broadcast while the bytes are packed.
            flat = await packing if packing is not None else None
            return await in_daemon_thread(self._broadcast, bucket, flat)

        send = asyncio.ensure_future(broadcast())
        seconds, *_ = await all_or_fail([send, *posts], f"sending bucket {names[0]}...")
        assert isinstance(seconds, float)
        return seconds

    async def publish(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int
    ) -> dict[str, float]:
        """Broadcast the weights bucket by bucket; the last bucket sets `version`."""
        async with self._lock:
            started = time.perf_counter()
            named = materialize(named_weights)
            connect = 0.0
            if self._group is None:
                await self._connect()
                connect = time.perf_counter() - started
            buckets = plan_buckets(named, self.bucket_bytes)

            packed = 0.0

            def pack(i: int) -> Tensor:
                nonlocal packed
                start = time.perf_counter()
                flat = self._pack(buckets[i], i % 2)
                packed += time.perf_counter() - start
                return flat

            async def pack_after(previous: asyncio.Future[Tensor], i: int) -> Tensor:
                # One packing at a time: the one the wire waits for gets the CPU.
                await asyncio.wait([previous])
                return await asyncio.to_thread(pack, i)

            packing: asyncio.Future[Tensor] | None = None
            broadcast = 0.0
            try:
                if self.flattened:
                    packing = asyncio.ensure_future(asyncio.to_thread(pack, 0))
                async with engines_paused(
                    self._clients, self._update_mode, failed_leaves_paused=True
                ) as paused:
                    for i, bucket in enumerate(buckets):
                        current, packing = packing, None
                        if current is not None and i + 1 < len(buckets):
                            # Pack the next bucket into the other buffer while this one travels.
                            packing = asyncio.ensure_future(pack_after(current, i + 1))
                        last = i == len(buckets) - 1
                        broadcast += await self._send_bucket(
                            bucket, current, version if last else None
                        )
            except BaseException:
                if packing is not None:
                    packing.cancel()
                # Some rank may be blocked in this group's broadcast: never reuse it.
                self._group = None
                raise
            seconds = time.perf_counter() - started
            nbytes = nbytes_of(named)
            return {
                "weight_sync/seconds": seconds,
                "weight_sync/connect_seconds": connect,
                "weight_sync/pack_seconds": packed,
                "weight_sync/broadcast_seconds": broadcast,
                "weight_sync/bytes": float(nbytes),
                "weight_sync/gbps": nbytes / max(seconds - connect, 1e-9) / 1e9,
                "weight_sync/buckets": float(len(buckets)),
                "weight_sync/engines": float(len(self._clients)),
                "weight_sync/version": float(version),
                **paused,
            }

    async def close(self) -> None:
        """Have the engines leave the group, leave it here, and close the HTTP clients."""
        async with self._lock:
            group, self._group = self._group, None
            if group is None and self._groups_built:
                await self._forget_group()  # the last group failed: engines may still hold it
            if group is not None:
                results = await asyncio.gather(
                    *(c.destroy_weights_update_group(self._group_name) for c in self._clients),
                    return_exceptions=True,
                )
                for client, result in zip(self._clients, results, strict=True):
                    if isinstance(result, BaseException):
                        log.warning(
                            "engine %s kept its weight-update group: %s", client.base_url, result
                        )
                await asyncio.to_thread(dist.destroy_process_group, group)
            self._store = None
            self._staging = [None, None]
            for client in self._clients:
                await client.aclose()
