"""`omniloop sandbox …` (placeholder until the backends land)."""

import typer

app = typer.Typer(no_args_is_help=True)
