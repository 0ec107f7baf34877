"""The roles as Ray Serve deployments, and the controller's side of them (DESIGN.md §1, §7).

Each role is its own deployment (a Serve application of the role's name), with its own
processes, resources (`services.placement`) and log (Ray's `logs/serve/` of the session),
reached by the controller only through a `DeploymentHandle` behind the protocols of
`controller`. Deployed in this order, each needing the ones before:

- `actor` (`ActorServer`): the trainer backend, its data-plane reader and the weight sync to
  the engines that attached; train, save, load and publish are its requests.
- `engine` (`engine_service.EngineServer`, `services.engine_replicas`): each replica launches
  or adopts one engine and attaches it to the actor before it serves.
- `reward` (`reward_service.RewardServer`, `services.reward_replicas`): the reward functions.
- `sandbox` (`sandbox_service.SandboxServer`, `services.sandbox_replicas`): sandboxd, the only
  process that creates sandboxes; each replica serves its own over HTTP.
- `rollout` (`RolloutServer`, `services.rollout_replicas`): one request per episode; each
  replica has its own data-plane client and store connection, reaches engines through an
  `EngineRouter` over the actor's rotation (session affinity per episode), sandboxes
  through `ServiceSandboxes` and rewards through `RemoteReward`s,
  and runs up to its share of `rollout.concurrency` episodes at once (`max_ongoing_requests`).
- `advantage` (`AdvantageServer`): one request per step, which reads the step whole.
- `reference` (`ScorerServer`, only with `trainer.reference=external` and a KL penalty):
  the frozen base model; one request per step, which writes the step's `ref_logprobs`.
- `teacher` (`ScorerServer`, only with `trainer.teacher`): the distillation teacher; one
  request per step, which writes the step's `teacher_logprobs`.
- `critic` (`CriticServer`, only with `trainer.critic`): PPO's value model; one request per
  step, which writes the step's `values` and then trains on its `returns`; saved with each
  checkpoint.
- `api` (`api_service.ApiServer`, with `services.api`): the REST API and dashboard over the
  run's store, behind Serve's HTTP proxy (deployed first: it needs none of the others).

Engines launched on request while the run trains (`POST /v1/rollout/engines` `{"launch":
true}`, `ServeEngineLauncher`) are one more Serve application each, `engine+N`, of one
`EngineServer` replica: Serve restarts it like the run's own, and `DELETE` undeploys it.

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
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

# Serve's router asks replicas for their queue length and warns when one answers later than
# this (0.2 s by default): on a loaded 2-core machine that is every few calls. Read at import.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "2.0")

from ray import serve
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ActorUnschedulableError,
    RayActorError,
)
from ray.serve import Application, RunTarget
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from omniloop.errors import RoleLost
from omniloop.platform.control.api_service import ApiServer
from omniloop.platform.control.console import console
from omniloop.platform.control.controller import (
    ActorLost,
    EpisodeSummary,
    Roles,
    TrainReport,
)
from omniloop.platform.control.engine_service import EngineServer
from omniloop.platform.control.faults import Failure, FaultTimeline, Retry
from omniloop.platform.control.health import HealthMonitor
from omniloop.platform.control.local import ScoringRole, StepRollout, scoring_roles
from omniloop.platform.control.replica import enter_run_folder
from omniloop.platform.control.reward_service import RewardServer
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.control.sandbox_service import SandboxServer
from omniloop.processes import free_port

T = TypeVar("T")

SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
"""Serve logs a line per request at INFO; the run's console keeps to one line per step. Each
replica still writes its own log file under the Ray session's `logs/serve/`."""
"""The Serve applications of a run, one per role (their deployments have the role's name)."""


def classify_failure(err: BaseException) -> tuple[Failure, str] | None:
    """A Serve call's failure as the role's (`busy`: refused; `lost`: its replica is gone, or
    a replica of a role the work used is: `RoleLost`, such as the rollout's `SandboxLost`)."""
    if isinstance(err, BackPressureError):
        return "busy", ""
    if isinstance(err, RoleLost):
        return "lost", ""
    if isinstance(
        err, ActorDiedError | ActorUnavailableError | RayActorError | ActorUnschedulableError
    ):
        actor_id = getattr(err, "actor_id", None) or ""
        return "lost", str(actor_id)
    if isinstance(err, ReplicaUnavailableError | DeploymentUnavailableError):
        return "lost", ""
    return None


def _check_data_plane() -> None:
    """What every role that reads or writes rows needs: the data plane's controller."""
    from omniloop.platform.data.tq import queue_running

    if not queue_running():
        raise RuntimeError("the data plane's controller is not running")


class RolloutServer:
    """A rollout replica: runs single episodes (`EpisodeRunner.run`) on request."""

    # Serve awaits an async constructor; mypy knows no such thing.
    async def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:  # type: ignore[misc]
        enter_run_folder(cwd, paths)
        from omniloop.platform.control.engine_routes import run_engines
        from omniloop.platform.control.reward_service import remote_rewards
        from omniloop.platform.control.run import episode_runner
        from omniloop.platform.control.sandbox_service import ServiceSandboxes

        self._stack = contextlib.AsyncExitStack()
        # Requests go to the engines the actor's coordinator has given the current weights.
        engine = run_engines(config)
        self._stack.push_async_callback(engine.aclose)
        sandboxes = ServiceSandboxes(
            serve.get_app_handle("sandbox"), config.rollout.sandbox, config.services.sandbox_wait_s
        )
        self._stack.push_async_callback(sandboxes.aclose)
        rewards = remote_rewards(config.rollout.rewards, serve.get_app_handle("reward"))
        self._runner = await self._stack.enter_async_context(
            episode_runner(config, engine, rewards=rewards, sandboxes=sandboxes)
        )

    async def open_step(self, step: int) -> None:
        self._runner.open_step(step)

    async def episode(self, step: int, index: int, attempt: int) -> EpisodeSummary:
        return await self._runner.run(step, index, attempt)

    async def close_step(self, step: int) -> None:
        await self._runner.close_step(step)

    async def check_health(self) -> None:
        # The engine's health is the engine role's: a dead engine must not take the rollout
        # replicas down with it (their episodes wait for the engine's replacement).
        _check_data_plane()

    async def __del__(self) -> None:
        await self._stack.aclose()


class AdvantageServer:
    """The advantage replica: writes a step's advantages on request."""

    async def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:  # type: ignore[misc]
        enter_run_folder(cwd, paths)
        from omniloop.platform.control.local import LocalAdvantage
        from omniloop.platform.data import DataPlane

        self._data = DataPlane.start()
        # Each `compute` reads its step whole (`DataPlane.reread`), so a replacement replica
        # recomputes a step its predecessor had half done.
        self._advantage = LocalAdvantage(
            self._data,
            config.trainer.advantage,
            config.rollout.samples_per_task,
            config.data_plane.read_timeout,
            drop_uniform=config.dynamic_sampling > 0,
            critic=config.trainer.critic,
        )

    async def compute(self, step: int) -> dict[str, float]:
        return await self._advantage.compute(step)

    async def check_health(self) -> None:
        _check_data_plane()


class ScorerServer:
    """A scoring replica (`reference`: the frozen base model; `teacher`: the distillation
    teacher), scoring a step's rows on request (`local.LocalScorer`)."""

    # Serve awaits an async constructor; mypy knows no such thing.
    async def __init__(  # type: ignore[misc]
        self, role: ScoringRole, config: RunConfig, cwd: str, paths: list[str]
    ) -> None:
        enter_run_folder(cwd, paths)
        from omniloop.platform.control.local import LocalScorer, scored_by
        from omniloop.platform.control.run import run_media
        from omniloop.platform.data import DataPlane
        from omniloop.trainer.reference import TorchReference

        self._data = DataPlane.start()
        model = scored_by(config, role)
        policy = await asyncio.to_thread(TorchReference, model, config.trainer)
        # Each `compute` reads its step whole, like the advantage stage's.
        self._scorer = LocalScorer(
            role,
            self._data,
            policy,
            config.trainer.micro_batch_size,
            config.data_plane.read_timeout,
            config.trainer_threads,
            media=await asyncio.to_thread(run_media, config),
        )

    async def compute(self, step: int) -> dict[str, float]:
        return await self._scorer.compute(step)

    async def check_health(self) -> None:
        _check_data_plane()


class CriticServer:
    """The critic replica: PPO's value model (`critic_stage.LocalCritic`). A replica that
    replaces a lost one continues from the newest checkpoint's critic (what the lost one
    learned since is lost with it)."""

    # Serve awaits an async constructor; mypy knows no such thing.
    async def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:  # type: ignore[misc]
        enter_run_folder(cwd, paths)
        from omniloop.platform.control.critic_stage import LocalCritic
        from omniloop.platform.control.record import checkpoints
        from omniloop.platform.data import DataPlane
        from omniloop.trainer.critic import TorchCritic

        if config.trainer.critic is None:
            raise ValueError("the critic role needs trainer.critic")
        self._data = DataPlane.start()
        model = await asyncio.to_thread(
            TorchCritic, config.model, config.trainer, config.trainer.critic
        )
        self._critic = LocalCritic(
            self._data,
            model,
            config.trainer.critic,
            config.trainer.micro_batch_size,
            config.data_plane.read_timeout,
            config.trainer_threads,
        )
        if found := checkpoints(Path(config.run_dir)):
            await self._critic.load(found[-1])

    async def compute(self, step: int) -> dict[str, float]:
        return await self._critic.compute(step)

    async def save(self, checkpoint: str) -> None:
        await self._critic.save(Path(checkpoint))

    async def load(self, checkpoint: str) -> None:
        await self._critic.load(Path(checkpoint))

    async def check_health(self) -> None:
        _check_data_plane()


class ActorReplaced(RoleLost):
    """The actor replica that answered replaced a lost one and holds its initial weights: it
    trains, saves and publishes only once the controller has restored it (`ServiceActor.recover`).
    Without this, a replica killed between two requests would be replaced unnoticed, and the next
    step trained on the initial weights."""

    failed_role = "actor"


class ActorServer:
    """The actor replica: the trainer backend with its data-plane reader and weight sync.

    The controller adopts the first replica (`adopt`, `load`); a replacement serves training
    requests only after `restore` or `start_over` (before: `ActorReplaced`)."""

    # Serve awaits an async constructor; mypy knows no such thing.
    async def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:  # type: ignore[misc]
        enter_run_folder(cwd, paths)
        from omniloop.platform.control.run import actor_roles

        self._stack = contextlib.AsyncExitStack()
        # Engines attach themselves (`attach_engine`) as their replicas start.
        self._actor, self._weights = await self._stack.enter_async_context(actor_roles(config, []))
        self._adopted = False

    async def version(self) -> int:
        return self._actor.version

    async def adopt(self) -> int:
        """The run's first replica, taken as it is; its weight version."""
        self._adopted = True
        return self._actor.version

    def _serving_the_run(self) -> None:
        if not self._adopted:
            raise ActorReplaced(
                "this actor replica replaced a lost one and has not been restored yet"
            )

    async def train(self, step: int) -> TrainReport:
        self._serving_the_run()
        return await self._actor.train(step)

    async def save(self, path: str, step: int) -> None:
        self._serving_the_run()
        await self._actor.save(Path(path), step)

    async def load(self, path: str) -> tuple[int, int]:
        """Resume the run from the checkpoint at `path` (adopts this replica)."""
        step = await self._actor.load(Path(path))
        self._adopted = True
        return step, self._actor.version

    async def start_over(self) -> tuple[int, int]:
        """A replica that replaces a lost one, with no checkpoint to restore: the initial
        weights and every row unread."""
        await self._actor.forget_consumed()
        self._actor.restored()
        self._adopted = True
        return 0, self._actor.version

    async def restore(self, path: str) -> tuple[int, int]:
        """A replica that replaces a lost one restores the checkpoint at `path`."""
        step = await self._actor.load(Path(path))
        self._actor.restored()
        self._adopted = True
        return step, self._actor.version

    async def serves(self, url: str) -> bool:
        return self._weights.serves(url)

    async def engines(self) -> int:
        return len(self._weights.engine_urls)

    async def engine_urls(self) -> list[str]:
        """The engines in rotation (serving the current weights)."""
        return self._weights.engine_urls

    async def publish(self, version: int) -> dict[str, float]:
        self._serving_the_run()
        return await self._weights.publish(version)

    async def attach_engine(self, url: str, served_version: int) -> None:
        """An engine replica registers its engine (not one removed by hand)."""
        await self._weights.attach(url, served_version=served_version, explicit=False)

    async def engine_table(self) -> list[dict[str, object]]:
        """The engines the weights go to, and whether each is in rotation."""
        return self._weights.table()

    async def add_engine(self, url: str) -> str | None:
        """Add the engine at `url` (started anywhere) by hand: it gets the current weights,
        then enters the rotation. Returns why it could not, or None."""
        from omniloop.errors import EngineError
        from omniloop.inference.client import EngineClient

        try:
            async with EngineClient(url, timeout=30) as engine:
                served = await engine.get_weight_version()
            await self._weights.attach(url, served_version=served)
        except EngineError as err:
            return str(err)
        return None

    async def remove_engine(self, url: str, drain_s: float) -> bool:
        """Take the engine at `url` out of the rotation, then (after `drain_s`) out of the
        run; False if it was not in it."""
        return await self._weights.detach(url, drain_s=drain_s)

    async def check_health(self) -> None:
        _check_data_plane()
        self._actor.check_health()

    async def __del__(self) -> None:
        await self._stack.aclose()


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

    cwd, paths = os.getcwd(), [p for p in sys.path if p]
    rollout_app = serve.deployment(
        name="rollout",
        num_replicas=settings.rollout_replicas,
        max_ongoing_requests=per_replica,
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

        async def episode(step: int, index: int, attempt: int) -> EpisodeSummary:
            summary: EpisodeSummary = await rollout.episode.remote(step, index, attempt)
            return summary

        async def open_step(step: int) -> None:
            await rollout.open_step.remote(step)

        async def close_step(step: int) -> None:
            await rollout.close_step.remote(step)

        episodes = config.tasks_per_step * config.rollout.samples_per_task
        stages = {role: ServiceStage(role, serve.get_app_handle(role), retry) for role in scorers}
        yield Roles(
            rollout=StepRollout(
                episodes,
                episode,
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
                max_failed_polls=settings.max_failed_polls,
                follow={LAUNCHED: 1},
            ),
            reference=stages.get("reference"),
            teacher=stages.get("teacher"),
            critic=(ServiceCritic(serve.get_app_handle("critic"), retry) if with_critic else None),
        )
    finally:
        await asyncio.to_thread(_undeploy)


def role_options(config: RunConfig, role: str) -> dict[str, Any]:
    """The deployment options of `role`'s replicas: queue bound, health checks, placement."""
    settings = config.services
    where = settings.placement.get(role)  # type: ignore[call-overload]
    # No CPU reserved: the roles share the machine's cores with the engine.
    options: dict[str, Any] = {"num_cpus": 0}
    if where is not None and where.resources:
        options["resources"] = dict(where.resources)
    out: dict[str, Any] = {
        "max_queued_requests": settings.max_queued_requests,
        "health_check_period_s": settings.health_check_period_s,
        "health_check_timeout_s": settings.health_check_timeout_s,
        "ray_actor_options": options,
    }
    if where is not None and where.max_replicas_per_node is not None:
        out["max_replicas_per_node"] = where.max_replicas_per_node
    return out


def engine_deployment(
    config: RunConfig, cwd: str, paths: list[str], *, replicas: int = 1
) -> Application:
    """`replicas` engine replicas (`EngineServer`), each launching or adopting one engine."""
    return serve.deployment(
        name="engine",
        num_replicas=replicas,
        max_ongoing_requests=1024,
        **role_options(config, "engine"),
    )(EngineServer).bind(config, str(Path(config.run_dir).resolve()), cwd, paths)


LAUNCHED = "engine+"
"""Prefix of the Serve applications of engines launched on request (`engine+1`, ...)."""
LAUNCHED_URL_TIMEOUT_S = 10.0
"""How long a launched engine's replica has to tell its URL when one is being removed."""


class ServeEngineLauncher:
    """Launches engines for a running run, each as a Serve application of its own (`engine+N`,
    one `EngineServer` replica on the engine role's placement), and undeploys them.

    Used from the run's api role. The replica attaches its engine to the actor before it
    is up, so a launched engine is in rotation, with the current weights, once `launch`
    returns. What it launched is read back from Serve each time (no state of its own), so an
    api replica that restarted still finds the engines launched before. The health monitor
    follows each application from its first healthy poll (a fault of role `engine+N` while it
    is down); Serve restarts a replica that fails."""

    def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:
        self._unusable = (
            "the run adopts the engine at rollout.engine.url; it launches none"
            if config.rollout.engine.url
            else None
        )
        self._config, self._cwd, self._paths = config, cwd, paths

    async def launch(self) -> str:
        """Start one more engine; its URL once it serves the current weights. Raises
        `EngineError` when it cannot (its application is removed again)."""
        from omniloop.errors import EngineError

        if self._unusable is not None:
            raise EngineError(self._unusable)
        taken = {int(n[len(LAUNCHED) :]) for n in self._launched() if n[len(LAUNCHED) :].isdigit()}
        name = f"{LAUNCHED}{max(taken, default=0) + 1}"
        app = engine_deployment(self._config, self._cwd, self._paths)
        try:
            handle = await asyncio.to_thread(
                serve.run, app, name=name, route_prefix=None, logging_config=SERVE_LOGGING
            )
            url: str = await handle.url.remote()
        except Exception as err:
            await asyncio.to_thread(serve.delete, name)
            raise EngineError(f"launching an engine ({name}) failed: {err}") from err
        return url

    async def stop(self, url: str) -> bool:
        """Undeploy the launched engine at `url`; False if none of them is at `url`."""
        for name in self._launched():
            try:
                # A replica that is not up would hold the call until Serve replaces it.
                served: str = await asyncio.wait_for(
                    serve.get_app_handle(name).url.remote(), LAUNCHED_URL_TIMEOUT_S
                )
            except Exception:  # not (yet, or no longer) up: not the one asked for
                continue
            if served == url:
                await asyncio.to_thread(serve.delete, name)
                return True
        return False

    @staticmethod
    def _launched() -> list[str]:
        return [n for n in serve.status().applications if n.startswith(LAUNCHED)]


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
