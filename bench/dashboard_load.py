"""Time to interactive of the dashboard's run page with 10,000 episodes and a long metric history.

Seeds a SQLite store (one run, `--episodes` episodes with mixed statuses, stop reasons and error
types, `--steps` steps of a dozen metrics), serves the API with the dashboard under uvicorn on
loopback, and loads `/#/runs/ID` in headless Chromium. Time to interactive is when both the
charts and the first page of episodes have rendered (the page's `charts-rendered` and
`episodes-rendered` performance marks, from navigation start). The first load is cold (empty
browser cache); the median is over `--loads` further reloads. Prints one JSON line.

    .venv/bin/python bench/dashboard_load.py [--episodes 10000] [--steps 1000] [--loads 5]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import uvicorn
from sqlalchemy import insert
from sqlalchemy.orm import Session

from omniloop.platform.api import ApiSettings, create_app
from omniloop.platform.store import Store
from omniloop.platform.store.models import EpisodeRow
from omniloop.processes import free_port
from omniloop.web import routes

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TARGET_SECONDS = 1.0
METRICS = [
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "actor/kl",
    "actor/entropy",
    "staleness/max",
    "staleness/mean",
    "perf/tokens_per_second",
    "perf/step_seconds",
    "sandbox/exec_latency_p50",
    "sandbox/exec_latency_p99",
    "episodes/errors",
]
OUTCOMES: list[tuple[str, str | None, str | None]] = [
    ("completed", "stop", None),
    ("completed", "length", None),
    ("completed", "max_turns", None),
    ("failed", "sandbox_error", "SandboxError"),
    ("failed", "engine_error", "EngineError"),
    ("cancelled", "cancelled", None),
]


def seed(store: Store, run_id: str, episodes: int, steps: int) -> None:
    """One run with `steps` steps of `METRICS` and `episodes` finished episodes."""
    rng = random.Random(0)
    store.create_run("bench run", {"model": "tiny", "steps": steps}, run_id=run_id)
    store.update_run_status(run_id, "running")
    for step in range(steps):
        x = step / max(steps - 1, 1)
        store.record_metrics(
            run_id,
            step,
            {name: math.sin(x * 6 + i) + x + rng.random() * 0.1 for i, name in enumerate(METRICS)},
        )
    start = datetime.now(UTC) - timedelta(hours=1)
    rows: list[dict[str, Any]] = []
    for n in range(episodes):
        status, stop_reason, error_type = OUTCOMES[n % len(OUTCOMES)]
        created = start + timedelta(milliseconds=n * 300)
        rows.append(
            {
                "id": uuid.uuid4().hex,
                "run_id": run_id,
                "status": status,
                "task": {"id": f"task-{n}", "prompt": f"What is {n} + {n}?"},
                "agent": "calc",
                "sampling": {},
                "reward": rng.random() if status == "completed" else None,
                "reward_info": {"correct": 1.0, "format": 0.5} if status == "completed" else {},
                "stop_reason": stop_reason,
                "error_type": error_type,
                "error_message": f"{error_type} in episode {n}" if error_type else None,
                "timings": {"total": rng.random() * 5},
                "num_turns": rng.randint(1, 6),
                "response_length": rng.randint(10, 900),
                "trajectory_id": None,
                "idempotency_key": None,
                "request_hash": None,
                "created_at": created,
                "updated_at": created,
                "started_at": created,
                "finished_at": created + timedelta(seconds=2),
            }
        )
    with Session(store.engine) as session, session.begin():
        session.execute(insert(EpisodeRow), rows)


def load_times(url: str, loads: int) -> tuple[float, list[float]]:
    """Seconds to interactive of a cold load, then of `loads` reloads."""
    from playwright.sync_api import sync_playwright

    script = """() => {
        const mark = (n) => performance.getEntriesByName(n)[0]?.startTime;
        return Math.max(mark("charts-rendered"), mark("episodes-rendered")) / 1000;
    }"""
    times: list[float] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for _ in range(loads + 1):
                page.goto("about:blank")
                page.goto(url)
                page.wait_for_selector("[data-charts][data-ready=true]", timeout=30_000)
                page.wait_for_selector(
                    "[data-episodes] tbody tr[data-episode] >> nth=49", timeout=30_000
                )
                times.append(float(page.evaluate(script)))
        finally:
            browser.close()
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=1_000)
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dashboard-bench-") as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        store = Store(db_url)
        store.migrate()
        began = time.perf_counter()
        seed(store, "bench", args.episodes, args.steps)
        seed_seconds = time.perf_counter() - began
        settings = ApiSettings.model_validate(
            {"db_url": db_url, "api_token": None, "concurrency": 0, "agents": {}}
        )
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(settings, store=store, extra_routes=routes()),
                host="127.0.0.1",
                port=port,
                log_level="warning",
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                if not thread.is_alive():
                    raise RuntimeError("uvicorn stopped before it started")
                time.sleep(0.02)
            cold, warm = load_times(f"http://127.0.0.1:{port}/#/runs/bench", args.loads)
        finally:
            server.should_exit = True
            thread.join(timeout=15)
            store.close()
    median = statistics.median(warm) if warm else cold
    print(
        json.dumps(
            {
                "bench": "dashboard_load",
                "episodes": args.episodes,
                "metric_steps": args.steps,
                "metric_names": len(METRICS),
                "tti_cold_s": round(cold, 3),
                "tti_median_s": round(median, 3),
                "tti_max_s": round(max(warm), 3) if warm else None,
                "loads": len(warm),
                "target_s": TARGET_SECONDS,
                "ok": max(cold, median) < TARGET_SECONDS,
                "seed_s": round(seed_seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
