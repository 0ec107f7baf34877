"""Step time through the role services vs the same roles in one process.

The same run is trained with `services.mode=in_process` and with `services.mode=services`
(rollout, reward, advantage, actor and engine as Ray Serve deployments), alternately,
`--rounds` times each, in one invocation, so both meet the same machine. `--task` picks the
run: `toy` (the default; the toy tool task, tiny model warm-started on the call format, 32
episodes per step, `max_staleness=1`: an episode is a few dozen tokens of a tiny model, so the
services' cost per episode weighs the most) or `calculator` (`make run`'s job: SmolLM2-135M,
24 episodes per step, `max_staleness=1`, as `examples/calculator/train.yaml` sets it). Step
time is the control loop's `perf/step_seconds`, the mean over the steps of every round of a
mode after its first `WARMUP_STEPS` (the first steps of a run also pay for warm pools and first
compilations): wall seconds per trained step, the inverse of steps per hour. Not the median:
at `max_staleness=1` a step whose next rollout had already finished takes a fraction of one
that waited for it, and the median of such a two-humped distribution jumps between the humps
from one invocation to the next (the median is reported too, `step_seconds_median_*`).
Start-up (Ray, Serve deployments, engine, model) is reported apart.

Prints ONE JSON line: `step_seconds_services`, `step_seconds_in_process`, `ratio` (services /
in process), `ratio_per_round` (the same from each round's pair of runs alone), the episodes
per second of each (episodes trained over the measured steps' wall time), the median rollout
and optimizer-step seconds of each (`rollout_seconds_*`, `train_seconds_*`), start-up seconds
of each, the CPU seconds per measured step spent by each kind of process of the run
(`cpu_per_step_*`: the driver, each role's replicas, Serve's controller, Ray's daemons, the
engine, sandboxd; `<kind> children`: what the ended children of that kind's processes spent,
such as sandboxd's tool calls, `CpuSampler`), the whole machine's busy CPU seconds per
measured step (`machine_cpu_per_step_*`, from `/proc/stat`: what the per-kind figures miss,
the kernel's own work above all), and the load average.

    .venv/bin/python bench/services_overhead.py [--task toy|calculator] [--steps 10]
        [--rounds 2] [--set KEY=VALUE]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from toy_run import TOY, task_config, task_parser
from toy_run import train as train_run

WARMUP_STEPS = 2


def _process_kind(cmdline: list[str]) -> str:
    """What a process of the run is, from its command line (Ray titles its workers)."""
    if not cmdline:
        return "other"
    first = cmdline[0]
    if first.startswith("ray::ServeReplica:"):
        return "replica:" + first.split(":")[3]
    if first.startswith("ray::"):
        return first.split()[0][len("ray::") :]
    if "-m" in cmdline[:-1]:
        return cmdline[cmdline.index("-m") + 1].rsplit(".", 1)[-1]
    name = Path(first).name
    if name.startswith("python") and len(cmdline) > 1:
        return Path(cmdline[1]).stem
    return name


class CpuSampler:
    """CPU seconds (user + system) of this process and every descendant, by kind, sampled
    every `period_s`; `between(t0, t1)` is what each kind spent in that wall-clock window.

    A process too short-lived to be sampled (a tool call's sandbox and the command it runs)
    still counts: once it has ended and been reaped, its CPU is its parent's children's time,
    reported as `<parent's kind> children`. A child that was sampled while it ran and ended
    within the window counts twice (as itself, and in its parent's children's time); the
    short-lived ones this is for are not."""

    def __init__(self, period_s: float = 0.5) -> None:
        self._period_s = period_s
        self._samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        """(time, {pid: (kind, CPU seconds)}) per sample; a process's reaped children count
        under the pid's negative, as `<kind> children`."""
        self._machine: list[tuple[float, float]] = []
        """(time, busy CPU seconds of the whole machine since boot) per sample."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            seen: dict[int, tuple[str, float]] = {}
            for process in [me, *me.children(recursive=True)]:
                try:
                    with process.oneshot():
                        times = process.cpu_times()
                        kind = (
                            "driver" if process.pid == me.pid else _process_kind(process.cmdline())
                        )
                        seen[process.pid] = (kind, times.user + times.system)
                        seen[-process.pid] = (
                            f"{kind} children",
                            times.children_user + times.children_system,
                        )
                except psutil.Error:
                    continue
            now = time.time()
            self._samples.append((now, seen))
            self._machine.append((now, _machine_busy_seconds()))
            self._stop.wait(self._period_s)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds by kind from the first sample at or after `t0` to the last at or
        before `t1` (a process born in between counts from its start)."""
        inside = [sample for sample in self._samples if t0 <= sample[0] <= t1]
        if len(inside) < 2:
            return {}
        (_, first), (_, last) = inside[0], inside[-1]
        spent: dict[str, float] = {}
        for pid, (kind, total) in last.items():
            before = first.get(pid)
            start = before[1] if before is not None and before[0] == kind else 0.0
            spent[kind] = spent.get(kind, 0.0) + max(total - start, 0.0)
        return spent

    def machine_between(self, t0: float, t1: float) -> float:
        """Busy CPU seconds of the whole machine in the same window as `between`: every
        process, those too short-lived for the sampler (a tool call's sandbox) and the kernel's
        own work included."""
        inside = [busy for at, busy in self._machine if t0 <= at <= t1]
        return inside[-1] - inside[0] if len(inside) >= 2 else 0.0


def _machine_busy_seconds() -> float:
    """CPU seconds the machine's cores spent not idle since boot (`/proc/stat`)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def train_once(
    model: Path | None, run_dir: Path, mode: str, steps: int, extra: list[str]
) -> dict[str, Any]:
    """Train `steps` steps with the roles in `mode` (and the dotted overrides `extra`): the toy
    task on `model`, or the calculator task when `model` is None; the step metrics and
    start-up seconds."""
    overrides = [f"checkpoint_every={steps}", f"services.mode={mode}", *extra]
    metrics, total = train_run(task_config(model, run_dir, steps, overrides))
    return {"metrics": metrics, "startup_s": total - sum(m["perf/step_seconds"] for m in metrics)}


def main() -> None:
    parser = task_parser(
        __doc__.split("\n\n")[0], steps=10, rounds=2, rounds_help="runs per mode, alternating"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override of the services run (e.g. services.rollout_replicas=1)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.task == "toy":  # its siblings' names (`agent`) are the calculator's too
        sys.path.insert(0, str(TOY))

    steps: dict[str, list[list[float]]] = {"in_process": [], "services": []}
    """Mode -> per round, the measured steps' seconds."""
    episodes: dict[str, float] = {"in_process": 0.0, "services": 0.0}
    startup: dict[str, list[float]] = {"in_process": [], "services": []}
    phases: dict[str, dict[str, list[float]]] = {
        mode: {"rollout": [], "train": []} for mode in ("in_process", "services")
    }
    cpu: dict[str, dict[str, float]] = {"in_process": {}, "services": {}}
    machine: dict[str, float] = {"in_process": 0.0, "services": 0.0}
    with tempfile.TemporaryDirectory(prefix="omniloop-bench-") as scratch, CpuSampler() as sampler:
        root = Path(scratch)
        model = None
        if args.task == "toy":
            from warm_start import warm_start

            model = warm_start(root / "model")
        for round_ in range(args.rounds):
            for mode in ("in_process", "services"):
                extra = args.set if mode == "services" else []
                result = train_once(model, root / f"{mode}-{round_}", mode, args.steps, extra)
                metrics = result["metrics"]
                measured = (metrics[WARMUP_STEPS - 1]["time"], metrics[-1]["time"])
                for kind, seconds in sampler.between(*measured).items():
                    cpu[mode][kind] = cpu[mode].get(kind, 0.0) + seconds
                machine[mode] += sampler.machine_between(*measured)
                kept = metrics[WARMUP_STEPS:]
                steps[mode].append([m["perf/step_seconds"] for m in kept])
                episodes[mode] += sum(m["episodes/count"] for m in kept)
                startup[mode].append(result["startup_s"])
                for phase in ("rollout", "train"):
                    phases[mode][phase] += [m[f"perf/{phase}_seconds"] for m in kept]
    every = {mode: [s for run in runs for s in run] for mode, runs in steps.items()}
    services = statistics.mean(every["services"])
    in_process = statistics.mean(every["in_process"])
    print(
        json.dumps(
            {
                "bench": "services_overhead",
                "task": args.task,
                "step_seconds_services": round(services, 3),
                "step_seconds_in_process": round(in_process, 3),
                "ratio": round(services / in_process, 3),
                "ratio_per_round": [
                    round(statistics.mean(ours) / statistics.mean(theirs), 3)
                    for ours, theirs in zip(steps["services"], steps["in_process"], strict=True)
                ],
                **{
                    f"step_seconds_median_{mode}": round(statistics.median(values), 3)
                    for mode, values in every.items()
                },
                **{
                    f"episodes_per_s_{mode}": round(episodes[mode] / sum(values), 2)
                    for mode, values in every.items()
                },
                **{
                    f"{phase}_seconds_{mode}": round(statistics.median(values), 3)
                    for mode, by_phase in phases.items()
                    for phase, values in by_phase.items()
                },
                **{
                    f"cpu_per_step_{mode}": {
                        kind: round(seconds / len(every[mode]), 3)
                        for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1])
                        if seconds / len(every[mode]) >= 0.01
                    }
                    for mode, by_kind in cpu.items()
                },
                **{
                    f"machine_cpu_per_step_{mode}": round(seconds / len(every[mode]), 3)
                    for mode, seconds in machine.items()
                },
                "startup_s_services": round(statistics.median(startup["services"]), 1),
                "startup_s_in_process": round(statistics.median(startup["in_process"]), 1),
                "steps_measured_per_mode": len(every["services"]),
                "rounds": args.rounds,
                "services_overrides": args.set,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
