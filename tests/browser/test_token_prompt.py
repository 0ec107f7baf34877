"""The dashboard of a server bound beyond loopback, whose every `/v1` request needs the token:
the page asks for it once, keeps it for the tab, sends it as a header and never in a URL, and
follows an episode's event stream with it."""

from __future__ import annotations

from typing import Any

import httpx
from playwright.sync_api import Page, Request, expect

RUN_ID = "guarded-run"


def _seed(dashboard: Any) -> None:
    store = dashboard.store()
    try:
        store.create_run("guarded run", {"steps": 20}, run_id=RUN_ID, status="running")
        for step in range(5):
            store.record_metrics(RUN_ID, step, {"reward/mean": step / 10})
    finally:
        store.close()


def _give_token(page: Page, token: str) -> None:
    prompt = page.locator("[data-token-prompt]")
    expect(prompt).to_be_visible()
    prompt.locator("input[name=token]").fill(token)
    prompt.get_by_role("button", name="Continue").click()


def test_the_dashboard_asks_for_the_token_once_and_never_puts_it_in_a_url(
    page: Page, guarded_dashboard: Any, screenshot: Any
) -> None:
    dashboard = guarded_dashboard
    token: str = dashboard.token
    _seed(dashboard)
    refused = httpx.get(f"{dashboard.url}/v1/runs", timeout=30)
    assert refused.status_code == 401
    assert refused.headers["content-type"] == "application/problem+json"
    requests: list[Request] = []
    page.on("request", lambda request: requests.append(request))

    # The page loads (its files are open) and asks for the token when the API answers 401.
    page.goto(f"{dashboard.url}/#/")
    prompt = page.locator("[data-token-prompt]")
    expect(prompt).to_be_visible()
    expect(prompt.locator("input[name=token]")).to_have_attribute("type", "password")
    expect(page.locator("tr[data-run]")).to_have_count(0)
    screenshot(page, "prompt")

    # A wrong token (entered with Enter) is refused, and the prompt comes back saying so.
    prompt.locator("input[name=token]").fill("not-the-token-0123456789abcdef")
    prompt.locator("input[name=token]").press("Enter")
    expect(page.locator("[data-token-rejected]")).to_be_visible()
    _give_token(page, token)
    row = page.locator(f'tr[data-run="{RUN_ID}"]')
    expect(row).to_contain_text("guarded run")
    expect(row.locator('[data-col="steps"]')).to_have_text("5 / 20")
    expect(prompt).to_have_count(0)
    screenshot(page, "runs")

    # Kept for the tab: a reload and the run's page ask nothing.
    page.reload()
    expect(row).to_be_visible()
    row.locator("a").click()
    expect(page.locator('.chart-panel[data-chart="Reward"]')).to_have_attribute("data-points", "5")
    expect(prompt).to_have_count(0)

    # The event stream, read with fetch and the token: a queued episode is shown live, and its
    # cancellation arrives as an event that makes the page show the episode in full.
    auth = dashboard.headers()
    body = {"agent": "calc", "task": {"prompt": "What is 6 * 7?", "answer": "42"}}
    accepted = httpx.post(f"{dashboard.url}/v1/episodes", json=body, headers=auth, timeout=30)
    assert accepted.status_code == 202, accepted.text
    episode = accepted.json()
    page.goto(f"{dashboard.url}/#/episodes/{episode['id']}")
    app = page.locator("#app")
    expect(app).to_have_attribute("data-status", "queued")
    expect(page.locator(".live")).to_have_text("live: queued")
    cancelled = httpx.post(f"{dashboard.url}{episode['href']}/cancel", headers=auth, timeout=30)
    assert cancelled.status_code == 200, cancelled.text
    expect(app).to_have_attribute("data-status", "cancelled")
    expect(page.locator(".page-head .badge")).to_have_text("cancelled")
    expect(prompt).to_have_count(0)

    urls = [r.url for r in requests]
    api_requests = [r for r in requests if "/v1/" in r.url]
    assert any(r.url.endswith(f"{episode['href']}/events") for r in api_requests), urls
    assert all(token not in url for url in urls), urls
    assert all(
        r.all_headers().get("authorization") == f"Bearer {token}"
        for r in api_requests
        if r.response() is not None and r.response().status != 401  # type: ignore[union-attr]
    )
    assert token not in dashboard.log.read_text()

    # Another tab has its own session storage: it asks again. Cancelling leaves an error that
    # offers the prompt again.
    other = page.context.new_page()
    try:
        other.goto(f"{dashboard.url}/#/")
        other_prompt = other.locator("[data-token-prompt]")
        expect(other_prompt).to_be_visible()
        other_prompt.get_by_role("button", name="Cancel").click()
        retry = other.locator('.error-box [data-action="login"]')
        expect(retry).to_be_visible()
        retry.click()
        _give_token(other, token)
        expect(other.locator(f'tr[data-run="{RUN_ID}"]')).to_be_visible()
    finally:
        other.close()
