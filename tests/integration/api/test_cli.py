"""`omniloop serve` as a real process and `omniloop episode submit|get|watch|cancel` against it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

TOKEN = "cli-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_engine_url) -> Iterator[str]:
    """`omniloop serve` with a token, on a free loopback port; yields its URL."""
    from omniloop.platform.api.settings import ApiSettings

    folder = tmp_path_factory.mktemp("serve")
    here = Path(__file__).parent
    sampling = {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [198]}
    config = {
        "agents": {
            "calc": {
                "agent": f"{here / 'agents.py'}:tool_agent",
                "rewards": [f"{here / 'agents.py'}:tool_said_42"],
                "sampling": sampling,
                "max_turns": 2,
            },
            "waiter": {"agent": f"{here / 'agents.py'}:waiting_agent", "sampling": sampling},
        },
        "engine": {"url": tiny_engine_url, "model": "tiny"},
        "sandbox": {"backend": "bwrap", "pool_size": 1},
        "concurrency": 2,
        "poll_interval": 0.2,
    }
    ApiSettings.model_validate({**config, "api_token": TOKEN})  # the file itself is valid
    path = folder / "api.yaml"
    path.write_text(yaml.safe_dump(config))
    log = folder / "serve.log"
    env = {**os.environ, "OMNILOOP_API_TOKEN": TOKEN}
    cmd = [
        sys.executable, "-m", "omniloop", "serve", "--config", str(path), "--port", "0",
        "--db-url", f"sqlite:///{folder / 'api.db'}", "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            text = log.read_text()
            if "omniloop api ready at " in text:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"omniloop serve did not start:\n{text}")
            time.sleep(0.1)
        yield text.split("omniloop api ready at ", 1)[1].split()[0]
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert proc.wait(timeout=30) == -signal.SIGTERM, log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def episode(server: str, *args: str, token: str | None = TOKEN) -> Result:
    """Run `omniloop episode ARGS` in this process (the server is a real process)."""
    from omniloop.cli import app

    env = {"OMNILOOP_API_URL": server, "OMNILOOP_API_TOKEN": token}
    return CliRunner().invoke(app, ["episode", *args], env=env)


def documents(stdout: str) -> list[Any]:
    """The JSON documents printed one after another (indented or one per line)."""
    decoder = json.JSONDecoder()
    docs, at = [], 0
    while at < len(stdout):
        if stdout[at].isspace():
            at += 1
            continue
        doc, at = decoder.raw_decode(stdout, at)
        docs.append(doc)
    return docs


def test_submit_watch_and_get_an_episode(server):
    # The installed entry point, as a user runs it; the other calls run in this process.
    env = {**os.environ, "OMNILOOP_API_URL": server, "OMNILOOP_API_TOKEN": TOKEN}
    submitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "omniloop",
            "episode",
            "submit",
            "calc",
            "What is 6 * 7?",
            "--answer",
            "42",
            "--idempotency-key",
            "cli-1",
            "--watch",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert submitted.returncode == 0, submitted.stderr
    accepted, *events = documents(submitted.stdout)
    assert accepted["created"] is True
    assert events[0]["data"] == {"status": "queued"}
    assert events[-1]["type"] == "status"
    assert events[-1]["data"]["status"] == "completed"
    assert any(e["type"] == "turn" for e in events)

    again = episode(server, "submit", "calc", "What is 6 * 7?", "--answer", "42",
                    "--idempotency-key", "cli-1")  # fmt: skip
    assert documents(again.stdout)[0]["id"] == accepted["id"]

    got = episode(server, "get", accepted["id"], "--no-trajectory")
    assert got.exit_code == 0, got.stderr
    detail = documents(got.stdout)[0]
    assert detail["status"] == "completed"
    assert detail["reward"] == 1.0
    assert detail["trajectory"] is None

    replay = episode(server, "watch", accepted["id"], "--last-event-id", str(events[-2]["id"]))
    assert replay.exit_code == 0
    assert [e["id"] for e in documents(replay.stdout)] == [events[-1]["id"]]
    # Nothing left after the last event: an empty stream, and the exit code still tells.
    done = episode(server, "watch", accepted["id"], "--last-event-id", str(events[-1]["id"]))
    assert done.exit_code == 0
    assert documents(done.stdout) == []


def test_cancel_ends_a_running_episode_and_watch_exits_1(server):
    accepted = documents(episode(server, "submit", "waiter", "wait").stdout)[0]
    deadline = time.monotonic() + 60
    while (status := documents(episode(server, "get", accepted["id"]).stdout)[0]["status"]) == (
        "queued"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status == "running"
    cancelled = episode(server, "cancel", accepted["id"])
    assert cancelled.exit_code == 0, cancelled.stderr
    assert documents(cancelled.stdout)[0]["status"] == "cancelled"
    watched = episode(server, "watch", accepted["id"])
    assert watched.exit_code == 1
    assert documents(watched.stdout)[-1]["data"]["status"] == "cancelled"


def test_errors_are_reported_with_the_servers_problem(server):
    missing = episode(server, "get", "no-such-episode")
    assert missing.exit_code == 1
    assert "HTTP 404" in missing.stderr
    assert "no-such-episode" in missing.stderr
    unauthorized = episode(server, "submit", "calc", "hi", token=None)
    assert unauthorized.exit_code == 1
    assert "HTTP 401" in unauthorized.stderr
    invalid = episode(server, "submit", "calc", "hi", "--max-turns", "0")
    assert invalid.exit_code == 1
    assert "body.max_turns" in invalid.stderr
    unreachable = episode("http://127.0.0.1:9", "get", "x")
    assert unreachable.exit_code == 1
    assert "cannot reach" in unreachable.stderr
