"""`SandboxConfig.read_only_paths` on bubblewrap: a host folder is visible at its own path,
readable and not writable; entries that would expose the workspace, the host's kernel
interfaces or a service socket are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from omniloop.errors import ConfigError
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.factory import create_sandbox


async def test_a_read_only_path_is_readable_and_not_writable(
    shared_folder: Path, check_read_only: Any
) -> None:
    config = SandboxConfig(
        backend="bwrap", limits=SandboxLimits(timeout=10.0), read_only_paths=[str(shared_folder)]
    )
    sandbox = await create_sandbox(config)
    try:
        await check_read_only(sandbox, shared_folder)
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
