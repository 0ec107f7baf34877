"""Trajectories per second through the data plane (TransferQueue on a private Ray instance).

Prints ONE JSON line. One process starts the queue and reads as the trainer does; a second
client attached to the same queue writes as the rollout and reward roles do. Per round: the
writer puts `--trajectories` trajectories of `--tokens` tokens (rollout fields in `--put-size`
puts, then their rewards), closes the step, and the reader streams the step back in
`--micro-batch` micro-batches with every field the actor reads. Reported, as medians over
`--rounds` rounds after one warm-up round: seconds to put the step, seconds to read it, and
trajectories and MiB per second end to end (put + read, the data the trainer receives), and
the size of the reader's consumed-id record (`consumed_state`, what each checkpoint saves) once
every round's step was trained and cleared, in bytes of JSON. Then what a long run leaves in
the queue: `--growth-steps` small steps (4 rows) each written, closed, read and cleared, first
as they were before `forget_cleared` existed, then with it called as the actor's checkpoints
call it (every 10 steps, for the steps before the previous checkpoint): the queue controller's
resident memory per 1,000 steps and the time of a partition listing (which readers, `reread`
and `reopen_cleared` make) at the end of each.

    .venv/bin/python bench/data_plane.py [--trajectories 256] [--tokens 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import psutil

from omniloop.platform.data import DataPlane, DataPlaneConfig
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta

FIELDS = ["input_ids", "loss_mask", "rollout_logprobs", "weight_version", "meta", "reward"]


def make_trajectory(index: int, tokens: int) -> Trajectory:
    """A four-turn trajectory of `tokens` tokens, half of them sampled."""
    prompt = tokens // 8
    builder = TrajectoryBuilder([1 + (index + j) % 1000 for j in range(prompt)])
    per_turn = (tokens - prompt) // 8
    for turn in range(4):
        sampled = [100 + (index * 7 + turn + j) % 30000 for j in range(per_turn)]
        builder.add_sampled(sampled, [-0.5] * per_turn, version=0)
        builder.add_observation([200 + j % 50 for j in range(per_turn)])
    meta = TrajectoryMeta(run_id="bench", episode_id=f"ep{index}", stop_reason="stop")
    return builder.build(meta)


async def one_round(
    reader: DataPlane, writer: DataPlane, step: int, trajectories: list[Trajectory], args: Any
) -> tuple[float, float]:
    started = time.perf_counter()
    ids: list[str] = []
    for start in range(0, len(trajectories), args.put_size):
        ids += await writer.put_rollout(step, trajectories[start : start + args.put_size])
    await writer.put_field(step, ids, "reward", [1.0] * len(ids))
    await writer.close_partition(step)
    put = time.perf_counter() - started
    rows = 0
    async for batch in reader.iter_micro_batches(step, FIELDS, args.micro_batch, timeout_s=60):
        rows += len(batch)
    read = time.perf_counter() - started - put
    assert rows == len(trajectories), f"read {rows} of {len(trajectories)} rows"
    await reader.clear(step)
    return put, read


async def measure(args: Any) -> dict[str, Any]:
    trajectories = [make_trajectory(i, args.tokens) for i in range(args.trajectories)]
    tokens = sum(len(t.input_ids) for t in trajectories)
    # int64 ids + int64 mask + fp32 logprobs + int64 versions per token.
    mib = tokens * (8 + 8 + 4 + 8) / 2**20
    temp = tempfile.mkdtemp(prefix="omniloop-bench-ray-", dir="/tmp")
    reader = DataPlane.start(
        DataPlaneConfig(ray_temp_dir=temp, min_poll_interval_s=0.005, max_poll_interval_s=0.02)
    )
    writer = DataPlane.start()
    try:
        await one_round(reader, writer, 0, trajectories, args)  # warm-up
        rounds = [
            await one_round(reader, writer, step, trajectories, args)
            for step in range(1, args.rounds + 1)
        ]
        record_bytes = len(json.dumps(reader.consumed_state()))
        growth = {
            mode: await queue_growth(reader, writer, start, args.growth_steps, forget)
            for mode, start, forget in (
                ("kept", 1_000_000, False),
                ("forgotten", 2_000_000, True),
            )
        }
    finally:
        writer.close()
        reader.close()
        shutil.rmtree(temp, ignore_errors=True)
    put = statistics.median(p for p, _ in rounds)
    read = statistics.median(r for _, r in rounds)
    total = statistics.median(p + r for p, r in rounds)
    return {
        "bench": "data_plane",
        "trajectories": args.trajectories,
        "tokens_per_trajectory": tokens // args.trajectories,
        "put_size": args.put_size,
        "micro_batch": args.micro_batch,
        "put_s": round(put, 3),
        "read_s": round(read, 3),
        "trajectories_per_s": round(args.trajectories / total, 1),
        "mib_per_s": round(mib / total, 1),
        "consumed_state_bytes": record_bytes,
        "growth_steps": args.growth_steps,
        "controller_mb_per_1000_steps": {m: g[0] for m, g in growth.items()},
        "partition_list_ms": {m: g[1] for m, g in growth.items()},
        "rounds": args.rounds,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


async def queue_growth(
    reader: DataPlane, writer: DataPlane, start: int, steps: int, forget: bool
) -> tuple[float, float]:
    """Controller MB per 1,000 steps and one partition listing's ms after `steps` steps."""
    rows = [make_trajectory(i, 64) for i in range(4)]
    before = _controller_rss_mb()
    for step in range(start, start + steps):
        await writer.put_rollout(step, rows)
        await writer.close_partition(step)
        async for _ in reader.iter_micro_batches(step, ["input_ids"], 4, timeout_s=60):
            pass
        await reader.clear(step)
        if forget and (step + 1) % 10 == 0:
            await reader.forget_cleared(step + 1 - 10)
    grown = (_controller_rss_mb() - before) * 1000 / steps
    started = time.perf_counter()
    for _ in range(20):
        await reader._client.async_get_partition_list()
    return round(grown, 2), round((time.perf_counter() - started) / 20 * 1000, 2)


def _controller_rss_mb() -> float:
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[0].startswith("ray::TransferQueueController"):
            return float(proc.memory_info().rss) / 2**20
    raise RuntimeError("no TransferQueue controller process found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--put-size", type=int, default=8, help="trajectories per put")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--growth-steps", type=int, default=3000)
    print(json.dumps(asyncio.run(measure(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
