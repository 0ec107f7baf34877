"""`SandboxConfig.read_only_paths` on bubblewrap: a host folder is visible at its own path,
readable and not writable; entries that would expose the workspace, the host's kernel
interfaces or a service socket are refused."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from omniloop.errors import ConfigError
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.factory import create_sandbox


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    # Under /tmp with 0755, so the sandbox's own user may read it (pytest's tmp_path is 0700).
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


async def test_a_read_only_path_is_readable_and_not_writable(shared_folder: Path) -> None:
    config = SandboxConfig(
        backend="bwrap", limits=SandboxLimits(timeout=10.0), read_only_paths=[str(shared_folder)]
    )
    sandbox = await create_sandbox(config)
    try:
        read = await sandbox.exec(["cat", str(shared_folder / "data.txt")])
        assert read.stdout == "seen from inside\n"
        write = await sandbox.exec(["sh", "-c", f"echo x > {shared_folder}/data.txt"])
        assert write.exit_code != 0
        assert "Read-only file system" in write.stderr
        assert (shared_folder / "data.txt").read_text() == "seen from inside\n"
    finally:
        await sandbox.close()


async def test_a_missing_read_only_path_is_a_config_error() -> None:
    config = SandboxConfig(backend="bwrap", read_only_paths=["/no/such/folder"])
    with pytest.raises(ConfigError, match="do not exist on this host"):
        await create_sandbox(config)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("relative/path", "must be an absolute path"),
        ("/", "must be an absolute path other than /"),
        ("/proc/1", "kernel interfaces"),
        ("/var/run/docker.sock", "kernel interfaces or a service socket"),
        ("/workspace/data", "overlaps the workspace"),
        ("/", "other than /"),
    ],
)
def test_paths_that_would_break_isolation_are_refused(path: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SandboxConfig(read_only_paths=[path])
