"""Round trip of `BwrapSandbox.exec(["/bin/true"])` beside bare bwrap, and warm pool acquire.

Prints ONE JSON line. The bare baseline spawns the very command line the sandbox uses
(`prlimit … setpriv … bwrap <same options> -- /bin/true`, from `BwrapSandbox.bwrap_argv`) as a
plain asyncio subprocess and waits for it, without the launcher, status pipe, output capture,
seccomp filter or cgroups; the two are interleaved so that load changes hit both alike. The
ratio of the p50s is the sandbox's overhead (target ≤ 1.3). Warm acquire is `SandboxPool.acquire`
with the pool full (target p50 ≤ 5 ms). The load average and this process's CPU seconds are
reported because on a shared machine wall time alone is noise.

    .venv/bin/python bench/sandbox_bwrap.py [--rounds 200] [--acquires 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from omniloop.sandboxes.bwrap import BwrapSandbox, create_bwrap_sandbox
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.pool import SandboxPool


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50": round(statistics.median(ms), 3), "p99": round(p99, 3)}


async def _exec_vs_bare(rounds: int) -> tuple[list[float], list[float]]:
    sandbox = await create_bwrap_sandbox(SandboxConfig(backend="bwrap"))
    argv = sandbox.bwrap_argv(["/bin/true"])
    ours: list[float] = []
    bare: list[float] = []
    try:
        for i in range(rounds + 10):
            started = time.perf_counter()
            result = await sandbox.exec(["/bin/true"])
            elapsed = time.perf_counter() - started
            if not result.ok:
                raise RuntimeError(f"/bin/true failed in the sandbox: {result}")
            started_bare = time.perf_counter()
            process = await asyncio.create_subprocess_exec(*argv, env={"PATH": "/usr/bin:/bin"})
            if await process.wait() != 0:
                raise RuntimeError("bare bwrap failed")
            elapsed_bare = time.perf_counter() - started_bare
            if i >= 10:  # warm-up: page cache, first launcher wake-ups
                ours.append(elapsed)
                bare.append(elapsed_bare)
    finally:
        await sandbox.close()
    return ours, bare


async def _warm_acquires(count: int) -> list[float]:
    config = SandboxConfig(backend="bwrap")
    times: list[float] = []
    pool: SandboxPool[BwrapSandbox] = SandboxPool(lambda: create_bwrap_sandbox(config), size=2)
    async with pool:
        for _ in range(count):
            await pool.start(wait=True)  # refilled: the next acquire is a warm one
            started = time.perf_counter()
            sandbox = await pool.acquire()
            times.append(time.perf_counter() - started)
            await pool.release(sandbox)
    return times


async def main(rounds: int, acquires: int) -> dict[str, object]:
    cpu, wall = time.process_time(), time.perf_counter()
    load = os.getloadavg()[0]
    ours, bare = await _exec_vs_bare(rounds)
    acquire = await _warm_acquires(acquires)
    exec_ms, bare_ms = _summary(ours), _summary(bare)
    return {
        "bench": "sandbox_bwrap",
        "exec_true_ms": exec_ms,
        "bare_bwrap_true_ms": bare_ms,
        "ratio_p50": round(exec_ms["p50"] / bare_ms["p50"], 3),
        "ratio_p99": round(exec_ms["p99"] / bare_ms["p99"], 3),
        "warm_acquire_ms": _summary(acquire),
        "targets": {"ratio_p50": 1.3, "warm_acquire_p50_ms": 5.0},
        "rounds": rounds,
        "acquires": acquires,
        "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "bench_cpu_s": round(time.process_time() - cpu, 2),
        "wall_s": round(time.perf_counter() - wall, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--acquires", type=int, default=40)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.rounds, args.acquires))))
