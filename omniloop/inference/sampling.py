"""Sampling one token per sequence from a batch of logits (the engine's sampler)."""

from __future__ import annotations

from collections.abc import Sequence
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


def sample(
    logits: torch.Tensor,
    reqs: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, vocab]; return the ids and raw logprobs.

    Greedy rows take the argmax (the first one on ties). Sampled rows divide by temperature,
    keep the top-k, then the smallest set whose probability reaches top-p, and draw with the
    row's generator.
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
    return tokens.tolist(), chosen.tolist()
