"""`DataPlane`: the `DataBus` on TransferQueue (the PyPI package `transferqueue`).

What TransferQueue provides, and this module uses as is:

- a controller actor that tracks, per partition, which rows exist, which fields of each row were
  produced and which rows each consumer task has taken (`get_meta(mode="fetch")` atomically
  picks ready rows and marks them consumed for that task, so readers sharing a task name never
  get the same row);
- storage-unit actors that hold the data, written and read by field and by row;
- a key-value layer that maps a user key to one row of a partition: writing an existing key
  overwrites that row, so keying rows by trajectory id makes writes idempotent.

What this module adds, because TransferQueue does not have it:

- the schema: DESIGN.md §2 fields, encoded as jagged tensors, scalars or JSON (`base.py`);
- a "closed" state per partition (a marker key in a side partition `step_k.closed`), so that a
  reader knows when a step is complete and can hand out the last, shorter micro-batch; the
  markers of forgotten steps give way to one mark, the step before which every step is closed
  (a partition `forgotten_before.N`);
- refusal of writes of one field for ids that have no row, and of new rollout rows for a
  closed partition; deduplication of ids repeated inside one write (TransferQueue would give
  each copy its own row);
- exactly-once consumption across restarts: TransferQueue marks rows consumed when they are
  fetched, before the consumer has trained on them, and its marks are not part of the trainer's
  checkpoint. The reader keeps its own set of ids handed out per consumer and partition;
  `restore_consumed` reinstates a checkpointed set and resets TransferQueue's marks for that
  consumer, so rows fetched after the checkpoint come back and rows before it never do. The
  ids of a cleared step are dropped (by `clear` in the clearing process, at the next `reread`
  in a stage's), so the set and the checkpoint hold the steps still in the queue, not the run;
- waiting: TransferQueue's blocking fetch sleeps inside the controller (5 s per attempt, which
  stalls every other client), so the controller runs in polling mode and the reader waits on
  its side with a capped exponential backoff; TransferQueue has no push notification;
- lifecycle: starting a private Ray instance (logical CPUs, temp dir, no usage stats) and the
  queue when none is running, attaching to them otherwise, and tearing down only what this
  instance started;
- keeping the caller's `torch.get_num_threads()`: TransferQueue resets it to its import-time
  value after every put and get.

Not covered: several readers sharing one consumer name across a restore (their consumed sets
must be merged into one state first), and a row fetched from TransferQueue whose data read then
fails (it is marked consumed there and comes back only after a `restore_consumed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import psutil

# TransferQueue reads this at import time and warns on every put and get when it exceeds the
# physical core count (its default is 8). Only a default: an explicit setting wins.
os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))

import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf
from pydantic import Field, model_validator
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack
from transfer_queue.client import AsyncTransferQueueClient

from omniloop.config import StrictModel
from omniloop.platform.data.base import (
    FIELDS,
    ROLLOUT_FIELDS,
    DataPlaneError,
    DataPlaneTimeoutError,
    FieldKind,
    FieldSpec,
    MicroBatch,
    PartitionClosedError,
    Row,
    UnknownRowsError,
    decode_json,
    encode_json,
    encode_scalars,
    encode_tokens,
    field_spec,
    partition_id,
    rollout_values,
)
from omniloop.trajectory import Trajectory

logger = logging.getLogger(__name__)

_CONTROLLER_NAME = "TransferQueueController"
_CONTROLLER_NAMESPACE = "transfer_queue"
_CLOSED_KEY = "closed"
_CONTROLLER_READY_TIMEOUT_S = 60.0
_STATE_FORMAT = 1


def _closed_partition(partition: str) -> str:
    # A side partition, so the marker is never a row of the step and needs no filtering.
    return f"{partition}.closed"


_FORGOTTEN_PREFIX = "forgotten_before."


def _forgotten_marks(partitions: Iterable[str]) -> dict[int, str]:
    """The marks among `partitions` of a step before which every step was forgotten (one,
    but for a moment while it moves): partition name by step."""
    marks = {}
    for name in partitions:
        if name.startswith(_FORGOTTEN_PREFIX) and name[len(_FORGOTTEN_PREFIX) :].isdigit():
            marks[int(name[len(_FORGOTTEN_PREFIX) :])] = name
    return marks


def _forgotten_before(partitions: Iterable[str]) -> int:
    """The step before which every step was forgotten and is closed (0: none was)."""
    return max(_forgotten_marks(partitions), default=0)


def _marked_steps(partitions: Iterable[str]) -> list[int]:
    """The steps that have a closed marker among `partitions`."""
    steps = []
    for name in partitions:
        match = re.fullmatch(r"step_(\d+)\.closed", name)
        if match:
            steps.append(int(match.group(1)))
    return steps


class DataPlaneConfig(StrictModel):
    """Where the data plane runs and how readers wait."""

    ray_address: str | None = None
    """Ray cluster to join if this process has not joined one; None starts a private local
    instance, which `close()` stops again."""
    num_cpus: int = Field(default=8, ge=1)
    """Logical CPUs of a private Ray instance. Deliberately more than the cores of a small
    machine: Ray counts CPUs for placement only, and the queue alone takes two."""
    ray_temp_dir: str | None = None
    """Temp dir of a private Ray instance; None makes (and later removes) a fresh one."""
    num_storage_units: int = Field(default=1, ge=1)
    """TransferQueue storage actors, used only when this process starts the queue."""
    storage_capacity: int | None = Field(default=None, ge=1)
    """Most rows the storage units hold at once; None for no limit."""
    storage_node_resource: str | None = None
    """A Ray resource that the nodes holding the storage units must offer (a node that will
    not go away, say the head's); None: any node with a CPU, round robin."""
    min_poll_interval_s: float = Field(default=0.025, gt=0)
    """First pause of a waiting reader after rows last came (it doubles up to
    `max_poll_interval_s`). Every check is a round trip to the queue's controller, which each
    writer's put needs too: with readers checking from 5 ms on, a rollout's put took 107 ms at
    the median on a 2-core machine, against 75 ms from 25 ms on (`docs/benchmarks.md`)."""
    max_poll_interval_s: float = Field(default=0.05, gt=0)
    """Longest pause of a waiting reader between two readiness checks: the latency a reader
    adds when rows trickle in."""

    @model_validator(mode="after")
    def _poll_bounds(self) -> DataPlaneConfig:
        if self.min_poll_interval_s > self.max_poll_interval_s:
            raise ValueError(
                f"min_poll_interval_s={self.min_poll_interval_s:g} is above "
                f"max_poll_interval_s={self.max_poll_interval_s:g}: set the first no higher "
                "than the second"
            )
        return self


@contextlib.contextmanager
def _keep_torch_threads() -> Iterator[None]:
    """Undo TransferQueue's reset of the torch thread count around one put or get."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _encode(spec: FieldSpec, values: Sequence[Any]) -> Any:
    """One TransferQueue column for `values`: jagged tensor, dense 1-D tensor or string stack."""
    if spec.kind == "tokens":
        return torch.nested.as_nested_tensor(encode_tokens(values, spec.dtype), layout=torch.jagged)
    if spec.kind == "scalar":
        return encode_scalars(values, spec.dtype)
    return NonTensorStack(*encode_json(values))


def _decode(column: Any, size: int) -> list[Any]:
    """Per-row values of one column read back from TransferQueue.

    The kind is recovered from what TransferQueue returns, so readers need no registry:
    per-token fields come back as a nested tensor (one 1-D tensor per row), scalars as a dense
    1-D tensor (one 0-d tensor per row), JSON fields as a stack of strings.
    """
    if isinstance(column, torch.Tensor):
        rows = list(column.unbind()) if column.is_nested else list(column)
    else:
        items = column.tolist() if hasattr(column, "tolist") else list(column)
        if items and all(isinstance(v, str) for v in items):
            rows = decode_json(items)
        else:
            # A ragged column TransferQueue could not pack into a nested tensor.
            rows = [torch.as_tensor(v) for v in items]
    if len(rows) != size:
        raise DataPlaneError(f"TransferQueue returned {len(rows)} values for {size} rows")
    return rows


class DataPlane:
    """The `DataBus` over TransferQueue; build it with `DataPlane.start(config)`.

    Any number of instances, in one process or in many, share the queue of a Ray cluster; the
    first one started there owns it. An instance may be used from several event loops in turn
    (TransferQueue keeps sockets per loop) but not from several threads at once.
    """

    def __init__(
        self,
        client: AsyncTransferQueueClient,
        config: DataPlaneConfig,
        *,
        owns_queue: bool,
        owns_ray: bool,
        ray_temp_dir: str | None,
    ) -> None:
        self._client = client
        self._config = config
        self._owns_queue = owns_queue
        self._owns_ray = owns_ray
        self._ray_temp_dir = ray_temp_dir
        self._closed = False
        # consumer -> partition -> ids handed out (the exactly-once record).
        self._consumed: dict[str, dict[str, set[str]]] = {}
        # Rows taken from TransferQueue but not yet handed out when a reader stopped early;
        # the next reader of the same (partition, consumer, fields) starts with them.
        self._leftover: dict[tuple[str, str, tuple[str, ...]], list[Row]] = {}
        # Fetches whose reader was cancelled mid-flight; their rows join the leftovers.
        self._inflight: dict[tuple[str, str, tuple[str, ...]], asyncio.Future[list[Row]]] = {}
        # After a restore, TransferQueue's consumption marks of each (partition, consumer) are
        # reset once, on first read.
        self._restored = False
        self._reset_done: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, config: DataPlaneConfig | None = None) -> DataPlane:
        """Join (or start) Ray and the queue, and connect a client. Blocks for a few seconds.

        If this process has not joined Ray, it starts a private instance (or joins
        `config.ray_address`). If no TransferQueue controller runs in the cluster, a driver
        starts one with its storage units; inside a Ray actor (a role's replica) this waits,
        up to a minute, for the driver that owns the run's queue to have started it. `close()`
        undoes exactly what was started here.
        """
        config = config or DataPlaneConfig()
        owns_ray, temp_dir = _ensure_ray(config)
        owns_queue = False
        try:
            owns_queue = _ensure_queue(config)
            conf = _controller_config()
            client = AsyncTransferQueueClient(
                client_id=f"omniloop-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                controller_info=conf.controller.zmq_info,
            )
            backend = conf.backend.storage_backend
            client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
        except BaseException:
            _teardown(owns_queue=owns_queue, owns_ray=owns_ray, temp_dir=temp_dir)
            raise
        return cls(client, config, owns_queue=owns_queue, owns_ray=owns_ray, ray_temp_dir=temp_dir)

    def close(self) -> None:
        """Close the client; stop the queue and Ray too if `start` started them. Idempotent.

        Closing the instance that owns the queue ends it for every client in the cluster.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._client.close()
        finally:
            _teardown(
                owns_queue=self._owns_queue, owns_ray=self._owns_ray, temp_dir=self._ray_temp_dir
            )

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError("the data plane is closed")

    # ------------------------------------------------------------------ writers

    async def put_rollout(
        self,
        step: int,
        trajectories: Sequence[Trajectory],
        extra: Mapping[str, Sequence[Any]] | None = None,
    ) -> list[str]:
        """Write the rollout fields of `trajectories` into partition `step`; return their ids.

        `extra` holds further fields of the same rows (one value per trajectory, in order),
        written in the same put: a rollout that scored its episode writes `reward` with it, so
        a row is never seen without it. Every trajectory is `check()`ed first. An id written
        again (in the same call or a later one) overwrites its row: one row per id. Raises
        `PartitionClosedError` once the partition was closed, since a reader may already have
        drained it.
        """
        self._check_open()
        if not trajectories:
            return []
        extra = dict(extra or {})
        for name, values in extra.items():
            if len(values) != len(trajectories):
                raise ValueError(
                    f"{len(trajectories)} trajectories but {len(values)} values for {name!r}"
                )
        # The last of repeated ids wins, for the extra fields as for the rollout's.
        index = {t.id: i for i, t in enumerate(trajectories)}
        unique = {tid: trajectories[i] for tid, i in index.items()}
        for traj in unique.values():
            traj.check()
        partition = partition_id(step)
        existing = await self._client.async_get_partition_list()
        if _closed_partition(partition) in existing or step < _forgotten_before(existing):
            raise PartitionClosedError(
                f"partition {partition} is closed; {len(unique)} trajectories were not written"
            )
        ids = list(unique)
        columns = {
            name: _encode(FIELDS[name], values)
            for name, values in rollout_values(list(unique.values())).items()
        }
        for name, values in extra.items():
            columns[name] = _encode(field_spec(name), [values[index[i]] for i in ids])
        await self._write(partition, ids, columns, create=True)
        return ids

    async def put_field(
        self,
        step: int,
        ids: Sequence[str],
        name: str,
        values: Sequence[Any],
        kind: FieldKind | None = None,
    ) -> None:
        """Write field `name` for rows `ids`, which `put_rollout` must have created.

        `kind` is needed only for a field not in `FIELDS`. Writing again overwrites. Raises
        `UnknownRowsError` naming ids without a row, `ValueError` for ill-fitting values.
        """
        self._check_open()
        if len(ids) != len(values):
            raise ValueError(f"{len(ids)} ids but {len(values)} values for field {name!r}")
        spec = field_spec(name, kind)
        if not ids:
            return
        unique = dict(zip(ids, values, strict=True))
        await self._write(
            partition_id(step),
            list(unique),
            {name: _encode(spec, list(unique.values()))},
            create=False,
        )

    async def close_partition(self, step: int) -> None:
        """Declare that partition `step` gets no new rows; readers then drain it and stop. A
        forgotten step is closed already, by the mark (`forget_cleared`): it gets no marker."""
        self._check_open()
        partitions = await self._client.async_get_partition_list()
        if step < _forgotten_before(partitions):
            return
        await self._client.async_kv_retrieve_meta(
            keys=[_CLOSED_KEY], partition_id=_closed_partition(partition_id(step)), create=True
        )

    async def written(self, step: int, trajectory_id: str) -> Trajectory | None:
        """See `DataBus.written`."""
        self._check_open()
        partition = partition_id(step)
        if partition not in await self._client.async_get_partition_list():
            return None
        meta = await self._client.async_kv_retrieve_meta(
            keys=[trajectory_id], partition_id=partition, create=False
        )
        names = [*ROLLOUT_FIELDS, "reward"]
        if meta.size != 1 or not set(names) <= set(meta.field_names):
            return None
        if "reward_info" in meta.field_names:
            names.append("reward_info")
        meta = meta.select_fields(names)
        if not meta.is_ready:
            return None
        with _keep_torch_threads():
            data = await self._client.async_get_data(meta)
        row = {name: _decode(data[name], 1)[0] for name in names}
        reward = float(row.pop("reward"))
        reward_info = row.pop("reward_info", None) or {}
        values = {
            name: value.tolist() if FIELDS[name].kind == "tokens" else value
            for name, value in row.items()
        }
        values["prompt_length"] = int(values["prompt_length"])
        return Trajectory.model_validate(
            {
                **values,
                "id": trajectory_id,
                "reward": None if math.isnan(reward) else reward,
                "reward_info": reward_info,
            }
        )

    async def clear(self, step: int) -> None:
        """See `DataBus.clear`: the rows go, the closed marker stays."""
        self._check_open()
        partition = partition_id(step)
        if partition in await self._client.async_get_partition_list():
            await self._client.async_clear_partition(partition)
        for key in [k for k in self._leftover if k[0] == partition]:
            del self._leftover[key]
        for key in [k for k in self._inflight if k[0] == partition]:
            del self._inflight[key]
        self._reset_done = {k for k in self._reset_done if k[0] != partition}
        self._forget_partitions({partition})

    async def reopen_cleared(self, from_step: int) -> list[int]:
        """See `DataBus.reopen_cleared`."""
        self._check_open()
        existing = set(await self._client.async_get_partition_list())
        if _forgotten_before(existing) > from_step:
            await self._mark_forgotten_before(from_step, existing)
        reopened = []
        for step in range(from_step, 1 + max(_marked_steps(existing), default=-1)):
            partition = partition_id(step)
            marker = _closed_partition(partition)
            # A marker without rows: a cleared step (a closed one that has rows is untrained).
            if marker in existing and partition not in existing:
                await self._client.async_clear_partition(marker)
                reopened.append(step)
        return reopened

    async def forget_cleared(self, before_step: int) -> list[int]:
        """See `DataBus.forget_cleared`."""
        self._check_open()
        existing = set(await self._client.async_get_partition_list())
        forgotten = sorted(
            step
            for step in _marked_steps(existing)
            if step < before_step and partition_id(step) not in existing
        )
        # The mark first: each step is closed by its own marker or by the mark throughout.
        if forgotten and _forgotten_before(existing) < forgotten[-1] + 1:
            await self._mark_forgotten_before(forgotten[-1] + 1, existing)
        for step in forgotten:
            await self._client.async_clear_partition(_closed_partition(partition_id(step)))
        return forgotten

    async def _mark_forgotten_before(self, step: int, existing: Iterable[str]) -> None:
        """Move the mark of the step before which every step is closed to `step`."""
        mark = f"{_FORGOTTEN_PREFIX}{step}"
        await self._client.async_kv_retrieve_meta(
            keys=[_CLOSED_KEY], partition_id=mark, create=True
        )
        for name in _forgotten_marks(existing).values():
            if name != mark:
                await self._client.async_clear_partition(name)

    async def _write(
        self, partition: str, ids: list[str], columns: Mapping[str, Any], *, create: bool
    ) -> None:
        meta = await self._client.async_kv_retrieve_meta(
            keys=ids, partition_id=partition, create=create
        )
        if meta.size != len(ids):
            found: set[str] = set()
            if meta.size:
                found = set(
                    await self._client.async_kv_retrieve_keys(
                        global_indexes=meta.global_indexes, partition_id=partition
                    )
                )
            missing = [i for i in ids if i not in found]
            raise UnknownRowsError(
                f"{len(missing)} of {len(ids)} ids have no row in partition {partition} "
                f"(write the rollout first): {missing[:5]}"
            )
        batch = TensorDict(dict(columns), batch_size=[len(ids)])
        with _keep_torch_threads():
            await self._client.async_put(batch, meta)

    # ------------------------------------------------------------------ readers

    async def iter_micro_batches(
        self,
        step: int,
        fields: Sequence[str],
        micro_batch_size: int,
        consumer: str = "actor",
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[MicroBatch]:
        """Yield micro-batches of rows of `step` that have all `fields`, as they become ready.

        A full micro-batch is yielded as soon as `micro_batch_size` unconsumed rows have every
        requested field, while producers may still be writing. The iteration ends when the
        partition is closed and every row in it was handed to `consumer`; the last micro-batch
        may then be shorter. A row is never yielded twice to the same consumer, including
        across `restore_consumed`. Rows taken from the queue but not yet yielded when the
        caller stops early are kept for its next call with the same arguments (close the
        iterator, e.g. with `contextlib.aclosing`, to make that immediate).

        Raises `DataPlaneTimeoutError` when `timeout_s` passes without a new row; the message
        says how many rows exist, are ready and were consumed, and whether the step is closed.
        """
        self._check_open()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        names = list(dict.fromkeys(fields))
        if not names:
            raise ValueError("iter_micro_batches needs at least one field")
        partition = partition_id(step)
        await self._reset_if_restored(partition, consumer)
        consumed = self._consumed.setdefault(consumer, {}).setdefault(partition, set())
        key = (partition, consumer, tuple(names))
        buffer = await self._take_leftover(key, consumed)
        delay = self._config.min_poll_interval_s
        last_progress = time.monotonic()
        try:
            while True:
                # Leftover rows from an earlier reader may already fill a batch.
                while len(buffer) >= micro_batch_size:
                    batch, buffer = buffer[:micro_batch_size], buffer[micro_batch_size:]
                    consumed.update(r.id for r in batch)
                    yield MicroBatch.from_rows(step, consumer, batch, names)
                want = micro_batch_size - len(buffer)
                rows = await self._fetch_kept(key, partition, names, consumer, want)
                if not rows and await self._is_closed(partition):
                    unconsumed, ready = await self._drain_status(partition, names, consumer)
                    if unconsumed == 0:
                        if buffer:
                            batch, buffer = buffer, []
                            consumed.update(r.id for r in batch)
                            yield MicroBatch.from_rows(step, consumer, batch, names)
                        return
                    if ready:
                        # The tail of a closed step: fewer ready rows than a full batch.
                        rows = await self._fetch_kept(
                            key, partition, names, consumer, min(ready, want)
                        )
                if rows:
                    last_progress = time.monotonic()
                    delay = self._config.min_poll_interval_s
                    held = {r.id for r in buffer}
                    for row in rows:
                        # Ids consumed before a restore come back from the reset queue.
                        if row.id not in consumed and row.id not in held:
                            buffer.append(row)
                            held.add(row.id)
                    continue
                if timeout_s is not None and time.monotonic() - last_progress > timeout_s:
                    raise DataPlaneTimeoutError(
                        await self._describe_stall(partition, names, consumer, timeout_s)
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._config.max_poll_interval_s)
        finally:
            if buffer:
                self._leftover.setdefault(key, []).extend(buffer)

    async def _fetch_kept(
        self,
        key: tuple[str, str, tuple[str, ...]],
        partition: str,
        names: list[str],
        consumer: str,
        n: int,
    ) -> list[Row]:
        """`_fetch`, shielded from cancellation of the reader.

        The queue marks rows consumed when it hands them out; a fetch cut off by a cancelled
        reader would drop them. The shielded fetch runs to the end instead and the next reader
        of `key` collects its rows (`_take_leftover`).
        """
        task = asyncio.ensure_future(self._fetch(partition, names, consumer, n))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._inflight[key] = task
            raise

    async def _take_leftover(
        self, key: tuple[str, str, tuple[str, ...]], consumed: set[str]
    ) -> list[Row]:
        """Rows an earlier reader of `key` took from the queue but did not hand out."""
        rows = self._leftover.pop(key, [])
        orphan = self._inflight.pop(key, None)
        if orphan is not None:
            try:
                rows = rows + await orphan
            except Exception as err:
                # Marked consumed in the queue but unreadable; restore_consumed recovers them.
                logger.warning("an interrupted fetch of %s failed: %r", key, err)
        return [r for r in rows if r.id not in consumed]

    async def _fetch(self, partition: str, names: list[str], consumer: str, n: int) -> list[Row]:
        """Take exactly `n` ready rows for `consumer`, or none while fewer are ready."""
        meta = await self._client.async_get_meta(
            data_fields=names,
            batch_size=n,
            partition_id=partition,
            mode="fetch",
            task_name=consumer,
        )
        if meta.size == 0:
            return []
        ids = await self._client.async_kv_retrieve_keys(
            global_indexes=meta.global_indexes, partition_id=partition
        )
        with _keep_torch_threads():
            data = await self._client.async_get_data(meta)
        columns = {name: _decode(data[name], meta.size) for name in names}
        return [
            Row(id=row_id, values={name: columns[name][i] for name in names})
            for i, row_id in enumerate(ids)
        ]

    async def _is_closed(self, partition: str) -> bool:
        listing = await self._client.async_kv_list(_closed_partition(partition))
        return bool(listing)

    async def _drain_status(
        self, partition: str, names: list[str], consumer: str
    ) -> tuple[int, int]:
        """(rows not yet taken by `consumer`, how many of those have every field)."""
        rows, consumed, ready = await self._row_sets(partition, names, consumer)
        unconsumed = rows - consumed
        return len(unconsumed), len(unconsumed & ready)

    async def _row_sets(
        self, partition: str, names: list[str], consumer: str
    ) -> tuple[set[int], set[int], set[int]]:
        """Row indexes of the partition's trajectory ids, those taken by `consumer`, and those
        with every field in `names`.

        Rows come from the key listing, not from TransferQueue's index range, which also holds
        pre-allocated indexes that are not rows.
        """
        listing = await self._client.async_kv_list(partition)
        keys = list(listing.get(partition, {}))
        if not keys:
            return set(), set(), set()
        meta = await self._client.async_kv_retrieve_meta(
            keys=keys, partition_id=partition, create=False
        )
        rows = set(meta.global_indexes)
        index, status = await self._client.async_get_consumption_status(
            task_name=consumer, partition_id=partition
        )
        consumed: set[int] = set()
        if index is not None and status is not None:
            consumed = {i for i, s in zip(index.tolist(), status.tolist(), strict=True) if s}
        index, status = await self._client.async_get_production_status(
            data_fields=names, partition_id=partition
        )
        ready: set[int] = set()
        if index is not None and status is not None:
            complete = status.bool().all(dim=1).tolist()
            ready = {i for i, ok in zip(index.tolist(), complete, strict=True) if ok}
        return rows, consumed & rows, ready & rows

    async def _describe_stall(
        self, partition: str, names: list[str], consumer: str, timeout_s: float
    ) -> str:
        rows, consumed, ready = await self._row_sets(partition, names, consumer)
        closed = await self._is_closed(partition)
        return (
            f"no new row for {consumer!r} in partition {partition} within {timeout_s:g} s: "
            f"{len(rows)} rows, {len(ready)} with all of {names}, {len(consumed)} consumed, "
            f"{'closed' if closed else 'not closed'}"
        )

    # ------------------------------------------------------------------ consumption state

    async def reread(self, step: int, consumer: str) -> None:
        """Hand every row of `step` to `consumer` again from its next read on: forget the ids
        handed to it here and reset the queue's marks. For a stage that recomputes a whole step
        with idempotent writes (the advantages), never for the trainer."""
        self._check_open()
        partition = partition_id(step)
        self._consumed.get(consumer, {}).pop(partition, None)
        for key in [k for k in self._leftover if k[0] == partition and k[1] == consumer]:
            del self._leftover[key]
        existing = set(await self._client.async_get_partition_list())
        if partition in existing:
            await self._client.async_reset_consumption(partition_id=partition, task_name=consumer)
        self._reset_done.add((partition, consumer))
        # A stage rereads each step it computes, in a process that never clears one: the ids
        # it took from the steps cleared since would otherwise pile up for the whole run.
        # (A partition read from and no longer in the queue was cleared.)
        recorded = {p for parts in self._consumed.values() for p in parts}
        self._forget_partitions(recorded - existing)

    def _forget_partitions(self, partitions: set[str]) -> None:
        """Drop every consumer's record of `partitions` (cleared ones: see `DataBus.clear`)."""
        for parts in self._consumed.values():
            for partition in partitions:
                parts.pop(partition, None)

    def consumed_state(self) -> dict[str, Any]:
        """`{"format": 1, "consumers": {consumer: {partition: [ids...]}}}`, JSON-ready.

        Rows are recorded when yielded, so a snapshot taken after training on a micro-batch
        covers exactly what was trained.
        """
        return {
            "format": _STATE_FORMAT,
            "consumers": {
                consumer: {p: sorted(ids) for p, ids in sorted(parts.items())}
                for consumer, parts in sorted(self._consumed.items())
            },
        }

    def restore_consumed(self, state: Mapping[str, Any]) -> None:
        """Adopt a `consumed_state()` snapshot (replacing the current record).

        Ids in it are never yielded again. Every other row becomes available once more, even
        one this or an earlier process had taken from the queue: on the first read of each
        (partition, consumer) after the restore, the queue's own consumption marks are reset.
        A restarted consumer calls this, with an empty state if it has none, before reading.
        """
        if state.get("format") != _STATE_FORMAT or not isinstance(state.get("consumers"), dict):
            raise ValueError(
                f"not a consumed-state snapshot of format {_STATE_FORMAT}: keys {sorted(state)}"
            )
        restored: dict[str, dict[str, set[str]]] = {}
        for consumer, parts in state["consumers"].items():
            if not isinstance(parts, dict):
                raise ValueError(f"consumer {consumer!r}: expected partition -> ids mapping")
            restored[str(consumer)] = {str(p): {str(i) for i in ids} for p, ids in parts.items()}
        self._consumed = restored
        self._leftover.clear()
        self._inflight.clear()
        self._restored = True
        self._reset_done.clear()

    async def _reset_if_restored(self, partition: str, consumer: str) -> None:
        if not self._restored or (partition, consumer) in self._reset_done:
            return
        if partition in await self._client.async_get_partition_list():
            await self._client.async_reset_consumption(partition_id=partition, task_name=consumer)
        # A partition that does not exist yet has no consumption marks to reset.
        self._reset_done.add((partition, consumer))


def _ensure_ray(config: DataPlaneConfig) -> tuple[bool, str | None]:
    """Join or start Ray unless this process already has; (started here, temp dir to remove)."""
    if ray.is_initialized():
        return False, None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at nice 15, below the driver. The role services (the trainer, the
    # engines their replicas start, the rollouts) are Ray workers: at nice 15 any other busy
    # process on the machine would starve them (minutes for a replica to start beside two busy
    # loops). A private instance runs them at the driver's priority; a cluster joined by
    # address keeps its own setting.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Serve's controller reconciles every deployment ten times a second by default, a tenth
    # of a core on a small machine; twice a second still notices a dead replica at once.
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    # The queue's actors inherit this; at INFO they print request statistics every five
    # minutes into the run's console. Warnings and errors still show.
    os.environ.setdefault("TQ_LOGGING_LEVEL", "WARNING")
    if config.ray_address is not None:
        ray.init(address=config.ray_address)
        return True, None
    temp_dir = config.ray_temp_dir or tempfile.mkdtemp(prefix="omniloop-ray-")
    # address="local": never attach by accident to another Ray instance on the machine.
    ray.init(address="local", num_cpus=config.num_cpus, _temp_dir=temp_dir, include_dashboard=False)
    return True, (temp_dir if config.ray_temp_dir is None else None)


def _find_controller() -> Any | None:
    try:
        return ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def _ensure_queue(config: DataPlaneConfig) -> bool:
    """Start TransferQueue unless its controller already runs in the cluster, or this process
    is a Ray actor; True if started."""
    if _find_controller() is not None:
        return False
    if ray.get_runtime_context().get_actor_id() is not None:
        # A role's replica: the queue is the run's, started (and closed) by its driver, which
        # may still be starting it (`_controller_config` waits). One started here would end
        # with this replica.
        return False
    storage: dict[str, Any] = {"num_data_storage_units": config.num_storage_units}
    if config.storage_capacity is not None:
        storage["total_storage_size"] = config.storage_capacity
    if config.storage_node_resource is not None:
        storage["required_node_resource"] = config.storage_node_resource
    tq.init(
        OmegaConf.create(
            {
                # Polling mode: a fetch with too few ready rows answers at once with nothing
                # instead of sleeping inside the controller.
                "controller": {"polling_mode": True},
                "backend": {"storage_backend": "SimpleStorage", "SimpleStorage": storage},
            }
        )
    )
    return True


def _controller_config() -> DictConfig:
    """The running controller's configuration (it is stored once its owner finished init)."""
    deadline = time.monotonic() + _CONTROLLER_READY_TIMEOUT_S
    while True:
        controller = _find_controller()
        conf = None if controller is None else ray.get(controller.get_config.remote())
        if conf is not None:
            break
        if time.monotonic() > deadline:
            raise DataPlaneError(
                f"TransferQueue controller not ready within {_CONTROLLER_READY_TIMEOUT_S:g} s"
                + (
                    " (a role's replica joins the queue its run's driver starts)"
                    if controller is None
                    else ""
                )
            )
        # Another process is still initialising the queue; this runs only during start-up.
        time.sleep(0.2)
    if not conf.controller.get("polling_mode", False):
        raise DataPlaneError(
            "the running TransferQueue controller was started without controller.polling_mode; "
            "its blocking fetch would stall every client. Start it through DataPlane.start()."
        )
    return conf


def _teardown(*, owns_queue: bool, owns_ray: bool, temp_dir: str | None) -> None:
    try:
        if owns_queue:
            tq.close()
    finally:
        if owns_ray:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def queue_running() -> bool:
    """Whether the queue's controller runs in the Ray cluster this process has joined."""
    return _find_controller() is not None
