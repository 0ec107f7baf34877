"""Wall time of synchronous vs bounded-asynchronous RL on a long-tail agentic workload.

The same run is trained twice, one after the other in this process, for the same number of
steps: with `max_staleness=0` (rollout and training alternate) and `max_staleness=2`
(rollouts of the next steps run while the trainer works); then a third time asynchronously
with weight updates drained instead of landing in place (`sync.update_mode=drain`: each update
first waits for the running requests), unless `--no-drain`. The workload is the toy tool task
(`examples/toy_tool`, tiny model warm-started on the call format) with one change that makes
it long-tailed, as agentic rollouts are: before the call runs, the episode's sandbox is busy for
a heavy-tailed time (Pareto, shape 1.2, scale 0.15 s, capped at 5 s), drawn from the episode
id, so both runs meet exactly the same durations. A sandbox that waits uses no CPU, as a remote
tool or a test suite on another machine would; the CPU goes to the engine and the trainer, one
torch thread each (set explicitly: on 2 cores two OpenMP threads per process wait on each
other). Generation and training still share the two cores, so they overlap only partly.

Prints ONE JSON line:
- `speedup`: wall seconds of the synchronous run's steps / the asynchronous run's steps (the
  control loop only: start-up of engine, Ray and sandboxes is excluded, and reported apart);
- `limit`: the best an overlap of the two stages could do, `(rollout + train) / max(rollout,
  train)`, from the synchronous run's measured stage times (per step, averaged). With
  `max_staleness=2` up to three steps' rollouts are in flight at once, so the waits of one
  step also overlap those of the next: the speedup can exceed this two-stage limit;
- `speedup_of_limit`: `speedup / limit`;
- `final_reward_sync`, `final_reward_async`: mean reward of each run's last five steps
  (`FINAL_STEPS`); `final_reward_noise`: twice the binomial standard error of their difference
  (rewards are 0 or 1), and `final_rewards_within_noise` whether they differ by less;
- `speedup_drain`, `in_place_vs_drain` (the drained async run's wall time / the in-place
  one's), `sync_seconds` (mean publish time per step in each mode);
- stage times, per-run wall times and CPU seconds, the load average, thread settings.

    .venv/bin/python bench/async_speedup.py [--quick] [--steps N]
        [--mode services|in_process|both]

`--mode both` runs both modes in one invocation, interleaved (both synchronous runs, then both
asynchronous ones; no drained run), and prints `speedup_services`, `speedup_in_process`,
`services_over_in_process` (their ratio) and each mode's keys above under `services` and
`in_process`.

With the roles as services (the default), the CPU seconds count this process and its children
only: the replicas are Ray's workers, not children of this process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from toy_run import TOY, toy_config
from toy_run import train as train_toy

sys.path.insert(0, str(TOY))

from agent import PREFILL, TOOLS, found_the_treasure

from omniloop.agents.base import Session, Task
from omniloop.tools import Toolset, parse_tool_calls
from omniloop.tools.base import ToolContext

# Chosen so that a step's rollout (generation plus its slowest wait) and its optimizer step take
# comparable time on a 2-core machine, the regime where overlapping them pays the most.
PARETO_SHAPE = 1.2
FINAL_STEPS = 5
PARETO_SCALE_S = 0.15
PARETO_CAP_S = 5.0

__all__ = ["LongTailAgent", "build_agent", "found_the_treasure", "tool_wait"]


def tool_wait(episode_id: str) -> float:
    """Seconds the sandbox is busy in `episode_id`: Pareto(1.2) from 0.15 s, capped at 5 s."""
    digest = hashlib.blake2b(episode_id.encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") + 1) / 2**64
    return min(PARETO_SCALE_S * u ** (-1.0 / PARETO_SHAPE), PARETO_CAP_S)


class LongTailAgent:
    """The toy agent, whose environment first takes a heavy-tailed time to get ready."""

    def __init__(self) -> None:
        self.toolset = Toolset(TOOLS)
        self.tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[dict[str, Any]]:
        return task.messages()

    async def run(self, task: Task, session: Session, context: ToolContext) -> None:
        turn = await session.generate(prefill=PREFILL)
        await context.sandbox.exec(["sleep", f"{tool_wait(context.episode_id):.3f}"])
        calls = parse_tool_calls(turn.text).calls
        records = await self.toolset.execute_all(calls, context, turn=0)
        context.state.setdefault("tool_calls", []).extend(records)


def build_agent() -> LongTailAgent:
    return LongTailAgent()


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def train_once(
    model: Path,
    run_dir: Path,
    max_staleness: int,
    steps: int,
    mode: str = "services",
    update_mode: str = "in_place",
) -> dict[str, Any]:
    """Train `steps` steps; return wall/CPU seconds and the per-step metrics."""
    bench = Path(__file__).resolve()
    config = toy_config(
        model,
        run_dir,
        steps,
        [
            f"max_staleness={max_staleness}",
            f"checkpoint_every={steps}",
            f"rollout.agent={bench}:build_agent",
            f"rollout.rewards=[{bench}:found_the_treasure]",
            # Room for the three steps a bound of 2 lets run at once (32 episodes each).
            "rollout.concurrency=96",
            "rollout.sandbox.pool_size=32",
            f"services.mode={mode}",
            f"sync.update_mode={update_mode}",
        ],
    )
    cpu = _cpu_seconds()
    metrics, total = train_toy(config)
    loop = sum(m["perf/step_seconds"] for m in metrics)
    return {
        "wall_s": loop,
        "startup_s": total - loop,
        "cpu_s": _cpu_seconds() - cpu,
        "metrics": metrics,
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary(
    mode: str,
    steps: int,
    sync: dict[str, Any],
    async_: dict[str, Any],
    drained: dict[str, Any] | None,
) -> dict[str, Any]:
    """What one mode's runs measured (the keys of the module docstring)."""
    sm = sync["metrics"]
    rollout = mean([m["perf/rollout_seconds"] for m in sm])
    # The trainer's stage in a synchronous step: everything that is not rollout.
    train = mean([m["perf/step_seconds"] - m["perf/rollout_seconds"] for m in sm])
    limit = (rollout + train) / max(rollout, train)
    speedup = sync["wall_s"] / async_["wall_s"]
    final_sync = mean([m["reward/mean"] for m in sm[-FINAL_STEPS:]])
    final_async = mean([m["reward/mean"] for m in async_["metrics"][-FINAL_STEPS:]])
    samples = sum(m["episodes/count"] for m in sm[-FINAL_STEPS:])
    noise = 2 * math.sqrt(
        (final_sync * (1 - final_sync) + final_async * (1 - final_async)) / samples
    )
    return {
        "mode": mode,
        "steps": steps,
        "speedup": round(speedup, 3),
        "limit": round(limit, 3),
        "speedup_of_limit": round(speedup / limit, 3),
        "final_reward_sync": round(final_sync, 3),
        "final_reward_async": round(final_async, 3),
        "final_reward_noise": round(noise, 3),
        "final_rewards_within_noise": abs(final_sync - final_async) < noise,
        "rollout_s_per_step": round(rollout, 3),
        "train_s_per_step": round(train, 3),
        "optimizer_step_s": round(mean([m.get("perf/train_seconds", 0.0) for m in sm]), 3),
        "sync_wall_s": round(sync["wall_s"], 2),
        "async_wall_s": round(async_["wall_s"], 2),
        "sync_cpu_s": round(sync["cpu_s"], 1),
        "async_cpu_s": round(async_["cpu_s"], 1),
        "async_staleness_max": max(m["staleness/max"] for m in async_["metrics"]),
        **(
            {
                "speedup_drain": round(sync["wall_s"] / drained["wall_s"], 3),
                "async_wall_s_drain": round(drained["wall_s"], 2),
                "in_place_vs_drain": round(drained["wall_s"] / async_["wall_s"], 3),
                "sync_seconds": {
                    "in_place": round(mean([m["perf/sync_seconds"] for m in async_["metrics"]]), 3),
                    "drain": round(mean([m["perf/sync_seconds"] for m in drained["metrics"]]), 3),
                },
            }
            if drained is not None
            else {}
        ),
        "startup_s": round(sync["startup_s"] + async_["startup_s"], 1),
        "episodes_per_step": sm[0]["episodes/count"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps per run (< 5 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 30)")
    parser.add_argument(
        "--mode",
        choices=("services", "in_process", "both"),
        default="services",
        help="the roles as Ray Serve deployments (the default of omniloop run), in process, or "
        "both side by side (their runs interleaved; no drained run)",
    )
    parser.add_argument(
        "--no-drain",
        dest="drain",
        action="store_false",
        help="skip the third run (max_staleness=2 with drained weight updates)",
    )
    args = parser.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    modes = ["in_process", "services"] if args.mode == "both" else [args.mode]
    drain = args.drain and args.mode != "both"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from warm_start import warm_start

    torch.set_num_threads(1)
    runs: dict[str, dict[str, Any]] = {mode: {} for mode in modes}
    with tempfile.TemporaryDirectory(prefix="omniloop-bench-") as scratch:
        root = Path(scratch)
        started = time.perf_counter()
        model = warm_start(root / "model")
        warm_s = time.perf_counter() - started
        # Both modes' synchronous runs, then both asynchronous ones: a drift of the machine's
        # load between the first run and the last weighs on both modes alike.
        for kind, staleness in (("sync", 0), ("async", 2)):
            for mode in modes:
                run_dir = root / f"{kind}-{mode}"
                runs[mode][kind] = train_once(model, run_dir, staleness, steps, mode)
        if drain:
            runs[args.mode]["drain"] = train_once(
                model, root / "drain", 2, steps, args.mode, "drain"
            )

    measured = {
        mode: summary(mode, steps, got["sync"], got["async"], got.get("drain"))
        for mode, got in runs.items()
    }
    machine = {
        "warm_start_s": round(warm_s, 1),
        "tool_wait": f"pareto(shape={PARETO_SHAPE}, scale={PARETO_SCALE_S}s, cap={PARETO_CAP_S}s)",
        "threads": {"engine": 1, "trainer": 1},
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    if args.mode != "both":
        print(json.dumps({"bench": "async_speedup", **measured[args.mode], **machine}))
        return
    services, in_process = measured["services"], measured["in_process"]
    print(
        json.dumps(
            {
                "bench": "async_speedup",
                "mode": "both",
                "steps": steps,
                "speedup_services": services["speedup"],
                "speedup_in_process": in_process["speedup"],
                "services_over_in_process": round(services["speedup"] / in_process["speedup"], 3),
                "services": services,
                "in_process": in_process,
                **machine,
            }
        )
    )


if __name__ == "__main__":
    main()
