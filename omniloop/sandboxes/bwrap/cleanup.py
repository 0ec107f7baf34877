"""Where bwrap sandboxes live on the host, and how they are removed: by `close`, and after a
crash by `reap_stale_sandboxes`.

Each sandbox is a folder `<tmp>/omniloop-bwrap-<euid>/<id>` whose `owner.json` names the process
that made it (pid and start time) and the mounts and cgroups it was planned with, written before
any of them exists. A sandbox whose owner no longer exists is stale.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from omniloop.sandboxes.bwrap.cgroups import remove_cgroup
from omniloop.sandboxes.bwrap.host import umount

logger = logging.getLogger(__name__)

_UNDESCRIBED_GRACE = 60.0  # seconds a folder without owner.json may be one being created

cleanup_failures = 0
"""How many sandbox clean-ups in this process left something behind (also logged as errors).
Read it as `omniloop.sandboxes.bwrap.cleanup_failures`."""


def count_cleanup_failure(sandbox_id: str, failures: Sequence[str]) -> None:
    """Count and log a clean-up of `sandbox_id` that left `failures` behind."""
    global cleanup_failures
    cleanup_failures += 1
    logger.error("sandbox %s clean-up incomplete: %s", sandbox_id, "; ".join(failures))


def base_dir() -> Path:
    """The folder every sandbox of this effective uid lives in."""
    return Path(tempfile.gettempdir()) / f"omniloop-bwrap-{os.geteuid()}"


def start_time(pid: int) -> str | None:
    """The start time of `pid` (clock ticks since boot), telling a process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def write_owner(root: Path, mounts: Sequence[str], cgroups: Sequence[str]) -> None:
    """Record in `root/owner.json` that this process owns the sandbox, with what it will make."""
    owner = {
        "pid": os.getpid(),
        "start": start_time(os.getpid()),
        "mounts": list(mounts),
        "cgroups": list(cgroups),
    }
    (root / "owner.json").write_text(json.dumps(owner))


def remove_tree(root: Path, mounts: Sequence[str], cgroups: Sequence[str]) -> list[str]:
    """Remove a sandbox's cgroups, mounts and folder; return what could not be removed."""
    failures: list[str] = []
    for folder in cgroups:
        try:
            remove_cgroup(folder)
        except OSError as err:
            failures.append(f"cgroup {folder}: {err}")
    for target in mounts:
        try:
            umount(target)
        except OSError as err:
            failures.append(f"mount {target}: {err}")
    if root.exists():
        shutil.rmtree(root, onerror=lambda _f, p, e: failures.append(f"{p}: {e[1]}"))
    return failures


def reap_stale_sandboxes() -> int:
    """Remove sandboxes whose creating process is gone (after a crash); return how many.

    Safe to call while other processes use the backend: a sandbox is touched only when the
    process recorded in its `owner.json` no longer exists.
    """
    base = base_dir()
    if not base.is_dir():
        return 0
    reaped = 0
    for root in base.iterdir():
        try:
            owner = json.loads((root / "owner.json").read_text())
        except FileNotFoundError:
            # Created a moment ago and not yet described, or torn down half-way long ago.
            if time.time() - root.stat().st_mtime < _UNDESCRIBED_GRACE:
                continue
            owner = {"pid": -1, "start": None, "mounts": [], "cgroups": []}
        except (OSError, ValueError):
            continue
        if owner["pid"] > 0 and start_time(owner["pid"]) == owner["start"]:
            continue
        failures = remove_tree(root, owner["mounts"], owner["cgroups"])
        if failures:
            logger.error("could not remove stale sandbox %s: %s", root, "; ".join(failures))
        else:
            reaped += 1
    if reaped:
        logger.info("removed %d stale bwrap sandboxes", reaped)
    return reaped
