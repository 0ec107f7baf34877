"""Weight-update groups: an engine's side of a trainer's torch.distributed broadcast.

`WeightGroups.init_weights_update_group` joins a trainer's group (gloo; its own store and name,
never the default group) and `update_weights_from_distributed` receives one broadcast bucket on
the calling thread, so generation goes on while the bytes arrive, then hands it to the engine's
scheduler as an update (`EngineCore.update_weights`); only the copy into the model waits for
the drain. A bucket broadcast tensor by tensor to an engine paused in place (`InPlaceReceiver`)
lands straight in the model's tensors instead, with no buffer and no copy; the update that
follows only sets the version and empties the prefix cache.

Also the wire helpers shared with the trainer's side (`omniloop.platform.dcs`): dtype names,
tensors packed in a byte buffer, the group's store, and daemon threads for calls that may block
until a torch.distributed timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from omniloop.errors import ConfigError, EngineError

T = TypeVar("T")

WEIGHT_UPDATE_TIMEOUT = timedelta(seconds=600)
"""How long a weight-update group waits for its peers (joining, or a broadcast to start)."""

FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's `load_format` for a bucket broadcast as one uint8 tensor: each tensor's bytes,
flattened, one after the other in the order of `names`."""


class UpdateWeights(Protocol):
    """`EngineCore.update_weights`: queue named tensors as (a part of) a weight update."""

    def __call__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        abort_all: bool = False,
        partial: bool = False,
    ) -> concurrent.futures.Future[Any]: ...


WeightSpec = tuple[str, torch.dtype, tuple[int, ...]]
"""A tensor of a bucket: its Hugging Face name, dtype and shape."""


class InPlaceReceiver(Protocol):
    """The engine's model, for receiving a bucket straight into its tensors (no buffer, no
    copy) while nothing reads them (`EngineCore`)."""

    def direct_targets(self, specs: Sequence[WeightSpec]) -> list[torch.Tensor] | None:
        """The model's own tensors for `specs` when a bucket may be written into them now;
        None when it must go through a buffer."""
        ...

    def receiving_in_place(self) -> contextlib.AbstractContextManager[None]:
        """Held while a bucket is written into the model: no forward pass runs, and if the
        write fails the engine admits nothing until a complete update."""
        ...


@dataclass
class _UpdateGroup:
    """A joined weight-update group and what receiving into it needs."""

    name: str
    group: dist.ProcessGroup
    store: dist.Store
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a bucket is received: broadcasts of one group must not interleave."""
    buffers: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    """Two receive buffers, used in turn: one bucket arrives while the previous one is copied
    into the model. Reused, so their pages are not faulted in again for every bucket."""
    pending: list[concurrent.futures.Future[Any] | None] = field(
        default_factory=lambda: [None, None]
    )
    """Per buffer, the update that still reads it (its tensors are views of the buffer)."""
    slot: int = 0
    """The buffer the next bucket goes to."""
    parts: list[concurrent.futures.Future[Any]] = field(default_factory=list)
    """Parts queued since the last bucket with a version: that bucket checks they all loaded."""


class WeightGroups:
    """The weight-update groups an engine joined, and the buckets received over them.

    Thread-safe: every method blocks its calling thread (joining until all ranks have joined,
    receiving while the bytes arrive), never the engine's scheduler.
    """

    def __init__(
        self, update_weights: UpdateWeights, in_place: InPlaceReceiver | None = None
    ) -> None:
        self._update_weights = update_weights
        self._in_place = in_place
        self._groups: dict[str, _UpdateGroup] = {}
        self._joining: set[str] = set()
        self._groups_lock = threading.Lock()

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout: timedelta = WEIGHT_UPDATE_TIMEOUT,
    ) -> None:
        """Join the trainer's group `group_name` as rank `rank_offset` (the trainer is rank 0).

        Blocks the calling thread until every rank has joined (or `timeout`); generation goes
        on meanwhile. Raises `ConfigError` for a backend this CPU engine cannot use (only
        gloo) or a name already joined, and `EngineError` if joining fails.
        """
        if backend != "gloo":
            raise ConfigError(
                f"backend {backend!r}: the CPU engine receives weights over gloo only "
                "(NCCL needs GPU tensors; use SGLang on GPUs)"
            )
        if not 0 < rank_offset < world_size:
            raise ConfigError(f"rank_offset {rank_offset} is outside 1..{world_size - 1}")
        with self._groups_lock:
            if group_name in self._groups or group_name in self._joining:
                raise ConfigError(
                    f"weight-update group {group_name!r} exists; destroy it first "
                    "(/destroy_weights_update_group)"
                )
            # Reserve the name while joining, so a second init cannot race this one.
            self._joining.add(group_name)
        try:
            store = weight_update_store(
                master_address,
                master_port,
                rank=rank_offset,
                world_size=world_size,
                timeout=timeout,
            )
            group = new_weight_update_group(
                store,
                backend=backend,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                timeout=timeout,
            )
        except Exception as err:
            with self._groups_lock:
                self._joining.discard(group_name)
            raise EngineError(
                f"could not join weight-update group {group_name!r} at "
                f"{master_address}:{master_port} as rank {rank_offset} of {world_size}: {err}"
            ) from err
        with self._groups_lock:
            self._joining.discard(group_name)
            self._groups[group_name] = _UpdateGroup(group_name, group, store)

    def weight_update_groups(self) -> list[str]:
        """Names of the weight-update groups joined so far."""
        with self._groups_lock:
            return list(self._groups)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave `group_name` (`ConfigError` if unknown); waits for a receive in progress."""
        update_group = self._joined(group_name)
        with update_group.lock:
            with self._groups_lock:
                self._groups.pop(group_name, None)
            dist.destroy_process_group(update_group.group)
            update_group.buffers = [None, None]

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        flattened: bool,
        version: int | None,
        abort_all: bool = False,
    ) -> concurrent.futures.Future[Any]:
        """Receive one bucket broadcast by rank 0 of `group_name`, then queue it as an update.

        Blocks the calling thread while the bytes arrive (`flattened`: one uint8 broadcast of
        every tensor's bytes in order, SGLang's `flattened_bucket`; otherwise one broadcast per
        tensor, in order). The bucket is received before its names and shapes are checked, so
        a bad bucket fails this call (`ConfigError`) without leaving the sender blocked
        half-way through a collective.

        `version` None makes the bucket a partial update (see `update_weights`); its future
        need not be awaited, since the last bucket (the one with a version) first waits for
        every earlier part to load, and if one failed it loads nothing and raises
        `EngineError` (admission stays closed: the weights are incomplete); otherwise it sets
        the version and lets generation resume. Rotary `inv_freq` buffers are skipped, as on
        the disk path.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ConfigError(
                f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: "
                "one of each per tensor"
            )
        update_group = self._joined(group_name)
        specs = [
            (n, parse_dtype(d), tuple(int(x) for x in s))
            for n, d, s in zip(names, dtypes, shapes, strict=True)
        ]
        with update_group.lock:
            slot = -1
            targets = None
            if not flattened and self._in_place is not None:
                targets = self._in_place.direct_targets(specs)
            if targets is not None:
                # Generation is paused in place: the bucket lands in the model itself, and the
                # update that follows only does the bookkeeping (version, prefix cache).
                with self._in_place.receiving_in_place():  # type: ignore[union-attr]
                    self._broadcast_into(update_group, targets)
                named: list[tuple[str, torch.Tensor]] = []
            else:
                slot = update_group.slot
                update_group.slot ^= 1
                pending = update_group.pending[slot]
                if pending is not None:
                    # The tensors of the bucket before last are views of this buffer.
                    concurrent.futures.wait([pending])
                    update_group.pending[slot] = None
                if flattened:
                    named = self._receive_flattened(update_group, slot, specs)
                else:
                    named = self._receive_each(update_group, slot, specs)
                named = [(n, t) for n, t in named if not n.endswith("rotary_emb.inv_freq")]
            if version is not None:
                parts, update_group.parts = update_group.parts, []
                concurrent.futures.wait(parts)
                failed = [f.exception() for f in parts if f.exception() is not None]
                if failed:
                    raise EngineError(
                        f"{len(failed)} earlier bucket(s) of this update failed to load "
                        f"({failed[0]}); no request is admitted until a complete update"
                    )
            future = self._update_weights(
                named, version=version, abort_all=abort_all, partial=version is None
            )
            if slot >= 0:
                update_group.pending[slot] = future
            if version is None:
                update_group.parts.append(future)
            return future

    def _joined(self, group_name: str) -> _UpdateGroup:
        with self._groups_lock:
            update_group = self._groups.get(group_name)
        if update_group is None:
            raise ConfigError(
                f"no weight-update group {group_name!r} (joined: {self.weight_update_groups()}); "
                "call /init_weights_update_group first"
            )
        return update_group

    @staticmethod
    def _buffer(update_group: _UpdateGroup, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of receive buffer `slot`, grown if too small."""
        buffer = update_group.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            update_group.buffers[slot] = None  # free the old one before allocating anew
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            update_group.buffers[slot] = buffer
        return buffer[:nbytes]

    @classmethod
    def _receive_flattened(
        cls,
        update_group: _UpdateGroup,
        slot: int,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    ) -> list[tuple[str, torch.Tensor]]:
        sizes = [_numel(shape) * dtype.itemsize for _, dtype, shape in specs]
        flat = cls._buffer(update_group, slot, sum(sizes))
        dist.broadcast(flat, src=0, group=update_group.group)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return tensor_views(
            flat, [(n, d, s, o) for (n, d, s), o in zip(specs, offsets, strict=True)]
        )

    @staticmethod
    def _broadcast_into(update_group: _UpdateGroup, targets: Sequence[torch.Tensor]) -> None:
        works = [dist.broadcast(t, src=0, group=update_group.group, async_op=True) for t in targets]
        for work in works:
            if work is not None:
                work.wait()

    @classmethod
    def _receive_each(
        cls,
        update_group: _UpdateGroup,
        slot: int,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    ) -> list[tuple[str, torch.Tensor]]:
        # Each tensor gets a 64-byte aligned view of the buffer: any dtype can view it.
        sizes = [_numel(shape) * dtype.itemsize for _, dtype, shape in specs]
        starts = []
        end = 0
        for size in sizes:
            starts.append(end)
            end += -(-size // 64) * 64
        buffer = cls._buffer(update_group, slot, end)
        named = [
            (name, buffer[start : start + size].view(dtype).view(shape))
            for (name, dtype, shape), start, size in zip(specs, starts, sizes, strict=True)
        ]
        works = [
            dist.broadcast(t, src=0, group=update_group.group, async_op=True) for _, t in named
        ]
        for work in works:
            if work is not None:
                work.wait()
        return named


def tensor_views(
    flat: torch.Tensor, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...], int]]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors (name, dtype, shape, byte offset) packed in the uint8 tensor `flat`, as
    views of it (a copy where the offset is not aligned to the dtype). `ConfigError` if one
    reaches past the end."""
    named = []
    for name, dtype, shape, offset in specs:
        size = _numel(shape) * dtype.itemsize
        if offset + size > flat.numel():
            raise ConfigError(
                f"tensor {name!r} ({dtype}, {list(shape)}) at byte {offset} ends past the "
                f"bucket's {flat.numel()} bytes"
            )
        chunk = flat[offset : offset + size]
        if offset % dtype.itemsize:
            chunk = chunk.clone()  # a dtype view needs an aligned start
        named.append((name, chunk.view(dtype).view(shape)))
    return named


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


async def in_daemon_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run a blocking call on a new daemon thread and await its result.

    For calls that can block until a torch.distributed timeout (joining a group, a broadcast
    whose peer never comes): unlike `asyncio.to_thread`, a thread left behind by a caller
    that failed or was cancelled holds up neither the event loop's shutdown nor the
    interpreter's exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(*args, **kwargs), None)
        except BaseException as err:
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name=f"omniloop-{fn.__name__}", daemon=True).start()
    return await future


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype SGLang's `dtypes` field names: `float32`, `bfloat16` (`torch.` allowed)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of `dtype` (`torch.float32` -> `float32`)."""
    return str(dtype).removeprefix("torch.")


def weight_update_store(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta = WEIGHT_UPDATE_TIMEOUT,
) -> dist.TCPStore:
    """The rendezvous store of a weight-update group; rank 0 serves it.

    Rank 0 may pass port 0 to bind a free port (read it back from `.port`); it does not wait
    for the others here, so it can tell them the port first. The store is the one
    `torch.distributed.rendezvous("tcp://...")` would build, which is what SGLang's
    `init_weights_update_group` connects to.
    """
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )


def new_weight_update_group(
    store: dist.Store,
    *,
    backend: str,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta = WEIGHT_UPDATE_TIMEOUT,
) -> dist.ProcessGroup:
    """Join the process group `group_name` over `store`; blocks until all ranks have joined.

    The group is independent of the default process group (which need not exist, and is left
    alone if it does) and is laid out as SGLang's `init_custom_process_group` lays out its
    own (store keys prefixed by the group name), so a trainer can broadcast to real SGLang
    engines and to omniloop's engine alike. Use it with `dist.broadcast(..., group=group)`
    (ranks in the group are the global ranks), and end it with `dist.destroy_process_group`.

    torch has no public constructor for a second "world" group, so this goes through
    `torch.distributed.distributed_c10d._new_process_group_helper`, as SGLang, slime and
    OpenRLHF do. With NCCL, create the process's default group (if any) without `device_id`:
    torch would otherwise try to split this group's communicator from the default one, whose
    ranks the engines are not.
    """
    from torch.distributed import distributed_c10d as c10d

    helper: Any = c10d._new_process_group_helper
    # The options keyword was renamed across torch releases (pg_options -> backend_options).
    params = inspect.signature(helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    assert isinstance(group, dist.ProcessGroup)
    return group
