"""Fixtures for training-loop tests: the toy tool task on the warm-started tiny model.

Everything is real: the CPU engine over HTTP, bwrap sandboxes, TransferQueue on Ray, the torch
trainer. The warm-started model is built once per session (about a minute on 2 busy cores).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from omniloop.config import load_config
from omniloop.platform.control.run_config import RunConfig

REPO = Path(__file__).resolve().parents[3]
TOY = REPO / "examples" / "toy_tool"
TOY_CONFIG = TOY / "train.yaml"


def load_example_script(folder: Path, script: str) -> ModuleType:
    """An example's script by file. Examples import their sibling modules by name (`agent`,
    `make_tasks`) and share those names, so the siblings are imported for this script alone
    and removed again (a later example imports its own)."""
    siblings = {path.stem for path in folder.glob("*.py")}
    saved = {name: sys.modules.pop(name) for name in siblings if name in sys.modules}
    module_name = f"{folder.name}_{script}"
    spec = importlib.util.spec_from_file_location(module_name, folder / f"{script}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    added = str(folder) not in sys.path
    try:
        spec.loader.exec_module(module)
        return module
    finally:
        for name in siblings:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        if added and str(folder) in sys.path:
            sys.path.remove(str(folder))


@pytest.fixture(scope="session")
def example_script() -> Callable[[Path, str], ModuleType]:
    """`load_example_script`, for the test modules (which are not importable)."""
    return load_example_script


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model warm-started on the toy task's call format (uniformly random tools)."""
    warm_start = load_example_script(TOY, "warm_start")
    return Path(warm_start.warm_start(tmp_path_factory.mktemp("toy") / "model"))


ConfigFactory = Callable[..., RunConfig]


@pytest.fixture(scope="session")
def toy_config(toy_model: Path) -> ConfigFactory:
    """`toy_config(run_dir, {"dotted.key": value})`: the example's config, test overrides."""

    def build(run_dir: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        items = [
            f"model={toy_model}",
            f"run_dir={run_dir}",
            "tensorboard=false",
            f"database=sqlite:///{run_dir}/omniloop.db",
        ]
        items += [f"{k}={json.dumps(v)}" for k, v in (overrides or {}).items()]
        return load_config(RunConfig, TOY_CONFIG, items)

    return build


@pytest.fixture(scope="session")
def toy_config_path() -> Path:
    """The toy example's run config file."""
    return TOY_CONFIG
