"""`omniloop sandbox build | reap | serve`: the Docker side of the sandbox CLI.

`register(app)` adds the three commands to the `sandbox` typer app. Imports are deferred so that
`omniloop --help` never loads the Docker SDK or FastAPI.
"""

from __future__ import annotations

import json
import os
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    """Add `build`, `reap` and `serve` to the `omniloop sandbox` app."""
    app.command("build")(build)
    app.command("reap")(reap)
    app.command("serve")(serve)


def _api(docker_host: str | None) -> Any:
    from docker.api.client import APIClient
    from docker.errors import DockerException
    from docker.utils import kwargs_from_env

    kwargs: dict[str, Any] = kwargs_from_env()
    if docker_host:
        kwargs["base_url"] = docker_host
    try:
        return APIClient(version="auto", **kwargs)
    except DockerException as err:
        typer.echo(f"Docker daemon not reachable: {err}", err=True)
        raise typer.Exit(1) from None


def build(
    tag: str = typer.Option("omniloop-sandbox:latest", help="Tag of the image to build."),
    base: str = typer.Option(
        "auto",
        help="auto (public image if pullable, else debootstrap, else busybox), public, "
        "debootstrap, busybox, or any image name to build on.",
    ),
    mirror: str | None = typer.Option(None, help="Debian mirror for debootstrap."),
    force: bool = typer.Option(False, help="Rebuild even when the image is up to date."),
    docker_host: str | None = typer.Option(None, help="Docker endpoint (default: DOCKER_HOST)."),
) -> None:
    """Build the sandbox image from docker/sandbox/Dockerfile, making the base image locally
    when no registry is reachable (the Debian base is cached under ~/.cache/omniloop)."""
    import logging

    from omniloop.errors import SandboxError
    from omniloop.sandboxes.images import build_sandbox_image

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        image_id = build_sandbox_image(
            _api(docker_host), tag=tag, base=base, mirror=mirror, force=force
        )
    except SandboxError as err:
        typer.echo(f"build failed: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"tag": tag, "id": image_id}))


def reap(
    grace: float = typer.Option(60.0, help="Age before a stopped leftover counts as orphaned."),
    docker_host: str | None = typer.Option(None, help="Docker endpoint (default: DOCKER_HOST)."),
) -> None:
    """Remove expired and orphaned sandboxes (containers, networks, volumes) once, by label;
    print what was removed as JSON. Exits 1 when a removal failed."""
    import asyncio

    from omniloop.errors import SandboxError
    from omniloop.sandboxes.docker import DockerHost
    from omniloop.sandboxes.reaper import Reaper

    async def once() -> Any:
        host = await asyncio.to_thread(DockerHost, docker_host)
        try:
            return await Reaper(host, grace=grace).reap_once()
        finally:
            host.close()

    try:
        report = asyncio.run(once())
    except SandboxError as err:
        typer.echo(f"reap failed: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        json.dumps(
            {
                "containers": report.containers,
                "networks": report.networks,
                "volumes": report.volumes,
                "failures": report.failures,
            }
        )
    )
    if report.failures:
        raise typer.Exit(1)


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8765, help="Port to bind."),
    token: str | None = typer.Option(
        None, envvar="OMNILOOP_SANDBOXD_TOKEN", help="Bearer token for mutating requests."
    ),
    image: str = typer.Option("omniloop-sandbox:latest", help="Default sandbox image."),
    backend: str = typer.Option("docker", help="Default backend: docker, gvisor or bwrap."),
    pool_size: int = typer.Option(4, help="Warm sandboxes per image (0: none)."),
    max_sandboxes: int = typer.Option(256, help="Most sandboxes at once."),
    max_concurrent_creates: int = typer.Option(4, help="Creations running at once."),
    max_pending_creates: int = typer.Option(32, help="Creations waiting or running (then 429)."),
    reaper_period: float = typer.Option(30.0, help="Seconds between reaper passes."),
    reaper_grace: float = typer.Option(60.0, help="Age before a stopped leftover is orphaned."),
    lease_timeout: float = typer.Option(
        900.0, help="Close sandboxes idle this long (0: never, only their TTL)."
    ),
    docker_host: str | None = typer.Option(None, help="Docker endpoint (default: DOCKER_HOST)."),
) -> None:
    """Run sandboxd, the sandbox service (sandboxes for clients over HTTP), until
    SIGTERM/Ctrl-C; every sandbox it made is removed before it exits."""
    from pydantic import ValidationError

    from omniloop.errors import ConfigError
    from omniloop.sandboxes.service import SandboxdSettings
    from omniloop.sandboxes.service import serve as run_service

    try:
        settings = SandboxdSettings.model_validate(
            {
                "host": host,
                "port": port,
                "token": token,
                "default_image": image,
                "default_backend": backend,
                "pool_size": pool_size,
                "pool_images": [image] if pool_size else [],
                "max_sandboxes": max_sandboxes,
                "max_concurrent_creates": max_concurrent_creates,
                "max_pending_creates": max_pending_creates,
                "reaper_period": reaper_period,
                "reaper_grace": reaper_grace,
                "lease_timeout": lease_timeout or None,
                "docker_host": docker_host or os.environ.get("DOCKER_HOST"),
            }
        )
        run_service(settings)
    except (ValidationError, ConfigError) as err:
        raise typer.BadParameter(str(err)) from None


def main() -> None:
    """`python -m omniloop.sandboxes.docker_cli build|reap|serve`: the same commands without the
    rest of the omniloop CLI (used by tests and container entry points)."""
    app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
    register(app)
    app()


if __name__ == "__main__":
    main()
