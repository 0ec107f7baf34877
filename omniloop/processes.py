"""Child processes that serve something on loopback (an engine, a sandboxd): a free port, a
child that dies with its parent, and a stop that escalates."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

# Below the kernel's ephemeral range (where outgoing connections and `bind(0)` take their
# ports) and above Ray's worker ports (10002-19999 by default).
_QUIET_PORTS_FROM = 20000
# Its own generator: a test that seeds `random` must not make two processes draw alike.
_draw = random.SystemRandom()


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago.

    The port is drawn at random from below the kernel's ephemeral range, so between this call
    and the caller's own bind no outgoing connection of any process can take it (the kernel's
    `bind(0)` pick is in that range, where a busy machine hands it to a client socket a moment
    later). Not a reservation: two callers may still draw the same port, rarely."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _draw.randrange(_QUIET_PORTS_FROM, low) if low > _QUIET_PORTS_FROM + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on loopback in {_QUIET_PORTS_FROM}-{low - 1}")


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 0


# Run by a fresh interpreter between the parent and `command`: ask for SIGKILL when the thread
# that spawned it ends, give up if the parent died before the request (the child has been
# handed to another process, which the request would watch instead), and become `command`;
# the request survives the exec.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_parent(command: list[str]) -> list[str]:
    """`command`, made to be sent SIGKILL by the kernel when the thread that spawns it ends
    (spawn it from a thread that lives as long as the child should: an event loop's).

    Linux only (`PR_SET_PDEATHSIG`). The request is made in the child by a small interpreter
    that then execs `command`, not in a `preexec_fn`: that runs Python between `fork` and
    `exec`, which is unsafe in a process with threads (a Ray worker's gRPC threads: a child
    forked so can abort before its `exec`)."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, wait `grace` seconds, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
