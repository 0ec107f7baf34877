"""One running command of a bwrap sandbox: its processes and its streams.

`Run` tracks bwrap's monitor process and the sandbox's pid 1 through pidfds, and drains stdout,
stderr and bwrap's status pipe on the event loop as data arrives (1 MiB pipes, up to 1 MiB per
read) into `CappedOutput` (head + tail), so the service's memory stays bounded whatever is
printed. Nothing here blocks: no thread is held while a command runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
from collections.abc import Callable

from omniloop.sandboxes.bwrap.proctree import parent_of
from omniloop.sandboxes.output import CappedOutput

READ_SIZE = 1 << 20
"""Bytes read from a pipe at a time, and the size asked for output pipes."""
_STATUS_MAX = 1 << 16
_KILL_WAIT = 5.0  # seconds a kill may wait for bwrap to name the sandbox's pid 1


def pipe(size: int | None = None) -> tuple[int, int]:
    """A pipe (read end, write end), enlarged to `size` bytes where the kernel allows."""
    r, w = os.pipe()
    if size is not None:
        # A larger pipe means fewer wake-ups while a command floods its output.
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
    return r, w


class Reader:
    """Drains a pipe into `sink` as data arrives, noting when data last came and when it ended."""

    def __init__(
        self, fd: int, loop: asyncio.AbstractEventLoop, sink: Callable[[bytes], None]
    ) -> None:
        self._fd = fd
        self._loop = loop
        self._sink = sink
        self.last_data = loop.time()
        self.eof: asyncio.Future[None] = loop.create_future()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self._fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._sink(chunk)
            self.last_data = self._loop.time()
            return
        self.close()
        self.eof.set_result(None)

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


class Writer:
    """Writes `data` to a pipe without blocking the loop, then closes it (EPIPE ends it early)."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, data: bytes) -> None:
        self._fd = fd
        self._loop = loop
        self._view = memoryview(data)
        os.set_blocking(fd, False)
        self._writable()
        if self._fd >= 0:
            loop.add_writer(fd, self._writable)

    def _writable(self) -> None:
        try:
            while self._view:
                self._view = self._view[os.write(self._fd, self._view) :]
        except BlockingIOError:
            return
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_writer(self._fd)
            os.close(self._fd)
            self._fd = -1


class Run:
    """One running command: bwrap's monitor process, the sandbox's pid 1, and the streams.

    Killing is ordered to leave nothing behind: the sandbox's pid 1 (whose death takes its pid
    namespace with it) is killed before bwrap's monitor. Killing only the monitor is not enough
    during the first milliseconds, before bwrap's child has bound its life to the monitor: the
    child would live on as an orphan. The child's pid comes with bwrap's first status line;
    until then a kill waits for it (at most `_KILL_WAIT` seconds, then takes the monitor alone).
    """

    def __init__(
        self, pid: int, pidfd: int, loop: asyncio.AbstractEventLoop, output_cap: int
    ) -> None:
        self.pid = pid
        self.loop = loop
        self.stdout = CappedOutput(output_cap)
        self.stderr = CappedOutput(output_cap)
        self.status = bytearray()
        self.exited: asyncio.Future[None] = loop.create_future()
        """bwrap's monitor has exited."""
        self.child_exited: asyncio.Future[None] = loop.create_future()
        """The sandbox's pid 1 has exited, and with it everything in its pid namespace (the
        kernel reaps the namespace's other processes before its pid 1 finishes exiting)."""
        self.readers: list[Reader] = []
        self.writer: Writer | None = None
        self._pidfd = pidfd
        self._child_pidfd = -1
        self._child_known = False
        self._kill_requested = False
        self._kill_timer: asyncio.TimerHandle | None = None
        loop.add_reader(pidfd, self._monitor_exited)

    def attach(self, stdout_fd: int, stderr_fd: int, status_fd: int, stdin: Writer | None) -> None:
        self.readers = [
            Reader(stdout_fd, self.loop, self.stdout.feed),
            Reader(stderr_fd, self.loop, self.stderr.feed),
            Reader(status_fd, self.loop, self._status_data),
        ]
        self.readers[2].eof.add_done_callback(lambda _: self._learn_child(final=True))
        self.writer = stdin

    def last_output(self) -> float:
        return max(r.last_data for r in self.readers[:2])

    def _monitor_exited(self) -> None:
        # Not final for the status line: it may still sit unread in the pipe. The pipe's end
        # of file (the monitor held the last writer) is what says no line will come.
        self.loop.remove_reader(self._pidfd)
        if not self.exited.done():
            self.exited.set_result(None)

    def _child_exited(self) -> None:
        self.loop.remove_reader(self._child_pidfd)
        if not self.child_exited.done():
            self.child_exited.set_result(None)

    def _status_data(self, chunk: bytes) -> None:
        if len(self.status) < _STATUS_MAX:  # bwrap writes two short lines
            self.status.extend(chunk)
        if not self._child_known and b"\n" in self.status:
            self._learn_child(final=False)

    def _learn_child(self, *, final: bool) -> None:
        """Open a pidfd on the sandbox's pid 1 from bwrap's first status line, if not done yet;
        `final` means no line can come any more (the status pipe is closed)."""
        if self._child_known:
            return
        line = bytes(self.status.partition(b"\n")[0])
        if not line and not final:
            return
        self._child_known = True
        with contextlib.suppress(ValueError, KeyError, TypeError):
            child = int(json.loads(line)["child-pid"])
            try:
                pidfd = os.pidfd_open(child)
            except OSError:
                pidfd = -1
            # The pid names the monitor's child only while it is one: check after opening.
            if pidfd >= 0 and parent_of(child) == self.pid:
                self._child_pidfd = pidfd
                self.loop.add_reader(pidfd, self._child_exited)
            elif pidfd >= 0:
                os.close(pidfd)
        if self._child_pidfd < 0 and not self.child_exited.done():
            self.child_exited.set_result(None)  # never started, or already gone
        if self._kill_requested:
            self._kill_all()

    def kill_now(self) -> None:
        """SIGKILL everything of this command (see the class docstring for the order)."""
        if self.exited.done() and self._child_pidfd < 0:
            return
        self._kill_requested = True
        if self._child_known:
            self._kill_all()
        elif self._kill_timer is None:
            self._kill_timer = self.loop.call_later(_KILL_WAIT, self._kill_all)

    def _kill_all(self) -> None:
        for fd in (self._child_pidfd, self._pidfd):
            if fd >= 0:
                with contextlib.suppress(OSError):  # already gone
                    signal.pidfd_send_signal(fd, signal.SIGKILL)

    def release(self) -> None:
        """Kill what is left and close every descriptor, once the monitor is gone."""
        self.kill_now()  # a no-op unless the call was cancelled or failed half-way
        if self.exited.done():
            self._close()
        else:
            self.exited.add_done_callback(lambda _: self._close())

    def _close(self) -> None:
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        for reader in self.readers:
            reader.close()
        if self.writer is not None:
            self.writer.close()
        for fd in (self._pidfd, self._child_pidfd):
            if fd >= 0:
                self.loop.remove_reader(fd)
                os.close(fd)
        self._pidfd = self._child_pidfd = -1
