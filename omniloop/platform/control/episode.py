"""One episode, start to finish: the rollout worker's unit of work.

`run_episode` is the boundary where errors become data: whatever ends the episode (a limit, an
engine or sandbox failure, a reward that raises, cancellation) is recorded as the trajectory's
`stop_reason` and `error`, never raised — except cancellation, which is recorded and re-raised
as `EpisodeCancelled` carrying the trajectory of what ran (so nothing is lost), and bugs (any
other exception), which propagate with the values that explain them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from omniloop.agents.base import Agent, EpisodeEnd, Session, Task
from omniloop.agents.chat import ChatFormat, Message
from omniloop.agents.media import EpisodeMedia, MediaResolver
from omniloop.errors import EngineError, MediaError, RewardError, RoleLost, SandboxError
from omniloop.inference.base import Engine, SamplingParams
from omniloop.rewards import RewardFn, score
from omniloop.sandboxes.base import ExecResult, Sandbox
from omniloop.tools import ToolContext, tool_call_metrics
from omniloop.trajectory import ErrorInfo, StopReason, Trajectory, TrajectoryMeta


class SandboxProvider(Protocol):
    """Where episodes get sandboxes (a `SandboxPool`): `acquire` one, `release` it after."""

    async def acquire(self) -> Sandbox: ...

    async def release(self, sandbox: Sandbox) -> None: ...


class LazySandbox:
    """A `Sandbox` acquired on first use, so episodes that never call a tool never pay for one."""

    def __init__(self, provider: SandboxProvider) -> None:
        self._provider = provider
        self._sandbox: Sandbox | None = None
        self._lock = asyncio.Lock()
        self.id = "lazy"

    async def _get(self) -> Sandbox:
        async with self._lock:
            if self._sandbox is None:
                self._sandbox = await self._provider.acquire()
                self.id = self._sandbox.id
            return self._sandbox

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        return await (await self._get()).exec(command, timeout=timeout, stdin=stdin, env=env)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await (await self._get()).write_file(path, data)

    async def read_file(self, path: str) -> bytes:
        return await (await self._get()).read_file(path)

    async def close(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await self._provider.release(sandbox)


@dataclass
class EpisodeSettings:
    """Per-episode limits and identity."""

    run_id: str
    episode_id: str
    group_id: str = ""
    attempt: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_turns: int = 8
    max_context: int = 2048
    reward_timeout: float | None = 30.0


class EpisodeCancelled(asyncio.CancelledError):
    """`run_episode` was cancelled. A `CancelledError`, so cancellation proceeds as usual;
    `trajectory` holds the turns that ran (stop reason `cancelled`, no reward)."""

    def __init__(self, trajectory: Trajectory) -> None:
        super().__init__(f"episode {trajectory.meta.episode_id!r} was cancelled")
        self.trajectory = trajectory


def without_media(messages: Sequence[Message], reason: str) -> list[Message]:
    """`messages` with every media part replaced by a text part naming `reason`: the record
    of a prompt whose media could not be used."""
    out: list[Message] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                p
                if not isinstance(p, dict) or p.get("type") == "text"
                else {"type": "text", "text": f"[{p.get('type')} not used: {reason}]"}
                for p in content
            ]
        out.append({**message, "content": content})
    return out


def _media_metrics(session: Session) -> dict[str, float]:
    metrics = dict(session.media.counts) if session.media is not None else {}
    if session.neutralised:
        metrics["media/neutralised_placeholders"] = float(session.neutralised)
    return metrics


def _error(err: BaseException) -> ErrorInfo:
    lost_to = err.failed_role if isinstance(err, RoleLost) else None
    return ErrorInfo(type=type(err).__name__, message=str(err)[:2000], failed_role=lost_to)


async def run_episode(
    agent: Agent,
    task: Task,
    *,
    engine: Engine,
    chat: ChatFormat,
    sandbox_provider: SandboxProvider,
    rewards: Sequence[RewardFn],
    settings: EpisodeSettings,
    media: MediaResolver | None = None,
) -> Trajectory:
    """Run `agent` on `task` and return its scored, token-exact trajectory.

    `media` resolves the media of the task's prompt and of tool results (None: the episode is
    text only). A prompt whose media cannot be used ends the episode at once as `media_error`
    (recorded with the prompt's text, the unusable parts named, never trained)."""
    started = time.perf_counter()
    opening = agent.opening(task)
    episode_media = EpisodeMedia(media) if media is not None else None
    stop: StopReason = "stop"
    error: ErrorInfo | None = None
    try:
        session = Session(
            engine, chat, opening, sampling=settings.sampling, max_turns=settings.max_turns,
            max_context=settings.max_context, media=episode_media,
        )  # fmt: skip
    except MediaError as err:
        stop, error = "media_error", _error(err)
        session = Session(
            engine, chat, without_media(opening, str(err)), sampling=settings.sampling,
            max_turns=settings.max_turns, max_context=settings.max_context,
        )  # fmt: skip
    sandbox = LazySandbox(sandbox_provider)
    context = ToolContext(sandbox=sandbox, task=task.model_dump(), episode_id=settings.episode_id)
    cancelled: asyncio.CancelledError | None = None
    try:
        if error is None:
            await agent.run(task, session, context)
    except EpisodeEnd as end:
        stop = end.reason
    except EngineError as err:
        stop, error = "engine_error", _error(err)
    except SandboxError as err:
        stop, error = "sandbox_error", _error(err)
    except asyncio.CancelledError as err:
        stop, error, cancelled = "cancelled", _error(err), err
    finally:
        # Shielded: a cancelled episode must still release its sandbox.
        try:
            await asyncio.shield(sandbox.close())
        except SandboxError as err:
            if error is None:
                stop, error = "sandbox_error", _error(err)
    rollout_seconds = time.perf_counter() - started

    tool_calls = list(context.state.get("tool_calls", []))
    meta = TrajectoryMeta(
        run_id=settings.run_id,
        episode_id=settings.episode_id,
        group_id=settings.group_id,
        attempt=settings.attempt,
        task_id=task.id,
        task=task.model_dump(mode="json"),
        turns=session.turns,
        tool_calls=tool_calls,
        stop_reason=stop,
        error=error,
        metrics={**tool_call_metrics(tool_calls), **_media_metrics(session), **session.metrics},
    )
    placements = session.media.placements if session.media is not None else []
    trajectory = session.builder.build(meta, [p.model_dump(mode="json") for p in placements])
    reward_seconds = 0.0
    if cancelled is None and not trajectory.is_infra_failure:
        reward_started = time.perf_counter()
        try:
            trajectory.reward, trajectory.reward_info = await score(
                rewards,
                task,
                session.final_response(),
                trajectory=trajectory,
                timeout=settings.reward_timeout,
            )
        except RewardError as err:
            trajectory.meta.stop_reason, trajectory.meta.error = "reward_error", _error(err)
        reward_seconds = time.perf_counter() - reward_started
    generate_seconds = sum(t.generate_seconds for t in session.turns)
    trajectory.meta.timings = {
        "generate": generate_seconds,
        "tools": sum(c.duration for c in trajectory.meta.tool_calls),
        "reward": reward_seconds,
        "total": rollout_seconds + reward_seconds,
    }
    if cancelled is not None:
        raise EpisodeCancelled(trajectory) from cancelled
    return trajectory
