"""The critic stage's order: a replica trains the steps it computes in step order, so a step's
values never come from a critic that has trained on a later step; a repeated request for a step
being computed joins it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omniloop.platform.control.critic_stage import LocalCritic
from omniloop.platform.data import MicroBatch
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import CriticConfig


class CountingCritic:
    """Values are the number of steps trained so far; training records the step's values."""

    def __init__(self) -> None:
        self.trained = 0
        self.scored_with: list[float] = []

    def values(self, batch: TrainBatch) -> Tensor:
        return torch.full(batch.input_ids.shape, float(self.trained))

    def train_step(self, batch: TrainBatch, old: Tensor, returns: Tensor) -> dict[str, float]:
        self.trained += 1
        return {"critic/values_mean": float(old[batch.loss_mask != 0].mean())}

    def save(self, path: Path) -> None:
        raise AssertionError("not saved here")

    def load(self, path: Path) -> None:
        raise AssertionError("not loaded here")


def _batch(step: int, name: str) -> MicroBatch:
    return MicroBatch(
        step=step,
        consumer="critic",
        ids=[name],
        fields={
            "input_ids": [torch.tensor([1, 2, 3, 4])],
            "loss_mask": [torch.tensor([0, 0, 1, 1], dtype=torch.int8)],
            "reward": torch.tensor([1.0]),
            "meta": [{"stop_reason": "stop"}],
        },
    )


class GatedRows:
    """A data plane whose steps hand out their rows when the test lets them."""

    def __init__(self) -> None:
        self.queues: dict[int, asyncio.Queue[MicroBatch | None]] = {}
        self.rereads: list[int] = []

    def queue(self, step: int) -> asyncio.Queue[MicroBatch | None]:
        return self.queues.setdefault(step, asyncio.Queue())

    async def reread(self, step: int, consumer: str) -> None:
        self.rereads.append(step)

    async def iter_micro_batches(self, step: int, *_: Any, **__: Any) -> AsyncIterator[MicroBatch]:
        while (batch := await self.queue(step).get()) is not None:
            yield batch

    async def put_field(self, step: int, ids: list[str], name: str, values: Any) -> None:
        pass


def test_a_step_whose_rows_come_first_trains_after_the_steps_before_it() -> None:
    async def scenario() -> None:
        data = GatedRows()
        critic = CountingCritic()
        stage = LocalCritic(data, critic, CriticConfig(), 8, 60.0, 1)  # type: ignore[arg-type]
        try:
            first = asyncio.create_task(stage.compute(0))
            data.queue(0).put_nowait(_batch(0, "a"))
            second = asyncio.create_task(stage.compute(1))
            data.queue(1).put_nowait(_batch(1, "b"))
            data.queue(1).put_nowait(None)  # step 1 has every row; step 0 does not
            await asyncio.sleep(0.3)
            assert not second.done(), "step 1 trained before step 0"
            assert critic.trained == 0
            # A repeated request for step 0 joins the computation under way.
            again = asyncio.create_task(stage.compute(0))
            data.queue(0).put_nowait(_batch(0, "c"))
            data.queue(0).put_nowait(None)
            step0, step0_again, step1 = await asyncio.gather(first, again, second)
        finally:
            stage.close()
        assert critic.trained == 2
        assert data.rereads == [0, 1]
        assert step0["critic/values_mean"] == 0, "step 0's rows were scored before any training"
        assert step0_again == step0
        assert step1["critic/values_mean"] == 0

    asyncio.run(scenario())
