"""Sampling one token per sequence from a batch of logits (the engine's sampler)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

GREEDY_EPS = 1e-6
"""Temperatures below this are greedy (SGLang's threshold)."""


class SamplingRow(Protocol):
    """A request's sampling parameters (`GenerationRequest` has them)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...


@dataclass(frozen=True)
class SampledTokens:
    """One token per row, with what was asked about the distribution it came from."""

    ids: list[int]
    logprobs: list[float]
    """Raw logprob (`log_softmax(logits)`) of each sampled id."""
    top_logprobs: list[list[tuple[float, int]] | None]
    """Per row: its `top_logprobs_num` most likely tokens of that same raw distribution,
    highest first, as (logprob, token id); None for a row that asks for none."""


def sample(
    logits: torch.Tensor,
    reqs: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
    top_logprobs_nums: Sequence[int] | None = None,
) -> SampledTokens:
    """Pick one token per row of `logits` [B, vocab]: the ids, their raw logprobs and, for
    rows whose `top_logprobs_nums` entry is above 0 (None: no row), the most likely tokens.

    Greedy rows take the argmax (the first one on ties). Sampled rows divide by temperature,
    keep the top-k, then the smallest set whose probability reaches top-p, and draw with the
    row's generator. Logprobs, sampled and top alike, are of the raw distribution (temperature
    1, no truncation), so a sampled token in its row's top list has the same logprob there.
    Among tied logprobs the order of the top list is unspecified.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    for i, (req, gen) in enumerate(zip(reqs, generators, strict=True)):
        if req.temperature < GREEDY_EPS:
            continue
        row = logits[i] / req.temperature
        if 0 < req.top_k < vocab:
            kth = torch.topk(row, req.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if req.top_p < 1.0:
            sorted_row, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_row, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop = (torch.cumsum(probs, dim=-1) - probs) > req.top_p
            row = torch.full_like(row, float("-inf")).scatter(
                0, order, sorted_row.masked_fill(drop, float("-inf"))
            )
        probs = torch.softmax(row, dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return SampledTokens(
        ids=tokens.tolist(),
        logprobs=chosen.tolist(),
        top_logprobs=_top_logprobs(logprobs, top_logprobs_nums, len(reqs)),
    )


def _top_logprobs(
    logprobs: torch.Tensor, nums: Sequence[int] | None, rows: int
) -> list[list[tuple[float, int]] | None]:
    """Each asking row's `nums[i]` highest logprobs, highest first; None for the others."""
    out: list[list[tuple[float, int]] | None] = [None] * rows
    if nums is None:
        return out
    if len(nums) != rows:
        raise ValueError(f"{len(nums)} top_logprobs_nums for {rows} rows")
    asking = [i for i, k in enumerate(nums) if k > 0]
    if not asking:
        return out  # the common case costs nothing
    # One topk over the asking rows at the largest k; each row keeps its own prefix.
    k = min(max(nums[i] for i in asking), logprobs.shape[-1])
    values, ids = torch.topk(logprobs[asking], k, dim=-1, sorted=True)
    for row, i in enumerate(asking):
        n = nums[i]
        out[i] = list(zip(values[row, :n].tolist(), ids[row, :n].tolist(), strict=True))
    return out
