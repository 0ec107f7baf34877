"""Fixtures for the REST API: the real app on a real SQLite store, talked to over HTTP.

`make_settings(**overrides)` gives `ApiSettings` for a fresh database in the test's folder, with
the test agents configured and the worker paused (concurrency 0) unless a test asks for more.
`open_api(settings)` runs the app's lifespan and yields an httpx client over the ASGI transport;
`serve_api(settings)` runs it under uvicorn on loopback (for streams, which the ASGI transport
buffers whole) and yields its base URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from omniloop.platform.api import ApiSettings, create_app

HERE = Path(__file__).parent
AGENTS = HERE / "agents.py"
TOKEN = "test-token-0123456789abcdef"

SettingsFactory = Callable[..., ApiSettings]


# Greedy, the random tiny model repeats the prompt's last token (the newline that ends the
# prefill and the generation prompt); stopping on it ends each turn.
SAMPLING = {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [198]}


def agents_config() -> dict[str, Any]:
    return {
        "calc": {
            "agent": f"{AGENTS}:tool_agent",
            "rewards": [f"{AGENTS}:tool_said_42"],
            "description": "Runs print(6 * 7) in the sandbox.",
            "sampling": SAMPLING,
            "max_turns": 2,
        },
        "waiter": {"agent": f"{AGENTS}:waiting_agent", "sampling": SAMPLING},
        "broken": {"agent": f"{AGENTS}:broken_agent", "sampling": SAMPLING},
    }


@pytest.fixture
def make_settings(tmp_path: Path) -> SettingsFactory:
    def build(**overrides: Any) -> ApiSettings:
        data: dict[str, Any] = {
            "db_url": f"sqlite:///{tmp_path / 'api.db'}",
            "api_token": None,
            "concurrency": 0,
            "poll_interval": 0.2,
            "agents": agents_config(),
            "sandbox": {"backend": "bwrap", "pool_size": 1, "limits": {"timeout": 10}},
        }
        data.update(overrides)
        return ApiSettings.model_validate(data)

    return build


@contextlib.asynccontextmanager
async def _open_api(
    settings: ApiSettings, app: FastAPI | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, and a client that calls it in-process."""
    app = app or create_app(settings)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api.test", timeout=60
        ) as client,
    ):
        yield client


@contextlib.asynccontextmanager
async def _serve_api(settings: ApiSettings) -> AsyncIterator[str]:
    """The app under uvicorn on 127.0.0.1 (a free port), in this event loop; yields its URL."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
        )
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


async def _read_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Parse a Server-Sent Events body into `{"id", "event", "data"}` dicts (data as JSON)."""
    event: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line:
            if "data" in event:
                yield event
            event = {}
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            event[name] = json.loads(value) if name == "data" else value


def _problem(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response's problem document, after checking it is one with `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json", response.headers
    doc = response.json()
    assert doc["status"] == status
    assert isinstance(doc["title"], str)
    assert doc["title"]
    assert isinstance(doc["type"], str)
    assert doc["type"]
    assert doc["instance"] == response.request.url.path
    assert isinstance(doc["detail"], str)
    assert doc["detail"]
    return doc


@pytest.fixture
def episode_body() -> Iterator[Callable[..., dict[str, Any]]]:
    def body(prompt: str = "What is 6 * 7?", agent: str = "calc", **extra: Any) -> dict[str, Any]:
        return {"agent": agent, "task": {"prompt": prompt, "answer": "42"}, **extra}

    return body


# Helpers as fixtures: test modules cannot import this conftest (importlib import mode).


@pytest.fixture
def open_api() -> Callable[..., contextlib.AbstractAsyncContextManager[httpx.AsyncClient]]:
    return _open_api


@pytest.fixture
def serve_api() -> Callable[[ApiSettings], contextlib.AbstractAsyncContextManager[str]]:
    return _serve_api


@pytest.fixture
def read_events() -> Callable[[httpx.Response], AsyncIterator[dict[str, Any]]]:
    return _read_events


@pytest.fixture
def problem() -> Callable[[httpx.Response, int], dict[str, Any]]:
    return _problem
