"""Advantage estimators against numbers worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
import torch

from omniloop.trainer.advantages import (
    distillation_advantages,
    gae,
    group_advantages,
    rloo_advantages,
    row_gae,
    token_advantages,
    whiten,
    with_teacher,
)


def close(actual: torch.Tensor, expected: list[float] | list[list[float]], atol: float = 1e-6):
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


def test_grpo_divides_by_group_mean_and_unbiased_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # Group 0: mean 0.5, deviations ±0.5, unbiased variance (4 * 0.25) / 3.
    a0 = 0.5 / math.sqrt(1.0 / 3.0)  # 0.8660254
    # Group 1: mean 3, deviations ∓1, unbiased variance (1 + 1) / 1 = 2.
    a1 = 1.0 / math.sqrt(2.0)  # 0.7071068
    adv = group_advantages(rewards, groups, eps=0.0)
    close(adv, [a0, -a0, a0, -a0, -a1, a1])


def test_grpo_groups_may_be_interleaved_and_use_any_ids() -> None:
    rewards = torch.tensor([1.0, 5.0, 0.0, 1.0])
    groups = torch.tensor([7, 3, 7, 3])
    # Group 7: [1, 0], mean 0.5, var (0.25 + 0.25) / 1, std 0.7071 -> ±0.7071.
    # Group 3: [5, 1], mean 3, var (4 + 4) / 1 = 8, std 2.8284 -> ±0.7071.
    adv = group_advantages(rewards, groups, eps=0.0)
    close(adv, [0.5 / 0.5**0.5, 2.0 / 8**0.5, -0.5 / 0.5**0.5, -2.0 / 8**0.5])


def test_drgrpo_subtracts_the_mean_without_dividing() -> None:
    adv = group_advantages(
        torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]), normalize_std=False
    )
    close(adv, [2 / 3, -1 / 3, -1 / 3])


def test_invalid_sample_gets_zero_and_leaves_group_statistics() -> None:
    # The third sample is an infrastructure failure; its reward (even NaN) must not count.
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.0])
    valid = torch.tensor([True, True, False, True])
    groups = torch.zeros(4, dtype=torch.long)
    # Valid rewards [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3],
    # unbiased variance (4/9 + 1/9 + 1/9) / 2 = 1/3.
    std = math.sqrt(1.0 / 3.0)
    adv = group_advantages(rewards, groups, valid, eps=0.0)
    close(adv, [(2 / 3) / std, (-1 / 3) / std, 0.0, (-1 / 3) / std])


def test_group_with_one_valid_sample_gets_zero() -> None:
    rewards = torch.tensor([1.0, 0.5, 3.0])
    groups = torch.tensor([0, 0, 1])
    valid = torch.tensor([True, False, True])
    close(group_advantages(rewards, groups, valid), [0.0, 0.0, 0.0])
    close(rloo_advantages(rewards, groups, valid), [0.0, 0.0, 0.0])


def test_group_with_equal_rewards_gets_zero_not_nan() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    close(adv, [0.0, 0.0, 0.0])


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 0]))
    # A_0 = 1 - (0 + 0 + 1) / 3; A_1 = 0 - (1 + 0 + 1) / 3.
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_leaves_invalid_samples_out_of_the_baseline() -> None:
    rewards = torch.tensor([1.0, 0.0, 100.0, 0.0])
    valid = torch.tensor([True, True, False, True])
    adv = rloo_advantages(rewards, torch.zeros(4, dtype=torch.long), valid)
    # Others of sample 0: [0, 0] -> 1 - 0; of sample 1: [1, 0] -> 0 - 0.5.
    close(adv, [1.0, -0.5, 0.0, -0.5])


def test_token_advantages_fill_only_masked_tokens() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    close(token_advantages(torch.tensor([2.0, -1.0]), mask), [[0, 2, 2, 0], [0, 0, -1, -1]])


def test_token_advantages_reject_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="do not match"):
        token_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 4))


def test_gae_matches_hand_recursion() -> None:
    values = torch.tensor([[0.5, 0.4, 0.3]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    # gamma 0.9, lambda 0.8, gamma*lambda = 0.72.
    # t=2: delta = 1 + 0 - 0.3 = 0.7, A = 0.7
    # t=1: delta = 0 + 0.9 * 0.3 - 0.4 = -0.13, A = -0.13 + 0.72 * 0.7 = 0.374
    # t=0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14, A = -0.14 + 0.72 * 0.374 = 0.12928
    adv, ret = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.12928, 0.374, 0.7]])
    close(ret, [[0.62928, 0.774, 1.0]])


def test_gae_skips_tokens_the_policy_did_not_sample() -> None:
    # [prompt, sampled, tool output, sampled, padding]: only the sampled tokens are time steps.
    values = torch.tensor([[9.0, 0.5, 99.0, 0.3, 7.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[0, 1, 0, 1, 0]])
    # t=3: A = 1 - 0.3 = 0.7; t=1 (next sampled is t=3): delta = 0.9 * 0.3 - 0.5 = -0.23,
    # A = -0.23 + 0.72 * 0.7 = 0.274.
    adv, ret = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.0, 0.274, 0.0, 0.7, 0.0]])
    close(ret, [[0.0, 0.774, 0.0, 1.0, 0.0]])


def test_gae_refuses_reward_on_unmasked_token() -> None:
    with pytest.raises(ValueError, match="loss-masked"):
        gae(torch.zeros(1, 3), torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0, 1, 0]]))


def test_whiten_normalizes_masked_entries_only() -> None:
    values = torch.tensor([2.0, 4.0, 6.0, 1000.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean 4, unbiased variance (4 + 0 + 4) / 2 = 4, std 2.
    close(whiten(values, mask, eps=0.0), [-1.0, 0.0, 1.0, 0.0])
    close(whiten(values, mask, shift_mean=False, eps=0.0), [3.0, 4.0, 5.0, 0.0])


def test_distillation_advantage_is_teacher_minus_student() -> None:
    student = torch.tensor([[0.0, -1.5, -1.0]])
    teacher = torch.tensor([[-7.0, -1.0, -2.0]])
    mask = torch.tensor([[0, 1, 1]])
    close(distillation_advantages(student, teacher, mask), [[0.0, 0.5, -1.0]])


def test_the_teacher_s_signal_is_added_to_the_weighted_reward_advantages() -> None:
    advantages = torch.tensor([0.0, 0.0, 1.0, 1.0])
    student = torch.tensor([0.0, -1.0, -1.5, -1.0])
    teacher = torch.tensor([0.0, -9.0, -1.0, -2.0])
    mask = torch.tensor([0, 0, 1, 1])
    mixed = with_teacher(advantages, student, teacher, mask, coef=0.5, reward_weight=2.0)
    close(mixed, [0.0, 0.0, 2.0 + 0.25, 2.0 - 0.5])
    alone = with_teacher(advantages, student, teacher, mask, coef=1.0, reward_weight=0.0)
    close(alone, [0.0, 0.0, 0.5, -1.0])


def test_row_gae_puts_the_reward_on_the_last_sampled_token() -> None:
    values = torch.tensor([0.0, 0.0, 0.5, 0.25, 0.0])
    mask = torch.tensor([0, 0, 1, 1, 0])
    adv, ret = row_gae(values, 1.0, mask, gamma=1.0, lam=1.0)
    close(adv, [0.0, 0.0, 0.5, 0.75, 0.0])
    close(ret, [0.0, 0.0, 1.0, 1.0, 0.0])
    adv, ret = row_gae(values, 1.0, torch.zeros(5), gamma=1.0, lam=1.0)
    assert not adv.any()
    assert not ret.any()
