"""What megatron-core 0.16 needs to run on a CPU, in one place.

megatron-core is written for CUDA; its tiny-model path (the local layer spec: no Transformer
Engine, no apex, every fusion off, fp32, `use_cpu_initialization`) computes correctly on a CPU
once a few CUDA calls it makes outside the maths are answered (verified: logits equal Hugging
Face's within 3e-7). `install()` patches exactly those, once, and only when no GPU is used. Each
patch says why. Nothing here changes what is computed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

_installed = False
_lock = threading.Lock()


def install() -> None:
    """Apply the shims (idempotent). Call before building a megatron model on the CPU."""
    global _installed
    with _lock:
        if _installed:
            return
        from megatron.core.tensor_parallel import random as megatron_random

        # Megatron places tensors with `device=torch.cuda.current_device()` (the embedding's
        # position buffers, the rotary frequencies, the optimizer's scalars); without CUDA
        # that call raises. The CPU is the device that index stands for here.
        torch.cuda.current_device = _cpu_device  # type: ignore[assignment]

        # Dropout inside attention runs under `get_cuda_rng_tracker().fork()`, which swaps CUDA
        # RNG states. Dropout is 0 in every config built here, and the CPU generator is the one
        # torch uses: the fork has nothing to swap.
        megatron_random.CudaRNGStatesTracker.fork = _no_fork

        # Not patched: with no explicit mask, causal attention builds its mask on "cuda"
        # (`get_default_causal_mask`); the backend always passes its own mask.
        _installed = True


def _cpu_device() -> str:
    return "cpu"


@contextlib.contextmanager
def _no_fork(self: Any, name: str = "model-parallel-rng") -> Iterator[None]:
    yield
