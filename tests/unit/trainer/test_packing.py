"""`trainer/megatron/packing.py`: rows packed first-fit decreasing into rows of the batch's
width, each token seeing only the earlier tokens of its own row."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from omniloop.trainer.megatron.packing import pack_rows


def batch(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
    ids = (torch.arange(len(lengths) * width).reshape(len(lengths), width) + 1) * attention
    return ids, attention


@given(st.lists(st.integers(1, 12), min_size=1, max_size=10), st.integers(0, 4))
def test_every_row_lands_whole_in_one_packed_row_seeing_only_itself(
    lengths: list[int], room: int
) -> None:
    width = max(lengths) + room
    ids, attention = batch(lengths, width)
    packing = pack_rows(ids, attention)
    packs = packing.input_ids.shape[0]
    assert packing.input_ids.shape == (packs, width)
    assert packs <= len(lengths)
    owner = torch.full((packs, width), -1)
    for row, n in enumerate(lengths):
        p, s = int(packing.pack[row]), int(packing.start[row])
        assert s + n <= width
        assert torch.equal(packing.input_ids[p, s : s + n], ids[row, :n])
        assert torch.equal(packing.positions[p, s : s + n], torch.arange(n))
        assert bool((owner[p, s : s + n] == -1).all())  # no two rows share a column
        owner[p, s : s + n] = row
        visible = ~packing.mask[p, 0, s : s + n]
        # a token sees exactly the tokens of its own row up to itself
        expected = torch.zeros(n, width, dtype=torch.bool)
        for i in range(n):
            expected[i, s : s + i + 1] = True
        assert torch.equal(visible, expected)
    assert bool((~packing.mask).any(-1).all())  # every query sees something: no empty softmax
    # per-token values come back to their rows, zeros after a row's end
    values = packing.input_ids.float()[..., None].repeat(1, 1, 3)
    assert torch.equal(packing.unpack(values), ids.float()[..., None].repeat(1, 1, 3))


def test_short_rows_fill_a_long_row_s_padding() -> None:
    ids, attention = batch([8, 5, 3, 2, 1], 8)
    packing = pack_rows(ids, attention)
    assert packing.input_ids.shape[0] == 3  # [8], [5, 3], [2, 1]
    assert packing.pack.tolist() == [0, 1, 1, 2, 2]
    assert packing.start.tolist() == [0, 0, 5, 0, 2]
    rows, columns = packing.at(torch.tensor([2, 4]), torch.tensor([1, 0]))
    assert rows.tolist() == [1, 2]
    assert columns.tolist() == [6, 2]
