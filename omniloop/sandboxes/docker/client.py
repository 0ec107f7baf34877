"""The connection to a Docker daemon (`DockerHost`) and whether one is there at all.

Control calls go through the Docker SDK on a thread pool of the host's own; exec streams go
through `exec_stream` on the event loop; a daemon thread follows Docker's event stream so that a
sandbox's death is known without a round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from docker.api.client import APIClient
from docker.errors import DockerException
from docker.utils import kwargs_from_env
from requests.exceptions import RequestException

from omniloop.errors import SandboxError
from omniloop.sandboxes.docker.exec_stream import StreamEndpoint
from omniloop.sandboxes.docker.ownership import LABEL_SANDBOX

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DockerHost:
    """One connection to a Docker daemon, shared by the sandboxes created through it.

    Control calls go through the Docker SDK on a thread pool of this host's own (the default
    executor has few threads; 32 episodes must not queue behind each other). Exec streams use
    raw asyncio connections to the same endpoint (`unix://`, `tcp://`, TLS from `DOCKER_TLS_*`).
    `DOCKER_HOST` and friends are read as the Docker CLI reads them; `base_url` overrides.
    """

    def __init__(
        self, base_url: str | None = None, *, max_workers: int = 64, timeout: float = 120.0
    ) -> None:
        kwargs: dict[str, Any] = kwargs_from_env()
        if base_url is not None:
            kwargs["base_url"] = base_url
        kwargs.setdefault("base_url", "unix:///var/run/docker.sock")
        self.base_url: str = kwargs["base_url"]
        try:
            self.api = APIClient(
                version="auto", timeout=timeout, max_pool_size=max_workers, **kwargs
            )
        except DockerException as err:
            raise SandboxError(f"Docker daemon at {self.base_url} is not reachable: {err}") from err
        self.api_version: str = self.api.api_version
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="omniloop-docker")
        self._streams = StreamEndpoint(self.base_url, self.api_version, kwargs.get("tls"))
        self.closed = False
        self._dead: dict[str, float] = {}
        self._paused: set[str] = set()
        self._watch_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._watch_stream: Any = None
        self.watching = False

    # -- container deaths, from Docker's event stream --

    def watch_deaths(self) -> None:
        """Follow Docker's event stream (in a daemon thread) and remember which sandbox
        containers died, so that `is_dead` answers without a round trip. Idempotent; the thread
        reconnects after errors and ends with `close`."""
        with self._watch_lock:
            if self._watcher is not None or self.closed:
                return
            self._watcher = threading.Thread(
                target=self._watch, name="omniloop-docker-events", daemon=True
            )
            self._watcher.start()

    def _watch(self) -> None:
        since = time.time()
        backoff = 0.1
        while not self.closed:
            try:
                stream = self.api.events(
                    since=int(since) - 1,
                    filters={
                        "type": "container",
                        "label": [f"{LABEL_SANDBOX}=1"],
                        "event": ["die", "oom", "destroy", "pause", "unpause"],
                    },
                    decode=True,
                )
                self._watch_stream = stream
                self.watching = True
                backoff = 0.1
                for event in stream:
                    since = int(event.get("timeNano", 0)) / 1e9 or since
                    container = event.get("id") or event.get("Actor", {}).get("ID", "")
                    if not container:
                        continue
                    action = event.get("Action") or event.get("status")
                    if action == "pause":
                        self._paused.add(container)
                    elif action == "unpause":
                        self._paused.discard(container)
                    else:
                        self._dead[container] = time.time()
            except Exception as err:  # the thread must survive anything the stream does
                if not self.closed:
                    logger.debug("Docker event stream broke (%s); reconnecting", err)
            finally:
                self.watching = False
            if not self.closed:
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            # Entries older than an hour are of containers long removed.
            cutoff = time.time() - 3600
            for container, seen in list(self._dead.items()):
                if seen < cutoff:
                    self._dead.pop(container, None)

    def is_dead(self, container_id: str) -> bool | None:
        """True when the event stream saw the container die (or it is paused); None when not
        watching."""
        if container_id in self._dead or container_id in self._paused:
            return True
        return False if self.watching else None

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run a blocking SDK call on this host's threads."""
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fresh raw connection to the daemon (for one exec stream)."""
        self._check_open()
        return await self._streams.connect()

    async def start_exec(self, exec_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Start a created exec and return the hijacked connection carrying its stdio (see
        `exec_stream`)."""
        self._check_open()
        return await self._streams.start_exec(exec_id)

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"connection to the Docker daemon at {self.base_url} is closed")

    def close(self) -> None:
        """Close the SDK connection pool and the threads; later calls raise `SandboxError`."""
        self.closed = True
        if self._watch_stream is not None:
            with contextlib.suppress(Exception):
                self._watch_stream.close()
        with contextlib.suppress(Exception):
            self.api.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


_default_host: DockerHost | None = None
_default_host_lock = threading.Lock()


def _make_default_host() -> DockerHost:
    global _default_host
    with _default_host_lock:
        if _default_host is None or _default_host.closed:
            _default_host = DockerHost()
        return _default_host


async def default_host() -> DockerHost:
    """The process-wide `DockerHost` for `DOCKER_HOST` (made on first use)."""
    host = _default_host
    if host is not None and not host.closed:
        return host
    return await asyncio.to_thread(_make_default_host)


_AVAILABLE_TTL = 10.0
_available_cache: dict[str, tuple[float, dict[str, Any] | None]] = {}


def _daemon_info(base_url: str | None, timeout: float) -> dict[str, Any] | None:
    """`docker info` of the daemon at `base_url` (default: `DOCKER_HOST`), None when it does not
    answer; remembered for 10 s so that backend selection stays cheap."""
    key = base_url or os.environ.get("DOCKER_HOST", "")
    cached = _available_cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < _AVAILABLE_TTL:
        return cached[1]
    kwargs: dict[str, Any] = kwargs_from_env()
    if base_url is not None:
        kwargs["base_url"] = base_url
    info: dict[str, Any] | None
    try:
        client = APIClient(version="auto", timeout=timeout, **kwargs)
        try:
            info = dict(client.info())
        finally:
            client.close()
    except (DockerException, RequestException, OSError):
        info = None
    _available_cache[key] = (time.monotonic(), info)
    return info


def docker_available(base_url: str | None = None, timeout: float = 3.0) -> bool:
    """True when a Docker daemon answers at `base_url` (default: `DOCKER_HOST`)."""
    return _daemon_info(base_url, timeout) is not None


def image_present(image: str, base_url: str | None = None, timeout: float = 3.0) -> bool:
    """True when the daemon answers and already has `image` (no registry is ever asked)."""
    kwargs: dict[str, Any] = kwargs_from_env()
    if base_url is not None:
        kwargs["base_url"] = base_url
    try:
        client = APIClient(version="auto", timeout=timeout, **kwargs)
        try:
            client.inspect_image(image)
        finally:
            client.close()
    except (DockerException, RequestException, OSError):
        return False
    return True


def gvisor_available(base_url: str | None = None, timeout: float = 3.0) -> bool:
    """True when the Docker daemon answers and has a runtime named `runsc` registered."""
    info = _daemon_info(base_url, timeout)
    return info is not None and "runsc" in (info.get("Runtimes") or {})


def docker_error(what: str, err: BaseException) -> SandboxError:
    return SandboxError(f"{what}: {err}")
