"""`omniloop engine serve`: run the CPU engine's SGLang-compatible HTTP server."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from omniloop.errors import ConfigError

if TYPE_CHECKING:
    from omniloop.inference.core import EngineServerConfig
    from omniloop.modalities.config import MediaConfig

app = typer.Typer(no_args_is_help=True)


@app.callback()
def engine() -> None:
    """omniloop's CPU inference engine (SGLang's native HTTP API)."""


@app.command()
def serve(
    model: str = typer.Option(
        "tiny", help="smollm2, tiny, tiny-omni, or a Hugging Face model folder."
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(30000, help="TCP port; 0 picks a free one."),
    threads: int | None = typer.Option(
        None, help="torch threads for the forward passes (default: every available core)."
    ),
    max_batch: int = typer.Option(32, help="Most sequences decoded together."),
    max_context: int | None = typer.Option(
        None, help="Most tokens per sequence, prompt included (default: model limit, ≤4096)."
    ),
    prefill_tokens: int = typer.Option(2048, help="Most prompt tokens per prefill forward."),
    prefix_cache_slots: int = typer.Option(
        32, help="Finished sequences kept for prompts that extend them; 0 turns the cache off."
    ),
    media: str | None = typer.Option(
        None,
        help="The media config (MediaConfig: bounds, frame rate, pixels) as a YAML or JSON "
        "file, or inline as a JSON object; it must match the one the prompts' placeholder "
        "blocks were counted with.",
    ),
    log_level: str = typer.Option("warning", help="uvicorn log level."),
) -> None:
    """Serve a model; prints `omniloop engine ready at URL` once it accepts requests."""
    from pydantic import ValidationError

    from omniloop.config import format_validation_error
    from omniloop.inference.core import EngineServerConfig

    try:
        media_config = _read_media(media)
    except ConfigError as err:
        raise typer.BadParameter(str(err), param_hint="--media") from None
    try:
        config = EngineServerConfig(
            model=model,
            host=host,
            port=port,
            threads=threads,
            max_batch=max_batch,
            max_context=max_context,
            prefill_tokens=prefill_tokens,
            prefix_cache_slots=prefix_cache_slots,
            media=media_config,
        )
    except ValidationError as err:
        raise typer.BadParameter(format_validation_error(EngineServerConfig, err)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(_serve(config, log_level))
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _read_media(value: str | None) -> MediaConfig:
    """`--media`'s `MediaConfig`: inline JSON (`{...}`) or a YAML/JSON file; defaults without."""
    from pydantic import ValidationError

    from omniloop.config import format_validation_error, load_config
    from omniloop.modalities.config import MediaConfig

    if value is None:
        return MediaConfig()
    if value.lstrip().startswith("{"):
        try:
            return MediaConfig.model_validate_json(value)
        except ValidationError as err:
            raise ConfigError(format_validation_error(MediaConfig, err)) from None
    return load_config(MediaConfig, Path(value))


async def _serve(config: EngineServerConfig, log_level: str) -> None:
    import uvicorn

    from omniloop.inference.core import build_core
    from omniloop.inference.server import create_app

    core = build_core(config)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(core, config.media),
            host=config.host,
            port=config.port,
            log_level=log_level,
            timeout_keep_alive=30,
            # On SIGTERM, give running generations 5 s, then fail them (the core shuts down).
            timeout_graceful_shutdown=5,
        )
    )
    serving = asyncio.create_task(server.serve())
    # uvicorn signals readiness only through the `started` flag (set after the socket binds).
    while not server.started and not serving.done():  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if server.started:
        sock = server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        typer.echo(
            f"omniloop engine ready at http://{shown}:{port} "
            f"(model {core.model_path}, threads {core.threads}, max_batch {core.max_batch}, "
            f"max_context {core.max_context})"
        )
    await serving


if __name__ == "__main__":  # `python -m omniloop.inference.cli serve ...` (engines.py)
    app(prog_name="omniloop engine")
