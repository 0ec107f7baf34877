"""What runs inside a Docker sandbox: commands (`exec`), their supervision (timeouts, strays,
OOM kills, a dead container) and the signals that stop them, and workspace file access.

Each command is a Docker exec as uid 1000 whose stdio is an exec stream (`exec_stream`); the
Docker SDK does the control calls (exec create and inspect, container inspect, events) on the
host's thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from docker.errors import DockerException, NotFound
from requests.exceptions import RequestException

from omniloop.errors import SandboxError
from omniloop.sandboxes.base import ExecResult, ExecStopReason
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.docker import exec_stream
from omniloop.sandboxes.docker.cleanup import remove_resources
from omniloop.sandboxes.docker.client import DockerHost, docker_error
from omniloop.sandboxes.docker.exec_stream import Sink
from omniloop.sandboxes.docker.files import transfer
from omniloop.sandboxes.docker.ownership import NAME_PREFIX, unregister
from omniloop.sandboxes.docker.profile import SANDBOX_UID
from omniloop.sandboxes.output import CappedOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

_KILL_BUDGET = 0.6  # seconds of retries to get a signalling process started before giving up
_DRAIN = 0.2  # seconds to let output drain once the command has ended
_POLLS = (0.25, 0.5, 1.0)  # when to ask Docker whether a still-streaming command is done
# Seconds Docker's `oom` event may trail the command's end (on a loaded host, over a second
# under gVisor). The scan returns at the first event, so only a SIGKILL or death that was
# not an OOM kill waits this long.
_OOM_WAIT = 3.0
_EXIT_WAIT = 2.0  # seconds Docker may take to record an exec's exit code after its output ends
# Stopping a command may take this long past its kill grace (signalling execs, each a few
# Docker round trips, which take seconds on a loaded host beside a fork bomb) before its
# sandbox is destroyed instead; an exec then waits at most `_DESTROY_WAIT` for the removal,
# which goes on (`close` waits for it). A gVisor sentry at its thread cap can keep a Docker
# call waiting for a minute or more: a command's timeout still holds.
_STOP_BUDGET = 10.0
_DESTROY_WAIT = 2.0
_SIGKILL_EXIT = 128 + 9
_RUNSC_FAILED = 128


class DockerSandbox:
    """A running container implementing the `Sandbox` protocol (see the package docstring)."""

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
        self._destroying: asyncio.Future[bool] | None = None

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
            raise docker_error(what, err) from err

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
        sinks: Mapping[int, Sink],
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
            raise docker_error(f"sandbox {self.id}: cannot reach Docker", err) from err
        except SandboxError:
            await self._refresh_state()
            raise
        last_output = [time.monotonic()]
        pump = asyncio.ensure_future(exec_stream.pump(reader, sinks, last_output))
        feeder: asyncio.Future[None] | None = None
        if stdin is not None:
            feeder = asyncio.ensure_future(exec_stream.feed_stdin(writer, stdin))
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
                    # (asyncio's clock is time.monotonic's)
                    async with asyncio.timeout_at(deadline):
                        info = await self.host.call(self.host.api.exec_inspect, exec_id)
                except TimeoutError:
                    return "tool_timeout"  # Docker answered no sooner than the deadline
                except NotFound:
                    # The container is gone (auto-removed after its init died).
                    return None
                except (DockerException, RequestException, OSError) as err:
                    raise docker_error(f"sandbox {self.id}: exec_inspect failed", err) from err
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
        no signal can be delivered (no process can be started to send it), or stopping takes
        more than `_STOP_BUDGET` past the grace, the sandbox is destroyed instead: nothing of the
        command may outlive its timeout."""
        reason = "its processes could not be stopped (process limit exhausted)"
        try:
            async with asyncio.timeout(self.config.limits.kill_grace + _STOP_BUDGET):
                if await self.signal_all("TERM"):
                    await asyncio.wait({pump}, timeout=self.config.limits.kill_grace)
                    if await self.signal_all("KILL"):
                        await asyncio.wait({pump}, timeout=_DRAIN)
                        return
        except TimeoutError:
            reason = f"its processes were not stopped within {_STOP_BUDGET:g}s past the grace"
        if self._dead is None and not self._closed:
            await self._destroy(reason)

    async def _destroy(self, reason: str) -> None:
        """Mark the sandbox dead and remove its container, waiting up to `_DESTROY_WAIT` for
        the removal (which goes on; `close` waits for it)."""
        self._dead = reason
        logger.warning("sandbox %s destroyed: %s", self.id, reason)
        self._destroying = asyncio.ensure_future(
            remove_resources(self.host, [self.container_id], [])
        )
        await asyncio.wait({self._destroying}, timeout=_DESTROY_WAIT)

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

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a regular file in the workspace (parents created), owned by the
        sandbox user. Refuses paths leaving the workspace and paths through symlinks."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await transfer(self._run, self.config, path, "write", payload)

    async def read_file(self, path: str) -> bytes:
        """Read a regular file of the workspace (at most `limits.file_size_mb`). Refuses paths
        leaving the workspace and paths through symlinks."""
        return await transfer(self._run, self.config, path, "read", None)

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
            if self._destroying is not None:
                await self._destroying
            await remove_resources(
                self.host, [self.container_id, *self._extra_containers], self._networks
            )
        finally:
            # Whatever is left is no longer ours to use: the reaper may take it now.
            unregister(*names)
