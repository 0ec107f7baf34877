"""Sequence packing: the rows of a right-padded batch packed into fewer rows, so that the padding
a short row carries is filled by other rows' tokens, and the opening that several rows share (a
GRPO group's samples of one prompt) is computed once.

Sharing. In the order of their tokens, a row whose opening is the same as the previous row's for
`min_shared` or more tokens holds only its tokens after that opening and reads the opening from
the previous row (its leader), which may read part of it from its own leader: in token order a
row's longest common opening with any other row is with a neighbour, so this holds every
distinct prefix once (a trie of the rows: a GRPO group's prompt once, and the turns its samples
agree on once). A shared token's hidden state is the same in every row that holds it (causal
attention: it depends only on the tokens before it), so one copy serves them all, forward and
backward: the gradients of the rows that read it add up there as they would over the copies.

Packing. Rows chained by sharing form a unit, in token order (a leader's tokens before its
followers'). Units go longest first into the first packed row with room (first-fit
decreasing); a packed row is as wide as the batch, or as the longest unit where sharing made a
unit wider (at most `UNIT_WIDTHS` times the batch's width). Each token attends to exactly the
earlier tokens of its own row, wherever they are held, and keeps its position in its own row,
so a row's logits are what it gets alone (the model is given each token's position).

The mask is explicit (`visible`): the attention of a packed row computes its masked blocks too,
so a unit longer than the batch's width pays for its attention (at most `UNIT_WIDTHS` times the
padded batch's, and a fraction of it when sharing saves most tokens); the linear layers, which
dominate at the lengths RL on a CPU trains, run on each distinct token once. A varlen attention
kernel (`thd` with Transformer Engine, on GPUs) would also skip the masked blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

UNIT_WIDTHS = 4
"""A unit of rows chained by sharing is at most this many times the batch's width (a row that
would make it wider starts a unit of its own): a packed row's attention computes its masked
blocks, so its cost grows with the square of its width."""


@dataclass(frozen=True)
class Packing:
    """A batch's rows packed (module docstring). Row `b`'s token `i` is at column
    `start[b] + i - shared[b]` of packed row `pack[b]`, or, for `i < shared[b]`, where its
    leader's token `i` is (`at`)."""

    input_ids: Tensor
    """`(P, W)` the packed rows' token ids (0 where a packed row has room left)."""
    positions: Tensor
    """`(P, W)` each token's position in its own row."""
    visible: Tensor
    """`(P, W, W)` True where a query (dim 1) may see a key (dim 2); every query sees itself."""
    pack: Tensor
    """`(B,)` the packed row each row went to (its unit's)."""
    start: Tensor
    """`(B,)` the column where its own tokens start there."""
    lengths: Tensor
    """`(B,)` each row's tokens."""
    leader: Tensor
    """`(B,)` the row a row's opening is read from (itself when it shares none)."""
    shared: Tensor
    """`(B,)` how many tokens of the opening it reads from its leader (0: none)."""
    row_width: int
    """`T`, the width of the batch that was packed."""

    @property
    def mask(self) -> Tensor:
        """megatron's attention mask `(P, 1, W, W)`: True where a query may not see a key."""
        return ~self.visible[:, None]

    def at(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Where token `(rows, positions)` of the batch sits: (packed rows, columns)."""
        holder = rows
        while True:  # a row's leader comes before it in token order: no cycle
            up = positions < self.shared[holder]
            if not bool(up.any()):
                break
            holder = torch.where(up, self.leader[holder], holder)
        return self.pack[holder], self.start[holder] + positions - self.shared[holder]

    def unpack(self, packed: Tensor) -> Tensor:
        """`(B, T, ...)` from `(P, W, ...)` per-token values of the packed rows: row `b`'s
        tokens in its first `n_b` columns, zeros after them."""
        batch, width = self.pack.shape[0], self.row_width
        columns = torch.arange(width, device=packed.device)
        real = columns[None, :] < self.lengths[:, None]
        rows = torch.arange(batch, device=packed.device)[:, None].expand(batch, width)
        positions = torch.minimum(columns[None, :], (self.lengths[:, None] - 1).clamp(min=0))
        source_rows, source_columns = self.at(rows, positions.expand(batch, width))
        out = packed[source_rows, source_columns.clamp(max=packed.shape[1] - 1)]
        return out * real.reshape(batch, width, *([1] * (out.dim() - 2))).to(out.dtype)


@dataclass(frozen=True)
class Units:
    """A batch's rows chained by sharing (module docstring), before they are packed."""

    rows: list[list[int]]
    """Each unit's rows, in token order (each reads its opening from the one before)."""
    size: list[int]
    """Each unit's distinct tokens."""
    lengths: list[int]
    """Each row's tokens."""
    leader: list[int]
    """Per row, the row it reads its opening from (itself: none)."""
    shared: list[int]
    """Per row, the tokens of that opening (0: none)."""

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor, min_shared: int) -> Units:
        """The units of the right-padded rows of `input_ids` (`(B, T)`), rows sharing openings
        of `min_shared` or more tokens (0: every row a unit of its own)."""
        batch, width = input_ids.shape
        tokens = _row_tokens(input_ids, attention_mask)
        lengths = [len(row) for row in tokens]
        order = _in_token_order(tokens)
        leader, shared = list(range(batch)), [0] * batch
        rows: list[list[int]] = []
        size: list[int] = []
        for before, row in zip([None, *order], order, strict=False):
            common = _common_length(tokens[before], tokens[row]) if before is not None else 0
            grown = size[-1] + lengths[row] - common if size else 0
            if 0 < min_shared <= common and grown <= UNIT_WIDTHS * width:
                assert before is not None
                leader[row], shared[row] = before, common
                rows[-1].append(row)
                size[-1] = grown
            else:
                rows.append([row])
                size.append(lengths[row])
        return cls(rows, size, lengths, leader, shared)


def pack_rows(input_ids: Tensor, attention_mask: Tensor, *, min_shared: int = 0) -> Packing:
    """Pack the right-padded rows of `input_ids` (`(B, T)`; real tokens where `attention_mask`
    is 1) into as few rows as first-fit decreasing finds; rows opening with the same
    `min_shared` or more tokens share them (0: no sharing)."""
    batch, width = input_ids.shape
    device = input_ids.device
    units = Units.of(input_ids, attention_mask, min_shared)
    lengths, leader, shared, size = units.lengths, units.leader, units.shared, units.size
    packed_width = max([width, *size])
    used: list[int] = []
    pack, start = [0] * batch, [0] * batch
    for unit in sorted(range(len(size)), key=lambda u: (-size[u], u)):
        target = next((p for p, u in enumerate(used) if u + size[unit] <= packed_width), len(used))
        if target == len(used):
            used.append(0)
        for row in units.rows[unit]:  # a leader's own tokens before its followers'
            pack[row], start[row] = target, used[target]
            used[target] += lengths[row] - shared[row]

    packing = Packing(
        input_ids=torch.zeros(len(used), packed_width, dtype=input_ids.dtype, device=device),
        positions=torch.zeros(len(used), packed_width, dtype=torch.long, device=device),
        # Room left over sees itself only, so that no row of the softmax is empty.
        visible=torch.eye(packed_width, dtype=torch.bool, device=device).repeat(len(used), 1, 1),
        pack=torch.tensor(pack, device=device),
        start=torch.tensor(start, device=device),
        lengths=torch.tensor(lengths, device=device),
        leader=torch.tensor(leader, device=device),
        shared=torch.tensor(shared, device=device),
        row_width=width,
    )
    for row in range(batch):
        p, n, k = pack[row], lengths[row], shared[row]
        if n == k:
            continue  # all of it read from its leader
        own = slice(start[row], start[row] + n - k)
        packing.input_ids[p, own] = input_ids[row, k:n]
        packing.positions[p, own] = torch.arange(k, n, device=device)
        # Its own token i sees the columns of its tokens 0..i, wherever they are held.
        everyone = torch.arange(n, device=device)
        _, columns = packing.at(torch.full((n,), row, device=device), everyone)
        earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        packing.visible[p, columns[k:, None], columns[None, :]] = earlier[k:]
    return packing


def row_costs(input_ids: Tensor, attention_mask: Tensor, min_shared: int = 0) -> list[int]:
    """Per row of a right-padded batch, its tokens after the opening it shares with the row
    before it when that opening is `min_shared` or more tokens (0: every row's tokens whole).
    Over consecutive rows in token order (`token_order`), their sum is the distinct tokens those
    rows hold packed (`Units`; a unit that would pass `UNIT_WIDTHS` widths shares less); in
    another order it is at least that."""
    tokens = _row_tokens(input_ids, attention_mask)
    costs = []
    for before, row in zip([None, *tokens], tokens, strict=False):
        common = _common_length(before, row) if before is not None else 0
        costs.append(len(row) - (common if 0 < min_shared <= common else 0))
    return costs


def token_order(input_ids: Tensor, attention_mask: Tensor) -> list[int]:
    """The rows of a right-padded batch in the order of their tokens (rows that open alike side
    by side; ties by row)."""
    return _in_token_order(_row_tokens(input_ids, attention_mask))


def _row_tokens(input_ids: Tensor, attention_mask: Tensor) -> list[list[int]]:
    """Each right-padded row's real tokens."""
    lengths = attention_mask.sum(-1).tolist()
    return [input_ids[row, : int(n)].tolist() for row, n in enumerate(lengths)]


def _in_token_order(tokens: list[list[int]]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda r: (tokens[r], r))


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
