"""The critic stage: values for a step's rows, then one value-model step on their returns.

`LocalCritic.compute(k)` (with `trainer.critic`) runs beside the advantage stage:

1. as rows of step `k` arrive, it writes their `values` (the value model's, `trainer.critic`);
   infrastructure failures get zeros without a forward pass. The advantage stage turns them
   into GAE advantages and returns (`advantages.row_gae`);
2. once it has read every row, it takes one optimizer step on the step's value loss, against
   the same returns, which it computes itself from the values and rewards it read (so it never
   reads the step after the actor, which clears a step once trained).

A step's values may come from a critic that has not yet trained on the step before (with
`max_staleness` above 0 steps overlap): GAE only needs values, not current ones. Never from one
that has trained on a later step: a replica trains the steps it was asked for in step order,
each once all earlier ones have trained (a step whose rows are all in early waits). A request
for a step the replica is already computing (a retry after a transient loss of contact) joins
that computation instead of training on the step twice. The critic's
state is part of each checkpoint (`checkpoints/step_k/critic/`): a resumed run, and a critic
replica that replaces a lost one, continue from the newest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omniloop.platform.control.local import TorchThread, closing_stream
from omniloop.trainer.advantages import row_gae
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import CriticConfig
from omniloop.trainer.critic import ValueModel
from omniloop.trajectory import INFRA_STOP_REASONS

if TYPE_CHECKING:
    from omniloop.platform.data import DataPlane, MicroBatch

VALUE_FIELDS = ("input_ids", "loss_mask", "reward", "meta")
"""What the critic reads of a row."""
CHECKPOINT_FOLDER = "critic"
"""The critic's part of a run checkpoint."""


def _trainable(batch: MicroBatch) -> list[int]:
    return [
        i for i, meta in enumerate(batch["meta"]) if meta["stop_reason"] not in INFRA_STOP_REASONS
    ]


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row.float()
    return out


class LocalCritic:
    """The critic stage in this process (module docstring), its torch work in a thread of its
    own."""

    def __init__(
        self,
        data: DataPlane,
        critic: ValueModel,
        config: CriticConfig,
        micro_batch_size: int,
        read_timeout: float,
        threads: int | None,
    ) -> None:
        self._data = data
        self._critic = critic
        self._config = config
        self._micro_batch_size = micro_batch_size
        self._read_timeout = read_timeout
        self._thread = TorchThread(threads, "critic")
        self._computing: dict[int, asyncio.Task[dict[str, float]]] = {}
        """The steps this replica is computing."""

    def close(self) -> None:
        """Stop the steps being computed and let the stage's thread end."""
        for task in self._computing.values():
            task.cancel()
        self._thread.close()

    async def compute(self, step: int) -> dict[str, float]:
        """Write `values` for every row of `step`, then train on its returns, after every
        earlier step this replica computes; metrics."""
        task = self._computing.get(step)
        if task is None:
            task = asyncio.create_task(self._compute(step))
            self._computing[step] = task
            task.add_done_callback(lambda _: self._computing.pop(step, None))
        # Shielded: a caller that gives up (its request cancelled) leaves the step to the steps
        # after it, which wait for it, and to a retry, which joins it.
        return await asyncio.shield(task)

    async def _after_earlier_steps(self, step: int) -> None:
        while earlier := [t for k, t in self._computing.items() if k < step and not t.done()]:
            await asyncio.wait(earlier)

    async def _compute(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        # Every row, as for the advantages: a replacement replica does the step whole.
        await self._data.reread(step, "critic")
        sequences: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        scored: list[torch.Tensor] = []
        returns: list[torch.Tensor] = []
        stream = self._data.iter_micro_batches(
            step, VALUE_FIELDS, self._micro_batch_size, "critic", timeout_s=self._read_timeout
        )
        async with closing_stream(stream) as batches:
            async for batch in batches:
                ids: list[torch.Tensor] = batch["input_ids"]
                values = [torch.zeros(len(row)) for row in ids]
                rows = _trainable(batch)
                if rows:
                    scoring = TrainBatch.for_scoring([ids[i] for i in rows])
                    out = await self._thread.run(self._critic.values, scoring)
                    for k, i in enumerate(rows):
                        values[i] = out[k, : len(ids[i])]
                        _, ret = row_gae(
                            values[i],
                            float(batch["reward"][i]),
                            batch["loss_mask"][i],
                            gamma=self._config.gamma,
                            lam=self._config.lam,
                        )
                        sequences.append(ids[i])
                        masks.append(batch["loss_mask"][i])
                        scored.append(values[i])
                        returns.append(ret)
                await self._data.put_field(step, batch.ids, "values", values)
        metrics: dict[str, float] = {"critic/rows": float(len(sequences))}
        await self._after_earlier_steps(step)
        if sequences:
            scoring = TrainBatch.for_scoring(sequences)
            width = scoring.input_ids.shape[1]
            train = dataclasses.replace(scoring, loss_mask=_padded(masks, width))
            metrics |= await self._thread.run(
                self._critic.train_step, train, _padded(scored, width), _padded(returns, width)
            )
        metrics["perf/critic_seconds"] = time.perf_counter() - started
        return metrics

    async def save(self, checkpoint: Path) -> None:
        """Save the critic into run checkpoint `checkpoint`."""
        await self._thread.run(self._critic.save, checkpoint / CHECKPOINT_FOLDER)

    async def load(self, checkpoint: Path) -> None:
        """Restore the critic of run checkpoint `checkpoint`. One without a critic's part (a run
        that had none, or one stopped between the actor's part and the critic's) leaves it as
        it is."""
        folder = checkpoint / CHECKPOINT_FOLDER
        if folder.is_dir():
            await self._thread.run(self._critic.load, folder)
