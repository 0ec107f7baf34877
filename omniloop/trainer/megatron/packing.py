"""Sequence packing for `GPTModel`: the rows of a right-padded batch packed into fewer rows of
the same width, so that the padding a short row carries is filled by other rows' tokens.

Rows go longest first into the first packed row with room (first-fit decreasing); a packed row is
never wider than the batch, so the packed batch costs at most what the padded one does, in the
linear layers and in attention alike. Each token attends only to the earlier tokens of its own
row (a block-diagonal causal mask) and each row's positions start at 0, so a row's logits are
what it gets alone: with rotary embeddings (our Llama / Qwen2 families) attention sees only
relative positions within a row, whatever column the row starts at.

The mask is explicit (megatron's local attention, which runs on the CPU); a varlen attention
kernel (`thd` with Transformer Engine, on GPUs) would also skip the masked blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """A batch's rows packed (module docstring): row `b`'s `n_b` tokens are columns
    `start[b] .. start[b] + n_b` of packed row `pack[b]`."""

    input_ids: Tensor
    """`(P, T)` the packed rows' token ids (0 where a packed row has room left)."""
    positions: Tensor
    """`(P, T)` each token's position in its own row."""
    mask: Tensor
    """`(P, 1, T, T)` megatron's attention mask: True where a query may not see a key."""
    pack: Tensor
    """`(B,)` the packed row each row went to."""
    start: Tensor
    """`(B,)` the column it starts at there."""
    lengths: Tensor
    """`(B,)` each row's tokens."""

    def unpack(self, packed: Tensor) -> Tensor:
        """`(B, T, ...)` from `(P, T, ...)` per-token values of the packed rows: row `b`'s
        tokens in its first `n_b` columns, zeros after them."""
        batch, width = self.pack.shape[0], packed.shape[1]
        columns = torch.arange(width, device=packed.device)
        source = (self.start[:, None] + columns).clamp(max=width - 1)
        out = packed[self.pack[:, None].expand(batch, width), source]
        real = columns[None, :] < self.lengths[:, None]
        return out * real.reshape(batch, width, *([1] * (out.dim() - 2))).to(out.dtype)

    def at(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Where token `(rows, positions)` of the batch sits: (packed rows, columns)."""
        return self.pack[rows], self.start[rows] + positions


def pack_rows(input_ids: Tensor, attention_mask: Tensor) -> Packing:
    """Pack the right-padded rows of `input_ids` (`(B, T)`; real tokens where `attention_mask`
    is 1) into as few rows of width `T` as first-fit decreasing finds."""
    batch, width = input_ids.shape
    device = input_ids.device
    lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
    used: list[int] = []
    pack, start = [0] * batch, [0] * batch
    for row in sorted(range(batch), key=lambda r: (-lengths[r], r)):
        target = next((p for p, u in enumerate(used) if u + lengths[row] <= width), len(used))
        if target == len(used):
            used.append(0)
        pack[row], start[row] = target, used[target]
        used[target] += lengths[row]
    packs = len(used)
    ids = torch.zeros(packs, width, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(packs, width, dtype=torch.long, device=device)
    # A column's segment: the row whose token it holds, or a segment of its own (negative) for
    # room left over, so that every query sees at least itself (no row of the softmax empty).
    segment = -1 - torch.arange(width, device=device).repeat(packs, 1)
    for row in range(batch):
        p, s, n = pack[row], start[row], lengths[row]
        ids[p, s : s + n] = input_ids[row, :n]
        positions[p, s : s + n] = torch.arange(n, device=device)
        segment[p, s : s + n] = row
    columns = torch.arange(width, device=device)
    causal = columns[None, :] <= columns[:, None]  # (query, key)
    visible = (segment[:, :, None] == segment[:, None, :]) & causal
    return Packing(
        input_ids=ids,
        positions=positions,
        mask=~visible[:, None],
        pack=torch.tensor(pack, device=device),
        start=torch.tensor(start, device=device),
        lengths=torch.tensor(lengths, device=device),
    )
