"""Property fuzz from the app's own OpenAPI document (schemathesis): for generated valid and
invalid requests to every operation, no 5xx, and every response (status, content type, body,
headers) conforms to what the document promises.

Bounded: a few dozen examples per operation, the episode worker paused (episodes only queue),
and the event stream left out (for a queued episode it would wait for its end).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from omniloop.platform.api import ApiSettings, create_app
from omniloop.platform.store import Store

TOKEN = "fuzz-token-0123456789abcdef"
EXAMPLES = 20
"""Examples per operation and mode: a bounded run (about 400 requests in all)."""


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app under uvicorn in a thread (schemathesis calls it synchronously), with a run and
    an episode in its database so that generated ids sometimes hit something."""
    folder = tmp_path_factory.mktemp("fuzz")
    db_url = f"sqlite:///{folder / 'api.db'}"
    store = Store(db_url)
    store.migrate()
    store.create_run("fuzzed", run_id="r1")
    store.record_metrics("r1", 0, {"reward": 0.5})
    store.record_run_event("r1", "fault", {"step": 0, "role": "rollout", "retried": ["step 0"]})
    store.create_episode({"id": "t"}, run_id="r1", agent="calc", episode_id="e1")
    store.close()
    settings_ = ApiSettings.model_validate(
        {
            "db_url": db_url,
            "api_token": TOKEN,
            "concurrency": 0,
            "agents": {"calc": {"agent": f"{Path(__file__).parent / 'agents.py'}:tool_agent"}},
            "limits": {"max_body_bytes": 64 * 1024},
        }
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings_), host="127.0.0.1", port=0, log_level="error")
    )
    thread = threading.Thread(target=server.run, name="fuzzed-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "the API stopped before it started"
        assert time.monotonic() < deadline, "the API did not start within 60 s"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def api_schema(api_url: str) -> schemathesis.BaseSchema:
    # A body over the size limit is refused with 413, which is as much a rejection of bad
    # data as 422 is; schemathesis's default list of rejections leaves 413 out.
    rejections = ["400", "401", "404", "405", "409", "413", "415", "422"]
    config = schemathesis.Config.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": rejections}}}
    )
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json", config=config)
    return schema.exclude(path_regex=r".*/events$")


def operations(schema: schemathesis.BaseSchema) -> list[schemathesis.APIOperation]:
    return [result.ok() for result in schema.get_all_operations()]


def test_the_fuzz_covers_every_operation_but_the_stream(api_schema):
    labels = {operation.label for operation in operations(api_schema)}
    assert len(labels) == 13
    assert "POST /v1/episodes" in labels
    assert not any(label.endswith("/events") for label in labels)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_conforms_to_its_document(api_schema, mode):
    unsatisfiable: list[str] = []
    for operation in operations(api_schema):
        inputs = (operation.path_parameters, operation.query, operation.headers, operation.body)
        if mode == GenerationMode.NEGATIVE and not any(len(group) for group in inputs):
            continue  # nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def conforms(case: schemathesis.Case) -> None:
            if case.headers and "Idempotency-Key" in case.headers:
                # A fresh key per case: reusing one for another body is a 422 by design.
                case.headers["Idempotency-Key"] = uuid.uuid4().hex
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

        try:
            conforms()
        except Unsatisfiable:
            # Some inputs have no invalid form that survives the trip through a URL (a path
            # id whose only constraint a URL cannot break): nothing negative to send.
            if mode != GenerationMode.NEGATIVE:
                raise
            unsatisfiable.append(operation.label)
        except BaseException as err:
            err.add_note(f"while fuzzing {operation.label} ({mode} data)")
            raise
    assert len(unsatisfiable) <= 3, unsatisfiable
