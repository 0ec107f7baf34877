"""Typed sandbox configuration shared by every backend (the default run profile)."""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from omniloop.config import StrictModel


class SandboxLimits(StrictModel):
    """Resource limits of one sandbox. Defaults follow SANDBOX-CHECKLIST.md's run profile."""

    timeout: float = Field(default=30.0, gt=0)
    """Default wall-clock seconds for one `exec` (a call may pass its own)."""
    idle_timeout: float | None = Field(default=None, gt=0)
    """Kill a command that prints nothing for this many seconds; None disables it."""
    kill_grace: float = Field(default=1.0, ge=0)
    """Seconds between SIGTERM and SIGKILL when a command is stopped."""
    memory_mb: int = Field(default=2048, gt=0)
    """Memory limit of the sandbox (RAM + swap)."""
    pids: int = Field(default=256, gt=0)
    """Most processes/threads alive at once inside the sandbox."""
    cpus: float = Field(default=1.0, gt=0)
    """CPU share (Docker `--cpus`)."""
    nofile: int = Field(default=1024, gt=0)
    """Most open file descriptors per process."""
    file_size_mb: int = Field(default=1024, gt=0)
    """Largest single file a process may write."""
    workspace_mb: int = Field(default=1024, gt=0)
    """Size of the writable workspace."""
    tmp_mb: int = Field(default=512, gt=0)
    """Size of the `/tmp` tmpfs."""
    inodes: int = Field(default=65536, gt=0)
    """Most files and folders in the workspace, and again in `/tmp` (tmpfs `nr_inodes`)."""
    output_bytes: int = Field(default=64 * 1024, ge=2)
    """Cap on captured stdout and on stderr, each kept as head + tail."""
    ttl: float = Field(default=3600.0, gt=0)
    """Seconds after creation when the reaper may remove the sandbox whatever its state."""


_KERNEL_DIRS = ("/proc", "/sys", "/dev", "/run")
"""Host folders `read_only_paths` may not expose."""


class SandboxConfig(StrictModel):
    """Which backend isolates tools, and how."""

    backend: Literal["auto", "docker", "gvisor", "bwrap"] = "auto"
    """`auto`: `docker` when a Docker daemon is reachable, else `bwrap`."""
    image: str = "omniloop-sandbox:latest"
    """Container image for the `docker` and `gvisor` backends."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Resource limits."""
    pool_size: int = Field(default=4, ge=0)
    """Warm sandboxes kept ready per image; 0 creates on demand."""
    workdir: str = "/workspace"
    """The writable workspace inside the sandbox; tools run there."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for every command (the host environment is never passed)."""
    read_only_paths: list[str] = Field(default_factory=list)
    """Host folders or files visible inside the sandbox at the same path, read-only (bwrap:
    binds; docker and gvisor: read-only bind mounts of the Docker host's paths): e.g. the
    virtual environment an MCP server runs from. Absolute; never `/` or the workspace."""
    egress_allowlist: list[str] | None = None
    """Opt-in outbound access (`docker` backend): `host:port` entries (`*.example.com:443`
    matches subdomains) reachable through a per-sandbox egress proxy, which the sandbox finds in
    `HTTP_PROXY`/`HTTPS_PROXY`. Everything else is refused: other hosts, other ports, IP literals.
    None (the default) gives the sandbox no network at all."""
    egress_network: str = "bridge"
    """The Docker network the egress proxy reaches allowed hosts through (allowlist mode only)."""
    gvisor_runtime: str = "runsc"
    """Name under which gVisor's `runsc` is registered with the Docker daemon."""
    service: str = "local"
    """Which process creates the sandboxes of `omniloop rollout`, `omniloop serve` and a run
    in process (a run's rollout replicas always use the run's sandbox role). `local`: a
    sandboxd child process on loopback, started on the first sandbox (a backend that crashes
    takes down that process, not the one running episodes); a URL (`http://host:8765`): a
    running sandboxd (`omniloop sandbox serve`; its token in `OMNILOOP_SANDBOXD_TOKEN`), whose
    host decides `auto`; `in_process`: the process itself (no isolation; for debugging)."""

    @field_validator("read_only_paths")
    @classmethod
    def _read_only_paths(cls, value: list[str], info: ValidationInfo) -> list[str]:
        workdir = posixpath.normpath(str(info.data.get("workdir", "/workspace")))
        out = []
        for path in value:
            normal = posixpath.normpath(path)
            if not path.startswith("/") or normal == "/":
                raise ValueError(
                    f"read_only_paths entry {path!r} must be an absolute path other than /"
                )
            kernel = any(normal == d or normal.startswith(d + "/") for d in _KERNEL_DIRS)
            if kernel or normal.endswith(".sock"):
                raise ValueError(
                    f"read_only_paths entry {path!r} would expose the host's kernel interfaces "
                    "or a service socket to the sandbox; it is refused"
                )
            inside = normal.startswith(workdir + "/") or workdir.startswith(normal + "/")
            if normal == workdir or inside:
                raise ValueError(
                    f"read_only_paths entry {path!r} overlaps the workspace {workdir!r}"
                )
            out.append(normal)
        return out

    @field_validator("service")
    @classmethod
    def _check_service(cls, value: str) -> str:
        if value in ("local", "in_process") or value.startswith(("http://", "https://")):
            return value
        raise ValueError(
            f"sandbox.service {value!r} is none of `local`, `in_process` or an http(s) URL of "
            "a sandboxd"
        )

    @field_validator("egress_allowlist")
    @classmethod
    def _check_allowlist(cls, value: list[str] | None) -> list[str] | None:
        for entry in value or []:
            host, sep, port = entry.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"egress_allowlist entry {entry!r} is not of the form host:port")
        return value
