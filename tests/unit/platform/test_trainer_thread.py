"""`trainer_threads` holds for every optimizer step: OpenMP's thread count is a setting of the
thread that makes it, so the actor runs its backend's work in one thread that it set."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from omniloop.platform.control.local import LocalActor
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run_config import RunConfig


def _actor(threads: int | None) -> LocalActor:
    config = RunConfig(
        rollout=RolloutConfig(tasks="tasks.jsonl", agent="agent.py:build", samples_per_task=2),
        trainer_threads=threads,
    )
    backend: Any = object()  # the actor's constructor only holds it
    data: Any = object()
    return LocalActor(backend, data, config)


@pytest.mark.parametrize("threads", [1, 2])
async def test_backend_work_runs_with_the_configured_thread_count(threads: int) -> None:
    here = torch.get_num_threads()
    actor = _actor(threads)
    try:
        seen = [await actor._in_trainer_thread(torch.get_num_threads) for _ in range(3)]
        names = {await actor._in_trainer_thread(lambda: threading.current_thread().name)}
    finally:
        actor.close()
    assert seen == [threads] * 3
    assert len(names) == 1, "the backend's work moved between threads"
    assert torch.get_num_threads() == here, "the caller's thread count changed"
