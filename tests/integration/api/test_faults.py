"""A run's fault timeline: `GET /v1/runs/{run_id}/faults` and the fault series of `/metrics`.

Faults are seeded the way a training run records them: `Fault.to_json()` of the control
plane's timeline, with the step, as a run event of type `fault`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from omniloop.platform.api import create_app
from omniloop.platform.control.faults import Fault
from omniloop.platform.store import FAULT_EVENT, Store

DETECTED = 1_796_140_971.39
"""A unix time (2026-12-01) the seeded faults are detected around."""
TOKEN = "test-token-0123456789abcdef"


def _fault(
    step: int,
    role: str,
    replica: str,
    *,
    after: float,
    down_for: float | None,
    retried: list[str],
) -> dict[str, Any]:
    detected = DETECTED + after
    fault = Fault(
        role=role,
        replica=replica,
        cause="ActorDiedError: The actor died unexpectedly before finishing this task.",
        detected_at=detected,
        recovered_at=None if down_for is None else detected + down_for,
        retried=retried,
    )
    return {"step": step, **fault.to_json()}


FAULTS = [
    _fault(
        1, "rollout", "a1b2c3d4e5f6a7b8c9d0", after=0, down_for=3.5, retried=["step 1 episode 4"]
    ),
    _fault(
        3,
        "advantage",
        "7806e8f1aa",
        after=60,
        down_for=7.25,
        retried=["step 3 advantages", "step 3 advantages"],
    ),
    _fault(4, "rollout", "", after=90, down_for=12.0, retried=[]),
    _fault(5, "actor", "ffee01", after=120, down_for=None, retried=["step 5 train"]),
]


def _seed(store: Store, run_id: str, faults: list[dict[str, Any]]) -> list[int]:
    """Record `faults` for `run_id`, with episode events between them (which the listing must
    leave out); return the fault events' ids."""
    episode, _ = store.create_episode({"prompt": "?"}, run_id=run_id)
    ids = []
    for n, data in enumerate(faults):
        store.append_event("turn", {"turn": n}, episode_id=episode.id)
        ids.append(store.record_run_event(run_id, FAULT_EVENT, data))
    return ids


@pytest.fixture
def seeded(make_settings):
    """Settings whose database holds run `train` (running, with `FAULTS`) and `quiet` (none)."""
    settings = make_settings()
    with Store(settings.db_url) as store:
        store.migrate()
        store.create_run("train", {"steps": 10}, run_id="train", status="running")
        store.create_run("quiet", run_id="quiet")
        ids = _seed(store, "train", FAULTS)
    return settings, ids


def _at(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC)


async def test_faults_are_listed_oldest_first_with_every_field(seeded, open_api):
    settings, ids = seeded
    async with open_api(settings) as api:
        run = (await api.get("/v1/runs/train")).json()
        response = await api.get(run["faults_href"])
        quiet = (await api.get("/v1/runs/quiet/faults")).json()
    assert run["faults_href"] == "/v1/runs/train/faults"
    doc = response.json()
    assert response.status_code == 200
    assert "link" not in response.headers
    assert (doc["run_id"], doc["next_cursor"], doc["next"]) == ("train", None, None)
    items = doc["items"]
    assert [f["id"] for f in items] == ids
    assert [(f["step"], f["role"]) for f in items] == [
        (1, "rollout"),
        (3, "advantage"),
        (4, "rollout"),
        (5, "actor"),
    ]
    first = items[0]
    assert set(first) == {
        "id",
        "fault_id",
        "step",
        "role",
        "replica",
        "cause",
        "detected_at",
        "recovered_at",
        "recovery_seconds",
        "retried",
        "recorded_at",
    }
    assert first["fault_id"] == FAULTS[0]["fault_id"]
    assert len({f["fault_id"] for f in items}) == len(items)
    assert first["replica"] == "a1b2c3d4e5f6a7b8c9d0"
    assert first["cause"] == FAULTS[0]["cause"]
    assert datetime.fromisoformat(first["detected_at"]) == _at(FAULTS[0]["detected_at"])
    assert datetime.fromisoformat(first["recovered_at"]) == _at(FAULTS[0]["recovered_at"])
    assert first["recovery_seconds"] == pytest.approx(3.5)
    assert first["retried"] == ["step 1 episode 4"]
    assert datetime.fromisoformat(first["recorded_at"]).tzinfo is not None
    assert items[1]["retried"] == ["step 3 advantages", "step 3 advantages"]
    # A fault the health monitor saw before any call named a replica.
    assert items[2]["replica"] is None
    # Still down when recorded.
    down = items[3]
    assert (down["recovered_at"], down["recovery_seconds"]) == (None, None)
    assert quiet == {"run_id": "quiet", "items": [], "next_cursor": None, "next": None}


async def test_faults_are_paginated_and_polled_after_the_newest_seen(seeded, open_api, problem):
    settings, ids = seeded
    async with open_api(settings) as api:
        first = await api.get("/v1/runs/train/faults", params={"limit": 3})
        second = await api.get(first.json()["next"])
        by_cursor = await api.get(
            "/v1/runs/train/faults", params={"limit": 3, "cursor": first.json()["next_cursor"]}
        )
        polled = (await api.get("/v1/runs/train/faults", params={"cursor": ids[-1]})).json()
        with Store(settings.db_url) as store:
            late = store.record_run_event(
                "train",
                FAULT_EVENT,
                _fault(6, "rollout", "0badcafe", after=200, down_for=1.0, retried=[]),
            )
        again = (await api.get("/v1/runs/train/faults", params={"cursor": ids[-1]})).json()
        problem(await api.get("/v1/runs/train/faults", params={"cursor": "0"}), 422)
        problem(await api.get("/v1/runs/train/faults", params={"cursor": "x"}), 422)
        problem(await api.get("/v1/runs/train/faults", params={"limit": 0}), 422)
        problem(await api.get("/v1/runs/train/faults", params={"limit": 201}), 422)
    page = first.json()
    assert [f["id"] for f in page["items"]] == ids[:3]
    assert page["next_cursor"] == str(ids[2])
    assert page["next"] == f"/v1/runs/train/faults?limit=3&cursor={ids[2]}"
    assert first.headers["link"] == f'<{page["next"]}>; rel="next"'
    assert [f["id"] for f in second.json()["items"]] == ids[3:]
    assert second.json()["next"] is None
    assert by_cursor.json() == second.json()
    assert polled["items"] == []
    assert [(f["id"], f["step"]) for f in again["items"]] == [(late, 6)]


async def test_an_unknown_run_is_a_404_problem(seeded, open_api, problem):
    settings, _ = seeded
    async with open_api(settings) as api:
        missing = await api.get("/v1/runs/nope/faults")
        past_the_end = await api.get("/v1/runs/nope/faults", params={"cursor": "99"})
    doc = problem(missing, 404)
    assert (doc["type"], doc["detail"]) == (
        "urn:omniloop:problem:not-found",
        "run 'nope' does not exist",
    )
    problem(past_the_end, 404)


async def test_a_fault_event_of_another_shape_reads_with_nulls(make_settings, open_api):
    settings = make_settings()
    with Store(settings.db_url) as store:
        store.migrate()
        store.create_run(run_id="odd")
        store.record_run_event("odd", FAULT_EVENT, {"cause": 42, "step": True, "retried": "x"})
        store.record_run_event(
            "odd",
            FAULT_EVENT,
            {"role": "rollout", "detected_at": 1e300, "retried": ["a", 3], "step": 2},
        )
    async with open_api(settings) as api:
        response = await api.get("/v1/runs/odd/faults")
    assert response.status_code == 200, response.text
    bare, huge = response.json()["items"]
    assert {k: v for k, v in bare.items() if k not in ("id", "recorded_at")} == {
        "fault_id": None,
        "step": None,
        "role": "unknown",
        "replica": None,
        "cause": None,
        "detected_at": None,
        "recovered_at": None,
        "recovery_seconds": None,
        "retried": [],
    }
    assert (huge["role"], huge["step"], huge["detected_at"]) == ("rollout", 2, None)
    assert huge["retried"] == ["a"]


async def test_beyond_loopback_the_faults_need_the_token(make_settings, open_api, problem):
    settings = make_settings(host="0.0.0.0", api_token=TOKEN)
    with Store(settings.db_url) as store:
        store.migrate()
        store.create_run(run_id="train")
        _seed(store, "train", FAULTS[:1])
    async with open_api(settings, create_app(settings)) as api:
        refused = await api.get("/v1/runs/train/faults")
        wrong = await api.get(
            "/v1/runs/train/faults", headers={"Authorization": "Bearer not-the-token-0123"}
        )
        allowed = await api.get(
            "/v1/runs/train/faults", headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert problem(refused, 401)["type"] == "urn:omniloop:problem:unauthorized"
    problem(wrong, 401)
    assert [f["role"] for f in allowed.json()["items"]] == ["rollout"]


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """`{(run_id, role): value}` of the exposition's samples of `name`."""
    found = {}
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            pairs = dict(p.split("=", 1) for p in labels.split(","))
            found[(pairs["run_id"].strip('"'), pairs["role"].strip('"'))] = float(value)
    return found


async def test_prometheus_exports_faults_per_role_of_running_and_recent_runs(
    make_settings, open_api
):
    settings = make_settings(metrics_recent_runs=1)
    with Store(settings.db_url) as store:
        store.migrate()
        store.create_run(run_id="old", status="completed")
        store.create_run(run_id="live", status="running")
        store.create_run(run_id="done", status="failed")
        _seed(store, "old", FAULTS)
        _seed(store, "live", FAULTS)
        _seed(store, "done", FAULTS[1:2])
    async with open_api(settings) as api:
        first = (await api.get("/metrics")).text
        with Store(settings.db_url) as store:
            # `live` finishes and a newer run starts: `live` is neither running nor the newest.
            store.update_run_status("live", "completed")
            store.create_run(run_id="next", status="running")
            store.record_run_event(
                "next", FAULT_EVENT, _fault(0, "actor", "01", after=0, down_for=2.0, retried=[])
            )
        second = (await api.get("/metrics")).text
    assert "# TYPE omniloop_run_faults_total counter" in first
    assert "# TYPE omniloop_run_fault_recovery_seconds gauge" in first
    # `old` is neither running nor among the newest one: left out.
    assert _samples(first, "omniloop_run_faults_total") == {
        ("live", "actor"): 1,
        ("live", "advantage"): 1,
        ("live", "rollout"): 2,
        ("done", "advantage"): 1,
    }
    # The newest recovered fault of each role; the actor's only fault is still down.
    assert _samples(first, "omniloop_run_fault_recovery_seconds") == {
        ("live", "advantage"): pytest.approx(7.25),
        ("live", "rollout"): pytest.approx(12.0),
        ("done", "advantage"): pytest.approx(7.25),
    }
    assert _samples(second, "omniloop_run_faults_total") == {("next", "actor"): 1}
    assert _samples(second, "omniloop_run_fault_recovery_seconds") == {
        ("next", "actor"): pytest.approx(2.0)
    }


async def test_a_fault_is_listed_when_detected_and_again_when_recovered(make_settings, open_api):
    settings = make_settings()
    detected = Fault(
        role="reward", replica="", cause="2 of 2 replicas running: x", detected_at=DETECTED
    )
    with Store(settings.db_url) as store:
        store.migrate()
        store.create_run(run_id="live", status="running")
        store.record_run_event("live", FAULT_EVENT, {"step": 2, **detected.to_json()})
    async with open_api(settings) as api:
        down = (await api.get("/v1/runs/live/faults")).json()["items"]
        count_down = _samples((await api.get("/metrics")).text, "omniloop_run_faults_total")
        detected.recovered_at = DETECTED + 4.0
        detected.retried.append("step 2 episode 3")
        with Store(settings.db_url) as store:
            store.record_run_event("live", FAULT_EVENT, {"step": 2, **detected.to_json()})
        after = (await api.get("/v1/runs/live/faults", params={"cursor": down[-1]["id"]})).json()
        count_up = _samples((await api.get("/metrics")).text, "omniloop_run_faults_total")
        recovery = _samples((await api.get("/metrics")).text, "omniloop_run_fault_recovery_seconds")
    [before] = down
    assert (before["recovered_at"], before["recovery_seconds"]) == (None, None)
    [recovered] = after["items"]
    assert recovered["fault_id"] == before["fault_id"] == detected.fault_id
    assert recovered["recovery_seconds"] == pytest.approx(4.0)
    assert recovered["retried"] == ["step 2 episode 3"]
    # Counted once, down or recovered.
    assert count_down == count_up == {("live", "reward"): 1}
    assert recovery == {("live", "reward"): pytest.approx(4.0)}
