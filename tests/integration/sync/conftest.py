"""Two tiny engines of their own (weight syncs change their weights) and trainer helpers."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend

# Two shared cores: one thread each avoids OpenMP threads waiting on each other.
torch.set_num_threads(1)

ENGINES = 2
MAX_CONTEXT = 512


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, deadline: float) -> str:
    url: str | None = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{log.read_text()}")
        if url is None:
            ready = [ln for ln in log.read_text().splitlines() if "engine ready at " in ln]
            url = ready[0].split("ready at ", 1)[1].split()[0] if ready else None
        try:
            if url is not None and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not healthy after 180 s:\n{log.read_text()}")
        time.sleep(0.1)


def _spawn(model: str, log: Path) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / "omniloop"
    cmd = [
        str(exe), "engine", "serve", "--model", model, "--port", "0",
        "--threads", "1", "--max-batch", "8", "--max-context", str(MAX_CONTEXT),
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def engine_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """URLs of two `omniloop engine serve --model tiny` subprocesses (one thread each).

    Separate from the session's shared engine: these tests replace the engines' weights.
    Every test publishes the weights it checks, so the order of tests does not matter.
    """
    folder = tmp_path_factory.mktemp("sync-engines")
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for i in range(ENGINES):
            log = folder / f"engine{i}.log"
            procs.append((_spawn("tiny", log), log))
        deadline = time.monotonic() + 180
        yield [_wait_ready(proc, log, deadline) for proc, log in procs]
    finally:
        for proc, _ in procs:
            _stop(proc)


@pytest.fixture
def serve_engine(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """`serve_engine(model)`: the URL of one more engine subprocess, for this test only."""
    procs: list[subprocess.Popen[bytes]] = []

    def serve(model: str) -> str:
        log = tmp_path / f"extra-engine{len(procs)}.log"
        procs.append(_spawn(model, log))
        return _wait_ready(procs[-1], log, time.monotonic() + 180)

    try:
        yield serve
    finally:
        for proc in procs:
            _stop(proc)


@pytest.fixture
def next_version() -> Callable[[], int]:
    """Fresh weight versions, distinct across the whole session."""
    return lambda: next(_VERSIONS)


_VERSIONS = itertools.count(100)


TrainerFactory = Callable[..., TorchTrainerBackend]
Greedy = Callable[[TorchTrainerBackend, list[int], int], list[int]]


@pytest.fixture
def make_trainer() -> TrainerFactory:
    """`make_trainer(perturb_seed=None, **trainer_config)`: see `_make_trainer`."""
    return _make_trainer


@pytest.fixture
def greedy() -> Greedy:
    """`greedy(trainer, prompt, n)`: see `_trainer_greedy`."""
    return _trainer_greedy


def _make_trainer(perturb_seed: int | None = None, **config: object) -> TorchTrainerBackend:
    """The tiny model in a trainer backend; with a seed, its weights moved far from the init.

    The tiny model's random init greedily repeats one token; noise of 0.2 (norms kept) gives
    varied greedy continuations whose top-2 logit gaps dwarf float rounding.
    """
    trainer = TorchTrainerBackend("tiny", TrainerConfig.model_validate({"device": "cpu", **config}))
    if perturb_seed is not None:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if "norm" not in name:
                    param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    return trainer


def _trainer_greedy(trainer: TorchTrainerBackend, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from the trainer's own forward; fails if a step is a near-tie."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = trainer.model(input_ids=ids).logits[0, -1]
            top = logits.topk(2).values
            assert float(top[0] - top[1]) > 1e-3, "near-tie: greedy is not well defined here"
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
