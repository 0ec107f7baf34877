"""TrainBatch: trajectories become aligned, padded tensors; failures never reach training."""

from __future__ import annotations

import math

import pytest
import torch

from omniloop.trainer.batch import TrainBatch, batch_from_trajectories, trajectory_advantages
from omniloop.trainer.config import AdvantageConfig
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta


def make_traj(
    episode: str,
    *,
    prompt: list[int],
    turns: list[tuple[list[int], list[float], int, list[int]]],
    reward: float | None = 1.0,
    group: str = "g0",
    stop_reason: str = "stop",
) -> Trajectory:
    """A trajectory: each turn is (sampled ids, their logprobs, version, observation ids)."""
    builder = TrajectoryBuilder(prompt)
    for ids, logprobs, version, observation in turns:
        builder.add_sampled(ids, logprobs, version)
        builder.add_observation(observation)
    traj = builder.build(TrajectoryMeta(episode_id=episode, group_id=group))
    traj.reward = reward
    traj.meta.stop_reason = stop_reason  # type: ignore[assignment]
    return traj


def two_turn() -> Trajectory:
    # ids: 10 11 | 20 21 | 30 | 22 ; mask 0 0 1 1 0 1
    return make_traj(
        "a", prompt=[10, 11], turns=[([20, 21], [-0.5, -0.25], 3, [30]), ([22], [-1.0], 4, [])]
    )


def one_turn() -> Trajectory:
    return make_traj("b", prompt=[10], turns=[([40, 41], [-2.0, -3.0], 4, [])], reward=0.0)


def test_from_trajectories_pads_right_and_keeps_token_alignment() -> None:
    batch = TrainBatch.from_trajectories([two_turn(), one_turn()], [2.0, -1.0], pad_id=7)
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 30, 22], [10, 40, 41, 7, 7, 7]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    # Each engine logprob stays at the index of the token it scores.
    assert batch.rollout_logprobs.tolist() == [
        [0, 0, -0.5, -0.25, 0, -1.0],
        [0, -2.0, -3.0, 0, 0, 0],
    ]
    assert batch.advantages.tolist() == [[0, 0, 2, 2, 0, 2], [0, -1, -1, 0, 0, 0]]
    assert batch.weight_version is not None
    assert batch.weight_version.tolist() == [[-1, -1, 3, 3, -1, 4], [-1, 4, 4, -1, -1, -1]]
    assert batch.num_tokens == 5
    assert len(batch) == 2


def test_per_token_advantages_are_zeroed_outside_the_loss_mask() -> None:
    batch = TrainBatch.from_trajectories([one_turn()], [[9.0, 0.5, 0.25]])
    assert batch.advantages.tolist() == [[0.0, 0.5, 0.25]]


def test_per_token_values_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match="2 values for 3 tokens"):
        TrainBatch.from_trajectories([one_turn()], [[0.5, 0.25]])


def test_infrastructure_failure_is_refused() -> None:
    failed = make_traj("c", prompt=[1], turns=[([2], [-1.0], 0, [])], stop_reason="sandbox_error")
    with pytest.raises(ValueError, match="sandbox_error"):
        TrainBatch.from_trajectories([failed], [0.0])


def test_loss_mask_on_position_zero_is_refused() -> None:
    ones = torch.ones(1, 3)
    with pytest.raises(ValueError, match="position 0"):
        TrainBatch(torch.zeros(1, 3, dtype=torch.long), ones.long(), ones, ones, ones)


def test_loss_mask_on_padding_is_refused() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    attention = torch.tensor([[1, 1, 0]])
    with pytest.raises(ValueError, match="padding"):
        TrainBatch(torch.zeros(1, 3, dtype=torch.long), attention, mask, mask, mask)


def test_split_trims_each_micro_batch_to_its_longest_row() -> None:
    long = make_traj("l", prompt=[1, 2, 3, 4], turns=[([5, 6, 7, 8], [-1.0] * 4, 0, [])])
    batch = TrainBatch.from_trajectories([long, one_turn(), one_turn()], [1.0, 2.0, 3.0])
    parts = batch.split(2)
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 8), (1, 3)]
    assert parts[1].input_ids.tolist() == [[10, 40, 41]]
    assert parts[1].advantages.tolist() == [[0.0, 3.0, 3.0]]
    assert parts[1].ids == (batch.ids[2],)


def test_split_tokens_fills_each_micro_batch_up_to_the_budget() -> None:
    """Two groups of three samples of a 20-token prompt, in token order, each sample 20 + 2
    tokens. Counted with the prompt held once, a group is 26 tokens: a budget of 30 takes one
    group per micro-batch, one of 60 both; counted whole (no sharing) 22 each, so 30 takes one
    row. A row over the budget is a micro-batch of its own, and every row lands exactly once,
    in order."""
    trajs = [
        make_traj(
            f"{group}-{sample}",
            prompt=[100 * group + i for i in range(1, 21)],
            turns=[([7 + sample, 8], [-1.0] * 2, 0, [])],
            group=str(group),
        )
        for group in range(2)
        for sample in range(3)
    ]
    batch = TrainBatch.from_trajectories(trajs, [1.0] * 6)

    def cut(budget: int, min_shared: int) -> list[list[str]]:
        return [list(part.ids) for part in batch.split_tokens(budget, min_shared)]

    ids = list(batch.ids)
    assert cut(30, 16) == [ids[:3], ids[3:]]
    assert cut(60, 16) == [ids]
    assert cut(30, 0) == [[i] for i in ids]
    assert cut(50, 0) == [ids[0:2], ids[2:4], ids[4:6]]
    # 22 + 2 fit 25, a third sample does not; it starts the next micro-batch, where it holds
    # the prompt itself (22), so the next group's first row (22) does not fit beside it.
    assert cut(25, 16) == [ids[0:2], [ids[2]], ids[3:5], [ids[5]]]
    assert cut(10, 16) == [[i] for i in ids]
    parts = batch.split_tokens(30, 16)
    assert [tuple(p.input_ids.shape) for p in parts] == [(3, 22), (3, 22)]
    with pytest.raises(ValueError, match="budget must be positive, got 0"):
        batch.split_tokens(0)


def test_shards_keep_rows_sharing_an_opening_together() -> None:
    """Three groups of four samples of one 20-token prompt, in mixed order: with sharing each
    group goes to one rank whole (its rank's packed step holds the prompt once), the ranks
    balanced by distinct tokens; without, rows are balanced one by one."""
    trajs = [
        make_traj(
            f"{group}-{sample}",
            prompt=[100 * group + i for i in range(1, 21)],
            turns=[([7 + sample] * (1 + sample), [-1.0] * (1 + sample), 0, [])],
            group=str(group),
        )
        for sample in range(4)
        for group in range(3)
    ]
    batch = TrainBatch.from_trajectories(trajs, [1.0] * 12)
    group_of = [int(first) // 100 for first in batch.input_ids[:, 0]]
    shards = batch.shards(2, min_shared=16)
    assert sorted(row for shard in shards for row in shard) == list(range(12))
    # Whole groups (30 distinct tokens each): one rank holds one, the other two.
    assert sorted(len(shard) for shard in shards) == [4, 8]
    assert all(len({group_of[row] for row in shard}) * 4 == len(shard) for shard in shards)
    alone = batch.shards(2)
    assert sorted(map(len, alone)) == [6, 6]
    assert all(len({group_of[row] for row in shard}) == 3 for shard in alone)
    assert batch.shard(1, 2, min_shared=16).ids == tuple(batch.ids[r] for r in shards[1])


def single(episode: str, reward: float | None, group: str = "g0", stop: str = "stop") -> Trajectory:
    """A one-token answer to a one-token prompt."""
    return make_traj(
        episode, prompt=[1], turns=[([2], [0.0], 0, [])], reward=reward, group=group,
        stop_reason=stop,
    )  # fmt: skip


def test_trajectory_advantages_group_and_exclude_failures() -> None:
    trajs = [
        single("1", 1.0, "x"),
        single("2", 0.0, "y"),
        single("3", 0.0, "x"),
        single("4", None, "x", stop="engine_error"),
        single("5", 1.0, "y"),
        single("6", 0.0, "x"),
    ]
    adv, valid = trajectory_advantages(trajs, AdvantageConfig(estimator="rloo"))
    assert valid.tolist() == [True, True, True, False, True, True]
    # Group x valid rewards [1, 0, 0]: RLOO 1 - 0, 0 - 0.5, 0 - 0.5. Group y [0, 1]: -1, +1.
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -0.5, 0.0, 1.0, -0.5]))


def test_batch_from_trajectories_drops_failures_and_reports_them() -> None:
    trajs = [single("1", 1.0), single("2", 0.0), single("3", None, stop="cancelled")]
    batch, metrics = batch_from_trajectories(trajs, AdvantageConfig(eps=1e-12))
    assert len(batch) == 2
    assert metrics["advantage/excluded"] == 1.0
    assert metrics["reward/mean"] == 0.5
    # Rewards [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> ±0.5 / 0.70711.
    a = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(batch.advantages, torch.tensor([[0.0, a], [0.0, -a]]))


def test_unscored_trajectory_is_an_error() -> None:
    with pytest.raises(ValueError, match="no reward"):
        trajectory_advantages([single("1", None)], AdvantageConfig())


def test_trajectory_without_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="group_id"):
        trajectory_advantages([single("1", 1.0, group="")], AdvantageConfig())
