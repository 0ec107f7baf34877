"""The `Sandbox` contract on the real `bwrap` backend: commands, streams, files, life cycle."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Awaitable, Callable

import pytest

from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.bwrap import BwrapSandbox, create_bwrap_sandbox
from omniloop.sandboxes.config import SandboxConfig

MakeSandbox = Callable[..., Awaitable[BwrapSandbox]]


async def test_is_a_sandbox(sandbox: BwrapSandbox) -> None:
    assert isinstance(sandbox, Sandbox)
    assert await sandbox.healthy()


async def test_exit_code_and_streams_are_kept_apart(sandbox: BwrapSandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3")

    assert result.exit_code == 3
    assert result.stop_reason == "exit"
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert not result.ok
    assert not result.truncated


async def test_argv_is_passed_without_a_shell(sandbox: BwrapSandbox) -> None:
    result = await sandbox.exec(["printf", "%s|", "two words", "$HOME", "*"])

    assert result.stdout == "two words|$HOME|*|"


async def test_stdin_is_fed_to_the_command(sandbox: BwrapSandbox) -> None:
    data = os.urandom(300_000)  # larger than a pipe buffer
    result = await sandbox.exec("wc -c", stdin=data)

    assert result.stdout.strip() == "300000"
    assert (await sandbox.exec("cat", stdin="héllo")).stdout == "héllo"


async def test_environment_is_path_home_lang_plus_config_and_call(
    make_sandbox: MakeSandbox,
) -> None:
    sandbox = await make_sandbox(env={"FROM_CONFIG": "a"})
    result = await sandbox.exec(
        "echo $HOME $LANG $FROM_CONFIG $FROM_CALL; pwd", env={"FROM_CALL": "b"}
    )

    assert result.stdout == "/workspace C.UTF-8 a b\n/workspace\n"


async def test_invalid_environment_is_refused(sandbox: BwrapSandbox) -> None:
    with pytest.raises(SandboxError):
        await sandbox.exec("true", env={"A=B": "x"})


async def test_workspace_and_tmp_persist_between_commands(sandbox: BwrapSandbox) -> None:
    await sandbox.exec("echo 1 > kept.txt; echo 2 > /tmp/kept.txt")
    result = await sandbox.exec("cat kept.txt /tmp/kept.txt")

    assert result.stdout == "1\n2\n"


async def test_processes_do_not_outlive_their_command(sandbox: BwrapSandbox) -> None:
    result = await sandbox.exec("sleep 9999 & echo started")

    assert result.ok
    assert result.stdout == "started\n"
    assert result.duration < 5
    assert sandbox.processes() == []


async def test_closing_kills_every_process_of_the_sandbox(
    sandbox: BwrapSandbox, still_running: Callable[..., list[int]]
) -> None:
    running = asyncio.ensure_future(sandbox.exec("sleep 60 & sleep 60"))
    deadline = asyncio.get_running_loop().time() + 20
    while len(sandbox.processes()) < 4:  # bwrap, its monitor, the shell and the two sleeps
        assert asyncio.get_running_loop().time() < deadline, sandbox.processes()
        await asyncio.sleep(0.05)
    pids = sandbox.processes()
    launcher = sandbox._launcher
    assert launcher is not None
    if sandbox._cgroups:  # where the host lets the sandbox have cgroups: its members are these
        assert sorted(launcher._below(launcher.pid() or 0)) == sorted(pids)
    await sandbox.close()
    await asyncio.gather(running, return_exceptions=True)
    assert not still_running(pids)


async def test_missing_program_is_a_failed_command_not_a_sandbox_error(
    sandbox: BwrapSandbox,
) -> None:
    result = await sandbox.exec(["no-such-program"])
    not_executable = await sandbox.exec(["/etc/passwd"])

    assert result.exit_code == 127
    assert result.stop_reason == "exit"
    assert "no-such-program" in result.stderr
    assert not_executable.exit_code == 126


async def test_concurrent_commands_share_the_workspace(sandbox: BwrapSandbox) -> None:
    results = await asyncio.gather(*(sandbox.exec(f"echo {i} > f{i}; cat f{i}") for i in range(6)))

    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]


async def test_cancelled_exec_kills_its_command(
    sandbox: BwrapSandbox, host_pids: Callable[[str], list[int]]
) -> None:
    token = f"3{secrets.randbelow(10**6)}.5"
    task = asyncio.ensure_future(sandbox.exec(f"sleep {token}", timeout=60))
    for _ in range(200):
        if host_pids(f"sleep {token}"):
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not host_pids(f"sleep {token}"):
            break
        await asyncio.sleep(0.02)

    assert host_pids(f"sleep {token}") == []
    assert (await sandbox.exec("echo next")).stdout == "next\n"


async def test_files_written_by_the_host_are_the_sandboxs_own(sandbox: BwrapSandbox) -> None:
    await sandbox.write_file("deep/er/notes.txt", "from the host\n")
    result = await sandbox.exec("echo from the sandbox >> deep/er/notes.txt; cat deep/er/notes.txt")

    assert result.stdout == "from the host\nfrom the sandbox\n"
    assert await sandbox.read_file("/workspace/deep/er/notes.txt") == (
        b"from the host\nfrom the sandbox\n"
    )
    with pytest.raises(SandboxError):
        await sandbox.read_file("deep/missing.txt")


async def test_custom_workdir(make_sandbox: MakeSandbox) -> None:
    sandbox = await make_sandbox(workdir="/home/agent/project")
    await sandbox.write_file("/home/agent/project/a.txt", "x")
    result = await sandbox.exec("pwd; cat a.txt")

    assert result.stdout == "/home/agent/project\nx"


async def test_config_the_backend_cannot_honour_is_refused(make_sandbox: MakeSandbox) -> None:
    with pytest.raises(ConfigError, match="system folder"):
        await make_sandbox(workdir="/usr/local/work")
    with pytest.raises(ConfigError, match="docker"):
        await create_bwrap_sandbox(SandboxConfig(egress_allowlist=["example.com:443"]))


async def test_closed_sandbox_refuses_work_and_close_is_idempotent(sandbox: BwrapSandbox) -> None:
    await sandbox.close()
    await asyncio.gather(sandbox.close(), sandbox.close())

    assert not await sandbox.healthy()
    with pytest.raises(SandboxError):
        await sandbox.exec("true")
    with pytest.raises(SandboxError):
        await sandbox.write_file("a", "b")


async def test_a_dead_launcher_is_replaced_on_the_next_command(sandbox: BwrapSandbox) -> None:
    launcher = sandbox._launcher
    assert launcher is not None
    pid = launcher.pid()
    assert pid is not None
    os.kill(pid, 9)
    for _ in range(100):
        if not sandbox.is_healthy():
            break
        await asyncio.sleep(0.01)

    assert not sandbox.is_healthy()
    assert (await sandbox.exec("echo back")).stdout == "back\n"
    assert sandbox.is_healthy()


async def test_commands_start_with_default_signal_actions(sandbox: BwrapSandbox) -> None:
    result = await sandbox.exec("yes | head -c 4; grep SigIgn /proc/self/status")

    ignored = int(result.stdout.split("SigIgn:")[1].split()[0], 16)
    assert "Broken pipe" not in result.stderr  # `yes` ended by SIGPIPE, as in a terminal
    assert not ignored & (1 << (13 - 1))  # SIGPIPE
    assert not ignored & (1 << (25 - 1))  # SIGXFSZ


async def test_file_size_limit_stops_a_growing_file(make_sandbox: MakeSandbox) -> None:
    sandbox = await make_sandbox(file_size_mb=1)
    result = await sandbox.exec("dd if=/dev/zero of=f bs=1M count=4 2>/dev/null; echo $?")

    assert result.stdout == "153\n"  # 128 + SIGXFSZ
    assert (sandbox.workspace / "f").stat().st_size == 1024 * 1024


async def test_overlong_command_is_refused_with_advice(sandbox: BwrapSandbox) -> None:
    with pytest.raises(SandboxError, match="write_file"):
        await sandbox.exec("echo " + "a" * 300_000)
