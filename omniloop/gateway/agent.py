"""`OpenAIAgent`: an agent written against the OpenAI SDK, run as an omniloop `Agent`.

Each episode gets a gateway of its own (`Gateway` over the episode's engine, with a token made
for it), reached under its session's path of one server per event loop on 127.0.0.1
(`EpisodeGateways`, started with the first episode). The agent is handed its base URL and key
and talks only to it, unchanged:

- a Python callable, `async def solve(task: Task, endpoint: OpenAIEndpoint) -> str | None`
  (e.g. `AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)`), or
- a command, run with `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `OPENAI_MODEL` and `OMNILOOP_TASK`
  (the task as JSON) in its environment; its standard output, stripped, is its answer.

The episode's trajectory is the gateway session's segment of the agent's last reply, adopted
by the episode's `Session` (`Session.adopt`); the final response is the agent's answer (or,
when it returns none, its last reply's text). The rollout's sampling settings govern every
reply (temperature, top-p, a per-reply seed, `max_new_tokens` as a cap), whatever the agent
asks, and `max_turns` / `max_context` bound the session: the call past them is refused, the
agent's SDK raises, and the episode ends `max_turns` / `context_limit`.

Outcomes: an engine failure behind any call is `engine_error` (an infrastructure failure,
never trained as a zero reward), whatever the agent made of it. An agent that raises or
exits non-zero for another reason has failed the task: its episode is scored as it stands
and counted (`gateway/agent_errors`). Per episode: `gateway/calls`, `gateway/segments`,
`gateway/fresh_segments`, `gateway/resent_calls`, `gateway/stable_calls` (a step's
`gateway/prefix_stability` is its stable over its resent calls).

Not covered: only the last reply's segment is trained; other segments (forks, or fresh
segments after the agent rewrote its history) are counted, not trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import re
import secrets
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omniloop.agents.base import EpisodeEnd, Session, Task
from omniloop.agents.chat import Message
from omniloop.errors import ConfigError, EngineError
from omniloop.gateway.app import bearer_matches, create_gateway_app, start_server
from omniloop.gateway.completions import Gateway

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
"""The model name the gateway of an episode lists (any name is accepted in requests)."""


@dataclass(frozen=True)
class OpenAIEndpoint:
    """Where an episode's agent sends its OpenAI calls."""

    base_url: str
    """The OpenAI `base_url` (ends in `/v1/sessions/<episode>`)."""
    api_key: str
    model: str = MODEL_NAME

    def http_client(self) -> Any:
        """An `httpx.AsyncClient` for `AsyncOpenAI(..., http_client=...)`, optional: the
        SDK's own client builds a TLS context each time (about 25 ms of CPU), which a loopback
        gateway never uses; this one shares one. Close it as usual (`async with` the SDK
        client does)."""
        from openai import DefaultAsyncHttpxClient

        return DefaultAsyncHttpxClient(verify=_tls_context())

    @property
    def env(self) -> dict[str, str]:
        """The OpenAI SDK's environment variables for a subprocess."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "OPENAI_MODEL": self.model,
        }


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


Solve = Callable[[Task, OpenAIEndpoint], Awaitable[str | None] | str | None]


class OpenAIAgent:
    """An OpenAI-SDK agent as an omniloop `Agent` (module docstring)."""

    def __init__(
        self,
        solve: Solve | None = None,
        *,
        command: Sequence[str] | None = None,
        timeout_s: float = 600.0,
        system_prompt: str | None = None,
    ) -> None:
        """
        Args:
            solve: The agent as a Python callable (sync callables run in a thread).
            command: Or the agent as a command line (`["python", "agent.py"]`).
            timeout_s: The most seconds an episode's agent may run.
            system_prompt: Only for the episode's opening record; the agent writes its own
                messages.
        """
        if (solve is None) == (command is None):
            raise ConfigError("OpenAIAgent takes a solve callable or a command, exactly one")
        self.solve = solve
        self.command = list(command) if command is not None else None
        self.timeout_s = timeout_s
        self.system_prompt = system_prompt
        self.tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[Message]:
        """The task's messages (the trajectory's prompt if the agent never calls)."""
        return task.messages(self.system_prompt)

    async def run(self, task: Task, session: Session, context: Any) -> None:
        """Serve the episode's gateway, run the agent against it, adopt what it recorded."""
        gateway = Gateway(
            session.engine,
            session.chat.tokenizer,
            model=MODEL_NAME,
            max_context=session.max_context,
            max_new_tokens=session.sampling.max_new_tokens,
            sampling=session.sampling,
            max_turns=session.max_turns,
            chat=None if session.chat.tools else session.chat,
        )
        # The session's name goes in the URL's path: the episode id, path-safe, made unique.
        episode = re.sub(r"[^A-Za-z0-9._-]", "_", str(getattr(context, "episode_id", "") or "ep"))
        name = f"{episode}-{secrets.token_hex(4)}"
        answer: str | None = None
        failure: BaseException | None = None
        async with episode_gateways().episode(name, gateway) as endpoint:
            try:
                answer = await asyncio.wait_for(self._run_agent(task, endpoint), self.timeout_s)
            except ConfigError:
                raise
            except Exception as err:  # the agent's failure (module docstring), a timeout too
                failure = err
        recording = gateway.close(name)
        if recording is not None and recording.ended_by == "engine_error":
            raise EngineError(f"the engine failed behind the agent's call: {failure!r}")
        if recording is not None and recording.last_segment is not None:
            segment = recording.segments[recording.last_segment]
            reply = segment.messages[-1].content
            text = answer if answer is not None else reply
            final: Message = {"role": "assistant", "content": text}
            session.adopt(segment.builder, segment.turns, [*session.messages, final])
        if recording is not None:
            stats = recording.stats()
            session.metrics.update(
                {
                    "gateway/calls": float(stats["calls"]),
                    "gateway/segments": float(stats["segments"]),
                    "gateway/fresh_segments": float(stats["fresh_segments"]),
                    "gateway/resent_calls": float(stats["resent_calls"]),
                    "gateway/stable_calls": float(stats["stable_calls"]),
                }
            )
            if recording.ended_by == "max_turns":
                raise EpisodeEnd("max_turns", f"the agent's call was refused: {failure!r}")
            if recording.ended_by == "context_limit":
                raise EpisodeEnd("context_limit", f"the agent's call was refused: {failure!r}")
        if failure is not None:
            session.metrics["gateway/agent_errors"] = 1.0
            logger.warning("episode %s: the agent failed: %r", name, failure)

    async def _run_agent(self, task: Task, endpoint: OpenAIEndpoint) -> str | None:
        if self.command is not None:
            return await self._run_command(task, endpoint)
        assert self.solve is not None
        if inspect.iscoroutinefunction(self.solve):
            result = await self.solve(task, endpoint)
        else:
            result = await asyncio.to_thread(self.solve, task, endpoint)
            if inspect.isawaitable(result):
                result = await result
        return None if result is None else str(result)

    async def _run_command(self, task: Task, endpoint: OpenAIEndpoint) -> str:
        assert self.command is not None
        env = {**os.environ, **endpoint.env, "OMNILOOP_TASK": task.model_dump_json()}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise ConfigError(f"the agent command {self.command!r} cannot start: {exc}") from None
        try:
            out, err = await process.communicate()
        except asyncio.CancelledError:
            process.kill()
            await process.wait()
            raise
        if process.returncode != 0:
            tail = err.decode(errors="replace")[-2000:]
            raise RuntimeError(f"the agent command exited {process.returncode}: {tail}")
        return out.decode(errors="replace").strip()


class EpisodeGateways:
    """The episodes' gateways of one event loop behind one server (`Routes`): a session per
    episode, each with its own gateway and token, registered for the episode's duration."""

    def __init__(self) -> None:
        self._sessions: dict[str, tuple[Gateway, str]] = {}
        self._url: str | None = None
        self._starting = asyncio.Lock()
        self._server: Any = None

    def gateway_for(self, session_id: str | None) -> Gateway | None:
        entry = self._sessions.get(session_id) if session_id else None
        return entry[0] if entry is not None else None

    def authorized(self, session_id: str | None, authorization: str) -> bool:
        entry = self._sessions.get(session_id) if session_id else None
        # An unknown session is not a secret: it is answered 404.
        return entry is None or bearer_matches(authorization, entry[1])

    async def url(self) -> str:
        """The server's base URL, started on first use (it lives as long as the loop)."""
        async with self._starting:
            if self._url is None:
                self._server, _, self._url = await start_server(create_gateway_app(self))
        return self._url

    @contextlib.asynccontextmanager
    async def episode(self, name: str, gateway: Gateway) -> AsyncIterator[OpenAIEndpoint]:
        """Serve `gateway` as session `name` for the block; the agent's endpoint."""
        token = secrets.token_urlsafe(24)
        url = await self.url()
        self._sessions[name] = (gateway, token)
        try:
            yield OpenAIEndpoint(f"{url}/v1/sessions/{name}", token)
        finally:
            del self._sessions[name]


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EpisodeGateways] = (
    weakref.WeakKeyDictionary()
)


def episode_gateways() -> EpisodeGateways:
    """This event loop's `EpisodeGateways`."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = EpisodeGateways()
    return hub


def task_from_env() -> dict[str, Any]:
    """In an agent command: the episode's task (`OMNILOOP_TASK`) as a dict."""
    value = os.environ.get("OMNILOOP_TASK")
    if value is None:
        raise RuntimeError("OMNILOOP_TASK is not set: run this as an OpenAIAgent command")
    task: dict[str, Any] = json.loads(value)
    return task
