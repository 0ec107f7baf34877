"""The `docker` and `gvisor` backends: one hardened container per sandbox.

Model
-----
A `DockerSandbox` is one container, created and started by `create_docker_sandbox`. Its main
process is `sleep <ttl>` under Docker's init (tini), both running as uid 65534; every command
(`exec`) runs as uid 1000 through the Docker API. When the TTL passes, `sleep` exits and the
container (auto-remove) deletes itself, even if nothing of omniloop is alive any more. The
`gvisor` backend is the same container under the `runsc` runtime: a user-space kernel between
the commands and the host kernel.

The Docker SDK does the control calls (create, start, inspect, remove) in a thread pool of its
own; exec output is read from a raw asyncio connection to the Docker API, so a running command
holds no thread and the event loop never blocks.

How a sandbox is started and isolated: `deployment` (creation and undo), `profile` (the run
profile as a Docker HostConfig), `network` (allowlist mode's private network and egress proxy),
`client` (the daemon connection, its thread pool and event stream), `ownership` (labels, names,
owner identity) and `cleanup` (removal, failure count). What runs inside it: `sandbox` (commands
and their supervision), `exec_stream` (a command's stdio over the Docker API) and `files`
(workspace file access).

What is covered
---------------
- Network: `--network none` (loopback only): nothing outside the sandbox, host loopback services
  and other sandboxes included, is reachable; DNS fails at once. Opt-in allowlist mode
  (`SandboxConfig.egress_allowlist`): the sandbox sits alone on a private `internal` network whose
  only other member is its egress proxy (`egress_proxy.py`), which lets through the listed
  `host:port` pairs and refuses everything else, IP literals included.
- Privilege: `--cap-drop ALL`, `no-new-privileges`, Docker's default seccomp profile, no
  `--privileged`, commands as uid/gid 1000, no Docker socket and no host bind mounts. The init
  runs as a different uid (65534), so a command can neither signal nor ptrace PID 1 (Docker's
  default seccomp profile allows ptrace on kernels >= 4.8; the uid boundary is what stops it).
- Filesystem: read-only root; `/tmp` and the workspace are tmpfs mounts with `size=` and
  `nr_inodes=` (ENOSPC at `tmp_mb` / `workspace_mb` / `inodes`, never the host disk: nothing
  the commands write reaches the host's disk except the rotated json-file logs). Tmpfs pages
  count against the memory limit, so
  `tmp_mb + workspace_mb` must stay below `memory_mb` (checked at creation), which makes a full
  tmpfs an ENOSPC and never an OOM kill. A tmpfs workspace is the honest way to bound it here:
  `--storage-opt size=` needs XFS project quotas and is silently ignored elsewhere (moby#46823),
  and nothing else the Docker API offers bounds a directory's size. RLIMIT_FSIZE caps any single
  file at `file_size_mb`; the workspace is empty in every new sandbox.
- Limits: `--memory` = `--memory-swap` = `memory_mb` (an OOM kill inside is reported as
  `stop_reason="oom"`, seen as Docker's `oom` event), `--cpus`, `--pids-limit` (a fork bomb
  gets EAGAIN), `--ulimit nofile` (EMFILE), core dumps off, `--init` reaping zombies,
  `oom_score_adj=500` (the host's OOM killer takes sandboxes before services), json-file logs
  rotated at 3 x 10 MB.
- gVisor: runsc runs with `--oci-seccomp`, so Docker's default seccomp profile also filters the
  sandbox's system calls inside gVisor (scripts/dockerd.sh registers it so). The sentry's own
  host threads count against the pids cgroup (5 to 20 per process of the sandbox, more when it
  forks hard; at the cgroup limit the sentry dies), so the cgroup is sized `pids * 24 + 512`
  and the sandbox's process limit is enforced inside by gVisor through RLIMIT_NPROC (`pids`),
  which there counts only the sandbox's own processes. A fork bomb that holds every process
  slot also blocks the exec that would signal it; the sandbox is then destroyed. The
  sentry's thread count also grows with a fork bomb's churn (runsc 2022's ptrace platform:
  about 200 threads a second at `pids=128`), so a bomb that runs long enough reaches the
  cgroup limit and the sentry dies: the command raises `SandboxError` (no result), as do later
  calls; the host is untouched. A memory-limit overrun kills the whole gVisor sandbox (the
  sentry holds all its memory): the command's result is `oom` and later calls raise
  `SandboxError`.
- Time: a wall-clock timeout per command and an optional no-output timeout. Stopping sends
  SIGTERM to every process of the sandbox user, waits `kill_grace`, then SIGKILL, each from a
  fresh `sh -c 'kill -SIG -1'` exec as uid 1000: `kill(-1)` reaches every process that uid owns
  (setsid, nohup and double-forked daemons included) and never the init, which another uid
  owns. A timeout therefore stops everything the sandbox user runs, not just that command. When
  a command exits while processes it started still hold its output (`server &`, a fork bomb's
  children), they are stopped the same way and the command's own exit status is returned;
  processes that redirected their output (`cmd >log 2>&1 &`) run on until a timeout or `close`.
  When no signalling exec can start (the bomb holds every process slot) or stopping takes more
  than 10 s past the grace (a gVisor sentry at its thread cap can keep a Docker call waiting
  for a minute or more), the sandbox is destroyed instead; the command returns at most 2 s
  later while Docker's removal goes on, and `close` waits for that removal.
- Output: stdout and stderr are read frame by frame (at most 64 KiB at a time) into
  `CappedOutput`, so memory stays bounded whatever a command prints.
- Environment: a command sees the image's environment, `config.env` and its call's `env`, never
  the host's.
- Files: `write_file`/`read_file` run `sh` as uid 1000 in the sandbox; paths are normalised and
  must stay inside the workspace; any symlink on the way is refused, and only regular files are
  read or replaced. The checks run as the sandbox user, so a race against a command of the
  sandbox can at worst reach what that user reaches anyway.
- Cleanup: `close` removes the container (and the proxy and network of allowlist mode). Each
  container carries labels `omniloop.sandbox=1`, `omniloop.episode_id`, `omniloop.expires_at` and
  `omniloop.owner` (the creating process); `reaper.py` removes expired ones, ones whose owner
  process is gone and ones whose close failed. Close failures are logged and counted in
  `cleanup_failures`.

What is not covered
-------------------
- The `docker` backend shares the host kernel: a kernel exploit through the allowed syscalls
  escapes. Use `gvisor` for untrusted multi-tenant code.
- Docker reports death by signal N as exit code 128 + N (as the shell does); only an OOM kill is
  told apart (`exit_code=-9`, `stop_reason="oom"`).
- The image must provide `/bin/sh` and `sleep` (commands, file transfer and the tree kill use
  them). Disk use by the image itself and inode counts beyond tmpfs defaults are not limited.
- In allowlist mode, the proxy resolves names with Docker's embedded DNS; names are not checked
  against a DNS-rebinding list beyond loopback/link-local/unspecified addresses. Each sandbox
  gets a network of its own (a /28 of 10.213.0.0/16) and a proxy container.
- A command that leaves a background process holding its output makes Docker delay the
  sandbox's next command by about 2 s (the daemon waits that long for the output to close).
- gVisor as packaged in Debian bookworm (runsc 0.0~20221219): Docker's seccomp profile reaches
  the container's init but not commands started by `docker exec`, so inside gVisor
  `unshare(CLONE_NEWUSER)` succeeds (a user namespace of the sentry's own kernel);
  `nr_inodes` is ignored (file counts are bounded by the memory limit, which kills the whole
  sandbox); coreutils `ls`/`stat` of bookworm fail with EINVAL (statx); allowlist mode is
  unavailable (runsc runs with `--network=none`).
"""

from typing import Any

from omniloop.sandboxes.docker import cleanup as _cleanup
from omniloop.sandboxes.docker.cleanup import count_cleanup_failure, remove_resources
from omniloop.sandboxes.docker.client import (
    DockerHost,
    default_host,
    docker_available,
    gvisor_available,
    image_present,
)
from omniloop.sandboxes.docker.deployment import create_docker_sandbox
from omniloop.sandboxes.docker.files import resolve_workspace_path
from omniloop.sandboxes.docker.ownership import (
    LABEL_BACKEND,
    LABEL_EPISODE,
    LABEL_EXPIRES,
    LABEL_IMAGE,
    LABEL_OWNER,
    LABEL_ROLE,
    LABEL_SANDBOX,
    NAME_PREFIX,
    owned_live_names,
    owner_alive,
    process_owner,
    sandbox_labels_filter,
)
from omniloop.sandboxes.docker.profile import INIT_UID, SANDBOX_UID, host_config_for
from omniloop.sandboxes.docker.sandbox import DockerSandbox

__all__ = [
    "INIT_UID",
    "LABEL_BACKEND",
    "LABEL_EPISODE",
    "LABEL_EXPIRES",
    "LABEL_IMAGE",
    "LABEL_OWNER",
    "LABEL_ROLE",
    "LABEL_SANDBOX",
    "NAME_PREFIX",
    "SANDBOX_UID",
    "DockerHost",
    "DockerSandbox",
    "cleanup_failures",
    "count_cleanup_failure",
    "create_docker_sandbox",
    "default_host",
    "docker_available",
    "gvisor_available",
    "host_config_for",
    "image_present",
    "owned_live_names",
    "owner_alive",
    "process_owner",
    "remove_resources",
    "resolve_workspace_path",
    "sandbox_labels_filter",
]


def __getattr__(name: str) -> Any:
    # `cleanup_failures` is a live counter kept in `cleanup`; a re-exported copy would go stale.
    if name == "cleanup_failures":
        return _cleanup.cleanup_failures
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
