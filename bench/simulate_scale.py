"""A discrete-event model of omniloop's training loop, from our 2-core runs to 1,000 GPUs.

The loop is `controller.train_loop` step for step: rollout `k` (all its episodes) is released
once `k - steps_trained <= max_staleness`; train(k) starts once the loop reaches `k` and every
row of step `k` has its advantage (the actor reads them all, then takes one optimizer step);
sync(version) pauses every engine while it loads the new weights; then the gate advances; then
the step is recorded and, every `checkpoint_every` steps, saved. Around it: engines that share
their throughput among running sequences, sandbox hosts with a number of slots, rollout
replicas with their share of `rollout.concurrency`, cores shared by engine, trainer and
replicas on one machine (`small`), and failures per role with their recovery and retries
(faults.py, services.py). docs/benchmarks.md ("Scale model") lists what is modelled, what is
not, the formulas and where every default comes from.

ETTR (RobustRL's effective training time ratio, T_eff / T_total): the wall time of the same run
(same seed, same draws) without failures over its wall time with them, at most 1; detection,
recovery, re-run episodes, redone steps and the waits they cause are what is lost.

Prints ONE JSON line: per `--staleness` setting throughput (trained episodes/s, sampled
tokens/s, steps/hour), staleness of the trained samples, ETTR, engine and trainer utilisation
and stage seconds; `--check` compares the `small` preset with what docs/benchmarks.md measured.

    .venv/bin/python bench/simulate_scale.py [--scale small|1000gpu] [--workload NAME]
        [--staleness 0,1,2,4,inf] [--steps N] [--seed S] [--fault-scale X]
        [--set FIELD=VALUE ...] [--measured RUN_DIR]
    .venv/bin/python bench/simulate_scale.py --check
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

ROLES = ("engine", "rollout", "advantage", "sandbox", "actor")

# -- parameters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """`lognormal` (median `a`, sigma `b`) or `pareto` (scale `a`, shape `b`), capped."""

    kind: Literal["lognormal", "pareto"]
    a: float
    b: float
    cap: float = math.inf

    def draw(self, rng: random.Random) -> float:
        if self.kind == "pareto":
            return min(self.a * (1.0 - rng.random()) ** (-1.0 / self.b), self.cap)
        return min(self.a * math.exp(self.b * rng.gauss(0.0, 1.0)), self.cap)


@dataclass(frozen=True)
class Workload:
    """What one step asks for."""

    name: str
    episodes_per_step: int
    group_size: int
    turns: tuple[int, int]  # uniform in [min, max]
    final_tool: bool  # a tool call after the last turn too (else turns - 1 calls)
    sampled_tokens: Dist  # per turn
    context_tokens: int  # prompt and observations: trained, not sampled
    tool_seconds: Dist
    turn_work: float  # engine work of a turn beyond its samples (prefill, HTTP), in tokens


@dataclass(frozen=True)
class Cluster:
    """Machines and per-step time models."""

    engines: int
    engine_peak: float  # tokens/s of one engine as its batch grows
    engine_half: float  # the batch at which it gives half of that
    engine_max_batch: int
    slow_engines: float  # share of straggler engines, running at `slow_factor`
    slow_factor: float
    rollout_replicas: int
    concurrency: int  # rollout.concurrency: episodes at once across all steps in flight
    sandbox_hosts: int
    sandbox_slots: int
    episode_cpu_s: float  # rollout-side CPU of an episode (Serve, data plane, store, sandbox)
    episode_cpu_pre: float  # the share of it before the first turn (the rest after the last)
    trainer_ranks: int
    train_fixed_s: float
    train_token_s: float  # one rank's seconds per trained token
    grad_bytes: float
    link_gbps: float
    link_latency_s: float
    weight_bytes: float
    sync_gbps: float
    sync_log_factor: float
    record_s: float  # controller bookkeeping a step (metrics, run store, trained ids)
    checkpoint_every: int
    checkpoint_s: float
    retry_pause_s: float
    max_attempts: int  # faults.max_attempts: runs of one episode before the run fails
    host_cores: float | None  # cores engine, trainer and replicas share; None: dedicated
    rollout_cpu: float  # cores the rollout replicas can use together
    fault_rate: dict[str, float]  # failures per unit per hour, by role
    recovery_s: dict[str, float]

    def train_seconds(self, tokens: int) -> float:
        """One optimizer step: compute split over the ranks plus a ring all-reduce."""
        m = self.trainer_ranks
        comm = 2 * self.grad_bytes * (m - 1) / m / (self.link_gbps * 1e9) if m > 1 else 0.0
        return self.train_fixed_s + self.train_token_s * tokens / m + comm + (
            math.log2(m) * self.link_latency_s)  # fmt: skip

    def sync_seconds(self) -> float:
        """The weights to every engine: a broadcast, slowed by log2(engines)."""
        spread = 1.0 + self.sync_log_factor * math.log2(max(self.engines, 1))
        return self.weight_bytes / (self.sync_gbps * 1e9) * spread


# -- defaults: measured (docs/benchmarks.md) unless said otherwise ------------------------------

# bench/engine_cpu.py, SmolLM2 on one thread: 119.0 tok/s at 8 concurrent, 153.7 at 32; the
# curve peak * c / (c + half) through both points.
SMOL_HALF = (32 * 153.7 / 119.0 - 32) / (4 - 153.7 / 119.0)
SMOL_PEAK = 119.0 * (8 + SMOL_HALF) / 8
SMOL_BYTES, TINY_BYTES = 538_060_032, 12_879_104  # weight_sync.py; a toy run's weight_sync/bytes
SYNC_GBPS, DISK_GBPS, LOOPBACK_GBPS = 0.884, 1.477, 1.335  # weight_sync.py: gloo, disk, TCP
# make run: per step wall / rollout / optimizer step 29.9 / 14.7 / 28.9 s, 24 episodes and
# ~2k trained tokens a step, 28 steps, a checkpoint every 14 (1.6 GB with the AdamW state).
RUN_STEP_S, RUN_ROLLOUT_S, RUN_TRAIN_S, RUN_STEPS, RUN_CKPT_BYTES = 29.9, 14.7, 28.9, 28, 1.6e9
RUN_CKPT_S = RUN_CKPT_BYTES / (DISK_GBPS * 1e9)
# bench/async_speedup.py, 30 steps x 32 episodes. The sync run's rollout, trainer stage and
# optimizer step a step and its CPU seconds; start-up of both runs; the speedup; both walls.
LT_ROLLOUT_S, LT_STAGE_S, LT_OPT_S, LT_CPU_S, LT_STARTUP_S = 4.179, 1.813, 1.693, 177.9, 25.5
LT_SPEEDUP, LT_SYNC_WALL_S, LT_ASYNC_WALL_S, LT_STEPS = 1.838, 179.75, 97.82, 30
# Rollout CPU of an episode: the sync run's CPU a step (its start-up taken as one core busy)
# less its trainer stage (one thread), over its 32 episodes.
EPISODE_CPU_S = ((LT_CPU_S - LT_STARTUP_S / 2) / LT_STEPS - LT_STAGE_S) / 32
# Fitted to inputs only (tests/unit/bench checks them): the share of an episode's CPU before
# its turns, such that the long-tail sync run's rollout is the measured 4.18 s (mean of the
# `--check` seeds); then (`calibrate`) the calculator's engine work a turn and its trainer's
# cost a token without contention, such that the `small` preset's rollout and optimizer step
# take the measured 14.7 s and 28.9 s while they overlap (max_staleness=1).
EPISODE_CPU_PRE, CALC_TURN_WORK, CALC_TOKEN_S = 0.254, 29.8, 0.01396

# fmt: off
WORKLOADS = {
    # examples/calculator/train.yaml: 6 tasks x 4; a call turn and an answer turn (~4 and ~3
    # tokens, at most 12); one bwrap call (bench/sandbox_bwrap.py: p50 12.1 ms, p99 39.4 ms).
    "calculator": Workload("calculator", 24, 4, (2, 2), False, Dist("lognormal", 3.5, 0.4, 12),
                           76, Dist("lognormal", 0.0121, math.log(39.4 / 12.1) / 2.326),
                           CALC_TURN_WORK),
    # bench/async_speedup.py: 4 tasks x 8; one 8-token turn; then the sandbox waits
    # Pareto(1.2) from 0.15 s, capped at 5 s, before the call.
    "long_tail": Workload("long_tail", 32, 8, (1, 1), True, Dist("lognormal", 8, 0.0), 60,
                          Dist("pareto", 0.15, 1.2, 5.0), CALC_TURN_WORK),
    # Assumed: SWE-style episodes, 2-12 turns of reasoning (median 800 tokens) each followed by
    # a tool call (median 1.5 s, heavy tail to 10 min: test runs, builds).
    "agentic": Workload("agentic", 2048, 16, (2, 12), False, Dist("lognormal", 800, 0.9, 16384),
                        4800, Dist("lognormal", 1.5, 1.2, 600.0), 25.0),
}

SMALL = Cluster(
    engines=1, engine_peak=SMOL_PEAK, engine_half=SMOL_HALF,
    engine_max_batch=32,  # the CPU engine's default max_batch
    slow_engines=0.0, slow_factor=1.0,
    rollout_replicas=2,  # services.rollout_replicas
    concurrency=16,  # the calculator's rollout.concurrency
    sandbox_hosts=1, sandbox_slots=1024,  # bwrap sandboxes are made on demand
    episode_cpu_s=EPISODE_CPU_S, episode_cpu_pre=EPISODE_CPU_PRE,
    trainer_ranks=1, train_fixed_s=0.0, train_token_s=CALC_TOKEN_S,
    grad_bytes=SMOL_BYTES, link_gbps=LOOPBACK_GBPS, link_latency_s=1e-4,
    weight_bytes=SMOL_BYTES, sync_gbps=SYNC_GBPS,
    sync_log_factor=0.5,  # assumed: a gloo broadcast tree
    # What the measured step leaves after its optimizer step, sync and share of 2 checkpoints.
    record_s=RUN_STEP_S - RUN_TRAIN_S - SMOL_BYTES / (SYNC_GBPS * 1e9) - 2 * RUN_CKPT_S / 28,
    checkpoint_every=14, checkpoint_s=RUN_CKPT_S,
    retry_pause_s=0.5, max_attempts=3,  # faults.retry_pause_s, faults.max_attempts
    host_cores=2.0,  # the benchmark machine: engine and trainer one thread each
    rollout_cpu=2.0,  # two replicas, one event loop each
    fault_rate={role: 0.0 for role in ROLES},  # no failure in any measured run
    # Stateless: Serve's 2 s health check period plus a replica start; engine ~30 s; actor:
    # a checkpoint load plus 30 s.
    recovery_s={"engine": 30.0, "rollout": 5.0, "advantage": 5.0, "sandbox": 5.0,
                "actor": RUN_CKPT_S + 30.0},
)

# Assumed, not measured: a 32B dense model in bf16 on H100 SXM (989 TFLOP/s, 3.35 TB/s HBM,
# 400 Gb/s InfiniBand a GPU), MFU 0.4; 192 engines of TP4 (768 GPUs), 256 trainer GPUs.
# Decoding is memory-bound: a sequence alone takes (weights / TP) / HBM x 1.25 (TP all-reduce)
# a token, a batch of 64 twice that. Failures: Llama 3's 419 unexpected interruptions in 54
# days on 16,384 GPUs (2.0e-5 per GPU-hour); CPU hosts 1e-4 per hour.
PARAMS, GPU_FAILS = 32e9, 419 / (54 * 24 * 16384)
T0 = PARAMS * 2 / 4 / 3.35e12 * 1.25
GPU1000 = replace(
    SMALL, engines=192, engine_peak=64 / T0, engine_half=64.0, engine_max_batch=128,
    slow_engines=0.02, slow_factor=0.7,  # assumed: a few throttled or badly linked engines
    rollout_replicas=48, concurrency=48 * 128, sandbox_hosts=64, sandbox_slots=96,
    trainer_ranks=256, train_fixed_s=1.0, train_token_s=6 * PARAMS / (989e12 * 0.4),
    grad_bytes=PARAMS * 2, link_gbps=50.0, link_latency_s=2e-5,
    weight_bytes=PARAMS * 2, sync_gbps=50.0, sync_log_factor=0.1, record_s=0.5,
    checkpoint_every=10, checkpoint_s=PARAMS * 16 / 256e9,  # weights + Adam, 1 GB/s a rank
    host_cores=None, rollout_cpu=math.inf,
    fault_rate={"engine": 4 * GPU_FAILS, "actor": 256 * GPU_FAILS, "rollout": 1e-4,
                "advantage": 1e-4, "sandbox": 1e-4},
    recovery_s={"engine": 30.0, "rollout": 5.0, "advantage": 5.0, "sandbox": 5.0,
                "actor": PARAMS * 16 / 256e9 + 30.0},
)

# `small` as bench/async_speedup.py ran it: rollout.concurrency=96; the tiny model (CPU decoding
# is memory-bound: faster by SmolLM2's bytes over its own); its optimizer step from the sync
# run (nothing overlaps it there) over 32 episodes of ~68 tokens; one checkpoint at the end; the
# rest of the trainer stage is bookkeeping.
SMALL_TINY = replace(
    SMALL, concurrency=96, engine_max_batch=96, engine_peak=SMOL_PEAK * SMOL_BYTES / TINY_BYTES,
    train_token_s=LT_OPT_S / (32 * 68), grad_bytes=TINY_BYTES, weight_bytes=TINY_BYTES,
    record_s=LT_STAGE_S - LT_OPT_S - TINY_BYTES / (SYNC_GBPS * 1e9), checkpoint_every=LT_STEPS,
    checkpoint_s=0.0,
)
# fmt: on
SCALES = {"small": (SMALL, "calculator"), "1000gpu": (GPU1000, "agentic")}
CLUSTERS = {("small", "long_tail"): SMALL_TINY}  # the model that workload's run trained

# -- processor sharing ----------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Job:
    work: float
    done: Callable[[Any], None]
    owner: Any
    active: bool = False
    group: Group | None = None


class Group:
    """Jobs sharing one resource equally (an engine's sequences, a host's tool calls): each
    active one gets `speed(n)` units/s while the host grants what the group asks (`demand`),
    less when it grants less; at most `limit` run, the rest queue. Service is one running
    total for the whole group, so a change costs O(log n)."""

    host: Host

    def __init__(
        self, sim: Sim, cap: float, speed: Callable[[int], float], batch: bool, limit: float
    ) -> None:
        self.sim, self.cap, self.speed, self.batch, self.limit = sim, cap, speed, batch, limit
        self.heap: list[tuple[float, int, Job]] = []
        self.waiting: deque[Job] = deque()
        self.n, self.served, self.rate, self.last, self.granted = 0, 0.0, 0.0, 0.0, 0.0
        self.paused, self.token, self.busy_s, self.load_s = False, 0, 0.0, 0.0

    def demand(self) -> float:
        """Cores asked for: all of `cap` for a batch (an engine), one a job otherwise."""
        if self.n == 0 or self.paused:
            return 0.0
        return self.cap if self.batch else min(self.cap, float(self.n))

    def advance(self) -> None:
        dt, self.last = self.sim.now - self.last, self.sim.now
        self.served += self.rate * dt
        self.busy_s += dt if self.rate > 0 else 0.0
        self.load_s += self.n * dt

    def add(self, job: Job) -> None:
        job.group = self
        if self.n >= self.limit:
            self.waiting.append(job)
            return
        self.advance()
        self._start(job)
        self.host.refresh()

    def _start(self, job: Job) -> None:
        job.active = True
        self.n += 1
        heapq.heappush(self.heap, (self.served + job.work, self.sim.tick(), job))

    def cancel(self, job: Job) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
        elif job.active:
            self.advance()
            job.active = False
            self.n -= 1
            self._fill()
            self.host.refresh()

    def clear(self) -> list[Job]:
        """Drop every job (the resource died) and return them."""
        self.advance()
        jobs = [j for _, _, j in self.heap if j.active] + list(self.waiting)
        for job in jobs:
            job.active = False
        self.heap, self.waiting, self.n = [], deque(), 0
        self.host.refresh()
        return jobs

    def pause(self, paused: bool) -> None:
        self.advance()
        self.paused = paused
        self.host.refresh()

    def _fill(self) -> None:
        while self.waiting and self.n < self.limit:
            self._start(self.waiting.popleft())

    def retime(self) -> None:
        """Take the rate the host's grant allows; schedule the next completion."""
        self.advance()
        demand = self.demand()
        self.rate = self.speed(self.n) * self.granted / demand if demand > 0 else 0.0
        self.token += 1
        while self.heap and not self.heap[0][2].active:
            heapq.heappop(self.heap)
        if self.heap and self.rate > 0:
            self.sim.at(max(self.heap[0][0] - self.served, 0.0) / self.rate, self._due, self.token)

    def _due(self, token: int) -> None:
        if token != self.token:
            return
        self.advance()
        finished = []
        while self.heap and self.heap[0][0] <= self.served + 1e-9 * max(1.0, self.served):
            job = heapq.heappop(self.heap)[2]
            if job.active:
                job.active, self.n = False, self.n - 1
                finished.append(job)
        self._fill()
        self.host.refresh()
        for job in finished:
            job.done(job.owner)


class Host:
    """Cores divided max-min fairly among its groups (`cores=None`: no limit)."""

    def __init__(self, cores: float | None, groups: list[Group]) -> None:
        self.cores, self.groups = cores, groups
        for group in groups:
            group.host = self

    def refresh(self) -> None:
        demands = [g.demand() for g in self.groups]
        grants = demands
        if self.cores is not None and sum(demands) > self.cores:
            grants, left = [0.0] * len(demands), self.cores
            order = sorted(range(len(demands)), key=lambda i: demands[i])
            for rank, i in enumerate(order):
                grants[i] = min(demands[i], left / (len(order) - rank))
                left -= grants[i]
        for group, grant in zip(self.groups, grants, strict=True):
            group.granted = grant
            group.retime()


# -- the model ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Episode:
    step: int
    index: int
    phases: list[tuple[bool, float]]  # (generation?, tokens of work | tool seconds)
    sampled: int
    tokens: int
    attempt: int = 0
    phase: int = -1
    engine: int = -1
    replica: int = -1
    sandbox: int = -1
    version: int | None = None  # the oldest weight version that sampled it
    job: Job | None = None
    live: bool = True


@dataclass
class StepState:
    episodes: list[Episode]
    groups: Counter[int] = field(default_factory=Counter)
    ready: int = 0
    first_start: float | None = None
    rollout_end: float | None = None


@dataclass
class Unit:
    """A failure domain with episodes on it: an engine, a rollout replica, a sandbox host."""

    up: bool = True
    episodes: dict[Episode, None] = field(default_factory=dict)  # ordered: deterministic


class Sim:
    """One run of `steps` steps under one `max_staleness` bound."""

    def __init__(
        self, cluster: Cluster, work: Workload, bound: float, steps: int, seed: int, faults: bool
    ) -> None:
        self.c, self.w, self.bound, self.steps, self.seed = cluster, work, bound, steps, seed
        self.now, self._ticks = 0.0, itertools.count()
        self._q: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        rng = random.Random(f"engines/{seed}")
        self.engine_groups = []
        for _ in range(cluster.engines):
            peak = cluster.engine_peak * (
                cluster.slow_factor if rng.random() < cluster.slow_engines else 1.0)  # fmt: skip
            speed = lambda n, p=peak, h=cluster.engine_half: p / (n + h)  # noqa: E731
            self.engine_groups.append(Group(self, 1.0, speed, True, cluster.engine_max_batch))
        self.trainer = Group(self, 1.0, lambda n: 1.0, True, 1)
        cpu = cluster.rollout_cpu
        self.cpu = Group(self, cpu, lambda n: min(cpu, n) / n if n else 0.0, False, math.inf)
        # Tool calls wait (in a sandbox, maybe another machine): never on the shared cores.
        self.sandbox_groups = [Group(self, math.inf, lambda n: 1.0, False, cluster.sandbox_slots)
                               for _ in range(cluster.sandbox_hosts)]  # fmt: skip
        groups = [*self.engine_groups, self.trainer, self.cpu]
        if cluster.host_cores:
            Host(cluster.host_cores, groups)
        for group in self.sandbox_groups + ([] if cluster.host_cores else groups):
            Host(None, [group])
        sizes = {"engine": cluster.engines, "rollout": cluster.rollout_replicas,
                 "sandbox": cluster.sandbox_hosts}  # fmt: skip
        self.units = {role: [Unit() for _ in range(n)] for role, n in sizes.items()}
        self.engines, self.replicas, self.sandboxes = self.units.values()
        self.per_replica = max(1, math.ceil(cluster.concurrency / cluster.rollout_replicas))
        self.admit_queue: deque[Episode] = deque()
        self.stalled: list[Episode] = []  # waiting for an engine or sandbox host to return
        self.rr = self.epoch = self.version = self.served_version = 0
        self.released = self.trained = 0  # the gate: steps released, steps trained
        self.syncing = False
        self.checkpoint = (0, 0)  # (step, version) of the last checkpoint
        self.advantage_up_at = self.step_started = 0.0
        self.state: dict[int, StepState] = {}
        self.records: dict[int, dict[str, Any]] = {}
        self.waiting_train: int | None = None
        self.done_at: float | None = None
        self.failed: str | None = None
        self.faults: Counter[str] = Counter()
        self.reruns = self.redone = self.restarts = self.resent = 0
        for role in ROLES if faults else ():
            for unit in range(len(self.units.get(role, [Unit()]))):
                self._schedule_fault(role, unit, random.Random(f"fault/{seed}/{role}/{unit}"))

    def tick(self) -> int:
        return next(self._ticks)

    def at(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._q, (self.now + delay, self.tick(), fn, args))

    def run(self) -> dict[str, Any]:
        self._release()
        self._loop(0)
        while self._q and self.done_at is None:
            self.now, _, fn, args = heapq.heappop(self._q)
            fn(*args)
        return self._report()

    # -- rollout

    def _release(self) -> None:
        """The gate: release every step k with k - steps_trained <= max_staleness."""
        while self.released < self.steps and self.released - self.trained <= self.bound:
            k, self.released = self.released, self.released + 1
            self.state[k] = StepState([self._draw(k, i) for i in range(self.w.episodes_per_step)])
            self.admit_queue.extend(self.state[k].episodes)
        self._admit()

    def _draw(self, step: int, index: int) -> Episode:
        rng = random.Random(f"{self.seed}/{step}/{index}")
        turns = rng.randint(*self.w.turns)
        phases: list[tuple[bool, float]] = []
        for t in range(turns):
            phases.append((True, max(1, round(self.w.sampled_tokens.draw(rng)))))
            if t < turns - 1 or self.w.final_tool:
                phases.append((False, self.w.tool_seconds.draw(rng)))
        sampled = int(sum(work for generating, work in phases if generating))
        phases = [(g, work + self.w.turn_work if g else work) for g, work in phases]
        return Episode(step, index, phases, sampled, sampled + self.w.context_tokens)

    def _admit(self) -> None:
        while self.admit_queue:
            for _ in self.replicas:
                self.rr = (self.rr + 1) % len(self.replicas)
                replica = self.replicas[self.rr]
                if replica.up and len(replica.episodes) < self.per_replica:
                    break
            else:
                return
            episode = self.admit_queue.popleft()
            episode.replica, replica.episodes[episode] = self.rr, None
            state = self.state[episode.step]
            state.first_start = self.now if state.first_start is None else state.first_start
            episode.job = Job(self.c.episode_cpu_s * self.c.episode_cpu_pre, self._next_phase,
                              episode)  # fmt: skip
            self.cpu.add(episode.job)

    def _next_phase(self, episode: Episode) -> None:
        if not episode.live:
            return
        episode.phase += 1
        if episode.phase == len(episode.phases):  # its rows, its record: rollout-side CPU
            episode.job = Job(self.c.episode_cpu_s * (1 - self.c.episode_cpu_pre),
                              self._next_phase, episode)  # fmt: skip
            self.cpu.add(episode.job)
        elif episode.phase > len(episode.phases):
            self._finished(episode)
        else:
            self._resume_phase(episode)

    def _resume_phase(self, episode: Episode) -> None:
        generating, work = episode.phases[episode.phase]
        units, groups = (self.engines, self.engine_groups) if generating else (
            self.sandboxes, self.sandbox_groups)  # fmt: skip
        i = self._pick(units, episode.engine if generating else episode.sandbox, episode)
        if i < 0:
            return
        if generating:
            episode.engine = i
            if episode.version is None:  # requests that arrive during a sync get its weights
                episode.version = self.version if self.syncing else self.served_version
        else:
            episode.sandbox = i
        episode.job = Job(work, self._next_phase, episode)
        groups[i].add(episode.job)

    def _pick(self, units: list[Unit], current: int, episode: Episode) -> int:
        """The episode's unit if it is up, else the least loaded live one (-1: none)."""
        if current >= 0 and units[current].up:
            return current
        live = [i for i, u in enumerate(units) if u.up]
        if not live:
            self.stalled.append(episode)
            return -1
        if current >= 0:
            units[current].episodes.pop(episode, None)
        chosen = min(live, key=lambda i: len(units[i].episodes))
        units[chosen].episodes[episode] = None
        return chosen

    def _finished(self, episode: Episode) -> None:
        episode.job = None
        self._unpin(episode)
        state = self.state[episode.step]
        group = episode.index // self.w.group_size
        state.groups[group] += 1
        if state.groups[group] == self.w.group_size:  # its advantages, once the role is up
            delay = max(0.0, self.advantage_up_at - self.now)
            self.at(delay, self._group_ready, episode.step, self.epoch)
        self._admit()

    def _group_ready(self, step: int, epoch: int) -> None:
        if epoch != self.epoch:
            return
        state = self.state[step]
        state.ready += self.w.group_size
        if state.ready == self.w.episodes_per_step:
            state.rollout_end = self.now
            if self.waiting_train == step:
                self._train(step)

    def _unpin(self, episode: Episode) -> None:
        for units, i in zip(self.units.values(), (episode.engine, episode.replica,
                                                  episode.sandbox), strict=True):  # fmt: skip
            if i >= 0:
                units[i].episodes.pop(episode, None)

    def _rerun(self, episode: Episode, role: str) -> None:
        """Work a dead replica cut off: the episode runs again from the start, same draws."""
        if not episode.live:
            return
        if episode.attempt + 1 >= self.c.max_attempts:  # faults.Retry raises RoleFailed
            self._give_up(f"the {role} role lost step {episode.step} episode {episode.index} "
                          f"{self.c.max_attempts} times (faults.max_attempts)")  # fmt: skip
        episode.live = False
        if episode.job is not None and episode.job.group is not None:
            episode.job.group.cancel(episode.job)
        if episode in self.stalled:
            self.stalled.remove(episode)
        self._unpin(episode)
        again = Episode(episode.step, episode.index, episode.phases, episode.sampled,
                        episode.tokens, attempt=episode.attempt + 1)  # fmt: skip
        episodes = self.state[episode.step].episodes
        episodes[episodes.index(episode)] = again
        self.reruns += 1
        self.at(self.c.retry_pause_s, self._readmit, again, self.epoch)
        self._admit()

    def _readmit(self, episode: Episode, epoch: int) -> None:
        if epoch == self.epoch:
            self.admit_queue.appendleft(episode)
            self._admit()

    # -- the control loop (train_loop)

    def _loop(self, step: int) -> None:
        self.step_started, self.waiting_train = self.now, step
        if self.state[step].rollout_end is not None:
            self._train(step)

    def _train(self, step: int) -> None:
        self.waiting_train = None
        staleness: Counter[int] = Counter()
        refused = tokens = sampled = 0
        for episode in self.state[step].episodes:
            assert episode.version is not None
            s = self.version - episode.version
            if s > self.bound:  # StalenessGate.admit: never true while the gate holds
                refused += 1
                continue
            staleness[s] += 1
            tokens, sampled = tokens + episode.tokens, sampled + episode.sampled
        state = self.state[step]
        self.records[step] = {"staleness": staleness, "refused": refused, "sampled": sampled,
                              "rollout": (state.rollout_end or 0.0) - (state.first_start or 0.0),
                              "train_start": self.now, "sync": 0.0}  # fmt: skip
        kept = sum(staleness.values())
        self.trainer.add(Job(self.c.train_seconds(tokens), self._trained, (step, kept)))

    def _trained(self, owner: tuple[int, int]) -> None:
        step, kept = owner
        record = self.records[step]
        record["train"] = self.now - record["train_start"]
        if not kept:  # no optimizer step, nothing to publish
            self._synced(step)
            return
        self.version += 1
        self.syncing, record["sync_start"] = True, self.now
        for group in self.engine_groups:
            group.pause(True)
        self.trainer.add(Job(self.c.sync_seconds(), self._synced, step))

    def _synced(self, step: int) -> None:
        if self.syncing:
            self.syncing, self.served_version = False, self.version
            self.records[step]["sync"] = self.now - self.records[step]["sync_start"]
            for group in self.engine_groups:
                group.pause(False)
        self.trained = step + 1
        self._release()  # gate.advance: only after the sync
        saving = (step + 1) % self.c.checkpoint_every == 0 or step + 1 == self.steps
        delay = self.c.record_s + (self.c.checkpoint_s if saving else 0.0)
        self.at(delay, self._step_end, step, saving, self.epoch)

    def _step_end(self, step: int, saving: bool, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.records[step] |= {"step": self.now - self.step_started, "end": self.now}
        if saving:
            self.checkpoint = (step + 1, self.version)
        if step + 1 == self.steps:
            self.done_at = self.now
        else:
            self._loop(step + 1)

    # -- failures

    def _schedule_fault(self, role: str, unit: int, rng: random.Random) -> None:
        rate = self.c.fault_rate.get(role, 0.0) / 3600.0
        if rate > 0:
            self.at(rng.expovariate(rate), self._fail, role, unit, rng)

    def _fail(self, role: str, unit: int, rng: random.Random) -> None:
        self.faults[role] += 1
        if role == "advantage":
            self.advantage_up_at = self.now + self.c.recovery_s[role]
        elif role == "actor":
            self._actor_lost()
        else:
            target = self.units[role][unit]
            target.up = False
            lost = list(target.episodes)  # a replica's episodes, a host's sandboxes
            if role == "engine":  # its turns are sent again to the next engine: the episode
                cut = [job.owner for job in self.engine_groups[unit].clear()]  # goes on
                for episode in target.episodes:
                    episode.engine = -1
                for episode in cut:
                    episode.version = None if episode.phase == 0 else episode.version
                    self.at(self.c.retry_pause_s, self._resend, episode, self.epoch)
                self.resent, lost = self.resent + len(cut), []
            elif role == "sandbox":
                self.sandbox_groups[unit].clear()
            target.episodes.clear()
            for episode in lost:
                self._rerun(episode, role)
        self.at(self.c.recovery_s[role], self._recovered, role, unit, rng)

    def _resend(self, episode: Episode, epoch: int) -> None:
        if episode.live and epoch == self.epoch:
            self._resume_phase(episode)

    def _recovered(self, role: str, unit: int, rng: random.Random) -> None:
        if role in self.units:
            self.units[role][unit].up = True
            waiting, self.stalled = self.stalled, []
            for episode in waiting:
                if episode.live:
                    self._resume_phase(episode)
            self._admit()
        elif role == "actor":
            for group in self.engine_groups:
                group.pause(False)
            self._release()
            self._loop(self.trained)
        self._schedule_fault(role, unit, rng)

    def _give_up(self, why: str) -> None:
        self.failed, self.done_at = self.failed or why, self.now

    def _actor_lost(self) -> None:
        """The run fails; `--resume` redoes everything after the last checkpoint."""
        self.restarts += 1
        if self.restarts > self.steps:
            self._give_up(f"the actor failed {self.restarts} times in {self.steps} steps: "
                          "faster than the run reaches its checkpoints")  # fmt: skip
        start, version = self.checkpoint
        self.redone += max(0, self.trained - start)
        self.epoch += 1
        for state in self.state.values():
            for episode in state.episodes:
                episode.live = False
        for group in [*self.engine_groups, *self.sandbox_groups, self.trainer, self.cpu]:
            group.clear()
        for unit in [*self.engines, *self.replicas, *self.sandboxes]:
            unit.episodes.clear()
        self.admit_queue.clear()
        self.stalled, self.syncing, self.waiting_train = [], False, None
        self.version = self.served_version = version
        self.trained = self.released = start
        for step in range(start, self.steps):
            self.records.pop(step, None)

    # -- results

    def _report(self) -> dict[str, Any]:
        wall = self.done_at or self.now
        for group in [*self.engine_groups, self.trainer]:
            group.advance()
        records = [r for r in self.records.values() if "step" in r]
        out: dict[str, Any] = {"wall_s": wall, "steps_done": len(records),
                               "faults": dict(self.faults), "episodes_rerun": self.reruns,
                               "turns_resent": self.resent,
                               "steps_redone": self.redone}  # fmt: skip
        if self.failed:
            out["failed"] = self.failed
        if not records:
            return out
        staleness: Counter[int] = sum((r["staleness"] for r in records), Counter())
        samples, n = sum(staleness.values()), len(self.engine_groups)
        ends = sorted(r["end"] for r in records)
        half = len(ends) // 2
        for stage in ("step", "rollout", "train", "sync"):
            out[f"{stage}_seconds"] = statistics.fmean(r[stage] for r in records)
        return out | {
            "episodes_per_s": samples / wall,
            "tokens_per_s": sum(r["sampled"] for r in records) / wall,
            "steps_per_hour": len(records) / wall * 3600,
            # Without the first steps' ramp-up: the second half of the run.
            "steady_steps_per_hour": (len(ends) - half) / (ends[-1] - ends[half - 1]) * 3600
            if half
            else None,
            "staleness_mean": sum(s * c for s, c in staleness.items()) / max(samples, 1),
            "staleness_max": max(staleness, default=0),
            "staleness_hist": {str(s): staleness[s] for s in sorted(staleness)},
            "refused": sum(r["refused"] for r in records),
            "engine_busy": sum(g.busy_s for g in self.engine_groups) / (n * wall),
            "engine_batch_fill": sum(g.load_s for g in self.engine_groups)
            / (n * self.c.engine_max_batch * wall),
            "trainer_busy": self.trainer.busy_s / wall,
        }


# -- experiments ----------------------------------------------------------------------------------


def parse_bound(text: str) -> float:
    """`max_staleness` as the controller reads it: a non-negative integer or `inf`."""
    text = text.strip().lower()
    if text != "inf" and not text.isdigit():
        raise SystemExit(f"--staleness: {text!r} is not a non-negative integer or 'inf'")
    return math.inf if text == "inf" else float(text)


def label(bound: float) -> str:
    return "inf" if math.isinf(bound) else str(int(bound))


def simulate(
    cluster: Cluster, work: Workload, bound: float, steps: int, seed: int, faults: bool = True
) -> dict[str, Any]:
    """One setting; ETTR against the same run without failures (at most 1: on a shared host a
    dead engine can free cores for the trainer)."""
    result = Sim(cluster, work, bound, steps, seed, faults).run()
    clean = Sim(cluster, work, bound, steps, seed, False).run() if result["faults"] else result
    # A run that failed part way: the share of the clean run its finished steps are.
    share = result["steps_done"] / clean["steps_done"] if clean["steps_done"] else 0.0
    result["wall_s_without_failures"] = clean["wall_s"]
    result["ettr"] = min(1.0, clean["wall_s"] * share / result["wall_s"])
    return result


def fit(trial: Callable[[float], tuple[Cluster, Workload]], target: float, key: str,
        hi: float, bound: float, steps: int, seed: int) -> float:  # fmt: skip
    """The x in [0, hi] whose simulated `key` is `target` (bisection; `key` rising in x)."""
    lo = 0.0
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if Sim(*trial(mid), bound, steps, seed, False).run()[key] < target else (
            lo, mid)  # fmt: skip
    return (lo + hi) / 2


def calibrate(cluster: Cluster, work: Workload, rollout_s: float, train_s: float,
              bound: float, steps: int, seed: int) -> tuple[float, float]:  # fmt: skip
    """(turn work, train seconds a token) that reproduce a run's rollout and optimizer step,
    which slow each other down on a shared host: three rounds of alternating fits."""
    turn, token = work.turn_work, cluster.train_token_s

    def with_turn(x: float) -> tuple[Cluster, Workload]:
        return replace(cluster, train_token_s=token), replace(work, turn_work=x)

    def with_token(x: float) -> tuple[Cluster, Workload]:
        return replace(cluster, train_token_s=x), replace(work, turn_work=turn)

    for _ in range(3):
        turn = fit(with_turn, rollout_s, "rollout_seconds", 1e4, bound, steps, seed)
        token = fit(with_token, train_s, "train_seconds", token * 4 + 1.0, bound, steps, seed)
    return turn, token


CHECK_TOLERANCE = {"step_seconds_error": 0.05, "async_speedup_error": 0.10}
"""Largest |relative error| `--check` accepts (tests/unit/bench asserts the same)."""
CHECK_SEEDS = 8
"""Seeds `--check` averages: one seed's 30 steps of tool tails move the speedup by +-5%."""


def check(seed: int) -> dict[str, Any]:
    """The `small` preset beside what docs/benchmarks.md measured, averaged over seeds."""
    runs: dict[str, list[float]] = {}
    for s in range(seed, seed + CHECK_SEEDS):
        calc = Sim(SMALL, WORKLOADS["calculator"], 1, RUN_STEPS, s, False).run()
        sync, async_ = (Sim(SMALL_TINY, WORKLOADS["long_tail"], b, LT_STEPS, s, False).run()
                        for b in (0, 2))  # fmt: skip
        for key, value in {
            "step_seconds": calc["step_seconds"],
            "rollout_seconds": calc["rollout_seconds"],
            "train_seconds": calc["train_seconds"],
            "async_speedup": sync["wall_s"] / async_["wall_s"],
            "long_tail_sync_step_seconds": sync["step_seconds"],
            "long_tail_sync_rollout_seconds": sync["rollout_seconds"],
            "long_tail_async_step_seconds": async_["step_seconds"],
        }.items():
            runs.setdefault(key, []).append(value)
    measured = {"step_seconds": RUN_STEP_S, "rollout_seconds": RUN_ROLLOUT_S,
                "train_seconds": RUN_TRAIN_S, "async_speedup": LT_SPEEDUP,
                "long_tail_sync_step_seconds": LT_SYNC_WALL_S / LT_STEPS,
                "long_tail_sync_rollout_seconds": LT_ROLLOUT_S,
                "long_tail_async_step_seconds": LT_ASYNC_WALL_S / LT_STEPS}  # fmt: skip
    out: dict[str, Any] = {"seeds": CHECK_SEEDS}
    for key, values in runs.items():
        predicted = statistics.fmean(values)
        out |= {f"{key}_measured": round(measured[key], 3), f"{key}_predicted": round(predicted, 3),
                f"{key}_seed_range": [round(min(values), 3), round(max(values), 3)],
                f"{key}_error": round((predicted - measured[key]) / measured[key], 4)}  # fmt: skip
    ok = all(abs(out[k]) <= tolerance for k, tolerance in CHECK_TOLERANCE.items())
    return out | {"tolerance": CHECK_TOLERANCE, "ok": ok}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def from_measured(
    run_dir: Path, cluster: Cluster, work: Workload, seed: int
) -> tuple[Cluster, Workload, dict[str, Any]]:
    """Refit to a real run: episodes a step, optimizer step, sync and bookkeeping seconds, per
    role failure rates and recovery seconds (`faults.jsonl`), and the per-turn engine work and
    per-token train cost that reproduce its mean rollout and optimizer step."""
    metrics = _jsonl(run_dir / "metrics.jsonl")
    keys = ["perf/rollout_seconds", "perf/train_seconds", "perf/sync_seconds",
            "perf/step_seconds", "episodes/count"]  # fmt: skip
    missing = [k for k in keys if not any(k in m for m in metrics)]
    if missing:
        raise SystemExit(f"--measured: {run_dir / 'metrics.jsonl'} lacks {missing} (or is empty)")
    rollout, train, sync, step, count = (
        statistics.fmean(float(m[k]) for m in metrics if k in m) for k in keys)  # fmt: skip
    # Bookkeeping: what a step takes beyond its wait for rows, optimizer step and sync (median:
    # the first step waits for a whole rollout).
    record = statistics.median(max(0.0, m["perf/step_seconds"] - m["perf/train_seconds"]
                                   - m.get("perf/train_wait_seconds", 0.0)
                                   - m.get("perf/sync_seconds", 0.0))
                               for m in metrics if {keys[1], keys[3]} <= m.keys())  # fmt: skip
    config = run_dir / "config.yaml"
    bound = 1.0
    if config.is_file():
        import yaml

        text = str((yaml.safe_load(config.read_text()) or {}).get("max_staleness", 1))
        bound = parse_bound(text)
    work = replace(work, episodes_per_step=max(1, round(count / work.group_size)) * work.group_size)
    faults = _jsonl(run_dir / "faults.jsonl")
    hours = len(metrics) * step / 3600
    rates, recovery = dict(cluster.fault_rate), dict(cluster.recovery_s)
    for role in ROLES:
        seen = [f for f in faults if f.get("role") == role]
        times = [float(f["recovery_seconds"]) for f in seen if f.get("recovery_seconds")]
        rates[role] = len(seen) / hours if seen else rates.get(role, 0.0)
        recovery[role] = statistics.fmean(times) if times else recovery[role]
    tokens = work.episodes_per_step * (work.context_tokens + work.sampled_tokens.a * work.turns[1])
    cluster = replace(
        cluster, train_fixed_s=0.0, train_token_s=train * cluster.trainer_ranks / tokens,
        grad_bytes=0.0, weight_bytes=sync * cluster.sync_gbps * 1e9, sync_log_factor=0.0,
        record_s=record, fault_rate=rates, recovery_s=recovery,
    )  # fmt: skip
    turn, token = calibrate(cluster, work, rollout, train, bound, min(len(metrics), 8), seed)
    cluster, work = replace(cluster, train_token_s=token), replace(work, turn_work=turn)
    predicted = Sim(cluster, work, bound, len(metrics), seed, False).run()["step_seconds"]
    return cluster, work, {
        "run_dir": str(run_dir), "steps": len(metrics), "max_staleness": label(bound),
        "episodes_per_step": work.episodes_per_step, "rollout_seconds": round(rollout, 3),
        "train_seconds": round(train, 3), "sync_seconds": round(sync, 3),
        "record_seconds": round(record, 3), "turn_work": round(turn, 2),
        "faults": dict(Counter(str(f.get("role")) for f in faults)),  # reward: not modelled
        "step_seconds_measured": round(step, 3), "step_seconds_predicted": round(predicted, 3),
        "step_seconds_error": round((predicted - step) / step, 4),
    }  # fmt: skip


def override(cluster: Cluster, work: Workload, pairs: list[str]) -> tuple[Cluster, Workload]:
    """`--set FIELD=VALUE`: a number of the cluster or of the workload."""
    for pair in pairs:
        name, _, text = pair.partition("=")
        target: Any = cluster if hasattr(cluster, name) else work
        current = getattr(target, name, None)
        if not isinstance(current, int | float) or isinstance(current, bool):
            raise SystemExit(f"--set {pair!r}: {name!r} is not a number of Cluster or Workload")
        try:
            value = type(current)(text)
        except ValueError:
            raise SystemExit(f"--set {pair!r}: not a {type(current).__name__}") from None
        if value < 0 or (value == 0 and isinstance(current, int)):
            raise SystemExit(f"--set {pair!r}: {name} must be positive")
        change: dict[str, Any] = {name: value}
        if target is cluster:
            cluster = replace(cluster, **change)
        else:
            work = replace(work, **change)
    if work.episodes_per_step % work.group_size:
        raise SystemExit(f"episodes_per_step {work.episodes_per_step} is not a multiple of "
                         f"group_size {work.group_size}")  # fmt: skip
    return cluster, work


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The JSON object the script prints."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="small")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--staleness", default="0,1,2,4,inf")
    parser.add_argument("--steps", type=int, default=None, help="a setting's (30; 1000gpu: 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-scale", type=float, default=1.0, help="times the fault rates")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--measured", type=Path, default=None, help="a real RUN_DIR to fit")
    parser.add_argument("--check", action="store_true", help="compare with docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.check:
        return {"bench": "simulate_scale", "seed": args.seed, "check": check(args.seed)}
    work = WORKLOADS[args.workload or SCALES[args.scale][1]]
    cluster = CLUSTERS.get((args.scale, work.name), SCALES[args.scale][0])
    if args.fault_scale < 0:
        raise SystemExit(f"--fault-scale must be >= 0, got {args.fault_scale}")
    rates = {k: v * args.fault_scale for k, v in cluster.fault_rate.items()}
    cluster, work = override(replace(cluster, fault_rate=rates), work, args.set)
    out: dict[str, Any] = {"bench": "simulate_scale", "scale": args.scale}
    if args.measured is not None:
        cluster, work, out["measured"] = from_measured(args.measured, cluster, work, args.seed)
    bounds = [parse_bound(b) for b in args.staleness.split(",")]
    steps = args.steps or (30 if args.scale == "small" else 10)
    if steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {steps}")
    results = {}
    for bound in bounds:
        result = simulate(cluster, work, bound, steps, args.seed)
        results[label(bound)] = {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in result.items()}  # fmt: skip
    base = label(min(bounds))
    rate = {k: r.get("steps_per_hour", 0.0) for k, r in results.items()}
    return out | {
        "workload": work.name, "seed": args.seed, "steps": steps,
        "sizes": {"engines": cluster.engines, "trainer_ranks": cluster.trainer_ranks,
                  "sandbox_hosts": cluster.sandbox_hosts,
                  "episodes_per_step": work.episodes_per_step},
        "sync_seconds_model": round(cluster.sync_seconds(), 3),
        "fault_rate_per_hour": {k: float(f"{v:.3g}") for k, v in cluster.fault_rate.items()},
        "results": results,
        "projection": {"best_max_staleness": max(rate, key=lambda k: rate[k]),
                       f"speedup_over_{base}": {k: round(v / rate[base], 3) if rate[base] else None
                                                for k, v in rate.items()}},
    }  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
