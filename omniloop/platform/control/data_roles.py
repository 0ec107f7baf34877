"""The replicas of the roles that write or read the data plane's rows: rollout, advantage,
the scoring roles (reference, teacher), critic and actor (DESIGN.md §1, §7).

Each class is what one replica of its deployment runs (`services.service_roles` deploys them);
each builds its role from the in-process pieces (`local`, `run`) in its constructor, so a
replica loads torch and the data plane's client, and nothing of the roles it does not run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING

from ray import serve

from omniloop.errors import RoleLost
from omniloop.platform.control.replica import enter_run_folder
from omniloop.platform.control.run_config import RunConfig

if TYPE_CHECKING:
    from omniloop.platform.control.controller import EpisodeSummary, TrainReport
    from omniloop.platform.control.local import ScoringRole


def check_data_plane() -> None:
    """What every role that reads or writes rows needs: the data plane's controller."""
    from omniloop.platform.data.tq import queue_running

    if not queue_running():
        raise RuntimeError("the data plane's controller is not running")


class RolloutServer:
    """A rollout replica: runs a group of episodes (`EpisodeRunner.run_group`) per request."""

    # Serve awaits an async constructor; mypy knows no such thing.
    async def __init__(self, config: RunConfig, cwd: str, paths: list[str]) -> None:  # type: ignore[misc]
        enter_run_folder(cwd, paths)
        from omniloop.platform.control.deployments import run_engines
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
        rewards = remote_rewards(
            config.rollout.rewards,
            serve.get_app_handle("reward"),
            config.services.reward_batch_wait_s,
        )
        self._runner = await self._stack.enter_async_context(
            episode_runner(config, engine, rewards=rewards, sandboxes=sandboxes)
        )

    async def open_step(self, step: int) -> None:
        self._runner.open_step(step)

    async def episodes(
        self, step: int, indices: list[int], attempt: int
    ) -> AsyncGenerator[list[tuple[int, EpisodeSummary]]]:
        """A group's episodes, streamed back as they are written, those written at the same
        moment in one message (`EpisodeRunner.run_group`; called with `stream=True`)."""
        async with contextlib.aclosing(self._runner.run_group(step, indices, attempt)) as group:
            async for done in group:
                yield done

    async def close_step(self, step: int) -> None:
        await self._runner.close_step(step)

    async def check_health(self) -> None:
        # The engine's health is the engine role's: a dead engine must not take the rollout
        # replicas down with it (their episodes wait for the engine's replacement).
        check_data_plane()

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
        check_data_plane()


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
        check_data_plane()


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
        check_data_plane()


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
        await self._actor.reopen_steps(0)
        self._actor.restored()
        self._adopted = True
        return 0, self._actor.version

    async def restore(self, path: str) -> tuple[int, int]:
        """A replica that replaces a lost one restores the checkpoint at `path`."""
        step = await self._actor.load(Path(path))
        await self._actor.reopen_steps(step)
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
        check_data_plane()
        self._actor.check_health()

    async def __del__(self) -> None:
        await self._stack.aclose()
