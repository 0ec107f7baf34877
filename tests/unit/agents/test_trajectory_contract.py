"""Property tests of the trajectory contract (DESIGN.md §2) over generated multi-turn episodes.

For any episode — many turns, odd whitespace, unicode, `<think>` blocks, tool output that looks
like special tokens, sampled ids that are not what the tokenizer would produce — the loss-mask-1
tokens are exactly the engine's sampled tokens in order, everything else is 0, every prompt the
engine saw is a prefix of the final token stream (nothing was re-tokenized), and decoding the
stream gives exactly the conversation the template renders. (Text is drawn from assigned,
non-private code points: the tokenizer itself maps unassigned ones to replacement bytes.)
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniloop.agents.base import EpisodeEnd, Session
from omniloop.agents.chat import ChatFormat
from omniloop.inference.base import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {"name": "python", "description": "Run code", "parameters": {"type": "object"}},
    }
]

LOOKALIKES = [
    "<|im_end|>",
    "<|im_start|>",
    "<tool_call>",
    "</tool_call>",
    "<|endoftext|>",
    "<think>",
]
odd_text = st.lists(
    st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co", "Cc")),
        st.sampled_from(["\n", "\t", "  ", "\r\n", "é", "日本", "🙂", "\u200b", " \n\n "]),
    ),
    max_size=40,
).map("".join)
# SmolLM2's special tokens are ids 0-16; every id above is plain text.
FIRST_PLAIN_ID = 17
VOCAB_SIZE = 49152
observation_text = st.lists(st.one_of(odd_text, st.sampled_from(LOOKALIKES)), max_size=6).map(
    "".join
)


@st.composite
def sampled_turn(draw, tokenizer, end_id: int) -> list[int]:
    """Sampled ids: either tokenized text (with <think>) or arbitrary non-special ids."""
    if draw(st.booleans()):
        text = draw(st.sampled_from(["", "<think>\n", "<think>hmm </think>"])) + draw(odd_text)
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    else:
        ids = draw(st.lists(st.integers(FIRST_PLAIN_ID, VOCAB_SIZE - 1), max_size=12))
    return [*ids, end_id]


@given(data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mask_one_tokens_are_exactly_the_sampled_tokens(tokenizer, scripted_engine_cls, data):
    chat = ChatFormat(tokenizer, TOOLS)
    end_id = chat.stop_token_ids[0]
    n_turns = data.draw(st.integers(8, 12), label="turns")
    replies = [data.draw(sampled_turn(tokenizer, end_id)) for _ in range(n_turns)]
    observations = [data.draw(observation_text) for _ in range(n_turns - 1)]
    user = data.draw(st.one_of(odd_text, observation_text), label="user prompt")
    engine = scripted_engine_cls(replies)
    opening = [{"role": "system", "content": "You solve tasks."}, {"role": "user", "content": user}]
    session = Session(
        engine,
        chat,
        opening,
        sampling=SamplingParams(max_new_tokens=4096),
        max_turns=n_turns,
        max_context=100_000,
    )

    async def episode() -> None:
        for turn in range(n_turns):
            await session.generate()
            if turn < n_turns - 1:
                session.add_observation([{"role": "tool", "content": observations[turn]}])

    asyncio.run(episode())
    traj = session.builder
    ids, mask = traj.input_ids, traj.loss_mask

    # 1. mask-1 tokens are the sampled tokens, in order; logprobs and versions line up.
    assert [t for t, m in zip(ids, mask, strict=True) if m == 1] == [t for r in replies for t in r]
    assert set(mask) <= {0, 1}
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, mask, strict=True) if m == 0)
    for record in session.turns:
        span = range(record.start, record.start + record.num_sampled)
        assert all(mask[i] == 1 and traj.weight_version[i] == record.weight_version for i in span)
    assert sum(mask) == sum(t.num_sampled for t in session.turns)

    # 2. Every prompt the engine saw is a prefix of the final stream: no re-tokenization.
    for prompt, record in zip(engine.prompts, session.turns, strict=True):
        assert ids[: len(prompt)] == prompt
        assert len(prompt) == record.start

    # 3. Decoding the stream gives exactly the conversation the template renders.
    messages = [*opening]
    for turn, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": tokenizer.decode(reply[:-1])})
        if turn < n_turns - 1:
            messages.append({"role": "tool", "content": observations[turn]})
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert rendered == chat.decode(ids) + "\n"

    # 4. Look-alike text never became a special token: one <|im_start|> and one <|im_end|>
    #    per message (system, user, each assistant turn, each tool result).
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start_id) == len(messages)
    assert ids.count(end_id) == len(messages)


def test_turn_cut_by_length_is_closed_by_glue_not_by_a_sampled_token(
    tokenizer, scripted_engine_cls
):
    chat = ChatFormat(tokenizer, TOOLS)
    reply = tokenizer.encode("abc def", add_special_tokens=False)
    engine = scripted_engine_cls([reply, [*reply, chat.stop_token_ids[0]]], finish=["stop", "stop"])
    session = Session(
        engine,
        chat,
        [{"role": "user", "content": "q"}],
        sampling=SamplingParams(max_new_tokens=64),
        max_turns=4,
        max_context=4096,
    )

    async def episode() -> None:
        await session.generate()
        session.add_observation([{"role": "tool", "content": "out"}])
        await session.generate()

    asyncio.run(episode())
    ids, mask = session.builder.input_ids, session.builder.loss_mask
    first = session.turns[0]
    after = first.start + first.num_sampled
    # The end-of-turn token the model did not sample is glue: present, with mask 0.
    assert ids[after] == chat.stop_token_ids[0]
    assert mask[after] == 0


def test_limits_end_the_episode_with_their_stop_reason(tokenizer, scripted_engine_cls):
    chat = ChatFormat(tokenizer, TOOLS)
    end = chat.stop_token_ids[0]
    long_reply = list(range(300, 340))

    async def run(max_turns: int, max_context: int, replies: list[list[int]], max_new: int = 64):
        engine = scripted_engine_cls(replies)
        session = Session(
            engine,
            chat,
            [{"role": "user", "content": "q"}],
            sampling=SamplingParams(max_new_tokens=max_new),
            max_turns=max_turns,
            max_context=max_context,
        )
        try:
            while True:
                await session.generate()
                session.add_observation([{"role": "tool", "content": "x"}])
        except EpisodeEnd as end_:
            return end_.reason, session

    reason, session = asyncio.run(run(2, 4096, [[5, end]] * 3))
    assert reason == "max_turns"
    assert session.num_turns == 2
    reason, _ = asyncio.run(run(8, 4096, [long_reply], max_new=10))
    assert reason == "length"
    prompt_len = len(chat.prompt_ids([{"role": "user", "content": "q"}]))
    reason, session = asyncio.run(run(8, prompt_len + 5, [long_reply]))
    assert reason == "context_limit"
    assert len(session.builder) <= prompt_len + 5


def test_plain_id_range_matches_the_tokenizer(tokenizer):
    assert max(tokenizer.all_special_ids) < FIRST_PLAIN_ID
    assert len(tokenizer) == VOCAB_SIZE
