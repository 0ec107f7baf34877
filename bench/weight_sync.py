"""Weight-sync seconds and GB/s by gloo broadcast, by HTTP buckets (tcp) and by disk, beside
raw loopback TCP, for 1, 2 and 4 engines; then syncs under load.

Prints ONE JSON line. The weights of `--model` (SmolLM2: 134.5M parameters, ~0.54 GB fp32) are
published to `--engines` local `omniloop engine serve` subprocesses (the largest count is
started once; each count uses the first engines) with `DistributedWeightSync` (gloo broadcast
in `--bucket-mb` buckets + `/update_weights_from_distributed`; `distributed`, the default:
one broadcast per tensor, which the engines, paused in place, receive straight into their
models; `distributed_flattened`: each bucket one uint8 broadcast), `TcpWeightSync` (the engines
fetch checksummed buckets from the bench's bucket server, `/update_weights_from_tcp`) and
`DiskWeightSync` (safetensors folder + `/update_weights_from_disk`). Each is warmed up once
(the distributed warm-up also builds the process group, reported as `distributed_connect_s`),
then measured `--repeats` times; the rounds interleave the methods with a loopback measurement
(one TCP connection on 127.0.0.1 carrying the model's bytes once, sender and receiver on two
threads, receive buffer pre-touched), so changing machine load hits all alike. Times are
medians over the rounds. A sync's time runs from `publish` to every engine having answered
(weights copied in, version set), so it includes the engines' copy into their models, not only
the transfer; `*_gbps` is the model's bytes over that time (each engine receives all of them,
so with N engines N times as many bytes moved). The top-level keys are those of the smallest
engine count (`tcp_gbps`, `distributed_gbps`, `*_vs_loopback`); `by_engines` has every count.
CPU seconds of this process and of the engines, and the load average, are reported because
on a shared machine wall time alone is noise.

Then, under load, on one engine: `--lanes` requests keep generating (64 tokens each, sampled,
one after another per lane) while the trainer publishes `--load-syncs` times by gloo in each
`update_mode`, and by tcp in place. `stall_ms` (`tcp_stall_ms`) is the median time generation
stood still per in-place sync (from every engine paused to every engine continued, as the
trainer saw it: the load and two HTTP round trips); `drain_publish_s` the median publish time
in drain mode, which waits for the running requests first; `aborted_requests` counts requests
that ended `abort`, in every mode (the invariant is 0); `mid_response_updates` counts
responses sampled by two versions (proof that in-place updates landed while requests decoded).

    .venv/bin/python bench/weight_sync.py [--model smollm2] [--engines 1,2,4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def start_engine(model: str, threads: int) -> tuple[subprocess.Popen[str], str]:
    exe = Path(sys.executable).parent / "omniloop"
    cmd = [
        str(exe), "engine", "serve", "--model", model, "--port", "0",
        "--threads", str(threads), "--max-batch", "4", "--max-context", "512",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "engine ready at " in line:
            url = line.split("ready at ", 1)[1].split()[0]
            # Keep draining the pipe so the engine never blocks on a full one.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, url
    raise RuntimeError("engine exited before it was ready:\n" + "".join(lines))


def loopback_seconds(nbytes: int, chunk: int = 4 << 20) -> float:
    """Seconds to carry `nbytes` over one loopback TCP connection (sender and receiver threads)."""
    payload = memoryview(bytearray(nbytes))
    sink = bytearray(nbytes)
    sink[::4096] = b"\x01" * len(sink[::4096])  # touch every page before timing
    view = memoryview(sink)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    with sender, receiver:

        def receive() -> None:
            got = 0
            while got < nbytes:
                n = receiver.recv_into(view[got:], min(chunk, nbytes - got))
                if n == 0:
                    raise ConnectionError("loopback sender closed early")
                got += n

        thread = threading.Thread(target=receive)
        start = time.perf_counter()
        thread.start()
        sender.sendall(payload)
        thread.join()
        return time.perf_counter() - start


def load_weights(model: str) -> list[tuple[str, torch.Tensor]]:
    """The model folder's tensors under their HF names (each tied tensor once, as saved)."""
    from omniloop.inference.llama import read_safetensors
    from omniloop.inference.models import resolve_model

    state = read_safetensors(resolve_model(model))
    return [(n, t) for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")]


async def under_load(
    url: str, named: list[tuple[str, torch.Tensor]], version: int, args: argparse.Namespace
) -> tuple[dict[str, Any], int]:
    """Publish `args.load_syncs` times per update mode while `args.lanes` requests generate."""
    from omniloop.inference.base import GenerateOutput, SamplingParams
    from omniloop.inference.client import EngineClient
    from omniloop.platform.dcs import WeightSync
    from omniloop.platform.dcs.distributed import DistributedWeightSync
    from omniloop.platform.dcs.tcp import TcpWeightSync

    results: dict[str, Any] = {}
    async with EngineClient(url, timeout=600) as client:
        for key, mode in (
            ("in_place", "in_place"),
            ("drain", "drain"),
            ("tcp_in_place", "in_place"),
        ):
            sync: WeightSync = (
                TcpWeightSync([url], bucket_mb=args.bucket_mb, timeout_s=600, update_mode=mode)
                if key.startswith("tcp")
                else DistributedWeightSync(
                    [url], bucket_mb=args.bucket_mb, timeout_s=600, update_mode=mode
                )
            )
            outputs: list[GenerateOutput] = []
            stop = asyncio.Event()

            async def lane(
                i: int, outputs: list[GenerateOutput] = outputs, stop: asyncio.Event = stop
            ) -> None:
                seed = i * 100_000
                while not stop.is_set():
                    seed += 1
                    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, seed=seed)
                    outputs.append(await client.generate([1, 504, 2114, 282, 4649 + i], sampling))

            version += 1
            await sync.publish(named, version)  # builds the process group
            lanes = [asyncio.create_task(lane(i)) for i in range(args.lanes)]
            paused: list[float] = []
            publish: list[float] = []
            try:
                await asyncio.sleep(1.0)
                for _ in range(args.load_syncs):
                    version += 1
                    metrics = await sync.publish(named, version)
                    publish.append(metrics["weight_sync/seconds"])
                    paused.append(metrics.get("weight_sync/paused_seconds", 0.0))
                    await asyncio.sleep(0.2)
            finally:
                stop.set()
                await asyncio.gather(*lanes, return_exceptions=True)
                await sync.close()
            results[key] = {
                "publish_s": round(statistics.median(publish), 4),
                "paused_ms": round(1000 * statistics.median(paused), 1),
                "responses": len(outputs),
                "aborted": sum(o.finish_reason == "abort" for o in outputs),
                "mid_response_updates": sum(len(set(o.weight_versions)) > 1 for o in outputs),
            }
    return results, version


async def measure(
    urls: list[str],
    procs: list[subprocess.Popen[str]],
    named: list[tuple[str, torch.Tensor]],
    version: int,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], int]:
    """Every method's publish to the engines at `urls`, `args.repeats` rounds interleaved with
    a loopback measurement; medians."""
    from omniloop.inference.client import EngineClient
    from omniloop.inference.models import resolve_model
    from omniloop.platform.dcs import WeightSync
    from omniloop.platform.dcs.disk import DiskWeightSync
    from omniloop.platform.dcs.distributed import DistributedWeightSync
    from omniloop.platform.dcs.tcp import TcpWeightSync

    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    staging = Path(tempfile.mkdtemp(prefix="omniloop-bench-weights-"))
    syncs: dict[str, WeightSync] = {
        "distributed": DistributedWeightSync(urls, bucket_mb=args.bucket_mb, timeout_s=600),
        "distributed_flattened": DistributedWeightSync(
            urls, bucket_mb=args.bucket_mb, flattened=True, timeout_s=600
        ),
        "tcp": TcpWeightSync(urls, bucket_mb=args.bucket_mb, timeout_s=600),
        "disk": DiskWeightSync(urls, staging, model_dir=resolve_model(args.model), timeout_s=600),
    }
    times: dict[str, list[float]] = {"loopback": [], **{name: [] for name in syncs}}
    cpu_bench = dict.fromkeys(syncs, 0.0)
    cpu_engines = dict.fromkeys(syncs, 0.0)
    extra: dict[str, list[float]] = {"disk_save": [], "disk_load": [], "tcp_pack": []}
    try:
        for name, sync in syncs.items():
            version += 1
            warm = await sync.publish(named, version)
            if name == "distributed":
                connect = warm["weight_sync/connect_seconds"]
                buckets = warm["weight_sync/buckets"]
        for _ in range(args.repeats):
            times["loopback"].append(loopback_seconds(nbytes))
            for name, sync in syncs.items():
                version += 1
                cpu0, eng0 = time.process_time(), sum(cpu_seconds_of(p.pid) for p in procs)
                metrics = await sync.publish(named, version)
                cpu_bench[name] += time.process_time() - cpu0
                cpu_engines[name] += sum(cpu_seconds_of(p.pid) for p in procs) - eng0
                times[name].append(metrics["weight_sync/seconds"])
                if name == "disk":
                    extra["disk_save"].append(metrics["weight_sync/save_seconds"])
                    extra["disk_load"].append(metrics["weight_sync/load_seconds"])
                if name == "tcp":
                    extra["tcp_pack"].append(metrics["weight_sync/pack_seconds"])
        for url in urls:
            async with EngineClient(url) as client:
                served = await client.get_weight_version()
            if served != version:
                raise RuntimeError(f"engine {url} serves version {served}, expected {version}")
    finally:
        for sync in syncs.values():
            await sync.close()
        shutil.rmtree(staging, ignore_errors=True)

    median = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in median.items()}
    out: dict[str, Any] = {"engines": len(urls), "buckets": int(buckets)}
    for name in syncs:
        out[f"{name}_s"] = round(median[name], 4)
        out[f"{name}_gbps"] = round(gbps[name], 3)
    out |= {
        "disk_save_s": round(statistics.median(extra["disk_save"]), 4),
        "disk_load_s": round(statistics.median(extra["disk_load"]), 4),
        "tcp_pack_s": round(statistics.median(extra["tcp_pack"]), 4),
        "distributed_connect_s": round(connect, 4),
        "loopback_s": round(median["loopback"], 4),
        "loopback_gbps": round(gbps["loopback"], 3),
        "distributed_vs_loopback": round(gbps["distributed"] / gbps["loopback"], 3),
        "distributed_flattened_vs_loopback": round(
            gbps["distributed_flattened"] / gbps["loopback"], 3
        ),
        "tcp_vs_loopback": round(gbps["tcp"] / gbps["loopback"], 3),
        "runs_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "cpu_s_per_sync": {
            k: {
                "bench": round(cpu_bench[k] / args.repeats, 3),
                "engines": round(cpu_engines[k] / args.repeats, 3),
            }
            for k in syncs
        },
    }
    return out, version


async def run(args: argparse.Namespace) -> dict[str, Any]:
    named = load_weights(args.model)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    load_start = os.getloadavg()
    counts = sorted({int(n) for n in args.engines.split(",")})
    started = [start_engine(args.model, args.threads) for _ in range(max(counts))]
    procs = [proc for proc, _ in started]
    urls = [url for _, url in started]
    version = 0
    by_engines: dict[str, dict[str, Any]] = {}
    try:
        for n in counts:
            by_engines[str(n)], version = await measure(urls[:n], procs[:n], named, version, args)
        loaded, version = await under_load(urls[0], named, version, args)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)

    one = by_engines[str(counts[0])]
    return {
        "bench": "weight_sync",
        "model": args.model,
        "bytes": nbytes,
        "tensors": len(named),
        "engines": counts,
        "repeats": args.repeats,
        "bucket_mb": args.bucket_mb,
        **{k: v for k, v in one.items() if k not in ("engines", "runs_s", "cpu_s_per_sync")},
        "by_engines": by_engines,
        "stall_ms": loaded["in_place"]["paused_ms"],
        "tcp_stall_ms": loaded["tcp_in_place"]["paused_ms"],
        "drain_publish_s": loaded["drain"]["publish_s"],
        "aborted_requests": sum(row["aborted"] for row in loaded.values()),
        "under_load": {"lanes": args.lanes, "syncs_per_mode": args.load_syncs, **loaded},
        "threads": args.threads,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both processes")
    parser.add_argument("--lanes", type=int, default=4, help="requests generating under load")
    parser.add_argument("--load-syncs", type=int, default=10, help="publishes per mode under load")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
