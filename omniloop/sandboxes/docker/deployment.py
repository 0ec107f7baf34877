"""How a Docker sandbox comes to be: its container (and in allowlist mode its network and
proxy) created and started with the default run profile, and undone if creation fails or is
cancelled.
"""

from __future__ import annotations

import asyncio
import math
import posixpath
import secrets
import time
from functools import partial
from typing import Any, Literal

from docker.errors import DockerException
from requests.exceptions import RequestException

from omniloop.errors import SandboxError
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.docker.cleanup import remove_resources
from omniloop.sandboxes.docker.client import DockerHost, default_host
from omniloop.sandboxes.docker.network import PROXY_PORT, create_egress
from omniloop.sandboxes.docker.ownership import (
    EGRESS_PREFIX,
    NAME_PREFIX,
    register,
    resource_labels,
    unregister,
)
from omniloop.sandboxes.docker.profile import INIT_UID, check_config, host_config_for
from omniloop.sandboxes.docker.sandbox import DockerSandbox

_background: set[asyncio.Future[Any]] = set()


async def _create(
    host: DockerHost,
    config: SandboxConfig,
    runtime: str | None,
    backend: Literal["docker", "gvisor"],
    episode_id: str | None,
    made: list[tuple[str, str]],
) -> DockerSandbox:
    sandbox_id = secrets.token_hex(6)
    name = NAME_PREFIX + sandbox_id
    limits = config.limits
    expires_at = time.time() + limits.ttl
    labels = resource_labels(sandbox_id, episode_id, expires_at, backend, "sandbox", config.image)
    # Registered before Docker knows the names, so this process's reaper never takes a sandbox
    # that is being created.
    egress_name = EGRESS_PREFIX + sandbox_id
    register(name, egress_name)
    made += [("name", name), ("name", egress_name)]
    environment: dict[str, str] = {}
    network_mode = "none"
    extra: list[str] = []
    networks: list[str] = []
    if config.egress_allowlist is not None:
        network_id, proxy_id, address = await create_egress(host, sandbox_id, config, labels, made)
        networks.append(network_id)
        extra.append(proxy_id)
        proxy_url = f"http://{address}:{PROXY_PORT}"
        names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
        environment = dict.fromkeys(names, proxy_url)
        network_mode = egress_name
    host_config = host_config_for(host.api, config, runtime=runtime, network_mode=network_mode)
    container = await host.call(
        host.api.create_container,
        config.image,
        # The main process outlives nothing: at the TTL it exits and auto-remove deletes the
        # container, even when no omniloop process is left to do it.
        command=["sleep", str(math.ceil(limits.ttl))],
        name=name,
        user=f"{INIT_UID}:{INIT_UID}",
        environment=environment,
        labels=labels,
        host_config=host_config,
        working_dir=posixpath.normpath(config.workdir),
    )
    container_id: str = container["Id"]
    made.append(("container", container_id))
    host.watch_deaths()
    await host.call(host.api.start, container_id)
    return DockerSandbox(
        host,
        config,
        sandbox_id=sandbox_id,
        container_id=container_id,
        backend=backend,
        episode_id=episode_id,
        expires_at=expires_at,
        extra_containers=extra,
        networks=networks,
    )


async def create_docker_sandbox(
    config: SandboxConfig,
    *,
    runtime: str | None = None,
    episode_id: str | None = None,
    host: DockerHost | None = None,
) -> DockerSandbox:
    """Create and start a sandbox container with the default run profile; raise `SandboxError`
    when Docker fails and `ConfigError` for an unusable config.

    `runtime` is the Docker runtime (`runsc` for gVisor); by default it follows
    `config.backend` (`gvisor` → `config.gvisor_runtime`, otherwise the daemon's default).
    Cancelling the call removes whatever it had created."""
    if runtime is None and config.backend == "gvisor":
        runtime = config.gvisor_runtime
    backend: Literal["docker", "gvisor"] = (
        "gvisor" if runtime is not None and "runsc" in runtime else "docker"
    )
    check_config(config, backend)
    docker_host = host if host is not None else await default_host()
    made: list[tuple[str, str]] = []
    task = asyncio.ensure_future(_create(docker_host, config, runtime, backend, episode_id, made))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # The creation goes on in Docker's threads; whatever it ends with is removed.
        task.add_done_callback(partial(_discard_creation, docker_host, made))
        raise
    except BaseException as err:
        await _undo(docker_host, made)
        if isinstance(err, (DockerException, RequestException, OSError)):
            raise SandboxError(
                f"cannot create {backend} sandbox from {config.image}: {err}"
            ) from err
        raise


async def _undo(host: DockerHost, made: list[tuple[str, str]]) -> None:
    containers = [rid for kind, rid in reversed(made) if kind == "container"]
    networks = [rid for kind, rid in made if kind == "network"]
    try:
        await remove_resources(host, containers, networks)
    finally:
        unregister(*(rid for kind, rid in made if kind == "name"))


def _discard_creation(
    host: DockerHost, made: list[tuple[str, str]], task: asyncio.Future[DockerSandbox]
) -> None:
    if not task.cancelled() and task.exception() is None:
        cleanup = asyncio.ensure_future(task.result().close())
    else:
        cleanup = asyncio.ensure_future(_undo(host, made))
    _background.add(cleanup)
    cleanup.add_done_callback(_background.discard)
