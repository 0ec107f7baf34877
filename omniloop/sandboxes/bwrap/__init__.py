"""The `bwrap` backend: a bubblewrap process sandbox for hosts without Docker.

How a sandbox is started and isolated: `isolation` (the command line: rlimits, host uid switch,
namespaces, file system view), `seccomp` (the syscall filters), `cgroups` (memory, pids, CPU),
`host` (what the host allows, probed once; sized tmpfs mounts; host uids), `launcher` (the
per-sandbox process that starts every bwrap) and `cleanup` (removal, also after a crash). What
runs inside it: `run` (one command's processes and output streams) and `files` (workspace file
access from the host). `sandbox` ties them together as `BwrapSandbox`.

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
  `unshare -U` fails), `--new-session` (no TIOCSTI into the caller's terminal) and seccomp
  filters (x86_64 and aarch64, built with libseccomp) that return EPERM for ptrace,
  process_vm_*, keyctl/add_key/request_key, bpf, perf_event_open, userfaultfd, io_uring, the
  mount API, setns/unshare, module and kexec loading, swap, reboot, clock setting, syslog,
  acct, quotactl and open_by_handle_at, return EPERM for the x32 syscall range, and kill any
  process using another syscall ABI (i386 on x86_64, arm32 on aarch64).
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

from typing import Any

from omniloop.sandboxes.bwrap import cleanup as _cleanup
from omniloop.sandboxes.bwrap.cleanup import reap_stale_sandboxes
from omniloop.sandboxes.bwrap.host import HOST_UID_BASE, HOST_UID_SPAN, bwrap_available
from omniloop.sandboxes.bwrap.isolation import SANDBOX_UID
from omniloop.sandboxes.bwrap.sandbox import BwrapSandbox, create_bwrap_sandbox
from omniloop.sandboxes.bwrap.seccomp import DENIED_SYSCALL_NAMES, denied_syscalls, seccomp_programs

__all__ = [
    "DENIED_SYSCALL_NAMES",
    "HOST_UID_BASE",
    "HOST_UID_SPAN",
    "SANDBOX_UID",
    "BwrapSandbox",
    "bwrap_available",
    "cleanup_failures",
    "create_bwrap_sandbox",
    "denied_syscalls",
    "reap_stale_sandboxes",
    "seccomp_programs",
]


def __getattr__(name: str) -> Any:
    # `cleanup_failures` is a live counter kept in `cleanup`; a re-exported copy would go stale.
    if name == "cleanup_failures":
        return _cleanup.cleanup_failures
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
