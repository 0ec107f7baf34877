"""Episode submissions per second and their latency against a real `omniloop serve`.

Prints ONE JSON line. The server is `omniloop serve` in its own process, on loopback, with a
SQLite store in a temporary folder and its episode worker paused (`concurrency=0`): every
accepted `POST /v1/episodes` is a real insert (episode row + status event, one write
transaction) and the episode just queues, so the benchmark measures the API and the store, not
the model. 64 clients each hold one keep-alive HTTP/1.1 connection and submit distinct
episodes.

Two phases, because with a fixed number of clients that wait for their answers, latency is
concurrency / throughput (Little's law) whatever the server does:
- `saturated`: every client submits as fast as it is answered (closed loop): the most
  submissions per second the server accepts, and the latency at that load.
- `paced`: the 64 clients together offer `--rate` submissions per second on a fixed schedule
  (open loop; latency counts from the scheduled send, so a stall is not hidden): the latency
  at the target load. Targets: ≥ 500/s accepted with p99 < 50 ms.

The load generator speaks raw HTTP/1.1 over asyncio streams (a few microseconds of client CPU
per request), since it shares the machine's cores with the server. The load average and both
processes' CPU seconds are reported because on a shared machine wall time alone is noise.

    .venv/bin/python bench/api_load.py [--clients 64] [--seconds 10] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "examples" / "calculator" / "agent.py"


def _summary(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50_ms": round(statistics.median(ms), 2), "p99_ms": round(p99, 2)}


def start_server(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`omniloop serve` on a free loopback port with a paused worker; returns it and its URL."""
    log = folder / "serve.log"
    cmd = [
        sys.executable, "-m", "omniloop", "serve", "--port", "0", "--log-level", "warning",
        "--db-url", f"sqlite:///{folder / 'bench.db'}",
        "concurrency=0", f"agents.calc.agent={AGENT}:build_agent",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMNILOOP_API_TOKEN"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while True:
        text = log.read_text()
        if "omniloop api ready at " in text:
            return proc, text.split("omniloop api ready at ", 1)[1].split()[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"omniloop serve did not start:\n{text}")
        time.sleep(0.05)


class Connection:
    """One keep-alive HTTP/1.1 connection that sends POSTs and reads whole responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def post(self, host: str, path: str, body: bytes) -> int:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    def close(self) -> None:
        self.writer.close()


def episode_body(client: int, number: int) -> bytes:
    return json.dumps(
        {
            "agent": "calc",
            "task": {"prompt": f"What is {client} + {number}?", "answer": str(client + number)},
            "sampling": {"temperature": 0.7},
        }
    ).encode()


async def saturated(url: str, clients: int, seconds: float) -> dict[str, float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connections = [await Connection.open(host, int(port)) for _ in range(clients)]
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def client(index: int, connection: Connection) -> None:
        nonlocal errors
        number = 0
        while time.perf_counter() < stop_at:
            body = episode_body(index, number)
            number += 1
            started = time.perf_counter()
            status = await connection.post(host, "/v1/episodes", body)
            latencies.append(time.perf_counter() - started)
            errors += status != 202

    started = time.perf_counter()
    await asyncio.gather(*(client(i, c) for i, c in enumerate(connections)))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    accepted = len(latencies) - errors
    return {"accepted_per_s": round(accepted / elapsed, 1), "requests": len(latencies),
            "errors": errors, **_summary(latencies)}  # fmt: skip


async def paced(url: str, clients: int, seconds: float, rate: float) -> dict[str, float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connections = [await Connection.open(host, int(port)) for _ in range(clients)]
    latencies: list[float] = []
    errors = 0
    interval = clients / rate  # each client's share of the schedule
    begin = time.perf_counter() + 0.1
    total = int(rate * seconds)

    async def client(index: int, connection: Connection) -> None:
        nonlocal errors
        # Client i sends at begin + (i / clients + k) * interval: the offers interleave evenly.
        for k in range(total // clients):
            due = begin + (index / clients + k) * interval
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            status = await connection.post(host, "/v1/episodes", episode_body(index, k))
            latencies.append(time.perf_counter() - due)
            errors += status != 202

    await asyncio.gather(*(client(i, c) for i, c in enumerate(connections)))
    elapsed = time.perf_counter() - begin
    for connection in connections:
        connection.close()
    accepted = len(latencies) - errors
    return {"target_per_s": rate, "accepted_per_s": round(accepted / elapsed, 1),
            "requests": len(latencies), "errors": errors, **_summary(latencies)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="omniloop-api-bench-") as tmp:
        proc, url = start_server(Path(tmp))
        server = psutil.Process(proc.pid)
        try:
            # Warm-up: imports, first connections, SQLite page cache.
            await saturated(url, args.clients, 1.0)
            cpu_before = server.cpu_times()
            own_before = resource.getrusage(resource.RUSAGE_SELF)
            load = os.getloadavg()[0]
            top = await saturated(url, args.clients, args.seconds)
            steady = await paced(url, args.clients, args.seconds, args.rate)
            cpu_after = server.cpu_times()
            own_after = resource.getrusage(resource.RUSAGE_SELF)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    server_cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    client_cpu = (own_after.ru_utime + own_after.ru_stime) - (
        own_before.ru_utime + own_before.ru_stime
    )
    return {
        "bench": "api_load",
        "clients": args.clients,
        "seconds_per_phase": args.seconds,
        "saturated": top,
        "paced": steady,
        "server_cpu_s": round(server_cpu, 2),
        "client_cpu_s": round(client_cpu, 2),
        "load_avg_1m": round(load, 2),
        "cpus": os.cpu_count(),
        "store": "sqlite",
        "worker": "paused",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=500.0)
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
