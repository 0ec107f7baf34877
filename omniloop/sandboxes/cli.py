"""`omniloop sandbox run`: run one command in a fresh sandbox and print its result as JSON."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(no_args_is_help=True)


def _register_docker_commands() -> None:
    # `build`, `reap`, `serve`: the Docker-side commands live with the Docker backend.
    from omniloop.sandboxes.docker_cli import register

    register(app)


@app.callback()
def sandbox() -> None:
    """Tool sandboxes (docker, gvisor, bwrap)."""


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    argv: list[str] = typer.Argument(..., help="The command and its arguments, after `--`."),
    backend: str = typer.Option("auto", help="auto, docker, gvisor or bwrap."),
    timeout: float = typer.Option(30.0, help="Wall-clock seconds before the command is killed."),
    idle_timeout: float | None = typer.Option(
        None, help="Kill the command after this many seconds without output."
    ),
    memory_mb: int | None = typer.Option(None, help="Memory limit (MiB)."),
    pids: int | None = typer.Option(None, help="Most processes and threads."),
    cpus: float | None = typer.Option(None, help="CPU share."),
    output_bytes: int | None = typer.Option(None, help="Cap on captured stdout and on stderr."),
    image: str | None = typer.Option(None, help="Container image (docker, gvisor)."),
    stdin_file: Path | None = typer.Option(
        None, "--stdin-file", help="Feed this file to the command's stdin; `-` for ours."
    ),
) -> None:
    """Run ARGV in a new sandbox, print one JSON line (exit_code, stdout, stderr, truncated,
    stop_reason, duration), and remove the sandbox.

    Exits 0 whenever a result was printed, whatever the command did; 1 when the sandbox failed;
    2 for bad options.
    """
    from pydantic import ValidationError

    from omniloop.config import format_validation_error
    from omniloop.errors import ConfigError, SandboxError
    from omniloop.sandboxes.config import SandboxConfig

    limits: dict[str, Any] = {"timeout": timeout, "idle_timeout": idle_timeout}
    optional = {"memory_mb": memory_mb, "pids": pids, "cpus": cpus, "output_bytes": output_bytes}
    limits.update({k: v for k, v in optional.items() if v is not None})
    fields: dict[str, Any] = {"backend": backend, "limits": limits}
    if image is not None:
        fields["image"] = image
    try:
        config = SandboxConfig.model_validate(fields)
    except ValidationError as err:
        raise typer.BadParameter(format_validation_error(SandboxConfig, err)) from None
    data: bytes | None = None
    if stdin_file is not None:
        data = sys.stdin.buffer.read() if str(stdin_file) == "-" else stdin_file.read_bytes()
    try:
        result = asyncio.run(_run_once(config, argv, data))
    except ConfigError as err:
        raise typer.BadParameter(str(err)) from None
    except SandboxError as err:
        typer.echo(f"sandbox error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(result.model_dump_json())


async def _run_once(config: Any, argv: list[str], data: bytes | None) -> Any:
    from omniloop.sandboxes.factory import create_sandbox

    sandbox = await create_sandbox(config)
    try:
        return await sandbox.exec(argv, stdin=data)
    finally:
        await sandbox.close()


_register_docker_commands()
