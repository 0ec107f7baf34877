"""Submitting, reading and listing episodes; input limits; problem documents.

The worker is paused (concurrency 0) here: episodes stay queued, so every answer depends only
on what was submitted.
"""

from __future__ import annotations

import pytest

from omniloop.platform.store import Store


async def test_submit_answers_202_with_location_and_the_episode_is_queued(
    make_settings, open_api, episode_body
):
    async with open_api(make_settings()) as api:
        response = await api.post("/v1/episodes", json=episode_body(max_turns=1))
        assert response.status_code == 202
        accepted = response.json()
        assert accepted["created"] is True
        assert accepted["status"] == "queued"
        assert response.headers["location"] == f"/v1/episodes/{accepted['id']}"
        assert accepted["href"] == response.headers["location"]
        assert accepted["events_href"] == f"{accepted['href']}/events"

        detail = (await api.get(response.headers["location"])).json()
    assert detail["id"] == accepted["id"]
    assert detail["status"] == "queued"
    assert detail["agent"] == "calc"
    assert detail["run_id"] is None
    assert detail["reward"] is None
    assert detail["trajectory"] is None
    assert detail["error"] is None
    # The task id defaults to the episode id; the answer and metadata are kept as sent.
    assert detail["task"] == {
        "id": accepted["id"],
        "prompt": "What is 6 * 7?",
        "answer": "42",
        "metadata": {},
    }
    assert detail["max_turns"] == 1


async def test_request_sampling_overrides_only_the_fields_it_gives(
    make_settings, open_api, episode_body
):
    async with open_api(make_settings()) as api:
        accepted = (
            await api.post(
                "/v1/episodes", json=episode_body(sampling={"temperature": 0.5, "seed": 7})
            )
        ).json()
        detail = (await api.get(accepted["href"])).json()
    # The agent's configured defaults (max_new_tokens 8, stop id 198, 2 turns) fill the rest.
    assert detail["sampling"]["temperature"] == 0.5
    assert detail["sampling"]["seed"] == 7
    assert detail["sampling"]["max_new_tokens"] == 8
    assert detail["sampling"]["stop_token_ids"] == [198]
    assert detail["max_turns"] == 2


async def test_a_task_given_as_messages_and_with_its_own_id_is_kept(make_settings, open_api):
    task = {
        "id": "task-7",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "6 * 7?"},
        ],
        "metadata": {"level": 1},
    }
    async with open_api(make_settings()) as api:
        accepted = (await api.post("/v1/episodes", json={"agent": "calc", "task": task})).json()
        detail = (await api.get(accepted["href"])).json()
    assert detail["task"] == {**task, "answer": None}
    assert detail["task_id"] == "task-7"


async def test_unknown_episode_and_unknown_path_are_404_problems(make_settings, open_api, problem):
    async with open_api(make_settings()) as api:
        missing = problem(await api.get("/v1/episodes/nope"), 404)
        assert missing["type"] == "urn:omniloop:problem:not-found"
        assert "nope" in missing["detail"]
        route = problem(await api.get("/v1/nothing-here"), 404)
        assert route["type"] == "about:blank"
        problem(await api.post("/v1/episodes/nope/cancel"), 404)
        problem(await api.get("/v1/episodes/nope/events"), 404)


async def test_a_method_a_path_does_not_allow_is_a_405_problem(make_settings, open_api, problem):
    async with open_api(make_settings()) as api:
        response = await api.delete("/v1/episodes")
        doc = problem(response, 405)
    assert response.headers["allow"] == "GET, POST"
    assert "DELETE" in doc["detail"]


async def test_validation_problem_lists_every_bad_field(make_settings, open_api, problem):
    body = {
        "agent": "calc",
        "task": {"prompt": "", "colour": "red"},
        "sampling": {"temperature": -1, "top_p": 0},
        "max_turns": 0,
    }
    async with open_api(make_settings()) as api:
        doc = problem(await api.post("/v1/episodes", json=body), 422)
    assert doc["type"] == "urn:omniloop:problem:validation-error"
    fields = {(e["location"], e["field"]): e["type"] for e in doc["errors"]}
    assert fields == {
        ("body", "task.prompt.text"): "string_too_short",
        ("body", "task.colour"): "extra_forbidden",
        ("body", "sampling.temperature"): "greater_than_equal",
        ("body", "sampling.top_p"): "greater_than",
        ("body", "max_turns"): "greater_than_equal",
    }
    for error in doc["errors"]:
        assert error["message"]


async def test_malformed_json_and_a_wrong_prompt_type_are_clear_problems(
    make_settings, open_api, problem
):
    async with open_api(make_settings()) as api:
        broken = await api.post(
            "/v1/episodes", content=b'{"agent": ', headers={"content-type": "application/json"}
        )
        doc = problem(broken, 422)
        assert doc["errors"][0]["type"] == "json_invalid"
        wrong = await api.post("/v1/episodes", json={"agent": "calc", "task": {"prompt": 42}})
        doc = problem(wrong, 422)
    assert doc["errors"] == [
        {
            "location": "body",
            "field": "task.prompt",
            "message": "prompt must be a string or a list of chat messages",
            "type": "prompt_type",
        }
    ]


async def test_an_unknown_agent_is_a_validation_problem_naming_the_known_ones(
    make_settings, open_api, episode_body, problem
):
    async with open_api(make_settings()) as api:
        doc = problem(await api.post("/v1/episodes", json=episode_body(agent="nobody")), 422)
        listed = (await api.get("/v1/episodes")).json()
    assert doc["errors"][0]["field"] == "agent"
    assert doc["errors"][0]["type"] == "unknown_agent"
    assert "calc, waiter" in doc["errors"][0]["message"]
    assert listed["items"] == []


async def test_body_over_the_limit_is_413_whether_declared_or_streamed(
    make_settings, open_api, episode_body, problem
):
    settings = make_settings(limits={"max_body_bytes": 4096})
    big = episode_body(prompt="x" * 5000)
    async with open_api(settings) as api:
        response = await api.post("/v1/episodes", json=big)
        declared = problem(response, 413)
        # The rest of an oversized body is not read: the connection is closed instead.
        assert response.headers["connection"] == "close"
        assert declared["type"] == "urn:omniloop:problem:body-too-large"
        assert declared["max_bytes"] == 4096

        async def chunks():
            for _ in range(5):
                yield b" " * 1000
            yield b"{}"

        # No Content-Length: the body is counted as it arrives.
        streamed = await api.post(
            "/v1/episodes", content=chunks(), headers={"content-type": "application/json"}
        )
        problem(streamed, 413)
        small = await api.post("/v1/episodes", json=episode_body(prompt="x" * 3000))
        assert small.status_code == 202
        assert len((await api.get("/v1/episodes")).json()["items"]) == 1


@pytest.mark.parametrize(
    ("body", "field", "kind"),
    [
        ({"task": {"prompt": "x" * 100_001}}, "task.prompt.text", "string_too_long"),
        ({"task": {"prompt": "hi", "id": "i" * 129}}, "task.id", "string_too_long"),
        (
            {"task": {"prompt": [{"role": "user", "content": "hi"}] * 257}},
            "task.prompt.messages",
            "too_long",
        ),
        ({"task": {"prompt": "hi"}, "sampling": {"stop": ["s"] * 17}}, "sampling.stop", "too_long"),
        (
            {"task": {"prompt": "hi"}, "sampling": {"stop": ["s" * 257]}},
            "sampling.stop.0",
            "string_too_long",
        ),
        (
            {"task": {"prompt": "hi", "metadata": {str(i): i for i in range(65)}}},
            "task.metadata",
            "too_long",
        ),
        ({"agent": "a" * 65, "task": {"prompt": "hi"}}, "agent", "string_pattern_mismatch"),
    ],
)
async def test_string_and_list_limits_are_validation_problems(
    make_settings, open_api, problem, body, field, kind
):
    async with open_api(make_settings(limits={"max_body_bytes": 10_000_000})) as api:
        doc = problem(await api.post("/v1/episodes", json={"agent": "calc", **body}), 422)
    assert [(e["field"], e["type"]) for e in doc["errors"]] == [(field, kind)]


async def test_server_limits_on_tokens_and_turns_are_enforced(
    make_settings, open_api, episode_body, problem
):
    settings = make_settings(limits={"max_new_tokens": 64, "max_turns": 8})
    async with open_api(settings) as api:
        tokens = problem(
            await api.post("/v1/episodes", json=episode_body(sampling={"max_new_tokens": 65})),
            422,
        )
        turns = problem(await api.post("/v1/episodes", json=episode_body(max_turns=9)), 422)
        ok = await api.post(
            "/v1/episodes", json=episode_body(sampling={"max_new_tokens": 64}, max_turns=8)
        )
    assert tokens["errors"][0]["field"] == "sampling.max_new_tokens"
    assert "64" in tokens["errors"][0]["message"]
    assert turns["errors"][0]["field"] == "max_turns"
    assert ok.status_code == 202


async def test_list_filters_and_paginates_newest_first_with_next_links(
    make_settings, open_api, episode_body, problem
):
    settings = make_settings()
    async with open_api(settings) as api:
        ids = []
        for i in range(5):
            ids.append((await api.post("/v1/episodes", json=episode_body(f"q{i}"))).json()["id"])
        cancelled = ids[1]
        assert (await api.post(f"/v1/episodes/{cancelled}/cancel")).status_code == 200

        first = await api.get("/v1/episodes", params={"limit": 2})
        page = first.json()
        assert [e["id"] for e in page["items"]] == [ids[4], ids[3]]
        assert page["next"].startswith("/v1/episodes?")
        assert first.headers["link"] == f'<{page["next"]}>; rel="next"'
        seen = [e["id"] for e in page["items"]]
        while page["next"]:
            page = (await api.get(page["next"])).json()
            seen += [e["id"] for e in page["items"]]
        assert seen == ids[::-1]
        assert page["next_cursor"] is None

        queued = (await api.get("/v1/episodes", params={"status": "queued"})).json()
        assert {e["id"] for e in queued["items"]} == set(ids) - {cancelled}
        only = (await api.get("/v1/episodes", params={"status": "cancelled"})).json()
        assert [e["id"] for e in only["items"]] == [cancelled]
        # Summaries carry no trajectory; a filtered page keeps the filter in its next link.
        assert "trajectory" not in only["items"][0]
        two = (await api.get("/v1/episodes", params={"status": "queued", "limit": 2})).json()
        assert "status=queued" in two["next"]

        problem(await api.get("/v1/episodes", params={"cursor": "garbage"}), 422)
        problem(await api.get("/v1/episodes", params={"limit": 0}), 422)
        problem(await api.get("/v1/episodes", params={"limit": 201}), 422)
        problem(await api.get("/v1/episodes", params={"status": "sleeping"}), 422)
        problem(await api.get("/v1/episodes", params={"run_id": "no-such-run"}), 404)


async def test_list_filters_by_run_stop_reason_and_error_type(make_settings, open_api, tmp_path):
    settings = make_settings()
    store = Store(settings.db_url)
    store.migrate()
    store.create_run("train", run_id="r1")
    done, _ = store.create_episode({"id": "t"}, run_id="r1", agent="calc")
    failed, _ = store.create_episode({"id": "t"}, run_id="r1", agent="calc")
    store.update_episode_status(failed.id, "failed", error_type="EngineError", error_message="x")
    store.create_episode({"id": "t"}, agent="calc")
    store.close()
    async with open_api(settings) as api:
        in_run = (await api.get("/v1/episodes", params={"run_id": "r1"})).json()["items"]
        errored = (await api.get("/v1/episodes", params={"error_type": "EngineError"})).json()
        none = (await api.get("/v1/episodes", params={"stop_reason": "stop"})).json()
    assert {e["id"] for e in in_run} == {done.id, failed.id}
    assert [e["id"] for e in errored["items"]] == [failed.id]
    assert errored["items"][0]["error"] == {"type": "EngineError", "message": "x"}
    assert none["items"] == []


async def test_episode_ids_with_slashes_work_in_every_path(make_settings, open_api, read_events):
    # Training rollouts name episodes `step/task/sample`.
    settings = make_settings()
    store = Store(settings.db_url)
    store.migrate()
    store.create_run("train", run_id="r/1")
    store.create_episode({"id": "t0"}, run_id="r/1", agent="calc", episode_id="step3/t0/1")
    store.close()
    async with open_api(settings) as api:
        listed = (await api.get("/v1/episodes", params={"run_id": "r/1"})).json()["items"]
        assert listed[0]["href"] == "/v1/episodes/step3%2Ft0%2F1"
        detail = (await api.get(listed[0]["href"])).json()
        cancelled = (await api.post(f"{listed[0]['href']}/cancel")).json()
        stream = await api.get(listed[0]["events_href"])
        run = (await api.get("/v1/runs/r%2F1")).json()
        metrics = await api.get("/v1/runs/r%2F1/metrics")
    assert detail["id"] == "step3/t0/1"
    assert cancelled["status"] == "cancelled"
    assert [e["data"]["data"]["status"] async for e in read_events(stream)] == [
        "queued",
        "cancelled",
    ]
    assert run["id"] == "r/1"
    assert metrics.json() == {"run_id": "r/1", "metrics": {}}


async def test_cancel_a_queued_episode_then_again_then_not_a_completed_one(
    make_settings, open_api, episode_body, problem
):
    async with open_api(make_settings()) as api:
        accepted = (await api.post("/v1/episodes", json=episode_body())).json()
        first = await api.post(f"{accepted['href']}/cancel")
        again = await api.post(f"{accepted['href']}/cancel")
        assert first.status_code == again.status_code == 200
        assert first.json()["status"] == again.json()["status"] == "cancelled"
        assert (await api.get(accepted["href"])).json()["status"] == "cancelled"

    settings = make_settings()
    store = Store(settings.db_url)
    failed, _ = store.create_episode({"id": "t"}, agent="calc")
    store.update_episode_status(failed.id, "failed", error_type="EngineError")
    store.close()
    async with open_api(settings) as api:
        doc = problem(await api.post(f"/v1/episodes/{failed.id}/cancel"), 409)
    assert doc["type"] == "urn:omniloop:problem:invalid-transition"
    assert "failed" in doc["detail"]


async def test_agents_lists_names_tools_and_defaults(make_settings, open_api):
    async with open_api(make_settings()) as api:
        agents = (await api.get("/v1/agents")).json()["items"]
    assert [a["name"] for a in agents] == ["broken", "calc", "waiter"]
    calc = agents[1]
    assert calc["tools"] == ["python"]
    assert calc["description"] == "Runs print(6 * 7) in the sandbox."
    assert calc["max_turns"] == 2
    assert calc["sampling"]["stop_token_ids"] == [198]
    assert agents[2]["tools"] == []


@pytest.mark.parametrize(
    ("raw", "status", "field"),
    [
        (
            b'{"agent": "calc", "task": {"prompt": "x", "metadata": {"a": NaN}}}',
            422,
            "task.metadata",
        ),
        (b'{"agent": "calc", "task": {"prompt": "x", "answer": [-Infinity]}}', 422, "task.answer"),
        (b"[" * 50_000 + b"]" * 50_000, 400, None),
    ],
)
async def test_what_json_cannot_hold_is_refused(
    make_settings, open_api, problem, raw, status, field
):
    # Python's JSON parser reads NaN and Infinity; the API must not store them as if valid.
    async with open_api(make_settings()) as api:
        response = await api.post(
            "/v1/episodes", content=raw, headers={"content-type": "application/json"}
        )
        doc = problem(response, status)
        listed = (await api.get("/v1/episodes")).json()["items"]
    if field is not None:
        assert [e["field"] for e in doc["errors"]] == [field]
    assert listed == []
