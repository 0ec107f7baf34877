"""The dev stack (compose.yaml): seconds from a cold `up` to every service healthy, and seconds
to rebuild the platform image after a one-line code change.

Needs a Docker daemon (`DOCKER_HOST`) and docker-compose. First builds the stack's images
(`scripts/stack.sh images`, not timed). Then, under a project name of its own and a free port:

1. `up_to_healthy_s`: `docker-compose up -d` of the built images with fresh volumes (an empty
   database, no converted model), until every container's health check passes and the API's
   `/readyz` answers 200 from the host. Then `down -v`.
2. `rebuild_s`: a comment line appended to `omniloop/__init__.py`, then `make images`'s
   `scripts/stack.sh images` (what a developer runs: the wheelhouse and sandbox image checked,
   every image of the stack built, only the platform image's code layers anew); the file is
   put back and the images rebuilt as they were (not timed).

Prints ONE JSON line.

    .venv/bin/python bench/compose_up.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from docker.api.client import APIClient
from docker.utils import kwargs_from_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omniloop.processes import free_port  # noqa: E402

CODE_FILE = ROOT / "omniloop" / "__init__.py"


def compose(env: dict[str, str], project: str, *args: str) -> None:
    subprocess.run(
        ["docker-compose", "-p", project, *args], cwd=ROOT, env=env, check=True,
        capture_output=True, timeout=900,
    )  # fmt: skip


def healthy(api: APIClient, project: str, url: str) -> bool:
    containers = api.containers(
        all=True, filters={"label": f"com.docker.compose.project={project}"}
    )
    states = [api.inspect_container(c["Id"])["State"] for c in containers]
    if not states or any(s.get("Health", {}).get("Status") != "healthy" for s in states):
        return False
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def up_to_healthy(env: dict[str, str], api: APIClient) -> float:
    project = f"omniloop-bench-{secrets.token_hex(4)}"
    url = f"http://127.0.0.1:{env['OMNILOOP_API_PORT']}"
    started = time.perf_counter()
    try:
        compose(env, project, "up", "-d")
        while not healthy(api, project, url):
            if time.perf_counter() - started > 600:
                raise TimeoutError("the stack was not healthy within 600 s")
            time.sleep(0.25)
        return time.perf_counter() - started
    finally:
        compose(env, project, "down", "-v", "--timeout", "20")


def images(env: dict[str, str]) -> None:
    subprocess.run(
        ["bash", "scripts/stack.sh", "images"], cwd=ROOT, env=env, check=True,
        capture_output=True, timeout=1800,
    )  # fmt: skip


def rebuild(env: dict[str, str]) -> float:
    original = CODE_FILE.read_text()
    try:
        CODE_FILE.write_text(original + f"# bench/compose_up.py {secrets.token_hex(4)}\n")
        started = time.perf_counter()
        images(env)
        return time.perf_counter() - started
    finally:
        CODE_FILE.write_text(original)
        images(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    env = {
        **os.environ,
        "OMNILOOP_API_TOKEN": secrets.token_urlsafe(24),
        "OMNILOOP_DB_PASSWORD": secrets.token_urlsafe(24),
        "OMNILOOP_SANDBOXD_TOKEN": secrets.token_urlsafe(24),
        "OMNILOOP_API_PORT": str(free_port()),
        "OMNILOOP_DOCKER_SOCKET": os.environ.get(
            "DOCKER_HOST", "unix:///var/run/docker.sock"
        ).removeprefix("unix://"),
    }
    images(env)
    api = APIClient(version="auto", **kwargs_from_env())
    ups = [up_to_healthy(env, api) for _ in range(args.rounds)]
    rebuilds = [rebuild(env) for _ in range(args.rounds)]
    print(
        json.dumps(
            {
                "bench": "compose_up",
                "up_to_healthy_s": round(statistics.median(ups), 1),
                "rebuild_s": round(statistics.median(rebuilds), 1),
                "up_to_healthy_s_each": [round(s, 1) for s in ups],
                "rebuild_s_each": [round(s, 1) for s in rebuilds],
                "services": 10,
                "compose": "docker-compose v1",
                "cpus": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
