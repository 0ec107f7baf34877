"""`omniloop serve` serves OpenAI-compatible chat completions beside its REST API, over the
engine its episode worker runs (the tiny model over HTTP here), behind the server's token.

What must hold:
- the official `openai` client, given the server's URL and token, gets a completion with the
  sampled ids, and the session reads back as a trajectory holding those ids;
- the guard's rule is the API's: a completion without the token is the server's 401;
- the gateway's errors are OpenAI's shape inside the API (the API's own stay problems);
- a server that runs no engine answers 503 saying why; `gateway: false` serves no route;
- while the engine starts, 503 with `Retry-After`; a failed worker's error is named.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from omniloop.gateway.app import SESSION_HEADER, GatewayUnavailable
from omniloop.platform.api.gateway import STARTING_RETRY_AFTER, WorkerGateway

TOKEN = "gateway-api-token-0123456789abcdef"


async def ready(client: httpx.AsyncClient) -> None:
    """Until the worker's engine is up (the gateway answers 503 while it starts)."""
    async with asyncio.timeout(120):
        while True:
            checks = (await client.get("/readyz")).json().get("checks", {})
            if checks.get("worker") == "running":
                return
            await asyncio.sleep(0.1)


async def test_an_openai_client_gets_completions_from_the_servers_engine(
    make_settings, tiny_engine_url, serve_api, problem
) -> None:
    engine = {"url": tiny_engine_url, "model": "tiny"}
    settings = make_settings(concurrency=1, engine=engine, api_token=TOKEN)
    async with (
        serve_api(settings) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0) as client,
    ):
        await ready(http)
        models = await client.models.list()
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=6,
            seed=7,
        )
        completion = raw.parse()
        session = raw.headers[SESSION_HEADER]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        view = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
        bare = await http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user"}]}
        )
        refused = await http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=auth
        )
        api_invalid = await http.post("/v1/episodes", json={"agent": 3}, headers=auth)
    assert [m.id for m in models.data] == ["tiny"]
    sampled = completion.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert 0 < len(sampled) <= 6
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(sampled)
    (trajectory,) = view["trajectories"]
    assert trajectory["input_ids"][-len(sampled) :] == sampled
    assert view["calls"] == 1
    problem(bare, 401)
    assert refused.status_code == 400
    assert "messages" in refused.json()["error"]["message"]
    problem(api_invalid, 422)


async def test_a_server_that_runs_no_engine_says_so(make_settings, open_api) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    async with open_api(make_settings(concurrency=0)) as api:
        paused = await api.post("/v1/chat/completions", json=body)
        models = await api.get("/v1/models")
        schema = (await api.get("/openapi.json")).json()
    async with open_api(make_settings(concurrency=0, gateway=False)) as api:
        absent = await api.post("/v1/chat/completions", json=body)
    assert paused.status_code == 503
    assert "retry-after" not in paused.headers
    error = paused.json()["error"]
    assert error["code"] == "unavailable"
    assert "concurrency: 0" in error["message"]
    assert models.status_code == 503
    # OpenAI's API is documented by OpenAI, not in the server's document.
    assert not any(path.startswith(("/v1/chat", "/v1/models")) for path in schema["paths"])
    assert absent.status_code == 404


class _Worker:
    """The attributes of `EpisodeWorker` that `WorkerGateway` reads."""

    def __init__(self, state: str, error: str | None = None) -> None:
        self.state, self.error, self.gateway = state, error, None


@pytest.mark.parametrize(
    ("state", "error", "retry_after", "said"),
    [
        ("starting", None, STARTING_RETRY_AFTER, "starting"),
        ("failed", "EngineError: no engine at http://x", None, "no engine at http://x"),
        ("stopped", None, None, "worker stopped"),
    ],
)
def test_without_a_running_engine_the_gateway_is_unavailable(
    state: str, error: str | None, retry_after: int | None, said: str
) -> None:
    worker: Any = _Worker(state, error)
    with pytest.raises(GatewayUnavailable, match=said) as raised:
        WorkerGateway(lambda: worker).gateway_for(None)
    assert raised.value.retry_after == retry_after
    with pytest.raises(GatewayUnavailable, match="starting"):
        WorkerGateway(lambda: None).gateway_for("s")
