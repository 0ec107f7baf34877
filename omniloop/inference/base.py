"""The engine boundary: what rollout code may ask of an inference engine.

Field names follow SGLang's native API (`/generate` with `input_ids` and `sampling_params`), so
the same client talks to real SGLang on GPUs and to omniloop's CPU engine elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omniloop.modalities.media import MediaData


class SamplingParams(BaseModel):
    """Sampling options, with SGLang's `sampling_params` field names."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_new_tokens: int = Field(default=256, ge=0)
    """Most tokens to sample in one call."""
    temperature: float = Field(default=1.0, ge=0.0)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 for all."""
    stop: list[str] | None = None
    """Stop when the output ends with one of these strings."""
    stop_token_ids: list[int] | None = None
    """Stop when one of these tokens is sampled (it is kept in the output)."""
    seed: int | None = None
    """Per-request sampling seed (engine-specific name `sampling_seed` on SGLang)."""


FinishReason = Literal["stop", "length", "abort"]


class GenerateOutput(BaseModel):
    """The engine's answer to one `/generate` prompt, reduced to what rollout needs."""

    model_config = ConfigDict(extra="forbid")

    output_ids: list[int]
    """Sampled token ids, verbatim, including a matched stop token."""
    output_logprobs: list[float]
    """Logprob of each sampled token under the sampling weights."""
    finish_reason: FinishReason
    """`stop` (stop token or string), `length` (max_new_tokens or context), `abort`."""
    weight_version: int
    """The weight version that sampled the first of these tokens."""
    weight_versions: list[int] = Field(default_factory=list)
    """The weight version that sampled each token (empty: `weight_version` for all). An engine
    that reports one version per response (SGLang) has it repeated; omniloop's reports a
    change mid-response (an update that landed in place)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """When asked (`Engine.generate`'s `top_logprobs`): per output token, that many of the most
    likely tokens of the distribution `output_logprobs` come from, as (token_id, logprob),
    highest first. None when not asked."""

    @model_validator(mode="after")
    def _one_version_per_token(self) -> GenerateOutput:
        if not self.weight_versions:
            self.weight_versions = [self.weight_version] * len(self.output_ids)
        elif len(self.weight_versions) != len(self.output_ids):
            raise ValueError(
                f"{len(self.output_ids)} output ids but {len(self.weight_versions)} weight versions"
            )
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.output_ids):
            raise ValueError(
                f"{len(self.output_ids)} output ids but {len(self.top_logprobs)} top logprob lists"
            )
        return self


class Engine(Protocol):
    """What rollout code may ask of an engine. `EngineClient` is the implementation."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        media: Sequence[MediaData] = (),
        *,
        top_logprobs: int = 0,
    ) -> GenerateOutput:
        """Sample a continuation of `input_ids`; raise `EngineError` if the engine fails.

        `input_ids` hold every media item's placeholder block already expanded (as many
        placeholder ids as the model's processor makes of the item); `media` are the items,
        in the order of their blocks (sent as SGLang's `image_data`, `audio_data`,
        `video_data`, one list per kind).
        `top_logprobs` above 0 fills `GenerateOutput.top_logprobs` with that many tokens per
        output token (SGLang's `top_logprobs_num`); callers pass it only when above 0, so an
        engine that never returns them may leave the keyword out."""
        ...
