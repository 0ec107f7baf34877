"""Fixtures for the torch trainer backend on the tiny random Llama."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from omniloop.inference.models import resolve_model
from omniloop.trainer.batch import TrainBatch


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    """Two shared cores: one thread avoids OpenMP threads waiting on each other. Set per test,
    because modules that run earlier in the session (the data plane) change the count."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model's folder (built into the cache on first use)."""
    return resolve_model("tiny")


BatchFactory = Callable[..., TrainBatch]


@pytest.fixture
def make_batch() -> BatchFactory:
    """Build a right-padded batch of random sequences.

    `lengths`: real tokens per row; `prompt`: leading untrained tokens per row; `advantages`: one
    value per row, broadcast to its trained tokens. Token ids are drawn from a fixed seed.
    """

    def build(
        lengths: list[int],
        *,
        prompt: int = 4,
        advantages: list[float] | None = None,
        seed: int = 0,
    ) -> TrainBatch:
        gen = torch.Generator().manual_seed(seed)
        rows, width = len(lengths), max(lengths)
        ids = torch.randint(3, 2000, (rows, width), generator=gen)
        attention = torch.zeros(rows, width, dtype=torch.long)
        loss_mask = torch.zeros(rows, width)
        for row, n in enumerate(lengths):
            attention[row, :n] = 1
            loss_mask[row, prompt:n] = 1
        ids = ids * attention  # padding id 0
        adv = torch.tensor(advantages if advantages is not None else [1.0] * rows)
        return TrainBatch(
            input_ids=ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            rollout_logprobs=torch.zeros(rows, width),
            advantages=adv[:, None] * loss_mask,
        )

    return build


@pytest.fixture(scope="session")
def rank_script() -> Callable[[str], tuple[Path, ModuleType]]:
    """`rank_script("dp_ranks")`: a rank script of this folder (run as one process per rank),
    its path and the script imported (to run one rank in the test's own process)."""

    def load(name: str) -> tuple[Path, ModuleType]:
        script = Path(__file__).with_name(f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, script)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return script, module

    return load
