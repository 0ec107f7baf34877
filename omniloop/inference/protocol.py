"""SGLang's native HTTP API as pydantic models: the wire contract of omniloop's CPU engine.

Names, defaults and response shapes follow SGLang's `io_struct.py` (`GenerateReqInput`,
`UpdateWeightFromDiskReqInput`, `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `DestroyWeightsUpdateGroupReqInput`,
`PauseGenerationReqInput`, `ContinueGenerationReqInput`), `sampling_params.py` and
`http_server.py`, so `EngineClient` talks to real SGLang and to this engine alike.

Where this engine differs, it says so instead of guessing:
- Tokens in, tokens out: `text` and `input_embeds` prompts are rejected (send `input_ids`).
- Media (`image_data`, `audio_data`, `video_data`, for a model that takes them) go with
  `input_ids` used verbatim: each item's placeholder block must already be expanded in them
  (as many placeholder ids as the engine's processor makes of the item), which SGLang only
  requires of pre-processed items. Items are `data:` URIs, base64 or file paths, or, per kind
  and prompt, one pre-processed dict (`format: processor_output`, the processor's fields as
  nested lists); URLs and `precomputed_embedding` dicts are rejected. `use_audio_in_video`
  must be false; `modalities` is accepted and ignored.
- A field SGLang accepts but this engine does not implement is rejected with 400, unless it is
  sent with its neutral value (`stream: false`, `n: 1`, `repetition_penalty: 1.0`, ...).
- `weight_version` is a string in SGLang's JSON; here it always holds an integer counter
  ("0" at start). An update without `weight_version` increments it; SGLang leaves it as is.
- `meta_info.output_token_logprobs` holds `[logprob, token_id, text|None]` triples for the
  output tokens only; input logprobs are not implemented. `top_logprobs_num` with
  `return_logprob` adds `meta_info.output_top_logprobs` in SGLang's shape (per output token,
  its most likely tokens as such triples, highest first), at most `MAX_TOP_LOGPROBS_NUM` (20,
  OpenAI's limit; SGLang has none). With `return_logprob`,
  `meta_info.output_token_weight_versions` (not SGLang's) holds the weight version that
  sampled each output token, and `cached_tokens` counts the prompt tokens served from the
  prefix cache (as SGLang does).
- An update that arrives while generation is paused (`in_place` or `retract`) lands at once,
  between two decode steps: running requests go on under the new weights after
  `/continue_generation`, none is aborted. Unpaused, an update waits for running requests to
  finish (drains).
- `/update_weights_from_distributed` without `weight_version` is one bucket of several: the
  engine answers once it has received it, loads it (after running requests finish), and then
  admits no request until a bucket *with* `weight_version` (the last one) has loaded, or
  `/continue_generation`; the last bucket's answer reports a failure of any earlier one.
  SGLang answers each bucket after loading it and leaves it to the caller to pause generation
  around the whole update. Weight-update groups use gloo only (this engine is CPU-only).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from omniloop.modalities.media import MediaKind

ENGINE_NAME = "omniloop's CPU engine"

# SGLang fields accepted only with these neutral values (anything else is not implemented).
_NEUTRAL_SAMPLING: dict[str, Any] = {
    "n": 1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
    "spaces_between_special_tokens": True,
}
_NEUTRAL_GENERATE: dict[str, Any] = {
    "stream": False,
    "logprob_start_len": -1,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "input_embeds": None,
    "use_audio_in_video": False,
    "lora_path": None,
    "custom_logit_processor": None,
    "session_params": None,
}
# SGLang fields that only steer its logging: accepted with any value.
_IGNORED_GENERATE = ("log_metrics", "no_logs")
# Request fields that a batch may give once for all prompts or as a list with one per prompt.
_PER_ITEM_GENERATE = ("sampling_params", "return_logprob", "top_logprobs_num", "rid")

MAX_TOP_LOGPROBS_NUM = 20
"""The most top logprobs `/generate` returns per output token (OpenAI's limit for
`top_logprobs`; SGLang sets none)."""


def _same_value(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return bool(value == neutral)


def _strip_neutral(data: Any, neutral: dict[str, Any], where: str) -> Any:
    """Remove neutral-valued SGLang extras; raise `ValueError` naming non-neutral ones."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    bad = []
    for key, value in neutral.items():
        if key in data:
            if _same_value(data[key], value):
                del data[key]
            else:
                bad.append(f"{key}={data[key]!r} (only {value!r} is supported)")
    if bad:
        raise ValueError(f"{where} not implemented by {ENGINE_NAME}: {'; '.join(bad)}")
    return data


def _integer_version(v: str | int | None) -> str | int | None:
    if v is not None and parse_weight_version(v) is None:
        raise ValueError(f"weight_version must be an integer (as a number or a string), got {v!r}")
    return v


RequestedVersion = Annotated[str | int | None, AfterValidator(_integer_version)]
"""A request's `weight_version`: SGLang sends a string; it must read as an integer."""


class _Wire(BaseModel):
    """A request body: strict types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class SamplingParamsInput(_Wire):
    """`sampling_params` of `/generate`, SGLang's names and defaults."""

    max_new_tokens: int | None = Field(default=128, ge=0)
    """Most tokens to sample; null: until a stop condition or the context is full."""
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    """Below 1e-6 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    """-1 for the whole vocabulary, else at least 1."""
    stop: str | list[str] | None = None
    """Stop once the decoded output contains one of these strings."""
    stop_token_ids: list[int] | None = None
    """Stop when one of these ids is sampled (it is kept in `output_ids`)."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS ids (benchmarks of fixed length)."""
    sampling_seed: int | None = None
    """Seed of this request's sampler; the same seed gives the same tokens."""
    skip_special_tokens: bool = True
    """Only affects `text`."""
    no_stop_trim: bool = False
    """Keep a matched stop string at the end of `text`."""

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        data = _strip_neutral(data, _NEUTRAL_SAMPLING, "sampling_params")
        if isinstance(data, dict):
            # SGLang reads null as "use the default" for every field but max_new_tokens.
            data = {k: v for k, v in data.items() if v is not None or k == "max_new_tokens"}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings cannot be empty")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


MediaSource = str | dict[str, Any]
"""One item (a `data:` URI, base64, or a file path), or one `processor_output` dict holding
all of a prompt's items of a kind."""

MediaField = MediaSource | list[MediaSource | list[MediaSource] | None] | None
"""SGLang's `image_data` / `audio_data` / `video_data`: for one prompt an item or a list of
items; for a batch an item for every prompt, or a list with an entry (an item, a list of
items, or null) per prompt (`MediaSource`)."""


class GenerateReqInput(_Wire):
    """Body of `/generate`: one prompt (`input_ids: list[int]`) or a batch (`list[list[int]]`)."""

    input_ids: list[int] | list[list[int]] | None = None
    """Prompt token ids; a list of lists is a batch and gets a list of results back."""
    text: str | list[str] | None = None
    """Not supported (tokens in): rejected with a message."""
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    """One for all prompts, or one per prompt of a batch."""
    return_logprob: bool | list[bool] | None = None
    """Add `meta_info.output_token_logprobs`."""
    top_logprobs_num: int | list[int] | None = None
    """With `return_logprob`: add `meta_info.output_top_logprobs`, this many of the most likely
    tokens per output token (0 to `MAX_TOP_LOGPROBS_NUM`; 0 or null none). One for all
    prompts, or one per prompt of a batch."""
    return_text_in_logprobs: bool = False
    """Fill the text slot of each logprob triple with the token's text."""
    rid: str | list[str] | None = None
    """Request id(s), echoed as `meta_info.id`; a string is suffixed `_i` in a batch."""
    image_data: MediaField = None
    """Images of the prompt(s), one per image placeholder block of `input_ids`, in order."""
    audio_data: MediaField = None
    """Audio clips of the prompt(s), one per audio placeholder block, in order."""
    video_data: MediaField = None
    """Videos of the prompt(s), one per video placeholder block, in order."""
    modalities: list[str | None] | None = None
    """SGLang's hint for llava-style models; accepted and not needed (the blocks in
    `input_ids` say which item is which)."""

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        data = _strip_neutral(data, _NEUTRAL_GENERATE, "request fields")
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in _IGNORED_GENERATE}
        return data

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        if self.text is not None:
            raise ValueError(
                f"text prompts are not supported: {ENGINE_NAME} is tokens-in, tokens-out; "
                "tokenize with the model's tokenizer and send input_ids"
            )
        if self.input_ids is None:
            raise ValueError("input_ids is required")
        if len(self.input_ids) == 0:
            raise ValueError("input_ids cannot be empty")
        if self.is_batch:
            n = len(self.input_ids)
            if any(len(p) == 0 for p in self.batch_input_ids()):
                raise ValueError("every prompt of a batch needs at least one token")
            for name in _PER_ITEM_GENERATE:
                value = getattr(self, name)
                if isinstance(value, list) and len(value) != n:
                    raise ValueError(f"{name} has {len(value)} entries for a batch of {n}")
            for kind in MediaKind:
                value = getattr(self, f"{kind}_data")
                # An empty list is no media (as SGLang reads it).
                if isinstance(value, list) and value and len(value) != n:
                    raise ValueError(
                        f"{kind}_data has {len(value)} entries for a batch of {n} (one entry "
                        "per prompt: an item, a list of items, or null)"
                    )
        else:
            for name in _PER_ITEM_GENERATE:
                if isinstance(getattr(self, name), list):
                    raise ValueError(f"{name} is a list but input_ids is a single prompt")
            for kind in MediaKind:
                value = getattr(self, f"{kind}_data")
                if isinstance(value, list) and any(not isinstance(v, str | dict) for v in value):
                    raise ValueError(
                        f"{kind}_data of a single prompt is an item or a list of items "
                        "(strings or processor_output dicts), not a list of lists or nulls"
                    )
        return self

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_logprobs_num(cls, v: int | list[int] | None) -> int | list[int] | None:
        for n in [v] if isinstance(v, int) else v or []:
            if not 0 <= n <= MAX_TOP_LOGPROBS_NUM:
                raise ValueError(
                    f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS_NUM} "
                    f"(the most this engine returns per token), got {n}"
                )
        return v

    @property
    def is_batch(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    def batch_input_ids(self) -> list[list[int]]:
        """The prompts as a batch (a single prompt becomes a batch of one)."""
        assert self.input_ids is not None
        if self.is_batch:
            return [list(p) for p in self.input_ids]  # type: ignore[arg-type]
        return [list(self.input_ids)]  # type: ignore[arg-type]

    def item_sampling(self, i: int) -> SamplingParamsInput:
        sp = self.sampling_params
        if isinstance(sp, list):
            return sp[i]
        return sp if sp is not None else SamplingParamsInput()

    def item_return_logprob(self, i: int) -> bool:
        rl = self.return_logprob
        return bool(rl[i] if isinstance(rl, list) else rl)

    def item_top_logprobs_num(self, i: int) -> int:
        """Prompt `i`'s top logprobs per output token; 0 unless it also has `return_logprob`
        (as SGLang: top logprobs come with the logprobs)."""
        n = self.top_logprobs_num
        num = (n[i] if isinstance(n, list) else n) or 0
        return num if self.item_return_logprob(i) else 0

    def item_media(self, i: int) -> list[tuple[MediaKind, MediaSource]]:
        """Prompt `i`'s media items: its images, then its audio, then its videos, each kind
        in the order sent (the order of that kind's blocks in its `input_ids`)."""
        items: list[tuple[MediaKind, MediaSource]] = []
        for kind in MediaKind:
            value = getattr(self, f"{kind}_data")
            if value is None or isinstance(value, str | dict):
                entry: MediaSource | list[MediaSource] | None = value  # the same for every prompt
            elif not self.is_batch:
                entry = [v for v in value if isinstance(v, str | dict)]
            else:
                entry = value[i] if value else None
            if isinstance(entry, str | dict):
                items.append((kind, entry))
            elif entry is not None:
                items.extend((kind, source) for source in entry)
        return items

    def item_rid(self, i: int, fallback: str) -> str:
        if isinstance(self.rid, list):
            return self.rid[i]
        if self.rid is None:
            return fallback
        return f"{self.rid}_{i}" if self.is_batch else self.rid


class FinishReason(BaseModel):
    """`meta_info.finish_reason`: `{type: stop, matched: id|str}`, `{type: length, length: n}`,
    or `{type: abort, message: ...}`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class GenerateMetaInfo(BaseModel):
    """`meta_info` of a `/generate` result (SGLang sends more keys; they are kept)."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | int | None = None
    """The weight version that sampled this result; an integer counter as a string here."""
    e2e_latency: float | None = None
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    """`[logprob, token_id, text|None]` per output token, when `return_logprob`."""
    output_top_logprobs: list[list[tuple[float | None, int, str | None]] | None] | None = None
    """With `return_logprob` and `top_logprobs_num` above 0: per output token, that many of the
    most likely tokens of the distribution `output_token_logprobs` come from, highest first,
    as `[logprob, token_id, text|None]` (text with `return_text_in_logprobs`)."""
    output_token_weight_versions: list[int] | None = None
    """omniloop's engine, with `return_logprob`: the weight version that sampled each output
    token (an update applied in place changes it mid-response). SGLang has no such key."""


class GenerateResponse(BaseModel):
    """One `/generate` result. `output_ids` are the sampled ids, verbatim."""

    model_config = ConfigDict(extra="allow")

    text: str = ""
    output_ids: list[int] | None = None
    meta_info: GenerateMetaInfo


class UpdateWeightFromDiskReqInput(_Wire):
    """Body of `/update_weights_from_disk`."""

    model_path: str
    """A Hugging Face folder with a model of the same architecture."""
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    """Abort running and waiting requests instead of letting running ones finish first."""
    weight_version: RequestedVersion = None
    """Integer version to set; omitted: the current version plus one."""
    keep_pause: bool = False
    """Stay paused after the update (until `/continue_generation`)."""
    flush_cache: bool = True
    """No prefix cache here: any value is accepted."""
    torch_empty_cache: bool = False
    """GPU memory hint; no effect on CPU."""
    recapture_cuda_graph: bool = False
    """GPU only; no effect on CPU."""
    is_async: Literal[False] = False
    token_step: Literal[0] = 0
    manifest: None = None
    rid: str | None = None


class UpdateWeightFromDiskReqOutput(BaseModel):
    """Answer of `/update_weights_from_disk` (HTTP 200 on success, 400 otherwise)."""

    success: bool
    message: str
    num_paused_requests: int = 0


class InitWeightsUpdateGroupReqInput(_Wire):
    """Body of `/init_weights_update_group`: join a trainer's weight-broadcast group.

    The trainer is rank 0 and serves the rendezvous store at `master_address:master_port`;
    this engine joins as rank `rank_offset` (SGLang: `rank_offset + tp_rank`). The call
    returns once every rank of `world_size` has joined.
    """

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    """`gloo` here (a CPU engine); SGLang's default `nccl` is refused with a message."""
    rid: str | None = None

    @model_validator(mode="after")
    def _ranks(self) -> InitWeightsUpdateGroupReqInput:
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} must be below world_size {self.world_size}"
            )
        return self


class UpdateWeightsFromDistributedReqInput(_Wire):
    """Body of `/update_weights_from_distributed`: receive one bucket of broadcast tensors.

    Rank 0 of `group_name` broadcasts the tensors while this request is in flight: one uint8
    tensor holding every tensor's bytes in order with `load_format: flattened_bucket`, else
    one broadcast per tensor, in order.
    """

    names: list[str] = Field(min_length=1)
    """Hugging Face parameter names."""
    dtypes: list[str]
    """One per name: `float32`, `bfloat16`, ... (`torch.` prefix accepted)."""
    shapes: list[list[int]]
    """One per name."""
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    """No prefix cache here: any value is accepted."""
    abort_all_requests: bool = False
    """Abort running and waiting requests instead of letting running ones finish first."""
    weight_version: RequestedVersion = None
    """Set on the last bucket: the integer version the engine reports afterwards. Omitted:
    more buckets follow and no request is admitted until the last one lands."""
    load_format: Literal["flattened_bucket"] | None = None
    torch_empty_cache: bool = False
    """GPU memory hint; no effect on CPU."""
    rid: str | None = None

    @model_validator(mode="after")
    def _lengths(self) -> UpdateWeightsFromDistributedReqInput:
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(
                f"{n} names, {len(self.dtypes)} dtypes and {len(self.shapes)} shapes: "
                "one of each per tensor"
            )
        if any(d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes cannot have negative sizes")
        return self


class DestroyWeightsUpdateGroupReqInput(_Wire):
    """Body of `/destroy_weights_update_group`: leave a weight-update group."""

    group_name: str = "weight_update_group"
    rid: str | None = None


class TensorEntry(BaseModel):
    """One tensor of a fetched bucket: where its bytes lie in the bucket."""

    name: str
    """Hugging Face parameter name."""
    dtype: str
    """`float32`, `bfloat16`, ..."""
    shape: list[int]
    offset: int = Field(ge=0)
    """Byte offset of the tensor in its bucket."""


BUCKET_CHECKSUM_HEADER = "X-Xxh3-128"
"""Response header of a bucket: the xxHash3-128 (hex) of the whole bucket's bytes, also on a
range response; a bucket whose bytes do not match it is refused."""


class BucketEntry(BaseModel):
    """One bucket of a weight manifest (the DCS `tcp` backend)."""

    nbytes: int = Field(ge=0)
    tensors: list[TensorEntry] = Field(min_length=1)


class WeightManifest(BaseModel):
    """`GET {source_url}/manifest`: what a version's buckets hold. Bucket `i` is served at
    `{source_url}/buckets/{i}` with its checksum in `BUCKET_CHECKSUM_HEADER` (byte ranges
    supported, so a broken transfer resumes). The manifest is known before any bucket is
    packed, so the first bucket travels while the next ones are packed."""

    version: int
    buckets: list[BucketEntry] = Field(min_length=1)


class UpdateWeightsFromTcpReqInput(_Wire):
    """Body of `/update_weights_from_tcp` (omniloop's own): fetch a version's buckets from a
    bucket server over HTTP, checksum each, and load them as one update."""

    source_url: str = Field(pattern=r"^https?://")
    """The version's base URL on the bucket server (`.../manifest`, `.../buckets/{i}`)."""
    token: str | None = None
    """Bearer token the bucket server wants (sent as `Authorization`, never in a URL)."""
    weight_version: RequestedVersion = None
    """Integer version to set; omitted: the manifest's version."""
    retries: int = Field(default=3, ge=0)
    """Per bucket: fetches again after a broken connection (resuming from the byte reached)
    or a checksum mismatch (the whole bucket), before the update fails."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Socket timeout of each fetch."""
    abort_all_requests: bool = False
    """Abort running and waiting requests instead of letting running ones finish first."""
    rid: str | None = None


class UpdateWeightsFromTcpReqOutput(BaseModel):
    """Answer of `/update_weights_from_tcp` (200 on success, 400 otherwise)."""

    success: bool
    message: str
    weight_version: int | None = None
    bytes: int = 0
    """Bytes of the buckets loaded (fetched again after a fault: counted once)."""
    seconds: float = 0.0
    """From the request to the last bucket loaded."""
    resumed: int = 0
    """Fetches that resumed a bucket after a broken connection."""
    refetched: int = 0
    """Buckets fetched whole again after a checksum mismatch."""


class SuccessMessage(BaseModel):
    """`{success, message}`: the answer of SGLang's weight-group endpoints."""

    success: bool
    message: str


class PauseGenerationReqInput(_Wire):
    """Body of `/pause_generation` (optional). SGLang's default mode is `abort`.

    `abort`: finish every running and waiting request with `finish_reason.type == "abort"`
    (partial output returned). `in_place`: stop decoding; running requests keep their KV cache
    and resume on `/continue_generation`. `retract`: same as `in_place` here (on SGLang the
    requests go back to the queue and are recomputed).
    """

    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: str | None = None


class ContinueGenerationReqInput(_Wire):
    """Body of `/continue_generation` (optional)."""

    torch_empty_cache: bool = True
    """GPU memory hint; no effect on CPU."""
    rid: str | None = None


class StatusMessage(BaseModel):
    """`{message, status}`: the answer of `/pause_generation` and `/continue_generation`."""

    message: str
    status: str = "ok"


class ModelInfo(BaseModel):
    """Answer of `/get_model_info`."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | dict[str, Any] | None = None
    weight_version: str | int | None = None
    model_type: str | None = None
    architectures: list[str] | None = None
    modalities: list[str] = Field(default_factory=lambda: ["text"])
    """What the model takes in its prompt (omniloop's): `text`, and `image`, `audio`, `video`
    for a model that takes media in `/generate`."""


class ErrorResponse(BaseModel):
    """Body of a 4xx/5xx answer, as SGLang's `ErrorResponse`."""

    object: str = "error"
    message: str
    type: str
    param: str | None = None
    code: int


def parse_weight_version(value: object) -> int | None:
    """An integer weight version from SGLang's string (or a number); None if not one.

    SGLang's default version is the string "default", which reads as 0.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s == "default":
            return 0
        if s.lstrip("-").isdigit():
            return int(s)
    return None


def _is_union_tag(part: object) -> bool:
    # pydantic names a union member in `loc` by its type: `list[int]`, `SamplingParamsInput`.
    return isinstance(part, str) and (
        part[:1].isupper() or "[" in part or part in ("bool", "int", "float", "str", "none")
    )


def _branch_score(errs: list[Any], depth: int) -> tuple[bool, int, int]:
    mismatch = [str(x.get("type", "")).endswith("_type") for x in errs]
    # A member whose root type does not even match (a dict given, a list expected) is the
    # least likely one the client meant.
    root = any(m and len(x["loc"]) == depth for m, x in zip(mismatch, errs, strict=True))
    return root, len(errs), sum(mismatch)


def _pick_union_branch(errors: list[Any]) -> list[Any]:
    """Keep, per union-typed field, only the errors of the member the input most resembles.

    pydantic reports every member's errors; the member whose root type matches, then with the
    fewest errors, then the fewest plain type mismatches, is the one the client meant.
    """
    branches: dict[tuple[Any, ...], dict[str, list[Any]]] = {}
    plain: list[Any] = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        tag_at = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
        if tag_at is None:
            plain.append(e)
        else:
            branches.setdefault(loc[:tag_at], {}).setdefault(loc[tag_at], []).append(e)
    for prefix, members in branches.items():
        plain.extend(min(members.values(), key=partial(_branch_score, depth=len(prefix) + 1)))
    return plain


def format_validation_errors(errors: list[Any]) -> str:
    """One line per pydantic error: `field.path: reason`, with our wording for unknown keys."""
    lines = []
    for e in _pick_union_branch(errors):
        loc = [str(p) for p in e.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        where = ".".join(loc) or "body"
        kind = e.get("type")
        if kind == "extra_forbidden":
            lines.append(f"{where}: unknown field, or an SGLang field {ENGINE_NAME} lacks")
        elif where == "body" and kind in ("model_attributes_type", "dict_type", "model_type"):
            lines.append("body: must be a JSON object (send Content-Type: application/json)")
        else:
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            lines.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(lines))
