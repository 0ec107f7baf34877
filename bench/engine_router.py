"""What `EngineRouter` spends choosing the engine of a new session, by sessions remembered.

A rollout's router remembers the engine of up to `MAX_SESSIONS` sessions (one per episode) and
sends a new session to the engine with the fewest requests in flight, then the fewest
remembered sessions. This times that choice (`_pick` of a new session key, no request sent)
over two engines after `--sessions` earlier sessions, for each count given. A run remembers
one session per episode it has run: 100,000 is 3,125 steps of 32 episodes.

Prints ONE JSON line: `pick_us` (sessions remembered -> microseconds per new session's pick,
the mean of `--picks`) and the Python version.

    .venv/bin/python bench/engine_router.py [--sessions 1000 10000 100000] [--picks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time

from omniloop.inference.router import EngineRouter


async def pick_seconds(remembered: int, picks: int) -> float:
    """Mean seconds of a new session's pick after `remembered` sessions."""
    router = EngineRouter.over(["http://engine-a", "http://engine-b"])
    for i in range(remembered):
        await router._pick(f"earlier-{i}")
    started = time.perf_counter()
    for i in range(picks):
        await router._pick(f"new-{i}")
    return (time.perf_counter() - started) / picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--picks", type=int, default=2_000)
    args = parser.parse_args()
    costs = {n: asyncio.run(pick_seconds(n, args.picks)) for n in args.sessions}
    print(
        json.dumps(
            {
                "bench": "engine_router",
                "pick_us": {str(n): round(s * 1e6, 2) for n, s in costs.items()},
                "picks": args.picks,
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
