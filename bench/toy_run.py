"""The toy tool task's training run, as the benchmarks that train it set it up.

`examples/toy_tool/train.yaml` with the model, a run folder of its own, a SQLite store in it,
no TensorBoard, and the caller's dotted overrides; `train` runs it and reads back the step
metrics. Imported by the bench scripts beside it (`bench/` is their `sys.path[0]`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omniloop.platform.control.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "examples" / "toy_tool"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path`; none when it does not exist (a run that recorded nothing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def toy_config(model: Path, run_dir: Path, steps: int, overrides: list[str]) -> RunConfig:
    """The toy run of `steps` steps of `model` in `run_dir`, with `overrides` applied last."""
    from omniloop.config import load_config
    from omniloop.platform.control.run_config import RunConfig

    return load_config(
        RunConfig,
        TOY / "train.yaml",
        [
            f"model={model}",
            f"run_dir={run_dir}",
            f"steps={steps}",
            "tensorboard=false",
            f"database=sqlite:///{run_dir}/omniloop.db",
            *overrides,
        ],
    )


def train(config: RunConfig) -> tuple[list[dict[str, Any]], float]:
    """Run `config`; its step metrics and the run's wall seconds, start-up included."""
    from omniloop.platform.control.run import run

    started = time.perf_counter()
    asyncio.run(run(config))
    return read_jsonl(Path(config.run_dir) / "metrics.jsonl"), time.perf_counter() - started
