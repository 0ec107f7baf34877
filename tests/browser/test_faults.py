"""The run page's Faults panel in headless Chromium: one row per fault of the run's roles
(seeded as a training run records them), live as new ones are recorded (down when detected,
then the same row recovered), with their steps marked on the reward chart; "No faults" for a
run without any."""

from __future__ import annotations

import re
from typing import Any

import httpx
from playwright.sync_api import Page, expect

from omniloop.platform.control.faults import Fault
from omniloop.platform.store import FAULT_EVENT

DETECTED = 1_796_140_971.39
CAUSE = "ActorDiedError: The actor died unexpectedly before finishing this task."


def _fault(
    step: int,
    role: str,
    replica: str,
    after: float,
    down_for: float | None,
    retried: list[str],
    fault_id: str | None = None,
) -> dict[str, Any]:
    fault = Fault(
        role=role,
        replica=replica,
        cause=CAUSE,
        detected_at=DETECTED + after,
        recovered_at=None if down_for is None else DETECTED + after + down_for,
        retried=retried,
    )
    if fault_id is not None:
        fault.fault_id = fault_id
    return {"step": step, **fault.to_json()}


def _seed(dashboard: Any, run_id: str, faults: list[dict[str, Any]], steps: int) -> None:
    store = dashboard.store()
    try:
        store.create_run("faulty run", {"steps": steps}, run_id=run_id, status="running")
        for step in range(steps):
            store.record_metrics(
                run_id, step, {"reward/mean": 0.1 + step / 20, "faults/count": 0.0}
            )
        for data in faults:
            store.record_run_event(run_id, FAULT_EVENT, data)
    finally:
        store.close()


def test_faults_panel_lists_the_timeline_live_and_marks_the_reward_chart(
    page: Page, dashboard: Any, screenshot: Any
) -> None:
    run_id = "faulty"
    replica = "7806e8f1aa9b4c3d2e1f"
    _seed(
        dashboard,
        run_id,
        [
            _fault(3, "advantage", replica, 0, 7.25, ["step 3 advantages"]),
            _fault(
                5,
                "rollout",
                "c0ffee1234",
                60,
                0.4,
                ["step 5 episode 2", "step 5 episode 7", "step 5 episode 9"],
            ),
            _fault(8, "actor", "", 120, None, []),
        ],
        steps=12,
    )

    page.goto(f"{dashboard.url}/#/runs/{run_id}")
    panel = page.locator("[data-faults]")
    expect(panel).to_have_attribute("data-ready", "true")
    expect(panel.locator("[data-faults-empty]")).to_be_hidden()
    expect(panel.locator("thead th")).to_have_text(
        ["step", "role", "replica", "cause", "detected", "recovery", "retried"]
    )
    rows = panel.locator("tbody tr[data-fault]")
    expect(rows).to_have_count(3)
    expect(rows.locator('[data-col="role"]')).to_have_text(["advantage", "rollout", "actor"])
    expect(rows.locator('[data-col="step"]')).to_have_text(["3", "5", "8"])

    first = rows.nth(0)
    # The replica short, in full on hover; the cause; when it was detected; how long it took.
    expect(first.locator('[data-col="replica"]')).to_have_text("7806e8f1aa9b…")
    expect(first.locator('[data-col="replica"]')).to_have_attribute("title", replica)
    expect(first.locator('[data-col="cause"]')).to_have_text(CAUSE)
    expect(first.locator('[data-col="detected"]')).to_have_text(re.compile(r"\d\d:\d\d:\d\d"))
    expect(first.locator('[data-col="recovery"]')).to_have_text("recovered after 7.25 s")
    expect(rows.nth(1).locator('[data-col="recovery"]')).to_have_text("recovered after 400 ms")
    # Not recovered: "down"; no replica named: a dash; nothing retried: 0.
    last = rows.nth(2)
    expect(last.locator('[data-col="recovery"]')).to_have_text("down")
    expect(last.locator('[data-col="replica"]')).to_have_text("–")
    expect(last.locator('[data-col="retried"]')).to_have_text("0")

    # The retried work: its count, the list on hover and when expanded.
    retried = rows.nth(1).locator('[data-col="retried"] details')
    expect(retried.locator("summary")).to_have_text("3")
    expect(retried).to_have_attribute(
        "title", "step 5 episode 2\nstep 5 episode 7\nstep 5 episode 9"
    )
    expect(retried.locator("li").first).to_be_hidden()
    retried.locator("summary").click()
    expect(retried.locator("li")).to_have_text(
        ["step 5 episode 2", "step 5 episode 7", "step 5 episode 9"]
    )

    # The fault steps are marked on the reward chart (and nowhere else).
    reward = page.locator('.chart-panel[data-chart="Reward"]')
    expect(reward).to_have_attribute("data-markers", "3,5,8")
    expect(reward.locator(".fault-key")).to_be_visible()
    expect(page.locator(".chart-panel[data-markers]")).to_have_count(1)
    screenshot(page, "faults")

    # Live: a fault recorded as it is detected shows up down without reloading, and so does
    # its marker; its recovery, recorded later under the same fault id, replaces its row.
    def record(data: dict[str, Any]) -> None:
        store = dashboard.store()
        try:
            store.record_run_event(run_id, FAULT_EVENT, data)
        finally:
            store.close()

    record(_fault(10, "rollout", "feedbeef", 200, None, [], fault_id="f-live"))
    expect(rows).to_have_count(4)
    expect(rows.nth(3).locator('[data-col="recovery"]')).to_have_text("down")
    expect(reward).to_have_attribute("data-markers", "3,5,8,10")
    screenshot(page, "faults-live-down")
    record(_fault(10, "rollout", "feedbeef", 200, 2.0, ["step 10 episode 1"], fault_id="f-live"))
    expect(rows.nth(3).locator('[data-col="recovery"]')).to_have_text("recovered after 2.00 s")
    expect(rows).to_have_count(4)
    expect(rows.nth(3).locator('[data-col="retried"] summary')).to_have_text("1")
    expect(rows.nth(3)).to_have_attribute("data-fault", "f-live")
    expect(reward).to_have_attribute("data-markers", "3,5,8,10")
    # What the page shows is what the API says: the live fault twice, under one id.
    api = httpx.get(f"{dashboard.url}/v1/runs/{run_id}/faults", timeout=30).json()
    assert [f["role"] for f in api["items"]] == [
        "advantage",
        "rollout",
        "actor",
        "rollout",
        "rollout",
    ]
    assert [f["fault_id"] for f in api["items"][3:]] == ["f-live", "f-live"]
    screenshot(page, "faults-live")


def test_a_run_without_faults_says_so(page: Page, dashboard: Any) -> None:
    run_id = "healthy"
    _seed(dashboard, run_id, [], steps=4)
    page.goto(f"{dashboard.url}/#/runs/{run_id}")
    panel = page.locator("[data-faults]")
    expect(panel).to_have_attribute("data-ready", "true")
    expect(panel.locator("[data-faults-empty]")).to_have_text("No faults")
    expect(panel.locator("[data-faults-empty]")).to_be_visible()
    expect(panel.locator("table")).to_be_hidden()
    expect(page.locator("[data-charts]")).to_have_attribute("data-ready", "true")
    expect(page.locator('.chart-panel[data-chart="Reward"] canvas')).to_have_count(1)
    expect(page.locator(".chart-panel[data-markers]")).to_have_count(0)
