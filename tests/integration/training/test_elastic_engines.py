"""Elastic rollout: an engine added to a running run over REST, then removed, costs nothing.

One real run of the toy task with the roles as services and one engine of its own. While it
trains, the test starts another engine (a process of its own, serving the run's model) and adds
it (`POST /v1/rollout/engines`) during step 1: it is answered only once the engine holds the
run's current weights and is in rotation, and rollouts send it requests. Once it has served
some (and not before step 3) it is removed (`DELETE`): it leaves the rotation, then the run;
it gets no more requests or weights. Before adding it, the test asks the api role's
OpenAI-compatible gateway for a completion, sampled by the run's engine. Beside that, as soon
as the run has its own engine, the test asks it to launch one more (`{"launch": true}`),
answered once that one is in rotation; once it has served and received later weights (and not
before step 6) it is removed too, and its process stops. The run completes with every episode
trained once and none lost to an engine error. The api role's `/metrics` shows each engine's
weight updates while it is in the run, and nothing of it after.

A run this short can outpace an engine launch on a busy machine, so a gate (`gated_rewards`)
holds its episodes: from step HOLD_UNTIL_LAUNCHED until the launched engine is in rotation,
then from step HOLD_UNTIL_REMOVED until both engines have been removed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.processes import free_port, stop_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 16
TASKS_PER_STEP = 4
SAMPLES = 4
ADD_AT, REMOVE_AT, REMOVE_LAUNCHED_AT = 1, 3, 6
HOLD_UNTIL_LAUNCHED, HOLD_UNTIL_REMOVED = 2, 12
GATED_REWARDS = Path(__file__).with_name("gated_rewards.py")
TOY_REWARD = f"{Path(__file__).parents[3] / 'examples/toy_tool/agent.py'}:found_the_treasure"


def generate_requests(log: Path) -> int:
    """`/generate` requests the engine answered (its access log)."""
    return sum("POST /generate" in line for line in log.read_text().splitlines())


def served_requests(url: str) -> float:
    """Requests the engine at `url` answered (its `/metrics`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "omniloop_engine_requests_total"
    )


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def weight_version(url: str) -> int:
    return int(httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"])


def engine_series(api: str) -> dict[str, dict[str, float]]:
    """The `omniloop_dcs_engine_*` samples of the api role's `/metrics`: engine -> name -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{api}/metrics", timeout=30).text
    series: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("omniloop_dcs_engine_"):
                name = sample.name.removeprefix("omniloop_dcs_engine_")
                series.setdefault(sample.labels["engine"], {})[name] = sample.value
    return series


@dataclass
class ElasticRun:
    run_dir: Path
    seen: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def errors_of(self, thread: str) -> list[str]:
        """What went wrong in the watcher thread `thread` (`add/remove`, `launch/remove`)."""
        return [e for e in self.errors if e.startswith(f"{thread}:")]


def _step_started(run_dir: Path, step: int) -> bool:
    written = run_dir / "trajectories" / f"step_{step}.jsonl"
    return written.is_file() and bool(written.read_text().strip())


def _wait_served_and_step(served: Callable[[], float], run_dir: Path, step: int) -> None:
    """Until an engine has served a request (`served()` > 0; at most 300 s), and until the run
    has started `step`."""
    deadline = time.monotonic() + 300
    while not served() and time.monotonic() < deadline:
        time.sleep(0.1)
    while not _step_started(run_dir, step):
        time.sleep(0.05)


def _ask_the_gateway(api: str) -> dict[str, Any]:
    """A completion from the api role's OpenAI-compatible gateway (the official client), and
    its session as the gateway recorded it."""
    client = openai.OpenAI(base_url=f"{api}/v1", api_key="no-token", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="toy", messages=[{"role": "user", "content": "Where is the treasure?"}],
        max_tokens=8, seed=3, timeout=120,
    )  # fmt: skip
    completion = raw.parse().model_dump()
    session = raw.headers["X-Omniloop-Session"]
    view = httpx.get(f"{api}/v1/sessions/{session}", timeout=30).json()
    return {"completion": completion, "session": view}


def _add_then_remove(elastic: ElasticRun, api: str, extra: str, log: Path) -> None:
    """During step ADD_AT add the engine at `extra`; once it has served, and not before step
    REMOVE_AT, remove it."""
    seen = elastic.seen
    try:
        while not _step_started(elastic.run_dir, ADD_AT):
            time.sleep(0.05)
        first = httpx.get(f"{api}/v1/rollout/engines", timeout=30).json()["engines"][0]["url"]
        seen["own"] = first
        seen["run_version_before_add"] = weight_version(first)
        seen["gateway"] = _ask_the_gateway(api)
        seen["run_version_after_gateway"] = weight_version(first)
        added = httpx.post(f"{api}/v1/rollout/engines", json={"url": extra}, timeout=300)
        seen["add"] = (added.status_code, added.json())
        seen["version_when_added"] = weight_version(extra)
        seen["listed_after_add"] = httpx.get(f"{api}/v1/rollout/engines", timeout=30).json()
        seen["series_after_add"] = engine_series(api)
        # Removed once it has served (rollouts read the rotation every 2 s, later on a loaded
        # machine), and not before step REMOVE_AT.
        _wait_served_and_step(lambda: generate_requests(log), elastic.run_dir, REMOVE_AT)
        seen["requests_before_remove"] = generate_requests(log)
        seen["series_before_remove"] = engine_series(api)
        unknown = httpx.delete(
            f"{api}/v1/rollout/engines", params={"url": "http://127.0.0.1:9"}, timeout=60
        )
        seen["remove_unknown"] = (unknown.status_code, unknown.json())
        removed = httpx.delete(
            f"{api}/v1/rollout/engines", params={"url": extra, "drain_s": 5}, timeout=300
        )
        seen["remove"] = (removed.status_code, removed.json())
        seen["listed_after_remove"] = httpx.get(f"{api}/v1/rollout/engines", timeout=30).json()
        seen["series_after_remove"] = engine_series(api)
        time.sleep(15)  # a request already on its way when the rotation changed has landed
        seen["requests_after_remove"] = generate_requests(log)
        seen["version_after_remove"] = weight_version(extra)
    except Exception as err:  # reported by the tests, not lost in this thread
        elastic.errors.append(f"add/remove: {err!r} after {sorted(seen)}")


def _launch_then_remove(elastic: ElasticRun, api: str) -> None:
    """As soon as the run has an engine, have it launch another; once that one has served,
    and not before step REMOVE_LAUNCHED_AT, remove it."""
    seen = elastic.seen
    try:
        while True:
            try:
                listed = httpx.get(f"{api}/v1/rollout/engines", timeout=30)
                if listed.status_code == 200 and listed.json()["engines"]:
                    break
            except httpx.HTTPError:
                pass  # the api role is not up yet
            time.sleep(0.2)
        launched = httpx.post(f"{api}/v1/rollout/engines", json={"launch": True}, timeout=300)
        seen["launch"] = (launched.status_code, launched.json())
        set_gate(elastic.run_dir, HOLD_UNTIL_REMOVED)
        url = launched.json()["url"]
        seen["launched_version_when_answered"] = weight_version(url)
        seen["series_after_launch"] = engine_series(api)
        _wait_served_and_step(lambda: served_requests(url), elastic.run_dir, REMOVE_LAUNCHED_AT)
        seen["launched_served"] = served_requests(url)
        seen["launched_version_before_remove"] = weight_version(url)
        removed = httpx.delete(
            f"{api}/v1/rollout/engines", params={"url": url, "drain_s": 5}, timeout=300
        )
        seen["remove_launched"] = (removed.status_code, removed.json())
        seen["launched_answers_after_remove"] = answers(url)
        seen["listed_after_remove_launched"] = httpx.get(
            f"{api}/v1/rollout/engines", timeout=30
        ).json()
        seen["series_after_remove_launched"] = engine_series(api)
    except Exception as err:  # reported by the tests, not lost in this thread
        elastic.errors.append(f"launch/remove: {err!r} after {sorted(seen)}")


def set_gate(run_dir: Path, step: int | None) -> None:
    """Hold the episodes of `step` and later (`gated_rewards`); None: hold none."""
    gate = run_dir / "gate"
    if step is None:
        gate.unlink(missing_ok=True)
        return
    staged = gate.with_suffix(".tmp")
    staged.write_text(str(step))
    staged.replace(gate)  # never a half-written gate


def _release_when_done(elastic: ElasticRun, watchers: list[threading.Thread]) -> None:
    """Open the gate once both watchers are done (or failed)."""
    for watcher in watchers:
        watcher.join()
    set_gate(elastic.run_dir, None)


@pytest.fixture(scope="module")
def elastic_run(toy_config: Any, toy_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    run_dir = tmp_path_factory.mktemp("elastic")
    shutil.copy(GATED_REWARDS, run_dir / GATED_REWARDS.name)
    set_gate(run_dir, HOLD_UNTIL_LAUNCHED)
    port = free_port()
    config = toy_config(
        run_dir,
        {
            "steps": STEPS,
            "tasks_per_step": TASKS_PER_STEP,
            "rollout.samples_per_task": SAMPLES,
            "max_staleness": 1,
            "services.mode": "services",
            "services.api_port": port,
            "rollout.rewards": [
                TOY_REWARD,
                f"{run_dir / GATED_REWARDS.name}:hold",
            ],
        },
    )
    log = run_dir / "extra-engine.log"
    engine_port = free_port()
    extra = f"http://127.0.0.1:{engine_port}"
    cmd = [
        sys.executable, "-m", "omniloop", "engine", "serve", "--model", str(toy_model),
        "--port", str(engine_port), "--threads", "1", "--log-level", "info",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    elastic = ElasticRun(run_dir)
    try:
        api = f"http://127.0.0.1:{port}"
        watchers = [
            threading.Thread(target=_add_then_remove, args=(elastic, api, extra, log)),
            threading.Thread(target=_launch_then_remove, args=(elastic, api)),
        ]
        for watcher in watchers:
            watcher.start()
        releaser = threading.Thread(target=_release_when_done, args=(elastic, watchers))
        releaser.start()
        try:
            asyncio.run(run(config))
        finally:
            set_gate(run_dir, None)
            for watcher in [*watchers, releaser]:
                watcher.join(timeout=120)
        elastic.seen["requests_at_end"] = generate_requests(log)
        elastic.seen["version_at_end"] = weight_version(extra)
        yield elastic, extra
    finally:
        stop_process(proc)


def test_the_added_engine_held_the_current_weights_and_was_in_rotation_when_answered(
    elastic_run: Any,
) -> None:
    elastic, extra = elastic_run
    assert not elastic.errors_of("add/remove"), elastic.seen
    seen = elastic.seen
    status, body = seen["add"]
    assert status == 201, body
    assert (body["url"], body["in_rotation"]) == (extra, True)
    assert body["weight_version"] == seen["version_when_added"] >= seen["run_version_before_add"]
    listed = seen["listed_after_add"]["engines"]
    # The run's own engine and the added one serve; the engine the other watcher has the run
    # launch may be listed too, still being given the current weights (not in rotation yet).
    assert {seen["own"], extra} <= {e["url"] for e in listed if e["in_rotation"]}


def test_the_api_role_answers_openai_clients_from_the_runs_engines(elastic_run: Any) -> None:
    elastic, _ = elastic_run
    assert not elastic.errors_of("add/remove"), elastic.seen
    seen = elastic.seen
    completion, view = seen["gateway"]["completion"], seen["gateway"]["session"]
    (choice,) = completion["choices"]
    sampled = choice["token_ids"]
    assert 0 < len(sampled) <= 8
    # Sampled by the run's engine at the weights it held then.
    version = completion["omniloop"]["weight_version"]
    assert seen["run_version_before_add"] <= version <= seen["run_version_after_gateway"]
    (trajectory,) = view["trajectories"]
    assert trajectory["input_ids"][-len(sampled) :] == sampled


def test_rollouts_sent_the_added_engine_requests_until_it_was_removed(elastic_run: Any) -> None:
    elastic, extra = elastic_run
    seen = elastic.seen
    assert seen["requests_before_remove"] > 0
    assert seen["remove"] == (200, {"url": extra, "removed": True})
    listed = [e["url"] for e in seen["listed_after_remove"]["engines"]]
    assert extra not in listed
    assert seen["own"] in listed
    # Gone from the run: no more requests, no more weights.
    assert seen["requests_at_end"] == seen["requests_after_remove"]
    assert seen["version_at_end"] == seen["version_after_remove"]


def test_a_launched_engine_served_with_the_current_weights_and_stopped_when_removed(
    elastic_run: Any,
) -> None:
    elastic, extra = elastic_run
    assert not elastic.errors_of("launch/remove"), elastic.seen
    seen = elastic.seen
    status, body = seen["launch"]
    assert status == 201, body
    launched = body["url"]
    assert launched not in (extra, seen["own"])
    assert body["in_rotation"] is True
    assert seen["launched_version_when_answered"] >= body["weight_version"]
    assert seen["series_after_launch"][launched]["in_rotation"] == 1
    # It served, and the run's later weights reached it.
    assert seen["launched_served"] > 0
    assert seen["launched_version_before_remove"] > body["weight_version"]
    assert seen["remove_launched"] == (200, {"url": launched, "removed": True})
    assert not seen["launched_answers_after_remove"]  # its replica stopped it
    listed = [e["url"] for e in seen["listed_after_remove_launched"]["engines"]]
    assert launched not in listed
    assert seen["own"] in listed
    assert set(seen["series_after_remove_launched"]) == set(listed)


def test_metrics_show_each_engines_weight_updates_while_it_is_in_the_run(
    elastic_run: Any,
) -> None:
    elastic, extra = elastic_run
    seen = elastic.seen
    assert seen["series_after_add"][extra]["in_rotation"] == 1
    first = seen["own"]
    # By step 3 the run's own engine has had at least two updates, all of the same size.
    engine = seen["series_before_remove"][first]
    assert engine["in_rotation"] == 1
    assert engine["updates_total"] >= 2
    assert engine["update_bytes_total"] > 0
    assert engine["update_bytes_total"] % engine["updates_total"] == 0
    assert 0 < engine["last_update_seconds"] <= engine["update_seconds_total"]
    assert engine["weight_version"] >= 1
    assert extra not in seen["series_after_remove"]
    assert first in seen["series_after_remove"]


def test_the_run_lost_no_episode_and_trained_each_once(elastic_run: Any) -> None:
    elastic, _ = elastic_run
    trained = read_jsonl(elastic.run_dir / "trained.jsonl")
    ids = [traj_id for step in trained for traj_id, _ in step["samples"]]
    assert len(ids) == len(set(ids)) == STEPS * TASKS_PER_STEP * SAMPLES
    for path in (elastic.run_dir / "trajectories").glob("step_*.jsonl"):
        stops = [t["meta"]["stop_reason"] for t in read_jsonl(path)]
        assert "engine_error" not in stops, path.name


def test_bad_requests_are_problems(elastic_run: Any) -> None:
    elastic, _ = elastic_run
    status, body = elastic.seen["remove_unknown"]
    assert status == 404
    assert body["type"] == "urn:omniloop:problem:no-such-engine"
    assert "http://127.0.0.1:9" in body["detail"]

    # Without an actor behind it (the run has ended), and with a bad body.
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from omniloop.platform.api.problems import install_problem_handlers
    from omniloop.platform.control.engine_routes import engine_router

    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(engine_router())
    with TestClient(app) as client:
        bad = client.post("/v1/rollout/engines", json={"url": "not a url"})
        assert bad.status_code == 422
        assert "url" in bad.text
        for both_or_neither in ({"url": "http://127.0.0.1:9", "launch": True}, {}):
            bad = client.post("/v1/rollout/engines", json=both_or_neither)
            assert bad.status_code == 422
            assert '"launch": true' in bad.json()["detail"]
        assert client.get("/v1/rollout/engines").status_code == 503
