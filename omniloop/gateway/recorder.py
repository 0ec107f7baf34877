"""A gateway session's recording: token-exact trajectory segments, matched by message prefix.

An OpenAI client resends the whole conversation on every call. Rendering it again would drift
from the tokens the engine sampled (decode-then-encode is not the identity), so a session
keeps what it recorded: per segment, the conversation's messages in their canonical form
(`Canonical`: what the chat template renders of a message, nothing else) beside the token
ids, mask, logprobs and weight versions of a `TrajectoryBuilder`, and the points where a
generation started or an assistant turn ended.

A call's messages are matched against every segment (`SessionRecording.match`):
- **extend**: the messages are a segment's whole conversation plus new tool or user messages;
  only the new messages are rendered (`ChatFormat.observation_ids`), after the recorded ids.
- **fork**: they are a segment's conversation up to an earlier point (a retry of a call, a
  second choice of `n`, or new messages after an earlier assistant turn): a new segment starts
  as a copy of that segment's ids up to the point, with its mask cleared (those turns are
  trained in the segment they were sampled in, never twice).
- **fresh**: nothing matches (the first call, or a client that edited or compacted its
  history): a new segment starts from the messages rendered as a prompt; earlier turns are
  then context (mask 0), never re-tokenized as if they had been sampled.

Prefix stability is counted per call: a call that resends assistant messages is stable when
it extends or forks a recorded point.

Not thread-safe: the gateway serializes a session's calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from omniloop.agents.chat import Message
from omniloop.trajectory import TrajectoryBuilder, TurnRecord


@dataclass(frozen=True)
class Canonical:
    """What the chat template renders of one message: role, text, and tool calls."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    """(name, arguments as sorted-key JSON) per call."""


def canonical(message: Message) -> Canonical:
    """The canonical form of a message in omniloop's chat form (`content` a string, tool calls
    as `tool_calls: [{"name", "arguments": dict}]`)."""
    calls = tuple(
        (str(call["name"]), json.dumps(call["arguments"], sort_keys=True, ensure_ascii=False))
        for call in message.get("tool_calls") or ()
    )
    return Canonical(str(message["role"]), str(message.get("content") or ""), calls)


@dataclass(frozen=True)
class Point:
    """A place in a segment where a call may continue it."""

    kind: Literal["generation", "turn"]
    """`generation`: a generation prompt ends here (an assistant turn is next); `turn`: an
    assistant turn ends here."""
    messages: int
    """Messages of the conversation up to this point."""
    tokens: int
    """Tokens of the segment up to this point."""
    closed: bool = True
    """For a turn: whether it ended with the end-of-turn token."""


@dataclass
class Segment:
    """One token-exact trajectory of a session."""

    index: int
    tools_key: str
    """The tool list it was rendered with (a different list renders a different prompt)."""
    messages: list[Canonical]
    builder: TrajectoryBuilder
    points: list[Point]
    turns: list[TurnRecord] = field(default_factory=list)
    parent: int | None = None
    """The segment it was forked from."""

    def fork(self, index: int, point: Point) -> Segment:
        """A copy up to `point`, its mask cleared (its sampled tokens are trained here)."""
        builder = TrajectoryBuilder(self.builder.input_ids[: point.tokens])
        return Segment(
            index=index,
            tools_key=self.tools_key,
            messages=self.messages[: point.messages],
            builder=builder,
            points=[p for p in self.points if p.tokens <= point.tokens],
            parent=self.index,
        )


@dataclass(frozen=True)
class Match:
    """Where a call continues: `segment` at `point` (None: a fresh segment), with the
    messages to render after it."""

    segment: Segment | None
    point: Point | None
    new_messages: list[Message]
    fork: bool


def _common_prefix(a: list[Canonical], b: list[Canonical]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class SessionRecording:
    """Every segment of one session, and its prefix-stability counts."""

    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    resent_calls: int = 0
    """Calls whose messages hold assistant turns (a client resending history)."""
    stable_calls: int = 0
    """Resent calls that extended or forked a recorded point."""
    fresh_segments: int = 0
    """Segments started because no recorded prefix matched a resent history."""
    engine_calls: int = 0
    """Replies sampled (a call with `n` choices makes `n`)."""
    last_segment: int | None = None
    """The segment the latest reply was recorded in."""
    ended_by: str | None = None
    """Why the gateway last refused a call: `max_turns`, `context_limit` or `engine_error`."""

    def match(self, messages: list[Message], tools_key: str) -> Match:
        """Where `messages` (omniloop's chat form) continue this session (module docstring)."""
        wanted = [canonical(m) for m in messages]
        best: tuple[int, int, Match] | None = None  # (messages covered, extend first, match)
        for segment in self.segments:
            if segment.tools_key != tools_key:
                continue
            common = _common_prefix(wanted, segment.messages)
            for point in segment.points:
                covered = point.messages
                if covered > common:
                    continue
                rest = messages[covered:]
                if any(m["role"] == "assistant" for m in rest):
                    continue
                if point.kind == "generation" and rest:
                    continue
                if point.kind == "turn" and not rest:
                    continue
                at_end = point.tokens == len(segment.builder) and covered == len(segment.messages)
                candidate = Match(segment, point, rest, fork=not at_end)
                key = (covered, int(at_end))
                if best is None or key > best[:2]:
                    best = (*key, candidate)
        if best is None:
            return Match(None, None, messages, fork=False)
        return best[2]

    def count(self, messages: list[Message], match: Match) -> None:
        """Count one call and how it matched."""
        self.calls += 1
        if any(m["role"] == "assistant" for m in messages):
            self.resent_calls += 1
            if match.segment is not None:
                self.stable_calls += 1
            else:
                self.fresh_segments += 1

    @property
    def prefix_stability(self) -> float:
        """Share of resent calls that extended or forked a recorded point (1.0 if none)."""
        return self.stable_calls / self.resent_calls if self.resent_calls else 1.0

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "resent_calls": self.resent_calls,
            "stable_calls": self.stable_calls,
            "fresh_segments": self.fresh_segments,
            "segments": len(self.segments),
            "engine_calls": self.engine_calls,
            "prefix_stability": self.prefix_stability,
        }
