"""Removal of what sandboxes are made of, and the count of removals that failed.

A failed removal is never ignored: it is logged and counted in `cleanup_failures` (read it as
`omniloop.sandboxes.docker.cleanup_failures`; the service exports it as a metric), and what is
left carries labels by which the reaper finds and removes it later.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from docker.errors import APIError, DockerException, NotFound
from requests.exceptions import RequestException

from omniloop.errors import SandboxError
from omniloop.sandboxes.docker.client import DockerHost

logger = logging.getLogger(__name__)

cleanup_failures = 0
"""How many sandbox clean-ups in this process left something behind (also logged as errors)."""


def count_cleanup_failure(what: str, err: BaseException) -> None:
    """Count and log a removal of `what` (e.g. "volume x") that failed with `err`."""
    global cleanup_failures
    cleanup_failures += 1
    logger.error("sandbox clean-up failed: %s: %s", what, err)


async def remove_resources(
    host: DockerHost, containers: Sequence[str], networks: Sequence[str]
) -> bool:
    """Force-remove containers (running or not) and then networks; True when all are gone.
    Failures are logged and counted in `cleanup_failures`."""
    ok = True
    for container in containers:
        try:
            await host.call(host.api.remove_container, container, force=True, v=True)
        except NotFound:
            pass
        except APIError as err:
            # Auto-remove may already be deleting it.
            if err.status_code == 409 and "already in progress" in str(err):
                continue
            ok = False
            count_cleanup_failure(f"container {container}", err)
        except (DockerException, RequestException, OSError, SandboxError) as err:
            ok = False
            count_cleanup_failure(f"container {container}", err)
    for network in networks:
        try:
            await host.call(host.api.remove_network, network)
        except NotFound:
            pass
        except (DockerException, RequestException, OSError, SandboxError) as err:
            ok = False
            count_cleanup_failure(f"network {network}", err)
    return ok
