"""Fixtures of the Docker sandbox suite (SANDBOX-CHECKLIST.md), marker `docker`.

These tests need a Docker daemon (`make test` starts one through scripts/with-services.sh) and
fail, never skip, when it does not answer. gVisor variants run wherever runsc is registered with
the daemon; they fail when runsc is installed but not registered, and skip only on hosts without
runsc at all.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from docker.api.client import APIClient
from docker.utils import kwargs_from_env

from omniloop.processes import free_port
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.docker import (
    LABEL_OWNER,
    DockerSandbox,
    create_docker_sandbox,
    docker_available,
    process_owner,
)
from omniloop.sandboxes.images import BUSYBOX_SANDBOX_IMAGE, SANDBOX_IMAGE, build_sandbox_image

HERE = Path(__file__).parent

SMALL_LIMITS = SandboxLimits(
    timeout=20, memory_mb=512, tmp_mb=64, workspace_mb=64, pids=128, ttl=600, kill_grace=1
)
"""Limits small enough that exhaustion tests end in seconds."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)


@pytest.fixture(scope="session")
def docker_api() -> Iterator[APIClient]:
    """An SDK client of the daemon under test; fails the test when there is none."""
    if not docker_available():
        pytest.fail(
            f"no Docker daemon answers at DOCKER_HOST={os.environ.get('DOCKER_HOST')!r}; run the "
            "suite through `make test` (scripts/with-services.sh starts one)"
        )
    api = APIClient(version="auto", **kwargs_from_env())
    yield api
    # Whatever a failed test left behind in this process's name goes, so reruns start clean.
    for item in api.containers(all=True, filters={"label": f"{LABEL_OWNER}={process_owner()}"}):
        api.remove_container(item["Id"], force=True)
    for item in api.networks(filters={"label": f"{LABEL_OWNER}={process_owner()}"}):
        api.remove_network(item["Id"])
    api.close()


@pytest.fixture(scope="session")
def sandbox_image(docker_api: APIClient) -> str:
    """The default sandbox image (Debian + Python), built once per session (cached base)."""
    build_sandbox_image(docker_api, tag=SANDBOX_IMAGE)
    return SANDBOX_IMAGE


@pytest.fixture(scope="session")
def busybox_image(docker_api: APIClient) -> str:
    """The sandbox Dockerfile on busybox: no Python, the fastest to start."""
    build_sandbox_image(docker_api, tag=BUSYBOX_SANDBOX_IMAGE, base="busybox")
    return BUSYBOX_SANDBOX_IMAGE


def runsc_registered(api: APIClient) -> bool:
    return "runsc" in (api.info().get("Runtimes") or {})


@pytest.fixture(params=["docker", "gvisor"])
def backend(request: pytest.FixtureRequest, docker_api: APIClient) -> str:
    """Each test using it runs against runc and against gVisor."""
    name: str = request.param
    if name == "gvisor" and not runsc_registered(docker_api):
        if shutil.which("runsc"):
            pytest.fail("runsc is installed but not registered with the Docker daemon")
        if os.environ.get("CI"):
            pytest.fail("runsc (gVisor) is missing; scripts/setup.sh installs it")
        pytest.skip("runsc (gVisor) is not installed on this host")
    return name


SandboxFactory = Callable[..., Awaitable[DockerSandbox]]


@pytest.fixture
async def make_sandbox(backend: str, sandbox_image: str) -> AsyncIterator[SandboxFactory]:
    """`await make_sandbox(**limits)` → a sandbox of `backend`, closed after the test."""
    made: list[DockerSandbox] = []

    async def make(
        *, image: str | None = None, config: SandboxConfig | None = None, **limits: Any
    ) -> DockerSandbox:
        if config is None:
            config = SandboxConfig(
                backend=backend,  # type: ignore[arg-type]
                image=image or sandbox_image,
                limits=SMALL_LIMITS.model_copy(update=limits),
            )
        sandbox = await create_docker_sandbox(config, episode_id="test")
        made.append(sandbox)
        return sandbox

    yield make
    await asyncio.gather(*(s.close() for s in made))


@pytest.fixture
def start_sandboxd(
    tmp_path: Path, sandbox_image: str, busybox_image: str, sandboxd_class: Any
) -> Iterator[Callable[..., Any]]:
    """`start_sandboxd(*cli_args)` → a ready sandboxd subprocess, stopped after the test."""
    started: list[Any] = []

    def start(*args: str, ready: bool = True) -> Any:
        log = tmp_path / f"sandboxd-{len(started)}.log"
        service = sandboxd_class(log, "--image", sandbox_image, *args)
        started.append(service)
        if ready:
            service.wait_ready()
        return service

    yield start
    for service in started:
        service.stop()


@pytest.fixture(scope="session")
def sandboxd(
    tmp_path_factory: pytest.TempPathFactory,
    sandbox_image: str,
    busybox_image: str,
    sandboxd_class: Any,
) -> Iterator[Any]:
    """One sandboxd for the session's remote-client tests (pool of 2, quick reaper)."""
    log = tmp_path_factory.mktemp("sandboxd") / "sandboxd.log"
    args = ["--pool-size", "2", "--reaper-period", "2", "--reaper-grace", "5"]
    service = sandboxd_class(log, "--image", sandbox_image, *args)
    service.wait_ready()
    yield service
    service.stop()


async def sandbox_processes(sandbox: DockerSandbox) -> list[tuple[int, int, str, str]]:
    """(pid, uid, state, command line) of every process in the sandbox but the lister itself."""
    script = (
        "import os\n"
        "me = os.getpid()\n"
        "for p in os.listdir('/proc'):\n"
        "    if not p.isdigit() or int(p) == me: continue\n"
        "    try:\n"
        "        st = open(f'/proc/{p}/status').read()\n"
        "        cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()\n"
        "    except OSError: continue\n"
        "    f = dict(l.split(':\\t', 1) for l in st.splitlines() if ':\\t' in l)\n"
        "    print(p, f['Uid'].split()[0], f['State'].split()[0], cmd.strip(), sep='|')\n"
    )
    result = await sandbox.exec(["python3", "-c", script], timeout=30)
    assert result.ok, result
    rows = []
    for line in result.stdout.splitlines():
        pid, uid, state, cmd = line.split("|", 3)
        rows.append((int(pid), int(uid), state, cmd))
    return rows


async def exec_round_trip(sandbox: DockerSandbox, n: int = 5) -> float:
    """Median seconds of `n` runs of `true` in the sandbox: what one exec costs on this host at
    this moment. Time bounds add a multiple of it as headroom, so that a loaded machine (every
    exec slower) does not flip them while a quiet one keeps them tight."""
    seconds = []
    for _ in range(n):
        start = time.monotonic()
        result = await sandbox.exec(["true"], timeout=30)
        assert result.ok, result
        seconds.append(time.monotonic() - start)
    return statistics.median(seconds)


def host_process_count() -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit())


def rss_bytes() -> int:
    """This process's resident set size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture
def helpers() -> Any:
    """Functions shared by the test modules (they are not a package)."""

    class Helpers:
        processes = staticmethod(sandbox_processes)
        exec_round_trip = staticmethod(exec_round_trip)
        host_process_count = staticmethod(host_process_count)
        rss_bytes = staticmethod(rss_bytes)
        free_port = staticmethod(free_port)

    return Helpers


class DockerProxy:
    """A unix-socket relay to the Docker daemon whose connections can be cut, to simulate a
    lost Docker connection. Runs its own event loop in a thread (it outlives test loops)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.target = urlparse(os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")).path
        self.url = f"unix://{path}"
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.start()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while chunk := await src.read(65536):
                    dst.write(chunk)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    def start(self) -> None:
        async def serve() -> None:
            self._server = await asyncio.start_unix_server(self._relay, path=str(self.path))

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(10)

    def cut(self) -> None:
        """Stop accepting and break every open connection."""

        async def cut() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
            self.path.unlink(missing_ok=True)

        asyncio.run_coroutine_threadsafe(cut(), self._loop).result(10)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def docker_proxy(tmp_path: Path, docker_api: APIClient) -> Iterator[DockerProxy]:
    # A short path: unix socket paths are limited to about 100 bytes.
    folder = Path(tempfile.mkdtemp(prefix="omniloop-proxy-"))
    proxy = DockerProxy(folder / "docker.sock")
    yield proxy
    proxy.close()
    shutil.rmtree(folder, ignore_errors=True)
