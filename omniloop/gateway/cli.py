"""`omniloop gateway serve`: the OpenAI-compatible gateway in front of a running engine."""

from __future__ import annotations

import asyncio
import os

import typer

app = typer.Typer(no_args_is_help=True)

TOKEN_ENV = "OMNILOOP_GATEWAY_TOKEN"


@app.callback()
def gateway() -> None:
    """OpenAI-compatible chat completions, recorded as token-exact trajectories."""


@app.command()
def serve(
    engine_url: str = typer.Option(..., help="Base URL of the engine (omniloop's or SGLang)."),
    model: str = typer.Option(
        "smollm2",
        help="The engine's model (its tokenizer and chat template): smollm2, tiny, or a "
        "Hugging Face model folder.",
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8100, help="TCP port; 0 picks a free one."),
    max_context: int = typer.Option(4096, help="Most tokens of a conversation."),
    max_new_tokens: int = typer.Option(1024, help="A reply's limit when a request sets none."),
    log_level: str = typer.Option("warning", help="uvicorn log level."),
) -> None:
    """Serve `/v1/chat/completions`; clients use `http://HOST:PORT/v1` as their base URL and
    the token in `$OMNILOOP_GATEWAY_TOKEN` (if set) as their API key."""
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"error: set {TOKEN_ENV} to serve beyond loopback", err=True)
        raise typer.Exit(2)
    options = (max_context, max_new_tokens, token, log_level)
    asyncio.run(_serve(engine_url, model, host, port, *options))


async def _serve(
    engine_url: str,
    model: str,
    host: str,
    port: int,
    max_context: int,
    max_new_tokens: int,
    token: str | None,
    log_level: str,
) -> None:
    import uvicorn

    from omniloop.gateway.app import create_gateway_app
    from omniloop.gateway.completions import Gateway
    from omniloop.inference.client import EngineClient
    from omniloop.inference.models import load_tokenizer

    async with EngineClient(engine_url) as engine:
        gateway = Gateway(
            engine, load_tokenizer(model), model=model, max_context=max_context,
            max_new_tokens=max_new_tokens,
        )  # fmt: skip
        app = create_gateway_app(gateway, token=token)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()
            typer.echo(f"omniloop gateway ready at http://{bound[0]}:{bound[1]}/v1")
        await serving  # until SIGINT or SIGTERM (uvicorn's handlers)
