"""Choosing and creating a sandbox backend from a `SandboxConfig`.

`BACKENDS` is the one place a backend plugs in: its name, how to create a sandbox, and how to
tell whether this host can run it. Backends are imported lazily, so that using one never imports
another's dependencies (the Docker SDK for `bwrap`, say).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from omniloop.errors import SandboxError
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.config import SandboxConfig

logger = logging.getLogger(__name__)

SandboxCreator = Callable[[SandboxConfig], Awaitable[Sandbox]]
"""Makes one ready sandbox from a config; raises `SandboxError` when the host cannot and
`ConfigError` when the backend cannot honour the config."""


@dataclass(frozen=True)
class Backend:
    """Where a backend lives: `module` holds an async `create` and a sync `available`."""

    module: str
    create: str
    """Name of `async def (config: SandboxConfig) -> Sandbox` in `module`."""
    available: str
    """Name of `def () -> bool` in `module`: can this host run the backend (cheap, cached)?"""

    def creator(self) -> SandboxCreator:
        creator: SandboxCreator = getattr(importlib.import_module(self.module), self.create)
        return creator

    def is_available(self) -> bool:
        check: Callable[[], bool] = getattr(importlib.import_module(self.module), self.available)
        return check()


BACKENDS: dict[str, Backend] = {
    "bwrap": Backend("omniloop.sandboxes.bwrap", "create_bwrap_sandbox", "bwrap_available"),
    "docker": Backend("omniloop.sandboxes.docker", "create_docker_sandbox", "docker_available"),
    "gvisor": Backend("omniloop.sandboxes.docker", "create_docker_sandbox", "gvisor_available"),
}
"""Backend name → where it lives."""

AUTO_ORDER = ("docker", "bwrap")
"""What `backend="auto"` tries, first available wins (only registered backends count)."""


def resolve_backend(config: SandboxConfig) -> str:
    """The backend `config` asks for, with `auto` resolved for this host.

    Raises `SandboxError` for a backend that is not registered, or when `auto` finds none that
    this host can run.
    """
    name = config.backend
    if name != "auto":
        if name not in BACKENDS:
            raise SandboxError(
                f"sandbox backend {name!r} is not available in this build "
                f"(registered: {', '.join(sorted(BACKENDS))})"
            )
        return name
    for candidate in AUTO_ORDER:
        backend = BACKENDS.get(candidate)
        if backend is None or not backend.is_available():
            continue
        if candidate == "docker" and not _docker_image_present(config.image):
            # A reachable daemon without the sandbox image would fail every episode; fall back
            # and say how to get the image.
            logger.warning(
                "Docker is reachable but has no image %r (build it with `omniloop sandbox "
                "build`); using the next backend",
                config.image,
            )
            continue
        return candidate
    raise SandboxError(
        f"no sandbox backend can run on this host (tried {', '.join(AUTO_ORDER)}); "
        "install Docker, or bubblewrap for the `bwrap` backend"
    )


def _docker_image_present(image: str) -> bool:
    from omniloop.sandboxes.docker import image_present

    return image_present(image)


async def create_sandbox(config: SandboxConfig) -> Sandbox:
    """Create one ready sandbox with the backend `config` selects (see `resolve_backend`)."""
    return await BACKENDS[resolve_backend(config)].creator()(config)
