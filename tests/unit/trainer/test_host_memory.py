"""`keep_freed_memory`: a large block freed and allocated again is not faulted in again.

In a child process (the setting is process-wide): the page faults of allocating and filling a
64-MiB block ten times, before and after the call. Counts of faults, not times.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json, resource
from omniloop.trainer.host_memory import keep_freed_memory

def faults_of_ten_blocks():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = bytearray(64 * 2**20)  # malloc, then every page written
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = faults_of_ten_blocks()
taken = keep_freed_memory()
faults_of_ten_blocks()  # the first block after the call grows the heap once
kept = faults_of_ten_blocks()
print(json.dumps({"plain": plain, "kept": kept, "taken": taken, "page": resource.getpagesize()}))
"""


def test_freed_blocks_are_reused_without_page_faults() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    result = json.loads(done.stdout)
    assert result["taken"] is True
    pages = 64 * 2**20 // result["page"]
    # Without it every block is a fresh mapping: each of its pages faults, ten times over.
    assert result["plain"] >= 9 * pages
    # With it the blocks come from the heap, already in memory.
    assert result["kept"] < pages // 10
