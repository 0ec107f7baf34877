"""Bearer-token rules: POSTs need the token when one is configured; beyond loopback every `/v1`
request (reads and event streams included) does too, and `/metrics` unless turned off, while
health, readiness, the OpenAPI document and the dashboard's pages stay open; and the server
refuses to bind beyond loopback without a token.

A server "beyond loopback" is the app built from settings with `host: 0.0.0.0`, called
in-process: the rule follows the settings, so no test needs to listen on a public interface
(the dashboard's browser test runs a real `omniloop serve --host 0.0.0.0`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import ValidationError
from starlette.routing import Mount, Route

import omniloop.web
from omniloop.platform.api import ApiSettings, create_app
from omniloop.platform.api.settings import is_loopback
from omniloop.platform.control.engine_routes import engine_router

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789abcdef"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
    ],
)
async def test_posts_without_the_right_token_are_401(
    make_settings, open_api, episode_body, problem, headers
):
    async with open_api(make_settings(api_token=TOKEN)) as api:
        submit = await api.post("/v1/episodes", json=episode_body(), headers=headers)
        cancel = await api.post("/v1/episodes/anything/cancel", headers=headers)
        listed = (await api.get("/v1/episodes")).json()["items"]
    for response in (submit, cancel):
        doc = problem(response, 401)
        assert doc["type"] == "urn:omniloop:problem:unauthorized"
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert TOKEN not in response.text
    assert listed == []


async def test_on_loopback_the_right_token_is_accepted_and_gets_need_none(
    make_settings, open_api, episode_body
):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with open_api(make_settings(api_token=TOKEN)) as api:
        submitted = await api.post("/v1/episodes", json=episode_body(), headers=auth)
        href = submitted.json()["href"]
        reads = [
            await api.get(path)
            for path in (href, "/v1/episodes", "/v1/runs", "/v1/agents", "/healthz", "/readyz")
        ]
        cancelled = await api.post(f"{href}/cancel", headers=auth)
    assert submitted.status_code == 202
    assert [r.status_code for r in reads] == [200] * 6
    assert cancelled.status_code == 200


async def test_the_token_is_checked_before_the_body(make_settings, open_api, problem):
    async with open_api(make_settings(api_token=TOKEN)) as api:
        response = await api.post("/v1/episodes", json={"nonsense": True})
    problem(response, 401)


async def test_the_openapi_document_declares_bearer_auth_on_posts_only(make_settings, open_api):
    async with open_api(make_settings(api_token=TOKEN)) as api:
        doc = (await api.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            assert ("security" in operation) == (method == "post"), (method, path)


def test_binding_beyond_loopback_without_a_token_is_refused(monkeypatch):
    monkeypatch.delenv("OMNILOOP_API_TOKEN", raising=False)
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com", ""):
        with pytest.raises(ValidationError, match="without a bearer token"):
            ApiSettings(host=host)
    for host in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert ApiSettings(host=host).api_token is None
    assert ApiSettings(host="0.0.0.0", api_token=TOKEN).api_token is not None


def test_the_token_comes_from_the_environment_and_must_not_be_weak(monkeypatch):
    monkeypatch.setenv("OMNILOOP_API_TOKEN", TOKEN)
    settings = ApiSettings(host="0.0.0.0")
    assert settings.token_bytes() == TOKEN.encode()
    assert TOKEN not in repr(settings)
    assert TOKEN not in str(settings.public_dump())
    monkeypatch.setenv("OMNILOOP_API_TOKEN", "short")
    with pytest.raises(ValidationError, match="at least 16"):
        ApiSettings()


def test_is_loopback_names_only_this_machine():
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("10.0.0.1")
    assert not is_loopback("localhost.example.com")


def test_omniloop_serve_refuses_a_public_bind_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMNILOOP_API_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omniloop",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--db-url",
            f"sqlite:///{tmp_path / 'x.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve on '0.0.0.0' without a bearer token" in proc.stderr
    assert not (tmp_path / "x.db").exists()


# -- beyond loopback ---------------------------------------------------------------------------

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
"""The routes that never need the token: they hold no data. Every other route must."""
DASHBOARD_FILE = "/js/api.js"
"""A file of the dashboard's static mount (the page must load before it can ask for a token)."""


def _calls(app: FastAPI) -> list[tuple[str, str, str]]:
    """(method, path, template) for every route in the app's route table (included routers
    expanded): each method it serves plus OPTIONS (allowed by none, so the token must be
    checked before the 405), path parameters filled with an id that names nothing (so no
    stream stays open)."""
    calls = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, Mount):
            root = f"{route.path}/"
            calls.append(("GET", root, root))
            if route.name == "dashboard":
                calls.append(("GET", DASHBOARD_FILE, root))
        elif isinstance(route, APIRoute | Route) and context.path_format is not None:
            path = re.sub(r"\{[^}]+\}", "no-such-id", context.path_format)
            for method in sorted({*(context.methods or {"GET"}), "OPTIONS"}):
                calls.append((method, path, context.path_format))
        else:
            raise AssertionError(f"{route!r}: a kind of route this test cannot call yet")
    return calls


def _beyond_loopback(make_settings, **overrides) -> tuple[ApiSettings, FastAPI]:
    settings = make_settings(host="0.0.0.0", api_token=TOKEN, **overrides)
    # As a run's api role builds it: with the run's engines beside the API.
    routes = [engine_router(), *omniloop.web.routes()]
    return settings, create_app(settings, extra_routes=routes)


@pytest.mark.parametrize("metrics_need_token", [True, False])
async def test_beyond_loopback_every_route_but_the_open_ones_needs_the_token(
    make_settings, open_api, problem, metrics_need_token
):
    settings, app = _beyond_loopback(make_settings, metrics_need_token=metrics_need_token)
    calls = _calls(app)
    templates = {template for _, _, template in calls}
    # The table really holds the API, the dashboard's endpoint and its pages.
    assert {"/v1/runs", "/v1/episodes/{episode_id}/events", "/v1/tokens/{episode_id}"} <= templates
    assert {"/", "/metrics", "/healthz", "/v1/rollout/engines"} <= templates
    # ... and the OpenAI-compatible gateway's routes.
    assert {"/v1/chat/completions", "/v1/models", "/v1/sessions/{session_id}"} <= templates
    right = {"Authorization": f"Bearer {TOKEN}"}
    wrong = {"Authorization": "Bearer not-the-token-0123456789"}
    async with open_api(settings, app) as api:
        for method, path, template in calls:
            is_open = (
                template in OPEN_PATHS
                or template == "/"
                or (template == "/metrics" and not metrics_need_token)
            )
            bare = await api.request(method, path)
            if is_open:
                assert bare.status_code != 401, (method, path, bare.text)
                continue
            doc = problem(bare, 401)
            assert doc["type"] == "urn:omniloop:problem:unauthorized", (method, path)
            assert bare.headers["www-authenticate"].startswith("Bearer"), (method, path)
            problem(await api.request(method, path, headers=wrong), 401)
            with_token = await api.request(method, path, headers=right)
            assert with_token.status_code != 401, (method, path, with_token.text)
        # What the open ones answer: health, readiness, the documents and the dashboard.
        assert (await api.get("/healthz")).json() == {"status": "ok"}
        assert (await api.get("/openapi.json")).status_code == 200
        assert "<html" in (await api.get("/")).text
        assert "Authorization" in (await api.get(DASHBOARD_FILE)).text


async def test_beyond_loopback_reads_and_event_streams_work_with_the_token(
    make_settings, open_api, episode_body, read_events
):
    settings, app = _beyond_loopback(make_settings)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with open_api(settings, app) as api:
        accepted = (await api.post("/v1/episodes", json=episode_body(), headers=auth)).json()
        refused = await api.get(accepted["events_href"])
        assert (await api.post(f"{accepted['href']}/cancel", headers=auth)).status_code == 200
        stream = await api.get(accepted["events_href"], headers=auth)
        listed = await api.get("/v1/episodes", headers=auth)
        runs = await api.get("/v1/runs", headers=auth)
        metrics = await api.get("/metrics", headers=auth)
    assert refused.status_code == 401
    assert refused.headers["content-type"] == "application/problem+json"
    assert stream.headers["content-type"].startswith("text/event-stream")
    statuses = [e["data"]["data"]["status"] async for e in read_events(stream)]
    assert statuses == ["queued", "cancelled"]
    assert [e["id"] for e in listed.json()["items"]] == [accepted["id"]]
    assert runs.json()["items"] == []
    assert "omniloop_api_requests_total" in metrics.text


async def test_beyond_loopback_the_openapi_document_marks_every_guarded_operation(
    make_settings, open_api
):
    settings, app = _beyond_loopback(make_settings)
    async with open_api(settings, app) as api:
        doc = (await api.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            guarded = path.startswith("/v1/") or path == "/metrics"
            assert ("security" in operation) == guarded, (method, path)
            assert ("401" in operation["responses"]) == guarded, (method, path)
    # The agents' names are behind the token (GET /v1/agents), not in the open document.
    assert "enum" not in doc["components"]["schemas"]["EpisodeRequest"]["properties"]["agent"]
