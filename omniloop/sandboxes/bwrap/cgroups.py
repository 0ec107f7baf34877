"""The cgroup v1 limits of a bwrap sandbox: memory (RAM + swap), process count and CPU quota.

A sandbox gets one cgroup per controller, created as a child of the service's own cgroup, so
whatever limits the service lives under also bind its sandboxes. Its launcher is moved into them
once, and every command inherits them at fork. Without a writable controller the sandbox falls
back to rlimits (see `isolation.rlimits`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Mapping

from omniloop.sandboxes.config import SandboxLimits

CONTROLLERS = ("memory", "pids", "cpu")
"""The cgroup v1 controllers a sandbox is limited by, where the host lets the service write."""
PLUMBING_PIDS = 3
"""Processes that are not the command's but count in its pids cgroup: the launcher, and bwrap's
monitor and pid 1 of a command."""

_MIB = 1024 * 1024
_CPU_PERIOD_US = 100_000
_REMOVE_WAIT = 5.0  # seconds to keep killing what is left in a cgroup before giving up


def own_cgroup_dirs() -> dict[str, str]:
    """For each cgroup v1 controller we use, the folder of this process's own cgroup, if writable.

    Sandbox cgroups are created below the service's own, so whatever limits the service lives
    under also bind its sandboxes.
    """
    mounts: dict[str, tuple[str, str]] = {}  # controller -> (cgroup root path, mount point)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, post_fields = pre.split(), post.split()
            if len(post_fields) < 3 or post_fields[0] != "cgroup":
                continue
            for option in post_fields[2].split(","):
                if option in CONTROLLERS:
                    mounts.setdefault(option, (fields[3], fields[4]))
    found: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                if controller not in mounts:
                    continue
                root, mount_point = mounts[controller]
                if root != "/" and not path.startswith(root):
                    continue
                rel = path[len(root) :] if root != "/" else path
                folder = mount_point + rel.rstrip("/")
                if os.path.isdir(folder) and os.access(folder, os.W_OK):
                    found[controller] = folder
    return found


def write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def create_cgroups(planned: Mapping[str, str], limits: SandboxLimits, made: dict[str, str]) -> None:
    """Create the sandbox's cgroups (`planned`: controller → folder) and set their limits.

    Each folder is recorded in `made` as soon as it exists, so that a failure half-way leaves
    the caller knowing what to remove.
    """
    for controller, folder in planned.items():
        os.mkdir(folder)
        made[controller] = folder
    if "memory" in made:
        folder = made["memory"]
        memory = str(limits.memory_mb * _MIB)
        write(os.path.join(folder, "memory.limit_in_bytes"), memory)
        memsw = os.path.join(folder, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # present when swap is accounted: RAM + swap = the limit
            write(memsw, memory)
    if "pids" in made:
        # The launcher, and bwrap's monitor and pid 1 of each command, count as well.
        pids = limits.pids + PLUMBING_PIDS
        write(os.path.join(made["pids"], "pids.max"), str(pids))
    if "cpu" in made:
        folder = made["cpu"]
        quota = max(1000, int(limits.cpus * _CPU_PERIOD_US))
        write(os.path.join(folder, "cpu.cfs_period_us"), str(_CPU_PERIOD_US))
        write(os.path.join(folder, "cpu.cfs_quota_us"), str(quota))


def add_process(folders: Mapping[str, str], pid: int) -> None:
    """Move `pid` into each cgroup (blocks for an RCU grace period per controller)."""
    for folder in folders.values():
        write(os.path.join(folder, "cgroup.procs"), str(pid))


def oom_kills(folder: str | None) -> int:
    """How many OOM kills the memory cgroup `folder` has seen (0 without one)."""
    if folder is None:
        return 0
    try:
        with open(os.path.join(folder, "memory.oom_control")) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in lines:
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def _kill_cgroup(folder: str) -> None:
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            pids = f.read().split()
    except FileNotFoundError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def remove_cgroup(folder: str) -> None:
    """SIGKILL whatever is left in the cgroup and remove it (the kernel needs it empty)."""
    deadline = time.monotonic() + _REMOVE_WAIT
    while True:
        _kill_cgroup(folder)
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.01)
