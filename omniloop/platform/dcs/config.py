"""The `sync` block of a run: how the trainer's weights reach the inference engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omniloop.config import StrictModel

UpdateMode = Literal["in_place", "drain"]
"""How a weight update meets running requests (see `omniloop.platform.dcs`)."""


class WeightSyncConfig(StrictModel):
    """How the trainer's weights reach the inference engines."""

    method: Literal["disk", "distributed", "tcp"] = "distributed"
    """`distributed`: torch.distributed broadcast in buckets (engines must reach
    `master_addr`); `tcp`: the engines fetch checksummed buckets over HTTP from the trainer's
    bucket server (`tcp_advertise_url`; omniloop's engine only); `disk`: a safetensors folder
    the engines load (needs a shared path)."""
    bucket_mb: float = Field(default=256.0, gt=0)
    """Distributed and tcp: most MiB per bucket (one broadcast, or one HTTP response, each);
    a tensor that is larger travels alone."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Distributed: `gloo` (CPU tensors; omniloop's CPU engine) or `nccl` (SGLang on GPUs)."""
    flattened: bool = False
    """Distributed: false (the default), one broadcast per tensor: an engine paused in place
    receives each straight into its model (no receive buffer, no copy) and the trainer packs
    nothing; true, each bucket as one uint8 broadcast (SGLang's `flattened_bucket` load
    format: fewer calls, but a pack on the trainer and a copy on the engine)."""
    master_addr: str = "127.0.0.1"
    """Distributed: the trainer's address as the engines reach it (rank 0 serves the store)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Distributed: the store's TCP port; 0 picks a free one."""
    group_name: str | None = None
    """Distributed: the process group's name; None: a unique one per run."""
    ranks_per_engine: int = Field(default=1, ge=1)
    """Distributed: ranks each engine joins with (SGLang's tensor-parallel size)."""
    tcp_host: str = "127.0.0.1"
    """Tcp: the address the bucket server listens on (`0.0.0.0` for engines on other hosts)."""
    tcp_port: int = Field(default=0, ge=0, le=65535)
    """Tcp: the bucket server's port; 0 picks a free one."""
    tcp_advertise_url: str | None = None
    """Tcp: the bucket server's base URL as the engines reach it (through a tunnel or a
    proxy, say); None: `http://{tcp_host}:{port}`."""
    tcp_retries: int = Field(default=3, ge=0)
    """Tcp: how often an engine fetches a bucket again after a broken connection (it resumes
    from the byte it got to) or a checksum mismatch (it fetches the bucket whole), before the
    update fails."""
    staging_dir: str | None = None
    """Disk: where weight folders are written (the engines read them at the same path);
    None: a temporary folder, removed on `close`."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one engine call (a weight update first waits for running requests)
    and for the process group's peers."""
    update_mode: UpdateMode = "in_place"
    """`in_place`: engines pause between decode steps while the weights load, and running
    requests go on under the new weights (a token records the version that sampled it).
    `drain`: running requests finish under the old weights first (one version per response;
    generation waits for the slowest)."""
