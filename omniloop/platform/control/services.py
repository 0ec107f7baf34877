"""The roles as Ray Serve deployments, and the controller's side of them (DESIGN.md §1, §7).

Each role is its own deployment (a Serve application of the role's name), with its own
processes, resources (`services.placement`) and log (Ray's `logs/serve/` of the session),
reached by the controller only through a `DeploymentHandle` behind the protocols of
`controller`. The replicas' classes live with their role (`data_roles` for the roles that
write or read rows, a module of its own for each light role), so that a replica imports only
its role's code. All are deployed at once; a replica that needs another role (an engine
attaching to the actor, a rollout replica's handles) waits for it through Serve:

- `actor` (`data_roles.ActorServer`): the trainer backend, its data-plane reader and the
  weight sync to the engines that attached; train, save, load and publish are its requests.
- `engine` (`engine_service.EngineServer`, `services.engine_replicas`): each replica launches
  or adopts one engine and attaches it to the actor before it serves.
- `reward` (`reward_service.RewardServer`, `services.reward_replicas`): the reward functions.
- `sandbox` (`sandbox_service.SandboxServer`, `services.sandbox_replicas`): sandboxd, the only
  process that creates sandboxes; each replica serves its own over HTTP.
- `rollout` (`data_roles.RolloutServer`, `services.rollout_replicas`): one request per GRPO
  group (`step_rollout`), whose episodes stream back as each is written; each replica has
  its own data-plane client and store connection, reaches engines through an `EngineRouter`
  over the actor's rotation (session affinity per episode), sandboxes through
  `ServiceSandboxes` and rewards through `RemoteReward`s (the evaluations of a moment in one
  call, `services.reward_batch_wait_s`), and runs up to its share of
  `rollout.concurrency` episodes at once, taking the groups that fill it
  (`max_ongoing_requests`, `services.rollout_groups_per_replica`).
- `advantage` (`data_roles.AdvantageServer`): one request per step, which reads the step
  whole.
- `reference` (`data_roles.ScorerServer`, only with `trainer.reference=external` and a KL
  penalty): the frozen base model; one request per step, which writes the step's
  `ref_logprobs`.
- `teacher` (`data_roles.ScorerServer`, only with `trainer.teacher`): the distillation
  teacher; one request per step, which writes the step's `teacher_logprobs`.
- `critic` (`data_roles.CriticServer`, only with `trainer.critic`): PPO's value model; one
  request per step, which writes the step's `values` and then trains on its `returns`; saved
  with each checkpoint.
- `api` (`api_service.ApiServer`, with `services.api`): the REST API and dashboard over the
  run's store, behind Serve's HTTP proxy (it needs none of the others).

Engines launched on request while the run trains (`POST /v1/rollout/engines` `{"launch":
true}`, `deployments.ServeEngineLauncher`) are one more Serve application each, `engine+N`,
of one `EngineServer` replica: Serve restarts it like the run's own, and `DELETE` undeploys
it.

What a dead replica costs: Serve replaces it (health checks: `check_health` tests what the
role needs, every `services.health_check_period_s`); an episode it was running (or whose
sandbox replica died) is re-run as `attempt + 1` under the same trajectory id, a step's
advantages are computed again (`faults.Retry`); an engine's episodes go on on another
engine in rotation, or wait for its replacement; a lost actor is restored from the newest
checkpoint by the controller (`ActorLost`, `train_loop`). A full queue refuses calls
(`BackPressureError`), which the controller waits out and retries; nothing is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

# Serve's router asks replicas for their queue length and warns when one answers later than
# this (0.2 s by default): on a loaded 2-core machine that is every few calls. Read at import.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "2.0")

from ray import serve
from ray.serve import Application, RunTarget
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from omniloop.platform.control.api_service import ApiServer
from omniloop.platform.control.console import console
from omniloop.platform.control.controller import ActorLost, EpisodeSummary, Roles, TrainReport
from omniloop.platform.control.data_roles import (
    ActorServer,
    AdvantageServer,
    CriticServer,
    RolloutServer,
    ScorerServer,
)
from omniloop.platform.control.deployments import (
    LAUNCHED,
    SERVE_LOGGING,
    classify_failure,
    engine_deployment,
    role_options,
)
from omniloop.platform.control.faults import FaultTimeline, Retry
from omniloop.platform.control.health import HealthMonitor
from omniloop.platform.control.local import scoring_roles
from omniloop.platform.control.reward_service import RewardServer
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.control.sandbox_service import SandboxServer
from omniloop.platform.control.step_rollout import StepRollout
from omniloop.processes import free_port

T = TypeVar("T")

# -- the controller's side ----------------------------------------------------------------------


class ServiceStage:
    """`Advantage` or `Scorer` over the deployment of `role` (a stage that computes a
    step's field on request); a step lost with its replica is redone."""

    def __init__(self, role: str, handle: DeploymentHandle, retry: Retry) -> None:
        self._role = role
        self._handle = handle
        self._retry = retry

    async def compute(self, step: int) -> dict[str, float]:
        result: dict[str, float] = await self._retry.call(
            self._role,
            lambda _: self._handle.compute.remote(step),
            what=f"step {step}'s {self._role}",
        )
        return result


class ServiceCritic:
    """`Critic` over the critic deployment; a step or a save lost with its replica is redone."""

    def __init__(self, handle: DeploymentHandle, retry: Retry) -> None:
        self._handle = handle
        self._retry = retry
        self._stage = ServiceStage("critic", handle, retry)

    async def compute(self, step: int) -> dict[str, float]:
        return await self._stage.compute(step)

    async def save(self, checkpoint: Path) -> None:
        await self._retry.call(
            "critic", lambda _: self._handle.save.remote(str(checkpoint)), what="saving"
        )

    async def load(self, checkpoint: Path) -> None:
        await self._retry.call(
            "critic", lambda _: self._handle.load.remote(str(checkpoint)), what="loading"
        )


class ServiceActor:
    """`Actor` over the actor deployment (one replica)."""

    def __init__(self, handle: DeploymentHandle, version: int, wait_s: float) -> None:
        self._handle = handle
        self._version = version
        self._wait_s = wait_s

    @property
    def version(self) -> int:
        return self._version

    async def train(self, step: int) -> TrainReport:
        report: TrainReport = await _lost_is_actor_lost(
            self._handle.train.remote(step), f"training step {step}"
        )
        self._version = report.version
        return report

    async def recover(self, checkpoint: Path | None) -> int:
        """Wait for the replacement replica, restore `checkpoint` in it, wait for an engine
        to attach, and publish the restored weights."""
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                await self._handle.version.remote()
                break
            except Exception as err:
                if classify_failure(err) is None or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
        if checkpoint is None:
            step, self._version = await self._handle.start_over.remote()
        else:
            step, self._version = await self._handle.restore.remote(str(checkpoint))
        while not await self._handle.engines.remote():
            if time.monotonic() > deadline:
                raise ActorLost(f"no engine attached to the restored actor in {self._wait_s}s")
            await asyncio.sleep(1.0)
        await self._handle.publish.remote(self._version)
        return int(step)

    async def save(self, path: Path, step: int) -> None:
        await _lost_is_actor_lost(self._handle.save.remote(str(path), step), "saving")

    async def load(self, path: Path) -> int:
        step, self._version = await self._handle.load.remote(str(path))
        return int(step)


class ServiceWeights:
    """`Weights` over the actor deployment: it publishes its own weights."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def publish(self, version: int) -> dict[str, float]:
        result: dict[str, float] = await _lost_is_actor_lost(
            self._handle.publish.remote(version), f"publishing version {version}"
        )
        return result


async def _lost_is_actor_lost(call: Awaitable[T], doing: str) -> T:
    """`await call`, raising `ActorLost` if the actor's replica died meanwhile."""
    try:
        return await call
    except Exception as err:
        failure = classify_failure(err)
        if failure is not None and failure[0] == "lost":
            raise ActorLost(f"the actor replica died {doing}: {err}") from err
        raise


@contextlib.asynccontextmanager
async def service_roles(
    config: RunConfig,
    retry: Retry,
    timeline: FaultTimeline,
    *,
    on_start: Any,
    on_episode: Any,
) -> AsyncIterator[Roles]:
    """Deploy the run's roles on the Ray cluster this process has joined, and undeploy them
    at the end of the block."""
    import asyncio

    settings = config.services
    per_replica = max(1, math.ceil(config.rollout.concurrency / settings.rollout_replicas))
    groups_per_replica = settings.rollout_groups_per_replica or math.ceil(
        per_replica / config.rollout.samples_per_task
    )

    cwd, paths = os.getcwd(), [p for p in sys.path if p]
    rollout_app = serve.deployment(
        name="rollout",
        num_replicas=settings.rollout_replicas,
        max_ongoing_requests=groups_per_replica,
        **role_options(config, "rollout"),
    )(RolloutServer).bind(
        config.model_copy(
            update={"rollout": config.rollout.model_copy(update={"concurrency": per_replica})}
        ),
        cwd,
        paths,
    )
    advantage_app = serve.deployment(
        name="advantage",
        num_replicas=1,
        max_ongoing_requests=64,
        **role_options(config, "advantage"),
    )(AdvantageServer).bind(config, cwd, paths)
    critic_app = serve.deployment(
        name="critic", num_replicas=1, max_ongoing_requests=64, **role_options(config, "critic")
    )(CriticServer).bind(config, cwd, paths)
    scorers = scoring_roles(config)
    with_critic = config.trainer.critic is not None
    scorer_apps: dict[str, Application] = {
        role: serve.deployment(
            name=role, num_replicas=1, max_ongoing_requests=64, **role_options(config, role)
        )(ScorerServer).bind(role, config, cwd, paths)
        for role in scorers
    }
    reward_app = serve.deployment(
        name="reward",
        num_replicas=settings.reward_replicas,
        max_ongoing_requests=max(per_replica, 8),
        **role_options(config, "reward"),
    )(RewardServer).bind(
        config.rollout.rewards,
        config.rollout.reward_timeout,
        settings.reward_memory_mb,
        cwd,
        paths,
    )
    sandbox_app = serve.deployment(
        name="sandbox",
        num_replicas=settings.sandbox_replicas,
        max_ongoing_requests=1024,
        **role_options(config, "sandbox"),
    )(SandboxServer).bind(config, cwd, paths)
    actor_app = serve.deployment(
        name="actor", num_replicas=1, max_ongoing_requests=8, **role_options(config, "actor")
    )(ActorServer).bind(config, cwd, paths)
    engines = 1 if config.rollout.engine.url else settings.engine_replicas
    engine_app = engine_deployment(config, cwd, paths, replicas=engines)

    api_port = settings.api_port or free_port()
    api_app = serve.deployment(
        name="api", num_replicas=1, max_ongoing_requests=256, **role_options(config, "api")
    )(serve.ingress()(ApiServer)).bind(config, os.environ.get("OMNILOOP_API_TOKEN"), cwd, paths)

    apps: dict[str, Application] = {
        "actor": actor_app,
        "engine": engine_app,
        "reward": reward_app,
        "sandbox": sandbox_app,
        **scorer_apps,
        **({"critic": critic_app} if with_critic else {}),
        "rollout": rollout_app,
        "advantage": advantage_app,
        **({"api": api_app} if settings.api else {}),
    }

    def deploy() -> dict[str, DeploymentHandle]:
        # The driver's Serve logger says "Application ... is ready" and the like at INFO.
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        _forget_serve_client()
        if settings.api:
            serve.start(
                proxy_location="HeadOnly",
                http_options={"host": settings.api_host, "port": api_port},
                logging_config=SERVE_LOGGING,
            )
        else:
            serve.start(proxy_location="Disabled", logging_config=SERVE_LOGGING)
        # All at once: the replicas start side by side, and one that needs another role (an
        # engine registering with the actor, a rollout's handles) waits for it through Serve.
        handles = serve.run_many(
            [
                RunTarget(
                    app,
                    name=name,
                    route_prefix="/" if name == "api" else None,
                    logging_config=SERVE_LOGGING,
                )
                for name, app in apps.items()
            ]
        )
        return dict(zip(apps, handles, strict=True))

    try:
        handles = await asyncio.to_thread(deploy)
        actor, rollout, advantage = handles["actor"], handles["rollout"], handles["advantage"]
        version = await actor.adopt.remote()
        if settings.api:
            console.print(
                f"[bold]dashboard[/bold] http://{settings.api_host}:{api_port}/", soft_wrap=True
            )

        streaming = rollout.options(stream=True)

        async def episodes(
            step: int, indices: list[int], attempt: int
        ) -> AsyncGenerator[list[tuple[int, EpisodeSummary]]]:
            stream: DeploymentResponseGenerator[list[tuple[int, EpisodeSummary]]]
            stream = streaming.episodes.remote(step, indices, attempt)  # type: ignore[assignment]
            try:
                async for done in stream:
                    yield done
            finally:
                stream.cancel()  # a no-op once the replica's stream has ended

        async def open_step(step: int) -> None:
            await rollout.open_step.remote(step)

        async def close_step(step: int) -> None:
            await rollout.close_step.remote(step)

        episodes_per_step = config.tasks_per_step * config.rollout.samples_per_task
        stages = {role: ServiceStage(role, serve.get_app_handle(role), retry) for role in scorers}
        yield Roles(
            rollout=StepRollout(
                episodes_per_step,
                episodes,
                concurrency=config.rollout.concurrency,
                begin=open_step,
                close=close_step,
                retry=retry,
                on_start=on_start,
                on_episode=on_episode,
                group_size=config.rollout.samples_per_task,
                extra_groups=config.dynamic_sampling,
            ),
            advantage=ServiceStage("advantage", advantage, retry),
            actor=ServiceActor(actor, version, settings.engine_wait_s),
            sync=ServiceWeights(actor),
            monitor=HealthMonitor(
                {
                    "engine": engines,
                    "reward": settings.reward_replicas,
                    "sandbox": settings.sandbox_replicas,
                    "rollout": settings.rollout_replicas,
                    "advantage": 1,
                    "actor": 1,
                    **({"api": 1} if settings.api else {}),
                    **dict.fromkeys(scorers, 1),
                    **({"critic": 1} if with_critic else {}),
                },
                timeline,
                period_s=settings.health_poll_s,
                poll_timeout_s=settings.health_poll_timeout_s,
                max_failed_polls=settings.max_failed_polls,
                follow={LAUNCHED: 1},
            ),
            reference=stages.get("reference"),
            teacher=stages.get("teacher"),
            critic=(ServiceCritic(serve.get_app_handle("critic"), retry) if with_critic else None),
        )
    finally:
        await asyncio.to_thread(_undeploy)


def _undeploy() -> None:
    with contextlib.suppress(Exception):
        serve.shutdown()
    _forget_serve_client()


def _forget_serve_client() -> None:
    """Drop Serve's cached controller client. Serve keeps one per process and trusts it while
    the job id matches, and every new Ray instance starts job ids afresh: a process that runs
    several runs, each on its own Ray, would otherwise talk to the controller of a Ray that is
    gone. (Private API: Serve offers no public way.)"""
    from ray.serve.context import _set_global_client

    _set_global_client(None)


def replica_pids(role: str, *, within: int | None = None) -> list[int]:
    """Process ids of the live replicas of `role` on this machine (for chaos tests and
    benchmarks): Ray titles each replica's process `ray::ServeReplica:{app}:{deployment}`.
    Processes a replica forked keep its title; they are left out. `within`: only the
    descendants of that process (the driver that started its Ray), not another run's."""
    import psutil

    title = f"ray::ServeReplica:{role}:"
    processes = (
        psutil.process_iter() if within is None else psutil.Process(within).children(recursive=True)
    )
    titled: dict[int, int] = {}
    for process in processes:
        try:
            cmdline, parent = process.cmdline(), process.ppid()
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
        if cmdline and cmdline[0].startswith(title):
            titled[process.pid] = parent
    return [pid for pid, parent in titled.items() if parent not in titled]
