"""Back-pressure on `POST /v1/episodes`: while `max_queued_episodes` episodes are queued, a
submission is refused with a 503 `queue-full` problem and `Retry-After`, and creates nothing;
once the worker has drained some, submissions are accepted again."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import httpx
import pytest
from pydantic import ValidationError

from omniloop.platform.api import ApiSettings
from omniloop.platform.api.worker import RETRY_AFTER_IDLE, RETRY_AFTER_MAX
from omniloop.platform.store import Store

QUEUE_FULL = "urn:omniloop:problem:queue-full"
T = TypeVar("T")


def _queue_full(problem, response: httpx.Response, limit: int) -> dict[str, Any]:
    """The response's queue-full problem, after checking what every one must say."""
    doc = problem(response, 503)
    assert doc["type"] == QUEUE_FULL
    assert doc["max_queued_episodes"] == limit
    assert doc["queued"] >= limit
    assert f"max_queued_episodes={limit}" in doc["detail"]
    assert "omniloop serve max_queued_episodes=" in doc["detail"]  # how to raise it
    retry = int(response.headers["retry-after"])
    assert 1 <= retry <= RETRY_AFTER_MAX
    assert doc["retry_after"] == retry
    return doc


async def _listed(api: httpx.AsyncClient, status: str) -> list[dict[str, Any]]:
    page = (await api.get("/v1/episodes", params={"status": status, "limit": 200})).json()
    items: list[dict[str, Any]] = page["items"]
    return items


async def _queued(api: httpx.AsyncClient) -> list[str]:
    return [item["id"] for item in await _listed(api, "queued")]


async def _until(
    read: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout: float = 120
) -> T:
    """Poll `read()` until `done` holds for what it returns."""
    async with asyncio.timeout(timeout):
        while True:
            value = await read()
            if done(value):
                return value
            await asyncio.sleep(0.05)


async def test_a_flood_past_the_limit_admits_exactly_the_limit(
    make_settings, serve_api, episode_body, problem
):
    limit, flood = 12, 40
    async with (
        serve_api(make_settings(max_queued_episodes=limit)) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as api,
    ):
        responses = await asyncio.gather(
            *(api.post("/v1/episodes", json=episode_body(f"p{i}")) for i in range(flood))
        )
        later = await api.post("/v1/episodes", json=episode_body("later"))
        queued = await _queued(api)
        everything = (await api.get("/v1/episodes", params={"limit": 200})).json()["items"]
        metrics = (await api.get("/metrics")).text
    accepted = [r for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code != 202]
    assert len(accepted) == limit
    assert len(refused) == flood - limit
    for response in [*refused, later]:
        doc = _queue_full(problem, response, limit)
        # The worker is paused: nothing here drains the queue, and the answer says so.
        assert response.headers["retry-after"] == str(RETRY_AFTER_IDLE)
        assert "runs no episodes" in doc["detail"]
    # Nothing was dropped or created behind the client's back: the store holds exactly the
    # accepted episodes.
    assert sorted(queued) == sorted(r.json()["id"] for r in accepted)
    assert len(everything) == limit
    assert (
        f'omniloop_api_episode_submissions_total{{outcome="queue_full"}} {flood - limit + 1}.0'
        in metrics
    )
    assert f'omniloop_api_episode_submissions_total{{outcome="created"}} {limit}.0' in metrics


async def test_a_key_refused_with_503_is_unused_and_works_on_retry(
    make_settings, open_api, episode_body, problem
):
    body = episode_body("keyed")
    async with open_api(make_settings(max_queued_episodes=2)) as api:
        used = await api.post(
            "/v1/episodes", json=episode_body("a"), headers={"Idempotency-Key": "a"}
        )
        other = await api.post("/v1/episodes", json=episode_body("b"))
        refused = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "k"})
        refused_again = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "k"})
        # A full queue still answers replays of keys already used: they create nothing.
        replay = await api.post(
            "/v1/episodes", json=episode_body("a"), headers={"Idempotency-Key": "a"}
        )
        reused = await api.post(
            "/v1/episodes", json=episode_body("not a"), headers={"Idempotency-Key": "a"}
        )
        listed = (await api.get("/v1/episodes")).json()["items"]
        # Room again (a queued episode cancelled): the refused key creates its episode, once.
        assert (await api.post(f"{used.json()['href']}/cancel")).status_code == 200
        retried = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "k"})
        replayed = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "k"})
        detail = (await api.get(retried.headers["location"])).json()
    for response in (refused, refused_again):
        _queue_full(problem, response, 2)
        assert "location" not in response.headers
    assert replay.status_code == 200
    assert replay.json()["id"] == used.json()["id"]
    assert problem(reused, 422)["type"] == "urn:omniloop:problem:idempotency-key-reused"
    assert sorted(item["id"] for item in listed) == sorted([used.json()["id"], other.json()["id"]])
    assert retried.status_code == 202
    assert replayed.status_code == 200
    assert replayed.json()["id"] == retried.json()["id"]
    assert detail["idempotency_key"] == "k"
    assert detail["task"]["prompt"] == "keyed"


async def test_after_the_worker_drains_some_submissions_are_accepted_again(
    make_settings, open_api, episode_body, problem, tiny_engine_url
):
    limit = 3
    body = episode_body(agent="broken")  # one turn, then a bug: a short episode
    # Fill the queue while the worker is paused.
    async with open_api(make_settings(max_queued_episodes=limit)) as api:
        filled = [await api.post("/v1/episodes", json=body) for _ in range(limit)]
        full = await api.post("/v1/episodes", json=body)
    assert [r.status_code for r in filled] == [202] * limit
    _queue_full(problem, full, limit)

    # The same database under a server whose worker runs episodes: the bound holds for what
    # was queued before it started, and lifts as its worker claims them.
    engine = {"url": tiny_engine_url, "model": "tiny"}
    running = make_settings(max_queued_episodes=limit, concurrency=1, engine=engine)
    async with open_api(running) as api:
        await _until(lambda: _queued(api), lambda ids: len(ids) < limit)
        accepted = await api.post("/v1/episodes", json=body)
        assert accepted.status_code == 202, accepted.text
        # One episode over, so the worker has a duration to estimate Retry-After from.
        await _until(lambda: _listed(api, "failed"), bool)
        # A burst: the queue fills again, and the rest wait for the worker.
        burst = await asyncio.gather(*(api.post("/v1/episodes", json=body) for _ in range(24)))
        assert len(await _queued(api)) <= limit
        refused = [r for r in burst if r.status_code == 503]
        assert refused, [r.status_code for r in burst]
        assert {r.status_code for r in burst} <= {202, 503}
        await _until(lambda: _queued(api), lambda ids: not ids)
        finished = await _listed(api, "failed")
        # Once the queue drained (episodes took their time), it is open again.
        after = await api.post("/v1/episodes", json=body)
    assert after.status_code == 202, after.text
    for response in refused:
        doc = _queue_full(problem, response, limit)
        assert "runs no episodes" not in doc["detail"]
    # Retry-After comes from how long this worker's episodes took (one slot): never longer
    # than the longest of them (the store's timestamps bracket the worker's own timing, plus
    # the status write after it).
    assert finished
    longest = max(_seconds(item["finished_at"]) - _seconds(item["started_at"]) for item in finished)
    late = int(refused[-1].headers["retry-after"])
    assert late <= max(1, math.ceil(longest)) + 1, (late, longest)


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


async def test_the_openapi_document_lists_the_503_with_retry_after(make_settings, open_api):
    async with open_api(make_settings()) as api:
        doc = (await api.get("/openapi.json")).json()
    documented = doc["paths"]["/v1/episodes"]["post"]["responses"]["503"]
    assert "queue-full" in documented["description"]
    assert documented["headers"]["Retry-After"]["schema"]["type"] == "integer"
    schema = documented["content"]["application/problem+json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/Problem"}


async def test_null_leaves_the_queue_unbounded(make_settings, open_api, episode_body, problem):
    default = ApiSettings().max_queued_episodes
    assert default == 1024
    settings = make_settings(max_queued_episodes=None)
    store = Store(settings.db_url)
    store.migrate()
    store.create_episodes([{"task": {"prompt": str(i)}, "agent": "calc"} for i in range(default)])
    store.close()
    async with open_api(settings) as api:
        unbounded = await api.post("/v1/episodes", json=episode_body())
    async with open_api(make_settings()) as api:
        bounded = await api.post("/v1/episodes", json=episode_body())
    assert unbounded.status_code == 202
    _queue_full(problem, bounded, default)


@pytest.mark.parametrize("value", [0, -1])
def test_the_limit_must_be_positive_or_null(make_settings, value):
    with pytest.raises(ValidationError, match="max_queued_episodes"):
        make_settings(max_queued_episodes=value)
