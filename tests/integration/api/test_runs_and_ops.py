"""Runs, their metrics, and the operational endpoints (`/healthz`, `/readyz`, `/metrics`,
`/openapi.json`)."""

from __future__ import annotations

import math
from datetime import datetime

import pytest
from sqlalchemy import insert
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from omniloop.platform.api import create_app
from omniloop.platform.store import Store
from omniloop.platform.store.models import EpisodeRow, utcnow


@pytest.fixture
def seeded(make_settings):
    """Settings whose database holds three runs; `r2` has metrics over four steps."""
    settings = make_settings()
    store = Store(settings.db_url)
    store.migrate()
    store.create_run("first", {"lr": 1e-6}, run_id="r1")
    store.create_run("second", {"algo": "grpo"}, run_id="r2", status="running")
    store.create_run("third", run_id="r/3")
    for step in range(4):
        store.record_metrics("r2", step, {"reward": step / 10, "loss": 1.0 - step / 10})
    store.record_metrics("r2", 4, {"loss": math.nan, "kl": math.inf})
    store.close()
    return settings


async def test_runs_are_listed_newest_first_and_paginated(seeded, open_api, problem):
    async with open_api(seeded) as api:
        first = (await api.get("/v1/runs", params={"limit": 2})).json()
        second = (await api.get(first["next"])).json()
        running = (await api.get("/v1/runs", params={"status": "running"})).json()
        problem(await api.get("/v1/runs", params={"status": "asleep"}), 422)
        problem(await api.get("/v1/runs", params={"cursor": "-4"}), 422)
    assert [r["id"] for r in first["items"]] == ["r/3", "r2"]
    assert [r["id"] for r in second["items"]] == ["r1"]
    assert second["next"] is None
    assert [r["id"] for r in running["items"]] == ["r2"]


async def test_runs_carry_progress_reward_trend_errors_and_duration(make_settings, open_api):
    settings = make_settings()
    store = Store(settings.db_url)
    store.migrate()
    store.create_run("train", {"steps": 50, "model": "tiny"}, run_id="t")
    store.create_run("bare", {"steps": True}, run_id="b")  # not a number of steps
    for step in range(40):
        store.record_metrics("t", step, {"reward/mean": step / 40, "loss": 1.0})
    store.record_metrics("t", 40, {"reward/mean": math.nan})
    now = utcnow()
    rows = [
        {
            "id": f"e{n}",
            "run_id": "t",
            "status": "completed" if reason in ("stop", "length") else "failed",
            "task": {},
            "agent": "calc",
            "sampling": {},
            "reward_info": {},
            "timings": {},
            "stop_reason": reason,
            "created_at": now,
            "updated_at": now,
        }
        for n, reason in enumerate(["stop", "sandbox_error", "engine_error", "length"])
    ]
    with store.engine.begin() as conn:
        conn.execute(insert(EpisodeRow), rows)
    store.update_run_status("b", "completed")
    store.close()
    async with open_api(settings) as api:
        listed = {r["id"]: r for r in (await api.get("/v1/runs")).json()["items"]}
        one = (await api.get("/v1/runs/t")).json()
    train, bare = listed["t"], listed["b"]
    assert (train["steps_done"], train["steps_total"], train["infra_errors"]) == (41, 50, 2)
    assert train["latest_reward"] is None  # NaN at the newest step
    trend = train["reward_trend"]
    assert len(trend) == 32
    assert (trend[0], trend[-1]) == ({"step": 0, "value": 0.0}, {"step": 40, "value": None})
    assert all(p["value"] == p["step"] / 40 for p in trend[:-1])
    assert train["duration_seconds"] >= 0
    assert {k: v for k, v in one.items() if k != "duration_seconds"} == {
        k: v for k, v in train.items() if k != "duration_seconds"
    }
    assert (bare["steps_done"], bare["steps_total"], bare["latest_reward"]) == (0, None, None)
    assert (bare["reward_trend"], bare["infra_errors"]) == ([], 0)
    finished = datetime.fromisoformat(bare["finished_at"])
    created = datetime.fromisoformat(bare["created_at"])
    assert bare["duration_seconds"] == pytest.approx((finished - created).total_seconds())


async def test_a_run_has_its_config_and_links(seeded, open_api, problem):
    async with open_api(seeded) as api:
        run = (await api.get("/v1/runs/r1")).json()
        slashed = (
            await api.get(
                (await api.get("/v1/runs", params={"limit": 1})).json()["items"][0]["href"]
            )
        ).json()
        problem(await api.get("/v1/runs/nope"), 404)
        problem(await api.get("/v1/runs/nope/metrics"), 404)
        episodes = await api.get(run["episodes_href"])
    assert run["name"] == "first"
    assert run["config"] == {"lr": 1e-6}
    assert run["status"] == "created"
    assert run["metrics_href"] == "/v1/runs/r1/metrics"
    # Ids with a slash are escaped in links, and the links work.
    assert slashed["id"] == "r/3"
    assert episodes.status_code == 200
    assert episodes.json()["items"] == []


async def test_metrics_by_name_since_a_step_and_non_finite_values_as_null(
    seeded, open_api, problem
):
    async with open_api(seeded) as api:
        everything = (await api.get("/v1/runs/r2/metrics")).json()
        some = (await api.get("/v1/runs/r2/metrics", params={"names": "reward, kl"})).json()
        recent = (
            await api.get("/v1/runs/r2/metrics", params={"names": "loss", "since_step": 2})
        ).json()
        unknown = (await api.get("/v1/runs/r2/metrics", params={"names": "nothing"})).json()
        too_many = await api.get(
            "/v1/runs/r2/metrics", params={"names": ",".join(f"m{i}" for i in range(101))}
        )
    assert everything["run_id"] == "r2"
    assert sorted(everything["metrics"]) == ["kl", "loss", "reward"]
    assert [p["step"] for p in everything["metrics"]["reward"]] == [0, 1, 2, 3]
    assert [p["value"] for p in everything["metrics"]["reward"]] == [0.0, 0.1, 0.2, 0.3]
    assert sorted(some["metrics"]) == ["kl", "reward"]
    assert some["metrics"]["kl"][0]["value"] is None  # infinity
    assert [(p["step"], p["value"]) for p in recent["metrics"]["loss"]] == [(3, 0.7), (4, None)]
    assert unknown["metrics"] == {}
    assert problem(too_many, 422)["errors"][0]["field"] == "names"


async def test_long_series_are_decimated_to_max_points_keeping_spikes_and_the_newest(
    make_settings, open_api, problem
):
    settings = make_settings()
    with Store(settings.db_url) as store:
        store.migrate()
        store.create_run("long", run_id="long")
        for step in range(1000):
            store.record_metrics("long", step, {"errors": 9.0 if step == 617 else 0.0})
    async with open_api(settings) as api:
        full = (await api.get("/v1/runs/long/metrics")).json()["metrics"]["errors"]
        few = (await api.get("/v1/runs/long/metrics", params={"max_points": 50})).json()
        too_few = await api.get("/v1/runs/long/metrics", params={"max_points": 2})
    assert len(full) == 1000
    points = [(p["step"], p["value"]) for p in few["metrics"]["errors"]]
    assert 25 <= len(points) <= 50
    assert (617, 9.0) in points
    assert points[-1] == (999, 0.0)
    assert [step for step, _ in points] == sorted({step for step, _ in points})
    assert problem(too_few, 422)["errors"][0]["field"] == "max_points"


async def test_health_readiness_and_prometheus_metrics(make_settings, open_api, episode_body):
    async with open_api(make_settings()) as api:
        await api.post("/v1/episodes", json=episode_body())
        await api.get("/v1/episodes/missing")
        health = await api.get("/healthz")
        ready = await api.get("/readyz")
        metrics = await api.get("/metrics")
    assert health.json() == {"status": "ok"}
    assert ready.json() == {"status": "ready", "checks": {"database": "ok", "worker": "paused"}}
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'omniloop_episodes{status="queued"} 1.0' in text
    assert 'omniloop_api_episode_submissions_total{outcome="created"} 1.0' in text
    # Requests are labelled by route template, not by raw path.
    assert (
        'omniloop_api_requests_total{method="GET",route="/v1/episodes/{episode_id}",status="404"}'
        in text
    )
    assert 'omniloop_api_request_duration_seconds_bucket{le="0.05",method="POST"' in text
    assert "omniloop_worker_up 1.0" in text


async def test_the_openapi_document_describes_every_endpoint_and_problem(make_settings, open_api):
    async with open_api(make_settings()) as api:
        doc = (await api.get("/openapi.json")).json()
    paths = doc["paths"]
    assert sorted(paths) == [
        "/healthz",
        "/metrics",
        "/readyz",
        "/v1/agents",
        "/v1/episodes",
        "/v1/episodes/{episode_id}",
        "/v1/episodes/{episode_id}/cancel",
        "/v1/episodes/{episode_id}/events",
        "/v1/episodes/{episode_id}/media/{index}",
        "/v1/runs",
        "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/faults",
        "/v1/runs/{run_id}/metrics",
    ]
    assert "Problem" in doc["components"]["schemas"]
    for operations in paths.values():
        for operation in operations.values():
            default = operation["responses"]["default"]["content"]
            assert list(default) == ["application/problem+json"]
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    assert list(response["content"]) == ["application/problem+json"]
    submit = paths["/v1/episodes"]["post"]["responses"]
    assert "Location" in submit["202"]["headers"]
    assert (
        "text/event-stream"
        in paths["/v1/episodes/{episode_id}/events"]["get"]["responses"]["200"]["content"]
    )


async def test_extra_routes_serve_beside_the_api_which_keeps_precedence(
    make_settings, open_api, tmp_path, problem
):
    # How the dashboard plugs in: static files mounted at `/`.
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<h1>dashboard</h1>")
    mount = Mount("/", StaticFiles(directory=site, html=True))
    settings = make_settings()
    async with open_api(settings, create_app(settings, extra_routes=[mount])) as api:
        page = await api.get("/")
        listed = await api.get("/v1/episodes")
        missing = await api.get("/v1/no-such-thing")
        health = await api.get("/healthz")
    assert page.status_code == 200
    assert "dashboard" in page.text
    assert listed.json()["items"] == []
    assert health.json() == {"status": "ok"}
    assert problem(missing, 404)["type"] == "about:blank"
