"""Freed host memory kept for the next allocation (`trainer.keep_freed_memory`).

An optimizer step on the CPU allocates and frees blocks of tens to hundreds of megabytes many
times: each micro-batch's activations, the dense gradient of the embedding matrix, the
gradients summed into the parameters'. glibc's malloc serves a block that large with a fresh
`mmap` and hands it back to the kernel with `munmap` when freed, so every such block is
page-faulted in again, one 4-KiB page at a time, by the next micro-batch (SmolLM2-135M: ~700
thousand faults per step). Told to serve every block from its heap and never to trim it,
malloc reuses the freed blocks instead. The cost: the process keeps the memory of its peak
once it has reached it (about the same peak as before) rather than giving it back between
steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
"""glibc's `mallopt` parameter: free memory at the heap's top kept before giving it back."""
M_MMAP_MAX = -4
"""glibc's `mallopt` parameter: most blocks served by `mmap` at once (0: none)."""
KEEP_BYTES = 2**31 - 1
"""The largest trim threshold `mallopt` takes (an int): in effect, never trim."""


def keep_freed_memory() -> bool:
    """Have this process's malloc keep freed memory for reuse (process-wide, from now on; for
    every thread). Returns whether the C library took the settings: False, with a log line,
    where it is not glibc (musl, macOS), and nothing changes there."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("keep_freed_memory: the C library (%s) has no mallopt; left as it is", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 when it took a setting, 0 when it refused it.
    taken = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    if not taken:
        log.info("keep_freed_memory: mallopt refused the settings; left as it is")
    return taken
