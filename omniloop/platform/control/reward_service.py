"""The reward role: reward functions in processes of their own (a Ray Serve deployment).

A rollout replica scores each episode through `RemoteReward`s, one per configured reward,
which satisfy `RewardFn` and call the `reward` deployment, where the real functions run. What a
misbehaving reward costs:

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
from typing import Any

from omniloop.rewards import RewardFn
from omniloop.rewards.base import RewardScore, Transcript, as_reward_fn, reward_inputs
from omniloop.trajectory import Trajectory

HANG_GRACE_S = 5.0
"""Seconds past its deadline an evaluation may still run before its replica counts as hung."""
REFUSED_PAUSE_S = 0.2
"""Seconds before a call the deployment refused (its queue was full) is sent again."""
WATCHDOG_PERIOD_S = 0.1
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

    async def evaluate(
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


class RemoteReward:
    """A `RewardFn` whose evaluation runs on the reward deployment (module docstring)."""

    def __init__(self, fn: RewardFn, handle: Any) -> None:
        self.name = fn.name
        self.weight = fn.weight
        self.timeout = fn.timeout
        self.inputs = reward_inputs(fn)
        self._handle = handle

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        from ray.serve.exceptions import BackPressureError

        # Only what the function reads travels (a trajectory is the bulk of an episode).
        if "transcript" not in self.inputs:
            transcript = None
        if "trajectory" not in self.inputs:
            trajectory = None
        while True:
            call = self._handle.evaluate.remote(self.name, task, response, transcript, trajectory)
            try:
                result: RewardScore = await call
            except BackPressureError:
                await asyncio.sleep(REFUSED_PAUSE_S)
                continue
            except asyncio.CancelledError:
                call.cancel()
                raise
            return result


def remote_rewards(specs: list[str], handle: Any) -> list[RewardFn]:
    """The configured rewards (names, weights, timeouts as configured), evaluated remotely."""
    from omniloop.platform.control.components import build_rewards

    return [RemoteReward(as_reward_fn(fn), handle) for fn in build_rewards(specs)]
