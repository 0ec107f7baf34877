"""The examples' training runs, as the benchmarks that train them set them up.

`examples/toy_tool/train.yaml` (the tiny model warm-started on the call format) or
`examples/calculator/train.yaml` (SmolLM2, `make run`'s job), each with a run folder of its
own, a SQLite store in it, no TensorBoard, and the caller's dotted overrides; `train` runs one
and reads back the step metrics. Imported by the bench scripts beside it (`bench/` is their
`sys.path[0]`).
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
CALCULATOR = REPO / "examples" / "calculator"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path`; none when it does not exist (a run that recorded nothing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def toy_config(model: Path, run_dir: Path, steps: int, overrides: list[str]) -> RunConfig:
    """The toy run of `steps` steps of `model` in `run_dir`, with `overrides` applied last."""
    return example_config(TOY, run_dir, steps, [f"model={model}", *overrides])


def example_config(folder: Path, run_dir: Path, steps: int, overrides: list[str]) -> RunConfig:
    """The run of `folder/train.yaml`, `steps` steps in `run_dir`, `overrides` applied last."""
    from omniloop.config import load_config
    from omniloop.platform.control.run_config import RunConfig

    return load_config(
        RunConfig,
        folder / "train.yaml",
        [
            f"run_dir={run_dir}",
            f"steps={steps}",
            "tensorboard=false",
            f"database=sqlite:///{run_dir}/omniloop.db",
            *overrides,
        ],
    )


def task_config(model: Path | None, run_dir: Path, steps: int, overrides: list[str]) -> RunConfig:
    """The toy run on `model`, or `make run`'s calculator run when `model` is None."""
    if model is None:
        return example_config(CALCULATOR, run_dir, steps, overrides)
    return toy_config(model, run_dir, steps, overrides)


def task_parser(description: str, *, steps: int, rounds: int, rounds_help: str) -> Any:
    """An `argparse` parser with the arguments of a benchmark that trains an example's run
    several times: `--task` (`toy` or `calculator`), `--steps` per run and `--rounds`."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", choices=["toy", "calculator"], default="toy")
    parser.add_argument("--steps", type=int, default=steps, help="steps per run")
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    return parser


def train(config: RunConfig) -> tuple[list[dict[str, Any]], float]:
    """Run `config`; its step metrics and the run's wall seconds, start-up included."""
    from omniloop.platform.control.run import run

    started = time.perf_counter()
    asyncio.run(run(config))
    return read_jsonl(Path(config.run_dir) / "metrics.jsonl"), time.perf_counter() - started
