"""`trainer/packing.py`: rows packed first-fit decreasing into rows of the batch's
width, each token seeing only the earlier tokens of its own row."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from omniloop.trainer.packing import pack_rows


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


def assert_rows_see_themselves_only(packing, ids: torch.Tensor, lengths: list[int]) -> None:
    """Each token of each row is found (`at`) at a column holding its id and position, and
    the token there sees exactly the columns of its own row's earlier tokens."""
    for row, n in enumerate(lengths):
        positions = torch.arange(n)
        packs, columns = packing.at(torch.full((n,), row), positions)
        assert bool((packs == packs[0]).all())
        p = int(packs[0])
        assert torch.equal(packing.input_ids[p, columns], ids[row, :n])
        assert torch.equal(packing.positions[p, columns], positions)
        for i in range(n):
            expected = torch.zeros(packing.visible.shape[-1], dtype=torch.bool)
            expected[columns[: i + 1]] = True
            assert torch.equal(packing.visible[p, columns[i]], expected), (row, i)


@given(
    st.lists(st.lists(st.integers(1, 3), min_size=0, max_size=6), min_size=1, max_size=3),
    st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 3), max_size=5)), max_size=8),
    st.integers(1, 4),
)
def test_rows_sharing_an_opening_read_it_from_one_copy(
    openings: list[list[int]], rows: list[tuple[int, list[int]]], min_shared: int
) -> None:
    """Rows built from a few openings and random tails (so some share, some are equal or
    prefixes of others): every token is where `at` says, sees exactly its own row's earlier
    tokens, and `unpack` gives each row back."""
    sequences = [openings[k % len(openings)] + tail for k, tail in rows]
    sequences = [s for s in sequences if s] or [[1]]
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    attention = torch.zeros(len(sequences), width, dtype=torch.long)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, tokens in enumerate(sequences):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
    packing = pack_rows(ids, attention, min_shared=min_shared)
    assert_rows_see_themselves_only(packing, ids, lengths)
    assert bool(packing.visible.diagonal(dim1=1, dim2=2).all())  # no empty softmax
    for row in range(len(sequences)):
        assert int(packing.shared[row]) == 0 or int(packing.shared[row]) >= min_shared
    # Every distinct opening is held once: the packed tokens are fewer by the shared ones.
    held = int((packing.input_ids != 0).sum())
    assert held == sum(lengths) - int(packing.shared.sum())
    values = packing.input_ids.float()[..., None].repeat(1, 1, 2)
    assert torch.equal(packing.unpack(values), ids.float()[..., None].repeat(1, 1, 2))


def test_a_group_shares_its_prompt_and_the_unit_may_be_wider_than_the_batch() -> None:
    prompt = list(range(10, 20))
    sequences = [[*prompt, 1, 2], [*prompt, 3], [*prompt, 1, 2, 4], [7, 8, 9]]
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(4, 13, dtype=torch.long)
    attention = torch.zeros(4, 13, dtype=torch.long)
    for row, tokens in enumerate(sequences):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
    packing = pack_rows(ids, attention, min_shared=8)
    # In token order rows 0, 2, 1: row 2 reads its first 12 tokens from row 0, row 1 its first
    # 10 from row 2 (which holds them at row 0's columns).
    assert packing.leader.tolist() == [0, 2, 0, 3]
    assert packing.shared.tolist() == [0, 10, 12, 0]
    assert packing.at(torch.tensor([1, 1]), torch.tensor([9, 10]))[1].tolist() == [9, 13]
    # One unit of 12 + 1 + 1 = 14 tokens, wider than the batch's 13: the packed rows are 14.
    assert packing.input_ids.shape == (2, 14)
    assert_rows_see_themselves_only(packing, ids, lengths)
    assert pack_rows(ids, attention, min_shared=11).shared.tolist() == [0, 0, 12, 0]
    assert pack_rows(ids, attention).shared.tolist() == [0, 0, 0, 0]


def test_a_unit_is_at_most_four_batch_widths() -> None:
    """Twelve rows of 10 tokens sharing 2: a unit holds 10 + 8 * k tokens, at most 40, so the
    rows go in units of 4 (34 tokens), each unit's first row holding its opening again."""
    ids = torch.arange(1, 121).reshape(12, 10)
    ids[:, :2] = torch.tensor([5, 6])
    packing = pack_rows(ids, torch.ones_like(ids), min_shared=2)
    assert packing.shared.tolist() == [0, 2, 2, 2] * 3
    assert packing.input_ids.shape == (3, 34)
    assert_rows_see_themselves_only(packing, ids, [10] * 12)
