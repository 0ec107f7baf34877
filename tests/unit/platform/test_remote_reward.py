"""`RemoteReward`: what it ships of an episode to the reward role, and how evaluations that
arrive together travel as one call whose results come back one by one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError

from omniloop.errors import RewardError
from omniloop.platform.control.reward_service import RemoteReward
from omniloop.rewards import reward
from omniloop.rewards.base import RewardScore
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta

TASK = {"id": "t1", "prompt": "?", "answer": "1", "metadata": {}}
TRANSCRIPT = [{"role": "user", "content": "?"}]

Answer = Callable[[list[Any]], AsyncGenerator[list[tuple[int, RewardScore | str]]]]


async def _all_at_once(evaluations: list[Any]) -> AsyncGenerator[list[tuple[int, Any]]]:
    yield [
        (i, RewardScore(float(response), {})) for i, (_, response, _, _) in enumerate(evaluations)
    ]


class _Stream:
    def __init__(self, answer: AsyncGenerator[Any]) -> None:
        self._answer = answer
        self.cancelled = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        return await self._answer.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """Stands in for the reward deployment's handle: records each call, answers with
    `answer(evaluations)`."""

    def __init__(self, answer: Answer = _all_at_once) -> None:
        self.calls: list[tuple[str, list[Any]]] = []
        self.streams: list[_Stream] = []
        handle = self

        class _Method:
            def remote(self, name: str, evaluations: list[Any]) -> _Stream:
                handle.calls.append((name, evaluations))
                handle.streams.append(_Stream(answer(evaluations)))
                return handle.streams[-1]

        self.evaluate_many = _Method()

    def options(self, *, stream: bool) -> _Handle:
        assert stream
        return self


@reward
def by_answer(task: dict, response: str) -> float:
    return 1.0


def _trajectory() -> Trajectory:
    return TrajectoryBuilder([1, 2, 3]).build(TrajectoryMeta(episode_id="e"))


async def test_a_reward_of_the_answer_is_sent_neither_transcript_nor_trajectory() -> None:
    handle = _Handle()
    remote = RemoteReward(by_answer, handle)
    score = await remote.evaluate(TASK, "1", transcript=TRANSCRIPT, trajectory=_trajectory())
    assert score == RewardScore(1.0, {})
    assert handle.calls == [("by_answer", [(TASK, "1", None, None)])]


async def test_a_reward_of_the_tokens_is_sent_the_trajectory() -> None:
    @reward
    def by_tokens(response: str, traj: Trajectory, transcript: list) -> float:
        return 1.0

    handle = _Handle()
    trajectory = _trajectory()
    await RemoteReward(by_tokens, handle).evaluate(
        TASK, "1", transcript=TRANSCRIPT, trajectory=trajectory
    )
    assert handle.calls == [("by_tokens", [(TASK, "1", TRANSCRIPT, trajectory)])]


async def test_evaluations_within_the_wait_go_as_one_call_each_with_its_own_result() -> None:
    handle = _Handle()
    remote = RemoteReward(by_answer, handle, batch_wait_s=0.05)

    async def later(response: str, delay: float) -> RewardScore:
        await asyncio.sleep(delay)
        return await remote.evaluate(TASK, response)

    scores = await asyncio.gather(later("1", 0), later("2", 0.01), later("3", 0.02))
    assert [s.total for s in scores] == [1.0, 2.0, 3.0]
    assert [len(evaluations) for _, evaluations in handle.calls] == [3]
    # One that arrives after the batch has gone goes in a call of its own.
    await asyncio.sleep(0.06)
    assert (await later("4", 0)).total == 4.0
    assert [len(evaluations) for _, evaluations in handle.calls] == [3, 1]


async def test_a_slow_evaluation_holds_back_no_other_and_a_failure_is_its_caller_s() -> None:
    release = asyncio.Event()

    async def answer(evaluations: list[Any]) -> AsyncGenerator[list[tuple[int, Any]]]:
        yield [(1, "reward 'by_answer' raised ValueError: no answer")]
        yield [(2, RewardScore(2.0, {}))]
        await release.wait()
        yield [(0, RewardScore(0.0, {}))]

    handle = _Handle(answer)
    remote = RemoteReward(by_answer, handle, batch_wait_s=0.01)
    slow = asyncio.create_task(remote.evaluate(TASK, "0"))
    failing = asyncio.create_task(remote.evaluate(TASK, "1"))
    quick = asyncio.create_task(remote.evaluate(TASK, "2"))
    assert (await quick).total == 2.0
    with pytest.raises(RewardError, match="raised ValueError: no answer"):
        await failing
    assert not slow.done()
    release.set()
    assert (await slow).total == 0.0
    assert len(handle.calls) == 1
    assert not handle.streams[0].cancelled


async def test_a_lost_call_fails_every_evaluation_it_held() -> None:
    async def answer(evaluations: list[Any]) -> AsyncGenerator[list[tuple[int, Any]]]:
        yield [(0, RewardScore(0.0, {}))]
        raise ConnectionError("the replica died")

    remote = RemoteReward(by_answer, _Handle(answer), batch_wait_s=0.01)
    first, second, third = await asyncio.gather(
        *(remote.evaluate(TASK, r) for r in "012"), return_exceptions=True
    )
    assert first == RewardScore(0.0, {})
    assert isinstance(second, ConnectionError)
    assert isinstance(third, ConnectionError)


async def test_a_refused_call_is_sent_again() -> None:
    refused = [False, True]  # popped from the end: the first call is refused

    async def answer(evaluations: list[Any]) -> AsyncGenerator[list[tuple[int, Any]]]:
        if refused.pop():
            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)
        async for finished in _all_at_once(evaluations):
            yield finished

    handle = _Handle(answer)
    assert (await RemoteReward(by_answer, handle).evaluate(TASK, "5")).total == 5.0
    assert len(handle.calls) == 2


async def test_callers_that_all_gave_up_cancel_the_call() -> None:
    async def answer(evaluations: list[Any]) -> AsyncGenerator[list[tuple[int, Any]]]:
        await asyncio.Event().wait()  # a hung reward
        yield []

    handle = _Handle(answer)
    remote = RemoteReward(by_answer, handle)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await remote.evaluate(TASK, "1")
    await asyncio.sleep(0.01)
    assert handle.streams[0].cancelled
