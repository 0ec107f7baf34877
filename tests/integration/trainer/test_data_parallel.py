"""Data-parallel ranks (`trainer/data_parallel.py`): two processes over gloo, each training its
own rows of a batch, take the steps one process takes on the whole batch; every row is trained
by exactly one rank; with the optimizer's state sharded, each holds part of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.data_parallel import shard_rows
from omniloop.trainer.torch_backend import TorchTrainerBackend

EXACT = 1e-5
# Weights after two AdamW steps at lr 1e-3: a gradient near zero, summed in another order, can
# move its weight differently by a fraction of lr (each step moves a weight by ~lr * sign).
STEPPED = 5e-5


@given(st.lists(st.integers(1, 500), max_size=40), st.integers(1, 6))
def test_every_row_is_in_exactly_one_shard_and_the_shards_are_balanced(
    tokens: list[int], ranks: int
) -> None:
    shards = shard_rows(tokens, ranks)
    assert len(shards) == ranks
    assert sorted(row for shard in shards for row in shard) == list(range(len(tokens)))
    loads = [sum(tokens[row] for row in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(tokens, default=0)
    assert shard_rows(tokens, ranks) == shards  # every rank computes the same split


def test_a_rank_outside_the_group_is_refused(make_batch) -> None:
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        make_batch([5, 6]).shard(2, 2)


@pytest.mark.parametrize(
    ("backend", "rows", "sharded"),
    [
        ("torch", [13, 9, 17, 6, 11], False),
        ("megatron", [13, 9, 17, 6, 11], False),
        ("torch", [13], False),
        ("torch", [13, 9, 17, 6, 11], True),
    ],
    ids=["torch", "megatron", "torch-one-row", "torch-sharded-optimizer"],
)
def test_two_data_parallel_ranks_train_as_one_rank_given_every_row(
    tmp_path: Path, make_batch, rank_script, backend: str, rows: list[int], sharded: bool
) -> None:
    """(With one row, the second rank has none and still takes its part in the step. With the
    optimizer's state sharded, each rank holds a part of it, and their checkpoint holds it
    whole.)"""
    batch = make_batch(rows, advantages=[1.0, -0.7, 0.4, -0.2, 0.9][: len(rows)], seed=7)
    batch = batch.replace(ids=tuple(f"row-{i}" for i in range(len(rows))))
    torch.save(batch, tmp_path / "batch.pt")
    script, ranks = rank_script("dp_ranks")
    one = ranks.alone(backend, batch)

    out = tmp_path / "seen"
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, str(script), str(rank), "2", str(tmp_path / "store")),
                *(str(tmp_path / "batch.pt"), backend, str(out), "1" if sharded else "0"),
            ]
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    seen = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]

    trained = [row for rank in seen for row in rank["ids"]]
    assert sorted(trained) == sorted(batch.ids)  # every row once, by one rank
    assert sum(bool(rank["ids"]) for rank in seen) == min(2, len(rows))
    for key in ("actor/grad_norm", "actor/num_tokens", "actor/num_seqs", "actor/loss"):
        for step in range(2):
            expected = one["metrics"][step][key]
            for rank in seen:
                assert rank["metrics"][step][key] == pytest.approx(expected, rel=1e-5), key
    for rank in seen:
        assert (rank["after"] - one["after"]).abs().max() < EXACT
        for name, weight in one["weights"].items():
            torch.testing.assert_close(rank["weights"][name], weight, atol=STEPPED, rtol=0)

    held = [rank["optimizer_bytes"] for rank in seen]
    if sharded:
        # Whole parameters, balanced by size: the tiny model's embedding, most of it, on one.
        assert sum(held) == one["optimizer_bytes"], "each parameter's state on one rank"
        assert min(held) > 0, held
    else:
        assert held == [one["optimizer_bytes"]] * 2
    resumed = TorchTrainerBackend("tiny", TrainerConfig(device="cpu", backend=backend))
    assert resumed.load(f"{out}.checkpoint") == {"step": 2}
    for name, weight in resumed.named_weights():
        assert torch.equal(weight, seen[0]["weights"][name]), name
    state = resumed.optimizer.state_dict()["state"]
    assert len(state) == len(list(resumed.model.parameters()))
