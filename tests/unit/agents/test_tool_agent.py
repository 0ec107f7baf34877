"""ToolAgent's loop: its loss mask over generated tool-using episodes, and its stop reasons."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniloop import Task, ToolAgent, ToolContext, tool
from omniloop.agents.base import EpisodeEnd, Session
from omniloop.agents.chat import ChatFormat
from omniloop.inference.base import SamplingParams

LOOKALIKES = ["<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", "</tool_response>", "\n\n"]


@tool
def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: What to return.
    """
    return text


@tool
async def shout(text: str) -> str:
    """Return the text in capitals, twice, with look-alike special tokens around it.

    Args:
        text: What to shout.
    """
    return f"<|im_end|>{text.upper()}<tool_call>{text.upper()}"


def call_text(name: str, text: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {'text': text}})}\n</tool_call>"


plain = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co", "Cc")))
payload = st.lists(st.one_of(plain, st.sampled_from(LOOKALIKES)), max_size=5).map("".join)


@given(data=st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_tool_agent_mask_is_exactly_the_sampled_tokens(tokenizer, scripted_engine_cls, data):
    agent = ToolAgent([echo, shout], system_prompt="Use tools.")
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    end = chat.stop_token_ids[0]
    n_tool_turns = data.draw(st.integers(7, 10), label="tool turns")
    replies, expected_outputs = [], []
    for _ in range(n_tool_turns):
        calls = data.draw(
            st.lists(
                st.tuples(st.sampled_from(["echo", "shout", "nope"]), payload),
                min_size=1,
                max_size=3,
            )
        )
        think = data.draw(st.sampled_from(["", "<think>let me see</think>\n"]))
        text = think + "".join(call_text(name, arg) for name, arg in calls)
        replies.append(
            [*tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True), end]
        )
        for name, arg in calls:
            expected_outputs.append(
                {"echo": arg, "shout": f"<|im_end|>{arg.upper()}<tool_call>{arg.upper()}"}.get(name)
            )
    answer = tokenizer.encode("The answer is 4.", add_special_tokens=False)
    replies.append([*answer, end])
    engine = scripted_engine_cls(replies)
    task = Task(id="t", prompt=data.draw(payload, label="prompt"))
    session = Session(
        engine,
        chat,
        agent.opening(task),
        sampling=SamplingParams(max_new_tokens=4096),
        max_turns=n_tool_turns + 1,
        max_context=1_000_000,
    )
    context = ToolContext(task=task.model_dump(), episode_id="t/0")
    asyncio.run(agent.run(task, session, context))

    ids, mask = session.builder.input_ids, session.builder.loss_mask
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [t for r in replies for t in r]
    for prompt in engine.prompts:
        assert ids[: len(prompt)] == prompt
    records = context.state["tool_calls"]
    assert len(records) == len(expected_outputs)
    for record, expected in zip(records, expected_outputs, strict=True):
        if expected is None:
            assert record.error == "unknown_tool"
        else:
            assert record.error is None
            assert record.output == expected
    # Every tool result reached the model as plain text: the decoded stream holds it verbatim,
    # and special tokens appear only as template glue (one <|im_end|> per message).
    decoded = chat.decode(ids)
    for record in records:
        assert record.output in decoded
    n_messages = len(session.messages)
    assert ids.count(end) == n_messages
    assert session.final_response() == "The answer is 4."


def test_tool_timeouts_end_the_episode_with_tool_timeout(tokenizer, scripted_engine_cls):
    @tool(timeout=0.05)
    async def slow() -> str:
        """Never finishes in time."""
        await asyncio.sleep(5)
        return "late"

    agent = ToolAgent([slow], max_tool_timeouts=2)
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    call = tokenizer.encode('<tool_call>{"name": "slow", "arguments": {}}</tool_call>')
    engine = scripted_engine_cls([[*call, chat.stop_token_ids[0]]] * 4)
    task = Task(id="t", prompt="go")
    session = Session(
        engine, chat, agent.opening(task), sampling=SamplingParams(), max_turns=8, max_context=8192
    )
    context = ToolContext(task={}, episode_id="t/0")
    with pytest.raises(EpisodeEnd) as ended:
        asyncio.run(agent.run(task, session, context))
    assert ended.value.reason == "tool_timeout"
    assert session.num_turns == 2
    assert [r.error for r in context.state["tool_calls"]] == ["tool_timeout", "tool_timeout"]


def test_prefill_is_part_of_the_turn_text_but_not_of_the_loss(tokenizer, scripted_engine_cls):
    prefill = '<tool_call>\n{"name": "echo", "arguments": {"text": "'
    agent = ToolAgent([echo], prefill=prefill)
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    rest = tokenizer.encode('hi"}}\n</tool_call>', add_special_tokens=False)
    final = tokenizer.encode("done", add_special_tokens=False)
    engine = scripted_engine_cls(
        [[*rest, chat.stop_token_ids[0]], [*final, chat.stop_token_ids[0]]]
    )
    task = Task(id="t", prompt="say hi")
    session = Session(
        engine, chat, agent.opening(task), sampling=SamplingParams(), max_turns=4, max_context=8192
    )
    context = ToolContext(task={}, episode_id="t/0")
    asyncio.run(agent.run(task, session, context))
    assert [r.output for r in context.state["tool_calls"]] == ["hi"]
    ids, mask = session.builder.input_ids, session.builder.loss_mask
    prefill_ids = tokenizer.encode(prefill, add_special_tokens=False)
    start = session.turns[0].start
    assert ids[start - len(prefill_ids) : start] == prefill_ids
    assert not any(mask[start - len(prefill_ids) : start])
    assert session.messages[-3]["content"].startswith(prefill)
