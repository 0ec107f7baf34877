"""The `bwrap` backend: a bubblewrap process sandbox for hosts without Docker.

Model
-----
A `BwrapSandbox` is a prepared place: a host folder holding the workspace, a persistent `/tmp`
and generated `/etc` files, its own cgroups and host uid (where the host allows), and a small
launcher process that lives in those cgroups. Every `exec` asks the launcher to start one `bwrap`
with fresh user, pid, network, ipc, uts and cgroup namespaces over that place; the command
inherits the cgroups at fork. (Moving each command into cgroups instead would cost an RCU grace
period per command, ~15 ms here.) When the command's first process exits, bwrap's monitor exits,
the sandbox's pid 1 gets SIGKILL (`--die-with-parent`) and the kernel kills everything left in
that pid namespace, so nothing a command started outlives its `exec`. State that persists between
commands of one episode is exactly the workspace and `/tmp`.

What is covered
---------------
- Network: `--unshare-all` gives an empty network namespace with only a loopback interface of its
  own. Host loopback services, other sandboxes and every other address are unreachable; DNS fails
  at once (no resolver answers inside).
- Privilege: the command runs as uid/gid 1000 inside a user namespace, with every capability
  dropped (`--cap-drop ALL`, empty bounding set), `no_new_privs` (bwrap always sets it, so setuid
  binaries do not raise privileges), `--disable-userns` (no nested user namespaces, so
  `unshare -U` fails), `--new-session` (no TIOCSTI into the caller's terminal) and a seccomp
  filter (x86_64 and aarch64) that returns EPERM for ptrace, process_vm_*, keyctl/add_key/
  request_key, bpf, perf_event_open, userfaultfd, io_uring, the mount API, setns/unshare,
  module and kexec loading, swap, reboot, clock setting, syslog, acct, quotactl and
  open_by_handle_at, and kills any process using a foreign syscall ABI (i386, x32).
- Host uid: when the service runs as root, bwrap itself runs as a dedicated unprivileged host uid
  per sandbox (`HOST_UID_BASE + n`, switched by `setpriv` right after `prlimit` has set the
  rlimits). A process that escaped every namespace would be an unprivileged, otherwise unused
  host user, not root; files it creates are owned by that uid. This is also what makes
  RLIMIT_NPROC a per-sandbox limit where cgroups are not writable.
- Filesystem: the root is a read-only tmpfs holding read-only binds of `/usr` and the merged-usr
  links (`/bin`, `/sbin`, `/lib*`), `/etc/alternatives`, the dynamic loader's cache and config,
  and generated `passwd`, `group`, `hosts`, `nsswitch.conf`. Nothing else of the host is visible:
  no `/home`, `/root`, `/var`, `/run`, no Docker socket. `/proc` is the sandbox's own; `/dev` is a
  read-only minimal set (null, zero, full, random, urandom, tty, pts) plus a sized `/dev/shm`.
- Sizes: as root the workspace and `/tmp` are per-sandbox host tmpfs mounts with `size=` (ENOSPC
  at `workspace_mb` / `tmp_mb`, never the host disk). Tmpfs pages a sandbox writes are charged to
  its memory cgroup, so keep `tmp_mb + workspace_mb` below `memory_mb` for ENOSPC rather than an
  OOM kill. RLIMIT_FSIZE caps any single file at `file_size_mb`.
- Limits, with cgroup v1 writable (root): a memory cgroup (`memory_mb`, RAM + swap; an OOM kill is
  reported as `stop_reason="oom"`), a pids cgroup (`pids`, a fork bomb hits EAGAIN) and a CPU
  quota (`cpus`), each created as a child of the service's own cgroup. The launcher (~10 MB, one
  process) and bwrap's two processes per command live in them too; `pids.max` is `pids + 3`.
  Always, set by `prlimit` before the uid switch: RLIMIT_NOFILE (`nofile`), RLIMIT_FSIZE
  (`file_size_mb`), RLIMIT_CORE=0.
- Fallbacks without writable cgroups: RLIMIT_NPROC (binding only when bwrap runs as a dedicated
  non-root uid; it is per host uid, hence the dedicated uid), RLIMIT_AS for memory (per process,
  reported as a failed command, not `oom`), no CPU quota. Without host mounts (not root) the
  workspace is a plain folder limited only by RLIMIT_FSIZE, and `/tmp` is a sized tmpfs created
  by bwrap for each command (so it does not persist between commands). A warning is logged once.
- Time: a wall-clock timeout per command (`tool_timeout`) and an optional no-output timeout
  (`idle_timeout`). Stopping sends SIGTERM to every process of the command, waits `kill_grace`,
  then SIGKILLs the sandbox's pid 1 and bwrap's monitor through pidfds; the death of pid 1 takes
  the whole pid namespace with it: `setsid`, `nohup` and double-forked daemons included. `exec`
  returns only once that pid 1 is gone. Zombies are reaped by bwrap's pid 1; bwrap processes
  orphaned by an early kill are reparented to the launcher (a subreaper) and killed with it.
- Output: stdout and stderr are read as they arrive (1 MiB pipes, up to 1 MiB per read) into
  `CappedOutput` (head + tail), so the service's memory stays bounded whatever is printed.
- Environment: bwrap itself is started with only PATH (that is what `/proc/1/environ` shows
  inside) and the command sees only PATH, HOME, LANG, `config.env` and the call's `env`.
- Files: `read_file`/`write_file` walk the workspace one component at a time with `O_NOFOLLOW`
  directory descriptors, resolve symlinks themselves in the sandbox's view, refuse anything that
  leaves the workspace, and open only regular files (no FIFOs, no hard-linked files).
- Cleanup: `close` kills what runs and the launcher, removes the cgroups (SIGKILLing anything
  left in them), unmounts and deletes the host folder; failures are logged and counted in
  `cleanup_failures`. If the service dies by SIGKILL, its launchers see their socket close and
  exit, and bwrap's `--die-with-parent` kills every sandbox process with them; the folders,
  mounts and cgroups left behind are removed by `reap_stale_sandboxes`, which the first sandbox
  created in a process runs (a sandbox is stale when the process that made it no longer exists).

What is not covered
-------------------
- The kernel is shared: a kernel exploit reachable through the allowed syscalls escapes. Use the
  `gvisor` backend for untrusted multi-tenant code.
- `/usr` of the host is visible read-only (that is where the tools come from); do not keep secrets
  there.
- Death by signal N inside the sandbox is reported as exit code 128+N, as a shell does (bwrap's
  pid 1 passes the status on that way); only an OOM kill is reported as -9. A program that cannot
  be executed gives 127 (not found) or 126, as in a shell. Concurrent commands of one sandbox
  share its memory cgroup, so an OOM kill during one of them may be reported by another that
  failed at the same time.
- `ttl` is not enforced while the owning service lives (nothing of a sandbox can outlive the
  service); cgroup v2 hosts, disk quotas without root, inode limits beyond tmpfs defaults, and
  seccomp on architectures other than x86_64/aarch64 are not covered.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniloop.errors import ConfigError, SandboxError
from omniloop.sandboxes.base import ExecResult, ExecStopReason
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits
from omniloop.sandboxes.output import CappedOutput

logger = logging.getLogger(__name__)

SANDBOX_UID = 1000
"""The uid (and gid) commands run as inside every sandbox."""
HOST_UID_BASE = 1_500_000_000
"""First host uid handed to sandboxes when the service runs as root."""
HOST_UID_SPAN = 1_000_000
"""Number of host uids sandboxes draw from."""

_MIB = 1024 * 1024
_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_START_TIMEOUT = 30.0  # seconds bwrap may take to set a sandbox up before it counts as broken
_DRAIN_TIMEOUT = 2.0  # seconds to wait for pipes to close after the command ended
_SHM_MAX_MB = 64
_CONTROLLERS = ("memory", "pids", "cpu")
_PLUMBING_PIDS = 3  # the launcher, and bwrap's monitor and pid 1 of a command
_READ_SIZE = 1 << 20
_STATUS_FD = 3  # descriptor numbers inside bwrap
_SECCOMP_FD = 4
_STATUS_MAX = 1 << 16
_MAX_SYMLINKS = 40
_MAX_ARG_BYTES = 128 * 1024  # MAX_ARG_STRLEN: the kernel's limit on one execve argument
_KILL_WAIT = 5.0  # seconds a kill may wait for bwrap to name the sandbox's pid 1
_EXECVP_FAILED = re.compile(r"^bwrap: execvp .*: ([^:\n]+)$", re.M)
_RESERVED_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/etc", "/proc", "/dev", "/tmp")

cleanup_failures = 0
"""How many sandbox clean-ups in this process left something behind (also logged as errors)."""


# --- seccomp -------------------------------------------------------------------------------------

# Denied syscalls and their numbers per architecture, from the kernel's uapi headers (x86_64:
# asm/unistd_64.h; aarch64: asm-generic/unistd.h; "-" where the syscall does not exist). Each
# either needs a capability the sandbox does not have, or is kernel attack surface that a tool
# command has no use for.
DENIED_SYSCALL_TABLE = """
# name                 x86_64  aarch64
ptrace                    101      117
process_vm_readv          310      270
process_vm_writev         311      271
kcmp                      312      272
pidfd_getfd               438      438
keyctl                    250      219
add_key                   248      217
request_key               249      218
bpf                       321      280
perf_event_open           298      241
userfaultfd               323      282
kexec_load                246      104
kexec_file_load           320      294
init_module               175      105
finit_module              313      273
delete_module             176      106
mount                     165       40
umount2                   166       39
pivot_root                155       41
swapon                    167      224
swapoff                   168      225
reboot                    169      142
setns                     308      268
unshare                   272       97
acct                      163       89
quotactl                  179       60
syslog                    103      116
open_by_handle_at         304      265
name_to_handle_at         303      264
iopl                      172        -
ioperm                    173        -
settimeofday              164      170
clock_settime             227      112
adjtimex                  159      171
clock_adjtime             305      266
vhangup                   153       58
lookup_dcookie            212       18
io_uring_setup            425      425
io_uring_enter            426      426
io_uring_register         427      427
open_tree                 428      428
move_mount                429      429
fsopen                    430      430
fsconfig                  431      431
fsmount                   432      432
fspick                    433      433
mount_setattr             442      442
"""
_MACHINES = ("x86_64", "aarch64")
DENIED_SYSCALLS: dict[str, dict[str, int]] = {
    machine: {
        row.split()[0]: int(row.split()[1 + i])
        for row in DENIED_SYSCALL_TABLE.strip().splitlines()[1:]
        if row.split()[1 + i] != "-"
    }
    for i, machine in enumerate(_MACHINES)
}
"""Machine → syscall name → number: each returns EPERM inside a sandbox."""
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_BPF_LD_W_ABS = 0x00 | 0x00 | 0x20
_BPF_JEQ_K = 0x05 | 0x10 | 0x00
_BPF_JGE_K = 0x05 | 0x30 | 0x00
_BPF_RET_K = 0x06 | 0x00
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The compiled seccomp filter bwrap loads (`--seccomp FD`), or None for an unknown machine.

    Layout: kill the process unless the syscall ABI is the host's native one; on x86_64 deny the
    x32 range; deny each listed syscall with EPERM; allow the rest.
    """
    machine = machine or platform.machine()
    table = DENIED_SYSCALLS.get(machine)
    if table is None:
        return None
    numbers = sorted(set(table.values()))
    n = len(numbers)
    insns: list[tuple[int, int, int, int]] = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_BPF_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        insns.append((_BPF_JGE_K, n + 1, 0, _X32_SYSCALL_BIT))  # over the n checks and ALLOW
    # From check i, DENY lies past the remaining n-1-i checks and ALLOW.
    insns.extend((_BPF_JEQ_K, n - i, 0, nr) for i, nr in enumerate(numbers))
    insns.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    insns.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM))
    return b"".join(struct.pack("=HBBI", *insn) for insn in insns)


# --- what the host allows ------------------------------------------------------------------------

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount_tmpfs(target: str, size_mb: int, uid: int, mode: int) -> None:
    opts = f"size={size_mb * _MIB},uid={uid},gid={uid},mode={mode:o}".encode()
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
            raise OSError(err, os.strerror(err), target)


def _own_cgroup_dirs() -> dict[str, str]:
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
                if option in _CONTROLLERS:
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


@dataclass(frozen=True)
class _Host:
    """What this host lets the backend do; probed once per process."""

    bwrap: str
    prlimit: str
    setpriv: str | None
    """Set when bwrap runs as a dedicated unprivileged host uid per sandbox."""
    mounts: bool
    """True when per-sandbox sized tmpfs mounts work (root)."""
    cgroups: dict[str, str] = field(default_factory=dict)
    """Controller → the folder sandbox cgroups are created in."""
    seccomp: bytes | None = None


_host: _Host | None = None
_host_error: str | None = None
_host_lock = threading.Lock()
_reaped = False
_uids_in_use: set[int] = set()


_ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
)


def _system_args() -> list[str]:
    """Read-only binds of the host's system folders; merged-usr links are recreated as links."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    args += ["--dir", "/etc"]  # 0755; created implicitly by the binds below it would be 0700
    for name in _ETC_FILES:
        if os.path.exists(name):
            args += ["--ro-bind", name, name]
    return args


_NAMESPACE_ARGS = [
    "--unshare-all",
    "--unshare-user",
    "--disable-userns",
    "--die-with-parent",
    "--new-session",
    "--cap-drop",
    "ALL",
    "--uid",
    str(SANDBOX_UID),
    "--gid",
    str(SANDBOX_UID),
    "--hostname",
    "sandbox",
]


def _probe_host() -> _Host:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("bubblewrap is not installed (no `bwrap` on PATH)")
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError("util-linux `prlimit` is not installed")
    probe = [bwrap, *_NAMESPACE_ARGS, *_system_args(), "--proc", "/proc", "--dev", "/dev"]
    probe += ["--", "/bin/true"]
    env = {"PATH": _PATH}
    setpriv = shutil.which("setpriv") if os.geteuid() == 0 else None
    failure = ""
    if setpriv is not None:
        uid = HOST_UID_BASE + HOST_UID_SPAN - 1
        as_uid = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *probe]
        done = subprocess.run(as_uid, env=env, capture_output=True, timeout=30, check=False)
        if done.returncode != 0:
            failure = done.stderr.decode(errors="replace").strip()
            logger.warning("bwrap cannot run as an unprivileged host uid (%s)", failure)
            setpriv = None
    if setpriv is None:
        done = subprocess.run(probe, env=env, capture_output=True, timeout=30, check=False)
        if done.returncode != 0:
            failure = done.stderr.decode(errors="replace").strip() or failure
            raise SandboxError(f"bwrap cannot create a sandbox on this host: {failure}")
    mounts = False
    if os.geteuid() == 0:
        with tempfile.TemporaryDirectory(prefix="omniloop-bwrap-probe-") as folder:
            try:
                _mount_tmpfs(folder, 1, os.geteuid(), 0o700)
                _umount(folder)
                mounts = True
            except OSError as err:
                logger.warning("cannot mount a tmpfs per sandbox (%s)", err)
    host = _Host(bwrap, prlimit, setpriv, mounts, _own_cgroup_dirs(), seccomp_program())
    missing = [c for c in _CONTROLLERS if c not in host.cgroups]
    if missing:
        logger.warning(
            "cgroup controllers %s are not writable: falling back to rlimits for them", missing
        )
    if host.seccomp is None:
        logger.warning("no seccomp filter for machine %s", platform.machine())
    return host


def _host_support() -> _Host:
    """Probe the host once (blocking, ~30 ms); raise `SandboxError` when bwrap cannot work."""
    global _host, _host_error
    with _host_lock:
        if _host is None and _host_error is None:
            try:
                _host = _probe_host()
            except (SandboxError, OSError, subprocess.SubprocessError) as err:
                _host_error = str(err)
        if _host is None:
            raise SandboxError(_host_error or "bwrap is unavailable")
        return _host


def bwrap_available() -> bool:
    """True when bubblewrap is installed and can create sandboxes here (probed once, cached)."""
    try:
        _host_support()
    except SandboxError:
        return False
    return True


# --- stale sandboxes -----------------------------------------------------------------------------


def _base_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"omniloop-bwrap-{os.geteuid()}"


def _start_time(pid: int) -> str | None:
    """The start time of `pid` (clock ticks since boot), telling a process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _kill_cgroup(folder: str) -> None:
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            pids = f.read().split()
    except FileNotFoundError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_cgroup(folder: str) -> None:
    """SIGKILL whatever is left in the cgroup and remove it (the kernel needs it empty)."""
    deadline = time.monotonic() + 5.0
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


def _remove_tree(root: Path, mounts: Sequence[str], cgroups: Sequence[str]) -> list[str]:
    """Remove a sandbox's cgroups, mounts and folder; return what could not be removed."""
    failures: list[str] = []
    for folder in cgroups:
        try:
            _remove_cgroup(folder)
        except OSError as err:
            failures.append(f"cgroup {folder}: {err}")
    for target in mounts:
        try:
            _umount(target)
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
    base = _base_dir()
    if not base.is_dir():
        return 0
    reaped = 0
    for root in base.iterdir():
        try:
            owner = json.loads((root / "owner.json").read_text())
        except FileNotFoundError:
            # Created a moment ago and not yet described, or torn down half-way long ago.
            if time.time() - root.stat().st_mtime < 60:
                continue
            owner = {"pid": -1, "start": None, "mounts": [], "cgroups": []}
        except (OSError, ValueError):
            continue
        if owner["pid"] > 0 and _start_time(owner["pid"]) == owner["start"]:
            continue
        failures = _remove_tree(root, owner["mounts"], owner["cgroups"])
        if failures:
            logger.error("could not remove stale sandbox %s: %s", root, "; ".join(failures))
        else:
            reaped += 1
    if reaped:
        logger.info("removed %d stale bwrap sandboxes", reaped)
    return reaped


# --- the launcher --------------------------------------------------------------------------------

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


class _Launcher:
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
                    env={"PATH": _PATH},
                    start_new_session=True,  # a Ctrl-C meant for the service is not for commands
                )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._proc, self._sock = proc, parent
        try:
            for folder in self._cgroups.values():
                _write(os.path.join(folder, "cgroup.procs"), str(proc.pid))
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
                for pid in _descendants(self._proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            self._proc.wait()
            self._proc = None

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
                reply, pidfds = await _receive(sock)
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


async def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
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
        await asyncio.wait([reply], timeout=_START_TIMEOUT)
    finally:
        loop.remove_reader(sock.fileno())
    if not reply.done():
        raise SandboxError(f"sandbox launcher did not answer within {_START_TIMEOUT}s")
    return reply.result()


# --- one command ---------------------------------------------------------------------------------


class _Reader:
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
            chunk = os.read(self._fd, _READ_SIZE)
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


class _Writer:
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


class _Run:
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
        self.readers: list[_Reader] = []
        self.writer: _Writer | None = None
        self._pidfd = pidfd
        self._child_pidfd = -1
        self._child_known = False
        self._kill_requested = False
        self._kill_timer: asyncio.TimerHandle | None = None
        loop.add_reader(pidfd, self._monitor_exited)

    def attach(self, stdout_fd: int, stderr_fd: int, status_fd: int, stdin: _Writer | None) -> None:
        self.readers = [
            _Reader(stdout_fd, self.loop, self.stdout.feed),
            _Reader(stderr_fd, self.loop, self.stderr.feed),
            _Reader(status_fd, self.loop, self._status_data),
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
            if pidfd >= 0 and _parent_of(child) == self.pid:
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


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _descendants(root_pid: int) -> list[int]:
    """Every living (not zombie) descendant of `root_pid`; for a sandbox that is all of it, as
    orphans reparent to its pid 1 (or to the launcher, a subreaper)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            state, ppid = fields[0], int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        if state not in ("Z", "X"):
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = deque(children.get(root_pid, []))
    while todo:
        pid = todo.popleft()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _allocate_uid() -> int:
    # Random rather than sequential so that two services on one host rarely pick the same uid;
    # within this process the set rules out reuse while a sandbox is alive.
    while True:
        uid = HOST_UID_BASE + secrets.randbelow(HOST_UID_SPAN - 1)
        if uid not in _uids_in_use:
            _uids_in_use.add(uid)
            return uid


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


def _env_args(env: Mapping[str, str]) -> list[str]:
    args: list[str] = []
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise SandboxError(f"invalid environment variable {key!r}")
        args += ["--setenv", key, value]
    return args


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _pipe(size: int | None = None) -> tuple[int, int]:
    r, w = os.pipe()
    if size is not None:
        # A larger pipe means fewer wake-ups while a command floods its output.
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
    return r, w


# --- the sandbox ---------------------------------------------------------------------------------


class BwrapSandbox:
    """A bubblewrap sandbox (see the module docstring for what it enforces and how).

    Create with `create_bwrap_sandbox`. `exec` may be called concurrently; each call is its own
    process world sharing the workspace, `/tmp` and the sandbox's limits.
    """

    def __init__(self, config: SandboxConfig, host: _Host) -> None:
        self.config = config
        self.limits: SandboxLimits = config.limits
        self.id = f"bwrap-{secrets.token_hex(6)}"
        self._host = host
        self._workdir_parts = _check_config(config)
        self.workdir = "/" + "/".join(self._workdir_parts)
        self._base_env = _env_args({"PATH": _PATH, "HOME": self.workdir, "LANG": "C.UTF-8"})
        self._base_env += _env_args(config.env)
        self.root = _base_dir() / self.id
        self.workspace = self.root / "workspace"
        self._tmp = self.root / "tmp"
        self.host_uid = _allocate_uid() if host.setpriv is not None else os.geteuid()
        self._mounts: list[str] = []
        self._cgroups: dict[str, str] = {}
        self._launcher: _Launcher | None = None
        self._runs: set[_Run] = set()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._prefix: list[str] = []

    # -- creation --

    def _create(self) -> None:
        """Lay out the host folder, mounts, cgroups and launcher (blocking: run in a thread)."""
        host, limits = self._host, self.limits
        _base_dir().mkdir(mode=0o711, exist_ok=True)
        self.root.mkdir(mode=0o711)
        planned_mounts = [str(self.workspace), str(self._tmp)] if host.mounts else []
        planned_cgroups = {
            c: os.path.join(d, f"omniloop-{self.id}") for c, d in host.cgroups.items()
        }
        owner = {
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "mounts": planned_mounts,
            "cgroups": list(planned_cgroups.values()),
        }
        (self.root / "owner.json").write_text(json.dumps(owner))
        etc = self.root / "etc"
        etc.mkdir(mode=0o755)
        (etc / "passwd").write_text(
            f"root:x:0:0:root:/root:/bin/sh\n"
            f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{self.workdir}:/bin/sh\n"
            f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (etc / "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
        (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n")
        (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
        for path in etc.iterdir():
            path.chmod(0o644)

        self.workspace.mkdir(mode=0o755)
        if host.mounts:
            _mount_tmpfs(str(self.workspace), limits.workspace_mb, self.host_uid, 0o755)
            self._mounts.append(str(self.workspace))
            self._tmp.mkdir(mode=0o755)
            _mount_tmpfs(str(self._tmp), limits.tmp_mb, self.host_uid, 0o1777)
            self._mounts.append(str(self._tmp))
        else:
            os.chown(self.workspace, self.host_uid, self.host_uid)

        for controller, folder in planned_cgroups.items():
            os.mkdir(folder)
            self._cgroups[controller] = folder
        if "memory" in self._cgroups:
            folder = self._cgroups["memory"]
            memory = str(limits.memory_mb * _MIB)
            _write(os.path.join(folder, "memory.limit_in_bytes"), memory)
            memsw = os.path.join(folder, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # present when swap is accounted: RAM + swap = the limit
                _write(memsw, memory)
        if "pids" in self._cgroups:
            # The launcher, and bwrap's monitor and pid 1 of each command, count as well.
            pids = limits.pids + _PLUMBING_PIDS
            _write(os.path.join(self._cgroups["pids"], "pids.max"), str(pids))
        if "cpu" in self._cgroups:
            folder = self._cgroups["cpu"]
            period = 100_000
            quota = max(1000, int(limits.cpus * period))
            _write(os.path.join(folder, "cpu.cfs_period_us"), str(period))
            _write(os.path.join(folder, "cpu.cfs_quota_us"), str(quota))
        self._prefix = self._bwrap_prefix()
        self._launcher = _Launcher(self.root / "launcher.log", self._cgroups)
        self._launcher.start()

    def _rlimits(self) -> list[tuple[str, int]]:
        """The rlimits every command starts with, by `prlimit` option name."""
        limits = self.limits
        rlimits = [("nofile", limits.nofile), ("fsize", limits.file_size_mb * _MIB), ("core", 0)]
        if "pids" not in self._cgroups and self._host.setpriv is not None:
            # Per host uid; the sandbox's uid is its own, and bwrap's monitor counts as one.
            rlimits.append(("nproc", limits.pids + 1))
        if "memory" not in self._cgroups:
            rlimits.append(("as", limits.memory_mb * _MIB))
        return rlimits

    def _bwrap_prefix(self) -> list[str]:
        host, limits = self._host, self.limits
        # prlimit sets the limits before setpriv drops to the sandbox's host uid: changing the
        # limits of another uid's process afterwards needs CAP_SYS_RESOURCE, which containers
        # often drop.
        args = [host.prlimit, *(f"--{name}={v}:{v}" for name, v in self._rlimits()), "--"]
        if host.setpriv is not None:
            uid = str(self.host_uid)
            args += [host.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        args.append(host.bwrap)
        etc = self.root / "etc"
        args += _NAMESPACE_ARGS
        args += _system_args()
        for name in ("passwd", "group", "hosts", "nsswitch.conf"):
            args += ["--ro-bind", str(etc / name), f"/etc/{name}"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        shm_mb = min(_SHM_MAX_MB, limits.tmp_mb)
        args += ["--perms", "1777", "--size", str(shm_mb * _MIB), "--tmpfs", "/dev/shm"]
        args += ["--remount-ro", "/dev"]
        if host.mounts:
            args += ["--bind", str(self._tmp), "/tmp"]
        else:
            args += ["--perms", "1777", "--size", str(limits.tmp_mb * _MIB), "--tmpfs", "/tmp"]
        args += ["--bind", str(self.workspace), self.workdir, "--chdir", self.workdir]
        args += ["--remount-ro", "/"]
        args += ["--clearenv", *self._base_env]
        return args

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
        extra_env = _env_args(env or {})
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

    async def _spawn(self, tail: list[str], data: bytes | None) -> _Run:
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
                stdin_r, stdin_w = _pipe()
                theirs[0] = stdin_r
            for target in (1, 2):
                r, w = _pipe(_READ_SIZE)
                ours.append(r)
                theirs[target] = w
            status_r, status_w = _pipe()
            ours.append(status_r)
            theirs[_STATUS_FD] = status_w
            if data is not None:
                ours.append(stdin_w)
            if self._host.seccomp is not None:
                seccomp_r, seccomp_w = _pipe()
                os.write(seccomp_w, self._host.seccomp)  # far below a pipe's buffer
                os.close(seccomp_w)
                theirs[_SECCOMP_FD] = seccomp_r
                args += ["--seccomp", str(_SECCOMP_FD)]
            pid, pidfd = await self._launcher.spawn([*args, *tail], theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs.values():
                os.close(fd)
        run = _Run(pid, pidfd, loop, self.limits.output_bytes)
        stdin = _Writer(ours[3], loop, data) if data is not None else None
        run.attach(ours[0], ours[1], ours[2], stdin)
        self._runs.add(run)
        return run

    def _release(self, run: _Run) -> None:
        run.release()
        self._runs.discard(run)

    def _release_started(self, starting: asyncio.Future[_Run]) -> None:
        """Done-callback for a start whose `exec` was cancelled: kill and forget what it made."""
        if not starting.cancelled() and starting.exception() is None:
            self._release(starting.result())

    async def _wait(self, run: _Run, wall: float, started: float) -> ExecStopReason | None:
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

    async def _stop(self, run: _Run) -> None:
        """SIGTERM every process of the command, wait `kill_grace`, then SIGKILL them all."""
        if self.limits.kill_grace > 0 and not run.exited.done():
            # Everything below bwrap's monitor, not the monitor itself: its death would SIGKILL
            # the sandbox before the grace period. While the monitor lives its pid is its own.
            for pid in await asyncio.to_thread(_descendants, run.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
            await asyncio.wait([run.exited], timeout=self.limits.kill_grace)
        run.kill_now()
        await asyncio.wait([run.exited], timeout=_START_TIMEOUT)
        if not run.exited.done():
            raise SandboxError(f"bwrap of sandbox {self.id} survived SIGKILL")

    def _oom_kills(self) -> int:
        folder = self._cgroups.get("memory")
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

    def _result(
        self, run: _Run, stop: ExecStopReason | None, oom_before: int, duration: float
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

    def _parts(self, path: str) -> list[str]:
        """`path` as components relative to the workspace (may hold `..`; checked while walking)."""
        if "\0" in path:
            raise SandboxError(f"path {path!r} contains a NUL byte")
        parts = [p for p in path.split("/") if p and p != "."]
        if path.startswith("/"):
            if parts[: len(self._workdir_parts)] != self._workdir_parts:
                raise SandboxError(f"path {path!r} is outside the workspace {self.workdir}")
            parts = parts[len(self._workdir_parts) :]
        return parts

    def _walk(self, path: str, *, create: bool) -> tuple[int, str]:
        """Resolve `path` as the sandbox would, one component at a time.

        Returns an open directory descriptor (the caller closes it) and the final name, which
        was not a symlink when checked. Folders are entered with `O_NOFOLLOW`, so a component
        swapped for a symlink after its check fails instead of being followed.
        """
        todo = deque(self._parts(path))
        stack = [os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
        links = 0
        try:
            while todo:
                name = todo.popleft()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(stack) == 1:
                        raise SandboxError(f"path {path!r} leaves the workspace")
                    os.close(stack.pop())
                    continue
                try:
                    st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                except FileNotFoundError:
                    if not todo:
                        return stack.pop(), name
                    if not create:
                        raise SandboxError(f"no folder {name!r} on the way to {path!r}") from None
                    os.mkdir(name, 0o755, dir_fd=stack[-1])
                    os.chown(
                        name, self.host_uid, self.host_uid, dir_fd=stack[-1], follow_symlinks=False
                    )
                    st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > _MAX_SYMLINKS:
                        raise SandboxError(f"too many symlinks in {path!r}")
                    target = os.readlink(name, dir_fd=stack[-1])
                    if target.startswith("/"):
                        try:
                            parts = self._parts(target)
                        except SandboxError:
                            raise SandboxError(
                                f"path {path!r} goes through a symlink to {target!r}, "
                                "outside the workspace"
                            ) from None
                        while len(stack) > 1:
                            os.close(stack.pop())
                    else:
                        parts = target.split("/")
                    todo.extendleft(reversed(parts))
                    continue
                if not todo:
                    return stack.pop(), name
                if not stat.S_ISDIR(st.st_mode):
                    raise SandboxError(f"{name!r} in {path!r} is not a folder")
                flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                stack.append(os.open(name, flags, dir_fd=stack[-1]))
            raise SandboxError(f"path {path!r} names a folder, not a file")
        except OSError as err:
            raise SandboxError(f"cannot resolve {path!r} in the workspace: {err}") from err
        finally:
            for fd in stack:
                os.close(fd)

    def _open_file(self, path: str, flags: int, *, create: bool) -> int:
        self._check_open()
        folder, name = self._walk(path, create=create)
        # O_NOFOLLOW: a symlink put there after the walk is refused, not followed.
        # O_NONBLOCK: opening a FIFO the sandbox made must not hang the service.
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=folder)
        except OSError as err:
            raise SandboxError(f"cannot open {path!r} in the workspace: {err}") from err
        finally:
            os.close(folder)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            raise SandboxError(f"{path!r} is not a regular, singly linked file")
        return fd

    def _write_file(self, path: str, data: bytes) -> None:
        fd = self._open_file(path, os.O_WRONLY | os.O_CREAT, create=True)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchown(fd, self.host_uid, self.host_uid)
        except OSError as err:
            raise SandboxError(f"cannot write {path!r} in the workspace: {err}") from err
        finally:
            os.close(fd)

    def _read_file(self, path: str) -> bytes:
        fd = self._open_file(path, os.O_RDONLY, create=False)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

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
        return [] if pid is None else _descendants(pid)

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
        global cleanup_failures
        runs = list(self._runs)
        for run in runs:
            run.kill_now()
        if runs:
            await asyncio.wait([r.exited for r in runs], timeout=_START_TIMEOUT)
        failures: list[str] = []
        if self._launcher is not None:
            try:
                await self._launcher.close()
            except OSError as err:
                failures.append(f"launcher: {err}")
        failures += await asyncio.to_thread(self._remove)
        if failures:
            cleanup_failures += 1
            logger.error("sandbox %s clean-up incomplete: %s", self.id, "; ".join(failures))

    def _remove(self) -> list[str]:
        failures = _remove_tree(self.root, list(self._mounts), list(self._cgroups.values()))
        _uids_in_use.discard(self.host_uid)
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
    host = _host if _host is not None else await asyncio.to_thread(_host_support)
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
