"""The data plane's contract, independent of the queue behind it.

Roles meet only in the data plane (DESIGN.md §1): one partition per rollout step, one row per
trajectory segment keyed by its deterministic id, and one field per column of DESIGN.md §2,
each written by the stage that produces it. This module holds what every implementation and
every caller shares: the `DataBus` protocol, the `MicroBatch` a reader receives, the registry
that says how each field is stored, and the errors. Nothing here imports Ray or TransferQueue.

How fields are stored (`FieldSpec.kind`):

- `tokens`: one 1-D tensor per row, as long as that row's `input_ids` (per-token arrays).
  A reader gets `list[torch.Tensor]`.
- `scalar`: one number per row. A reader gets a 1-D tensor with one entry per row.
- `json`: any JSON-serialisable value per row (pydantic models are dumped first). A reader gets
  `list[Any]` of the decoded values.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel

from omniloop.errors import OmniloopError
from omniloop.trajectory import Trajectory

FieldKind = Literal["tokens", "scalar", "json"]


@dataclass(frozen=True)
class FieldSpec:
    """How one field is stored and returned."""

    kind: FieldKind
    dtype: torch.dtype | None = None
    """Element type of `tokens` and `scalar` fields; None for `json`."""


FIELDS: dict[str, FieldSpec] = {
    # Written by rollout (`put_rollout`).
    "input_ids": FieldSpec("tokens", torch.int64),
    "loss_mask": FieldSpec("tokens", torch.int8),
    "rollout_logprobs": FieldSpec("tokens", torch.float32),
    "weight_version": FieldSpec("tokens", torch.int32),
    "prompt_length": FieldSpec("scalar", torch.int64),
    "multimodal": FieldSpec("json"),
    "meta": FieldSpec("json"),
    # Written by later stages (`put_field`).
    "reward": FieldSpec("scalar", torch.float32),
    "reward_info": FieldSpec("json"),
    "ref_logprobs": FieldSpec("tokens", torch.float32),
    "teacher_logprobs": FieldSpec("tokens", torch.float32),
    "old_logprobs": FieldSpec("tokens", torch.float32),
    "values": FieldSpec("tokens", torch.float32),
    "advantages": FieldSpec("tokens", torch.float32),
    "dropped": FieldSpec("scalar", torch.int8),
    "returns": FieldSpec("tokens", torch.float32),
}
"""The fields of DESIGN.md §2. Other names may be written with an explicit `kind`."""

ROLLOUT_FIELDS: tuple[str, ...] = (
    "input_ids",
    "loss_mask",
    "rollout_logprobs",
    "weight_version",
    "prompt_length",
    "multimodal",
    "meta",
)
"""The fields `put_rollout` writes for every trajectory."""

_DEFAULT_DTYPES: dict[FieldKind, torch.dtype | None] = {
    "tokens": torch.float32,
    "scalar": torch.float32,
    "json": None,
}


class DataPlaneError(OmniloopError):
    """The data plane refused an operation or could not carry it out."""


class UnknownRowsError(DataPlaneError):
    """A field was written for trajectory ids that have no row in the partition."""


class PartitionClosedError(DataPlaneError):
    """Rollout rows were written to a partition that was already closed."""


class DataPlaneTimeoutError(DataPlaneError, TimeoutError):
    """A streaming reader saw no new row for longer than its timeout."""


def partition_id(step: int) -> str:
    """The partition that holds the rows of rollout step `step`."""
    if step < 0:
        raise ValueError(f"rollout step must be >= 0, got {step}")
    return f"step_{step}"


def field_spec(name: str, kind: FieldKind | None = None) -> FieldSpec:
    """The spec of `name`: the registered one, or one built from `kind` for a new field.

    Raises `ValueError` when `name` is unknown and no `kind` is given, or when `kind`
    contradicts the registry (a `reward` written as tokens would break every reader).
    """
    spec = FIELDS.get(name)
    if spec is not None:
        if kind is not None and kind != spec.kind:
            raise ValueError(f"field {name!r} is stored as {spec.kind!r}, not {kind!r}")
        return spec
    if kind is None:
        raise ValueError(
            f"field {name!r} is not one of the known fields ({', '.join(sorted(FIELDS))}); "
            "pass kind='tokens' | 'scalar' | 'json' to write a new one"
        )
    return FieldSpec(kind, _DEFAULT_DTYPES[kind])


def _to_json(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, separators=(",", ":"), allow_nan=True)


def encode_tokens(values: Sequence[Any], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """One 1-D tensor of `dtype` per row; raises `ValueError` on anything not 1-D."""
    out = []
    for i, v in enumerate(values):
        t = torch.as_tensor(v, dtype=dtype)
        if t.ndim != 1:
            raise ValueError(
                f"row {i}: a per-token field needs a 1-D sequence, got shape {tuple(t.shape)}"
            )
        out.append(t)
    return out


def encode_scalars(values: Sequence[Any], dtype: torch.dtype | None) -> torch.Tensor:
    """A 1-D tensor with one entry per row; raises `ValueError` on None or non-scalars."""
    items = []
    for i, v in enumerate(values):
        if v is None:
            raise ValueError(f"row {i}: a scalar field cannot hold None")
        t = torch.as_tensor(v)
        if t.numel() != 1:
            raise ValueError(
                f"row {i}: a scalar field needs one number, got shape {tuple(t.shape)}"
            )
        items.append(t.reshape(()).item())
    return torch.tensor(items, dtype=dtype)


def encode_json(values: Sequence[Any]) -> list[str]:
    """One compact JSON document per row (pydantic models are dumped in JSON mode first)."""
    return [_to_json(v) for v in values]


def decode_json(values: Sequence[str]) -> list[Any]:
    """The inverse of `encode_json`."""
    return [json.loads(v) for v in values]


def rollout_values(trajectories: Sequence[Trajectory]) -> dict[str, list[Any]]:
    """The values of every field in `ROLLOUT_FIELDS`, one list per field, one entry per row."""
    return {
        "input_ids": [t.input_ids for t in trajectories],
        "loss_mask": [t.loss_mask for t in trajectories],
        "rollout_logprobs": [t.rollout_logprobs for t in trajectories],
        "weight_version": [t.weight_version for t in trajectories],
        "prompt_length": [t.prompt_length for t in trajectories],
        "multimodal": [t.multimodal for t in trajectories],
        "meta": [t.meta for t in trajectories],
    }


@dataclass(frozen=True)
class Row:
    """One decoded row as a reader holds it before batching."""

    id: str
    values: dict[str, Any]


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one partition handed to one consumer, in a stable order.

    `fields[name]` is `list[torch.Tensor]` for `tokens` fields, a 1-D tensor for `scalar`
    fields and `list[Any]` for `json` fields; entry `i` of every field belongs to `ids[i]`.
    """

    step: int
    consumer: str
    ids: list[str]
    fields: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    @classmethod
    def from_rows(
        cls, step: int, consumer: str, rows: Sequence[Row], names: Sequence[str]
    ) -> MicroBatch:
        """Assemble decoded rows: 0-d tensors (scalar fields) are stacked into one 1-D tensor,
        every other field stays a per-row list."""
        fields: dict[str, Any] = {}
        for name in names:
            column = [r.values[name] for r in rows]
            scalar = bool(column) and all(
                isinstance(v, torch.Tensor) and v.ndim == 0 for v in column
            )
            fields[name] = torch.stack(column) if scalar else column
        return cls(step=step, consumer=consumer, ids=[r.id for r in rows], fields=fields)


class DataBus(Protocol):
    """What the controller and the roles use to exchange trajectories (DESIGN.md §1, §2).

    Delivery is at-least-once and training exactly-once: writes are idempotent per trajectory
    id, and a consumer is never handed the same id twice, across `consumed_state` /
    `restore_consumed` too.
    """

    async def put_rollout(
        self,
        step: int,
        trajectories: Sequence[Trajectory],
        extra: Mapping[str, Sequence[Any]] | None = None,
    ) -> list[str]:
        """Write the rollout fields of `trajectories` (and the fields of `extra`, one value
        per trajectory, such as `reward`) into partition `step` in one put; return their ids.

        Writing an id again overwrites its row and never adds one. Raises
        `PartitionClosedError` once `close_partition(step)` was called.
        """
        ...

    async def put_field(
        self,
        step: int,
        ids: Sequence[str],
        name: str,
        values: Sequence[Any],
        kind: FieldKind | None = None,
    ) -> None:
        """Write field `name` for existing rows `ids` (one value each).

        Raises `UnknownRowsError` if an id has no row in the partition and `ValueError` for
        values that do not fit the field's kind.
        """
        ...

    async def close_partition(self, step: int) -> None:
        """Declare that no new rows will be added to partition `step` (idempotent)."""
        ...

    async def written(self, step: int, trajectory_id: str) -> Trajectory | None:
        """The trajectory whose rollout fields and reward partition `step` holds under
        `trajectory_id`, read back without handing the row to any consumer; None while the
        row is missing or incomplete. `reward_info` reads back if the row has it (else empty),
        and a reward written as NaN (an infrastructure failure, an episode without a reward)
        reads back as None."""
        ...

    def iter_micro_batches(
        self,
        step: int,
        fields: Sequence[str],
        micro_batch_size: int,
        consumer: str = "actor",
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[MicroBatch]:
        """Yield micro-batches of rows that have every field in `fields`, as they become ready.

        Full batches are yielded while producers still write; the iteration ends once the
        partition is closed and every row in it was handed to `consumer` (the last batch may
        be shorter). Raises `DataPlaneTimeoutError` after `timeout_s` without a new row.
        """
        ...

    def consumed_state(self) -> dict[str, Any]:
        """The ids handed to each consumer so far, JSON-serialisable, for checkpoints."""
        ...

    def restore_consumed(self, state: Mapping[str, Any]) -> None:
        """Resume from `consumed_state()`: ids in it are never yielded again, all others are."""
        ...

    async def clear(self, step: int) -> None:
        """Drop every row of partition `step` (after it was trained on). The step stays
        closed: a reader of it (a stage re-running its work after a replica died) ends at once
        instead of waiting for rows that will not come, and a late write of a row is refused.
        The ids consumed from it are dropped too (from this client's record, and from a stage's
        at its next `reread`): nothing of the step can be handed out again until
        `reopen_cleared`, which only an actor restore calls, after replacing the record with
        its checkpoint's, so the record of a long run holds its uncleared steps only. What
        marks the step closed stays until `forget_cleared`."""
        ...

    async def reopen_cleared(self, from_step: int) -> list[int]:
        """Open the cleared steps from `from_step` on for writing again, and return them: an
        actor restored from a checkpoint has those steps produced again. A closed step that
        still has its rows (produced, not yet trained) stays closed."""
        ...

    async def forget_cleared(self, before_step: int) -> list[int]:
        """Forget the cleared steps before `before_step` altogether, and return them: what
        marks each closed goes too (it costs the queue a few KB per step, for the whole run),
        replaced by one mark: every step before the last forgotten one and it are closed, so a
        late write of a row to any of them is still refused (`PartitionClosedError`), until
        `reopen_cleared` reopens from a step before the mark. A reader of a forgotten step
        waits for rows as for one never written, so the caller names only steps that no stage
        reads again and no restore reopens: those before the checkpoint before the newest."""
        ...

    def close(self) -> None:
        """Release this client, and whatever it started (queue, Ray), idempotently."""
        ...
