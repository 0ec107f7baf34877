"""Turns of one episode sample independently on the real CPU engine, reproducibly per episode.

`Session` gives each turn the seed `turn_seed(episode_seed, turn)`. With one seed for every
turn, the engine's sampler drew the same random numbers each turn (every turn came out the same
length); here two turns given the same prompt must sample differently, and the same episode run
again must sample the same tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any

from omniloop.agents.base import EpisodeEnd, Session, turn_seed
from omniloop.agents.chat import ChatFormat
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.client import EngineClient

TURNS = 4


class FixedPromptEngine:
    """The real engine, asked with the same prompt every turn.

    A session appends each turn's sample to the next prompt, so its turns never share a prompt
    and would sample differently even under one shared seed; pinning the prompt leaves the seed
    as the only thing that differs between turns, so the test fails if the seeds do not.
    """

    def __init__(self, engine: EngineClient, prompt: list[int]) -> None:
        self.engine = engine
        self.prompt = prompt
        self.seeds: list[int | None] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        self.seeds.append(sampling.seed)
        return await self.engine.generate(self.prompt, sampling)


async def episode_samples(
    engine: EngineClient, chat: ChatFormat, seed: int | None
) -> tuple[list[list[int]], list[int | None]]:
    """Sample `TURNS` turns of one episode; each turn's sampled ids and the seed it was sent."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    fixed = FixedPromptEngine(engine, chat.prompt_ids(messages))
    session = Session(
        fixed,
        chat,
        messages,
        sampling=SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed),
        max_turns=TURNS,
        max_context=4096,
    )
    for _ in range(TURNS):
        # A turn that fills max_new_tokens ends the episode as `length`; the next turn is
        # still sampled, which is all this test needs.
        with contextlib.suppress(EpisodeEnd):
            await session.generate()
    ids = session.builder.input_ids
    return [list(ids[t.start : t.start + t.num_sampled]) for t in session.turns], fixed.seeds


async def test_turns_of_one_episode_sample_independently_and_reproducibly(
    engine: EngineClient, tokenizer: Any
) -> None:
    chat = ChatFormat(tokenizer)
    samples, seeds = await episode_samples(engine, chat, seed=1234)
    assert seeds == [turn_seed(1234, turn) for turn in range(TURNS)]
    assert all(samples), samples
    # Identical prompts, so only the per-turn seeds can make the turns differ.
    assert len({tuple(s) for s in samples}) == TURNS, samples

    again, _ = await episode_samples(engine, chat, seed=1234)
    assert again == samples

    # Turn 0 is exactly what the engine samples for its derived seed on that prompt.
    prompt = chat.prompt_ids([{"role": "user", "content": "Tell me a story."}])
    direct = await engine.generate(
        prompt,
        SamplingParams(
            max_new_tokens=12,
            temperature=1.0,
            seed=turn_seed(1234, 0),
            stop_token_ids=sorted(chat.stop_token_ids),
        ),
    )
    assert direct.output_ids == samples[0]

    other, _ = await episode_samples(engine, chat, seed=1235)
    assert other != samples
