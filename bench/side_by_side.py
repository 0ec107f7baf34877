"""Variants of one training run side by side: the same task trained under each variant's
settings, the order rotated every round, in one invocation, so that every variant meets the
same machine.

A variant is a name and its settings, each a dotted override of the run (`services.mode=
in_process`, `data_plane.max_poll_interval_s=0.1`) or an environment variable for the run's
processes (`ENV:RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000`). An environment variable is set
before the run starts and removed after it: a run starts its own Ray instance, whose processes
(the role replicas among them) read it; this process's modules that read it at import keep
the value they read. `--task` as in `services_overhead.py` (`toy`: the toy tool task, tiny
model; `calculator`: `make run`'s job). Per run, the mean `perf/step_seconds` of the steps
after its first `WARMUP_STEPS`, and the CPU of those steps as `services_overhead.py` samples
it.

Prints ONE JSON line: per variant (`variants`), its `settings`, `step_seconds` (the mean over
its rounds' measured steps), `step_seconds_per_round` (in round order), `ratio` (its
`step_seconds` over the first variant's), `machine_cpu_per_step` (the machine's busy CPU
seconds per measured step) and `cpu_per_step` (by kind of process, those of 0.01 s or more);
`order` (the variants' order in each round), the load average and the CPU count.

    .venv/bin/python bench/side_by_side.py [--task toy|calculator] [--steps 12] [--rounds 3]
        [--variant NAME=SETTING,SETTING... --variant NAME=...]

Without `--variant`, the variants are the roles in one process and as services.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from services_overhead import WARMUP_STEPS, CpuSampler
from toy_run import TOY, task_config, task_parser
from toy_run import train as train_run

DEFAULT_VARIANTS = ("in_process=services.mode=in_process", "services=services.mode=services")
"""Without `--variant`: the roles in one process beside the roles as services."""
ENV = "ENV:"
"""Prefix of a setting that is an environment variable rather than a dotted override."""


def parse_variant(text: str) -> tuple[str, list[str], dict[str, str]]:
    """`NAME=SETTING,SETTING...` as (name, dotted overrides, environment variables)."""
    name, sep, settings = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: write NAME=SETTING,SETTING... (or NAME= for none)")
    overrides, env = [], {}
    for setting in filter(None, settings.split(",")):
        if setting.startswith(ENV):
            key, sep, value = setting[len(ENV) :].partition("=")
            if not sep or not key:
                raise SystemExit(f"--variant {name}: {setting!r} is not ENV:NAME=VALUE")
            env[key] = value
        elif "=" not in setting:
            raise SystemExit(f"--variant {name}: {setting!r} is not a dotted KEY=VALUE")
        else:
            overrides.append(setting)
    return name, overrides, env


def run_variant(
    model: Path | None, run_dir: Path, steps: int, overrides: list[str], env: dict[str, str]
) -> list[dict[str, Any]]:
    """One run (the toy task on `model`, or the calculator task when `model` is None) with
    `overrides` applied and `env` set for its duration; its step metrics."""
    config = task_config(model, run_dir, steps, [f"checkpoint_every={steps}", *overrides])
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        metrics, _ = train_run(config)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return metrics


def main() -> None:
    parser = task_parser(
        __doc__.split("\n\n")[0], steps=12, rounds=3, rounds_help="runs per variant, rotated"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SETTING,...",
        help="a variant: dotted overrides and ENV:NAME=VALUE settings (two or more; "
        "default: in process and services)",
    )
    args = parser.parse_args()
    args.variant = args.variant or list(DEFAULT_VARIANTS)
    variants = [parse_variant(text) for text in args.variant]
    names = [name for name, _, _ in variants]
    if len(variants) < 2 or len(set(names)) != len(names):
        raise SystemExit("give two or more --variant NAME=..., each NAME once")
    if args.steps <= WARMUP_STEPS + 1:
        raise SystemExit(f"--steps {args.steps}: runs need more than {WARMUP_STEPS + 1} steps")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.task == "toy":  # its siblings' names (`agent`) are the calculator's too
        sys.path.insert(0, str(TOY))

    steps: dict[str, list[list[float]]] = {name: [] for name in names}
    cpu: dict[str, dict[str, float]] = {name: {} for name in names}
    machine = dict.fromkeys(names, 0.0)
    order = []
    with tempfile.TemporaryDirectory(prefix="omniloop-bench-") as scratch, CpuSampler() as sampler:
        root = Path(scratch)
        model = None
        if args.task == "toy":
            from warm_start import warm_start

            model = warm_start(root / "model")
        for round_ in range(args.rounds):
            shift = round_ % len(variants)
            rotated = variants[shift:] + variants[:shift]
            order.append([name for name, _, _ in rotated])
            for name, overrides, env in rotated:
                metrics = run_variant(model, root / f"{name}-{round_}", args.steps, overrides, env)
                measured = (metrics[WARMUP_STEPS - 1]["time"], metrics[-1]["time"])
                for kind, seconds in sampler.between(*measured).items():
                    cpu[name][kind] = cpu[name].get(kind, 0.0) + seconds
                machine[name] += sampler.machine_between(*measured)
                steps[name].append([m["perf/step_seconds"] for m in metrics[WARMUP_STEPS:]])
    mean = {name: statistics.mean(s for run in runs for s in run) for name, runs in steps.items()}
    measured_steps = {name: sum(len(run) for run in runs) for name, runs in steps.items()}
    report = {
        name: {
            "settings": [
                s for s in args.variant[names.index(name)].partition("=")[2].split(",") if s
            ],
            "step_seconds": round(mean[name], 3),
            "step_seconds_per_round": [round(statistics.mean(run), 3) for run in steps[name]],
            "ratio": round(mean[name] / mean[names[0]], 3),
            "machine_cpu_per_step": round(machine[name] / measured_steps[name], 3),
            "cpu_per_step": {
                kind: round(seconds / measured_steps[name], 3)
                for kind, seconds in sorted(cpu[name].items(), key=lambda kv: -kv[1])
                if seconds / measured_steps[name] >= 0.01
            },
        }
        for name in names
    }
    print(
        json.dumps(
            {
                "bench": "side_by_side",
                "task": args.task,
                "steps": args.steps,
                "rounds": args.rounds,
                "variants": report,
                "order": order,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
