"""The dashboard in headless Chromium against the real server.

An episode submitted over REST is watched to completion on the page and inspected in the
trajectory viewer; a seeded run's page shows grouped charts that update live and an episode
browser that filters and pages through the API; the runs list shows each run's progress,
reward trend, errors and duration; charts never mix units on one axis.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from playwright.sync_api import Page, expect
from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from omniloop.inference.models import load_tokenizer
from omniloop.platform.store.models import EpisodeRow, RunRow
from omniloop.web.dashboard import token_pieces

COMPLETE_MS = 60_000


def test_submitted_episode_completes_on_the_page(
    page: Page, dashboard: Any, screenshot: Any
) -> None:
    body = {"agent": "calc", "task": {"prompt": "What is 6 * 7?", "answer": "42"}}
    accepted = httpx.post(f"{dashboard.url}/v1/episodes", json=body, timeout=30)
    assert accepted.status_code == 202, accepted.text
    episode_id = accepted.json()["id"]

    # The viewer follows the episode's event stream until it is completed, then shows it all.
    page.goto(f"{dashboard.url}/#/episodes/{episode_id}")
    app = page.locator("#app")
    expect(app).to_have_attribute("data-status", "completed", timeout=COMPLETE_MS)
    expect(page.locator(".page-head .badge")).to_have_text("completed")
    episode = httpx.get(f"{dashboard.url}/v1/episodes/{episode_id}", timeout=30).json()
    trajectory = episode["trajectory"]
    mask: list[int] = trajectory["loss_mask"]
    prompt_length: int = trajectory["prompt_length"]

    # The loss mask overlay: one span per token, sampled tokens marked, the prompt dimmed.
    tokens = page.locator(".token-view .tokens .tok")
    expect(tokens).to_have_count(len(trajectory["input_ids"]))
    expect(page.locator(".token-view .tokens .tok.s")).to_have_count(sum(mask))
    expect(page.locator(".token-view .tokens .tok.p")).to_have_count(prompt_length)
    observed = len(mask) - prompt_length - sum(mask)
    expect(page.locator(".token-view .tokens .tok.o")).to_have_count(observed)
    first_sampled = mask.index(1)
    span = page.locator(f'.token-view .tok[data-i="{first_sampled}"]')
    expect(span).to_have_class(re.compile(r"\bs\b"))
    logprob = trajectory["rollout_logprobs"][first_sampled]
    expect(span).to_have_attribute("title", re.compile(rf"logprob {logprob:.4f}"))
    # The spans read as the decoded sequence.
    tokenizer = load_tokenizer("tiny")
    shown = "".join(tokens.all_text_contents())
    assert shown == tokenizer.decode(trajectory["input_ids"], skip_special_tokens=False)

    # Turns, the tool call with its result, and the reward breakdown.
    expect(page.locator(".turn h3", has_text="Turn 1")).to_be_visible()
    call = page.locator('.tool-call[data-tool="python"]').first
    expect(call).to_be_visible()
    expect(call.locator(".tool-args")).to_contain_text("print(6 * 7)")
    expect(call.locator("[data-tool-output]")).to_have_text(re.compile(r"^\s*42\s*$"))
    expect(page.locator("[data-reward]")).to_have_attribute("data-reward", "1.5")
    expect(page.locator('[data-component="printed_42"]')).to_contain_text("1")
    expect(page.locator('[data-component="called_a_tool"]')).to_contain_text("0.5")
    screenshot(page, "trajectory")

    # The episode browser lists it as completed and links to the viewer.
    page.goto(f"{dashboard.url}/#/episodes")
    row = page.locator(f'tr[data-episode="{episode_id}"]')
    expect(row).to_have_attribute("data-status", "completed")
    expect(row).to_contain_text("stop")
    screenshot(page, "episodes")
    row.locator("a").click()
    expect(page).to_have_url(re.compile(rf"#/episodes/{episode_id}$"))
    expect(page.locator('.tool-call[data-tool="python"]').first).to_be_visible()


OUTCOMES = [
    ("completed", "stop", None),
    ("completed", "length", None),
    ("failed", "sandbox_error", "SandboxError"),
    ("failed", "engine_error", "EngineError"),
    ("cancelled", "cancelled", None),
]


def _seed_run(dashboard: Any, run_id: str, episodes: int, steps: int) -> None:
    store = dashboard.store()
    try:
        store.create_run("seeded run", {"model": "tiny"}, run_id=run_id, status="running")
        for step in range(steps):
            store.record_metrics(
                run_id,
                step,
                {
                    "reward/mean": step / steps,
                    "response_length/mean": 100.0 + step,
                    "actor/kl": 0.01 * step,
                    "actor/entropy": 2.0 - 0.01 * step,
                    "staleness/max": float(step % 3),
                    "perf/tokens_per_second": 500.0 + 10 * math.sin(step),
                    "sandbox/exec_latency_p50": 0.05,
                    "episodes/errors": float(step % 2),
                },
            )
        start = datetime.now(UTC) - timedelta(hours=1)
        rows = []
        for n in range(episodes):
            status, stop_reason, error_type = OUTCOMES[n % len(OUTCOMES)]
            created = start + timedelta(seconds=n)
            rows.append(
                {
                    "id": f"{run_id}-ep{n:04d}",
                    "run_id": run_id,
                    "status": status,
                    "task": {"id": f"task-{n}", "prompt": f"What is {n} + {n}?"},
                    "agent": "calc",
                    "sampling": {},
                    "reward": 1.0 if status == "completed" else None,
                    "reward_info": {},
                    "stop_reason": stop_reason,
                    "error_type": error_type,
                    "error_message": "boom" if error_type else None,
                    "timings": {},
                    "num_turns": 1,
                    "response_length": 10,
                    "created_at": created,
                    "updated_at": created,
                }
            )
        with Session(store.engine) as session, session.begin():
            session.execute(insert(EpisodeRow), rows)
    finally:
        store.close()


def test_run_page_charts_update_and_episodes_filter_and_page(
    page: Page, dashboard: Any, screenshot: Any
) -> None:
    run_id = "seeded"
    _seed_run(dashboard, run_id, episodes=120, steps=30)

    page.goto(f"{dashboard.url}/#/")
    expect(page.locator(f'tr[data-run="{run_id}"]')).to_contain_text("seeded run")
    page.locator(f'tr[data-run="{run_id}"] a').click()

    # One panel per group of metrics, each a canvas chart with every step.
    charts = page.locator("[data-charts]")
    expect(charts).to_have_attribute("data-ready", "true")
    titles = [
        "Reward",
        "Response length",
        "KL",
        "Entropy",
        "Staleness",
        "Throughput",
        "Sandbox latency",
        "Errors",
    ]
    expect(page.locator(".chart-panel h3")).to_have_text(titles)
    for title in titles:
        panel = page.locator(f'.chart-panel[data-chart="{title}"]')
        expect(panel.locator("canvas")).to_have_count(1)
        expect(panel).to_have_attribute("data-points", "30")

    # The first page of the run's episodes, newest first.
    rows = page.locator("[data-episodes] tbody tr[data-episode]")
    expect(rows).to_have_count(50)
    expect(rows.first).to_have_attribute("data-episode", f"{run_id}-ep0119")
    screenshot(page, "run")

    # Live: a step recorded now shows up without reloading.
    store = dashboard.store()
    try:
        store.record_metrics(run_id, 30, {"reward/mean": 1.0, "actor/kl": 0.5})
    finally:
        store.close()
    expect(page.locator('.chart-panel[data-chart="Reward"]')).to_have_attribute("data-points", "31")
    expect(page.locator('.chart-panel[data-chart="KL"]')).to_have_attribute("data-points", "31")

    # Keyset paging: 50, 50, 20, then no older page; and back.
    older = page.locator('[data-page="older"]')
    older.click()
    expect(rows.first).to_have_attribute("data-episode", f"{run_id}-ep0069")
    expect(rows).to_have_count(50)
    older.click()
    expect(rows).to_have_count(20)
    expect(rows.last).to_have_attribute("data-episode", f"{run_id}-ep0000")
    expect(older).to_be_disabled()
    page.locator('[data-page="newer"]').click()
    expect(rows.first).to_have_attribute("data-episode", f"{run_id}-ep0069")

    # Filters go into the URL and to the API: status, then stop reason, then error type.
    page.select_option("select[name=status]", "failed")
    expect(page).to_have_url(re.compile(r"status=failed"))
    expect(rows).to_have_count(48)
    expect(page.locator('[data-episodes] tbody tr[data-status="failed"]')).to_have_count(48)
    page.select_option("select[name=stop_reason]", "sandbox_error")
    expect(rows).to_have_count(24)
    page.fill("input[name=error_type]", "EngineError")
    page.press("input[name=error_type]", "Enter")
    expect(page.locator("[data-episodes] .empty")).to_have_text("No episodes match.")
    page.select_option("select[name=stop_reason]", "")
    expect(rows).to_have_count(24)
    expect(rows.first).to_contain_text("EngineError")
    screenshot(page, "run-filtered")
    # A filtered URL opens filtered.
    page.reload()
    expect(page.locator("select[name=status]")).to_have_value("failed")
    expect(rows).to_have_count(24)


def test_tokens_endpoint_pieces_join_to_the_text(dashboard: Any) -> None:
    tokenizer = load_tokenizer("tiny")
    text = "naïve café → 42 ✓ 🎉\nend"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)
    missing = httpx.get(f"{dashboard.url}/v1/tokens/no-such-episode", timeout=30)
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


def _episode_row(run_id: str, n: int, stop_reason: str, at: datetime) -> dict[str, Any]:
    failed = stop_reason not in ("stop", "length")
    return {
        "id": f"{run_id}-ep{n:04d}",
        "run_id": run_id,
        "status": "failed" if failed else "completed",
        "task": {"id": f"task-{n}", "prompt": "?"},
        "agent": "calc",
        "sampling": {},
        "reward": None if failed else 1.0,
        "reward_info": {},
        "stop_reason": stop_reason,
        "timings": {},
        "created_at": at,
        "updated_at": at,
    }


STOPPED_EARLY = (
    "stop_when: reward/mean averaged 0.813 over steps 28-30 (at least 0.8); the run ended after "
    "step 30 of 40"
)


def test_runs_list_shows_progress_reward_trend_errors_and_duration(
    page: Page, dashboard: Any, screenshot: Any
) -> None:
    run_id = "glance"
    finished = datetime.now(UTC) - timedelta(minutes=5)
    started = finished - timedelta(hours=1, minutes=2, seconds=3)
    # Seven episodes ended in an infrastructure failure; the seven others did not.
    reasons = ["stop"] * 5 + ["length"] * 2 + ["sandbox_error"] * 3 + ["engine_error"]
    reasons += ["reward_error"] * 2 + ["cancelled"]
    store = dashboard.store()
    try:
        store.create_run("at a glance", {"steps": 40}, run_id=run_id, status="completed")
        store.update_run_status(run_id, "completed", STOPPED_EARLY)
        for step in range(30):
            store.record_metrics(run_id, step, {"reward/mean": 0.2 + step / 50, "kl": 0.1})
        rows = [_episode_row(run_id, n, r, started) for n, r in enumerate(reasons)]
        with Session(store.engine) as session, session.begin():
            session.execute(insert(EpisodeRow), rows)
            session.execute(
                update(RunRow)
                .where(RunRow.id == run_id)
                .values(created_at=started, updated_at=finished, finished_at=finished)
            )
    finally:
        store.close()

    page.goto(f"{dashboard.url}/#/")
    expect(page.locator("[data-runs] thead th")).to_have_text(
        ["run", "id", "status", "steps", "reward", "errors", "duration", "created"]
    )
    row = page.locator(f'tr[data-run="{run_id}"]')
    expect(row).to_contain_text("at a glance")
    expect(row.locator('[data-col="steps"]')).to_have_text("30 / 40")
    expect(row.locator('[data-col="reward"] .reward-now')).to_have_text("0.78")
    spark = row.locator('[data-col="reward"] svg.spark')
    expect(spark).to_have_attribute("data-points", "30")  # at most 32: every step
    expect(spark.locator("path")).to_have_attribute("d", re.compile(r"^M[\d.,]+(L[\d.,]+){29}$"))
    expect(row.locator('[data-col="errors"]')).to_have_text("7")
    expect(row.locator('[data-col="duration"]')).to_have_text("1 h 02 m")
    # Why it ended after 30 of 40 steps: on the status, and under the run page's title.
    expect(row.locator("td", has=page.locator("[data-status]"))).to_have_attribute(
        "title", STOPPED_EARLY
    )
    # What the page shows is what the API says.
    run = httpx.get(f"{dashboard.url}/v1/runs/{run_id}", timeout=30).json()
    assert (run["steps_done"], run["steps_total"], run["infra_errors"]) == (30, 40, 7)
    assert run["status_reason"] == STOPPED_EARLY
    assert run["duration_seconds"] == 3723
    assert [p["step"] for p in run["reward_trend"]] == list(range(30))
    # A run without a planned number of steps shows the steps it has.
    expect(page.locator('tr[data-run="seeded"] [data-col="steps"]')).to_have_text(
        re.compile(r"^\d+$")
    )
    screenshot(page, "runs")
    page.goto(f"{dashboard.url}/#/runs/{run_id}")
    expect(page.locator("[data-status-reason]")).to_have_text(STOPPED_EARLY)


def test_run_page_charts_never_mix_units_on_an_axis(
    page: Page, dashboard: Any, screenshot: Any
) -> None:
    run_id = "units"
    store = dashboard.store()
    try:
        store.create_run("units", {"steps": 12}, run_id=run_id, status="running")
        for step in range(12):
            store.record_metrics(
                run_id,
                step,
                {
                    "reward/mean": step / 12,
                    "perf/step_seconds": 4.0 + step % 3,
                    "perf/rollout_seconds": 3.0 + step % 2,
                    "perf/tokens_per_second": 900.0 + 10 * step,
                    "perf/train_tokens_per_second": 2500.0 - 20 * step,
                    "perf/sampled_tokens": 4000.0 + 50 * step,
                    "staleness/max": float(step % 3),
                    "staleness/mean": (step % 3) / 2,
                    "staleness/admitted": 64.0,
                    "staleness/refused": float(step % 4),
                    "staleness/count/0": 40.0,
                    "staleness/count/1": 24.0,
                },
            )
    finally:
        store.close()
    # Panel → (unit, its series): a subject with several units gets one panel per unit.
    expected = {
        "Reward": ("", ["reward/mean"]),
        "Staleness · samples": (
            "samples",
            ["staleness/admitted", "staleness/count/0", "staleness/count/1", "staleness/refused"],
        ),
        "Staleness · steps behind": ("steps behind", ["staleness/max", "staleness/mean"]),
        "Throughput · s": ("s", ["perf/rollout_seconds", "perf/step_seconds"]),
        "Throughput · tokens": ("tokens", ["perf/sampled_tokens"]),
        "Throughput · tokens/s": (
            "tokens/s",
            ["perf/tokens_per_second", "perf/train_tokens_per_second"],
        ),
    }

    page.goto(f"{dashboard.url}/#/runs/{run_id}")
    expect(page.locator("[data-charts]")).to_have_attribute("data-ready", "true")
    expect(page.locator(".chart-panel h3")).to_have_text(list(expected))
    for title, (unit, names) in expected.items():
        panel = page.locator(f'.chart-panel[data-chart="{title}"]')
        expect(panel).to_have_attribute("data-unit", unit)
        expect(panel).to_have_attribute("data-points", "12")
        # uPlot's legend: the x series, then one entry per line drawn.
        expect(panel.locator(".u-legend .u-series .u-label")).to_have_text(["step", *names])
    screenshot(page, "units")
