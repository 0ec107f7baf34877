"""Exactly-once training across a crash: SIGKILL `omniloop run` after a checkpoint, resume.

The first run is killed with SIGKILL (no cleanup of any kind) once its checkpoint of step 2 is
on disk; `omniloop run --resume RUN_DIR` then finishes the run in a new process with a new
Ray, queue and engine. Across both, every trajectory id of every step is trained exactly once,
the optimizer and weight version continue from the checkpoint, and the steps after the
checkpoint are redone with the same trajectory ids.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from omniloop.platform.control.components import load_tasks
from omniloop.platform.control.local import step_tasks
from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.record import checkpoints
from omniloop.platform.store import Store
from omniloop.trajectory import trajectory_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OMNILOOP = str(Path(sys.executable).parent / "omniloop")
STEPS = 5
TASKS_PER_STEP = 2
SAMPLES = 4


def kill_session(leader: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run and every process it started (its session: engine, Ray, sandboxes)."""
    members = [p for p in psutil.process_iter() if _sid(p.pid) == leader.pid]
    for process in members:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    leader.wait(timeout=30)
    psutil.wait_procs(members, timeout=30)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_killed_run_resumes_and_trains_every_trajectory_exactly_once(
    toy_model: Path, toy_config_path: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # Ray's files of the killed run are not removed by it; a short path of our own is.
    ray_dir = tempfile.mkdtemp(prefix="omniloop-test-ray-", dir="/tmp")
    overrides = [
        f"model={toy_model}", f"run_dir={run_dir}", f"steps={STEPS}", "checkpoint_every=1",
        f"tasks_per_step={TASKS_PER_STEP}", f"rollout.samples_per_task={SAMPLES}",
        "max_staleness=1", "tensorboard=false", f"data_plane.ray_temp_dir={ray_dir}",
        f"database=sqlite:///{run_dir}/omniloop.db",
    ]  # fmt: skip
    try:
        _kill_and_resume(run_dir, toy_config_path, overrides, tmp_path)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def _kill_and_resume(
    run_dir: Path, toy_config_path: Path, overrides: list[str], tmp_path: Path
) -> None:
    with (tmp_path / "first.log").open("wb") as log:
        first = subprocess.Popen(
            [OMNILOOP, "run", str(toy_config_path), *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step_2" / "trainer_state.json").is_file():
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "no checkpoint of step 2 within 600 s"
            time.sleep(0.1)
    finally:
        kill_session(first)
    assert first.returncode == -signal.SIGKILL
    before = read_jsonl(run_dir / "trained.jsonl")
    newest = checkpoints(run_dir)[-1]
    resumed_from = int(newest.name.removeprefix("step_"))
    assert 2 <= resumed_from < STEPS, "the run was killed after it had finished"

    second = subprocess.run(
        [OMNILOOP, "run", "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stderr

    trained = read_jsonl(run_dir / "trained.jsonl")
    assert [s["step"] for s in trained] == list(range(STEPS))
    # Steps before the checkpoint are the killed run's; later ones were redone, same ids.
    assert trained[:resumed_from] == before[:resumed_from]
    for redone in before[resumed_from:]:
        again = trained[redone["step"]]
        assert {i for i, _ in again["samples"]} == {i for i, _ in redone["samples"]}

    ids = [traj_id for step in trained for traj_id, _ in step["samples"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    run_id = (run_dir / "run_id").read_text().strip()
    tasks = load_tasks(str(toy_config_path.parent / "tasks.jsonl"))
    for step in trained:
        k = step["step"]
        expected = {
            trajectory_id(run_id, f"step{k}/{task.id}/{sample}")
            for task in step_tasks(tasks, k, TASKS_PER_STEP)
            for sample in range(SAMPLES)
        }
        failed = {
            t["id"]
            for t in read_jsonl(run_dir / "trajectories" / f"step_{k}.jsonl")
            if t["meta"]["stop_reason"] in ("sandbox_error", "reward_error", "engine_error")
        }
        assert {i for i, _ in step["samples"]} == expected - failed

    # The optimizer and the weight version continued instead of starting over.
    assert [s["trainer_version"] for s in trained] == list(range(STEPS))
    final = run_dir / "checkpoints" / f"step_{STEPS}"
    assert json.loads((final / "trainer_state.json").read_text())["version"] == STEPS
    optimizer = torch.load(final / "optimizer.pt", weights_only=True)["optimizer"]
    assert {int(s["step"]) for s in optimizer["state"].values()} == {STEPS}

    # The database holds the run once, completed, with every episode of every step once.
    with Store(f"sqlite:///{run_dir}/omniloop.db") as store:
        assert store.get_run(run_id).status == "completed"
        assert sum(store.count_episodes(run_id).values()) == STEPS * TASKS_PER_STEP * SAMPLES
        assert sorted(p.step for p in store.get_metrics(run_id)["reward/mean"]) == list(
            range(STEPS)
        )
