"""`HttpClient` against a real aiohttp server on loopback: answers, failures, event loops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omniloop.http_client import HttpClient, HttpTransportError
from omniloop.processes import free_port


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "body": body.decode(),
            "auth": request.headers.get("Authorization"),
        },
        status=int(request.query.get("status", "200")),
        headers={"Retry-After": "3"},
    )


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.Response(text="late")


def _app() -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/echo", _echo)
    app.router.add_get("/slow", _slow)
    return app


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    async with TestServer(_app()) as running:
        yield running


async def test_a_call_returns_status_headers_and_body(server: TestServer) -> None:
    client = HttpClient(str(server.make_url("")), timeout=10, headers={"Authorization": "t"})
    try:
        answer = await client.request(
            "PUT", "/echo", params={"path": "a b", "status": "409"}, content=b"bytes"
        )
        assert answer.status_code == 409  # returned, not raised
        assert answer.headers["retry-after"] == "3"  # case-insensitive
        assert answer.json() == {
            "method": "PUT",
            "path": "/echo",
            "query": {"path": "a b", "status": "409"},
            "body": "bytes",
            "auth": "t",
        }
        sent = await client.request("POST", "/echo", json={"x": [1, 2]})
        assert sent.json()["body"] == '{"x": [1, 2]}'
        assert '"method": "POST"' in sent.text
    finally:
        await client.aclose()


async def test_no_answer_is_a_transport_error_naming_the_call(server: TestServer) -> None:
    refused = HttpClient(f"http://127.0.0.1:{free_port()}", timeout=5)
    with pytest.raises(HttpTransportError, match=r"GET http://127\.0\.0\.1:\d+/x"):
        await refused.get("/x")
    await refused.aclose()
    client = HttpClient(str(server.make_url("")), timeout=10)
    try:
        with pytest.raises(HttpTransportError, match="/slow"):
            await client.get("/slow", timeout=0.2)
        assert (await client.get("/echo")).status_code == 200  # the pool is still usable
    finally:
        await client.aclose()


def test_one_client_serves_one_event_loop_after_another() -> None:
    """A client made outside any loop works in each `asyncio.run` it is used from."""
    port = free_port()
    client = HttpClient(f"http://127.0.0.1:{port}", timeout=10)

    async def call() -> int:
        async with TestServer(_app(), host="127.0.0.1", port=port):
            return (await client.get("/echo")).status_code

    assert asyncio.run(call()) == 200
    assert asyncio.run(call()) == 200
    asyncio.run(client.aclose())
