"""The agent boundary: `Task`, the `Agent` protocol, and the token-level `Session`.

An agent drives one episode through its `Session`: `generate()` samples an assistant turn from
the engine and `add_observation()` appends what the environment says back. The session owns the
token stream (a `TrajectoryBuilder`), so an agent cannot get the loss mask wrong: sampled ids go
in verbatim with mask 1, everything else with mask 0. Limits (`max_turns`, the context length)
are enforced here by raising `EpisodeEnd`, which the rollout turns into the stop reason.
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from omniloop.agents.chat import ChatFormat, Message
from omniloop.agents.media import EpisodeMedia
from omniloop.inference.base import Engine, SamplingParams
from omniloop.modalities.media import MediaData
from omniloop.trajectory import StopReason, TrajectoryBuilder, TurnRecord


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn` (0-based) of an episode whose seed is `seed`.

    Every turn of an episode gets its own seed, so turns draw independent random numbers (with
    one seed for all, every turn would replay the same draws), and the same episode seed gives
    the same per-turn seeds in every run. The value is a 32-bit unsigned integer (a blake2b hash
    of both), within what every engine accepts. None stays None: the engine picks a fresh seed.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class Task(BaseModel):
    """One unit of work for an agent, as read from a JSONL task set."""

    model_config = ConfigDict(extra="forbid")

    id: str
    """Stable id of the task (episode ids derive from it)."""
    prompt: str | list[dict[str, Any]]
    """The user's request, or a whole list of chat messages."""
    answer: Any = None
    """The reference answer, for rewards that need one."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything else the agent, tools or rewards need."""

    @field_serializer("prompt")
    def _media_inline(self, prompt: str | list[dict[str, Any]]) -> Any:
        # Media given as bytes (or `MediaData`) are written as `data:` URIs, so a task always
        # dumps to JSON and reads back the same media.
        if isinstance(prompt, str):
            return prompt
        return [
            {**m, "content": [_inline(p) for p in m["content"]]}
            if isinstance(m.get("content"), list)
            else m
            for m in prompt
        ]

    def messages(self, system_prompt: str | None = None) -> list[Message]:
        """The opening chat messages: an optional system prompt, then the prompt."""
        opening: list[Message] = (
            [{"role": "system", "content": system_prompt}] if system_prompt else []
        )
        if isinstance(self.prompt, str):
            return [*opening, {"role": "user", "content": self.prompt}]
        has_system = any(m.get("role") == "system" for m in self.prompt)
        return [*([] if has_system else opening), *self.prompt]


def _inline(part: Any) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    source = part.get(kind) if isinstance(kind, str) else None
    if isinstance(source, MediaData):
        source = source.data
    if not isinstance(source, bytes):
        return part
    return {
        **part,
        kind: "data:application/octet-stream;base64," + base64.b64encode(source).decode(),
    }


class EpisodeEnd(Exception):
    """Raised by a `Session` when a limit ends the episode; carries the stop reason."""

    def __init__(self, reason: StopReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: StopReason = reason


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the agent sees it."""

    text: str
    """Prefill (if any) plus the sampled text, without the end-of-turn token."""
    token_ids: list[int]
    """The sampled ids, verbatim."""
    finish_reason: str
    """`stop` or `length`."""


class Session:
    """The token-level conversation of one episode with one engine."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        messages: list[Message],
        *,
        sampling: SamplingParams,
        max_turns: int,
        max_context: int,
        media: EpisodeMedia | None = None,
    ) -> None:
        """`media` resolves media parts of messages (None: text only, and a media part is a
        `ConfigError`); an unusable item in `messages` raises `MediaError`."""
        self.engine = engine
        self.chat = chat
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_context = max_context
        self.media = media
        if media is not None:
            messages = media.prepare(messages, strict=True)
        self.messages: list[Message] = [dict(m) for m in messages]
        prompt = chat.prompt_ids(messages)
        if media is not None:
            media.place(prompt, 0)
        self.builder = TrajectoryBuilder(prompt)
        self.turns: list[TurnRecord] = []
        self.neutralised = 0
        """Sampled media placeholder ids replaced by a text id (module docstring)."""
        self.metrics: dict[str, float] = {}
        """Counters the agent adds to the trajectory's `meta.metrics`."""
        self._closed = True  # whether the last assistant turn ended with its end-of-turn token

    @property
    def num_turns(self) -> int:
        """Assistant turns sampled so far."""
        return len(self.turns)

    async def generate(self, *, prefill: str = "") -> Turn:
        """Sample the next assistant turn.

        `prefill` is text placed at the start of the turn as if the model had written it; its
        tokens are mask 0 (the policy did not sample them) and it is part of `Turn.text`.
        The request's seed is `turn_seed(sampling.seed, turn)`: each turn samples independently,
        reproducibly from the episode's seed. Raises `EpisodeEnd` when `max_turns` is reached
        or no context is left.
        """
        if len(self.turns) >= self.max_turns:
            raise EpisodeEnd("max_turns", f"{self.max_turns} turns")
        if prefill:
            self.builder.add_observation(
                self.chat.tokenizer.encode(
                    prefill, add_special_tokens=False, split_special_tokens=True
                )
            )
        room = self.max_context - len(self.builder)
        if room <= 0:
            raise EpisodeEnd("context_limit", f"{len(self.builder)} tokens")
        max_new = min(self.sampling.max_new_tokens, room)
        params = self.sampling.model_copy(
            update={
                "seed": turn_seed(self.sampling.seed, len(self.turns)),
                "max_new_tokens": max_new,
                "stop_token_ids": sorted(
                    {*(self.sampling.stop_token_ids or []), *self.chat.stop_token_ids}
                ),
            }
        )
        started = time.perf_counter()
        if self.media is not None and self.media.items:
            out = await self.engine.generate(list(self.builder.input_ids), params, self.media.items)
        else:
            out = await self.engine.generate(list(self.builder.input_ids), params)
        elapsed = time.perf_counter() - started
        start = len(self.builder)
        self.builder.add_sampled(out.output_ids, out.output_logprobs, out.weight_versions)
        self._neutralise(start)
        self.turns.append(
            TurnRecord(
                start=start,
                num_sampled=len(out.output_ids),
                finish_reason=out.finish_reason,
                weight_version=out.weight_version,
                generate_seconds=elapsed,
            )
        )
        self._closed = bool(out.output_ids) and self.chat.is_closing(out.output_ids[-1])
        content_ids = out.output_ids[:-1] if self._closed else out.output_ids
        text = prefill + self.chat.decode(content_ids)
        self.messages.append({"role": "assistant", "content": text})
        if out.finish_reason == "length":
            reason: StopReason = (
                "context_limit" if max_new < self.sampling.max_new_tokens else "length"
            )
            raise EpisodeEnd(reason, f"turn {len(self.turns)} hit {max_new} new tokens")
        if out.finish_reason == "abort":
            raise EpisodeEnd("engine_error", "the engine aborted the request")
        return Turn(text=text, token_ids=list(out.output_ids), finish_reason=out.finish_reason)

    def add_observation(self, messages: list[Message]) -> None:
        """Append environment messages (tool results, user follow-ups) and the next generation
        prompt. Raises `EpisodeEnd('context_limit')` if they would not leave room to answer."""
        if self.media is not None:
            messages = self.media.prepare(messages, strict=False)
        ids = self.chat.observation_ids(messages, closed=self._closed)
        if len(self.builder) + len(ids) >= self.max_context:
            raise EpisodeEnd("context_limit", f"observation of {len(ids)} tokens does not fit")
        if self.media is not None:
            self.media.place(ids, len(self.builder))
        self.builder.add_observation(ids)
        if self.turns:
            last = self.turns[-1]
            self.turns[-1] = last.model_copy(
                update={"num_observation": last.num_observation + len(ids)}
            )
        self.messages.extend(dict(m) for m in messages)
        self._closed = True

    def adopt(
        self, builder: TrajectoryBuilder, turns: list[TurnRecord], messages: list[Message]
    ) -> None:
        """Take a conversation recorded elsewhere as this session's: its tokens (`builder`,
        used as it is), its turns, and its messages (the last assistant one is the final
        response). For agents whose turns are sampled outside the session (the gateway's)."""
        self.builder = builder
        self.turns = list(turns)
        self.messages = [dict(m) for m in messages]

    def _neutralise(self, start: int) -> None:
        """Replace media placeholder ids the model sampled (from `start` on) by the tokenizer's
        unknown-token id, out of the loss: no media stands behind them, so fed back as they
        are they would break the next prompt's blocks (the processor counts placeholders), and
        the replacement was not sampled, so it is not trained."""
        placeholders = self.media.placeholder_ids() if self.media is not None else frozenset()
        if not placeholders:
            return
        for i in range(start, len(self.builder)):
            if self.builder.input_ids[i] in placeholders:
                self.builder.replace_sampled(i, self._neutral_id)
                self.neutralised += 1

    @property
    def _neutral_id(self) -> int:
        tok = self.chat.tokenizer
        for candidate in (tok.unk_token_id, tok.pad_token_id, tok.eos_token_id):
            if isinstance(candidate, int):
                return candidate
        return 0

    def final_response(self) -> str:
        """Text of the last assistant turn ('' if none)."""
        for message in reversed(self.messages):
            if message["role"] == "assistant":
                return str(message["content"])
        return ""


class Agent(Protocol):
    """What users write: the opening of an episode and its loop over a `Session`.

    `tool_schemas` (may be empty) is what the chat template shows the model; `opening` gives
    the first messages; `run` drives the episode through `session` and returns when it is done
    (limits end it by `EpisodeEnd`). `context` is the episode's `ToolContext` (its sandbox,
    task, id and a scratch `state` dict).
    """

    tool_schemas: list[dict[str, Any]]

    def opening(self, task: Task) -> list[Message]:
        """The first chat messages of an episode on `task`."""
        ...

    async def run(self, task: Task, session: Session, context: Any) -> None:
        """Drive the episode."""
        ...
