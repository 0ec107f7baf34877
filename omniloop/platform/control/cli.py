"""Top-level platform commands: `omniloop rollout`, `omniloop run`."""

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
    from omniloop.platform.control.console import console
    from omniloop.platform.control.rollout import run_rollout, summarize
    from omniloop.platform.control.rollout_config import RolloutConfig

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


def run(
    args: Annotated[
        list[str] | None,
        typer.Argument(
            help="CONFIG (a YAML run config), then dotted overrides, e.g. trainer.lr=1e-5. "
            "With --resume, CONFIG may be left out: the run's saved config.yaml is used.",
            metavar="[CONFIG] [KEY=VALUE]...",
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue RUN_DIR from its last checkpoint."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config and stop.")
    ] = False,
) -> None:
    """Train a policy with RL: rollouts, rewards, advantages, optimizer steps, weight syncs."""
    from omniloop.config import load_config
    from omniloop.platform.control.console import console
    from omniloop.platform.control.run import run as run_training
    from omniloop.platform.control.run_config import RunConfig, config_yaml

    items = list(args or [])
    config_path: Path | None = None
    if items and "=" not in items[0]:
        config_path = Path(items.pop(0))
    overrides = items
    if resume is not None:
        if config_path is None:
            config_path = resume / "config.yaml"
        overrides = [*overrides, f"run_dir={resume}"]
    if config_path is None:
        raise _fail(ValueError("give a run config (or --resume RUN_DIR)"))
    try:
        resolved = load_config(RunConfig, config_path, overrides)
    except OmniloopError as err:
        raise _fail(err) from None
    console.print(config_yaml(resolved), highlight=False)
    if dry_run:
        return
    try:
        run_dir = asyncio.run(run_training(resolved, resume=resume is not None))
    except OmniloopError as err:
        raise _fail(err) from None
    console.print(f"[bold]done[/bold]: {run_dir}")


def register(app: typer.Typer) -> None:
    """Attach the platform's commands to the root app."""
    app.command("rollout")(rollout)
    app.command("run")(run)
