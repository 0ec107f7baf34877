"""`python -m omniloop` is the `omniloop` command."""

from omniloop.cli import app

app()
