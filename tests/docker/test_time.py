"""SANDBOX-CHECKLIST.md B11–B16: time limits and process trees, against runc and gVisor."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from docker.api.client import APIClient

from omniloop.sandboxes.config import SandboxConfig, SandboxLimits

# The time limit tests allow, past the timeout and the kill grace, 1.5 s plus four exec round
# trips measured just before (stopping a command takes two signalling execs): the bound stays
# tight on a quiet machine and does not flip on a loaded one, where every exec is slower. What
# it tells apart is a command that would run forever.


async def test_b11_infinite_loop_is_killed_at_the_timeout(make_sandbox: Any, helpers: Any) -> None:
    sandbox = await make_sandbox(kill_grace=1)
    bound = 2 + 1 + 1.5 + 4 * await helpers.exec_round_trip(sandbox)
    start = time.monotonic()
    result = await sandbox.exec(["sh", "-c", "while true; do :; done"], timeout=2)
    elapsed = time.monotonic() - start
    assert result.stop_reason == "tool_timeout"
    assert result.exit_code is None
    assert elapsed < bound, f"returned after {elapsed:.1f}s (T=2, grace=1, bound {bound:.1f}s)"
    assert "[timed out after" in result.text()


async def test_b12_timeout_kills_the_whole_process_tree(make_sandbox: Any, helpers: Any) -> None:
    sandbox = await make_sandbox()
    script = textwrap.dedent(
        """\
        setsid sleep 9999 &
        nohup sleep 9998 >/dev/null 2>&1 &
        # A double-forked daemon: its parent exits, so it is reparented to init.
        sh -c 'sleep 9997 </dev/null >/dev/null 2>&1 &' &
        python3 -c 'import os, time; os.setsid(); os.fork() or time.sleep(9996)' &
        sleep 9995
        """
    )
    result = await sandbox.exec(["sh", "-c", script], timeout=2)
    assert result.stop_reason == "tool_timeout"
    rows = await helpers.processes(sandbox)
    # Only the init and the container's main process (another uid) remain.
    assert [r for r in rows if r[1] == 1000] == [], rows
    assert {r[3].split()[0] for r in rows} <= {"/sbin/docker-init", "sleep"}, rows
    assert len(rows) == 2, rows


async def test_b13_sigterm_ignoring_command_is_sigkilled_after_the_grace(
    make_sandbox: Any, helpers: Any
) -> None:
    sandbox = await make_sandbox(kill_grace=1)
    bound = 1.5 + 1 + 1.5 + 4 * await helpers.exec_round_trip(sandbox)
    start = time.monotonic()
    result = await sandbox.exec(["sh", "-c", "trap '' TERM; sleep 9999 & wait"], timeout=1.5)
    elapsed = time.monotonic() - start
    assert result.stop_reason == "tool_timeout"
    assert elapsed < bound, f"returned after {elapsed:.1f}s (T=1.5, grace=1, bound {bound:.1f}s)"
    rows = await helpers.processes(sandbox)
    assert [r for r in rows if r[1] == 1000] == [], rows


async def test_b14_zombies_are_reaped_by_the_init(make_sandbox: Any, helpers: Any) -> None:
    sandbox = await make_sandbox()
    # Children that exit while their parent is gone end up with PID 1, which must reap them.
    script = "for i in $(seq 20); do (sleep 0.2 & exec sleep 0.1) & done; wait; sleep 1"
    result = await sandbox.exec(["sh", "-c", script], timeout=20)
    assert result.ok, result
    rows = await helpers.processes(sandbox)
    assert [r for r in rows if r[2] == "Z"] == [], rows


async def test_b15_silent_command_is_killed_by_the_idle_timeout_not_the_wall_timeout(
    make_sandbox: Any, helpers: Any
) -> None:
    sandbox = await make_sandbox(idle_timeout=1.5)
    # Far below the wall timeout (30 s) on any machine that runs an exec in under 6 s.
    bound = 1.5 + 1 + 1.5 + 4 * await helpers.exec_round_trip(sandbox)
    start = time.monotonic()
    result = await sandbox.exec(["sleep", "9999"], timeout=30)
    elapsed = time.monotonic() - start
    assert result.stop_reason == "idle_timeout"
    assert elapsed < bound, f"returned after {elapsed:.1f}s (idle 1.5, bound {bound:.1f}s)"
    # A command that keeps talking is not idle, even past the idle timeout.
    chatty = await sandbox.exec(
        ["sh", "-c", "for i in 1 2 3 4 5 6; do echo tick; sleep 0.5; done"], timeout=30
    )
    assert chatty.ok, chatty
    assert chatty.stdout.count("tick") == 6


CONTROLLER = """
import asyncio, sys, time
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.docker import create_docker_sandbox

async def main():
    config = SandboxConfig.model_validate_json(sys.argv[1])
    sandbox = await create_docker_sandbox(config, episode_id="controller")
    print(sandbox.container_id, flush=True)
    await sandbox.exec(["sleep", "600"], timeout=600)

asyncio.run(main())
"""


async def test_b16_sandbox_self_destructs_at_its_ttl_after_the_controller_is_sigkilled(
    backend: str, sandbox_image: str, docker_api: APIClient, tmp_path: Path
) -> None:
    ttl = 4.0
    config = SandboxConfig(
        backend=backend,  # type: ignore[arg-type]
        image=sandbox_image,
        limits=SandboxLimits(memory_mb=256, tmp_mb=32, workspace_mb=32, ttl=ttl),
    )
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), config.model_dump_json(), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    container = (await proc.stdout.readline()).decode().strip()
    created = time.monotonic()
    assert container, "the controller did not create a sandbox"
    os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()
    assert docker_api.inspect_container(container)["State"]["Running"]
    # No reaper runs here: the sandbox's own TTL ends it (its main process exits, auto-remove
    # deletes it).
    while docker_api.containers(all=True, filters={"id": container}):
        assert time.monotonic() - created < ttl + 10, "sandbox outlived its TTL"
        await asyncio.sleep(0.25)
