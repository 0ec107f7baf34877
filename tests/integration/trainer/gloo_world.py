"""What the rank scripts of this folder do around their work: join a gloo world of processes
over a file, one torch thread each (two shared cores), and leave it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def gloo_world(rank: str, world: str, store: str) -> Iterator[None]:
    """Be rank `rank` of `world` processes meeting at the file `store` while the block runs.

    A rank whose block finished waits for the others, drops megatron's model-parallel groups,
    leaves the world and exits the process with 0 at once: left to the interpreter's teardown,
    a gloo group still referenced from a module global can be destroyed with its threads
    running, which aborts the process ("terminate called without an active exception") after
    its work is done. A block that raises leaves the world and lets the exception through.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world)
    )
    try:
        yield
        dist.barrier()
    finally:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
