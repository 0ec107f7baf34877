"""Top-level platform commands: `omniloop rollout`."""

import typer


def register(app: typer.Typer) -> None:
    """Attach the platform's commands to the root app."""
