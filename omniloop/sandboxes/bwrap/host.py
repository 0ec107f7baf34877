"""What this host lets the bwrap backend do, probed once per process, and the host-side means it
uses: sized tmpfs mounts and a dedicated host uid per sandbox (both when running as root).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field

from omniloop.errors import SandboxError
from omniloop.sandboxes.bwrap.cgroups import CONTROLLERS, own_cgroup_dirs
from omniloop.sandboxes.bwrap.isolation import NAMESPACE_ARGS, PATH, system_args
from omniloop.sandboxes.bwrap.seccomp import seccomp_programs

logger = logging.getLogger(__name__)

HOST_UID_BASE = 1_500_000_000
"""First host uid handed to sandboxes when the service runs as root."""
HOST_UID_SPAN = 1_000_000
"""Number of host uids sandboxes draw from."""

_MIB = 1024 * 1024
_PROBE_TIMEOUT = 30  # seconds the probe's bwrap may take


@dataclass(frozen=True)
class Host:
    """What this host lets the backend do; probed once per process."""

    bwrap: str
    prlimit: str
    setpriv: str | None
    """Set when bwrap runs as a dedicated unprivileged host uid per sandbox."""
    mounts: bool
    """True when per-sandbox sized tmpfs mounts work (root)."""
    cgroups: dict[str, str] = field(default_factory=dict)
    """Controller → the folder sandbox cgroups are created in."""
    seccomp: tuple[bytes, ...] = ()
    """The compiled seccomp filters bwrap loads; empty on a machine without them."""


# --- sized tmpfs mounts --------------------------------------------------------------------------

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount_tmpfs(target: str, size_mb: int, uid: int, mode: int) -> None:
    """Mount a `size_mb` tmpfs owned by `uid` on `target` (needs root); raise `OSError`."""
    opts = f"size={size_mb * _MIB},uid={uid},gid={uid},mode={mode:o}".encode()
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def umount(target: str) -> None:
    """Detach the mount on `target`; a target that is not (or no longer) one is fine."""
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
            raise OSError(err, os.strerror(err), target)


# --- host uids -----------------------------------------------------------------------------------

_uids_in_use: set[int] = set()


def allocate_uid() -> int:
    """A host uid for a new sandbox, unused by this process's other sandboxes."""
    # Random rather than sequential so that two services on one host rarely pick the same uid;
    # within this process the set rules out reuse while a sandbox is alive.
    while True:
        uid = HOST_UID_BASE + secrets.randbelow(HOST_UID_SPAN - 1)
        if uid not in _uids_in_use:
            _uids_in_use.add(uid)
            return uid


def release_uid(uid: int) -> None:
    """Hand back a uid from `allocate_uid` once its sandbox is removed."""
    _uids_in_use.discard(uid)


# --- the probe -----------------------------------------------------------------------------------

_host: Host | None = None
_host_error: str | None = None
_host_lock = threading.Lock()


def _probe() -> Host:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("bubblewrap is not installed (no `bwrap` on PATH)")
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError("util-linux `prlimit` is not installed")
    probe = [bwrap, *NAMESPACE_ARGS, *system_args(), "--proc", "/proc", "--dev", "/dev"]
    probe += ["--", "/bin/true"]
    env = {"PATH": PATH}
    setpriv = shutil.which("setpriv") if os.geteuid() == 0 else None
    failure = ""
    if setpriv is not None:
        uid = HOST_UID_BASE + HOST_UID_SPAN - 1
        as_uid = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *probe]
        done = subprocess.run(
            as_uid, env=env, capture_output=True, timeout=_PROBE_TIMEOUT, check=False
        )
        if done.returncode != 0:
            failure = done.stderr.decode(errors="replace").strip()
            logger.warning("bwrap cannot run as an unprivileged host uid (%s)", failure)
            setpriv = None
    if setpriv is None:
        done = subprocess.run(
            probe, env=env, capture_output=True, timeout=_PROBE_TIMEOUT, check=False
        )
        if done.returncode != 0:
            failure = done.stderr.decode(errors="replace").strip() or failure
            raise SandboxError(f"bwrap cannot create a sandbox on this host: {failure}")
    mounts = False
    if os.geteuid() == 0:
        with tempfile.TemporaryDirectory(prefix="omniloop-bwrap-probe-") as folder:
            try:
                mount_tmpfs(folder, 1, os.geteuid(), 0o700)
                umount(folder)
                mounts = True
            except OSError as err:
                logger.warning("cannot mount a tmpfs per sandbox (%s)", err)
    host = Host(bwrap, prlimit, setpriv, mounts, own_cgroup_dirs(), seccomp_programs())
    missing = [c for c in CONTROLLERS if c not in host.cgroups]
    if missing:
        logger.warning(
            "cgroup controllers %s are not writable: falling back to rlimits for them", missing
        )
    if not host.seccomp:
        logger.warning("no seccomp filter for machine %s", platform.machine())
    return host


def probed_host() -> Host | None:
    """The host's probe result if it was already taken (no blocking), else None."""
    return _host


def host_support() -> Host:
    """Probe the host once (blocking, ~30 ms); raise `SandboxError` when bwrap cannot work."""
    global _host, _host_error
    with _host_lock:
        if _host is None and _host_error is None:
            try:
                _host = _probe()
            except (SandboxError, OSError, subprocess.SubprocessError) as err:
                _host_error = str(err)
        if _host is None:
            raise SandboxError(_host_error or "bwrap is unavailable")
        return _host


def bwrap_available() -> bool:
    """True when bubblewrap is installed and can create sandboxes here (probed once, cached)."""
    try:
        host_support()
    except SandboxError:
        return False
    return True
