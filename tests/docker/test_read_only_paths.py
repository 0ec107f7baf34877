"""`SandboxConfig.read_only_paths` on Docker and gVisor: a host folder bound read-only at its
own path (the daemon under test runs on this host)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omniloop.sandboxes.config import SandboxConfig


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="omniloop-ro-", dir="/tmp"))
    os.chmod(folder, 0o755)
    (folder / "data.txt").write_text("seen from inside\n")
    # Writable by anyone: only the read-only mount may stop a write.
    os.chmod(folder / "data.txt", 0o666)
    try:
        yield folder
    finally:
        (folder / "data.txt").unlink(missing_ok=True)
        folder.rmdir()


async def test_a_read_only_path_is_readable_and_not_writable(
    make_sandbox: Any, backend: str, sandbox_image: str, shared_folder: Path
) -> None:
    config = SandboxConfig(
        backend=backend,  # type: ignore[arg-type]
        image=sandbox_image,
        read_only_paths=[str(shared_folder)],
    )
    sandbox = await make_sandbox(config=config)
    read = await sandbox.exec(["cat", str(shared_folder / "data.txt")])
    assert read.stdout == "seen from inside\n"
    write = await sandbox.exec(["sh", "-c", f"echo x > {shared_folder}/data.txt"])
    assert write.exit_code != 0
    assert "Read-only file system" in write.stderr
    assert (shared_folder / "data.txt").read_text() == "seen from inside\n"
