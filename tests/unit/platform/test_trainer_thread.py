"""`trainer_threads` holds for every optimizer step and reference pass: OpenMP's thread count
is a setting of the thread that makes it, so the actor and the reference stage run their torch
work in one thread of their own that they set (`TorchThread`)."""

from __future__ import annotations

import threading

import pytest
import torch

from omniloop.platform.control.local import TorchThread


@pytest.mark.parametrize("threads", [1, 2])
async def test_torch_work_runs_with_the_configured_thread_count(threads: int) -> None:
    here = torch.get_num_threads()
    thread = TorchThread(threads, "trainer")
    try:
        seen = [await thread.run(torch.get_num_threads) for _ in range(3)]
        names = {await thread.run(lambda: threading.current_thread().name) for _ in range(3)}
    finally:
        thread.close()
    assert seen == [threads] * 3
    assert len(names) == 1, "the work moved between threads"
    assert next(iter(names)).startswith("trainer")
    assert torch.get_num_threads() == here, "the caller's thread count changed"
