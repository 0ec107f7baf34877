"""`Gateway`: OpenAI chat completions over an engine's `/generate`, recorded token-exactly.

A call's messages are matched against its session's recording (`recorder.py`); only the
messages after the matched point are rendered (`ChatFormat`, per tool list), the engine samples
from the ids (never from text, never through its own chat endpoint), and the sampled ids are
recorded verbatim. The turn's text then becomes OpenAI's message: Hermes/Qwen `<tool_call>`
blocks become `tool_calls` when every block parses (otherwise the text is returned as it is,
and the calls stay text), the rest is `content`. What the client is given is what a resent
message is matched against.

Sessions are kept in memory, the `max_sessions` most recently used; a call naming no session
gets a new one. A session's calls are served one at a time.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from omniloop.agents.base import turn_seed
from omniloop.agents.chat import ChatFormat, Message
from omniloop.errors import EngineError
from omniloop.gateway.openai_wire import ChatCompletionRequest, render_form, to_chat
from omniloop.gateway.recorder import Point, Segment, SessionRecording, canonical
from omniloop.inference.base import Engine, GenerateOutput, SamplingParams
from omniloop.tools import parse_tool_calls
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta, TurnRecord

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ContextLengthError(ValueError):
    """The conversation leaves no room for a reply."""


class TurnLimitError(ValueError):
    """The session has sampled as many replies as the gateway allows."""


class EngineAborted(EngineError):
    """The engine aborted the request (e.g. around a weight update); retry it."""


@dataclass(frozen=True)
class Choice:
    """One sampled reply, in OpenAI's terms and in tokens."""

    index: int
    content: str | None
    tool_calls: list[dict[str, Any]]
    """OpenAI's `tool_calls`: `{"id", "type": "function", "function": {"name", "arguments"}}`."""
    finish_reason: str
    """`stop`, `length` or `tool_calls`."""
    token_ids: list[int]
    """The sampled ids, verbatim (the end-of-turn token included when sampled)."""
    logprobs: list[float]
    token_texts: list[str]
    """Each sampled token's text (its share of the decoded turn)."""
    top_logprobs: list[list[tuple[str, float]]]
    """Per sampled token, the request's `top_logprobs` most likely tokens, as (text, logprob),
    highest first; empty when not asked."""
    prompt_tokens: int
    weight_version: int
    segment: int


@dataclass
class _Session:
    recording: SessionRecording = field(default_factory=SessionRecording)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def token_texts(chat: ChatFormat, ids: list[int]) -> list[str]:
    """Each id's share of the decoded text: differences of the decoded prefixes, so that the
    pieces join to exactly the decoded whole (a character split over tokens lands on the
    token that completes it)."""
    texts, before = [], ""
    for i in range(len(ids)):
        now = chat.decode(ids[: i + 1])
        texts.append(now[len(before) :] if now.startswith(before) else now)
        before = now
    return texts


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


class Gateway:
    """Chat completions for one model over `engine`, with per-session recordings."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: str,
        max_context: int = 4096,
        max_new_tokens: int = 1024,
        max_sessions: int = 10_000,
        sampling: SamplingParams | None = None,
        max_turns: int | None = None,
        on_abort: Literal["hold", "retry_after"] = "hold",
        hold_s: float = 600.0,
        chat: ChatFormat | None = None,
    ) -> None:
        """`model`: the name `/v1/models` lists; `max_context`: most tokens of a segment;
        `max_new_tokens`: a reply's limit when the request sets none.

        For training (an episode's gateway), `sampling` overrides what requests ask for:
        its temperature, top-p and top-k are used, its `max_new_tokens` caps every reply, its
        stop strings are added, and reply `k` of a session samples with `turn_seed(seed, k)`
        (as the in-process agent loop's turns do); `max_turns` bounds the replies of a
        session.

        A weight sync may abort requests the engine is running (SGLang's `abort` pause mode):
        with `on_abort="hold"` the gateway samples the reply again, for up to `hold_s`
        seconds (the paused engine holds the new request until the sync is over), so no
        client call fails because of a sync; with `retry_after` the call is answered 429 with
        `Retry-After`. An aborted attempt's partial output is never recorded.

        `chat`: the chat format of requests without tools, if one is at hand (built otherwise;
        building one renders the template a few times)."""
        self.on_abort = on_abort
        self.hold_s = hold_s
        self.engine = engine
        self.sampling = sampling
        self.max_turns = max_turns
        self.tokenizer = tokenizer
        self.model = model
        self.max_context = max_context
        self.max_new_tokens = max_new_tokens
        self.max_sessions = max_sessions
        self.aborted_attempts = 0
        """Engine replies aborted (and sampled again, or answered 429)."""
        self._formats: dict[str, ChatFormat] = {}
        if chat is not None:
            if chat.tools:
                raise ValueError("Gateway(chat=...) is the format of requests without tools")
            self._formats[json.dumps([])] = chat
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    # -- sessions -------------------------------------------------------------------------------

    def new_session_id(self) -> str:
        return "sess-" + secrets.token_hex(8)

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        return session

    def recording(self, session_id: str) -> SessionRecording | None:
        session = self._sessions.get(session_id)
        return session.recording if session is not None else None

    def close(self, session_id: str) -> SessionRecording | None:
        """Forget a session; its recording (None if unknown)."""
        session = self._sessions.pop(session_id, None)
        return session.recording if session is not None else None

    def trajectories(self, recording: SessionRecording, session_id: str) -> list[Trajectory]:
        """Each segment of a recording as a `Trajectory` (episode id: the session id)."""
        return [
            segment.builder.build(
                TrajectoryMeta(
                    run_id="gateway",
                    episode_id=session_id,
                    segment=segment.index,
                    turns=list(segment.turns),
                    metrics={"gateway/forked_from": float(segment.parent)}
                    if segment.parent is not None
                    else {},
                )
            )
            for segment in recording.segments
        ]

    # -- completions ----------------------------------------------------------------------------

    def chat_format(self, tools: list[dict[str, Any]] | None) -> tuple[str, ChatFormat]:
        """The chat format of a tool list (cached), and the list's key."""
        key = json.dumps(tools or [], ensure_ascii=False)
        chat = self._formats.get(key)
        if chat is None:
            chat = self._formats[key] = ChatFormat(self.tokenizer, tools or None)
        return key, chat

    async def complete(self, request: ChatCompletionRequest, session_id: str) -> list[Choice]:
        """Sample `request.n` replies in session `session_id` and record them.

        `ValueError` for messages the gateway cannot take (naming them), `ContextLengthError`
        when no room is left, `EngineError` / `EngineAborted` from the engine."""
        messages = to_chat(request.messages)
        key, chat = self.chat_format(request.tools)
        session = self._session(session_id)
        async with session.lock:
            recording = session.recording
            recording.count(messages, recording.match(messages, key))
            choices = []
            for index in range(request.n):
                seed = None if request.seed is None else request.seed + index
                choice = await self._one(recording, messages, key, chat, request, seed, index)
                choices.append(choice)
            return choices

    async def _one(
        self,
        recording: SessionRecording,
        messages: list[Message],
        key: str,
        chat: ChatFormat,
        request: ChatCompletionRequest,
        seed: int | None,
        index: int,
    ) -> Choice:
        if self.max_turns is not None and recording.engine_calls >= self.max_turns:
            recording.ended_by = "max_turns"
            raise TurnLimitError(f"the session has had its {self.max_turns} replies (max_turns)")
        match = recording.match(messages, key)
        point = match.point
        base: Segment | None = match.segment
        if base is not None and match.fork and point is not None:
            base = base.fork(len(recording.segments), point)
        new = [render_form(m) for m in match.new_messages]
        if base is None:
            before: list[int] = []
            added = chat.prompt_ids(new)
        else:
            before = base.builder.input_ids
            closed = point.closed if point is not None else True
            added = chat.observation_ids(new, closed=closed) if new else []
        prompt = [*before, *added]
        room = self.max_context - len(prompt)
        if room <= 0:
            recording.ended_by = "context_limit"
            raise ContextLengthError(
                f"the conversation is {len(prompt)} tokens, the gateway's max_context is "
                f"{self.max_context}: no room for a reply"
            )
        params = self._params(request, chat, seed, room, recording.engine_calls)
        started = time.perf_counter()
        try:
            out = await self._generate(prompt, params, request.top_logprobs or 0)
        except EngineError:
            recording.ended_by = "engine_error"
            raise
        recording.engine_calls += 1
        seconds = time.perf_counter() - started
        # Commit only now: a failed call leaves the recording as it was.
        if base is None:
            segment = Segment(
                index=len(recording.segments),
                tools_key=key,
                messages=[canonical(m) for m in match.new_messages],
                builder=TrajectoryBuilder(prompt),
                points=[],
            )
        else:
            segment = base
            if added:
                segment.builder.add_observation(added)
            segment.messages.extend(canonical(m) for m in match.new_messages)
        if match.fork or base is None:
            recording.segments.append(segment)
        segment.points.append(Point("generation", len(segment.messages), len(segment.builder)))
        start = len(segment.builder)
        ids = list(out.output_ids)
        versions = out.weight_versions or out.weight_version
        segment.builder.add_sampled(ids, out.output_logprobs, versions)
        closed = bool(ids) and chat.is_closing(ids[-1])
        text = chat.decode(ids[:-1] if closed else ids)
        if not closed and out.finish_reason == "stop":
            text = _cut_at_stop(text, params.stop or [])
        content, calls = self._reply(text, parse=request.tool_choice != "none")
        # Recorded as a client resending the reply would send it (the same parse).
        reply = {"role": "assistant", "content": content, "tool_calls": calls}
        segment.messages.append(canonical(to_chat([reply])[0]))
        segment.turns.append(
            TurnRecord(
                start=start,
                num_sampled=len(ids),
                finish_reason=out.finish_reason,
                weight_version=out.weight_version,
                generate_seconds=seconds,
            )
        )
        segment.points.append(Point("turn", len(segment.messages), len(segment.builder), closed))
        recording.last_segment = segment.index
        finish = "length" if out.finish_reason == "length" else "tool_calls" if calls else "stop"
        return Choice(
            index=index,
            content=content if content or not calls else None,
            tool_calls=calls,
            finish_reason=finish,
            token_ids=ids,
            logprobs=list(out.output_logprobs),
            token_texts=token_texts(chat, ids) if request.logprobs or request.stream else [],
            top_logprobs=[
                [(chat.decode([token]), logprob) for token, logprob in step]
                for step in out.top_logprobs or []
            ],
            prompt_tokens=len(prompt),
            weight_version=out.weight_version,
            segment=segment.index,
        )

    async def _generate(
        self, prompt: list[int], params: SamplingParams, top_logprobs: int
    ) -> GenerateOutput:
        """The engine's reply, sampled again while a sync aborts it (`on_abort`)."""
        deadline = time.monotonic() + self.hold_s
        pause = 0.05
        while True:
            if top_logprobs:
                out = await self.engine.generate(prompt, params, top_logprobs=top_logprobs)
            else:
                out = await self.engine.generate(prompt, params)
            if out.finish_reason != "abort":
                return out
            self.aborted_attempts += 1
            if self.on_abort == "retry_after" or time.monotonic() + pause > deadline:
                raise EngineAborted("the engine aborted the request (a weight sync?); retry it")
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    def _params(
        self,
        request: ChatCompletionRequest,
        chat: ChatFormat,
        seed: int | None,
        room: int,
        replies: int,
    ) -> SamplingParams:
        """The engine's sampling for a reply: the request's, or the rollout's (`sampling`)."""
        wanted = request.max_new_tokens or self.max_new_tokens
        rollout = self.sampling
        if rollout is None:
            return SamplingParams(
                max_new_tokens=min(wanted, room),
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                stop=request.stop_list or None,
                stop_token_ids=list(chat.stop_token_ids),
                seed=seed,
            )
        return rollout.model_copy(
            update={
                "max_new_tokens": min(wanted, rollout.max_new_tokens, room),
                "stop": [*(rollout.stop or []), *request.stop_list] or None,
                "stop_token_ids": sorted({*(rollout.stop_token_ids or []), *chat.stop_token_ids}),
                "seed": turn_seed(rollout.seed, replies),
            }
        )

    @staticmethod
    def _reply(text: str, *, parse: bool) -> tuple[str, list[dict[str, Any]]]:
        """The turn's `content` and OpenAI `tool_calls` (module docstring)."""
        if not parse:
            return text, []
        parsed = parse_tool_calls(text)
        if not parsed.calls or parsed.errors:
            return text, []
        content = text
        calls = []
        for call in parsed.calls:
            content = content.replace(call.raw, "", 1)
            arguments = json.dumps(call.arguments or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": "call_" + secrets.token_hex(12),
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            )
        return content.strip(), calls
