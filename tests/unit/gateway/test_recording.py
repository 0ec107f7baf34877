"""The gateway's recording against the in-process agent loop, with a scripted engine.

The engine here is a fake that returns scripted ids (this is a unit test of `gateway`); the
tokenizer and chat template are the real tiny model's. What must hold:
- an OpenAI-style client that resends its whole history each call gets recorded exactly the
  trajectory the in-process `Session` records for the same sampled ids: ids, mask and
  logprobs, over generated conversations with several tool calls per turn, thinking blocks,
  odd whitespace, unicode and special-token look-alikes in tool output; 100 % prefix-stable;
- a retried call, a second choice, and new messages after an earlier turn fork a segment
  whose copied tokens are out of the loss; an edited history starts a fresh segment, counted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniloop.agents.base import Session
from omniloop.agents.chat import ChatFormat
from omniloop.gateway.app import create_gateway_app
from omniloop.gateway.completions import Choice, Gateway
from omniloop.gateway.openai_wire import ChatCompletionRequest, hermes_call
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.models import load_tokenizer
from omniloop.modalities.media import MediaData
from omniloop.tools import parse_tool_calls

TOKENIZER = load_tokenizer("tiny")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]
CHAT = ChatFormat(TOKENIZER, TOOLS)
END = CHAT.stop_token_ids[0]
ABORT = "<aborted by a sync>"
"""A scripted turn starting with this is answered as an aborted request (partial output)."""


class ScriptedEngine:
    """Returns the scripted turns in order, each as its ids plus the end-of-turn token."""

    def __init__(self, turns: Sequence[str]) -> None:
        self.turns = list(turns)
        self.prompts: list[list[int]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, media: Sequence[MediaData] = ()
    ) -> GenerateOutput:
        self.prompts.append(list(input_ids))
        text = self.turns.pop(0)
        aborted = text.startswith(ABORT)
        ids = TOKENIZER.encode(text.removeprefix(ABORT), add_special_tokens=False)
        ids += [] if aborted else [END]
        logprobs = [-(i % 7) / 10 - 0.05 for i in range(len(ids))]
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=logprobs,
            finish_reason="abort" if aborted else "stop",
            weight_version=3,
            weight_versions=[3] * len(ids),
        )


def request(messages: list[dict[str, Any]], **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny", messages=messages, tools=TOOLS, **fields)


def tool_outputs(turn: str, outputs: list[str]) -> list[str]:
    calls = parse_tool_calls(turn).calls
    return [outputs[i % len(outputs)] + f" #{i}" for i in range(len(calls))]


async def in_process(opening: list[dict[str, Any]], turns: list[str], outputs: list[str]) -> Any:
    """What the in-process agent loop records for these turns and tool outputs."""
    session = Session(
        ScriptedEngine(turns), CHAT, opening, sampling=SamplingParams(max_new_tokens=512),
        max_turns=len(turns), max_context=8192,
    )  # fmt: skip
    for _ in turns:
        turn = await session.generate()
        results = tool_outputs(turn.text, outputs)
        if not results:
            break
        session.add_observation([{"role": "tool", "content": r} for r in results])
    return session.builder


async def through_gateway(
    opening: list[dict[str, Any]], turns: list[str], outputs: list[str]
) -> tuple[Gateway, list[Choice]]:
    """An OpenAI-style client: resends its whole history every call."""
    gateway = Gateway(ScriptedEngine(turns), TOKENIZER, model="tiny", max_context=8192)
    messages = [dict(m) for m in opening]
    choices = []
    for turn in turns:
        (choice,) = await gateway.complete(request(messages, max_tokens=512), "s")
        choices.append(choice)
        messages.append(
            {"role": "assistant", "content": choice.content, "tool_calls": choice.tool_calls}
        )
        results = tool_outputs(turn, outputs)
        if not results:
            break
        assert len(choice.tool_calls) == len(results)
        for call, result in zip(choice.tool_calls, results, strict=True):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return gateway, choices


WORDS = st.text(
    alphabet=st.sampled_from(list("abc xyz\n\t  é中🙂<>/|{}\"'\\_")), min_size=0, max_size=12
)
LOOK_ALIKES = st.sampled_from(
    ["<|im_end|>", "<tool_call>", "</tool_call>", "<|im_start|>user", "<think>", "\u2063", ""]
)


@st.composite
def turn_texts(draw: st.DrawFn, last: bool) -> str:
    pieces = []
    if draw(st.booleans()):
        pieces.append(f"<think>{draw(WORDS)}</think>")
    pieces.append(draw(WORDS))
    calls = 0 if last else draw(st.integers(1, 3))
    for _ in range(calls):
        arguments = {"word": draw(WORDS) + draw(LOOK_ALIKES)}
        pieces.append(hermes_call("lookup", arguments))
        pieces.append(draw(st.sampled_from(["", "\n", " ", "\n\n"])))
    return "".join(pieces)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    n = draw(st.integers(1, 4))
    turns = [draw(turn_texts(last=i == n - 1)) for i in range(n)]
    outputs = [draw(WORDS) + draw(LOOK_ALIKES) + draw(WORDS) for _ in range(3)]
    opening = [{"role": "user", "content": draw(WORDS) + "?"}]
    if draw(st.booleans()):
        opening.insert(0, {"role": "system", "content": draw(WORDS)})
    return opening, turns, outputs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_a_resending_client_records_what_the_agent_loop_records(
    conversation: tuple[list[dict[str, Any]], list[str], list[str]],
) -> None:
    opening, turns, outputs = conversation
    reference = asyncio.run(in_process(opening, turns, outputs))
    gateway, _ = asyncio.run(through_gateway(opening, turns, outputs))
    recording = gateway.recording("s")
    assert recording is not None
    assert recording.prefix_stability == 1.0
    assert recording.fresh_segments == 0
    (segment,) = recording.segments
    assert segment.builder.input_ids == reference.input_ids
    assert segment.builder.loss_mask == reference.loss_mask
    assert segment.builder.rollout_logprobs == reference.rollout_logprobs
    assert segment.builder.weight_version == reference.weight_version


def test_tool_calls_come_back_as_openai_calls_and_their_text_as_content() -> None:
    turn = "<think>hm</think>Let me look. " + hermes_call("lookup", {"word": "a\u00e9"})
    _, (choice,) = asyncio.run(through_gateway([{"role": "user", "content": "?"}], [turn], ["r"]))
    assert choice.finish_reason == "tool_calls"
    assert choice.content == "<think>hm</think>Let me look."
    (call,) = choice.tool_calls
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"word": "a\u00e9"}
    assert choice.token_ids[-1] == END
    assert CHAT.decode(choice.token_ids[:-1]) == turn


def test_a_malformed_call_stays_text() -> None:
    turn = 'Trying <tool_call>{"name": "lookup", "arguments": </tool_call>'
    gateway = Gateway(ScriptedEngine([turn]), TOKENIZER, model="tiny")
    (choice,) = asyncio.run(gateway.complete(request([{"role": "user", "content": "?"}]), "s"))
    assert choice.tool_calls == []
    assert choice.content == turn
    assert choice.finish_reason == "stop"


async def _conversation_with(gateway: Gateway, session: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "first?"}]
    (choice,) = await gateway.complete(request(messages), session)
    reply = {"role": "assistant", "content": choice.content, "tool_calls": choice.tool_calls}
    messages += [reply, {"role": "tool", "content": "result"}]
    await gateway.complete(request(messages), session)
    return messages


def test_a_retry_forks_and_the_copied_turns_stay_out_of_the_loss() -> None:
    turns = [hermes_call("lookup", {"word": "x"}), "done", "again"]
    gateway = Gateway(ScriptedEngine(turns), TOKENIZER, model="tiny")
    messages = asyncio.run(_conversation_with(gateway, "s"))
    # The client retries its second call: the same history again.
    asyncio.run(gateway.complete(request(messages), "s"))
    recording = gateway.recording("s")
    assert recording is not None
    first, retry = recording.segments
    assert retry.parent == 0
    cut = first.points[-2].tokens  # where the second call's generation started
    assert retry.builder.input_ids[:cut] == first.builder.input_ids[:cut]
    assert not any(retry.builder.loss_mask[:cut])
    assert all(retry.builder.loss_mask[cut:])
    assert recording.prefix_stability == 1.0


def test_n_choices_are_segments_of_one_prompt() -> None:
    gateway = Gateway(ScriptedEngine(["one", "two", "three"]), TOKENIZER, model="tiny")
    choices = asyncio.run(
        gateway.complete(request([{"role": "user", "content": "?"}], n=3, seed=5), "s")
    )
    assert [c.index for c in choices] == [0, 1, 2]
    assert [c.segment for c in choices] == [0, 1, 2]
    recording = gateway.recording("s")
    assert recording is not None
    prompts = {tuple(s.builder.input_ids[: s.points[0].tokens]) for s in recording.segments}
    assert len(prompts) == 1


def test_new_messages_after_an_earlier_turn_branch_from_it() -> None:
    turns = [hermes_call("lookup", {"word": "x"}), "done", "other branch"]
    engine = ScriptedEngine(turns)
    gateway = Gateway(engine, TOKENIZER, model="tiny")
    messages = asyncio.run(_conversation_with(gateway, "s"))
    branched = [*messages[:2], {"role": "tool", "content": "a different result"}]
    asyncio.run(gateway.complete(request(branched), "s"))
    recording = gateway.recording("s")
    assert recording is not None
    first, branch = recording.segments
    turn_end = first.points[1].tokens
    assert branch.builder.input_ids[:turn_end] == first.builder.input_ids[:turn_end]
    assert engine.prompts[-1][:turn_end] == first.builder.input_ids[:turn_end]
    assert recording.stable_calls == recording.resent_calls == 2


def test_an_edited_history_starts_a_fresh_segment_and_is_counted() -> None:
    turns = [hermes_call("lookup", {"word": "x"}), "done", "after the edit"]
    gateway = Gateway(ScriptedEngine(turns), TOKENIZER, model="tiny")
    messages = asyncio.run(_conversation_with(gateway, "s"))
    edited = [dict(m) for m in messages]
    edited[1] = {"role": "assistant", "content": "I summarised the call."}
    asyncio.run(gateway.complete(request(edited), "s"))
    recording = gateway.recording("s")
    assert recording is not None
    assert len(recording.segments) == 2
    fresh = recording.segments[1]
    assert fresh.parent is None
    assert recording.fresh_segments == 1
    assert recording.prefix_stability == 0.5
    # The edited history is context: nothing in it is trained.
    assert not any(fresh.builder.loss_mask[: fresh.points[0].tokens])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"tool_choice": "required"}, "tool_choice 'required' is not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty is not supported"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ],
)
def test_fields_the_gateway_cannot_honour_are_refused_by_name(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        request([{"role": "user", "content": "?"}], **fields)


def test_ignored_fields_are_accepted() -> None:
    body = request([{"role": "user", "content": "?"}], user="u", store=False, metadata={"a": "b"})
    assert body.n == 1


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "robot", "content": "x"}, "role 'robot' is not one of"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "'image_url' is not supported"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "arguments is not JSON",
        ),
    ],
)
def test_messages_the_gateway_cannot_render_are_refused_by_index(
    message: dict[str, Any], error: str
) -> None:
    gateway = Gateway(ScriptedEngine(["x"]), TOKENIZER, model="tiny")
    body = request([{"role": "user", "content": "?"}, message])
    with pytest.raises(ValueError, match=rf"messages\[1\]: .*{error}"):
        asyncio.run(gateway.complete(body, "s"))


def test_a_reply_aborted_by_a_sync_is_sampled_again_and_recorded_once() -> None:
    engine = ScriptedEngine([ABORT + "half a rep", "the whole reply"])
    gateway = Gateway(engine, TOKENIZER, model="tiny")
    (choice,) = asyncio.run(gateway.complete(request([{"role": "user", "content": "?"}]), "s"))
    assert choice.content == "the whole reply"
    assert gateway.aborted_attempts == 1
    assert len(engine.prompts) == 2
    assert engine.prompts[0] == engine.prompts[1]
    recording = gateway.recording("s")
    assert recording is not None
    (segment,) = recording.segments
    pairs = zip(segment.builder.input_ids, segment.builder.loss_mask, strict=True)
    assert CHAT.decode([t for t, m in pairs if m]) == "the whole reply<|im_end|>"


async def test_without_holding_an_aborted_call_is_a_429_with_retry_after() -> None:
    engine = ScriptedEngine([ABORT + "half", "unused"])
    gateway = Gateway(engine, TOKENIZER, model="tiny", on_abort="retry_after")
    app = create_gateway_app(gateway)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "?"}]}
        response = await http.post("/v1/sessions/s/chat/completions", json=body)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "engine_aborted"
    recording = gateway.recording("s")
    assert recording is not None
    assert recording.segments == []
