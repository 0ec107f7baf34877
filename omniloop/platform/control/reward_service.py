"""The reward role: reward functions in processes of their own (a Ray Serve deployment).

A rollout replica scores each episode through `RemoteReward`s, one per configured reward,
which satisfy `RewardFn` and call the `reward` deployment, where the real functions run. The
evaluations of one reward that arrive within `services.reward_batch_wait_s` of each other (a
GRPO group's episodes end close together) travel as one call, `RewardServer.evaluate_many`,
whose answer streams each evaluation's result back as it finishes: one slow evaluation holds
back no other. What a misbehaving reward costs:

- one that **raises** or returns garbage: that episode is `reward_error` (as in process);
- one that **crashes its process** (a segfault, `os._exit`): only its replica dies, and every
  episode it was scoring at that moment is `reward_error`; Serve starts a new replica;
- one that **hangs**: the caller's timeout (`reward.timeout`, else `rollout.reward_timeout`)
  makes the episode `reward_error`; the replica's health check then fails (an evaluation past
  its deadline plus `HANG_GRACE_S`), so Serve replaces it and the stuck thread goes with it;
- one that **allocates without bound**: a watchdog thread ends the replica's process when its
  resident memory passes `services.reward_memory_mb`, before the machine runs short; the
  episodes it was scoring are `reward_error`.

No failure of a reward is retried: a deterministic crash would only crash again, and an
episode is never trained on a reward it did not get (`reward_error` is an infrastructure stop
reason: excluded from training and counted, and the run's infra-error bound applies). A call
the deployment refuses because its queue is full (`services.max_queued_requests`) is no
failure: it is sent again after a pause, within the reward's timeout.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncGenerator
from typing import Any

from omniloop.rewards import RewardFn
from omniloop.rewards.base import (
    RewardError,
    RewardScore,
    Transcript,
    as_reward_fn,
    reward_inputs,
)
from omniloop.trajectory import Trajectory

HANG_GRACE_S = 5.0
"""Seconds past its deadline an evaluation may still run before its replica counts as hung."""
REFUSED_PAUSE_S = 0.2
"""Seconds before a call the deployment refused (its queue was full) is sent again."""
WATCHDOG_PERIOD_S = 0.1
MAX_BATCH = 256
"""Most evaluations in one call to the reward role; a full batch is sent at once."""

Evaluation = tuple[dict[str, Any], str, Transcript | None, Trajectory | None]
"""What one evaluation sends: the task, the response, and the transcript and trajectory where
the reward reads them (else None)."""
"""How often the memory watchdog looks at the replica's resident memory."""


class RewardServer:
    """A reward replica: evaluates the configured rewards by name."""

    def __init__(
        self,
        specs: list[str],
        default_timeout: float | None,
        memory_mb: int,
        cwd: str,
        paths: list[str],
    ) -> None:
        from omniloop.platform.control.components import build_rewards
        from omniloop.platform.control.replica import enter_run_folder

        enter_run_folder(cwd, paths)
        self._fns = {fn.name: fn for fn in map(as_reward_fn, build_rewards(specs))}
        self._default_timeout = default_timeout
        self._running: dict[int, float] = {}
        """Evaluation -> its deadline (monotonic seconds), for the hang check."""
        self._next = 0
        limit = memory_mb * 1024 * 1024
        threading.Thread(target=_watch_memory, args=(limit,), daemon=True).start()

    async def _evaluate(
        self,
        name: str,
        task: dict[str, Any],
        response: str,
        transcript: Transcript | None,
        trajectory: Trajectory | None,
    ) -> RewardScore:
        fn = self._fns[name]
        timeout = fn.timeout if fn.timeout is not None else self._default_timeout
        key, self._next = self._next, self._next + 1
        self._running[key] = time.monotonic() + (timeout if timeout is not None else 1e9)
        try:
            return await fn.evaluate(task, response, transcript=transcript, trajectory=trajectory)
        finally:
            del self._running[key]

    async def evaluate_many(
        self, name: str, evaluations: list[Evaluation]
    ) -> AsyncGenerator[list[tuple[int, RewardScore | str]]]:
        """Evaluate `evaluations` side by side; yield `(index, score)` for those that finished
        together, as they finish, a failure as the message of its caller's `RewardError`
        (called with `stream=True`). The caller's timeout bounds each one; a hung evaluation is
        left to the health check."""
        running = {
            asyncio.ensure_future(self._evaluate(name, *evaluation)): index
            for index, evaluation in enumerate(evaluations)
        }
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                yield [(running.pop(future), _score_or_error(name, future)) for future in done]
        finally:
            for future in running:
                future.cancel()

    async def check_health(self) -> None:
        now = time.monotonic()
        late = [d for d in self._running.values() if now > d + HANG_GRACE_S]
        if late:
            raise RuntimeError(f"{len(late)} reward evaluation(s) hung past their deadline")


def _watch_memory(limit_bytes: int) -> None:
    """End this process once its resident memory passes `limit_bytes` (a runaway reward)."""
    import psutil

    process = psutil.Process()
    while True:
        if process.memory_info().rss > limit_bytes:
            os._exit(137)
        time.sleep(WATCHDOG_PERIOD_S)


def _score_or_error(name: str, future: asyncio.Future[RewardScore]) -> RewardScore | str:
    """The evaluation's score, or what it failed with in words, for its caller's `RewardError`."""
    error = future.exception()
    if error is None:
        return future.result()
    if isinstance(error, RewardError):
        return str(error)
    return f"reward {name!r} raised {type(error).__name__}: {error}"


class RemoteReward:
    """A `RewardFn` whose evaluation runs on the reward deployment (module docstring): the
    evaluations that arrive within `batch_wait_s` of the first go as one call."""

    def __init__(self, fn: RewardFn, handle: Any, batch_wait_s: float = 0.0) -> None:
        self.name = fn.name
        self.weight = fn.weight
        self.timeout = fn.timeout
        self.inputs = reward_inputs(fn)
        self._handle = handle.options(stream=True)
        self._batch_wait_s = batch_wait_s
        self._waiting: list[tuple[Evaluation, asyncio.Future[RewardScore]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()
        """Calls under way, held until they end (their callers await futures, not them)."""

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        # Only what the function reads travels (a trajectory is the bulk of an episode).
        if "transcript" not in self.inputs:
            transcript = None
        if "trajectory" not in self.inputs:
            trajectory = None
        score: asyncio.Future[RewardScore] = asyncio.get_running_loop().create_future()
        self._waiting.append(((task, response, transcript, trajectory), score))
        if len(self._waiting) >= MAX_BATCH:
            self._send()
        elif self._sender is None:
            self._sender = asyncio.create_task(self._send_after_wait())
        return await score

    async def _send_after_wait(self) -> None:
        await asyncio.sleep(self._batch_wait_s)
        self._sender = None
        self._send()

    def _send(self) -> None:
        batch, self._waiting = self._waiting, []
        if batch:
            call = asyncio.create_task(self._call(batch))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[tuple[Evaluation, asyncio.Future[RewardScore]]]) -> None:
        """One call for `batch`: each caller's future gets its result as it streams back, or
        the call's failure (a replica that died fails every evaluation it held). Once every
        caller has its result or has given up (timed out, cancelled), the call is cancelled."""
        from ray.serve.exceptions import BackPressureError

        scores = [score for _, score in batch]
        me = asyncio.current_task()
        assert me is not None

        def given_up(_: object) -> None:
            if all(s.done() for s in scores) and any(s.cancelled() for s in scores):
                me.cancel()

        for score in scores:
            score.add_done_callback(given_up)
        try:
            while True:
                stream = self._handle.evaluate_many.remote(self.name, [e for e, _ in batch])
                ended = False
                try:
                    async for finished in stream:
                        for index, result in finished:
                            if scores[index].done():
                                continue
                            if isinstance(result, str):
                                scores[index].set_exception(RewardError(result))
                            else:
                                scores[index].set_result(result)
                    ended = True
                    return
                except BackPressureError:
                    await asyncio.sleep(REFUSED_PAUSE_S)
                finally:
                    if not ended:
                        stream.cancel()
        except Exception as err:
            for score in scores:
                if not score.done():
                    score.set_exception(err)


def remote_rewards(specs: list[str], handle: Any, batch_wait_s: float) -> list[RewardFn]:
    """The configured rewards (names, weights, timeouts as configured), evaluated remotely,
    gathered into a call for `batch_wait_s`."""
    from omniloop.platform.control.components import build_rewards

    return [RemoteReward(as_reward_fn(fn), handle, batch_wait_s) for fn in build_rewards(specs)]
