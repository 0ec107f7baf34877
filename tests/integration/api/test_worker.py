"""Episodes submitted over REST run for real: the tiny model in the CPU engine over HTTP, a
bubblewrap sandbox for the tool, the rewards; followed live over Server-Sent Events on a
uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from omniloop.platform.store import Store


@pytest.fixture
def run_settings(make_settings, tiny_engine_url):
    """Settings whose worker runs episodes on the session's tiny engine."""

    def build(**overrides: Any):
        engine = {"url": tiny_engine_url, "model": "tiny"}
        return make_settings(**{"concurrency": 2, "engine": engine, **overrides})

    return build


async def follow(
    client: httpx.AsyncClient, href: str, read_events, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Every event of one stream, until the server ends it."""
    events = []
    async with asyncio.timeout(90), client.stream("GET", href, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for event in read_events(response):
            events.append(event)
    return events


async def wait_for_status(client: httpx.AsyncClient, href: str, *statuses: str) -> dict[str, Any]:
    async with asyncio.timeout(60):
        while True:
            episode = (await client.get(href)).json()
            if episode["status"] in statuses:
                return episode
            await asyncio.sleep(0.05)


async def test_an_episode_runs_a_real_tool_in_a_real_sandbox_and_streams_its_events(
    run_settings, serve_api, read_events, episode_body
):
    async with (
        serve_api(run_settings()) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        accepted = (await client.post("/v1/episodes", json=episode_body())).json()
        events = await follow(client, accepted["events_href"], read_events)
        episode = (await client.get(accepted["href"])).json()

    kinds = [(e["event"], e["data"]["data"].get("status")) for e in events]
    assert kinds[:2] == [("status", "queued"), ("status", "running")]
    assert kinds[-1] == ("status", "completed")
    turns = [e["data"]["data"] for e in events if e["event"] == "turn"]
    assert [t["turn"] for t in turns] == list(range(episode["num_turns"]))
    assert all(t["completion_tokens"] > 0 and t["finish_reason"] == "stop" for t in turns)
    # SSE ids are the store's event ids: increasing, and the payload repeats them.
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(ids)
    assert [e["data"]["id"] for e in events] == ids
    assert {e["data"]["episode_id"] for e in events} == {accepted["id"]}
    assert events[-1]["data"]["data"]["reward"] == 1.0

    assert episode["status"] == "completed"
    assert episode["stop_reason"] == "stop"
    assert episode["error"] is None
    assert episode["reward"] == 1.0
    assert episode["reward_info"] == {"tool_said_42": 1.0}
    trajectory = episode["trajectory"]
    assert trajectory["id"] == episode["trajectory_id"]
    assert trajectory["meta"]["episode_id"] == accepted["id"]
    assert trajectory["meta"]["run_id"] == "api"
    calls = trajectory["meta"]["tool_calls"]
    assert calls[0]["name"] == "python"
    assert calls[0]["output"].strip() == "42"
    assert len(trajectory["meta"]["turns"]) == episode["num_turns"] >= 2
    n = len(trajectory["input_ids"])
    assert len(trajectory["loss_mask"]) == len(trajectory["rollout_logprobs"]) == n
    assert episode["response_length"] == n - trajectory["prompt_length"]
    assert episode["timings"]["total"] > 0


async def test_resuming_with_last_event_id_replays_only_later_events(
    run_settings, serve_api, read_events, episode_body, problem
):
    async with (
        serve_api(run_settings()) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        accepted = (await client.post("/v1/episodes", json=episode_body())).json()
        everything = await follow(client, accepted["events_href"], read_events)
        cut = everything[1]["id"]
        rest = await follow(client, accepted["events_href"], read_events, {"Last-Event-ID": cut})
        last = everything[-1]["id"]
        nothing = await follow(
            client, accepted["events_href"], read_events, {"Last-Event-ID": last}
        )
        bad = await client.get(accepted["events_href"], headers={"Last-Event-ID": "soon"})
    assert [e["id"] for e in rest] == [e["id"] for e in everything[2:]]
    assert nothing == []
    assert problem(bad, 422)["errors"][0]["field"] == "Last-Event-ID"


async def test_cancelling_a_running_episode_ends_its_task_and_its_stream(
    run_settings, serve_api, read_events, episode_body
):
    async with (
        serve_api(run_settings()) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        accepted = (await client.post("/v1/episodes", json=episode_body(agent="waiter"))).json()
        seen: list[dict[str, Any]] = []
        async with (
            asyncio.timeout(60),
            client.stream("GET", accepted["events_href"]) as response,
        ):
            async for event in read_events(response):
                seen.append(event)
                if event["event"] == "turn":
                    # Live: the agent now waits 60 s on its environment.
                    cancelled = await client.post(f"{accepted['href']}/cancel")
                    assert cancelled.status_code == 200
                    assert cancelled.json()["status"] == "cancelled"
        # The worker stores what ran once its task has ended.
        for _ in range(600):
            episode = (await client.get(accepted["href"])).json()
            if episode["trajectory"] is not None:
                break
            await asyncio.sleep(0.05)
        metrics = (await client.get("/metrics")).text
    assert seen[-1]["data"]["data"]["status"] == "cancelled"
    assert episode["status"] == "cancelled"
    assert episode["reward"] is None
    trajectory = episode["trajectory"]
    assert trajectory["meta"]["stop_reason"] == "cancelled"
    assert len(trajectory["meta"]["turns"]) == 1
    assert sum(trajectory["loss_mask"]) == trajectory["meta"]["turns"][0]["num_sampled"] > 0
    assert "omniloop_worker_episodes_running 0.0" in metrics
    assert 'omniloop_worker_episodes_finished_total{status="cancelled"} 1.0' in metrics


async def test_at_most_concurrency_episodes_run_at_once(run_settings, open_api, episode_body):
    async with open_api(run_settings(concurrency=2)) as api:
        hrefs = [
            (await api.post("/v1/episodes", json=episode_body(agent="waiter"))).json()["href"]
            for _ in range(3)
        ]
        await wait_for_status(api, hrefs[0], "running")
        await wait_for_status(api, hrefs[1], "running")
        await asyncio.sleep(0.5)
        assert (await api.get(hrefs[2])).json()["status"] == "queued"
        # A slot frees up: the queued one starts.
        await api.post(f"{hrefs[0]}/cancel")
        await wait_for_status(api, hrefs[2], "running")
        for href in hrefs[1:]:
            await api.post(f"{href}/cancel")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_engine_failure_fails_the_episode_with_the_error_and_no_reward(
    make_settings, open_api, episode_body
):
    engine = {"url": f"http://127.0.0.1:{closed_port()}", "model": "tiny"}
    async with open_api(make_settings(concurrency=1, engine=engine)) as api:
        href = (await api.post("/v1/episodes", json=episode_body())).json()["href"]
        episode = await wait_for_status(api, href, "completed", "failed", "cancelled")
        failed = (await api.get("/v1/episodes", params={"error_type": "EngineError"})).json()
    assert episode["status"] == "failed"
    assert episode["stop_reason"] == "engine_error"
    assert episode["error"]["type"] == "EngineError"
    assert episode["error"]["message"]
    # An infrastructure failure is recorded, never scored as a zero reward.
    assert episode["reward"] is None
    assert episode["trajectory"]["meta"]["error"]["type"] == "EngineError"
    assert [e["href"] for e in failed["items"]] == [href]


async def test_a_bug_in_an_agent_fails_that_episode_and_the_worker_goes_on(
    run_settings, open_api, episode_body
):
    async with open_api(run_settings()) as api:
        broken = (await api.post("/v1/episodes", json=episode_body(agent="broken"))).json()
        fine = (await api.post("/v1/episodes", json=episode_body())).json()
        broken_episode = await wait_for_status(api, broken["href"], "completed", "failed")
        fine_episode = await wait_for_status(api, fine["href"], "completed", "failed")
        ready = await api.get("/readyz")
    assert broken_episode["status"] == "failed"
    assert broken_episode["error"] == {"type": "RuntimeError", "message": "the agent has a bug"}
    assert broken_episode["reward"] is None
    assert fine_episode["status"] == "completed"
    assert ready.json()["checks"]["worker"] == "running"


async def test_stopping_the_server_requeues_running_episodes(
    run_settings, make_settings, open_api, episode_body
):
    settings = run_settings()
    async with open_api(settings) as api:
        href = (await api.post("/v1/episodes", json=episode_body(agent="waiter"))).json()["href"]
        await wait_for_status(api, href, "running")
    async with open_api(make_settings()) as api:
        episode = (await api.get(href)).json()
    assert episode["status"] == "queued"
    assert episode["started_at"] is None


async def test_a_restart_requeues_what_a_dead_server_left_running(make_settings, open_api):
    settings = make_settings()
    store = Store(settings.db_url)
    store.migrate()
    orphan, _ = store.create_episode({"id": "t", "prompt": "hi"}, agent="calc")
    in_run, _ = store.create_episode({"id": "t"}, run_id=store.create_run().id, agent="calc")
    assert store.claim_next_episode().id == orphan.id
    assert store.claim_next_episode().id == in_run.id
    store.close()
    async with open_api(settings) as api:
        orphan_now = (await api.get(f"/v1/episodes/{orphan.id}")).json()
        in_run_now = (await api.get(f"/v1/episodes/{in_run.id}")).json()
    assert orphan_now["status"] == "queued"
    # A training run's episode belongs to its run's rollout workers, not to the API.
    assert in_run_now["status"] == "running"


async def test_readyz_is_503_when_the_worker_cannot_start(make_settings, open_api, problem):
    engine = {"url": "http://127.0.0.1:9", "model": "/nonexistent/model"}
    async with open_api(make_settings(concurrency=1, engine=engine)) as api:
        async with asyncio.timeout(30):
            # The worker fails in the background, after start-up: poll until readyz sees it.
            while (response := await api.get("/readyz")).status_code == 200:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        health = await api.get("/healthz")
    doc = problem(response, 503)
    assert doc["type"] == "urn:omniloop:problem:not-ready"
    assert doc["checks"]["database"] == "ok"
    assert doc["checks"]["worker"] == "failed"
    assert "worker_error" in doc["checks"]
    assert health.json() == {"status": "ok"}
