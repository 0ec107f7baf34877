"""`SandboxConfig.read_only_paths` on Docker and gVisor: a host folder bound read-only at its
own path (the daemon under test runs on this host)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.sandboxes.config import SandboxConfig


async def test_a_read_only_path_is_readable_and_not_writable(
    make_sandbox: Any, backend: str, sandbox_image: str, shared_folder: Path, check_read_only: Any
) -> None:
    config = SandboxConfig(
        backend=backend,  # type: ignore[arg-type]
        image=sandbox_image,
        read_only_paths=[str(shared_folder)],
    )
    await check_read_only(await make_sandbox(config=config), shared_folder)
