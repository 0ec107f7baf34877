"""A training run, start to finish: build the roles, direct them with `train_loop`."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from pathlib import Path
from typing import Any

from omniloop.errors import ConfigError
from omniloop.platform.control.controller import Roles, train_loop
from omniloop.platform.control.metrics import MetricsSink
from omniloop.platform.control.record import RunRecord, checkpoints, recorded_run
from omniloop.platform.control.run_config import RunConfig, config_yaml


def seed_everything(seed: int) -> None:
    """Seed the trainer-side RNGs (sampling seeds derive from episode ids, not from these)."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


async def run(config: RunConfig, *, resume: bool = False) -> Path:
    """Train as `config` says, with in-process roles; returns the run folder.

    Starts (and always stops again) the data plane, a local engine unless `rollout.engine.url`
    is given, and a sandbox pool. With `resume`, continues `config.run_dir` from its newest
    checkpoint: weights, optimizer, version, data position and consumed ids are restored, and
    the engines are given the restored weights before the first rollout. Without `resume`, a
    run folder that already holds checkpoints is refused rather than overwritten.
    """
    import torch
    from transformers.utils import logging as hf_logging

    from omniloop.agents.chat import ChatFormat
    from omniloop.inference.client import EngineClient
    from omniloop.inference.models import load_tokenizer, resolve_model
    from omniloop.platform.control.components import build_agent, build_rewards, load_tasks
    from omniloop.platform.control.console import console, progress_bar
    from omniloop.platform.control.local import (
        ActorWeights,
        LocalActor,
        LocalAdvantage,
        LocalRollout,
        step_tasks,
    )
    from omniloop.platform.control.rollout import engine_url, sandbox_pool
    from omniloop.platform.data import DataPlane, DataPlaneConfig
    from omniloop.platform.store import AsyncStore
    from omniloop.trainer.torch_backend import TorchTrainerBackend
    from omniloop.trainer.weight_sync import make_weight_sync

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
    if config.trainer_threads is not None:
        torch.set_num_threads(config.trainer_threads)
    seed_everything(config.seed)
    tasks = load_tasks(config.rollout.tasks, config.rollout.num_tasks)
    try:
        step_tasks(tasks, 0, config.tasks_per_step)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    agent = build_agent(config.rollout.agent)
    rewards = build_rewards(config.rollout.rewards)
    chat = ChatFormat(load_tokenizer(config.model), agent.tool_schemas)
    plane_config = DataPlaneConfig(
        ray_address=config.data_plane.ray_address,
        num_cpus=config.data_plane.num_cpus,
        ray_temp_dir=config.data_plane.ray_temp_dir,
    )

    store = AsyncStore.open(config.database)
    await store.migrate()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        await stack.enter_async_context(recorded_run(store, config, resume=resume))
        database = store.store.engine.url.render_as_string(hide_password=True)
        console.print(f"[bold]run[/bold] {config.run_id} recorded in {database}", soft_wrap=True)
        # Ray and the queue, the engine and the trainer's model start side by side.
        plane_start = asyncio.ensure_future(asyncio.to_thread(DataPlane.start, plane_config))
        stack.push_async_callback(_close_plane, plane_start)
        backend_load = asyncio.ensure_future(
            asyncio.to_thread(TorchTrainerBackend, config.model, config.trainer)
        )
        stack.push_async_callback(_settle, backend_load)
        url = await stack.enter_async_context(engine_url(config.rollout.engine, log_dir=run_dir))
        engine = await stack.enter_async_context(EngineClient(url))
        pool = await stack.enter_async_context(sandbox_pool(config.rollout.sandbox))
        backend = await backend_load
        actor_data = await plane_start
        # Every role has its own client of the queue, as a separate service would.
        rollout_data, advantage_data = DataPlane.start(), DataPlane.start()
        stack.callback(rollout_data.close)
        stack.callback(advantage_data.close)
        progress = stack.enter_context(progress_bar())
        sink = stack.enter_context(MetricsSink(run_dir, console, tensorboard=config.tensorboard))

        weight_sync = make_weight_sync(config.sync, [url], model_dir=resolve_model(config.model))
        stack.push_async_callback(weight_sync.close)
        actor = LocalActor(backend, actor_data, config)
        sync = ActorWeights(backend, weight_sync)
        start = 0
        if resume and (found := checkpoints(run_dir)):
            start = await actor.load(found[-1])
            await sync.publish(actor.version)
            console.print(
                f"[bold]resumed from[/bold] {found[-1]} (version {actor.version})", soft_wrap=True
            )
        record = RunRecord(config, sink, progress, store, resume_step=start)
        rollout = LocalRollout(
            config,
            tasks=tasks,
            agent=agent,
            rewards=rewards,
            chat=chat,
            engine=engine,
            sandboxes=pool,
            data=rollout_data,
            on_start=record.episodes_started,
            on_episode=record.episodes_done,
        )
        advantage = LocalAdvantage(
            advantage_data,
            config.trainer.advantage,
            config.rollout.samples_per_task,
            config.data_plane.read_timeout,
        )
        await train_loop(Roles(rollout, advantage, actor, sync), record, config, start)
    return run_dir


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


async def _settle(task: asyncio.Future[Any]) -> None:
    """Wait for a start-up task that may still run when start-up fails elsewhere."""
    await asyncio.gather(task, return_exceptions=True)


async def _close_plane(task: asyncio.Future[Any]) -> None:
    """Close the data plane once its start finished, whether or not the run got to use it."""
    results = await asyncio.gather(task, return_exceptions=True)
    plane = results[0]
    if not isinstance(plane, BaseException):
        await asyncio.to_thread(plane.close)
