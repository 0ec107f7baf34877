"""Two nodes: roles placed by their resource requests, a node lost mid-run, the run completes.

A `ray.cluster_utils.Cluster` on this machine: a head node (CPUs, a `head` resource, one
`rollout` slot) and a worker node with only a `rollout` slot, each its own raylet. The run
joins the cluster by address (`ray_address`); its rollout deployment asks for one `rollout`
slot per replica and at most one replica per node, so its two replicas run one on each node;
the other roles ask for the `head` resource and run on the head, and so does the queue's
storage (`data_plane.storage_node_resource`). Mid-run the worker node is removed (its raylet
and every process on it end), and a new one joins a little later (room for Serve's replacement
replica): the lost replica's episodes are re-run on the head's, and the run completes with
every trajectory trained once. (The sandbox and api roles ask for nothing: Serve may place
them on either node, and replaces them on the head if they were on the lost one.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from ray.cluster_utils import Cluster

from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.services import replica_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OMNILOOP = str(Path(sys.executable).parent / "omniloop")
STEPS = 6
EPISODES = 16
LOSE_AT_STEP = 2
HEAD_ROLES = ("actor", "engine", "advantage", "reward")
"""Roles that ask for the head's `head` resource (the trainer, the engine and their peers)."""


def _raylets(pids: list[int]) -> set[int]:
    """The raylets (nodes) the processes `pids` run under."""
    return {psutil.Process(pid).ppid() for pid in pids}


def _lose_a_node(
    cluster: Cluster, run_dir: Path, seen: dict[str, Any], proc: subprocess.Popen[bytes]
) -> None:
    """While the run lasts: remove the worker node once step `LOSE_AT_STEP` has written an
    episode, and add a new one 5 s later (in the main thread: Ray's node setup installs signal
    handlers)."""
    written = run_dir / "trajectories" / f"step_{LOSE_AT_STEP}.jsonl"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if "lost_at" not in seen and written.is_file() and written.read_text().strip():
            seen["raylets_before"] = _raylets(replica_pids("rollout", within=os.getpid()))
            cluster.remove_node(seen["worker"], allow_graceful=False)
            seen["lost_at"] = time.time()
        if "lost_at" in seen and "added_at" not in seen and time.time() > seen["lost_at"] + 5:
            cluster.add_node(num_cpus=0, resources={"rollout": 1})
            seen["added_at"] = time.time()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def multinode_run(
    toy_model: Path, toy_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    # As a private instance of the run's own would: workers at the driver's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8,
            "resources": {"rollout": 1, "head": 100},
            "include_dashboard": False,
        },
    )
    seen: dict[str, Any] = {"worker": cluster.add_node(num_cpus=0, resources={"rollout": 1})}
    run_dir = tmp_path_factory.mktemp("multinode")
    placement = {
        "rollout": {"resources": {"rollout": 1}, "max_replicas_per_node": 1},
        **{role: {"resources": {"head": 1}} for role in HEAD_ROLES},
    }
    overrides = [
        f"model={toy_model}", f"run_dir={run_dir}", "tensorboard=false",
        f"database=sqlite:///{run_dir}/omniloop.db", f"ray_address={cluster.address}",
        f"steps={STEPS}", "tasks_per_step=4", "rollout.samples_per_task=4",
        f"checkpoint_every={STEPS}", "services.rollout_replicas=2",
        f"services.placement={json.dumps(placement)}",
        "data_plane.storage_node_resource=head",
    ]  # fmt: skip
    log = run_dir / "driver.log"
    try:
        # A driver process of its own joins the cluster, as `omniloop run ray_address=...` does.
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [OMNILOOP, "run", str(toy_config_path), *overrides], stdout=out, stderr=out
            )
            try:
                _lose_a_node(cluster, run_dir, seen, proc)
                proc.wait(timeout=5)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        cluster.shutdown()
    assert proc.returncode == 0, log.read_text(errors="replace")[-6000:]
    seen["run_dir"] = run_dir
    return seen


def test_rollout_replicas_ran_on_both_nodes(multinode_run: dict[str, Any]) -> None:
    assert len(multinode_run["raylets_before"]) == 2


def test_the_run_completes_with_every_trajectory_trained_once(
    multinode_run: dict[str, Any],
) -> None:
    run_dir: Path = multinode_run["run_dir"]
    assert "lost_at" in multinode_run, "the node was never removed"
    trained = read_jsonl(run_dir / "trained.jsonl")
    assert [s["step"] for s in trained] == list(range(STEPS))
    ids = [i for s in trained for i, _ in s["samples"]]
    assert len(ids) == len(set(ids)) == STEPS * EPISODES


def test_the_node_loss_is_on_the_fault_timeline(multinode_run: dict[str, Any]) -> None:
    faults = read_jsonl(multinode_run["run_dir"] / "faults.jsonl")
    rollout = [f for f in faults if f["role"] == "rollout"]
    assert rollout, faults
    assert rollout[0]["detected_at"] >= multinode_run["lost_at"] - 1
