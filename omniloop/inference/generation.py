"""What goes into the engine's core and what comes out: requests, results, update outcomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from omniloop.modalities import ProcessedMedia

PauseMode = Literal["abort", "retract", "in_place"]
FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete. Field meanings follow SGLang's `sampling_params`."""

    input_ids: list[int]
    rid: str = ""
    max_new_tokens: int | None = 128
    """None: until a stop condition or the context is full."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps the whole vocabulary."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    """Seed of this request's sampling generator; None draws a random one."""
    skip_special_tokens: bool = True
    """Only for `GenerationResult.text`."""
    no_stop_trim: bool = False
    """Keep a matched stop string at the end of `GenerationResult.text`."""
    token_texts: bool = False
    """Also decode each output token on its own (`GenerationResult.token_texts`), and each
    token of `GenerationResult.output_top_logprobs` (`top_token_texts`)."""
    top_logprobs_num: int = 0
    """How many of the most likely tokens, with their raw logprobs, to return per output token
    (`GenerationResult.output_top_logprobs`); 0 none."""
    media: tuple[ProcessedMedia, ...] = ()
    """The prompt's media, processed, in the order of their placeholder blocks in `input_ids`
    (per kind; kinds may interleave). Only for a model that takes media."""


@dataclass(frozen=True)
class GenerationResult:
    """What came of one `GenerationRequest`."""

    rid: str
    output_ids: list[int]
    """Sampled ids, verbatim, including a matched stop or EOS token."""
    output_logprobs: list[float]
    """Raw-distribution logprob of each sampled id (see the module docstring)."""
    finish_type: FinishType
    matched: int | str | None
    """The stop token id or stop string for `stop`; None otherwise."""
    finish_message: str | None
    """Why a request was aborted."""
    prompt_tokens: int
    weight_version: int
    """The version of the weights that sampled the first output token (the one the request was
    admitted under)."""
    output_versions: list[int]
    """The version of the weights that sampled each output token: an update applied in place
    changes it mid-response."""
    cached_tokens: int
    """Prompt tokens whose keys and values came from the prefix cache instead of a prefill."""
    text: str
    """The output decoded (special tokens per the request; a matched stop string trimmed)."""
    token_texts: list[str] | None
    e2e_latency: float
    """Seconds from submission to the result."""
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    """Per output token, the request's `top_logprobs_num` most likely tokens of the same raw
    distribution `output_logprobs` come from, highest first, as (logprob, token_id); the
    sampled token, when among them, has its `output_logprobs` value. None when not asked."""
    top_token_texts: list[list[str]] | None = None
    """The text of each token of `output_top_logprobs`, decoded on its own (with special
    tokens), when the request asked for `token_texts` too; None otherwise."""


@dataclass(frozen=True)
class WeightUpdateResult:
    """Outcome of a weight update applied by the scheduler."""

    weight_version: int
    num_aborted: int
    """Requests aborted because the update asked for `abort_all_requests`."""
    num_waiting: int
    """Requests that were held in the queue while the weights changed."""
