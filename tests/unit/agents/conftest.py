"""Fixtures for agent tests: the real SmolLM2 tokenizer and a scripted engine (a fake only
here, in unit tests of the agents module; integration tests use the real engine over HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.models import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny")


@dataclass
class ScriptedEngine:
    """Returns scripted token ids turn by turn and records every prompt and sampling it was
    given."""

    replies: list[list[int]]
    finish: list[str] | None = None
    version: int = 3
    prompts: list[list[int]] = field(default_factory=list)
    samplings: list[SamplingParams] = field(default_factory=list)

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        turn = len(self.prompts)
        self.prompts.append(list(input_ids))
        self.samplings.append(sampling)
        ids = self.replies[turn][: sampling.max_new_tokens]
        reason = (self.finish[turn] if self.finish else None) or (
            "length" if len(ids) < len(self.replies[turn]) else "stop"
        )
        logprobs = [-0.5 - 0.01 * ((i + turn) % 7) for i in range(len(ids))]
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            weight_version=self.version + turn,
            completion_tokens=len(ids),
        )


@pytest.fixture(scope="session")
def scripted_engine_cls():
    return ScriptedEngine
