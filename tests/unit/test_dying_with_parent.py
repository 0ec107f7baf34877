"""`dying_with_parent`: the child becomes the command, keeps the descriptors handed to it, and
is killed when the thread that spawned it ends, not before."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil

from omniloop.processes import dying_with_parent


def _spawn_in_thread(command: list[str], **popen: object) -> tuple[threading.Event, list[int]]:
    """Spawn `command` from a thread that lives until the returned event is set."""
    release, pid, started = threading.Event(), [], threading.Event()

    def spawner() -> None:
        proc = subprocess.Popen(dying_with_parent(command), **popen)  # type: ignore[call-overload]
        pid.append(proc.pid)
        started.set()
        release.wait(60)
        # The child is not waited for here: the kernel, not this thread, ends it.
        threading.Thread(target=proc.wait, daemon=True).start()

    threading.Thread(target=spawner, daemon=True).start()
    assert started.wait(30)
    return release, pid


def test_the_child_runs_the_command_until_its_spawning_thread_ends(
    still_running: Callable[..., list[int]],
) -> None:
    release, (pid,) = _spawn_in_thread(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(pid).name() != "sleep":  # the interpreter has exec'd the command
            assert time.monotonic() < deadline, psutil.Process(pid).cmdline()
            time.sleep(0.05)
        time.sleep(0.5)
        assert still_running([pid]) == [pid], "the child died while its spawning thread lived"
    finally:
        release.set()
    assert not still_running([pid], within=10), "the child outlived the thread that spawned it"


def test_descriptors_passed_to_the_child_reach_the_command() -> None:
    read_end, write_end = os.pipe()
    command = [sys.executable, "-c", f"import os; os.write({write_end}, b'through')"]
    release, _ = _spawn_in_thread(command, pass_fds=(write_end,))
    os.close(write_end)
    try:
        with os.fdopen(read_end) as reader:  # EOF once the command has exited
            assert reader.read().strip() == "through"
    finally:
        release.set()
