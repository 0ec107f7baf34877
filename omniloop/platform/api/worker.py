"""The episode worker: runs episodes submitted over REST through the training rollout path.

`EpisodeWorker` is a set of asyncio tasks inside the server process. Its loop claims the oldest
queued episode from the store (`queued` → `running`), runs it with `run_episode` (the same
function training rollouts use: same agent, engine client, sandbox pool and rewards) and stores
the trajectory with `finish_episode`, which makes the episode `completed` or, for an
infrastructure failure (engine, sandbox, reward), `failed` with the error recorded and no
reward. At most `concurrency` episodes run at once; `concurrency=0` (or a server without agents)
pauses the worker: episodes queue and no engine or sandbox is started.

Each sampled turn appends a `turn` event (token counts, finish reason, decoded text), so event
streams show an episode as it runs.

Cancellation: the API marks the episode `cancelled` in the store first (the first terminal
status wins, so a late finish cannot overwrite it), then `cancel()` cancels its task; the
sandbox is released by `run_episode`'s shielded clean-up, and the turns that ran are stored as
the cancelled episode's trajectory. When the server stops, episodes still
running are put back in the queue for the next start instead of being cancelled.

A bug (an exception `run_episode` does not turn into data) fails that episode with the
exception's type and message; the worker goes on with the next one.

Back-pressure: the worker keeps the wall times of its `RECENT_EPISODES` latest episodes, and
`retry_after()` turns them into the `Retry-After` of a `queue-full` answer (see
`estimate_retry_after`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omniloop.agents.base import Agent, Task
from omniloop.agents.chat import ChatFormat
from omniloop.agents.media import MediaResolver
from omniloop.errors import ConfigError
from omniloop.gateway.completions import Gateway
from omniloop.inference.base import Engine, GenerateOutput, SamplingParams
from omniloop.modalities.media import MediaData
from omniloop.platform.api.events import EpisodeSignals
from omniloop.platform.api.metrics import ApiMetrics
from omniloop.platform.api.schemas import MAX_TURNS_FIELD
from omniloop.platform.api.settings import AgentEntry, ApiSettings
from omniloop.platform.control.episode import (
    EpisodeCancelled,
    EpisodeSettings,
    SandboxProvider,
    run_episode,
)
from omniloop.platform.store import AsyncStore, EpisodeRecord, InvalidTransition, StoreError
from omniloop.rewards import RewardFn
from omniloop.trajectory import Trajectory

logger = logging.getLogger(__name__)

WorkerState = Literal["starting", "running", "paused", "failed", "stopped"]

API_RUN_ID = "api"
"""Run id written into the trajectories of episodes that belong to no run."""

MAX_TURN_TEXT = 8000
"""Most characters of decoded text a `turn` event carries."""

CANCEL_MEMORY = 60.0
"""Seconds a cancel for an episode not (yet) running here is remembered (see `cancel`)."""

GATEWAY_MAX_NEW_TOKENS = 1024
"""A gateway reply's limit when the request sets none (and `limits.max_new_tokens` is more)."""
RECENT_EPISODES = 32
"""How many of the latest episodes' wall times `retry_after` estimates from."""
RETRY_AFTER_UNKNOWN = 5
"""`Retry-After` seconds while the worker runs (or is starting) but no episode has ended here
yet: nothing to estimate from, and a slot frees within a few seconds for short episodes."""
RETRY_AFTER_IDLE = 60
"""`Retry-After` seconds when this server's worker runs no episodes (paused with
`concurrency: 0`, failed or stopped): nothing here drains the queue, only another process
claiming episodes or clients cancelling queued ones, so clients should come back slowly."""
RETRY_AFTER_MAX = 300
"""Largest `Retry-After`, however long episodes take: a client should look again at least this
often."""


def estimate_retry_after(durations: Iterable[float], concurrency: int) -> int:
    """Seconds until the queue is likely to have room again: whole seconds in
    [1, `RETRY_AFTER_MAX`].

    The queue gains room when the worker claims an episode, which it does each time one of its
    `concurrency` slots frees. With episodes taking `d` seconds (the median of `durations`, so
    one stuck or instant episode does not swing it) and the slots busy, one frees about every
    `d / concurrency` seconds. No durations: `RETRY_AFTER_UNKNOWN`; no slots (`concurrency`
    below 1): `RETRY_AFTER_IDLE`.
    """
    if concurrency < 1:
        return RETRY_AFTER_IDLE
    seen = [d for d in durations if math.isfinite(d) and d >= 0]
    if not seen:
        return RETRY_AFTER_UNKNOWN
    return max(1, min(RETRY_AFTER_MAX, math.ceil(statistics.median(seen) / concurrency)))


@dataclass
class LoadedAgent:
    """A configured agent, imported and ready."""

    name: str
    entry: AgentEntry
    agent: Agent
    rewards: list[RewardFn]

    @property
    def tool_names(self) -> list[str]:
        names = []
        for schema in self.agent.tool_schemas:
            function = schema.get("function", schema)
            name = function.get("name") if isinstance(function, Mapping) else None
            if isinstance(name, str):
                names.append(name)
        return names


def load_agents(settings: ApiSettings) -> dict[str, LoadedAgent]:
    """Import every configured agent and its rewards; raise `ConfigError` naming the bad one."""
    from omniloop.platform.control.components import build_agent, build_rewards

    loaded = {}
    for name, entry in settings.agents.items():
        try:
            agent = build_agent(entry.agent)
            rewards = build_rewards(entry.rewards)
        except ConfigError as err:
            raise ConfigError(f"agent {name!r}: {err}") from None
        loaded[name] = LoadedAgent(name=name, entry=entry, agent=agent, rewards=rewards)
    return loaded


@dataclass
class _Runtime:
    engine: Engine
    chats: dict[str, ChatFormat]
    sandboxes: SandboxProvider
    media: MediaResolver


class _TurnReporter:
    """An `Engine` that appends a `turn` event to the episode after every generation."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        store: AsyncStore,
        signals: EpisodeSignals,
        episode_id: str,
    ) -> None:
        self._engine = engine
        self._chat = chat
        self._store = store
        self._signals = signals
        self._episode_id = episode_id
        self._turn = 0

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        media: Sequence[MediaData] = (),
        *,
        top_logprobs: int = 0,
    ) -> GenerateOutput:
        if top_logprobs:
            out = await self._engine.generate(input_ids, sampling, media, top_logprobs=top_logprobs)
        else:
            out = await self._engine.generate(input_ids, sampling, media)
        data = {
            "turn": self._turn,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(out.output_ids),
            "finish_reason": out.finish_reason,
            "weight_version": out.weight_version,
            "text": self._chat.decode(out.output_ids)[:MAX_TURN_TEXT],
        }
        self._turn += 1
        try:
            await self._store.append_event("turn", data, episode_id=self._episode_id)
        except StoreError:
            # Progress events are a view; losing one must not fail the episode.
            logger.warning("could not record turn event of episode %s", self._episode_id)
        self._signals.notify(self._episode_id)
        return out


def episode_task(record: EpisodeRecord) -> Task:
    """The `Task` a stored episode asks for (its id defaults to the episode's)."""
    doc = dict(record.task)
    if not doc.get("id"):
        doc["id"] = record.id
    return Task.model_validate(doc)


def episode_settings(record: EpisodeRecord, settings: ApiSettings) -> EpisodeSettings:
    """Limits and identity for running a stored episode."""
    sampling = dict(record.sampling)
    max_turns = sampling.pop(MAX_TURNS_FIELD, None)
    task_id = record.task.get("id")
    return EpisodeSettings(
        run_id=record.run_id or API_RUN_ID,
        episode_id=record.id,
        group_id=task_id if isinstance(task_id, str) else record.id,
        sampling=SamplingParams.model_validate(sampling),
        max_turns=max_turns if isinstance(max_turns, int) else 8,
        max_context=settings.max_context,
        reward_timeout=settings.reward_timeout,
    )


class EpisodeWorker:
    """Runs queued episodes; see the module docstring. `start()` once, `stop()` once."""

    def __init__(
        self,
        store: AsyncStore,
        settings: ApiSettings,
        agents: Mapping[str, LoadedAgent],
        signals: EpisodeSignals,
        metrics: ApiMetrics,
    ) -> None:
        self.store = store
        self.settings = settings
        self.agents = dict(agents)
        self.signals = signals
        self.metrics = metrics
        # With no agents nothing can be submitted: no engine or sandbox is worth starting.
        self._paused = settings.concurrency == 0 or not self.agents
        self.state: WorkerState = "paused" if self._paused else "starting"
        self.error: str | None = None
        """Why the worker failed (state `failed`), e.g. the engine did not start."""
        self._wake = asyncio.Event()
        self._main: asyncio.Task[None] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._user_cancelled: set[str] = set()
        self._cancel_pending: dict[str, float] = {}
        self._stopping = False
        self._durations: deque[float] = deque(maxlen=RECENT_EPISODES)
        """Wall seconds, claim to end, of the latest episodes that ended here."""
        self.gateway: Gateway | None = None
        """OpenAI-compatible completions over the worker's engine, while it runs (with
        `settings.gateway`)."""

    @property
    def alive(self) -> bool:
        """True while the worker can run (or, paused, could queue) episodes."""
        return self.state in ("starting", "running", "paused")

    @property
    def running(self) -> list[str]:
        """Ids of the episodes running in this process now."""
        return list(self._tasks)

    def retry_after(self) -> int:
        """`Retry-After` seconds for a client refused because the queue is full: see
        `estimate_retry_after`; `RETRY_AFTER_IDLE` when this worker runs no episodes
        (paused, failed or stopped)."""
        if self._paused or self.state not in ("starting", "running"):
            return RETRY_AFTER_IDLE
        return estimate_retry_after(self._durations, self.settings.concurrency)

    def start(self) -> None:
        if self._main is not None:
            raise RuntimeError("the episode worker was already started")
        self._main = asyncio.create_task(self._run_forever(), name="omniloop-episode-worker")
        self.metrics.worker_up.set(1)

    def wake(self) -> None:
        """Tell the worker an episode was queued (it also polls, for other processes' work)."""
        self._wake.set()

    def cancel(self, episode_id: str) -> None:
        """Cancel the episode's task if it runs here. Call after the store marked it cancelled.

        A cancel that arrives between the worker claiming the episode and starting its task is
        remembered for `CANCEL_MEMORY` seconds, so the task is never started.
        """
        task = self._tasks.get(episode_id)
        if task is not None:
            self._user_cancelled.add(episode_id)
            task.cancel()
            return
        now = time.monotonic()
        for key, when in list(self._cancel_pending.items()):
            if now - when > CANCEL_MEMORY:
                del self._cancel_pending[key]
        self._cancel_pending[episode_id] = now

    async def stop(self) -> None:
        """Stop claiming, put running episodes back in the queue, release engine and sandboxes."""
        self._stopping = True
        if self._main is not None:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._main
        self.state = "stopped"
        self.metrics.worker_up.set(0)

    # -- internals ----------------------------------------------------------------------------

    async def _run_forever(self) -> None:
        try:
            if self._paused:
                await asyncio.Event().wait()  # until stop() cancels
            async with self._runtime() as runtime:
                self.state = "running"
                await self._claim_loop(runtime)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.state = "failed"
            self.error = f"{type(err).__name__}: {err}"
            self.metrics.worker_up.set(0)
            logger.exception("the episode worker failed; episodes stay queued")

    @contextlib.asynccontextmanager
    async def _runtime(self) -> AsyncIterator[_Runtime]:
        from omniloop.agents.media import media_resolver
        from omniloop.inference.client import EngineClient
        from omniloop.inference.models import load_tokenizer, resolve_model
        from omniloop.platform.control.rollout import engine_url, media_encoder, sandbox_pool

        tokenizer = await asyncio.to_thread(load_tokenizer, self.settings.engine.model)
        model_folder = resolve_model(self.settings.engine.model)
        media = await asyncio.to_thread(
            media_resolver,
            model_folder,
            tokenizer,
            self.settings.media,
            Path(self.settings.media_dir),
            allow_files=False,
        )

        def chat_formats() -> dict[str, ChatFormat]:
            return {
                name: ChatFormat(tokenizer, loaded.agent.tool_schemas)
                for name, loaded in self.agents.items()
            }

        chats = await asyncio.to_thread(chat_formats)
        encoder = media_encoder(self.settings.engine, model_folder, self.settings.media)
        async with (
            engine_url(self.settings.engine, media=self.settings.media) as url,
            EngineClient(url, media_encoder=encoder) as engine,
            sandbox_pool(self.settings.sandbox) as pool,
        ):
            if self.settings.gateway:
                self.gateway = Gateway(
                    engine, tokenizer, model=self.settings.engine.model,
                    max_context=self.settings.max_context,
                    max_new_tokens=min(GATEWAY_MAX_NEW_TOKENS, self.settings.limits.max_new_tokens),
                )  # fmt: skip
            try:
                yield _Runtime(engine=engine, chats=chats, sandboxes=pool, media=media)
            finally:
                self.gateway = None
                await self._requeue_running()

    async def _claim_loop(self, runtime: _Runtime) -> None:
        slots = asyncio.Semaphore(self.settings.concurrency)
        while True:
            await slots.acquire()
            self._wake.clear()
            try:
                record = await self.store.claim_next_episode()
            except Exception:
                slots.release()
                logger.exception("could not claim a queued episode; retrying")
                await asyncio.sleep(self.settings.poll_interval)
                continue
            if record is None:
                slots.release()
                # `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` returns the
                # result when a cancel (`stop()`) arrives just as a submission's `wake()` sets
                # the event, and the cancel is lost: the loop then polls forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.poll_interval):
                        await self._wake.wait()
                continue
            self.signals.notify(record.id)
            if self._cancel_pending.pop(record.id, None) is not None:
                slots.release()
                continue
            task = asyncio.create_task(self._run_one(record, runtime), name=f"episode-{record.id}")
            self._tasks[record.id] = task
            self.metrics.running.set(len(self._tasks))

            def done(_: asyncio.Task[None], episode_id: str = record.id) -> None:
                self._tasks.pop(episode_id, None)
                self.metrics.running.set(len(self._tasks))
                slots.release()

            task.add_done_callback(done)

    async def _run_one(self, record: EpisodeRecord, runtime: _Runtime) -> None:
        episode_id = record.id
        began = time.monotonic()
        try:
            loaded = self.agents.get(record.agent)
            if loaded is None:
                raise ConfigError(
                    f"agent {record.agent!r} is not configured on this server "
                    f"(configured: {', '.join(sorted(self.agents)) or 'none'})"
                )
            chat = runtime.chats[loaded.name]
            trajectory = await run_episode(
                loaded.agent,
                episode_task(record),
                engine=_TurnReporter(runtime.engine, chat, self.store, self.signals, episode_id),
                chat=chat,
                sandbox_provider=runtime.sandboxes,
                rewards=loaded.rewards,
                settings=episode_settings(record, self.settings),
                media=runtime.media,
            )
            final = await self.store.finish_episode(episode_id, trajectory)
            self.metrics.finished.labels(final.status).inc()
        except asyncio.CancelledError as err:
            if self._stopping and episode_id not in self._user_cancelled:
                await asyncio.shield(self._set_status(episode_id, "queued"))
            else:
                await asyncio.shield(self._set_status(episode_id, "cancelled"))
                self.metrics.finished.labels("cancelled").inc()
                if isinstance(err, EpisodeCancelled):
                    # The turns that ran stay readable; the episode stays cancelled.
                    await asyncio.shield(self._keep_trajectory(episode_id, err.trajectory))
            raise
        except Exception as err:
            logger.exception("episode %s failed", episode_id)
            await self._set_status(
                episode_id, "failed", error_type=type(err).__name__, error_message=str(err)[:2000]
            )
            self.metrics.finished.labels("failed").inc()
        finally:
            if not self._stopping:  # a stop cuts episodes short: no sample of their length
                self._durations.append(time.monotonic() - began)
            self._user_cancelled.discard(episode_id)
            self.signals.notify(episode_id)

    async def _keep_trajectory(self, episode_id: str, trajectory: Trajectory) -> None:
        """Best-effort store of a cancelled episode's partial trajectory."""
        try:
            await self.store.finish_episode(episode_id, trajectory)
        except Exception:
            logger.exception("could not store the trajectory of cancelled episode %s", episode_id)

    async def _set_status(self, episode_id: str, status: Any, **error: str) -> None:
        """Best-effort status change at the end of an episode: one already terminal (say,
        cancelled by a client) keeps its status."""
        try:
            await self.store.update_episode_status(episode_id, status, **error)
        except InvalidTransition:
            pass
        except Exception:
            logger.exception("could not mark episode %s %s", episode_id, status)
        self.signals.notify(episode_id)

    async def _requeue_running(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
