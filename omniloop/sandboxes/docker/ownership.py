"""Who owns what in Docker: the labels and names of everything a sandbox is made of, the
creating process's identity, and the names this process still uses.

Every container, proxy and network carries `omniloop.sandbox=1` and the labels below;
`omniloop.owner` names the creating process so that a reaper can tell whether it still lives
(`owner_alive`). Names this process made and has not closed are registered here before Docker
knows them (`owned_live_names`), so this process's own reaper never takes one being created.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

NAME_PREFIX = "omniloop-sbx-"
"""Container names are `omniloop-sbx-<id>`; proxies and networks use `omniloop-egress-<id>`."""
EGRESS_PREFIX = "omniloop-egress-"
"""Name prefix of a sandbox's egress proxy and private network."""
LABEL_SANDBOX = "omniloop.sandbox"
LABEL_EPISODE = "omniloop.episode_id"
LABEL_EXPIRES = "omniloop.expires_at"
LABEL_OWNER = "omniloop.owner"
LABEL_BACKEND = "omniloop.backend"
LABEL_ROLE = "omniloop.role"
LABEL_IMAGE = "omniloop.image"

_live_names: set[str] = set()
"""Names of the containers this process created and has not closed (see `owned_live_names`)."""
_live_lock = threading.Lock()


def owned_live_names() -> frozenset[str]:
    """Containers, proxies and networks this process made and still uses. The reaper removes
    everything else this process owns (a close that failed, e.g. after a lost connection)."""
    with _live_lock:
        return frozenset(_live_names)


def register(*names: str) -> None:
    """Mark `names` as in use by this process (see `owned_live_names`)."""
    with _live_lock:
        _live_names.update(names)


def unregister(*names: str) -> None:
    """Hand `names` over to the reaper: this process no longer uses them."""
    with _live_lock:
        _live_names.difference_update(names)


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


def resource_labels(
    sandbox_id: str, episode_id: str | None, expires_at: float, backend: str, role: str, image: str
) -> dict[str, str]:
    """The labels of a sandbox's container (`role` "sandbox"), proxy or network."""
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


def sandbox_labels_filter() -> dict[str, list[str]]:
    """The Docker API filter that selects everything omniloop sandboxes are made of."""
    return {"label": [f"{LABEL_SANDBOX}=1"]}
