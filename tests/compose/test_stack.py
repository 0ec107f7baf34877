"""The dev stack (`compose.yaml`) built from a local base and run with `docker-compose` (v1,
what Debian ships), on the daemon `make test` starts.

One stack for the module, under a project name of its own and a free port, so it never
touches a developer's stack. What must hold:
- the file is valid for `docker-compose` (and `docker compose` where v2 is installed);
- every service becomes healthy, and the only published port is the API's, on 127.0.0.1;
- an episode submitted over REST runs (SmolLM2 on the stack's engine, sandboxes from the
  stack's sandboxd) and completes with a trajectory; the gateway answers an OpenAI client;
- a training run of the tiny model goes through the stack's Ray cluster (each role on the
  container that offers its resource), and survives its rollout container crashing mid-run
  (the container restarts, its node rejoins, the lost episodes are run again);
- a new API container finds the run and the episode again (the data is in PostgreSQL's volume);
- an engine whose process dies is restarted by its policy, and the API samples from it again;
- no image holds a secret;
- `down -v` leaves no container, network or volume of the project, and no sandbox.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from docker.api.client import APIClient
from docker.utils import kwargs_from_env

from omniloop.processes import free_port
from omniloop.sandboxes.docker import docker_available
from omniloop.sandboxes.docker.ownership import LABEL_SANDBOX

pytestmark = [pytest.mark.compose, pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).parents[2]
PROJECT_LABEL = "com.docker.compose.project"
READY_S = 300


@dataclass
class Stack:
    project: str
    url: str
    env: dict[str, str]
    api: APIClient
    sandboxes_before: set[str]
    """Sandbox containers on the daemon before the stack started."""
    episode: str | None = None
    """The episode the REST test ran (the restart test looks for it)."""
    run: str | None = None
    """The training run the stack ran (the restart test looks for it)."""

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["docker-compose", "-p", self.project, *args],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stderr[-4000:]}"
        return done

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.env['OMNILOOP_API_TOKEN']}"}

    def wait_healthy(self) -> None:
        """Until every container of the project passes its health check (and the API answers
        ready from the host)."""
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            states = [
                self.api.inspect_container(c["Id"])["State"] for c in self.labelled()["containers"]
            ]
            healthy = all(s.get("Health", {}).get("Status") == "healthy" for s in states)
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                ready = False
            if states and healthy and ready:
                return
            time.sleep(1)
        logs = self.compose("logs", "--tail", "40").stdout
        raise AssertionError(f"the stack was not healthy within {READY_S} s:\n{logs}")

    def labelled(self) -> dict[str, list[Any]]:
        """The project's containers, networks and volumes left on the daemon."""
        label = {"label": f"{PROJECT_LABEL}={self.project}"}
        return {
            "containers": self.api.containers(all=True, filters=label),
            "networks": self.api.networks(filters=label),
            "volumes": self.api.volumes(filters=label).get("Volumes") or [],
        }


def _sandboxes(api: APIClient) -> set[str]:
    return {c["Id"] for c in api.containers(all=True, filters={"label": LABEL_SANDBOX})}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if not docker_available() or shutil.which("docker-compose") is None:
        pytest.fail("the compose tests need a Docker daemon and docker-compose (make test)")
    socket = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
    port = free_port()
    env = {
        **os.environ,
        "OMNILOOP_API_TOKEN": secrets.token_urlsafe(24),
        "OMNILOOP_DB_PASSWORD": secrets.token_urlsafe(24),
        "OMNILOOP_SANDBOXD_TOKEN": secrets.token_urlsafe(24),
        "OMNILOOP_API_PORT": str(port),
        "OMNILOOP_DOCKER_SOCKET": socket,
    }
    built = subprocess.run(
        ["bash", "scripts/stack.sh", "images"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    api = APIClient(version="auto", **kwargs_from_env())
    project = f"omniloop-test-{secrets.token_hex(4)}"
    stack = Stack(project, f"http://127.0.0.1:{port}", env, api, _sandboxes(api))
    try:
        # The images exist now: `up` starts them as built.
        stack.compose("up", "-d")
        stack.wait_healthy()
        yield stack
    finally:
        subprocess.run(
            ["docker-compose", "-p", stack.project, "down", "-v", "--timeout", "20"],
            cwd=ROOT, env=env, capture_output=True, timeout=300,
        )  # fmt: skip
        api.close()


def test_the_file_is_valid_for_both_composes(stack: Stack) -> None:
    stack.compose("config", "-q")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        v2 = subprocess.run(
            ["docker", "compose", "-p", stack.project, "config", "-q"],
            cwd=ROOT, env=stack.env, capture_output=True, text=True,
        )  # fmt: skip
        assert v2.returncode == 0, v2.stderr


def test_every_service_is_healthy_and_only_the_api_is_published_on_loopback(
    stack: Stack,
) -> None:
    containers = stack.labelled()["containers"]
    services = {c["Labels"]["com.docker.compose.service"]: c for c in containers}
    assert set(services) == {
        "postgres", "engine", "sandboxd", "api", "ray-head", "controller", "rollout", "reward",
        "advantage", "trainer",
    }  # fmt: skip
    for name, summary in services.items():
        state = stack.api.inspect_container(summary["Id"])["State"]
        assert state["Health"]["Status"] == "healthy", (name, state["Health"]["Log"][-1:])
    published = set()
    for name, summary in services.items():
        ports = stack.api.inspect_container(summary["Id"])["NetworkSettings"]["Ports"] or {}
        published |= {(name, b["HostIp"]) for bindings in ports.values() for b in bindings or []}
    assert published == {("api", "127.0.0.1")}


def test_an_episode_submitted_over_rest_completes_with_a_trajectory(stack: Stack) -> None:
    body = {"agent": "calculator", "task": {"prompt": "What is 6 * 7?", "answer": "42"}}
    refused = httpx.post(f"{stack.url}/v1/episodes", json=body, timeout=30)
    accepted = httpx.post(f"{stack.url}/v1/episodes", json=body, headers=stack.headers, timeout=30)
    assert refused.status_code == 401
    assert accepted.status_code == 202, accepted.text
    href = f"{stack.url}{accepted.json()['href']}"
    deadline = time.monotonic() + 300
    while True:
        episode = httpx.get(href, headers=stack.headers, timeout=30).json()
        if episode["status"] in ("completed", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, episode
        time.sleep(1)
    assert episode["status"] == "completed", json.dumps(episode)[:2000]
    assert episode["trajectory"]["input_ids"]
    assert sum(episode["trajectory"]["loss_mask"]) > 0
    stack.episode = accepted.json()["id"]
    # The same server answers OpenAI clients from the stack's engine.
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.env["OMNILOOP_API_TOKEN"])
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, timeout=120
    )
    assert reply.choices[0].model_extra["token_ids"]  # type: ignore[index]


def _service(stack: Stack, name: str) -> dict[str, Any]:
    (found,) = [
        c for c in stack.labelled()["containers"]
        if c["Labels"]["com.docker.compose.service"] == name
    ]  # fmt: skip
    return found


def _crash(stack: Stack, name: str) -> None:
    """Every process of the service's container dies (SIGKILL) but its init, which then exits:
    a crash, which the restart policy answers (a `docker stop` or `kill` it would respect)."""
    kill = (
        "import os\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    if int(pid) not in (1, os.getpid()):\n"
        "        try:\n"
        "            os.kill(int(pid), 9)\n"
        "        except ProcessLookupError:\n"
        "            pass\n"
    )
    container = _service(stack, name)["Id"]
    restarts = stack.api.inspect_container(container)["RestartCount"]
    stack.api.exec_start(stack.api.exec_create(container, ["python", "-c", kill]))
    deadline = time.monotonic() + READY_S
    while stack.api.inspect_container(container)["RestartCount"] == restarts:
        assert time.monotonic() < deadline, f"the {name} container was not restarted"
        time.sleep(0.5)


def test_a_training_run_goes_through_the_stack_and_survives_its_rollout_container(
    stack: Stack,
) -> None:
    run_id = f"stack-{secrets.token_hex(4)}"
    # 32 episodes a step: the steps after the first take longer than the crash takes to land.
    steps = 12
    command = [
        "docker-compose", "-p", stack.project, "exec", "-T", "controller",
        "python", "-m", "omniloop", "run", "/app/docker/stack/train.yaml",
        f"steps={steps}", "tasks_per_step=8", f"run_id={run_id}", f"run_dir=/app/runs/{run_id}",
    ]  # fmt: skip
    log = ROOT / "test-artifacts" / f"{run_id}.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        run = subprocess.Popen(command, cwd=ROOT, env=stack.env, stdout=out, stderr=out)
        try:
            metrics = f"{stack.url}/v1/runs/{run_id}/metrics"
            deadline = time.monotonic() + READY_S
            while True:  # until the run has trained a step
                got = httpx.get(metrics, headers=stack.headers, timeout=30)
                if got.status_code == 200 and got.json()["metrics"].get("perf/step_seconds"):
                    break
                assert run.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(1)
            _crash(stack, "rollout")
            code = run.wait(timeout=900)
        finally:
            if run.poll() is None:
                run.kill()
    output = log.read_text()
    assert code == 0, output[-4000:]
    found = httpx.get(f"{stack.url}/v1/runs/{run_id}", headers=stack.headers, timeout=30).json()
    assert found["status"] == "completed", found
    recorded = httpx.get(metrics, headers=stack.headers, timeout=30).json()["metrics"]
    assert len(recorded["perf/step_seconds"]) == steps
    faults = httpx.get(
        f"{stack.url}/v1/runs/{run_id}/faults", headers=stack.headers, timeout=30
    ).json()["items"]
    assert "rollout" in {f["role"] for f in faults}, faults
    stack.run = run_id


def test_a_new_api_container_finds_the_run_and_the_episode_in_postgres(stack: Stack) -> None:
    assert stack.episode is not None, "the episode test did not run first"
    assert stack.run is not None, "the training test did not run first"
    old = {c["Id"] for c in stack.labelled()["containers"]}
    stack.compose("up", "-d", "--force-recreate", "--no-deps", "api")
    assert {c["Id"] for c in stack.labelled()["containers"]} != old
    stack.wait_healthy()
    episode = httpx.get(
        f"{stack.url}/v1/episodes/{stack.episode}", headers=stack.headers, timeout=30
    ).json()
    run = httpx.get(f"{stack.url}/v1/runs/{stack.run}", headers=stack.headers, timeout=30).json()
    assert episode["status"] == "completed"
    assert run["status"] == "completed"


def test_a_crashed_engine_is_restarted_and_serves_again(stack: Stack) -> None:
    _crash(stack, "engine")
    stack.wait_healthy()
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.env["OMNILOOP_API_TOKEN"])
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, timeout=120
    )
    assert reply.choices[0].model_extra["token_ids"]  # type: ignore[index]


def test_no_image_holds_a_secret(stack: Stack) -> None:
    secrets_ = [stack.env[k] for k in ("OMNILOOP_API_TOKEN", "OMNILOOP_DB_PASSWORD")]
    for image in ("omniloop-platform:dev", "omniloop-postgres:dev"):
        doc = json.dumps([stack.api.inspect_image(image), stack.api.history(image)])
        assert not any(s in doc for s in secrets_), image


def test_down_leaves_nothing_of_the_project(stack: Stack) -> None:
    stack.compose("down", "-v", "--timeout", "20")
    assert stack.labelled() == {"containers": [], "networks": [], "volumes": []}
    # sandboxd removed the sandboxes it made before it exited.
    assert _sandboxes(stack.api) <= stack.sandboxes_before
