"""Child processes that serve something on loopback (an engine, a sandboxd): a free port, a
child that dies with its parent, and a stop that escalates."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """A `preexec_fn`: in the child, before exec, be sent SIGKILL when the thread that started
    it ends (so spawn from a thread that lives as long as the child should: an event loop's)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, wait `grace` seconds, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
