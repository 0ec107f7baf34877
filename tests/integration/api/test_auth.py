"""Bearer-token rules: POSTs need the token when one is configured, GETs never do, and the
server refuses to bind beyond loopback without one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from omniloop.platform.api import ApiSettings
from omniloop.platform.api.settings import is_loopback

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


async def test_the_right_token_is_accepted_and_gets_need_none(
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
