"""The gateway over the real tiny engine (HTTP), driven by the official `openai` client.

What must hold:
- the SDK lists the model and gets completions in OpenAI's shapes, with the sampled ids;
- a multi-turn conversation sent by the SDK (history resent every call) is recorded as the
  in-process `Session` records the same turns with the same seeds: same ids and mask, logprobs
  within 1e-5; the session reads back as a trajectory;
- streaming gives the same ids and text as a non-streaming call with the same seed;
- a wrong key is a 401, a field the gateway cannot honour a 400 naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from omniloop.agents.base import Session, turn_seed
from omniloop.agents.chat import ChatFormat
from omniloop.gateway.app import SESSION_HEADER, serve_gateway
from omniloop.gateway.completions import Gateway
from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.inference.models import load_tokenizer

TOKEN = "gateway-test-token-0123456789"
MAX_CONTEXT = 512


@pytest.fixture
async def gateway_url(tiny_engine_url: str) -> AsyncIterator[str]:
    async with EngineClient(tiny_engine_url) as engine:
        gateway = Gateway(engine, load_tokenizer("tiny"), model="tiny", max_context=MAX_CONTEXT)
        async with serve_gateway(gateway, token=TOKEN) as url:
            yield url


def sdk(url: str, session: str | None = None, key: str = TOKEN) -> openai.AsyncOpenAI:
    base = f"{url}/v1/sessions/{session}" if session else f"{url}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)


async def session_view(url: str, session: str) -> dict[str, Any]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        response = await http.get(f"{url}/v1/sessions/{session}")
    assert response.status_code == 200, response.text
    view: dict[str, Any] = response.json()
    return view


async def test_the_sdk_lists_the_model_and_gets_a_completion_with_its_ids(
    gateway_url: str,
) -> None:
    async with sdk(gateway_url) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8,
            seed=3, logprobs=True,
        )  # fmt: skip
    completion = raw.parse()
    session = raw.headers[SESSION_HEADER]
    (choice,) = completion.choices
    ids = choice.model_extra["token_ids"]
    assert 1 <= len(ids) <= 8
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(ids)
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    sampled = [entry.logprob for entry in choice.logprobs.content]
    view = await session_view(gateway_url, session)
    (trajectory,) = view["trajectories"]
    assert trajectory["input_ids"][-len(ids) :] == ids
    assert trajectory["rollout_logprobs"][-len(ids) :] == sampled
    assert trajectory["loss_mask"][-len(ids) :] == [1] * len(ids)
    assert (
        trajectory["input_ids"][: completion.usage.prompt_tokens]
        == trajectory["input_ids"][: trajectory["prompt_length"]]
    )


async def test_a_conversation_resent_by_the_sdk_is_recorded_as_the_session_records_it(
    gateway_url: str, tiny_engine_url: str
) -> None:
    follow_ups = ["Tell me more.", "And then?"]
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    seed = 11
    # The in-process agent loop, straight to the engine.
    async with EngineClient(tiny_engine_url) as engine:
        session = Session(
            engine, ChatFormat(load_tokenizer("tiny")), opening,
            sampling=SamplingParams(max_new_tokens=12, seed=seed), max_turns=3,
            max_context=MAX_CONTEXT,
        )  # fmt: skip
        for turn in range(3):
            with contextlib.suppress(Exception):  # a turn cut at max_new_tokens ends it
                await session.generate()
            if turn < 2:
                session.add_observation([{"role": "user", "content": follow_ups[turn]}])
    reference = session.builder
    # The same conversation through the gateway, as an SDK client writes it.
    messages: list[dict[str, Any]] = [dict(m) for m in opening]
    async with sdk(gateway_url, "conv-1") as client:
        for turn in range(3):
            completion = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, seed=turn_seed(seed, turn)
            )  # type: ignore[call-overload]
            messages.append(completion.choices[0].message.model_dump(exclude_none=True))
            if turn < 2:
                messages.append({"role": "user", "content": follow_ups[turn]})
    view = await session_view(gateway_url, "conv-1")
    assert view["prefix_stability"] == 1.0
    assert view["resent_calls"] == view["stable_calls"] == 2
    (trajectory,) = view["trajectories"]
    assert trajectory["input_ids"] == reference.input_ids
    assert trajectory["loss_mask"] == reference.loss_mask
    assert trajectory["rollout_logprobs"] == pytest.approx(reference.rollout_logprobs, abs=1e-5)
    assert trajectory["meta"]["episode_id"] == "conv-1"
    assert len(trajectory["meta"]["turns"]) == 3


async def test_streaming_gives_the_ids_and_text_of_a_plain_call(gateway_url: str) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    async with sdk(gateway_url) as client:
        plain = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, seed=21
        )  # type: ignore[call-overload]
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, seed=21, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        texts, ids, finish, usage = [], [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts.append(choice.delta.content or "")
                ids += (choice.model_extra or {}).get("token_ids", [])
                finish = choice.finish_reason or finish
    assert ids == plain.choices[0].model_extra["token_ids"]
    assert "".join(texts) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage is not None
    assert usage.completion_tokens == len(ids)


async def test_top_logprobs_are_the_engines_most_likely_tokens(gateway_url: str) -> None:
    messages = [{"role": "user", "content": "Count: one, two,"}]
    asked: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "logprobs": True}
    async with sdk(gateway_url) as client:
        greedy = await client.chat.completions.create(
            model="tiny", messages=messages, top_logprobs=3, **asked
        )  # type: ignore[call-overload]
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, top_logprobs=3, stream=True, **asked
        )  # type: ignore[call-overload]
        streamed = [
            entry for chunk in [c async for c in stream] for choice in chunk.choices
            if choice.logprobs is not None for entry in choice.logprobs.content or []
        ]  # fmt: skip
    choice = greedy.choices[0]
    assert choice.logprobs is not None
    entries = choice.logprobs.content or []
    assert len(entries) == len(choice.model_extra["token_ids"]) > 0
    for entry in entries:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3
        assert tops == sorted(tops, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    assert [e.top_logprobs for e in streamed] == [e.top_logprobs for e in entries]


async def test_a_wrong_key_and_an_unsupported_field_are_refused(gateway_url: str) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    async with sdk(gateway_url, key="not-the-token") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[call-overload]
    async with sdk(gateway_url) as client:
        with pytest.raises(openai.BadRequestError, match="presence_penalty is not supported"):
            await client.chat.completions.create(
                model="tiny", messages=messages, presence_penalty=0.5
            )  # type: ignore[call-overload]
        with pytest.raises(openai.BadRequestError, match=r"max_context is 512"):
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "word " * 600}]
            )  # type: ignore[call-overload]
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        missing = await http.get(f"{gateway_url}/v1/sessions/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


async def metric(http: httpx.AsyncClient, engine_url: str, name: str) -> float:
    text = (await http.get(f"{engine_url}/metrics")).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name)))


async def test_a_sync_that_aborts_a_running_call_does_not_fail_the_client(
    gateway_url: str, tiny_engine_url: str
) -> None:
    """The engine pauses in SGLang's `abort` mode while the call is decoding: the engine
    answers it aborted, the gateway samples it again once generation continues, and the
    client gets a complete reply."""
    aborted = 'omniloop_engine_requests_total{finish="abort"}'
    running = "omniloop_engine_running_requests"
    async with httpx.AsyncClient(timeout=60) as http, sdk(gateway_url, "synced") as client:
        before = await metric(http, tiny_engine_url, aborted)
        call = asyncio.create_task(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=400, seed=9,
            )  # type: ignore[call-overload]
        )  # fmt: skip
        while await metric(http, tiny_engine_url, running) < 1:
            assert not call.done(), "the call ended before the engine ran it"
            await asyncio.sleep(0.005)
        await http.post(f"{tiny_engine_url}/pause_generation", json={"mode": "abort"})
        await asyncio.sleep(0.3)
        assert not call.done()  # held: the new attempt waits for the sync to end
        await http.post(f"{tiny_engine_url}/continue_generation", json={})
        completion = await call
        assert await metric(http, tiny_engine_url, aborted) >= before + 1
    ids = completion.choices[0].model_extra["token_ids"]
    view = await session_view(gateway_url, "synced")
    (trajectory,) = view["trajectories"]
    assert trajectory["input_ids"][-len(ids) :] == ids
    assert sum(trajectory["loss_mask"]) == len(ids)
