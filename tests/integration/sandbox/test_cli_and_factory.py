"""`omniloop sandbox run` end to end, and backend selection in the factory."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from omniloop.errors import SandboxError
from omniloop.sandboxes.bwrap import BwrapSandbox
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.factory import BACKENDS, create_sandbox, resolve_backend

OMNILOOP = Path(sys.executable).parent / "omniloop"


async def _cli(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(OMNILOOP),
        *args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await process.communicate(stdin)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_run_prints_one_json_result() -> None:
    code, out, _ = await _cli(
        "sandbox", "run", "--backend", "bwrap", "--timeout", "5", "--", "echo", "hi"
    )

    assert code == 0
    assert len(out.splitlines()) == 1
    result = json.loads(out)
    assert set(result) == {"exit_code", "stdout", "stderr", "truncated", "stop_reason", "duration"}
    assert result["exit_code"] == 0
    assert result["stdout"] == "hi\n"
    assert result["stop_reason"] == "exit"


async def test_cli_run_reports_timeouts_and_limits() -> None:
    code, out, _ = await _cli(
        "sandbox", "run", "--backend", "bwrap", "--timeout", "1", "--memory-mb", "128",
        "--", "sh", "-c", "echo started; sleep 30",
    )  # fmt: skip

    result = json.loads(out)
    assert code == 0
    assert result["stop_reason"] == "tool_timeout"
    assert result["stdout"] == "started\n"


async def test_cli_run_rejects_an_unknown_backend() -> None:
    code, out, err = await _cli("sandbox", "run", "--backend", "qemu", "--", "true")

    assert code != 0
    assert out == ""
    assert "backend" in err


def test_auto_resolves_to_a_registered_available_backend() -> None:
    resolved = resolve_backend(SandboxConfig(backend="auto"))

    assert resolved in BACKENDS
    if "docker" not in BACKENDS:
        assert resolved == "bwrap"


def test_unregistered_backend_is_a_sandbox_error() -> None:
    config = SandboxConfig.model_construct(backend="qemu")  # bypasses the Literal on purpose

    with pytest.raises(SandboxError, match="qemu"):
        resolve_backend(config)


async def test_create_sandbox_goes_through_the_registry() -> None:
    sandbox = await create_sandbox(SandboxConfig(backend="bwrap"))
    try:
        assert isinstance(sandbox, BwrapSandbox)
        assert (await sandbox.exec(["echo", "via factory"])).stdout == "via factory\n"
    finally:
        await sandbox.close()
