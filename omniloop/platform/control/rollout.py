"""`omniloop rollout`: run N episodes of a task set and write their trajectories.

The rollout worker's loop: for each (task, sample) pair, run an episode under a concurrency
bound, write its trajectory as one JSONL line as soon as it finishes, and summarise at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omniloop.agents.base import Task
from omniloop.agents.chat import ChatFormat
from omniloop.agents.media import media_resolver
from omniloop.inference.client import (
    EngineClient,
    MediaEncoder,
    ProcessorOutputFields,
    media_fields,
)
from omniloop.inference.models import load_tokenizer, resolve_model
from omniloop.modalities.config import MediaConfig
from omniloop.modalities.families import processor_for
from omniloop.platform.control.components import (
    build_agent,
    build_rewards,
    episode_plan,
    load_tasks,
)
from omniloop.platform.control.console import console, progress_bar
from omniloop.platform.control.engines import local_engine
from omniloop.platform.control.episode import EpisodeSettings, SandboxProvider, run_episode
from omniloop.platform.control.rollout_config import EngineConfig, RolloutConfig
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.factory import create_sandbox, resolve_backend
from omniloop.sandboxes.local import TOKEN_ENV, LocalSandboxd, RemoteSandboxes
from omniloop.sandboxes.pool import SandboxPool
from omniloop.sandboxes.remote import SandboxClient
from omniloop.trajectory import Trajectory


@contextlib.asynccontextmanager
async def engine_url(
    config: EngineConfig, log_dir: Path | None = None, media: MediaConfig | None = None
) -> AsyncIterator[str]:
    """The configured engine's URL, starting a local engine for the block if none is given
    (with `media`, the settings the rollout counts placeholder blocks with)."""
    if config.url:
        yield config.url.rstrip("/")
        return
    log = log_dir / "engine.log" if log_dir else None
    async with local_engine(
        config.model,
        threads=config.threads,
        log_path=log,
        startup_timeout=config.startup_timeout,
        media=media,
    ) as url:
        yield url


def media_encoder(config: EngineConfig, model_folder: Path, media: MediaConfig) -> MediaEncoder:
    """The form the rollout sends media to its engines in (`EngineConfig.media_form`)."""
    processor = processor_for(model_folder, media)
    if config.media_form == "files" or processor is None:
        return media_fields
    return ProcessorOutputFields(processor)


def write_trajectory(stream: Any, trajectory: Trajectory) -> None:
    """Append one trajectory as a JSON line and flush (a crash loses at most one line)."""
    stream.write(trajectory.model_dump_json() + "\n")
    stream.flush()


def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Counts and means; infrastructure failures are counted, not averaged into rewards."""
    scored = [t.reward for t in trajectories if t.reward is not None and not t.is_infra_failure]
    stops: dict[str, int] = {}
    for t in trajectories:
        stops[str(t.meta.stop_reason)] = stops.get(str(t.meta.stop_reason), 0) + 1
    n = len(trajectories)
    return {
        "episodes": n,
        "errors": sum(t.is_infra_failure for t in trajectories),
        "reward_mean": sum(scored) / len(scored) if scored else None,
        "response_length_mean": sum(t.response_length for t in trajectories) / n if n else 0.0,
        "turns_mean": sum(len(t.meta.turns) for t in trajectories) / n if n else 0.0,
        "tool_calls": sum(len(t.meta.tool_calls) for t in trajectories),
        "stop_reasons": dict(sorted(stops.items())),
    }


@contextlib.asynccontextmanager
async def sandbox_pool(
    config: SandboxConfig, log_dir: Path | None = None
) -> AsyncIterator[SandboxProvider]:
    """Where this process's episodes get sandboxes, as `config.service` says: a sandboxd child
    process (`local`, its log in `log_dir/sandboxd.log` when given), a running sandboxd (a
    URL), or a warm pool in this process (`in_process`). The backend is printed."""
    if config.service.startswith(("http://", "https://")):
        console.print(f"[bold]sandbox service:[/bold] {config.service} ({config.backend})")
        client = SandboxClient(config.service, token=os.environ.get(TOKEN_ENV))
        async with client:
            yield RemoteSandboxes(client, config)
        return
    backend = resolve_backend(config)
    console.print(f"[bold]sandbox backend:[/bold] {backend}")
    resolved = config.model_copy(update={"backend": backend})
    if config.service == "local":
        log = log_dir / "sandboxd.log" if log_dir is not None else None
        async with LocalSandboxd(resolved, log_path=log) as local:
            yield local
        return
    async with SandboxPool(lambda: create_sandbox(resolved), config.pool_size) as pool:
        yield pool


async def run_rollout(config: RolloutConfig) -> list[Trajectory]:
    """Run every episode of `config`, writing trajectories as they finish; return them all."""
    tasks = load_tasks(config.tasks, config.num_tasks)
    agent = build_agent(config.agent)
    rewards = build_rewards(config.rewards)
    tokenizer = load_tokenizer(config.engine.model)
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    plan = list(episode_plan(config, tasks))
    output = Path(config.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    model_folder = resolve_model(config.engine.model)
    media = media_resolver(model_folder, tokenizer, config.media, output.parent / "media")
    limit = asyncio.Semaphore(config.concurrency)
    results: list[Trajectory] = []

    async with (
        engine_url(config.engine, log_dir=output.parent, media=config.media) as url,
        EngineClient(
            url, media_encoder=media_encoder(config.engine, model_folder, config.media)
        ) as engine,
        sandbox_pool(config.sandbox, log_dir=output.parent) as pool,
    ):

        async def one(task: Task, settings: EpisodeSettings) -> Trajectory:
            async with limit:
                return await run_episode(
                    agent,
                    task,
                    engine=engine,
                    chat=chat,
                    sandbox_provider=pool,
                    rewards=rewards,
                    settings=settings,
                    media=media,
                )

        with output.open("w") as stream, progress_bar() as bar:  # noqa: ASYNC230
            job = bar.add_task("episodes", total=len(plan))
            for finished in asyncio.as_completed([one(t, s) for t, s in plan]):
                trajectory = await finished
                write_trajectory(stream, trajectory)
                results.append(trajectory)
                bar.advance(job)
    return results
