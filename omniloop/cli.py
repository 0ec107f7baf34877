"""The `omniloop` command line: one typer app, one sub-app per component."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="omniloop",
    help="Agentic, multi-turn, omni-modal RL post-training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Sub-apps live next to the component they drive; importing them here keeps start-up cheap
    # for commands that do not need torch.
    from omniloop.gateway.cli import app as gateway_app
    from omniloop.inference.cli import app as engine_app
    from omniloop.platform.api.cli import register as register_api
    from omniloop.platform.control.cli import register as register_platform
    from omniloop.sandboxes.cli import app as sandbox_app

    app.add_typer(sandbox_app, name="sandbox", help="Run commands in tool sandboxes.")
    app.add_typer(engine_app, name="engine", help="Serve a model with the CPU inference engine.")
    app.add_typer(gateway_app, name="gateway", help="OpenAI-compatible chat completions, recorded.")
    register_platform(app)
    register_api(app)


_register()
