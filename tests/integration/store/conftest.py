"""Fixtures for the run store: every test runs against SQLite and a real PostgreSQL server.

PostgreSQL comes from `OMNILOOP_TEST_PG_URL`. When it is unset, this conftest starts a private
server with scripts/postgres.sh for the session (and stops it afterwards); if that fails, the
PostgreSQL tests fail with instructions. They are never skipped. Each test gets its own
PostgreSQL schema (through `search_path`), so tests start from an empty database and leave
nothing behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from omniloop.platform.store import Store
from omniloop.trajectory import ErrorInfo, Trajectory, TrajectoryBuilder, TrajectoryMeta, TurnRecord

REPO = Path(__file__).resolve().parents[3]

HOW_TO_START = (
    "Start a PostgreSQL server for the tests and point OMNILOOP_TEST_PG_URL at it, e.g.\n"
    "  source scripts/postgres.sh && postgres_start   # exports OMNILOOP_TEST_PG_URL\n"
    "(needs the Debian package postgresql), or run the suite through\n"
    "  bash scripts/with-services.sh .venv/bin/python -m pytest ..."
)


def _postgres_script(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"source scripts/postgres.sh && {command}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of the PostgreSQL test database (started here when OMNILOOP_TEST_PG_URL is unset)."""
    url = os.environ.get("OMNILOOP_TEST_PG_URL")
    if url:
        yield url
        return
    # mkdtemp's folder is private (0700): postgres.sh hands it to the server's user.
    pg_dir = tempfile.mkdtemp(prefix="omniloop-pg-")
    env = {**os.environ, "OMNILOOP_PG_DIR": pg_dir}
    started = _postgres_script('postgres_start && printf %s "$OMNILOOP_TEST_PG_URL"', env)
    if started.returncode != 0 or not started.stdout:
        _postgres_script("postgres_stop", env)
        shutil.rmtree(pg_dir, ignore_errors=True)
        pytest.fail(
            "OMNILOOP_TEST_PG_URL is unset and scripts/postgres.sh could not start a server:\n"
            f"{started.stderr.strip()}\n\n{HOW_TO_START}",
            pytrace=False,
        )
    try:
        yield started.stdout.strip()
    finally:
        _postgres_script("postgres_stop", env)
        shutil.rmtree(pg_dir, ignore_errors=True)


@contextmanager
def _fresh_database(kind: str, folder: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of an empty database: a new SQLite file in `folder`, or a new PostgreSQL schema."""
    if kind == "sqlite":
        yield f"sqlite:///{folder / 'store.db'}"
        return
    base = request.getfixturevalue("postgres_url")
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(make_url(base).set(drivername="postgresql+psycopg"))
    try:
        with admin.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    except Exception as err:
        admin.dispose()
        pytest.fail(f"cannot use PostgreSQL at {base}: {err}\n\n{HOW_TO_START}", pytrace=False)
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database, once on SQLite and once on PostgreSQL."""
    with _fresh_database(request.param, tmp_path, request) as url:
        yield url


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Like `db_url`, shared by the tests of one module (for expensive data sets)."""
    with _fresh_database(request.param, tmp_path_factory.mktemp("db"), request) as url:
        yield url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A migrated store on an empty database."""
    s = Store(db_url)
    s.migrate()
    try:
        yield s
    finally:
        s.close()


TrajectoryFactory = Callable[..., Trajectory]


@pytest.fixture
def make_trajectory() -> TrajectoryFactory:
    """Build a valid two-turn trajectory for an episode.

    Keywords: `run_id`, `reward`, `stop_reason`, `error` (an `(type, message)` pair),
    `attempt`, `response` (sampled tokens per turn).
    """

    def build(
        episode_id: str,
        *,
        run_id: str = "local",
        reward: float | None = 1.0,
        stop_reason: str = "stop",
        error: tuple[str, str] | None = None,
        attempt: int = 0,
        response: int = 3,
    ) -> Trajectory:
        builder = TrajectoryBuilder([1, 2, 3, 4])
        turns = []
        for turn in range(2):
            start = len(builder)
            builder.add_sampled(
                list(range(10, 10 + response)), [-0.5 - turn] * response, version=turn
            )
            builder.add_observation([7, 8])
            turns.append(
                TurnRecord(
                    start=start,
                    num_sampled=response,
                    num_observation=2,
                    finish_reason="stop",
                    weight_version=turn,
                )
            )
        meta = TrajectoryMeta(
            run_id=run_id,
            episode_id=episode_id,
            attempt=attempt,
            task={"prompt": "2+2?", "answer": "4"},
            turns=turns,
            stop_reason=stop_reason,
            error=ErrorInfo(type=error[0], message=error[1]) if error else None,
            timings={"generate": 0.25, "total": 0.5},
        )
        traj = builder.build(meta)
        return traj.model_copy(update={"reward": reward, "reward_info": {"format": 0.5}})

    return build
