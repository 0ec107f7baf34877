"""Top-level platform commands: `omniloop rollout`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from omniloop.errors import OmniloopError


def _fail(err: Exception) -> typer.Exit:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def rollout(
    config: Annotated[Path, typer.Argument(help="YAML rollout config.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, e.g. sampling.temperature=0.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config and stop.")
    ] = False,
) -> None:
    """Run N episodes of a JSONL task set; write trajectories as JSONL and print a summary."""
    from omniloop.config import dump_config, load_config
    from omniloop.platform.rollout import RolloutConfig, console, run_rollout, summarize

    try:
        resolved = load_config(RolloutConfig, config, overrides or [])
    except OmniloopError as err:
        raise _fail(err) from None
    console.print(dump_config(resolved), highlight=False)
    if dry_run:
        return
    try:
        trajectories = asyncio.run(run_rollout(resolved))
    except OmniloopError as err:
        raise _fail(err) from None
    summary = summarize(trajectories)
    console.print(f"[bold]wrote[/bold] {len(trajectories)} trajectories to {resolved.output}")
    typer.echo(json.dumps(summary))


def register(app: typer.Typer) -> None:
    """Attach the platform's commands to the root app."""
    app.command("rollout")(rollout)
