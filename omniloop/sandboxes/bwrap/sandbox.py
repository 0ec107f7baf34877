"""The bwrap sandbox itself: its life cycle on the host and its commands.

A `BwrapSandbox` lays out its place on the host once (folder, generated `/etc`, sized tmpfs
mounts, cgroups, launcher: `isolation`, `host`, `cgroups`, `launcher`) and then runs each `exec`
as one bwrap started by the launcher (`run`), with workspace file access through `files`. See
the package docstring for what is enforced and what is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes.base import ExecResult, ExecStopReason
from omniloop.sandboxes.bwrap import cgroups
from omniloop.sandboxes.bwrap.cleanup import (
    base_dir,
    count_cleanup_failure,
    reap_stale_sandboxes,
    remove_tree,
    write_owner,
)
from omniloop.sandboxes.bwrap.files import WorkspaceFiles
from omniloop.sandboxes.bwrap.host import (
    Host,
    allocate_uid,
    host_support,
    mount_tmpfs,
    probed_host,
    release_uid,
)
from omniloop.sandboxes.bwrap.isolation import PATH, bwrap_prefix, env_args, write_etc
from omniloop.sandboxes.bwrap.launcher import START_TIMEOUT, Launcher
from omniloop.sandboxes.bwrap.proctree import descendants
from omniloop.sandboxes.bwrap.run import READ_SIZE, Run, Writer, pipe
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits

_DRAIN_TIMEOUT = 2.0  # seconds to wait for pipes to close after the command ended
_STATUS_FD = 3  # descriptor numbers inside bwrap
_SECCOMP_FD = 4  # and up, one per filter
_EXECVP_FAILED = re.compile(r"^bwrap: execvp .*: ([^:\n]+)$", re.M)
_RESERVED_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/etc", "/proc", "/dev", "/tmp")

_reaped = False


def _check_config(config: SandboxConfig) -> list[str]:
    """Refuse what this backend cannot honour; return the workdir's components."""
    if config.egress_allowlist is not None:
        raise ConfigError(
            "egress_allowlist needs the docker backend: a bwrap sandbox has no network at all"
        )
    workdir = config.workdir
    parts = [p for p in workdir.split("/") if p]
    if not workdir.startswith("/") or not parts or any(p in (".", "..") for p in parts):
        raise ConfigError(f"workdir must be an absolute path below /, got {workdir!r}")
    normalized = "/" + "/".join(parts)
    for reserved in _RESERVED_DIRS:
        if normalized == reserved or normalized.startswith(reserved + "/"):
            raise ConfigError(f"workdir {workdir!r} lies inside the system folder {reserved}")
    return parts


def _existing(paths: list[str]) -> list[str]:
    """`SandboxConfig.read_only_paths`, each of which must exist on the host."""
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        raise ConfigError(f"read_only_paths {missing} do not exist on this host")
    return paths


class BwrapSandbox:
    """A bubblewrap sandbox (see the package docstring for what it enforces and how).

    Create with `create_bwrap_sandbox`. `exec` may be called concurrently; each call is its own
    process world sharing the workspace, `/tmp` and the sandbox's limits.
    """

    def __init__(self, config: SandboxConfig, host: Host) -> None:
        self.config = config
        self.limits: SandboxLimits = config.limits
        self.id = f"bwrap-{secrets.token_hex(6)}"
        self._host = host
        self._workdir_parts = _check_config(config)
        self.workdir = "/" + "/".join(self._workdir_parts)
        self._base_env = env_args({"PATH": PATH, "HOME": self.workdir, "LANG": "C.UTF-8"})
        self._base_env += env_args(config.env)
        self.root = base_dir() / self.id
        self.workspace = self.root / "workspace"
        self._tmp = self.root / "tmp"
        self.host_uid = allocate_uid() if host.setpriv is not None else os.geteuid()
        self._files = WorkspaceFiles(self.workspace, self.workdir, self.host_uid)
        self._mounts: list[str] = []
        self._cgroups: dict[str, str] = {}
        self._launcher: Launcher | None = None
        self._runs: set[Run] = set()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._prefix: list[str] = []

    # -- creation --

    def _create(self) -> None:
        """Lay out the host folder, mounts, cgroups and launcher (blocking: run in a thread)."""
        host, limits = self._host, self.limits
        base_dir().mkdir(mode=0o711, exist_ok=True)
        self.root.mkdir(mode=0o711)
        planned_mounts = [str(self.workspace), str(self._tmp)] if host.mounts else []
        planned_cgroups = {
            c: os.path.join(d, f"omniloop-{self.id}") for c, d in host.cgroups.items()
        }
        write_owner(self.root, planned_mounts, list(planned_cgroups.values()))
        etc = self.root / "etc"
        write_etc(etc, self.workdir)

        self.workspace.mkdir(mode=0o755)
        if host.mounts:
            mount_tmpfs(str(self.workspace), limits.workspace_mb, self.host_uid, 0o755)
            self._mounts.append(str(self.workspace))
            self._tmp.mkdir(mode=0o755)
            mount_tmpfs(str(self._tmp), limits.tmp_mb, self.host_uid, 0o1777)
            self._mounts.append(str(self._tmp))
        else:
            os.chown(self.workspace, self.host_uid, self.host_uid)

        cgroups.create_cgroups(planned_cgroups, limits, self._cgroups)
        self._prefix = bwrap_prefix(
            prlimit=host.prlimit,
            setpriv=host.setpriv,
            bwrap=host.bwrap,
            host_uid=self.host_uid,
            limits=limits,
            controllers=list(self._cgroups),
            etc=etc,
            tmp=self._tmp if host.mounts else None,
            workspace=self.workspace,
            workdir=self.workdir,
            env=self._base_env,
            read_only=_existing(self.config.read_only_paths),
        )
        self._launcher = Launcher(self.root / "launcher.log", self._cgroups)
        self._launcher.start()

    def bwrap_argv(self, argv: Sequence[str]) -> list[str]:
        """The command line (prlimit, setpriv, bwrap and its options) this sandbox uses for
        `argv`, without the status descriptor, seccomp and cgroups: for benchmarks against
        bare bwrap."""
        return [*self._prefix, "--", *argv]

    # -- commands --

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `command` in a fresh process world over this sandbox's workspace.

        Returns when the command's first process exits (everything it started is killed then),
        or when it is stopped: `timeout` (default `limits.timeout`) → `tool_timeout`,
        `limits.idle_timeout` without output → `idle_timeout`, an OOM kill in the sandbox's
        memory cgroup while the command failed → `oom`. Raises `SandboxError` when the sandbox is
        closed or bwrap could not set it up.
        """
        self._check_open()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise SandboxError("empty command")
        extra_env = env_args(env or {})
        wall = self.limits.timeout if timeout is None else timeout
        if wall <= 0:
            raise SandboxError(f"timeout must be positive, got {wall}")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        assert self._launcher is not None

        loop = asyncio.get_running_loop()
        started = loop.time()
        oom_before = self._oom_kills()
        # Starting is shielded: a cancellation while the launcher works must still find the
        # run it started, to kill it.
        starting = asyncio.ensure_future(self._spawn([*extra_env, "--", *argv], data))
        try:
            run = await asyncio.shield(starting)
        except asyncio.CancelledError:
            starting.add_done_callback(self._release_started)
            raise
        try:
            stop = await self._wait(run, wall, started)
            if stop is not None:
                await self._stop(run)
            pending = [run.exited, run.child_exited, *(r.eof for r in run.readers)]
            await asyncio.wait(pending, timeout=_DRAIN_TIMEOUT)
            if not all(f.done() for f in pending):
                # Something still holds the pipes although the command ended: end it all.
                run.kill_now()
                await asyncio.wait(pending, timeout=_DRAIN_TIMEOUT)
            if self._closed and stop is None:
                raise SandboxError(f"sandbox {self.id} was closed while a command ran")
            return self._result(run, stop, oom_before, loop.time() - started)
        finally:
            self._release(run)

    async def _spawn(self, tail: list[str], data: bytes | None) -> Run:
        """Have the launcher start bwrap for `tail` (extra options, `--`, argv) and track it."""
        assert self._launcher is not None
        loop = asyncio.get_running_loop()
        args = [*self._prefix, "--json-status-fd", str(_STATUS_FD)]
        ours: list[int] = []  # our ends: stdout, stderr, status (and stdin)
        theirs: dict[int, int] = {}  # descriptor number inside bwrap → the one passed
        try:
            if data is None:
                theirs[0] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            else:
                stdin_r, stdin_w = pipe()
                theirs[0] = stdin_r
            for target in (1, 2):
                r, w = pipe(READ_SIZE)
                ours.append(r)
                theirs[target] = w
            status_r, status_w = pipe()
            ours.append(status_r)
            theirs[_STATUS_FD] = status_w
            if data is not None:
                ours.append(stdin_w)
            for target, program in enumerate(self._host.seccomp, start=_SECCOMP_FD):
                seccomp_r, seccomp_w = pipe()
                os.write(seccomp_w, program)  # far below a pipe's buffer
                os.close(seccomp_w)
                theirs[target] = seccomp_r
                args += ["--add-seccomp-fd", str(target)]
            pid, pidfd = await self._launcher.spawn([*args, *tail], theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs.values():
                os.close(fd)
        run = Run(pid, pidfd, loop, self.limits.output_bytes)
        stdin = Writer(ours[3], loop, data) if data is not None else None
        run.attach(ours[0], ours[1], ours[2], stdin)
        self._runs.add(run)
        return run

    def _release(self, run: Run) -> None:
        run.release()
        self._runs.discard(run)

    def _release_started(self, starting: asyncio.Future[Run]) -> None:
        """Done-callback for a start whose `exec` was cancelled: kill and forget what it made."""
        if not starting.cancelled() and starting.exception() is None:
            self._release(starting.result())

    async def _wait(self, run: Run, wall: float, started: float) -> ExecStopReason | None:
        """Wait for the command to end; return why it must be stopped, or None if it ended."""
        loop = asyncio.get_running_loop()
        idle = self.limits.idle_timeout
        deadline = started + wall
        while not run.exited.done():
            now = loop.time()
            if now >= deadline:
                return "tool_timeout"
            until = deadline
            if idle is not None:
                idle_deadline = run.last_output() + idle
                if now >= idle_deadline:
                    return "idle_timeout"
                until = min(until, idle_deadline)
            await asyncio.wait([run.exited], timeout=until - now)
        return None

    async def _stop(self, run: Run) -> None:
        """SIGTERM every process of the command, wait `kill_grace`, then SIGKILL them all."""
        if self.limits.kill_grace > 0 and not run.exited.done():
            # Everything below bwrap's monitor, not the monitor itself: its death would SIGKILL
            # the sandbox before the grace period. While the monitor lives its pid is its own.
            for pid in await asyncio.to_thread(descendants, run.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
            await asyncio.wait([run.exited], timeout=self.limits.kill_grace)
        run.kill_now()
        await asyncio.wait([run.exited], timeout=START_TIMEOUT)
        if not run.exited.done():
            raise SandboxError(f"bwrap of sandbox {self.id} survived SIGKILL")

    def _oom_kills(self) -> int:
        return cgroups.oom_kills(self._cgroups.get("memory"))

    def _result(
        self, run: Run, stop: ExecStopReason | None, oom_before: int, duration: float
    ) -> ExecResult:
        exit_code: int | None = None
        reason: ExecStopReason = "exit" if stop is None else stop
        if stop is None:
            for line in run.status.decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    payload = json.loads(line)
                    if isinstance(payload, dict) and "exit-code" in payload:
                        exit_code = int(payload["exit-code"])
            oom = self._oom_kills() > oom_before
            if exit_code is None and not oom:
                # bwrap reports an exit code once the command started. Without one, either the
                # program could not be executed (a command failure: 127 or 126, as a shell
                # says), or bwrap itself failed or was killed from outside.
                stderr = run.stderr.text().strip()
                failed_exec = _EXECVP_FAILED.search(stderr)
                if failed_exec is None:
                    raise SandboxError(f"bwrap failed: {stderr or 'killed'}")
                exit_code = 127 if failed_exec.group(1) == "No such file or directory" else 126
            if oom and exit_code != 0:
                reason = "oom"
                if exit_code is not None and exit_code > 128:
                    exit_code = -(exit_code - 128)
        return ExecResult(
            exit_code=exit_code,
            stdout=run.stdout.text(),
            stderr=run.stderr.text(),
            truncated=run.stdout.truncated or run.stderr.truncated,
            stop_reason=reason,
            duration=max(0.0, duration),
        )

    # -- files --

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a regular file in the workspace (parents created); refuse paths leaving it."""
        payload = data.encode() if isinstance(data, str) else data
        await asyncio.to_thread(self._write_file, path, payload)

    async def read_file(self, path: str) -> bytes:
        """Read a regular file of the workspace; refuse paths leaving it."""
        return await asyncio.to_thread(self._read_file, path)

    def _write_file(self, path: str, data: bytes) -> None:
        self._check_open()
        self._files.write(path, data)

    def _read_file(self, path: str) -> bytes:
        self._check_open()
        return self._files.read(path)

    # -- life cycle --

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    def is_healthy(self) -> bool:
        """Open, with its folder, mounts, cgroups and launcher in place (stats of in-memory file
        systems and a waitpid: microseconds, fine on the event loop)."""
        if self._closed or self._launcher is None or not self._launcher.alive():
            return False
        if not self.workspace.is_dir() or any(not os.path.ismount(m) for m in self._mounts):
            return False
        return all(os.path.isdir(folder) for folder in self._cgroups.values())

    def processes(self) -> list[int]:
        """Host pids of every process running for this sandbox's commands (bwrap's included,
        the launcher not): all descendants of the launcher. Empty between commands."""
        pid = self._launcher.pid() if self._launcher is not None else None
        return [] if pid is None else descendants(pid)

    async def healthy(self) -> bool:
        """The pool's liveness check (see `is_healthy`)."""
        return self.is_healthy()

    async def close(self) -> None:
        """Kill every running command and remove the sandbox (idempotent; concurrent calls wait
        for the same clean-up). Clean-up failures are logged and counted in `cleanup_failures`."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._teardown())
        await asyncio.shield(self._close_task)

    async def _teardown(self) -> None:
        runs = list(self._runs)
        for run in runs:
            run.kill_now()
        if runs:
            await asyncio.wait([r.exited for r in runs], timeout=START_TIMEOUT)
        failures: list[str] = []
        if self._launcher is not None:
            try:
                await self._launcher.close()
            except OSError as err:
                failures.append(f"launcher: {err}")
        failures += await asyncio.to_thread(self._remove)
        if failures:
            count_cleanup_failure(self.id, failures)

    def _remove(self) -> list[str]:
        failures = remove_tree(self.root, list(self._mounts), list(self._cgroups.values()))
        release_uid(self.host_uid)
        return failures

    def __repr__(self) -> str:
        return f"BwrapSandbox(id={self.id!r}, closed={self._closed})"


async def create_bwrap_sandbox(config: SandboxConfig) -> BwrapSandbox:
    """Create a ready sandbox; raise `SandboxError` when the host cannot provide one and
    `ConfigError` for a config this backend cannot honour.

    Creation runs in a worker thread (moving the launcher into cgroups blocks for a grace
    period). The first call in a process probes the host and removes sandboxes that dead
    processes left behind.
    """
    global _reaped
    host = probed_host()
    if host is None:
        host = await asyncio.to_thread(host_support)
    if not _reaped:
        _reaped = True
        await asyncio.to_thread(reap_stale_sandboxes)
    sandbox = BwrapSandbox(config, host)
    creation = asyncio.ensure_future(asyncio.to_thread(sandbox._create))
    try:
        await asyncio.shield(creation)
    except asyncio.CancelledError:
        # The thread cannot be stopped: remove the sandbox once it is done with it.
        creation.add_done_callback(lambda _: _in_background(sandbox.close()))
        raise
    except BaseException as err:
        await sandbox.close()
        if isinstance(err, OSError):
            raise SandboxError(f"cannot create bwrap sandbox {sandbox.id}: {err}") from err
        raise
    return sandbox


_background: set[asyncio.Task[None]] = set()


def _in_background(coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
