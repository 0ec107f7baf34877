"""`RemoteReward` ships only what its reward reads of an episode to the reward role."""

from __future__ import annotations

from typing import Any

from omniloop.platform.control.reward_service import RemoteReward
from omniloop.rewards import reward
from omniloop.rewards.base import RewardScore
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta

TASK = {"id": "t1", "prompt": "?", "answer": "1", "metadata": {}}
TRANSCRIPT = [{"role": "user", "content": "?"}]


class _Call:
    def __init__(self, sent: list[tuple[Any, ...]], args: tuple[Any, ...]) -> None:
        sent.append(args)

    def __await__(self) -> Any:
        async def result() -> RewardScore:
            return RewardScore(1.0, {})

        return result().__await__()


class _Handle:
    """Stands in for the reward deployment's handle: records what each call sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        handle = self

        class _Method:
            def remote(self, *args: Any) -> _Call:
                return _Call(handle.sent, args)

        self.evaluate = _Method()


def _trajectory() -> Trajectory:
    return TrajectoryBuilder([1, 2, 3]).build(TrajectoryMeta(episode_id="e"))


async def test_a_reward_of_the_answer_is_sent_neither_transcript_nor_trajectory() -> None:
    @reward
    def by_answer(task: dict, response: str) -> float:
        return 1.0

    handle = _Handle()
    remote = RemoteReward(by_answer, handle)
    score = await remote.evaluate(TASK, "1", transcript=TRANSCRIPT, trajectory=_trajectory())
    assert score == RewardScore(1.0, {})
    assert handle.sent == [("by_answer", TASK, "1", None, None)]


async def test_a_reward_of_the_tokens_is_sent_the_trajectory() -> None:
    @reward
    def by_tokens(response: str, traj: Trajectory, transcript: list) -> float:
        return 1.0

    handle = _Handle()
    trajectory = _trajectory()
    await RemoteReward(by_tokens, handle).evaluate(
        TASK, "1", transcript=TRANSCRIPT, trajectory=trajectory
    )
    assert handle.sent == [("by_tokens", TASK, "1", TRANSCRIPT, trajectory)]
