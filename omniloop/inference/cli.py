"""`omniloop engine …` (placeholder until the engine lands)."""

import typer

app = typer.Typer(no_args_is_help=True)
