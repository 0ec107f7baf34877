"""Fixtures for the dashboard tests: `omniloop serve` and headless Chromium.

Every test here gets the `browser` marker. The server is the real one (`omniloop serve`, so
the dashboard is mounted the way users get it) on a SQLite file, with the session's tiny
engine and bubblewrap sandboxes; tests seed runs straight into the same database. Two servers:
`dashboard` on loopback without a token, and `guarded_dashboard` bound beyond loopback
(`--host 0.0.0.0`) with a token. Screenshots go to `test-artifacts/browser/`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from playwright.sync_api import Browser, Page, expect, sync_playwright

from omniloop.platform.store import Store

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Greedy, the random tiny model repeats the newline that ends the prompt; stopping on it ends
# each turn after a token or two.
SAMPLING = {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [198]}

# Playwright's `expect` waits 5 s by default for the page to show what it asserts; on a loaded
# 2-core machine (Chromium, the server, the engine and the tests on it) a page can take longer
# with nothing wrong. A longer wait only delays a failure: an assertion passes as soon as the
# page holds it.
expect.set_options(timeout=30_000)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.browser)


@dataclass
class Dashboard:
    """A running `omniloop serve` with the dashboard."""

    url: str
    db_url: str
    log: Path
    token: str | None = None
    """The server's API token; None for the open loopback server."""

    def store(self) -> Store:
        return Store(self.db_url)

    def headers(self) -> dict[str, str]:
        """What a REST client sends: the token when the server has one."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def _serve(
    folder: Path,
    engine_url: str,
    *,
    host: str | None = None,
    token: str | None = None,
    concurrency: int = 1,
) -> Iterator[Dashboard]:
    """`omniloop serve` on a SQLite file in `folder`, bound to `host` (loopback when None),
    with `token` as its $OMNILOOP_API_TOKEN, running `concurrency` episodes at once (0: they
    only queue); stopped afterwards."""
    db_url = f"sqlite:///{folder / 'api.db'}"
    agents = HERE / "agents.py"
    config: dict[str, Any] = {
        "db_url": db_url,
        "concurrency": concurrency,
        "poll_interval": 0.2,
        "engine": {"url": engine_url, "model": "tiny"},
        "sandbox": {"backend": "bwrap", "pool_size": 1, "limits": {"timeout": 10}},
        "agents": {
            "calc": {
                "agent": f"{agents}:tool_agent",
                "rewards": [f"{agents}:printed_42", f"{agents}:called_a_tool"],
                "sampling": SAMPLING,
                "max_turns": 2,
            }
        },
    }
    config_path = folder / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = folder / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "OMNILOOP_API_TOKEN"}
    if token is not None:
        env["OMNILOOP_API_TOKEN"] = token
    exe = Path(sys.executable).parent / "omniloop"
    cmd = [str(exe), "serve", "--config", str(config_path), "--port", "0", "--log-level", "warning"]
    if host is not None:
        cmd += ["--host", host]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        url: str | None = None
        while url is None:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"omniloop serve exited with {proc.returncode}:\n{log.read_text()}"
                )
            ready = [ln for ln in log.read_text().splitlines() if "omniloop api ready at " in ln]
            url = ready[0].split("ready at ", 1)[1].strip() if ready else None
            if time.monotonic() > deadline:
                raise TimeoutError(f"omniloop serve not ready after 120 s:\n{log.read_text()}")
            time.sleep(0.1)
        # A server on every interface is reached here through loopback.
        url = url.replace("://0.0.0.0:", "://127.0.0.1:")
        while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"omniloop serve not ready after 120 s:\n{log.read_text()}")
            time.sleep(0.2)
        yield Dashboard(url=url, db_url=db_url, log=log, token=token)
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def dashboard(
    tiny_engine_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dashboard]:
    """The dashboard on loopback without a token (the API is open)."""
    with _serve(tmp_path_factory.mktemp("dashboard"), tiny_engine_url) as served:
        yield served


GUARDED_TOKEN = "browser-test-token-0123456789abcdef"


@pytest.fixture(scope="session")
def guarded_dashboard(
    tiny_engine_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dashboard]:
    """The dashboard of a server bound beyond loopback (`--host 0.0.0.0`), so with a token
    that every `/v1` request needs. Its worker is paused: submitted episodes stay queued
    until a test cancels them."""
    folder = tmp_path_factory.mktemp("guarded")
    with _serve(
        folder, tiny_engine_url, host="0.0.0.0", token=GUARDED_TOKEN, concurrency=0
    ) as served:
        yield served


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    # Module scope, not session: Playwright's sync API keeps an event loop running on this
    # thread while it is open, which would break every asyncio test collected after it.
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(chromium: Browser) -> Iterator[Page]:
    """A fresh page; JavaScript errors on it fail the test."""
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def screenshot(request: pytest.FixtureRequest) -> Any:
    """`screenshot(page, name)` saves a full-page PNG under test-artifacts/browser/."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def save(page: Page, name: str) -> Path:
        path = ARTIFACTS / f"{request.node.name}-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return save
