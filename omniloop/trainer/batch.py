"""`TrainBatch`: trajectories as padded tensors, the unit the trainer backends consume.

Layout: `B` sequences right-padded to a common length `T`. Every per-token tensor is `(B, T)` and
index `i` belongs to token `i` of `input_ids`, exactly as in `Trajectory` (DESIGN.md §2):
`rollout_logprobs[b, i]` is the engine's logprob of `input_ids[b, i]`, and so are `advantages`,
`old_logprobs` and `ref_logprobs` at `[b, i]`. Position 0 has no logprob (nothing precedes it)
and can never be in the loss mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from omniloop.trainer.advantages import group_advantages, rloo_advantages
from omniloop.trainer.config import AdvantageConfig
from omniloop.trajectory import INFRA_STOP_REASONS, Trajectory

Values = float | Sequence[float] | Tensor
"""One number for every token, or one per token."""


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
    padding and at position 0; `ids` is empty or has `B` entries.
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
        trained = self.loss_mask != 0
        if bool((trained & (self.attention_mask == 0)).any()):
            raise ValueError("loss_mask covers padding")
        if shape[1] and bool(trained[:, 0].any()):
            raise ValueError("loss_mask covers position 0, which has no logprob")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Loss-masked tokens in the batch."""
        return int((self.loss_mask != 0).sum())

    @classmethod
    def from_rows(cls, rows: Sequence[TrainRow], *, pad_id: int = 0) -> TrainBatch:
        """Pad rows into a batch: the one place a batch is built (`from_trajectories` makes
        rows of trajectories). `old_logprobs` are taken from the rows when every row has them.
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
        )

    @classmethod
    def for_scoring(
        cls, sequences: Sequence[Sequence[int] | Tensor], *, pad_id: int = 0
    ) -> TrainBatch:
        """Token sequences, right-padded, with nothing to train (zero loss mask, advantages
        and logprobs): all that scoring them (`logprobs`, a reference's) reads."""
        if not sequences:
            raise ValueError("a batch needs at least one row")
        length = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), length), dtype=torch.long)
        for b, sequence in enumerate(sequences):
            ids[b, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
            attention[b, : len(sequence)] = 1
        zeros = torch.zeros(ids.shape)
        return cls(ids, attention, zeros, zeros, zeros)

    @classmethod
    def from_trajectories(
        cls,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[float] | Sequence[Sequence[float]] | Tensor | None,
        *,
        pad_id: int = 0,
        old_logprobs: Sequence[Sequence[float]] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> TrainBatch:
        """Pad trajectories into a batch.

        `advantages`: one float per trajectory (broadcast to its loss-masked tokens), or one list
        per trajectory with a value per token (e.g. from `gae`), or None for zeros (a batch only
        scored with `logprobs`, never trained). Per-token values are zeroed outside the loss
        mask. `old_logprobs` / `ref_logprobs`: optional per-token lists, same alignment.
        Infrastructure failures are refused: they must be dropped, not trained (DESIGN.md §2).
        The padding id is irrelevant to the result (padding is masked and comes after every real
        token, which causal attention never lets a real token see).
        """
        if not trajectories:
            raise ValueError("a batch needs at least one trajectory")
        n = len(trajectories)
        if advantages is not None and len(advantages) != n:
            raise ValueError(f"{len(advantages)} advantages for {n} trajectories")
        for name, extra in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
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
                )
            )
        return cls.from_rows(rows, pad_id=pad_id)

    def replace(self, **changes: object) -> TrainBatch:
        """A copy with some fields replaced (e.g. `old_logprobs=backend.logprobs(batch)`)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def select(self, rows: slice | Sequence[int]) -> TrainBatch:
        """The given rows, trimmed to their longest sequence (so no column is padding only)."""
        if isinstance(rows, slice):
            index: slice | Tensor = rows
            ids = self.ids[rows]
        else:
            index = torch.tensor(list(rows), dtype=torch.long)
            ids = tuple(self.ids[i] for i in rows) if self.ids else ()
        attention = self.attention_mask[index]
        width = int(attention.sum(-1).max()) if attention.shape[0] else 0
        values: dict[str, object] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                values[field.name] = value[index][:, :width]
        return self.replace(**values, ids=ids)

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Consecutive micro-batches of at most `micro_batch_size` rows, each trimmed."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        return [
            self.select(slice(start, start + micro_batch_size))
            for start in range(0, len(self), micro_batch_size)
        ]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return self.replace(**moved)


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
    return rloo_advantages(rewards, groups, valid)


def batch_from_trajectories(
    trajectories: Sequence[Trajectory], config: AdvantageConfig, *, pad_id: int = 0
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages, exclusion of infrastructure failures, and padding, in one call.

    Returns the batch of valid trajectories and metrics: `advantage/excluded` (infrastructure
    failures dropped), `advantage/mean`, `advantage/abs_mean`, `advantage/zero_frac` (valid
    samples with advantage 0: their group had one value only), `reward/mean` (valid only).
    Raises `ValueError` when no trajectory is valid.
    """
    adv, valid = trajectory_advantages(trajectories, config)
    kept = [t for t, ok in zip(trajectories, valid.tolist(), strict=True) if ok]
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
    return TrainBatch.from_trajectories(kept, kept_adv.tolist(), pad_id=pad_id), metrics
