"""What the rank scripts of this folder do around their work: join a gloo world of processes
over a file, one torch thread each (two shared cores), and leave it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def gloo_world(rank: str, world: str, store: str) -> Iterator[None]:
    """Be rank `rank` of `world` processes meeting at the file `store` while the block runs."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
