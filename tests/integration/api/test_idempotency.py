"""`Idempotency-Key` on `POST /v1/episodes`: same key and body → the same episode; another
body → 422; while the first request with the key is still being created → 409."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest


async def test_same_key_same_body_returns_the_same_episode(make_settings, open_api, episode_body):
    body = episode_body(sampling={"temperature": 0.5})
    async with open_api(make_settings()) as api:
        first = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "k-1"})
        # The same request spelled differently: key order, whitespace, a default spelled out.
        respelled = json.dumps({"max_turns": None, **dict(reversed(list(body.items())))}, indent=3)
        again = await api.post(
            "/v1/episodes",
            content=respelled,
            headers={"Idempotency-Key": "k-1", "content-type": "application/json"},
        )
        listed = (await api.get("/v1/episodes")).json()["items"]
        detail = (await api.get(first.headers["location"])).json()
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["created"] is False
    assert again.headers["location"] == first.headers["location"]
    assert len(listed) == 1
    assert detail["idempotency_key"] == "k-1"


async def test_same_key_different_body_is_422_naming_the_first_episode(
    make_settings, open_api, episode_body, problem
):
    async with open_api(make_settings()) as api:
        first = await api.post(
            "/v1/episodes", json=episode_body("a"), headers={"Idempotency-Key": "k-2"}
        )
        response = await api.post(
            "/v1/episodes", json=episode_body("b"), headers={"Idempotency-Key": "k-2"}
        )
        doc = problem(response, 422)
        listed = (await api.get("/v1/episodes")).json()["items"]
    assert doc["type"] == "urn:omniloop:problem:idempotency-key-reused"
    assert doc["episode_id"] == first.json()["id"]
    assert "k-2" in doc["detail"]
    assert len(listed) == 1


async def test_different_keys_and_no_key_create_separate_episodes(
    make_settings, open_api, episode_body
):
    body = episode_body()
    async with open_api(make_settings()) as api:
        ids = {
            (await api.post("/v1/episodes", json=body, headers=headers)).json()["id"]
            for headers in ({"Idempotency-Key": "a"}, {"Idempotency-Key": "b"}, {}, {})
        }
    assert len(ids) == 4


async def test_a_key_in_flight_is_409_until_the_first_request_finishes(
    make_settings, open_api, episode_body, problem
):
    settings = make_settings()
    body = episode_body()
    async with open_api(settings) as api:
        path = settings.db_url.removeprefix("sqlite:///")
        # Hold SQLite's write lock, so the first request waits inside its insert.
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            first = asyncio.create_task(
                api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "slow"})
            )
            await asyncio.sleep(0.3)
            assert not first.done()
            busy = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "slow"})
            other = await api.post(
                "/v1/episodes", json=episode_body("other"), headers={"Idempotency-Key": "slow"}
            )
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        created = await first
        after = await api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "slow"})
    doc = problem(busy, 409)
    assert doc["type"] == "urn:omniloop:problem:idempotency-key-in-use"
    assert busy.headers["retry-after"] == "1"
    # Any body: the first request's outcome is not known yet.
    problem(other, 409)
    assert created.status_code == 202
    assert after.status_code == 200
    assert after.json()["id"] == created.json()["id"]


async def test_concurrent_first_requests_with_one_key_make_one_episode(
    make_settings, open_api, episode_body
):
    body = episode_body()
    async with open_api(make_settings()) as api:
        responses = await asyncio.gather(
            *(
                api.post("/v1/episodes", json=body, headers={"Idempotency-Key": "race"})
                for _ in range(8)
            )
        )
        listed = (await api.get("/v1/episodes")).json()["items"]
    statuses = sorted(r.status_code for r in responses)
    # One creates; the others replay it or are told the key is in use. None makes another.
    assert statuses.count(202) == 1
    assert set(statuses) <= {200, 202, 409}
    assert {r.json().get("id") for r in responses if r.status_code < 300} == {listed[0]["id"]}
    assert len(listed) == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "tab\tkey", "ünï"])
async def test_malformed_keys_are_validation_problems(
    make_settings, open_api, episode_body, problem, key
):
    async with open_api(make_settings()) as api:
        response = await api.post(
            "/v1/episodes", json=episode_body(), headers={"Idempotency-Key": key.encode()}
        )
        doc = problem(response, 422)
    assert doc["errors"][0]["location"] == "header"
    assert doc["errors"][0]["field"] == "Idempotency-Key"
