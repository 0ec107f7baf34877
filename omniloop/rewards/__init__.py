"""Rewards: `@reward`, `score` (the one place rewards run), and the built-in rewards."""

from omniloop.rewards.base import (
    DEFAULT_REWARD_TIMEOUT,
    CombinedReward,
    Reward,
    RewardFn,
    RewardScore,
    as_reward_fn,
    combine,
    normalize_reward,
    reward,
    score,
)
from omniloop.rewards.builtin import (
    ExactMatch,
    FormatReward,
    MathEqual,
    MathVerifyPool,
    exact_match,
    final_answer,
    format_reward,
    last_boxed,
    math_equal,
    normalize_answer,
)

__all__ = [
    "DEFAULT_REWARD_TIMEOUT",
    "CombinedReward",
    "ExactMatch",
    "FormatReward",
    "MathEqual",
    "MathVerifyPool",
    "Reward",
    "RewardFn",
    "RewardScore",
    "as_reward_fn",
    "combine",
    "exact_match",
    "final_answer",
    "format_reward",
    "last_boxed",
    "math_equal",
    "normalize_answer",
    "normalize_reward",
    "reward",
    "score",
]
