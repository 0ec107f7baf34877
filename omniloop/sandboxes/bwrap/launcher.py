"""The launcher: one small process per sandbox, inside its cgroups, that starts every bwrap of
the sandbox on request and passes back a pidfd of each (see `Launcher`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from omniloop.errors import SandboxError
from omniloop.sandboxes.bwrap.cgroups import add_process
from omniloop.sandboxes.bwrap.isolation import PATH
from omniloop.sandboxes.bwrap.proctree import descendants

logger = logging.getLogger(__name__)

START_TIMEOUT = 30.0
"""Seconds the launcher and bwrap may take to set a command up before the sandbox counts as
broken."""
_MAX_ARG_BYTES = 128 * 1024  # MAX_ARG_STRLEN: the kernel's limit on one execve argument

# Runs as `python -I -S -c _LAUNCHER_SOURCE FD`, one per sandbox, inside the sandbox's cgroups.
# Each request on the SOCK_SEQPACKET socket FD is "t0,t1,...\0\0argv0\0argv1..." with one file
# descriptor per target number; it answers with the pid and a pidfd of the spawned process, or
# "E" and the error. It reaps its children and exits when the socket closes (the service is gone).
_LAUNCHER_SOURCE = r"""
import fcntl, os, select, signal, socket, sys

def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

def spawn(message, fds):
    header, _, body = message.partition(b"\0\0")
    targets = [int(t) for t in header.split(b",")]
    argv = [os.fsdecode(a) for a in body.split(b"\0")]
    # Received descriptors are inheritable and may sit on a target number: move them out of the
    # way (close-on-exec) first; posix_spawn's dup2 then gives each target a clean copy.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in fds]
    for fd in fds:
        os.close(fd)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, src, dst) for src, dst in zip(high, targets)]
        # Only PATH: this environment is what /proc/1/environ shows inside the sandbox.
        env = {"PATH": os.environ["PATH"]}
        # Python ignores SIGPIPE and SIGXFSZ; commands must get the default actions back
        # (`yes | head` ends by SIGPIPE, a write past RLIMIT_FSIZE by SIGXFSZ).
        pid = os.posix_spawn(
            argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=DEFAULT_SIGNALS
        )
        return pid, os.pidfd_open(pid)
    finally:
        for fd in high:
            os.close(fd)

DEFAULT_SIGNALS = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}

def main():
    # Subreaper: a bwrap child orphaned by its monitor stays below us (found, killed, reaped).
    import ctypes
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    sock = socket.socket(fileno=int(sys.argv[1]))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            reap()
        if sock not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 21, 8)
        if not message:
            return
        try:
            pid, pidfd = spawn(message, fds)
        except Exception as err:
            sock.send(b"E" + repr(err).encode())
            continue
        socket.send_fds(sock, [b"%d" % pid], [pidfd])
        os.close(pidfd)

main()
"""


def _python() -> str:
    if sys.executable and os.access(sys.executable, os.X_OK):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise SandboxError("no Python interpreter to run the sandbox launcher")
    return found


class Launcher:
    """A small process inside the sandbox's cgroups that starts every bwrap of the sandbox.

    Moving a process into a cgroup v1 waits for an RCU grace period (here ~15 ms, blocking the
    caller); doing that once per sandbox instead of once per command keeps `exec` near the cost
    of bwrap itself. Commands inherit the cgroups from the launcher at fork. If the launcher dies
    (an OOM kill in the sandbox can pick it), the next spawn starts a new one.
    """

    def __init__(self, log_path: Path, cgroups: Mapping[str, str]) -> None:
        self._log_path = log_path
        self._cgroups = dict(cgroups)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    def start(self) -> None:
        """Start (or restart) the launcher and move it into the cgroups (blocking)."""
        self.stop()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(self._log_path, "ab") as log:
                argv = [_python(), "-I", "-S", "-c", _LAUNCHER_SOURCE, str(child.fileno())]
                proc = subprocess.Popen(
                    argv,
                    pass_fds=[child.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    env={"PATH": PATH},
                    start_new_session=True,  # a Ctrl-C meant for the service is not for commands
                )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._proc, self._sock = proc, parent
        try:
            add_process(self._cgroups, proc.pid)
        except OSError:
            self.stop()
            raise

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        """Kill the launcher and everything below it (blocking)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                # Whatever runs is killed first: the launcher's own death would hand orphans
                # to the host's init instead.
                for pid in self._below(self._proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _below(self, launcher: int) -> list[int]:
        """Every process of the sandbox but the launcher: its cgroup's members (the sandbox's
        processes and no other), else the launcher's descendants, which takes reading every
        process of the host (1.1 ms with 80 of them, and it grows with them)."""
        for folder in self._cgroups.values():
            with contextlib.suppress(OSError), open(os.path.join(folder, "cgroup.procs")) as f:
                return [pid for pid in map(int, f.read().split()) if pid != launcher]
        return descendants(launcher)

    async def close(self) -> None:
        """Stop for good, after any request in flight (its socket must not close under it)."""
        async with self._lock:
            self._closed = True
            await asyncio.to_thread(self.stop)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log_path.read_bytes()[-2000:].decode(errors="replace").strip()
        return ""

    async def spawn(self, argv: Sequence[str], fds: Mapping[int, int]) -> tuple[int, int]:
        """Start `argv` with `fds` (target number → our descriptor); return its pid and pidfd."""
        parts = [os.fsencode(a) for a in argv]
        if any(b"\0" in p for p in parts):
            raise SandboxError("command arguments must not contain NUL bytes")
        if any(len(p) >= _MAX_ARG_BYTES for p in parts):
            raise SandboxError(
                f"a command argument is longer than execve allows ({_MAX_ARG_BYTES} bytes): "
                "write long scripts with write_file and run the file"
            )
        header = ",".join(str(t) for t in fds).encode()
        message = header + b"\0\0" + b"\0".join(parts)
        async with self._lock:  # one request in flight: replies come back in order
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if not self.alive():
                if self._proc is not None:
                    logger.warning(
                        "sandbox launcher died (%s); starting a new one", self._log_tail()
                    )
                await asyncio.to_thread(self.start)
            sock = self._sock
            assert sock is not None
            try:
                socket.send_fds(sock, [message], list(fds.values()))
            except OSError as err:
                if err.errno == errno.EMSGSIZE:
                    raise SandboxError(
                        f"command too long ({len(message)} bytes): write long scripts with "
                        "write_file and run the file"
                    ) from err
                raise SandboxError(f"sandbox launcher unreachable: {err}") from err
            try:
                reply, pidfds = await receive(sock)
            except SandboxError:
                # A late answer would be read as the next request's: start afresh instead.
                await asyncio.to_thread(self.stop)
                raise
        if reply.startswith(b"E") or not pidfds:
            for fd in pidfds:
                os.close(fd)
            detail = reply[1:].decode(errors="replace") if reply else self._log_tail()
            raise SandboxError(f"sandbox launcher could not start bwrap: {detail}")
        return int(reply), pidfds[0]


async def receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The next message and its descriptors from a non-blocking socket (b"" at end of stream)."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[tuple[bytes, list[int]]] = loop.create_future()

    def readable() -> None:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        except BlockingIOError:
            return
        except OSError:
            message, fds = b"", []
        loop.remove_reader(sock.fileno())
        if reply.done():
            for fd in fds:
                os.close(fd)
        else:
            reply.set_result((message, fds))

    loop.add_reader(sock.fileno(), readable)
    try:
        await asyncio.wait([reply], timeout=START_TIMEOUT)
    finally:
        loop.remove_reader(sock.fileno())
    if not reply.done():
        raise SandboxError(f"sandbox launcher did not answer within {START_TIMEOUT}s")
    return reply.result()
