"""A training run, start to finish: build the roles, direct them with `train_loop`."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniloop.errors import ConfigError
from omniloop.platform.control.controller import Roles, train_loop
from omniloop.platform.control.metrics import MetricsSink
from omniloop.platform.control.record import RunRecord, checkpoints, recorded_run
from omniloop.platform.control.run_config import RunConfig, config_yaml

if TYPE_CHECKING:
    from omniloop.agents.media import MediaResolver
    from omniloop.inference.base import Engine
    from omniloop.platform.control.episode import SandboxProvider
    from omniloop.platform.control.faults import Retry
    from omniloop.platform.control.local import EpisodeRunner, LocalActor
    from omniloop.platform.data import DataPlane
    from omniloop.platform.dcs.coordinator import WeightCoordinator
    from omniloop.rewards import RewardFn


def seed_everything(seed: int) -> None:
    """Seed the trainer-side RNGs (sampling seeds derive from episode ids, not from these)."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


async def run(config: RunConfig, *, resume: bool = False) -> Path:
    """Train as `config` says; returns the run folder.

    Starts (and always stops again) the data plane on a Ray cluster, a local engine unless
    `rollout.engine.url` is given, and the roles: Ray Serve deployments
    (`services.mode=services`, the default; `services`) or this process's (`in_process`). With
    `resume`, continues `config.run_dir` from its newest checkpoint: weights, optimizer,
    version, data position and consumed ids are restored, and the engines are given the
    restored weights before the first rollout. Without `resume`, a run folder that already
    holds checkpoints is refused rather than overwritten.
    """
    from transformers.utils import logging as hf_logging

    from omniloop.platform.control.console import console, progress_bar
    from omniloop.platform.control.faults import Retry, never_retry
    from omniloop.platform.control.rollout import engine_url
    from omniloop.platform.data import DataPlane, DataPlaneConfig
    from omniloop.platform.store import AsyncStore

    # One line per step on the console; transformers' per-save progress bars would bury it.
    hf_logging.disable_progress_bar()
    run_dir = Path(config.run_dir)
    if checkpoints(run_dir) and not resume:
        raise ConfigError(
            f"{run_dir} already holds checkpoints; continue it with --resume {run_dir} "
            "or choose another run_dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml(config))
    config = with_run_id(config, resume=resume)
    seed_everything(config.seed)
    check_tasks(config)
    check_teacher(config)
    plane_config = DataPlaneConfig(
        ray_address=config.ray_address,
        num_cpus=config.data_plane.num_cpus,
        ray_temp_dir=config.data_plane.ray_temp_dir,
        storage_node_resource=config.data_plane.storage_node_resource,
    )

    store = AsyncStore.open(config.database)
    await store.migrate()
    # Every role opens the same database, whatever its environment says.
    config = config.model_copy(
        update={"database": store.store.engine.url.render_as_string(hide_password=False)}
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        ending = await stack.enter_async_context(recorded_run(store, config, resume=resume))
        database = store.store.engine.url.render_as_string(hide_password=True)
        console.print(f"[bold]run[/bold] {config.run_id} recorded in {database}", soft_wrap=True)
        plane_start = asyncio.ensure_future(asyncio.to_thread(DataPlane.start, plane_config))
        stack.push_async_callback(_close_plane, plane_start)
        url = ""
        if config.services.mode == "in_process":  # the engine starts beside Ray and the queue
            url = await stack.enter_async_context(
                engine_url(config.rollout.engine, log_dir=run_dir, media=config.rollout.media)
            )
        plane = await plane_start
        progress = stack.enter_context(progress_bar())
        sink = stack.enter_context(MetricsSink(run_dir, console, tensorboard=config.tensorboard))
        record = RunRecord(config, sink, progress, store)
        if config.services.mode == "services":
            from omniloop.platform.control.deployments import classify_failure
            from omniloop.platform.control.services import service_roles

            retry = Retry(config.faults, record.timeline, classify_failure)
            roles_cm = service_roles(
                config,
                retry,
                record.timeline,
                on_start=record.episodes_started,
                on_episode=record.episodes_done,
            )
        else:
            retry = Retry(config.faults, record.timeline, never_retry)
            roles_cm = local_roles(config, url, plane, record, retry)
        roles = await stack.enter_async_context(roles_cm)
        console.print(f"[bold]roles:[/bold] {config.services.mode}")
        start = 0
        if resume and (found := checkpoints(run_dir)):
            start = await roles.actor.load(found[-1])
            if roles.critic is not None:
                await roles.critic.load(found[-1])
            await roles.sync.publish(roles.actor.version)
            console.print(
                f"[bold]resumed from[/bold] {found[-1]} (version {roles.actor.version})",
                soft_wrap=True,
            )
        record.rewind(start)
        try:
            await _supervised(train_loop(roles, record, config, start), roles)
        finally:
            await asyncio.shield(record.finish())
        ending.reason = record.ended_early
    return run_dir


async def _supervised(loop: Awaitable[None], roles: Roles) -> None:
    """Run the loop while the health monitor watches the roles; the monitor's failure (the
    role services cannot be recovered) ends the loop with it."""
    if roles.monitor is None:
        await loop
        return
    main = asyncio.ensure_future(loop)
    watch = asyncio.ensure_future(roles.monitor.run())
    try:
        await asyncio.wait([main, watch], return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and not main.done():
            main.cancel()
            watch.result()  # raises the monitor's error
        await main
    finally:
        for task in (main, watch):
            task.cancel()
        await asyncio.gather(main, watch, return_exceptions=True)


def check_tasks(config: RunConfig) -> None:
    """Fail at once, with the fix, if the task set cannot fill a step."""
    from omniloop.platform.control.components import load_tasks
    from omniloop.platform.control.local import step_tasks

    tasks = load_tasks(config.rollout.tasks, config.rollout.num_tasks)
    try:
        step_tasks(tasks, 0, config.tasks_per_step)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_teacher(config: RunConfig) -> None:
    """Fail at once if the teacher (`trainer.teacher`) cannot score the policy's token ids as
    they are: its tokenizer must have the policy's vocabulary, id for id."""
    from omniloop.inference.models import load_tokenizer

    teacher = config.trainer.teacher
    if teacher is None:
        return
    try:
        vocabulary = load_tokenizer(teacher.model).get_vocab()
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"trainer.teacher.model={teacher.model!r} cannot be loaded: {err}"
        ) from err
    if vocabulary != load_tokenizer(config.model).get_vocab():
        raise ConfigError(
            f"trainer.teacher.model={teacher.model!r} has another vocabulary than the policy "
            f"{config.model!r}; the teacher scores the policy's token ids as they are, so it "
            "must use the policy's tokenizer (pick a teacher of the same model family)"
        )


def run_media_dir(config: RunConfig) -> Path:
    """The run's media store (`RUN_DIR/media`): every image, clip and video of its episodes,
    once each by content hash, where the rollout writes and the actor reads them."""
    return Path(config.run_dir) / "media"


def run_media(config: RunConfig) -> MediaResolver:
    """The run's media resolver: its store (`run_media_dir`), the model's processor and
    placeholder tokens, the rollout's media settings (trainer and rollout count alike)."""
    from omniloop.agents.media import media_resolver
    from omniloop.inference.models import load_tokenizer, resolve_model

    return media_resolver(
        resolve_model(config.model),
        load_tokenizer(config.model),
        config.rollout.media,
        run_media_dir(config),
    )


@contextlib.asynccontextmanager
async def episode_runner(
    config: RunConfig,
    engine: str | Engine,
    *,
    rewards: list[RewardFn] | None = None,
    sandboxes: SandboxProvider | None = None,
) -> AsyncIterator[EpisodeRunner]:
    """What runs a run's episodes (in this process or a rollout replica): the task set, agent,
    rewards (the configured ones in this process unless `rewards` are given), an engine
    client, sandboxes (a pool in this process unless `sandboxes` are given), a data-plane
    client and the run store."""
    from omniloop.agents.chat import ChatFormat
    from omniloop.agents.media import media_resolver
    from omniloop.inference.client import EngineClient
    from omniloop.inference.models import load_tokenizer, resolve_model
    from omniloop.platform.control.components import build_agent, build_rewards, load_tasks
    from omniloop.platform.control.local import EpisodeRunner
    from omniloop.platform.control.rollout import media_encoder, sandbox_pool
    from omniloop.platform.data import DataPlane
    from omniloop.platform.store import AsyncStore

    agent = build_agent(config.rollout.agent)
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(engine, str):
            encoder = media_encoder(
                config.rollout.engine, resolve_model(config.model), config.rollout.media
            )
            engine = await stack.enter_async_context(EngineClient(engine, media_encoder=encoder))
        if sandboxes is None:
            sandboxes = await stack.enter_async_context(
                sandbox_pool(config.rollout.sandbox, log_dir=Path(config.run_dir))
            )
        data = DataPlane.start()
        stack.callback(data.close)
        store = AsyncStore.open(config.database)
        stack.push_async_callback(store.close)
        tokenizer = load_tokenizer(config.model)
        yield EpisodeRunner(
            config,
            tasks=load_tasks(config.rollout.tasks, config.rollout.num_tasks),
            agent=agent,
            rewards=build_rewards(config.rollout.rewards) if rewards is None else rewards,
            chat=ChatFormat(tokenizer, agent.tool_schemas),
            engine=engine,
            sandboxes=sandboxes,
            data=data,
            store=store,
            media=media_resolver(
                resolve_model(config.model), tokenizer, config.rollout.media, run_media_dir(config)
            ),
        )


@contextlib.asynccontextmanager
async def actor_roles(
    config: RunConfig, engine_urls: list[str], data: DataPlane | None = None
) -> AsyncIterator[tuple[LocalActor, WeightCoordinator]]:
    """The actor (trainer backend + data-plane reader) and its weight sync to `engine_urls`
    (more may be attached later), in this process or an actor replica. `data` is the reader
    (a new client by default)."""
    import functools

    from omniloop.inference.models import resolve_model
    from omniloop.platform.control.local import LocalActor
    from omniloop.platform.data import DataPlane
    from omniloop.platform.dcs import make_weight_sync
    from omniloop.platform.dcs.coordinator import WeightCoordinator
    from omniloop.trainer.backend import Supervised, make_backend

    seed_everything(config.seed)
    async with contextlib.AsyncExitStack() as stack:
        backend = await asyncio.to_thread(make_backend, config.model, config.trainer)
        if isinstance(backend, Supervised):
            stack.callback(backend.close)
        if data is None:
            data = DataPlane.start()
            stack.callback(data.close)
        make_sync = functools.partial(
            make_weight_sync, config.sync, model_dir=resolve_model(config.model)
        )
        weights = WeightCoordinator(backend, make_sync, engine_urls)
        stack.push_async_callback(weights.close)
        media = await asyncio.to_thread(run_media, config)
        actor = LocalActor(backend, data, config, lock=weights.lock, media=media)
        stack.callback(actor.close)
        yield actor, weights


@contextlib.asynccontextmanager
async def local_roles(
    config: RunConfig, url: str, plane: DataPlane, record: RunRecord, retry: Retry
) -> AsyncIterator[Roles]:
    """The roles in this process (`services.mode=in_process`), each with its own data-plane
    client as a service would have; the actor reads through `plane`."""
    from omniloop.platform.control.local import (
        LocalAdvantage,
        LocalScorer,
        scored_by,
        scoring_roles,
    )
    from omniloop.platform.control.step_rollout import StepRollout
    from omniloop.platform.data import DataPlane
    from omniloop.trainer.reference import TorchReference

    async with contextlib.AsyncExitStack() as stack:
        actor, weights = await stack.enter_async_context(actor_roles(config, [url], plane))
        runner = await stack.enter_async_context(episode_runner(config, url))
        advantage_data = DataPlane.start()
        stack.callback(advantage_data.close)

        async def begin(step: int) -> None:
            runner.open_step(step)

        rollout = StepRollout(
            config.tasks_per_step * config.rollout.samples_per_task,
            runner.run_group,
            concurrency=config.rollout.concurrency,
            begin=begin,
            close=runner.close_step,
            retry=retry,
            on_start=record.episodes_started,
            on_episode=record.episodes_done,
            group_size=config.rollout.samples_per_task,
            extra_groups=config.dynamic_sampling,
        )
        advantage = LocalAdvantage(
            advantage_data,
            config.trainer.advantage,
            config.rollout.samples_per_task,
            config.data_plane.read_timeout,
            drop_uniform=config.dynamic_sampling > 0,
            critic=config.trainer.critic,
        )
        scorers: dict[str, LocalScorer] = {}
        for role in scoring_roles(config):
            scorer_data = DataPlane.start()
            stack.callback(scorer_data.close)
            scorer = LocalScorer(
                role,
                scorer_data,
                await asyncio.to_thread(TorchReference, scored_by(config, role), config.trainer),
                config.trainer.micro_batch_size,
                config.data_plane.read_timeout,
                config.trainer_threads,
                media=await asyncio.to_thread(run_media, config),
            )
            stack.callback(scorer.close)
            scorers[role] = scorer
        critic = None
        if config.trainer.critic is not None:
            from omniloop.platform.control.critic_stage import LocalCritic
            from omniloop.trainer.critic import TorchCritic

            critic_data = DataPlane.start()
            stack.callback(critic_data.close)
            critic = LocalCritic(
                critic_data,
                await asyncio.to_thread(
                    TorchCritic, config.model, config.trainer, config.trainer.critic
                ),
                config.trainer.critic,
                config.trainer.micro_batch_size,
                config.data_plane.read_timeout,
                config.trainer_threads,
            )
            stack.callback(critic.close)
        yield Roles(
            rollout,
            advantage,
            actor,
            weights,
            reference=scorers.get("reference"),
            teacher=scorers.get("teacher"),
            critic=critic,
        )


def with_run_id(config: RunConfig, *, resume: bool) -> RunConfig:
    """`config` with its run id: the one in `RUN_DIR/run_id` when resuming, else `run_id` as
    configured or a new random one, then kept in `RUN_DIR/run_id`."""
    path = Path(config.run_dir) / "run_id"
    if resume and path.is_file():
        run_id = path.read_text().strip()
        if config.run_id is not None and config.run_id != run_id:
            raise ConfigError(
                f"run_id={config.run_id!r} differs from {run_id!r}, the id of the run being "
                f"resumed (in {path}); drop the run_id override"
            )
    else:
        run_id = config.run_id or uuid.uuid4().hex
        path.write_text(run_id + "\n")
    rollout = config.rollout.model_copy(update={"run_id": run_id})
    return config.model_copy(update={"run_id": run_id, "rollout": rollout})


async def _close_plane(task: asyncio.Future[Any]) -> None:
    """Close the data plane once its start finished, whether or not the run got to use it."""
    results = await asyncio.gather(task, return_exceptions=True)
    plane = results[0]
    if not isinstance(plane, BaseException):
        await asyncio.to_thread(plane.close)
