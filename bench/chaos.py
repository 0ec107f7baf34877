"""Recovery per role, and the effective training time ratio under random SIGKILLs.

The toy tool task (tiny model warm-started on the call format) is trained three times in this
invocation, with the roles as Ray Serve deployments: undisturbed (the baseline), then while a
watcher SIGKILLs the process of one replica of a role (`rollout`, `sandbox`, `reward`,
`advantage`, `engine`, `actor`, `api`) every `--kill-every` seconds, then undisturbed again.
The roles are drawn in a random order, each once before any a second time (`kill_order`), so a
disturbed run that lasts seven kills measures every role's recovery. All runs train the same
steps; the baselines on either side of the disturbed run cancel a machine whose speed drifts
steadily over the invocation, which two runs one after the other cannot tell from the kills.

Prints ONE JSON line:
- `recovery_s`: role -> seconds from the failure being detected to the role being back at full
  strength (from the run's fault timeline, `faults.jsonl`; the median when a role was killed
  more than once);
- `lost`: trajectory ids of the run's steps that were never trained; `trained_twice`: ids
  trained more than once (from `trained.jsonl`);
- `ettr`: the effective training time ratio, the undisturbed runs' mean wall time of their
  training loop divided by the disturbed run's: the share of the disturbed run's time that was
  as productive as an undisturbed run (1.0: failures cost nothing);
- `kill_cost_s`: per kill, in order, the seconds the disturbed run's steps recorded in the
  `COST_WINDOW_S` after it took beyond the mean of the steps recorded outside every kill's
  window (what each kill cost, read from the disturbed run alone; the machine's drift between
  runs does not enter it), and `kill_cost_share`, their sum over the disturbed loop's seconds;
- `roles_not_killed`: the roles the run ended before killing;
- the kills (time, role), the wall times (`baseline_loop_s`: before and after), steps, and
  the load average.

    .venv/bin/python bench/chaos.py [--steps 30] [--kill-every 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toy_run import TOY, read_jsonl, toy_config
from toy_run import train as train_toy

ROLES = ("rollout", "sandbox", "reward", "advantage", "engine", "actor", "api")
COST_WINDOW_S = 30.0
"""How long after a kill the steps recorded count towards its cost (`kill_costs`)."""


def train(model: Path, run_dir: Path, steps: int, killer: Killer | None) -> float:
    """Train `steps` steps (SIGKILLs from `killer` meanwhile); the training loop's seconds."""
    config = toy_config(model, run_dir, steps, ["checkpoint_every=5", "services.mode=services"])
    if killer is not None:
        killer.start()
    try:
        metrics, _ = train_toy(config)
    finally:
        if killer is not None:
            killer.stop()
    return sum(m["perf/step_seconds"] for m in metrics)


def kill_order(rng: random.Random) -> Iterator[str]:
    """The roles to kill, endlessly: every role once in a random order, then again."""
    while True:
        roles = list(ROLES)
        rng.shuffle(roles)
        yield from roles


class Killer:
    """SIGKILLs a replica of the next role of `kill_order` every `every` seconds once the run
    has started."""

    def __init__(self, run_dir: Path, every: float, seed: int) -> None:
        self._run_dir = run_dir
        self._every = every
        self._random = random.Random(seed)
        self._roles = kill_order(self._random)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.kills: list[dict[str, Any]] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        from omniloop.platform.control.services import replica_pids

        # The first kill comes `every` seconds after the first step is recorded.
        while not (self._run_dir / "metrics.jsonl").exists():
            if self._stop.wait(0.2):
                return
        while not self._stop.wait(self._every):
            role = next(self._roles)
            pids = replica_pids(role, within=os.getpid())
            if not pids:
                continue
            pid = self._random.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"t": round(time.time(), 1), "role": role, "pid": pid})


def kill_costs(
    metrics: list[dict[str, Any]], kills: list[dict[str, Any]], window: float = COST_WINDOW_S
) -> list[float]:
    """Per kill, the seconds that the steps recorded (`time`) within `window` after it took
    beyond as many steps at the mean of those recorded outside every kill's window. A step in
    two kills' windows counts towards the earlier kill only."""

    def kill_of(step: dict[str, Any]) -> int | None:
        return next(
            (i for i, k in enumerate(kills) if k["t"] <= step["time"] < k["t"] + window), None
        )

    by_kill: list[list[float]] = [[] for _ in kills]
    clean: list[float] = []
    for step in metrics:
        i = kill_of(step)
        (clean if i is None else by_kill[i]).append(step["perf/step_seconds"])
    if not clean:
        raise ValueError(f"every step is within {window} s of a kill: kill less often")
    mean = statistics.mean(clean)
    return [sum(steps) - len(steps) * mean for steps in by_kill]


def _expected_ids(run_dir: Path, steps: int, tasks_per_step: int, samples: int) -> set[str]:
    from omniloop.platform.control.components import load_tasks
    from omniloop.platform.control.local import step_tasks
    from omniloop.trajectory import trajectory_id

    run_id = (run_dir / "run_id").read_text().strip()
    tasks = load_tasks(str(TOY / "tasks.jsonl"))
    return {
        trajectory_id(run_id, f"step{k}/{task.id}/{sample}")
        for k in range(steps)
        for task in step_tasks(tasks, k, tasks_per_step)
        for sample in range(samples)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(TOY))

    import yaml
    from warm_start import warm_start

    toy = yaml.safe_load((TOY / "train.yaml").read_text())
    tasks_per_step, samples = toy["tasks_per_step"], toy["rollout"]["samples_per_task"]
    with tempfile.TemporaryDirectory(prefix="omniloop-bench-") as scratch:
        root = Path(scratch)
        model = warm_start(root / "model")
        before_s = train(model, root / "before", args.steps, None)
        killer = Killer(root / "chaos", args.kill_every, args.seed)
        chaos_s = train(model, root / "chaos", args.steps, killer)
        after_s = train(model, root / "after", args.steps, None)
        trained = read_jsonl(root / "chaos" / "trained.jsonl")
        costs = kill_costs(read_jsonl(root / "chaos" / "metrics.jsonl"), killer.kills)
        faults = read_jsonl(root / "chaos" / "faults.jsonl")
        expected = _expected_ids(root / "chaos", args.steps, tasks_per_step, samples)
    ids = [i for step in trained for i, _ in step["samples"]]
    by_role: dict[str, list[float]] = {}
    for fault in faults:
        if fault.get("recovery_seconds") is not None:
            by_role.setdefault(fault["role"], []).append(fault["recovery_seconds"])
    print(
        json.dumps(
            {
                "bench": "chaos",
                "recovery_s": {r: round(statistics.median(v), 1) for r, v in by_role.items()},
                "lost": len(expected - set(ids)),
                "trained_twice": len(ids) - len(set(ids)),
                "ettr": round((before_s + after_s) / 2 / chaos_s, 3),
                "kill_cost_s": [
                    {"role": k["role"], "s": round(c, 1)}
                    for k, c in zip(killer.kills, costs, strict=True)
                ],
                "kill_cost_share": round(sum(costs) / chaos_s, 3),
                "roles_not_killed": sorted(set(ROLES) - {k["role"] for k in killer.kills}),
                "kills": killer.kills,
                "faults": len(faults),
                "unrecovered_faults": sum(f.get("recovery_seconds") is None for f in faults),
                "baseline_loop_s": [round(before_s, 1), round(after_s, 1)],
                "chaos_loop_s": round(chaos_s, 1),
                "steps": args.steps,
                "kill_every_s": args.kill_every,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
