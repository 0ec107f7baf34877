"""Chaos: a role's replica SIGKILLed mid-run costs the run nothing.

One real run of the toy task with the roles as Ray Serve deployments. While it trains, a
watcher SIGKILLs the process of one replica per role, each at a step of its own, in the middle
of that step's work: a rollout replica while step 1's episodes run, holding a group (the engine
paused meanwhile, so the group cannot end first; a later step if too few of step 1's groups
were left), the sandbox replica (sandboxd, and with it every sandbox) during step 2, the
advantage replica while step 3's groups arrive, the engine's replica (and so its engine) during
step 4. Ray Serve replaces each; the controller re-runs what was cut off (an episode whose
sandbox died is run again from the start); episodes waiting for a sandbox or on the dead engine
resume on the replacement, which for an engine has the current weights before it serves (a
sample of older weights would be refused by the actor and missing from `trained.jsonl`); the
reference replica (the run trains with a KL penalty scored by the `reference` role) during step
6, whose `ref_logprobs` the replacement writes; the actor's replica during step 7, once step 6
is trained (so mostly while it waits for step 7's rollout with no request of the controller's
under way: the replacement must refuse to train until restored): only the actor restarts, from
its checkpoint of step 4, while the rollout goes on, and steps 4 to 7 are produced and trained
again under the same ids, step 6 only once the restored actor has trained step 4 (the
staleness bound holds across the restore: sampled at once by the restored weights, step 6
would reach the trainer two versions behind, and be refused).

Afterwards: the run completed; every trajectory id of every step was trained exactly once
(`trained.jsonl`); the store holds every episode once; each kill is a fault on the timeline
(`faults.jsonl` and the run's events) with its recovery time; a killed engine or sandbox
replica left no engine or sandbox process behind; and the run's REST API (the api replica,
killed during step 5) answered about the run before and again after.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from omniloop.platform.control.components import load_tasks
from omniloop.platform.control.local import step_tasks
from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.platform.control.services import replica_pids
from omniloop.platform.store import Store
from omniloop.processes import free_port
from omniloop.trajectory import trajectory_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 8
CHECKPOINT_EVERY = 4
TASKS_PER_STEP = 4
SAMPLES = 4
KILLS = {
    "rollout": 1,
    "sandbox": 2,
    "advantage": 3,
    "engine": 4,
    "api": 5,
    "reference": 6,
    "actor": 7,
}
"""Role -> the step during whose rollout one of its replicas is killed."""


@dataclass
class ChaosRun:
    run_dir: Path
    trained: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    killed: dict[str, int] = field(default_factory=dict)
    """Role -> pid killed."""
    orphans: dict[str, list[int]] = field(default_factory=dict)
    """Role -> the killed replica's child processes (its engine, its sandboxes)."""
    api: dict[str, Any] = field(default_factory=dict)
    """What the run's REST API answered before its replica was killed, and after."""


def _api_answers(url: str, deadline: float) -> httpx.Response | None:
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return response
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return None


def _trained(run_dir: Path, step: int) -> bool:
    path = run_dir / "trained.jsonl"
    return path.is_file() and any(
        json.loads(line)["step"] == step for line in path.read_text().splitlines() if line
    )


def _written(run_dir: Path, step: int) -> int:
    path = run_dir / "trajectories" / f"step_{step}.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _kill_a_rollout_replica_holding_a_group(run: ChaosRun, step: int) -> bool:
    """Pause the engine (SIGSTOP), so that every episode waits at its next generation and a
    rollout replica that has a group keeps it; once no episode has been written for two
    seconds, SIGKILL a rollout replica if at least two of `step`'s groups are unwritten (each of
    the two replicas holds one: Serve hands a waiting group to a free replica within a second),
    and resume the engine. Toy episodes end in a fraction of a second, so without the pause a
    replica could be found between groups. False, with nothing killed, when fewer groups were
    left."""
    engine = [
        child
        for pid in replica_pids("engine", within=os.getpid())
        for child in psutil.Process(pid).children(recursive=True)
    ]
    for process in engine:
        process.send_signal(signal.SIGSTOP)
    try:
        written = _written(run.run_dir, step)
        while True:
            time.sleep(2.0)
            settled, written = written, _written(run.run_dir, step)
            if written == settled:
                break
        pids = replica_pids("rollout", within=os.getpid())
        if TASKS_PER_STEP * SAMPLES - written <= SAMPLES or not pids:
            return False
        os.kill(pids[0], signal.SIGKILL)
        run.killed["rollout"] = pids[0]
        return True
    finally:
        for process in engine:
            process.send_signal(signal.SIGCONT)


def _kill_during_steps(run: ChaosRun, api_url: str, stop: threading.Event) -> None:
    """SIGKILL a replica of each role of `KILLS` once its step has written a few episodes;
    around the api's kill, ask the run's REST API about the run."""
    pending = dict(KILLS)
    while pending and not stop.is_set():
        for role, step in list(pending.items()):
            if _written(run.run_dir, step) >= 1 and (
                role != "actor" or _trained(run.run_dir, step - 1)
            ):
                if role == "rollout":
                    if _kill_a_rollout_replica_holding_a_group(run, step):
                        del pending[role]
                    else:
                        pending[role] = step + 1
                    continue
                pids = replica_pids(role, within=os.getpid())
                if pids:
                    if role == "api":
                        run_id = (run.run_dir / "run_id").read_text().strip()
                        page = f"{api_url}/v1/runs/{run_id}"
                        run.api["before"] = _api_answers(page, time.monotonic() + 30)
                    children = psutil.Process(pids[0]).children(recursive=True)
                    os.kill(pids[0], signal.SIGKILL)
                    run.killed[role] = pids[0]
                    run.orphans[role] = [c.pid for c in children]
                    del pending[role]
                    if role == "api":  # beside the watcher: the actor's kill must not wait

                        def after(page: str = page) -> None:
                            run.api["after"] = _api_answers(page, time.monotonic() + 90)

                        threading.Thread(target=after, daemon=True).start()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def chaos_run(toy_config: Any, tmp_path_factory: pytest.TempPathFactory) -> ChaosRun:
    run_dir = tmp_path_factory.mktemp("chaos")
    port = free_port()
    config = toy_config(
        run_dir,
        {
            "steps": STEPS,
            "tasks_per_step": TASKS_PER_STEP,
            "rollout.samples_per_task": SAMPLES,
            "max_staleness": 1,
            "checkpoint_every": CHECKPOINT_EVERY,
            "services.mode": "services",
            "services.rollout_replicas": 2,
            # One group per replica at a time, the others queued: whichever replica is killed
            # while a step's groups run, it was running one of them.
            "services.rollout_groups_per_replica": 1,
            "services.reward_replicas": 2,
            "services.api_port": port,
            "trainer.loss.kl_coef": 0.05,
            "trainer.reference": "external",
            "data_plane.read_timeout": 240,
        },
    )
    chaos = ChaosRun(run_dir, [], [])
    stop = threading.Event()
    watcher = threading.Thread(
        target=_kill_during_steps, args=(chaos, f"http://127.0.0.1:{port}", stop)
    )
    watcher.start()
    try:
        asyncio.run(run(config))
    finally:
        stop.set()
        watcher.join()
    deadline = time.monotonic() + 90
    while "api" in chaos.killed and "after" not in chaos.api and time.monotonic() < deadline:
        time.sleep(0.2)
    chaos.trained = read_jsonl(run_dir / "trained.jsonl")
    if (run_dir / "faults.jsonl").exists():
        chaos.faults = read_jsonl(run_dir / "faults.jsonl")
    return chaos


def test_each_role_was_killed_mid_run(chaos_run: ChaosRun) -> None:
    assert set(chaos_run.killed) == set(KILLS)


def test_every_step_trained_with_the_reference_role_s_kl(chaos_run: ChaosRun) -> None:
    metrics = read_jsonl(chaos_run.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    # Step 0 trains the initial policy, which is the reference: no divergence yet.
    assert abs(metrics[0]["actor/kl"]) < 1e-5
    # The reference's replica scored each step's rows, or its replacement did; a step whose
    # work was re-run only after the actor had trained it (the lost replica had written every
    # row, then died before it answered) finds the step finished and scores none.
    [fault] = [f for f in chaos_run.faults if f["role"] == "reference"]
    rerun = {int(work.split()[1].removesuffix("'s")) for work in fault["retried"]}
    for m in metrics:
        assert m["reference/rows"] == TASKS_PER_STEP * SAMPLES or (
            m["reference/rows"] == 0 and m["step"] in rerun
        ), m


def test_the_run_s_api_answers_again_after_its_replica_was_killed(chaos_run: ChaosRun) -> None:
    before, after = chaos_run.api.get("before"), chaos_run.api.get("after")
    assert before is not None, "the run's REST API did not answer while the run trained"
    assert after is not None, "the run's REST API did not come back after its replica died"
    assert after.json()["id"] == before.json()["id"]


def test_the_restored_actor_continues_from_its_checkpoint(chaos_run: ChaosRun) -> None:
    versions = [(s["trainer_version"], s["version"]) for s in chaos_run.trained]
    # One optimizer step per trained step, across the restore: the redone steps start from
    # the checkpoint's version, not from the lost actor's.
    assert versions == [(k, k + 1) for k in range(STEPS)]


def test_episodes_cut_off_by_a_dead_engine_or_sandbox_resumed_on_the_replacement(
    chaos_run: ChaosRun,
) -> None:
    for path in (chaos_run.run_dir / "trajectories").glob("step_*.jsonl"):
        stops = [t["meta"]["stop_reason"] for t in read_jsonl(path)]
        assert "engine_error" not in stops, path.name
        assert "sandbox_error" not in stops, path.name


def test_each_episode_is_written_once_as_the_store_holds_it(chaos_run: ChaosRun) -> None:
    # An episode re-run after its rollout replica died keeps the first attempt that wrote its
    # row: one line per id in its step's file, the same trajectory as the store's record. The
    # steps redone after the actor's restore are sampled again; the store holds what was
    # sampled last, which is what was trained.
    run_id = (chaos_run.run_dir / "run_id").read_text().strip()
    with Store(f"sqlite:///{chaos_run.run_dir}/omniloop.db") as store:
        for step in range(STEPS):
            path = chaos_run.run_dir / "trajectories" / f"step_{step}.jsonl"
            lines = read_jsonl(path)
            ids = [t["id"] for t in lines]
            assert len(ids) == len(set(ids)) == TASKS_PER_STEP * SAMPLES, path.name
            for line in lines:
                stored = store.get_episode(line["id"]).trajectory
                assert stored is not None
                assert stored.meta.run_id == run_id
                assert stored.input_ids == line["input_ids"], (path.name, line["id"])


@pytest.mark.parametrize("role", ["engine", "sandbox"])
def test_a_killed_replica_takes_its_processes_with_it(
    chaos_run: ChaosRun, role: str, still_running: Callable[..., list[int]]
) -> None:
    # The engine replica's engine; the sandbox replica's warm pool of bwrap sandboxes.
    assert chaos_run.orphans[role], f"the {role} replica had no child process"
    assert not still_running(chaos_run.orphans[role], within=10)


def test_every_trajectory_of_every_step_is_trained_exactly_once(
    chaos_run: ChaosRun, toy_config_path: Path
) -> None:
    assert [s["step"] for s in chaos_run.trained] == list(range(STEPS))
    ids = [traj_id for step in chaos_run.trained for traj_id, _ in step["samples"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    run_id = (chaos_run.run_dir / "run_id").read_text().strip()
    tasks = load_tasks(str(toy_config_path.parent / "tasks.jsonl"))
    for step in chaos_run.trained:
        k = step["step"]
        expected = {
            trajectory_id(run_id, f"step{k}/{task.id}/{sample}")
            for task in step_tasks(tasks, k, TASKS_PER_STEP)
            for sample in range(SAMPLES)
        }
        assert {i for i, _ in step["samples"]} == expected, f"step {k} lost or gained samples"


def test_the_store_holds_every_episode_once_and_the_run_completed(chaos_run: ChaosRun) -> None:
    with Store(f"sqlite:///{chaos_run.run_dir}/omniloop.db") as store:
        run_id = (chaos_run.run_dir / "run_id").read_text().strip()
        assert store.get_run(run_id).status == "completed"
        episodes = store.list_episodes(run_id=run_id, limit=1000).items
        assert len(episodes) == STEPS * TASKS_PER_STEP * SAMPLES
        assert len({e.id for e in episodes}) == len(episodes)
        assert not [e for e in episodes if e.status != "completed"], "an episode was lost"
        events = [e for e in store.list_events(run_id=run_id) if e.type == "fault"]
        assert {e.data["role"] for e in events} == set(KILLS)
        # Each fault is stored as it is detected (still down), then once recovered.
        by_fault: dict[str, list[Any]] = {}
        for event in events:
            by_fault.setdefault(event.data["fault_id"], []).append(event.data)
        assert len(by_fault) == len(KILLS), events
        for fault_id, stored in by_fault.items():
            assert [d["recovered_at"] is None for d in stored] == [True, False], (fault_id, stored)


@pytest.mark.parametrize("role", sorted(KILLS))
def test_each_kill_is_on_the_fault_timeline_with_its_recovery(
    chaos_run: ChaosRun, role: str
) -> None:
    faults = [f for f in chaos_run.faults if f["role"] == role]
    assert len(faults) == 1, chaos_run.faults
    fault = faults[0]
    # Episodes wait out an engine's replacement: nothing is re-run. A sandbox replica's kill
    # re-runs the episodes that were inside a sandbox at that moment, and there may be none.
    # The api does no work of the run's.
    if role not in ("engine", "sandbox", "api"):
        assert fault["retried"], "the work the replica was doing was not retried"
    assert fault["recovery_seconds"] is not None
    assert 0 <= fault["recovery_seconds"] < 120
