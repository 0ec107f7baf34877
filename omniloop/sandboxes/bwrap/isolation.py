"""The command line that isolates each command: rlimits, host uid switch, bwrap's namespaces and
the sandbox's file system view.

Every command runs as `prlimit <rlimits> -- [setpriv <host uid> --] bwrap <options> -- argv`.
prlimit sets the limits before setpriv drops to the sandbox's host uid (changing the limits of
another uid's process afterwards needs CAP_SYS_RESOURCE, which containers often drop); bwrap then
enters fresh namespaces over a read-only root that holds only the host's system folders, the
sandbox's generated `/etc` files, its `/tmp` and its workspace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from omniloop.errors import SandboxError
from omniloop.sandboxes.config import SandboxLimits

SANDBOX_UID = 1000
"""The uid (and gid) commands run as inside every sandbox."""
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
"""PATH of bwrap itself and of every command."""

_MIB = 1024 * 1024
_SHM_MAX_MB = 64
_ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
)
_GENERATED_ETC = ("passwd", "group", "hosts", "nsswitch.conf")

NAMESPACE_ARGS = [
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
"""bwrap's namespace and privilege options, the same for every command."""


def system_args() -> list[str]:
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


def write_etc(etc: Path, workdir: str) -> None:
    """Write the sandbox's own `passwd`, `group`, `hosts` and `nsswitch.conf` into `etc`."""
    etc.mkdir(mode=0o755)
    (etc / "passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\n"
        f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{workdir}:/bin/sh\n"
        f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n")
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    for path in etc.iterdir():
        path.chmod(0o644)


def env_args(env: Mapping[str, str]) -> list[str]:
    """bwrap options setting `env` in the command's environment; refuse malformed variables."""
    args: list[str] = []
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise SandboxError(f"invalid environment variable {key!r}")
        args += ["--setenv", key, value]
    return args


def rlimits(
    limits: SandboxLimits, controllers: Sequence[str], own_uid: bool
) -> list[tuple[str, int]]:
    """The rlimits every command starts with, by `prlimit` option name.

    `controllers` are the cgroup controllers the sandbox has; RLIMIT_NPROC and RLIMIT_AS stand
    in for missing pids and memory cgroups. RLIMIT_NPROC counts per host uid, so it binds only
    when bwrap runs as a uid of the sandbox's own (`own_uid`).
    """
    found = [("nofile", limits.nofile), ("fsize", limits.file_size_mb * _MIB), ("core", 0)]
    if "pids" not in controllers and own_uid:
        # Per host uid; the sandbox's uid is its own, and bwrap's monitor counts as one.
        found.append(("nproc", limits.pids + 1))
    if "memory" not in controllers:
        found.append(("as", limits.memory_mb * _MIB))
    return found


def bwrap_prefix(
    *,
    prlimit: str,
    setpriv: str | None,
    bwrap: str,
    host_uid: int,
    limits: SandboxLimits,
    controllers: Sequence[str],
    etc: Path,
    tmp: Path | None,
    workspace: Path,
    workdir: str,
    env: Sequence[str],
    read_only: Sequence[str] = (),
) -> list[str]:
    """Everything of a command's command line before bwrap's `--` and the command.

    `setpriv` (when set) switches to `host_uid`; `tmp` is the sandbox's persistent `/tmp`
    folder, or None for a sized tmpfs that bwrap creates for each command; `env` is the bwrap
    options of the base environment (see `env_args`); `read_only`: host paths bound read-only
    at the same path.
    """
    own_uid = setpriv is not None
    args = [prlimit, *(f"--{n}={v}:{v}" for n, v in rlimits(limits, controllers, own_uid)), "--"]
    if setpriv is not None:
        uid = str(host_uid)
        args += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    args.append(bwrap)
    args += NAMESPACE_ARGS
    args += system_args()
    for name in _GENERATED_ETC:
        args += ["--ro-bind", str(etc / name), f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    shm_mb = min(_SHM_MAX_MB, limits.tmp_mb)
    args += ["--perms", "1777", "--size", str(shm_mb * _MIB), "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev"]
    if tmp is not None:
        args += ["--bind", str(tmp), "/tmp"]
    else:
        args += ["--perms", "1777", "--size", str(limits.tmp_mb * _MIB), "--tmpfs", "/tmp"]
    args += ["--bind", str(workspace), workdir, "--chdir", workdir]
    for path in read_only:  # SandboxConfig.read_only_paths, last: /tmp's mount would hide them
        args += ["--ro-bind", path, path]
    args += ["--remount-ro", "/"]
    args += ["--clearenv", *env]
    return args
