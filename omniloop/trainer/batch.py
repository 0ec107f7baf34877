"""`TrainBatch`: trajectories as padded tensors, the unit the trainer backends consume.

Layout: `B` sequences right-padded to a common length `T`. Every per-token tensor is `(B, T)` and
index `i` belongs to token `i` of `input_ids`, exactly as in `Trajectory` (DESIGN.md §2):
`rollout_logprobs[b, i]` is the engine's logprob of `input_ids[b, i]`, and so are `advantages`,
`old_logprobs` and `ref_logprobs` at `[b, i]`. Position 0 has no logprob (nothing precedes it)
and can never be in the loss mask.

Media: a row that shows the model images, audio or video carries the forward inputs of its items
(`TrainRow.media_inputs`, as `modalities.concat_inputs` makes them: every tensor's dim 0 counts
items or patches, in the order the items' placeholder blocks appear in `input_ids`). A batch keeps
them per row (`TrainBatch.media_inputs`) so that slicing rows keeps them aligned, and
`TrainBatch.media_kwargs` concatenates them over rows in row order, which is how a Qwen-VL/Omni
style model takes a batch: it fills the placeholder tokens of the flattened batch in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from omniloop.trainer.advantages import group_advantages, rloo_advantages
from omniloop.trainer.config import AdvantageConfig
from omniloop.trainer.data_parallel import shard_rows
from omniloop.trainer.packing import Units, row_costs
from omniloop.trajectory import INFRA_STOP_REASONS, Trajectory

Values = float | Sequence[float] | Tensor
"""One number for every token, or one per token."""

MediaInputs = Mapping[str, Tensor]
"""One row's media forward inputs: name -> tensor whose dim 0 counts items or patches."""

PADDED_MEDIA_KEYS = frozenset({"input_features", "feature_attention_mask"})
"""Media inputs whose last dim may differ between rows (audio frames, when a processor does not
pad clips to one length): right-padded with zeros when rows are concatenated, which the zeros
of `feature_attention_mask` mark as padding."""


@dataclass(frozen=True)
class TrainRow:
    """One trajectory as the trainer needs it (a data-plane row, or a `Trajectory`): per-token
    values aligned with `input_ids` as in `Trajectory` (DESIGN.md §2)."""

    id: str
    input_ids: Sequence[int] | Tensor
    loss_mask: Sequence[int] | Tensor
    rollout_logprobs: Sequence[float] | Tensor
    weight_version: Sequence[int] | Tensor
    advantages: Values
    """Per token, or one value broadcast to the loss-masked tokens."""
    stop_reason: str
    old_logprobs: Values | None = None
    """PPO's pi_old per token; None leaves it to the backend (its own logprobs)."""
    ref_logprobs: Values | None = None
    media_inputs: MediaInputs | None = None
    """The forward inputs of the row's media items, concatenated in order
    (`modalities.concat_inputs`); None for a text-only row."""

    @property
    def sampled_versions(self) -> list[int]:
        """The weight version of each sampled (loss-masked) token."""
        versions = torch.as_tensor(self.weight_version).tolist()
        mask = torch.as_tensor(self.loss_mask).tolist()
        return [v for v, m in zip(versions, mask, strict=True) if m]


@dataclass(frozen=True)
class TrainBatch:
    """A right-padded batch of sequences with everything the loss needs.

    Invariants (checked on construction): all per-token tensors are `(B, T)`; `loss_mask` is 0 on
    padding and at position 0; `ids` is empty or has `B` entries; `media_inputs` is empty or has
    `B` entries, and is empty whenever no row has media (a tuple of all None is normalized to
    `()`).
    """

    input_ids: Tensor
    """`(B, T)` int64 token ids, right-padded."""
    attention_mask: Tensor
    """`(B, T)` int64: 1 on real tokens, 0 on padding."""
    loss_mask: Tensor
    """`(B, T)` float32: 1 on tokens the policy sampled (trained), 0 elsewhere."""
    rollout_logprobs: Tensor
    """`(B, T)` float32: the engine's logprob of each sampled token, 0 elsewhere."""
    advantages: Tensor
    """`(B, T)` float32 per-token advantages, 0 where the loss mask is 0."""
    old_logprobs: Tensor | None = None
    """`(B, T)` trainer logprobs before this update (PPO's pi_old). None: the backend uses its
    own current logprobs, detached — exact when each batch gets one optimizer step."""
    ref_logprobs: Tensor | None = None
    """`(B, T)` reference-policy logprobs for the KL penalty, when computed elsewhere."""
    weight_version: Tensor | None = None
    """`(B, T)` int64 weight version that sampled each token, -1 elsewhere (for staleness)."""
    ids: tuple[str, ...] = ()
    """Trajectory ids, one per row (empty when built from raw tensors)."""
    media_inputs: tuple[MediaInputs | None, ...] = ()
    """Each row's media forward inputs (None for a text-only row); empty when no row has any.
    `media_kwargs` gives the forward inputs of the whole batch."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for field in ("attention_mask", "loss_mask", "rollout_logprobs", "advantages",
                      "old_logprobs", "ref_logprobs", "weight_version"):  # fmt: skip
            value = getattr(self, field)
            if value is not None and value.shape != shape:
                raise ValueError(
                    f"{field} has shape {tuple(value.shape)} but input_ids has {tuple(shape)}"
                )
        if self.ids and len(self.ids) != shape[0]:
            raise ValueError(f"{len(self.ids)} ids for {shape[0]} rows")
        media = tuple(self.media_inputs)
        if media and len(media) != shape[0]:
            raise ValueError(f"{len(media)} media_inputs for {shape[0]} rows")
        for b, inputs in enumerate(media):
            if inputs is not None and not all(isinstance(v, Tensor) for v in inputs.values()):
                raise ValueError(f"{self._row_name(b)}: media_inputs values must be tensors")
        # Frozen dataclass: normalize through object.__setattr__ so that "no media" has one
        # spelling, whatever slice of a batch produced it.
        object.__setattr__(self, "media_inputs", media if any(m is not None for m in media) else ())
        trained = self.loss_mask != 0
        if bool((trained & (self.attention_mask == 0)).any()):
            raise ValueError("loss_mask covers padding")
        if shape[1] and bool(trained[:, 0].any()):
            raise ValueError("loss_mask covers position 0, which has no logprob")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def _row_name(self, row: int) -> str:
        return f"row {row} ({self.ids[row]})" if self.ids else f"row {row}"

    @property
    def has_media(self) -> bool:
        """Whether any row carries media inputs."""
        return bool(self.media_inputs)

    def media_kwargs(self) -> dict[str, Tensor]:
        """The media forward inputs of the whole batch: each key concatenated along dim 0 over
        the rows that have it, in row order (`PADDED_MEDIA_KEYS` right-padded to a common last
        dim first). Empty when no row has media."""
        keyed: dict[str, list[Tensor]] = {}
        for inputs in self.media_inputs:
            for key, tensor in (inputs or {}).items():
                keyed.setdefault(key, []).append(tensor)
        return {key: _concat_rows(key, tensors) for key, tensors in keyed.items()}

    @property
    def num_tokens(self) -> int:
        """Loss-masked tokens in the batch."""
        return int((self.loss_mask != 0).sum())

    @classmethod
    def from_rows(cls, rows: Sequence[TrainRow], *, pad_id: int = 0) -> TrainBatch:
        """Pad rows into a batch: the one place a batch is built (`from_trajectories` makes
        rows of trajectories). `old_logprobs` are taken from the rows when every row has them;
        each row's `media_inputs` go along with it.
        Infrastructure failures are refused: they must be dropped, not trained (DESIGN.md §2).
        """
        if not rows:
            raise ValueError("a batch needs at least one row")
        n = len(rows)
        length = max(len(r.input_ids) for r in rows)
        ids = torch.full((n, length), pad_id, dtype=torch.long)
        attention = torch.zeros((n, length), dtype=torch.long)
        loss_mask = torch.zeros((n, length))
        rollout = torch.zeros((n, length))
        adv = torch.zeros((n, length))
        version = torch.full((n, length), -1, dtype=torch.long)
        with_old = all(r.old_logprobs is not None for r in rows)
        with_ref = all(r.ref_logprobs is not None for r in rows)
        old = torch.zeros((n, length)) if with_old else None
        ref = torch.zeros((n, length)) if with_ref else None
        for b, row in enumerate(rows):
            if row.stop_reason in INFRA_STOP_REASONS:
                raise ValueError(
                    f"trajectory {row.id} ended with {row.stop_reason}: infrastructure "
                    "failures are excluded from training, not trained"
                )
            k = len(row.input_ids)
            ids[b, :k] = torch.as_tensor(row.input_ids, dtype=torch.long)
            attention[b, :k] = 1
            mask = torch.as_tensor(row.loss_mask, dtype=torch.float32)
            loss_mask[b, :k] = mask
            rollout[b, :k] = torch.as_tensor(row.rollout_logprobs, dtype=torch.float32) * mask
            version[b, :k] = torch.as_tensor(row.weight_version, dtype=torch.long)
            adv[b, :k] = _row_values(row.advantages, k, "advantages", row.id) * mask
            if old is not None and row.old_logprobs is not None:
                old[b, :k] = _row_values(row.old_logprobs, k, "old_logprobs", row.id)
            if ref is not None and row.ref_logprobs is not None:
                ref[b, :k] = _row_values(row.ref_logprobs, k, "ref_logprobs", row.id)
        return cls(
            input_ids=ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            rollout_logprobs=rollout,
            advantages=adv,
            old_logprobs=old,
            ref_logprobs=ref,
            weight_version=version,
            ids=tuple(r.id for r in rows),
            media_inputs=tuple(r.media_inputs for r in rows),
        )

    @classmethod
    def for_scoring(
        cls,
        sequences: Sequence[Sequence[int] | Tensor],
        *,
        pad_id: int = 0,
        media_inputs: Sequence[MediaInputs | None] | None = None,
    ) -> TrainBatch:
        """Token sequences, right-padded, with nothing to train (zero loss mask, advantages
        and logprobs): all that scoring them (`logprobs`, a reference's) reads. `media_inputs`:
        one entry per sequence (None for text-only ones), or None when none has media."""
        if not sequences:
            raise ValueError("a batch needs at least one row")
        if media_inputs is not None and len(media_inputs) != len(sequences):
            raise ValueError(f"{len(media_inputs)} media_inputs for {len(sequences)} sequences")
        length = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), length), dtype=torch.long)
        for b, sequence in enumerate(sequences):
            ids[b, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
            attention[b, : len(sequence)] = 1
        zeros = torch.zeros(ids.shape)
        media = tuple(media_inputs) if media_inputs is not None else ()
        return cls(ids, attention, zeros, zeros, zeros, media_inputs=media)

    @classmethod
    def from_trajectories(
        cls,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[float] | Sequence[Sequence[float]] | Tensor | None,
        *,
        pad_id: int = 0,
        old_logprobs: Sequence[Sequence[float]] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
        media_inputs: Sequence[MediaInputs | None] | None = None,
    ) -> TrainBatch:
        """Pad trajectories into a batch.

        `advantages`: one float per trajectory (broadcast to its loss-masked tokens), or one list
        per trajectory with a value per token (e.g. from `gae`), or None for zeros (a batch only
        scored with `logprobs`, never trained). Per-token values are zeroed outside the loss
        mask. `old_logprobs` / `ref_logprobs`: optional per-token lists, same alignment.
        `media_inputs`: optional, one entry per trajectory (its media's forward inputs, or None).
        Infrastructure failures are refused: they must be dropped, not trained (DESIGN.md §2).
        The padding id is irrelevant to the result (padding is masked and comes after every real
        token, which causal attention never lets a real token see).
        """
        if not trajectories:
            raise ValueError("a batch needs at least one trajectory")
        n = len(trajectories)
        if advantages is not None and len(advantages) != n:
            raise ValueError(f"{len(advantages)} advantages for {n} trajectories")
        extras = (
            ("old_logprobs", old_logprobs),
            ("ref_logprobs", ref_logprobs),
            ("media_inputs", media_inputs),
        )
        for name, extra in extras:
            if extra is not None and len(extra) != n:
                raise ValueError(f"{len(extra)} {name} rows for {n} trajectories")
        rows = []
        for i, traj in enumerate(trajectories):
            traj.check()
            rows.append(
                TrainRow(
                    id=traj.id,
                    input_ids=traj.input_ids,
                    loss_mask=traj.loss_mask,
                    rollout_logprobs=traj.rollout_logprobs,
                    weight_version=traj.weight_version,
                    advantages=0.0 if advantages is None else advantages[i],
                    stop_reason=str(traj.meta.stop_reason),
                    old_logprobs=None if old_logprobs is None else old_logprobs[i],
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[i],
                    media_inputs=None if media_inputs is None else media_inputs[i],
                )
            )
        return cls.from_rows(rows, pad_id=pad_id)

    def replace(self, **changes: object) -> TrainBatch:
        """A copy with some fields replaced (e.g. `old_logprobs=backend.logprobs(batch)`)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def select(self, rows: slice | Sequence[int]) -> TrainBatch:
        """The given rows, trimmed to their longest sequence (so no column is padding only),
        with their ids and media inputs."""
        if isinstance(rows, slice):
            index: slice | Tensor = rows
            ids = self.ids[rows]
            media = self.media_inputs[rows]
        else:
            index = torch.tensor(list(rows), dtype=torch.long)
            ids = tuple(self.ids[i] for i in rows) if self.ids else ()
            media = tuple(self.media_inputs[i] for i in rows) if self.media_inputs else ()
        attention = self.attention_mask[index]
        width = int(attention.sum(-1).max()) if attention.shape[0] else 0
        values: dict[str, object] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                values[field.name] = value[index][:, :width]
        return self.replace(**values, ids=ids, media_inputs=media)

    def shard(self, rank: int, ranks: int, min_shared: int = 0) -> TrainBatch:
        """The rows data-parallel rank `rank` of `ranks` trains (`shards`), trimmed."""
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of {ranks} data-parallel ranks")
        return self.select(self.shards(ranks, min_shared)[rank])

    def shards(self, ranks: int, min_shared: int = 0) -> list[list[int]]:
        """The rows of each of `ranks` data-parallel ranks: each row in exactly one shard,
        shards balanced by tokens (`data_parallel.shard_rows`), rows that open with the same
        `min_shared` or more tokens in one shard (whose packed step holds the opening once:
        `packing.Units`; 0: rows one by one), balanced by their distinct tokens."""
        units = Units.of(self.input_ids, self.attention_mask, min_shared)
        by_unit = shard_rows(units.size, ranks)
        return [sorted(row for unit in shard for row in units.rows[unit]) for shard in by_unit]

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Consecutive micro-batches of at most `micro_batch_size` rows, each trimmed."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        return [
            self.select(slice(start, start + micro_batch_size))
            for start in range(0, len(self), micro_batch_size)
        ]

    def split_tokens(self, budget: int, min_shared: int = 0) -> list[TrainBatch]:
        """Consecutive micro-batches, each of as many rows as hold at most `budget` tokens
        (`packing.row_costs`: an opening of `min_shared` or more tokens shared with the row
        before counted once; 0: rows whole), each trimmed. A row longer than `budget` is a
        micro-batch of its own."""
        if budget <= 0:
            raise ValueError(f"a micro-batch token budget must be positive, got {budget}")
        parts: list[list[int]] = []
        held = 0
        for row, cost in enumerate(row_costs(self.input_ids, self.attention_mask, min_shared)):
            if not parts or held + cost > budget:
                parts.append([])
                # A row that starts a micro-batch holds its opening itself.
                cost = int(self.attention_mask[row].sum())
                held = 0
            parts[-1].append(row)
            held += cost
        return [self.select(rows) for rows in parts]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch with every tensor on `device`, media inputs included."""
        moved: dict[str, object] = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        if self.media_inputs:
            # The rows of a group share their prompt's media tensors: move each tensor once, so
            # that G rows do not become G copies on the device.
            done: dict[int, Tensor] = {}

            def move(tensor: Tensor) -> Tensor:
                if id(tensor) not in done:
                    done[id(tensor)] = tensor.to(device)
                return done[id(tensor)]

            moved["media_inputs"] = tuple(
                None if inputs is None else {k: move(v) for k, v in inputs.items()}
                for inputs in self.media_inputs
            )
        return self.replace(**moved)


def _concat_rows(key: str, tensors: list[Tensor]) -> Tensor:
    """`tensors` concatenated along dim 0; for `PADDED_MEDIA_KEYS`, the last dim right-padded
    with zeros to the longest first."""
    if len(tensors) == 1:
        return tensors[0]
    if key in PADDED_MEDIA_KEYS:
        width = max(t.shape[-1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors]
    trailing = {tuple(t.shape[1:]) for t in tensors}
    if len(trailing) > 1:
        raise ValueError(
            f"media input {key!r} has per-item shapes {sorted(trailing)} in different rows; "
            "they must agree to be batched"
        )
    return torch.cat(tensors, dim=0)


def _row_values(
    values: float | Sequence[float] | Tensor, length: int, name: str, traj_id: str
) -> Tensor:
    if isinstance(values, (int, float)) or (isinstance(values, Tensor) and values.dim() == 0):
        return torch.full((length,), float(values))
    row = torch.as_tensor(values, dtype=torch.float32)
    if row.shape != (length,):
        raise ValueError(
            f"trajectory {traj_id}: {name} has {row.numel()} values for {length} tokens"
        )
    return row


def trajectory_advantages(
    trajectories: Sequence[Trajectory], config: AdvantageConfig
) -> tuple[Tensor, Tensor]:
    """Per-trajectory advantages and the valid mask, grouped by `meta.group_id`.

    A trajectory is invalid when it is an infrastructure failure (its reward, if any, is not
    used); it gets advantage 0 and is left out of its group's statistics. A valid trajectory
    without a reward, or without a group id, is an error: it means a stage was skipped.
    Returns `(advantages (N,), valid (N,) bool)`.
    """
    group_index: dict[str, int] = {}
    groups, rewards, valid = [], [], []
    for traj in trajectories:
        ok = not traj.is_infra_failure
        if ok and traj.reward is None:
            raise ValueError(f"trajectory {traj.id} has no reward; score it before training")
        if not traj.meta.group_id:
            raise ValueError(f"trajectory {traj.id} has no meta.group_id; group baselines need one")
        groups.append(group_index.setdefault(traj.meta.group_id, len(group_index)))
        rewards.append(float(traj.reward) if ok and traj.reward is not None else 0.0)
        valid.append(ok)
    v = torch.tensor(valid, dtype=torch.bool)
    adv = estimate(torch.tensor(rewards), torch.tensor(groups, dtype=torch.long), v, config)
    return adv, v


def estimate(rewards: Tensor, groups: Tensor, valid: Tensor, config: AdvantageConfig) -> Tensor:
    """Per-sample advantages `(N,)` by `config.estimator` (`grpo` or `rloo`); invalid samples
    get 0 and are left out of their group's statistics."""
    if config.estimator == "grpo":
        return group_advantages(
            rewards, groups, valid, normalize_std=config.normalize_std, eps=config.eps
        )
    if config.estimator == "rloo":
        return rloo_advantages(rewards, groups, valid)
    raise ValueError(
        f"advantage estimator {config.estimator!r} is per token, from a critic's values "
        "(the critic role): it has no per-sample form"
    )


def batch_from_trajectories(
    trajectories: Sequence[Trajectory],
    config: AdvantageConfig,
    *,
    pad_id: int = 0,
    media_inputs: Sequence[MediaInputs | None] | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages, exclusion of infrastructure failures, and padding, in one call.

    `media_inputs`: optional, one entry per trajectory (dropped with it when it is excluded).

    Returns the batch of valid trajectories and metrics: `advantage/excluded` (infrastructure
    failures dropped), `advantage/mean`, `advantage/abs_mean`, `advantage/zero_frac` (valid
    samples with advantage 0: their group had one value only), `reward/mean` (valid only).
    Raises `ValueError` when no trajectory is valid.
    """
    if media_inputs is not None and len(media_inputs) != len(trajectories):
        raise ValueError(f"{len(media_inputs)} media_inputs for {len(trajectories)} trajectories")
    adv, valid = trajectory_advantages(trajectories, config)
    kept = [t for t, ok in zip(trajectories, valid.tolist(), strict=True) if ok]
    kept_media = (
        None
        if media_inputs is None
        else [m for m, ok in zip(media_inputs, valid.tolist(), strict=True) if ok]
    )
    if not kept:
        raise ValueError(f"all {len(trajectories)} trajectories are infrastructure failures")
    kept_adv = adv[valid]
    rewards = torch.tensor([float(t.reward or 0.0) for t in kept])
    metrics = {
        "advantage/excluded": float(len(trajectories) - len(kept)),
        "advantage/mean": float(kept_adv.mean()),
        "advantage/abs_mean": float(kept_adv.abs().mean()),
        "advantage/zero_frac": float((kept_adv == 0).float().mean()),
        "reward/mean": float(rewards.mean()),
    }
    batch = TrainBatch.from_trajectories(
        kept, kept_adv.tolist(), pad_id=pad_id, media_inputs=kept_media
    )
    return batch, metrics
