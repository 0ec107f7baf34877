"""The `disk` backend: a safetensors folder under a staging path every engine can read, loaded
with `/update_weights_from_disk`. One host, or a shared filesystem."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import Tensor

from omniloop.inference.client import EngineClient
from omniloop.platform.dcs.base import (
    WeightSyncError,
    all_or_fail,
    engines_paused,
    materialize,
    nbytes_of,
    tagged,
)
from omniloop.platform.dcs.config import UpdateMode

WEIGHTS_FILE = "model.safetensors"
STAGED_PREFIX = "weights-v"
# Files of a model folder that are weights (or training state), not configuration.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")
_NOT_CONFIG = ("trainer_state.json",)


def write_weights_folder(
    named: Sequence[tuple[str, Tensor]], config_dir: Path, target: Path
) -> None:
    """Write `target` as a model folder: `config_dir`'s non-weight files and the weights.

    Atomic: written aside, then renamed over `target` (a folder of that name is replaced).
    """
    import safetensors.torch

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        for item in config_dir.iterdir():
            if (
                item.is_file()
                and not item.name.endswith(_WEIGHT_SUFFIXES)
                and item.name not in _NOT_CONFIG
            ):
                shutil.copy2(item, tmp / item.name)
        state: dict[str, Tensor] = {}
        seen: set[int] = set()
        for name, tensor in named:
            cpu = tensor.to("cpu").contiguous()
            storage = cpu.untyped_storage().data_ptr()
            # safetensors refuses tensors that share memory (tied weights given twice).
            state[name] = cpu.clone() if storage in seen else cpu
            seen.add(storage)
        safetensors.torch.save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class DiskWeightSync:
    """Publishes through a model folder on disk and `/update_weights_from_disk`.

    Each publish writes `staging_dir/weights-v{version}` and removes the folders of earlier
    versions once every engine has loaded the new one.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        staging_dir: str | Path | None = None,
        *,
        model_dir: str | Path | None = None,
        timeout_s: float = 600.0,
        update_mode: UpdateMode = "in_place",
    ) -> None:
        if not engine_urls:
            raise ValueError("no engines to publish to")
        self._clients = [EngineClient(url, timeout=timeout_s) for url in engine_urls]
        self._update_mode = update_mode
        self._own_staging = staging_dir is None
        self.staging_dir = Path(
            tempfile.mkdtemp(prefix="omniloop-weights-") if staging_dir is None else staging_dir
        )
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._lock = asyncio.Lock()

    async def _config_dir(self) -> Path:
        if self._model_dir is None:
            info = await self._clients[0].get_model_info()
            folder = Path(info.model_path)
            if not (folder / "config.json").is_file():
                raise WeightSyncError(
                    f"engine {self._clients[0].base_url} serves {folder}, which has no "
                    "config.json here; pass model_dir (the model's folder) to the disk sync"
                )
            self._model_dir = folder
        return self._model_dir

    async def publish(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int
    ) -> dict[str, float]:
        """Write the weights as `weights-v{version}` and have every engine load them."""
        async with self._lock:
            started = time.perf_counter()
            named = materialize(named_weights)
            target = self.staging_dir / f"{STAGED_PREFIX}{version}"
            config_dir = await self._config_dir()
            try:
                await asyncio.to_thread(write_weights_folder, named, config_dir, target)
            except OSError as err:
                raise WeightSyncError(f"writing weights v{version} to {target}: {err}") from err
            saved = time.perf_counter()
            # A failed load from disk changed nothing: generation goes on.
            async with engines_paused(
                self._clients, self._update_mode, failed_leaves_paused=False
            ) as paused:
                await all_or_fail(
                    [
                        tagged(c, c.update_weights_from_disk(str(target), weight_version=version))
                        for c in self._clients
                    ],
                    f"loading weights v{version} from {target}",
                )
            loaded = time.perf_counter()
            for old in self.staging_dir.glob(f"{STAGED_PREFIX}*"):
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
            nbytes = nbytes_of(named)
            seconds = loaded - started
            return {
                "weight_sync/seconds": seconds,
                "weight_sync/save_seconds": saved - started,
                "weight_sync/load_seconds": loaded - saved,
                "weight_sync/bytes": float(nbytes),
                "weight_sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
                "weight_sync/engines": float(len(self._clients)),
                "weight_sync/version": float(version),
                **paused,
            }

    async def close(self) -> None:
        """Close the HTTP clients; remove the staging folder if this object made it."""
        async with self._lock:
            for client in self._clients:
                await client.aclose()
            if self._own_staging:
                shutil.rmtree(self.staging_dir, ignore_errors=True)
