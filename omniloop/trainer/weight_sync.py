"""Weight sync: publish the trainer's weights to every inference engine.

Two implementations of one `WeightSync` protocol, chosen by `WeightSyncConfig.method`:

- `disk` (`DiskWeightSync`): write a Hugging Face folder (the model's config and tokenizer files
  plus one safetensors file) under `staging_dir`, then `/update_weights_from_disk` on every
  engine at once. The engines must see `staging_dir` at the same path (one host, or a shared
  filesystem).
- `distributed` (`DistributedWeightSync`): a torch.distributed broadcast in buckets, with
  SGLang's protocol. On the first publish the trainer creates a process group of its own (its
  own store and name; a default group, if the process has one, is left alone) in which it is
  rank 0, and asks each engine to join it (`/init_weights_update_group`, rank 1..n). Then per
  bucket it announces names, dtypes and shapes to every engine
  (`/update_weights_from_distributed`) while it broadcasts the bytes. gloo on CPU, NCCL on GPU:
  the same code, the backend string comes from the config (NCCL buckets are staged on the GPU).

Contract of `publish(named_weights, version)`, both methods: when it returns, every engine holds
exactly those weights and reports `version`, and no request was aborted. How an update meets
the requests running at that moment is `update_mode`:

- `in_place` (the default): every engine is paused between two decode steps
  (`/pause_generation` with mode `in_place`, which keeps requests, never SGLang's aborting
  default) while the weights are loaded, then continued (`/continue_generation`, also when the
  publish fails). Running requests go on under the new weights; each token records the version
  that sampled it (omniloop's engine reports it per token), and no token is sampled by a mix.
  Generation stalls for the load alone (the transfer, for `distributed`), not for the slowest
  running request.
- `drain`: the engines let running requests finish under the old weights before they load
  (omniloop's engine admits nothing meanwhile, and between the first and the last bucket), so
  every response has one version. On SGLang, drain means pausing generation around a bucketed
  update yourself.

Failures raise `WeightSyncError` naming the engine. An engine left with part of a bucketed
update keeps admitting nothing (rather than sample with mixed weights) until a later publish
succeeds; in `in_place` mode it is also left paused. After a failed bucket the process group
is abandoned and the next publish builds a new one (under a new name): a blocked broadcast
cannot be cancelled, it ends at `timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor

from omniloop.config import StrictModel
from omniloop.errors import ConfigError, EngineError
from omniloop.inference.client import EngineClient
from omniloop.inference.core import (
    dtype_name,
    in_daemon_thread,
    new_weight_update_group,
    weight_update_store,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

WEIGHTS_FILE = "model.safetensors"
STAGED_PREFIX = "weights-v"
# Files of a model folder that are weights (or training state), not configuration.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")
_NOT_CONFIG = ("trainer_state.json",)


UpdateMode = Literal["in_place", "drain"]
"""How a weight update meets running requests (module docstring)."""


class WeightSyncError(EngineError):
    """Publishing weights to an engine failed; the message names the engine and the step."""


class WeightSyncConfig(StrictModel):
    """How the trainer's weights reach the inference engines."""

    method: Literal["disk", "distributed"] = "distributed"
    """`distributed`: torch.distributed broadcast in buckets (engines must reach
    `master_addr`); `disk`: a safetensors folder the engines load (needs a shared path)."""
    bucket_mb: float = Field(default=256.0, gt=0)
    """Distributed: most MiB per bucket (one HTTP call and one broadcast each); a tensor that
    is larger travels alone."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Distributed: `gloo` (CPU tensors; omniloop's CPU engine) or `nccl` (SGLang on GPUs)."""
    flattened: bool = True
    """Distributed: send each bucket as one uint8 broadcast (SGLang's `flattened_bucket`
    load format); false: one broadcast per tensor, for SGLang builds without that format."""
    master_addr: str = "127.0.0.1"
    """Distributed: the trainer's address as the engines reach it (rank 0 serves the store)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Distributed: the store's TCP port; 0 picks a free one."""
    group_name: str | None = None
    """Distributed: the process group's name; None: a unique one per run."""
    ranks_per_engine: int = Field(default=1, ge=1)
    """Distributed: ranks each engine joins with (SGLang's tensor-parallel size)."""
    staging_dir: str | None = None
    """Disk: where weight folders are written (the engines read them at the same path);
    None: a temporary folder, removed on `close`."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one engine call (a weight update first waits for running requests)
    and for the process group's peers."""
    update_mode: UpdateMode = "in_place"
    """`in_place`: engines pause between decode steps while the weights load, and running
    requests go on under the new weights (a token records the version that sampled it).
    `drain`: running requests finish under the old weights first (one version per response;
    generation waits for the slowest)."""


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


def make_weight_sync(
    config: WeightSyncConfig,
    engine_urls: Sequence[str],
    *,
    model_dir: str | Path | None = None,
) -> WeightSync:
    """The `WeightSync` that `config.method` names, for the engines at `engine_urls`.

    `model_dir` (disk only): the model folder whose config and tokenizer files go with the
    weights; None: the folder the first engine reports in `/get_model_info`.
    """
    if config.method == "disk":
        return DiskWeightSync(
            engine_urls,
            config.staging_dir,
            model_dir=model_dir,
            timeout_s=config.timeout_s,
            update_mode=config.update_mode,
        )
    return DistributedWeightSync(
        engine_urls,
        backend=config.backend,
        bucket_mb=config.bucket_mb,
        master_addr=config.master_addr,
        master_port=config.master_port,
        group_name=config.group_name,
        flattened=config.flattened,
        ranks_per_engine=config.ranks_per_engine,
        timeout_s=config.timeout_s,
        update_mode=config.update_mode,
    )


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
    await _all_or_fail(
        [_tagged(c, c.pause_generation("in_place")) for c in clients],
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


def _nbytes(named: Iterable[tuple[str, Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _materialize(named_weights: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    named = [(name, tensor.detach()) for name, tensor in named_weights]
    if not named:
        raise ValueError("no weights to publish")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("a weight name appears twice")
    return named


async def _all_or_fail(tasks: Sequence[asyncio.Future[Any]], what: str) -> list[Any]:
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


def _tagged(client: EngineClient, call: Awaitable[T]) -> asyncio.Task[T]:
    """A task whose error names the engine it came from."""

    async def run() -> T:
        try:
            return await call
        except EngineError as err:
            raise WeightSyncError(f"engine {client.base_url}: {err}") from err

    return asyncio.ensure_future(run())


# -- disk ------------------------------------------------------------------------------------


def write_weights_folder(
    named: Sequence[tuple[str, Tensor]], config_dir: Path, target: Path
) -> None:
    """Write `target` as a model folder: `config_dir`'s non-weight files and the weights.

    Atomic: written aside, then renamed over `target` (a folder of that name is replaced).
    """
    import safetensors.torch

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        for item in config_dir.iterdir():
            if (
                item.is_file()
                and not item.name.endswith(_WEIGHT_SUFFIXES)
                and item.name not in _NOT_CONFIG
            ):
                shutil.copy2(item, tmp / item.name)
        state: dict[str, Tensor] = {}
        seen: set[int] = set()
        for name, tensor in named:
            cpu = tensor.to("cpu").contiguous()
            storage = cpu.untyped_storage().data_ptr()
            # safetensors refuses tensors that share memory (tied weights given twice).
            state[name] = cpu.clone() if storage in seen else cpu
            seen.add(storage)
        safetensors.torch.save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class DiskWeightSync:
    """Publishes through a model folder on disk and `/update_weights_from_disk`.

    Each publish writes `staging_dir/weights-v{version}` and removes the folders of earlier
    versions once every engine has loaded the new one.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        staging_dir: str | Path | None = None,
        *,
        model_dir: str | Path | None = None,
        timeout_s: float = 600.0,
        update_mode: UpdateMode = "in_place",
    ) -> None:
        if not engine_urls:
            raise ValueError("no engines to publish to")
        self._clients = [EngineClient(url, timeout=timeout_s) for url in engine_urls]
        self._update_mode = update_mode
        self._own_staging = staging_dir is None
        self.staging_dir = Path(
            tempfile.mkdtemp(prefix="omniloop-weights-") if staging_dir is None else staging_dir
        )
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._lock = asyncio.Lock()

    async def _config_dir(self) -> Path:
        if self._model_dir is None:
            info = await self._clients[0].get_model_info()
            folder = Path(info.model_path)
            if not (folder / "config.json").is_file():
                raise WeightSyncError(
                    f"engine {self._clients[0].base_url} serves {folder}, which has no "
                    "config.json here; pass model_dir (the model's folder) to the disk sync"
                )
            self._model_dir = folder
        return self._model_dir

    async def publish(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int
    ) -> dict[str, float]:
        """Write the weights as `weights-v{version}` and have every engine load them."""
        async with self._lock:
            started = time.perf_counter()
            named = _materialize(named_weights)
            target = self.staging_dir / f"{STAGED_PREFIX}{version}"
            config_dir = await self._config_dir()
            try:
                await asyncio.to_thread(write_weights_folder, named, config_dir, target)
            except OSError as err:
                raise WeightSyncError(f"writing weights v{version} to {target}: {err}") from err
            saved = time.perf_counter()
            # A failed load from disk changed nothing: generation goes on.
            async with engines_paused(
                self._clients, self._update_mode, failed_leaves_paused=False
            ) as paused:
                await _all_or_fail(
                    [
                        _tagged(c, c.update_weights_from_disk(str(target), weight_version=version))
                        for c in self._clients
                    ],
                    f"loading weights v{version} from {target}",
                )
            loaded = time.perf_counter()
            for old in self.staging_dir.glob(f"{STAGED_PREFIX}*"):
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
            nbytes = _nbytes(named)
            seconds = loaded - started
            return {
                "weight_sync/seconds": seconds,
                "weight_sync/save_seconds": saved - started,
                "weight_sync/load_seconds": loaded - saved,
                "weight_sync/bytes": float(nbytes),
                "weight_sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
                "weight_sync/engines": float(len(self._clients)),
                "weight_sync/version": float(version),
                **paused,
            }

    async def close(self) -> None:
        """Close the HTTP clients; remove the staging folder if this object made it."""
        async with self._lock:
            for client in self._clients:
                await client.aclose()
            if self._own_staging:
                shutil.rmtree(self.staging_dir, ignore_errors=True)


# -- distributed -----------------------------------------------------------------------------


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
        flattened: bool = True,
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
            _tagged(
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
        group, *_ = await _all_or_fail(
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
        total = _nbytes(bucket)
        staging = self._staging[slot]
        if staging is None or staging.numel() < total:
            self._staging[slot] = None  # free the old buffer before allocating the larger one
            staging = torch.empty(total, dtype=torch.uint8, device=self._device)
            self._staging[slot] = staging
        flat = staging[:total]
        offset = 0
        for _, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            src = tensor.contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + nbytes].copy_(src)
            offset += nbytes
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
            _tagged(
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
        seconds, *_ = await _all_or_fail([send, *posts], f"sending bucket {names[0]}...")
        assert isinstance(seconds, float)
        return seconds

    async def publish(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int
    ) -> dict[str, float]:
        """Broadcast the weights bucket by bucket; the last bucket sets `version`."""
        async with self._lock:
            started = time.perf_counter()
            named = _materialize(named_weights)
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
            nbytes = _nbytes(named)
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
