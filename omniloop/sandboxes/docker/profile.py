"""The default run profile (SANDBOX-CHECKLIST.md): how a sandbox's container is limited and
isolated, as a Docker HostConfig, and the configs this backend refuses.
"""

from __future__ import annotations

import posixpath
from typing import Any

from docker.api.client import APIClient
from docker.types import LogConfig, Ulimit

from omniloop.errors import ConfigError
from omniloop.sandboxes.config import SandboxConfig

SANDBOX_UID = 1000
"""The uid (and gid) every command runs as."""
INIT_UID = 65534
"""The uid of the container's init and main process: not the commands' uid, so they cannot
signal or ptrace it."""

_MIB = 1024 * 1024


def check_config(config: SandboxConfig, backend: str) -> None:
    """Raise `ConfigError` for a config the `backend` ("docker" or "gvisor") cannot honour."""
    limits = config.limits
    if limits.tmp_mb + limits.workspace_mb >= limits.memory_mb:
        raise ConfigError(
            f"tmp_mb ({limits.tmp_mb}) + workspace_mb ({limits.workspace_mb}) must stay below "
            f"memory_mb ({limits.memory_mb}): tmpfs pages count against the memory limit, and a "
            "full /tmp must be ENOSPC, not an OOM kill. Lower the tmpfs sizes or raise memory_mb."
        )
    if not posixpath.isabs(config.workdir) or posixpath.normpath(config.workdir) in ("/", "/tmp"):
        raise ConfigError(
            f"workdir must be an absolute folder other than / and /tmp, got {config.workdir!r}"
        )
    if config.egress_allowlist is not None and backend == "gvisor":
        raise ConfigError(
            "egress_allowlist is not available with the gvisor backend: runsc is registered "
            "with --network=none (scripts/dockerd.sh), so a gVisor sandbox has loopback only"
        )


def host_config_for(
    api: APIClient,
    config: SandboxConfig,
    *,
    runtime: str | None,
    network_mode: str,
) -> dict[str, Any]:
    """The Docker HostConfig of the default run profile (SANDBOX-CHECKLIST.md) for `config`."""
    limits = config.limits
    memory = limits.memory_mb * _MIB
    fsize = limits.file_size_mb * _MIB
    ulimits = [
        Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
        Ulimit(name="fsize", soft=fsize, hard=fsize),
        Ulimit(name="core", soft=0, hard=0),
    ]
    pids = limits.pids
    if runtime is not None and "runsc" in runtime:
        # gVisor's sentry threads share the pids cgroup with the sandbox's processes (about five
        # host threads per process); the sandbox's own limit is enforced inside by gVisor.
        ulimits.append(Ulimit(name="nproc", soft=limits.pids, hard=limits.pids))
        pids = limits.pids * 24 + 512
    tmpfs = {
        "/tmp": f"rw,nosuid,nodev,size={limits.tmp_mb}m,nr_inodes={limits.inodes},mode=1777",
        posixpath.normpath(config.workdir): (
            f"rw,nosuid,nodev,size={limits.workspace_mb}m,nr_inodes={limits.inodes},"
            f"uid={SANDBOX_UID},gid={SANDBOX_UID},mode=0755"
        ),
    }
    return api.create_host_config(
        network_mode=network_mode,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        privileged=False,
        read_only=True,
        tmpfs=tmpfs,
        mem_limit=memory,
        memswap_limit=memory,
        nano_cpus=int(limits.cpus * 1e9),
        # The CPU weight follows the allowance: while a throttled sandbox bursts through its
        # quota, a neighbour with a larger allowance keeps the larger part of each CPU.
        cpu_shares=max(2, int(1024 * limits.cpus)),
        pids_limit=pids,
        ulimits=ulimits,
        init=True,
        ipc_mode="private",
        binds={path: {"bind": path, "mode": "ro"} for path in config.read_only_paths} or None,
        oom_score_adj=500,
        auto_remove=True,
        log_config=LogConfig(type="json-file", config={"max-size": "10m", "max-file": "3"}),
        runtime=runtime,
    )
