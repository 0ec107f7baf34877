"""The `docker` and `gvisor` backends: one hardened container per sandbox.

Model
-----
A `DockerSandbox` is one container, created and started by `create_docker_sandbox`. Its main
process is `sleep <ttl>` under Docker's init (tini), both running as uid 65534; every command
(`exec`) runs as uid 1000 through the Docker API. When the TTL passes, `sleep` exits and the
container (auto-remove) deletes itself, even if nothing of omniloop is alive any more. The
`gvisor` backend is the same container under the `runsc` runtime: a user-space kernel between
the commands and the host kernel.

The Docker SDK does the control calls (create, start, inspect, remove) in a thread pool of its
own; exec output is read from a raw asyncio connection to the Docker API, so a running command
holds no thread and the event loop never blocks.

What is covered
---------------
- Network: `--network none` (loopback only): nothing outside the sandbox, host loopback services
  and other sandboxes included, is reachable; DNS fails at once. Opt-in allowlist mode
  (`SandboxConfig.egress_allowlist`): the sandbox sits alone on a private `internal` network whose
  only other member is its egress proxy (`egress_proxy.py`), which lets through the listed
  `host:port` pairs and refuses everything else, IP literals included.
- Privilege: `--cap-drop ALL`, `no-new-privileges`, Docker's default seccomp profile, no
  `--privileged`, commands as uid/gid 1000, no Docker socket and no host bind mounts. The init
  runs as a different uid (65534), so a command can neither signal nor ptrace PID 1 (Docker's
  default seccomp profile allows ptrace on kernels >= 4.8; the uid boundary is what stops it).
- Filesystem: read-only root; `/tmp` and the workspace are tmpfs mounts with `size=` and
  `nr_inodes=` (ENOSPC at `tmp_mb` / `workspace_mb` / `inodes`, never the host disk: nothing
  the commands write reaches the host's disk except the rotated json-file logs). Tmpfs pages
  count against the memory limit, so
  `tmp_mb + workspace_mb` must stay below `memory_mb` (checked at creation), which makes a full
  tmpfs an ENOSPC and never an OOM kill. A tmpfs workspace is the honest way to bound it here:
  `--storage-opt size=` needs XFS project quotas and is silently ignored elsewhere (moby#46823),
  and nothing else the Docker API offers bounds a directory's size. RLIMIT_FSIZE caps any single
  file at `file_size_mb`; the workspace is empty in every new sandbox.
- Limits: `--memory` = `--memory-swap` = `memory_mb` (an OOM kill inside is reported as
  `stop_reason="oom"`, seen as Docker's `oom` event), `--cpus`, `--pids-limit` (a fork bomb
  gets EAGAIN), `--ulimit nofile` (EMFILE), core dumps off, `--init` reaping zombies,
  `oom_score_adj=500` (the host's OOM killer takes sandboxes before services), json-file logs
  rotated at 3 x 10 MB.
- gVisor: runsc runs with `--oci-seccomp`, so Docker's default seccomp profile also filters the
  sandbox's system calls inside gVisor (scripts/dockerd.sh registers it so). The sentry's own
  host threads count against the pids cgroup (5 to 20 per process of the sandbox, more when it
  forks hard; at the cgroup limit the sentry dies), so the cgroup is sized `pids * 24 + 512`
  and the sandbox's process limit is enforced inside by gVisor through RLIMIT_NPROC (`pids`),
  which there counts only the sandbox's own processes. A fork bomb that holds every process
  slot also blocks the exec that would signal it; the sandbox is then destroyed. The
  sentry's thread count also grows with a fork bomb's churn (runsc 2022's ptrace platform:
  about 200 threads a second at `pids=128`), so a bomb that runs long enough reaches the
  cgroup limit and the sentry dies: the command raises `SandboxError` (no result), as do later
  calls; the host is untouched. A memory-limit overrun kills the whole gVisor sandbox (the
  sentry holds all its memory): the command's result is `oom` and later calls raise
  `SandboxError`.
- Time: a wall-clock timeout per command and an optional no-output timeout. Stopping sends
  SIGTERM to every process of the sandbox user, waits `kill_grace`, then SIGKILL, each from a
  fresh `sh -c 'kill -SIG -1'` exec as uid 1000: `kill(-1)` reaches every process that uid owns
  (setsid, nohup and double-forked daemons included) and never the init, which another uid
  owns. A timeout therefore stops everything the sandbox user runs, not just that command. When
  a command exits while processes it started still hold its output (`server &`, a fork bomb's
  children), they are stopped the same way and the command's own exit status is returned;
  processes that redirected their output (`cmd >log 2>&1 &`) run on until a timeout or `close`.
- Output: stdout and stderr are read frame by frame (at most 64 KiB at a time) into
  `CappedOutput`, so memory stays bounded whatever a command prints.
- Environment: a command sees the image's environment, `config.env` and its call's `env`, never
  the host's.
- Files: `write_file`/`read_file` run `sh` as uid 1000 in the sandbox; paths are normalised and
  must stay inside the workspace; any symlink on the way is refused, and only regular files are
  read or replaced. The checks run as the sandbox user, so a race against a command of the
  sandbox can at worst reach what that user reaches anyway.
- Cleanup: `close` removes the container (and the proxy and network of allowlist mode). Each
  container carries labels `omniloop.sandbox=1`, `omniloop.episode_id`, `omniloop.expires_at` and
  `omniloop.owner` (the creating process); `reaper.py` removes expired ones, ones whose owner
  process is gone and ones whose close failed. Close failures are logged and counted in
  `cleanup_failures`.

What is not covered
-------------------
- The `docker` backend shares the host kernel: a kernel exploit through the allowed syscalls
  escapes. Use `gvisor` for untrusted multi-tenant code.
- Docker reports death by signal N as exit code 128 + N (as the shell does); only an OOM kill is
  told apart (`exit_code=-9`, `stop_reason="oom"`).
- The image must provide `/bin/sh` and `sleep` (commands, file transfer and the tree kill use
  them). Disk use by the image itself and inode counts beyond tmpfs defaults are not limited.
- In allowlist mode, the proxy resolves names with Docker's embedded DNS; names are not checked
  against a DNS-rebinding list beyond loopback/link-local/unspecified addresses. Each sandbox
  gets a network of its own (a /28 of 10.213.0.0/16) and a proxy container.
- A command that leaves a background process holding its output makes Docker delay the
  sandbox's next command by about 2 s (the daemon waits that long for the output to close).
- gVisor as packaged in Debian bookworm (runsc 0.0~20221219): Docker's seccomp profile reaches
  the container's init but not commands started by `docker exec`, so inside gVisor
  `unshare(CLONE_NEWUSER)` succeeds (a user namespace of the sentry's own kernel);
  `nr_inodes` is ignored (file counts are bounded by the memory limit, which kills the whole
  sandbox); coreutils `ls`/`stat` of bookworm fail with EINVAL (statx); allowlist mode is
  unavailable (runsc runs with `--network=none`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import posixpath
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlparse

from docker.api.client import APIClient
from docker.errors import APIError, DockerException, NotFound
from docker.types import IPAMConfig, IPAMPool, LogConfig, Ulimit
from docker.utils import kwargs_from_env
from requests.exceptions import RequestException

from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes.base import ExecResult, ExecStopReason
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.output import CappedOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

SANDBOX_UID = 1000
"""The uid (and gid) every command runs as."""
INIT_UID = 65534
"""The uid of the container's init and main process: not the commands' uid, so they cannot
signal or ptrace it."""
NAME_PREFIX = "omniloop-sbx-"
"""Container names are `omniloop-sbx-<id>`; proxies and networks use `omniloop-egress-<id>`."""
LABEL_SANDBOX = "omniloop.sandbox"
LABEL_EPISODE = "omniloop.episode_id"
LABEL_EXPIRES = "omniloop.expires_at"
LABEL_OWNER = "omniloop.owner"
LABEL_BACKEND = "omniloop.backend"
LABEL_ROLE = "omniloop.role"
LABEL_IMAGE = "omniloop.image"

_MIB = 1024 * 1024
_CHUNK = 64 * 1024
_PROXY_PORT = 3128
_KILL_BUDGET = 0.6  # seconds of retries to get a signalling process started before giving up
_DRAIN = 0.2  # seconds to let output drain once the command has ended
_POLLS = (0.25, 0.5, 1.0)  # when to ask Docker whether a still-streaming command is done
_OOM_WAIT = 0.3  # seconds Docker's `oom` event may trail the command's end
_EXIT_WAIT = 2.0  # seconds Docker may take to record an exec's exit code after its output ends
_SIGKILL_EXIT = 128 + 9
_RUNSC_FAILED = 128

cleanup_failures = 0
"""How many sandbox clean-ups in this process left something behind (also logged as errors)."""

_live_names: set[str] = set()
"""Names of the containers this process created and has not closed (see `owned_live_names`)."""
_live_lock = threading.Lock()
_background: set[asyncio.Future[Any]] = set()


def owned_live_names() -> frozenset[str]:
    """Containers, proxies and networks this process made and still uses. The reaper removes
    everything else this process owns (a close that failed, e.g. after a lost connection)."""
    with _live_lock:
        return frozenset(_live_names)


def _register(*names: str) -> None:
    with _live_lock:
        _live_names.update(names)


def _unregister(*names: str) -> None:
    with _live_lock:
        _live_names.difference_update(names)


def _count_cleanup_failure(what: str, err: BaseException) -> None:
    global cleanup_failures
    cleanup_failures += 1
    logger.error("sandbox clean-up failed: %s: %s", what, err)


# --- owner identity ------------------------------------------------------------------------------


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (start time in clock ticks since boot) follows the parenthesised command name,
    # which may itself contain spaces and parentheses.
    return stat.rsplit(")", 1)[1].split()[19]


def _machine_scope() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "0"
    return f"{boot}/{pidns}"


_OWNER: str | None = None


def process_owner() -> str:
    """This process's identity in `omniloop.owner` labels: `<boot id>/<pid ns>/<pid>/<start>`.

    A reaper on the same machine and pid namespace can tell whether that process still lives; a
    pid reused by a later process has another start time."""
    global _OWNER
    if _OWNER is None or _OWNER.split("/")[2] != str(os.getpid()):
        _OWNER = f"{_machine_scope()}/{os.getpid()}/{_proc_start_time(os.getpid())}"
    return _OWNER


def owner_alive(owner: str) -> bool | None:
    """Whether the process named by an `omniloop.owner` label lives: None when it cannot be
    told from here (another machine or pid namespace, or a malformed label)."""
    parts = owner.split("/")
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    if "/".join(parts[:2]) != _machine_scope():
        return None
    return _proc_start_time(int(parts[2])) == parts[3]


# --- the daemon connection -----------------------------------------------------------------------


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
        self._ssl: ssl.SSLContext | None = None
        tls = kwargs.get("tls")
        if tls:
            self._ssl = ssl.create_default_context(cafile=tls.ca_cert) if tls.verify else None
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
            if tls.cert:
                self._ssl.load_cert_chain(*tls.cert)
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
        if self.closed:
            raise SandboxError(f"connection to the Docker daemon at {self.base_url} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fresh raw connection to the daemon (for one exec stream)."""
        if self.closed:
            raise SandboxError(f"connection to the Docker daemon at {self.base_url} is closed")
        url = urlparse(self.base_url)
        if url.scheme in ("unix", "http+unix"):
            return await asyncio.open_unix_connection(url.path, limit=_CHUNK)
        if url.scheme in ("tcp", "http", "https"):
            use_ssl = self._ssl if (self._ssl is not None or url.scheme == "https") else None
            if url.scheme == "https" and use_ssl is None:
                use_ssl = ssl.create_default_context()
            return await asyncio.open_connection(
                url.hostname, url.port or 2375, ssl=use_ssl, limit=_CHUNK
            )
        raise SandboxError(f"exec streams over {url.scheme}:// are not supported ({self.base_url})")

    async def start_exec(self, exec_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Start a created exec and return the hijacked connection carrying its stdio."""
        reader, writer = await self.connect()
        try:
            body = b'{"Detach": false, "Tty": false}'
            writer.write(
                f"POST /v{self.api_version}/exec/{exec_id}/start HTTP/1.1\r\n"
                "Host: docker\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            status = int(status_line.split(" ")[1])
            if status not in (101, 200):
                headers = dict(line.split(":", 1) for line in header_lines if ":" in line)
                length = int(
                    next((v for k, v in headers.items() if k.lower() == "content-length"), "0")
                )
                detail = (await reader.read(min(length, 4096))).decode(errors="replace")
                raise SandboxError(f"exec start failed ({status}): {detail.strip()}")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
            writer.close()
            raise SandboxError(f"exec start failed: {err}") from err
        except BaseException:
            writer.close()
            raise
        return reader, writer

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


def _docker_error(what: str, err: BaseException) -> SandboxError:
    return SandboxError(f"{what}: {err}")


# --- output sinks --------------------------------------------------------------------------------


class _Sink(Protocol):
    def feed(self, chunk: bytes) -> None: ...


class _BoundedBytes:
    """Collects a stream whole, up to `limit` bytes; notes an overflow instead of growing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.overflow = False

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.overflow = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk


async def _pump(
    reader: asyncio.StreamReader, sinks: Mapping[int, _Sink], last_output: list[float]
) -> None:
    """Demultiplex Docker's stdio frames (8-byte header: stream, 0, 0, 0, big-endian size) into
    the sinks, a bounded chunk at a time, until the stream ends."""
    while True:
        try:
            header = await reader.readexactly(8)
        except asyncio.IncompleteReadError:
            return
        sink = sinks.get(header[0])
        size = int.from_bytes(header[4:8], "big")
        while size:
            chunk = await reader.read(min(size, _CHUNK))
            if not chunk:
                return
            size -= len(chunk)
            last_output[0] = time.monotonic()
            if sink is not None:
                sink.feed(chunk)


async def _feed_stdin(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        for start in range(0, len(data), _CHUNK):
            writer.write(data[start : start + _CHUNK])
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        # The command exited without reading all of its input; that is its business.
        pass


# --- the sandbox ---------------------------------------------------------------------------------

# Walks the path one component at a time and refuses symlinks, then reads or replaces a regular
# file. Arguments: workspace, target (normalised, absolute, inside the workspace), mode.
_FILE_SCRIPT = r"""
W=$1; T=$2; M=$3
rel=${T#"$W"/}; cur=$W; set -f; IFS=/
for part in $rel; do
  cur=$cur/$part
  if [ -L "$cur" ]; then echo "symlink on the path: $cur" >&2; exit 97; fi
  if [ "$cur" != "$T" ] && [ -e "$cur" ] && [ ! -d "$cur" ]; then
    echo "not a directory: $cur" >&2; exit 98
  fi
done
unset IFS
if [ -e "$T" ] && [ ! -f "$T" ]; then echo "not a regular file: $T" >&2; exit 98; fi
if [ "$M" = read ]; then
  [ -f "$T" ] || { echo "no such file: $T" >&2; exit 96; }
  exec cat -- "$T"
fi
mkdir -p -- "${T%/*}" || exit 98
exec cat > "$T"
"""
_FILE_ERRORS = {96: FileNotFoundError, 97: PermissionError, 98: PermissionError}


def resolve_workspace_path(workdir: str, path: str) -> str:
    """The absolute, normalised path of `path` (relative to `workdir`, or absolute inside it);
    raise `SandboxError` for anything that leaves the workspace or names the workspace itself."""
    if not path or "\x00" in path:
        raise SandboxError(f"invalid path {path!r}")
    root = posixpath.normpath(workdir)
    resolved = posixpath.normpath(posixpath.join(root, path))
    if not resolved.startswith(root.rstrip("/") + "/"):
        raise SandboxError(f"path {path!r} leaves the workspace {workdir}")
    return resolved


class DockerSandbox:
    """A running container implementing the `Sandbox` protocol (see the module docstring)."""

    def __init__(
        self,
        host: DockerHost,
        config: SandboxConfig,
        *,
        sandbox_id: str,
        container_id: str,
        backend: Literal["docker", "gvisor"],
        episode_id: str | None,
        expires_at: float,
        extra_containers: Sequence[str] = (),
        networks: Sequence[str] = (),
    ) -> None:
        self.id = sandbox_id
        self.host = host
        self.config = config
        self.container_id = container_id
        self.backend = backend
        self.episode_id = episode_id
        self.expires_at = expires_at
        self._extra_containers = list(extra_containers)
        self._networks = list(networks)
        self._closed = False
        self._dead: str | None = None
        self._close_task: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        """The container's name, `omniloop-sbx-<id>`."""
        return NAME_PREFIX + self.id

    def __repr__(self) -> str:
        return f"DockerSandbox(id={self.id!r}, backend={self.backend!r}, closed={self._closed})"

    async def __aenter__(self) -> DockerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._dead is not None:
            raise SandboxError(f"sandbox {self.id} is no longer running ({self._dead})")

    async def _api(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        try:
            return await self.host.call(fn, *args, **kwargs)
        except NotFound as err:
            self._dead = "container gone"
            raise SandboxError(f"sandbox {self.id}: container is gone: {err}") from err
        except (DockerException, RequestException, OSError) as err:
            what = f"sandbox {self.id}: Docker call {fn.__name__} failed"
            raise _docker_error(what, err) from err

    # -- commands --

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `command` as uid 1000 in the workspace (a string runs under `/bin/sh -c`).

        Stops it at `timeout` (default `limits.timeout`) → `tool_timeout`, after
        `limits.idle_timeout` without output → `idle_timeout`; an OOM kill → `oom`. Stopping a
        command stops every process of the sandbox user. Raises `SandboxError` only when the
        sandbox or Docker fails."""
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise SandboxError("empty command")
        limits = self.config.limits
        data = stdin.encode() if isinstance(stdin, str) else stdin
        out, err = CappedOutput(limits.output_bytes), CappedOutput(limits.output_bytes)
        exit_code, reason, duration = await self._run(
            argv,
            sinks={1: out, 2: err},
            timeout=limits.timeout if timeout is None else timeout,
            idle_timeout=limits.idle_timeout,
            stdin=data,
            env=env,
        )
        return ExecResult(
            exit_code=exit_code,
            stdout=out.text(),
            stderr=err.text(),
            truncated=out.truncated or err.truncated,
            stop_reason=reason,
            duration=duration,
        )

    def _environment(self, env: Mapping[str, str] | None) -> dict[str, str]:
        merged = {**self.config.env, **(env or {})}
        for key, value in merged.items():
            if not key or "=" in key or "\x00" in key or "\x00" in value:
                raise SandboxError(f"invalid environment variable {key!r}")
        return merged

    async def _run(
        self,
        argv: list[str],
        *,
        sinks: Mapping[int, _Sink],
        timeout: float,
        idle_timeout: float | None,
        stdin: bytes | None,
        env: Mapping[str, str] | None,
    ) -> tuple[int | None, ExecStopReason, float]:
        self._check_usable()
        environment = self._environment(env)
        start_ns = time.time_ns()
        start = time.monotonic()
        try:
            exec_id: str = (
                await self._api(
                    self.host.api.exec_create,
                    self.container_id,
                    argv,
                    stdout=True,
                    stderr=True,
                    stdin=stdin is not None,
                    user=f"{SANDBOX_UID}:{SANDBOX_UID}",
                    environment=environment,
                    workdir=self.config.workdir,
                )
            )["Id"]
            reader, writer = await self.host.start_exec(exec_id)
        except OSError as err:
            await self._refresh_state()
            raise _docker_error(f"sandbox {self.id}: cannot reach Docker", err) from err
        except SandboxError:
            await self._refresh_state()
            raise
        last_output = [time.monotonic()]
        pump = asyncio.ensure_future(_pump(reader, sinks, last_output))
        feeder = asyncio.ensure_future(_feed_stdin(writer, stdin)) if stdin is not None else None
        stop: ExecStopReason | None = None
        exit_code: int | None = None
        try:
            verdict = await self._supervise(
                exec_id, pump, start, timeout, idle_timeout, last_output
            )
            if verdict == "strays":
                exit_code = await self._exit_code(exec_id)
            if verdict is not None:
                await self._stop_everything(pump)
            if verdict != "strays":
                stop = verdict
        finally:
            for task in (pump, feeder):
                if task is not None and not task.done():
                    task.cancel()
            writer.close()
        duration = time.monotonic() - start
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            logger.warning("sandbox %s: exec stream failed: %s", self.id, pump.exception())
        if stop is not None:
            return None, stop, duration
        if exit_code is not None:
            # The command had exited; only its strays were stopped (perhaps with the sandbox).
            return exit_code, "exit", duration
        exit_code = await self._exit_code(exec_id)
        if self.backend == "gvisor" and exit_code == _RUNSC_FAILED:
            # runsc reports its sentry's death to the exec (128) a moment before Docker sees
            # the container stop.
            await self._wait_stopped(2.0)
        died = await self._refresh_state()
        if (exit_code == _SIGKILL_EXIT or died) and await self._oom_since(start_ns):
            if died:
                self._dead = "killed for exceeding its memory limit"
            return -9, "oom", duration
        if died:
            raise SandboxError(f"sandbox {self.id} died while running a command ({self._dead})")
        if exit_code is None:
            raise SandboxError(f"sandbox {self.id}: exec {exec_id} never reported an exit code")
        return exit_code, "exit", duration

    async def _supervise(
        self,
        exec_id: str,
        pump: asyncio.Future[None],
        start: float,
        timeout: float,
        idle_timeout: float | None,
        last_output: list[float],
    ) -> Literal["tool_timeout", "idle_timeout", "strays"] | None:
        """Wait for the output to end; return why the sandbox user's processes must be stopped,
        if they must: a timeout, or `strays` (the command exited, but processes it started still
        hold its output)."""
        deadline = start + timeout
        polls = list(_POLLS)
        next_poll = start + polls.pop(0)
        while not pump.done():
            now = time.monotonic()
            if now >= deadline:
                return "tool_timeout"
            if idle_timeout is not None and now - last_output[0] >= idle_timeout:
                return "idle_timeout"
            if now >= next_poll:
                next_poll = now + (polls.pop(0) if polls else _POLLS[-1])
                try:
                    info = await self.host.call(self.host.api.exec_inspect, exec_id)
                except NotFound:
                    # The container is gone (auto-removed after its init died).
                    return None
                except (DockerException, RequestException, OSError) as err:
                    raise _docker_error(f"sandbox {self.id}: exec_inspect failed", err) from err
                if not info.get("Running"):
                    # The command ended but its output stays open: processes it started hold
                    # stdout (a fork bomb's children, `server &`), or (gVisor) the sandbox died
                    # under the stream. The command's own result is what counts; the strays
                    # are stopped (their output has nowhere to go, and Docker would stall the
                    # sandbox's next command for 2 s waiting for it).
                    await asyncio.wait({pump}, timeout=_DRAIN)
                    if pump.done() or not await self._running():
                        return None
                    return "strays"
                continue
            wake = min(deadline, next_poll)
            if idle_timeout is not None:
                wake = min(wake, last_output[0] + idle_timeout)
            await asyncio.wait({pump}, timeout=max(wake - now, 0.0))
        return None

    async def _stop_everything(self, pump: asyncio.Future[None]) -> None:
        """SIGTERM every process of the sandbox user, SIGKILL what is left after the grace. When
        no signal can be delivered (no process can be started to send it), the sandbox is
        destroyed instead: nothing of the command may outlive its timeout."""
        if await self.signal_all("TERM"):
            await asyncio.wait({pump}, timeout=self.config.limits.kill_grace)
            if await self.signal_all("KILL"):
                await asyncio.wait({pump}, timeout=_DRAIN)
                return
        if self._dead is None and not self._closed:
            await self._destroy("its processes could not be stopped (process limit exhausted)")

    async def _destroy(self, reason: str) -> None:
        self._dead = reason
        logger.warning("sandbox %s destroyed: %s", self.id, reason)
        await remove_resources(self.host, [self.container_id], [])

    async def signal_all(self, signal: Literal["TERM", "KILL"] = "KILL") -> bool:
        """Send `signal` to every process of the sandbox user (the init is another uid and is
        spared); return False if the sandbox is not running. Used for timeouts, and before a
        verifier runs so that nothing the agent started can still touch the workspace."""
        if self._closed or self._dead is not None:
            return False
        script = f"kill -{signal} -1; kill -{signal} -1"
        deadline = time.monotonic() + _KILL_BUDGET
        attempt = 0
        while True:
            attempt += 1
            try:
                exec_id = (
                    await self._api(
                        self.host.api.exec_create,
                        self.container_id,
                        ["/bin/sh", "-c", script],
                        user=f"{SANDBOX_UID}:{SANDBOX_UID}",
                        stdout=False,
                        stderr=False,
                    )
                )["Id"]
                await self._api(self.host.api.exec_start, exec_id)
                info = await self._api(self.host.api.exec_inspect, exec_id)
                # 126: the runtime could not start the process (no pid or process slot).
                if info.get("ExitCode") != 126:
                    return True
                raise SandboxError("the runtime could not start the signalling process")
            except SandboxError as err:
                if not await self._running():
                    return False
                # Under a fork bomb a pid frees up within a few tries (runc); gVisor counts the
                # exec against the user's RLIMIT_NPROC, which the bomb may hold for good.
                logger.debug("sandbox %s: kill attempt %d failed: %s", self.id, attempt, err)
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.02 * attempt)
        logger.error("sandbox %s: could not deliver SIG%s to its processes", self.id, signal)
        return False

    async def _exit_code(self, exec_id: str) -> int | None:
        deadline = time.monotonic() + _EXIT_WAIT
        while True:
            try:
                info = await self.host.call(self.host.api.exec_inspect, exec_id)
            except (DockerException, RequestException, OSError):
                return None
            if not info.get("Running"):
                code = info.get("ExitCode")
                return int(code) if code is not None else None
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.01)

    async def _running(self) -> bool:
        if self.host.closed:
            return True
        try:
            info = await self.host.call(self.host.api.inspect_container, self.container_id)
        except NotFound:
            self._dead = self._dead or "container gone"
            return False
        except (DockerException, RequestException, OSError):
            return True
        state = info.get("State", {})
        if not state.get("Running") or state.get("Paused") or state.get("Restarting"):
            self._dead = self._dead or f"container {state.get('Status', 'gone')}"
            return False
        return True

    async def _wait_stopped(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while await self._running():
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.1)

    async def _refresh_state(self) -> bool:
        """True when the container stopped running (then `_dead` says why)."""
        return not await self._running()

    async def _oom_since(self, start_ns: int) -> bool:
        """True when Docker saw an OOM kill in this container since `start_ns` (wall clock)."""

        def scan() -> bool:
            stream = self.host.api.events(
                since=start_ns // 1_000_000_000 - 1,
                until=math.ceil(time.time() + _OOM_WAIT),
                filters={"container": self.container_id, "event": "oom"},
                decode=True,
            )
            try:
                for event in stream:
                    # Docker's clock and ours are the same host's; allow a little skew.
                    if int(event.get("timeNano", 0)) >= start_ns - 50_000_000:
                        return True
            finally:
                stream.close()
            return False

        try:
            return await self.host.call(scan)
        except (DockerException, RequestException, OSError) as err:
            logger.warning("sandbox %s: cannot read Docker events: %s", self.id, err)
            return False

    async def healthy(self) -> bool:
        """The pool's check: not closed, not dead, and with most of its TTL still ahead (a
        pooled sandbox idle for over a tenth of its TTL is replaced). Death is known from
        Docker's event stream without a round trip; without it, the container is inspected."""
        if self._closed or self._dead is not None:
            return False
        if time.time() > self.expires_at - 0.9 * self.config.limits.ttl:
            return False
        dead = self.host.is_dead(self.container_id)
        if dead is None:
            return await self._running()
        return not dead

    # -- files --

    async def _file_op(
        self, path: str, mode: Literal["read", "write"], data: bytes | None
    ) -> bytes:
        target = resolve_workspace_path(self.config.workdir, path)
        limit = self.config.limits.file_size_mb * _MIB
        out, err = _BoundedBytes(limit), _BoundedBytes(4096)
        workspace = posixpath.normpath(self.config.workdir)
        exit_code, reason, _ = await self._run(
            ["/bin/sh", "-c", _FILE_SCRIPT, "sh", workspace, target, mode],
            sinks={1: out, 2: err},
            timeout=self.config.limits.timeout,
            idle_timeout=None,
            stdin=data,
            env=None,
        )
        message = err.data.decode(errors="replace").strip()
        if reason != "exit":
            raise SandboxError(f"{mode} of {path!r} stopped: {reason}")
        if exit_code in _FILE_ERRORS:
            raise SandboxError(f"{mode} of {path!r} refused: {message}")
        if exit_code != 0:
            raise SandboxError(f"{mode} of {path!r} failed (exit {exit_code}): {message}")
        if out.overflow:
            raise SandboxError(f"{path!r} is larger than the {limit} byte read limit")
        return bytes(out.data)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a regular file in the workspace (parents created), owned by the
        sandbox user. Refuses paths leaving the workspace and paths through symlinks."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await self._file_op(path, "write", payload)

    async def read_file(self, path: str) -> bytes:
        """Read a regular file of the workspace (at most `limits.file_size_mb`). Refuses paths
        leaving the workspace and paths through symlinks."""
        return await self._file_op(path, "read", None)

    # -- teardown --

    async def close(self) -> None:
        """Remove the container (and the proxy and network of allowlist mode). Idempotent;
        concurrent calls wait for the same removal. Failures are logged and counted in
        `cleanup_failures`, and left to the reaper."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._teardown())
        await asyncio.shield(self._close_task)

    async def _teardown(self) -> None:
        names = [self.name, *self._extra_containers, *self._networks]
        try:
            await remove_resources(
                self.host, [self.container_id, *self._extra_containers], self._networks
            )
        finally:
            # Whatever is left is no longer ours to use: the reaper may take it now.
            _unregister(*names)


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
            _count_cleanup_failure(f"container {container}", err)
        except (DockerException, RequestException, OSError, SandboxError) as err:
            ok = False
            _count_cleanup_failure(f"container {container}", err)
    for network in networks:
        try:
            await host.call(host.api.remove_network, network)
        except NotFound:
            pass
        except (DockerException, RequestException, OSError, SandboxError) as err:
            ok = False
            _count_cleanup_failure(f"network {network}", err)
    return ok


# --- creation ------------------------------------------------------------------------------------


def _check_config(config: SandboxConfig, backend: str) -> None:
    limits = config.limits
    if limits.tmp_mb + limits.workspace_mb >= limits.memory_mb:
        raise ConfigError(
            f"tmp_mb ({limits.tmp_mb}) + workspace_mb ({limits.workspace_mb}) must stay below "
            f"memory_mb ({limits.memory_mb}): tmpfs pages count against the memory limit, and a "
            "full /tmp must be ENOSPC, not an OOM kill. Lower the tmpfs sizes or raise memory_mb."
        )
    if not posixpath.isabs(config.workdir) or posixpath.normpath(config.workdir) in ("/", "/tmp"):
        raise ConfigError(
            f"workdir must be an absolute folder other than / and /tmp, got {config.workdir!r}"
        )
    if config.egress_allowlist is not None and backend == "gvisor":
        raise ConfigError(
            "egress_allowlist is not available with the gvisor backend: runsc is registered "
            "with --network=none (scripts/dockerd.sh), so a gVisor sandbox has loopback only"
        )


def _labels(
    sandbox_id: str, episode_id: str | None, expires_at: float, backend: str, role: str, image: str
) -> dict[str, str]:
    return {
        LABEL_SANDBOX: "1",
        LABEL_EPISODE: episode_id or "",
        LABEL_EXPIRES: str(int(expires_at)),
        LABEL_OWNER: process_owner(),
        LABEL_BACKEND: backend,
        LABEL_ROLE: role,
        LABEL_IMAGE: image,
        "omniloop.sandbox_id": sandbox_id,
    }


def host_config_for(
    api: APIClient,
    config: SandboxConfig,
    *,
    runtime: str | None,
    network_mode: str,
) -> dict[str, Any]:
    """The Docker HostConfig of the default run profile (SANDBOX-CHECKLIST.md) for `config`."""
    limits = config.limits
    memory = limits.memory_mb * _MIB
    fsize = limits.file_size_mb * _MIB
    ulimits = [
        Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
        Ulimit(name="fsize", soft=fsize, hard=fsize),
        Ulimit(name="core", soft=0, hard=0),
    ]
    pids = limits.pids
    if runtime is not None and "runsc" in runtime:
        # gVisor's sentry threads share the pids cgroup with the sandbox's processes (about five
        # host threads per process); the sandbox's own limit is enforced inside by gVisor.
        ulimits.append(Ulimit(name="nproc", soft=limits.pids, hard=limits.pids))
        pids = limits.pids * 24 + 512
    tmpfs = {
        "/tmp": f"rw,nosuid,nodev,size={limits.tmp_mb}m,nr_inodes={limits.inodes},mode=1777",
        posixpath.normpath(config.workdir): (
            f"rw,nosuid,nodev,size={limits.workspace_mb}m,nr_inodes={limits.inodes},"
            f"uid={SANDBOX_UID},gid={SANDBOX_UID},mode=0755"
        ),
    }
    return api.create_host_config(
        network_mode=network_mode,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        privileged=False,
        read_only=True,
        tmpfs=tmpfs,
        mem_limit=memory,
        memswap_limit=memory,
        nano_cpus=int(limits.cpus * 1e9),
        # The CPU weight follows the allowance: while a throttled sandbox bursts through its
        # quota, a neighbour with a larger allowance keeps the larger part of each CPU.
        cpu_shares=max(2, int(1024 * limits.cpus)),
        pids_limit=pids,
        ulimits=ulimits,
        init=True,
        ipc_mode="private",
        oom_score_adj=500,
        auto_remove=True,
        log_config=LogConfig(type="json-file", config={"max-size": "10m", "max-file": "3"}),
        runtime=runtime,
    )


async def _wait_for_log(host: DockerHost, container: str, text: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        logs: bytes = await host.call(host.api.logs, container, stdout=True, stderr=True)
        if text in logs:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"{container} did not become ready: {logs[-2000:]!r}")
        await asyncio.sleep(0.05)


async def _create_private_network(host: DockerHost, name: str, labels: dict[str, str]) -> str:
    """An `internal` bridge network of its own for one sandbox: no route out, and no address
    for the host on it (`inhibit_ipv4`), so host services on 0.0.0.0 stay out of reach.

    Each gets a random /28 from 10.213.0.0/16: Docker's default pools hold about 30 networks,
    too few for one per sandbox; a clash with another network is retried."""
    last: BaseException | None = None
    for _ in range(8):
        block = secrets.randbelow(4096)
        subnet = f"10.213.{block // 16}.{(block % 16) * 16}/28"
        ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=subnet)])
        try:
            network = await host.call(
                host.api.create_network,
                name,
                driver="bridge",
                internal=True,
                ipam=ipam,
                options={"com.docker.network.bridge.inhibit_ipv4": "true"},
                labels=labels,
                check_duplicate=True,
            )
        except APIError as err:
            if "overlap" not in str(err).lower():
                raise
            last = err
            continue
        return str(network["Id"])
    raise SandboxError(f"no free subnet for network {name}: {last}")


async def _create_egress(
    host: DockerHost,
    sandbox_id: str,
    config: SandboxConfig,
    labels: dict[str, str],
    made: list[tuple[str, str]],
) -> tuple[str, str, str]:
    """Create the sandbox's private internal network and its egress proxy; return (network id,
    proxy container id, proxy address)."""
    from omniloop.sandboxes import egress_proxy

    name = f"omniloop-egress-{sandbox_id}"
    network_id = await _create_private_network(host, name, {**labels, LABEL_ROLE: "network"})
    made.append(("network", network_id))
    allow = [arg for entry in config.egress_allowlist or [] for arg in ("--allow", entry)]
    proxy_limits = config.limits.model_copy(
        update={"memory_mb": 256, "tmp_mb": 16, "workspace_mb": 16, "pids": 64, "cpus": 0.5}
    )
    proxy_config = config.model_copy(update={"limits": proxy_limits})
    host_config = host_config_for(host.api, proxy_config, runtime=None, network_mode=name)
    source = await asyncio.to_thread(Path(egress_proxy.__file__).read_text)
    proxy = await host.call(
        host.api.create_container,
        config.image,
        command=["python3", "-c", source, "--port", str(_PROXY_PORT), *allow],
        name=name,
        user=f"{INIT_UID}:{INIT_UID}",
        labels={**labels, LABEL_ROLE: "egress-proxy"},
        host_config=host_config,
        working_dir="/tmp",
    )
    proxy_id: str = proxy["Id"]
    made.append(("container", proxy_id))
    await host.call(host.api.connect_container_to_network, proxy_id, config.egress_network)
    await host.call(host.api.start, proxy_id)
    await _wait_for_log(host, proxy_id, b"egress proxy ready", timeout=30)
    info = await host.call(host.api.inspect_container, proxy_id)
    address: str = info["NetworkSettings"]["Networks"][name]["IPAddress"]
    return network_id, proxy_id, address


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
    labels = _labels(sandbox_id, episode_id, expires_at, backend, "sandbox", config.image)
    # Registered before Docker knows the names, so this process's reaper never takes a sandbox
    # that is being created.
    egress_name = f"omniloop-egress-{sandbox_id}"
    _register(name, egress_name)
    made += [("name", name), ("name", egress_name)]
    environment: dict[str, str] = {}
    network_mode = "none"
    extra: list[str] = []
    networks: list[str] = []
    if config.egress_allowlist is not None:
        network_id, proxy_id, address = await _create_egress(host, sandbox_id, config, labels, made)
        networks.append(network_id)
        extra.append(proxy_id)
        proxy_url = f"http://{address}:{_PROXY_PORT}"
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
    _check_config(config, backend)
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
        _unregister(*(rid for kind, rid in made if kind == "name"))


def _discard_creation(
    host: DockerHost, made: list[tuple[str, str]], task: asyncio.Future[DockerSandbox]
) -> None:
    if not task.cancelled() and task.exception() is None:
        cleanup = asyncio.ensure_future(task.result().close())
    else:
        cleanup = asyncio.ensure_future(_undo(host, made))
    _background.add(cleanup)
    cleanup.add_done_callback(_background.discard)


def sandbox_labels_filter() -> dict[str, list[str]]:
    """The Docker API filter that selects everything omniloop sandboxes are made of."""
    return {"label": [f"{LABEL_SANDBOX}=1"]}
