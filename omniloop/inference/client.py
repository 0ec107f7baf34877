"""`EngineClient`: the one async client of an inference engine's SGLang-native HTTP API.

It talks to omniloop's CPU engine and to real SGLang alike (same paths and field names; see
`protocol.py`). Only idempotent reads (`/health`, `/health_generate`, `/get_model_info`,
`/get_weight_version`) are retried, on transport errors, with tenacity. Everything else is sent
once: a failed `/generate` raises `EngineHTTPError` carrying the status and body, and a
transport failure raises `EngineError`.

Media go as SGLang takes them, in one of two forms (`media_encoder`): base64 files (the
default, `media_fields`), or `processor_output` dicts processed on the client's side
(`ProcessorOutputFields`), the form SGLang keeps `input_ids` verbatim with.

`generate` always asks for logprobs, because a trajectory needs one per sampled token.
SGLang's `weight_version` is a string; it is parsed to an int ("default", SGLang's initial
value, reads as 0; anything else that is not an integer is an `EngineError`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, Protocol

from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from omniloop.errors import EngineError
from omniloop.http_client import HttpClient, HttpResponse, HttpTransportError
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.protocol import (
    GenerateResponse,
    ModelInfo,
    SuccessMessage,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTcpReqOutput,
    parse_weight_version,
)
from omniloop.modalities.media import MediaData, MediaKind
from omniloop.modalities.processing import MediaProcessor, ProcessedMedia, processor_output


class EngineHTTPError(EngineError):
    """The engine answered with an error status; `status_code` and `body` say what it said."""

    def __init__(self, what: str, status_code: int, body: str) -> None:
        super().__init__(f"{what} failed with HTTP {status_code}: {body}")
        self.status_code = status_code
        self.body = body


def sampling_to_wire(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for `sampling` (the seed travels as `sampling_seed`)."""
    wire: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop:
        wire["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        wire["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        wire["sampling_seed"] = sampling.seed
    return wire


def parse_generate_output(data: Any, top_logprobs: int = 0) -> GenerateOutput:
    """A `GenerateOutput` from one `/generate` result object; `EngineError` if unusable.

    `top_logprobs` above 0: the request asked for them, so `meta_info.output_top_logprobs`
    must hold a list per output token (it is read only then: some SGLang versions send the
    key, empty, when nothing was asked)."""
    try:
        response = GenerateResponse.model_validate(data)
    except ValueError as err:
        raise EngineError(f"engine returned a malformed /generate result: {err}") from None
    meta = response.meta_info
    if meta.finish_reason is None:
        raise EngineError(f"engine result {meta.id!r} has no finish_reason (not finished)")
    triples = meta.output_token_logprobs
    if triples is None:
        raise EngineError(f"engine result {meta.id!r} has no output_token_logprobs")
    ids = response.output_ids if response.output_ids is not None else [t[1] for t in triples]
    logprobs = [t[0] for t in triples]
    if len(ids) != len(logprobs) or any(lp is None for lp in logprobs):
        raise EngineError(
            f"engine result {meta.id!r} has {len(ids)} output ids but logprobs {logprobs!r}"
        )
    version = parse_weight_version(meta.weight_version)
    if version is None:
        raise EngineError(f"engine weight_version {meta.weight_version!r} is not an integer")
    top = None
    if top_logprobs > 0:
        if meta.output_top_logprobs is None or len(meta.output_top_logprobs) != len(ids):
            got = "none" if meta.output_top_logprobs is None else len(meta.output_top_logprobs)
            raise EngineError(
                f"engine result {meta.id!r} has {len(ids)} output ids but {got} top logprob "
                f"lists (asked for top_logprobs_num={top_logprobs})"
            )
        top = [
            [(token, float(lp)) for lp, token, _ in step or () if lp is not None]
            for step in meta.output_top_logprobs
        ]
    versions = meta.output_token_weight_versions
    if versions is None:
        versions = [version] * len(ids)
    elif len(versions) != len(ids):
        raise EngineError(
            f"engine result {meta.id!r} has {len(ids)} output ids but {len(versions)} weight "
            "versions"
        )
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=[float(lp) for lp in logprobs if lp is not None],
        finish_reason=meta.finish_reason.type,
        weight_version=versions[0] if versions else version,
        weight_versions=versions,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        cached_tokens=meta.cached_tokens,
        top_logprobs=top,
    )


class MediaEncoder(Protocol):
    """Turns a prompt's media into `/generate`'s `image_data`, `audio_data`, `video_data`."""

    def __call__(self, media: Sequence[MediaData]) -> dict[str, Any]:
        """The fields for `media` (in block order); none when `media` is empty."""
        ...


def media_fields(media: Sequence[MediaData]) -> dict[str, Any]:
    """SGLang's `/generate` media fields for `media`: `image_data`, `audio_data`,
    `video_data`, each a list of base64 `data:` URIs in the order given (absent when empty)."""
    fields: dict[str, list[str]] = {}
    for item in media:
        uri = "data:application/octet-stream;base64," + base64.b64encode(item.data).decode()
        fields.setdefault(f"{item.kind}_data", []).append(uri)
    return fields


class ProcessorOutputFields:
    """`MediaEncoder` of SGLang's `processor_output` form: each kind's items processed here by
    the model family's processor and sent as one dict of the processor's fields (nested
    lists). The engine then uses `input_ids` verbatim, SGLang included, and processes
    nothing; the body is larger (a 30 s audio item is 384,000 floats). Processing is cached by
    content hash (the `cache_items` most recent items), since each turn resends every item of
    the episode so far. Thread-safe."""

    def __init__(self, processor: MediaProcessor, cache_items: int = 64) -> None:
        self.processor = processor
        self._cache: OrderedDict[str, ProcessedMedia] = OrderedDict()
        self._cache_items = cache_items
        self._lock = threading.Lock()

    def __call__(self, media: Sequence[MediaData]) -> dict[str, Any]:
        by_kind: dict[MediaKind, list[ProcessedMedia]] = {}
        for item in media:
            by_kind.setdefault(item.kind, []).append(self._processed(item))
        return {f"{kind}_data": processor_output(items) for kind, items in by_kind.items()}

    def _processed(self, item: MediaData) -> ProcessedMedia:
        key = f"{item.kind}:{hashlib.sha256(item.data).hexdigest()}"
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        processed = self.processor.process(item.kind, item.data, label=f"{item.kind} item")
        with self._lock:
            self._cache[key] = processed
            while len(self._cache) > self._cache_items:
                self._cache.popitem(last=False)
        return processed


class EngineClient:
    """Async client of one engine at `base_url` (e.g. `http://127.0.0.1:30000`).

    Satisfies `omniloop.inference.base.Engine`. Use as `async with EngineClient(url) as c:`
    or call `aclose()`. `timeout` bounds each HTTP call in seconds (generation included).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        *,
        retries: int = 3,
        media_encoder: MediaEncoder = media_fields,
    ) -> None:
        """`media_encoder`: the form media are sent in (module docstring)."""
        self.base_url = base_url.rstrip("/")
        self._retries = retries
        self._media_encoder = media_encoder
        # Rollout sends many generations at once (up to the pool's 256); the engine batches them.
        self._http = HttpClient(self.base_url, timeout=timeout, connect_timeout=min(timeout, 10.0))

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- transport --------------------------------------------------------------------------

    async def _send(self, method: str, path: str, json: Any = None) -> HttpResponse:
        try:
            return await self._http.request(method, path, json=json)
        except HttpTransportError as err:
            raise EngineError(str(err)) from err

    async def _get_idempotent(self, path: str) -> HttpResponse:
        """GET with retries on transport errors (safe: the call changes nothing)."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._retries),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception_type(HttpTransportError),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._http.get(path)
        except HttpTransportError as err:
            raise EngineError(str(err)) from err
        raise AssertionError("unreachable: tenacity re-raises the last error")

    @staticmethod
    def _check(what: str, response: HttpResponse) -> HttpResponse:
        if response.status_code >= 400:
            raise EngineHTTPError(what, response.status_code, response.text)
        return response

    # -- generation -------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        media: Sequence[MediaData] = (),
        *,
        top_logprobs: int = 0,
    ) -> GenerateOutput:
        """Sample a continuation of `input_ids` (see `base.Engine`); `EngineError` on failure.

        Media travel in SGLang's `image_data`, `audio_data` and `video_data` (in block order,
        in the client's `media_encoder` form; encoded off the event loop), next to the
        already expanded `input_ids`. `MediaError` if an item cannot be processed.
        `top_logprobs` above 0 is sent as SGLang's `top_logprobs_num` and fills
        `GenerateOutput.top_logprobs` (an engine that returns none: `EngineError`)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_to_wire(sampling),
            "return_logprob": True,
        }
        if top_logprobs > 0:
            # Sent only when asked, so plain requests still suit an engine that lacks the field.
            body["top_logprobs_num"] = top_logprobs
        if media:
            body.update(await asyncio.to_thread(self._media_encoder, media))
        response = self._check("/generate", await self._send("POST", "/generate", body))
        return parse_generate_output(response.json(), top_logprobs)

    async def generate_batch(
        self,
        prompts: Sequence[list[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
    ) -> list[GenerateOutput]:
        """Several prompts in one `/generate` call; one `SamplingParams` for all, or one each."""
        if not prompts:
            return []
        if isinstance(sampling, SamplingParams):
            wire: Any = sampling_to_wire(sampling)
        else:
            if len(sampling) != len(prompts):
                raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
            wire = [sampling_to_wire(s) for s in sampling]
        body = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": wire,
            "return_logprob": True,
        }
        response = self._check("/generate", await self._send("POST", "/generate", body))
        data = response.json()
        if not isinstance(data, list) or len(data) != len(prompts):
            raise EngineError(f"batched /generate returned {type(data).__name__}, not a list")
        return [parse_generate_output(item) for item in data]

    # -- health and info --------------------------------------------------------------------

    async def health(self) -> bool:
        """Whether `/health` answers 200 (False if the engine cannot be reached)."""
        try:
            return (await self._get_idempotent("/health")).status_code == 200
        except EngineError:
            return False

    async def health_generate(self) -> bool:
        """Whether `/health_generate` (a 1-token generation) answers 200."""
        try:
            return (await self._get_idempotent("/health_generate")).status_code == 200
        except EngineError:
            return False

    async def get_model_info(self) -> ModelInfo:
        """`/get_model_info`: model path, weight version and more."""
        response = self._check("/get_model_info", await self._get_idempotent("/get_model_info"))
        return ModelInfo.model_validate(response.json())

    async def get_weight_version(self) -> int:
        """The engine's current weight version, as an int."""
        response = self._check(
            "/get_weight_version", await self._get_idempotent("/get_weight_version")
        )
        raw = response.json().get("weight_version")
        version = parse_weight_version(raw)
        if version is None:
            raise EngineError(f"engine weight_version {raw!r} is not an integer")
        return version

    # -- control ----------------------------------------------------------------------------

    async def flush_cache(self) -> None:
        """Ask the engine to drop its prefix cache; `EngineHTTPError` if it refuses."""
        self._check("/flush_cache", await self._send("POST", "/flush_cache"))

    async def update_weights_from_disk(
        self,
        path: str,
        weight_version: int | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> UpdateWeightFromDiskReqOutput:
        """Load new weights from a model folder on the engine's disk.

        `weight_version` is sent as a string (SGLang's type). Without it, omniloop's engine
        increments its version and SGLang keeps its current one, so pass it when the caller
        tracks versions. Raises `EngineHTTPError` when the engine reports failure.
        """
        body: dict[str, Any] = {"model_path": str(path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        response = self._check(
            "/update_weights_from_disk", await self._send("POST", "/update_weights_from_disk", body)
        )
        result = UpdateWeightFromDiskReqOutput.model_validate(response.json())
        if not result.success:
            raise EngineHTTPError("/update_weights_from_disk", response.status_code, response.text)
        return result

    async def update_weights_from_tcp(
        self,
        source_url: str,
        *,
        token: str | None = None,
        weight_version: int | None = None,
        retries: int = 3,
        timeout_s: float = 60.0,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsFromTcpReqOutput:
        """Have omniloop's engine fetch and load the buckets served at `source_url` (the DCS
        `tcp` backend). Raises `EngineHTTPError` when the engine reports failure."""
        body: dict[str, Any] = {
            "source_url": source_url,
            "token": token,
            "retries": retries,
            "timeout_s": timeout_s,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        path = "/update_weights_from_tcp"
        response = self._check(path, await self._send("POST", path, body))
        result = UpdateWeightsFromTcpReqOutput.model_validate(response.json())
        if not result.success:
            raise EngineHTTPError(path, response.status_code, response.text)
        return result

    async def _post_success(self, path: str, body: dict[str, Any]) -> SuccessMessage:
        """POST an SGLang `{success, message}` endpoint; `EngineHTTPError` unless success."""
        response = self._check(path, await self._send("POST", path, body))
        try:
            result = SuccessMessage.model_validate(response.json())
        except ValueError as err:
            raise EngineError(f"{path} returned a malformed answer: {response.text}") from err
        if not result.success:
            raise EngineHTTPError(path, response.status_code, response.text)
        return result

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> SuccessMessage:
        """Have the engine join a trainer's broadcast group as rank `rank_offset`.

        Returns once every rank of `world_size` has joined, so the trainer (rank 0) must be
        joining at the same time. Raises `EngineHTTPError` when the engine reports failure.
        """
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._post_success("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        flattened: bool = True,
        abort_all_requests: bool = False,
    ) -> SuccessMessage:
        """Announce one bucket; the engine receives it from rank 0's concurrent broadcast.

        `dtypes` are SGLang's names (`float32`). `flattened` sends `load_format:
        flattened_bucket` (one uint8 broadcast of all the bytes). `weight_version` (as a
        string on the wire) marks the last bucket; omniloop's engine admits no request
        between the first bucket and that one. Raises `EngineHTTPError` on failure.
        """
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "abort_all_requests": abort_all_requests,
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post_success("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> SuccessMessage:
        """Have the engine leave a weight-update group; `EngineHTTPError` on failure."""
        return await self._post_success("/destroy_weights_update_group", {"group_name": group_name})

    async def pause_generation(
        self, mode: Literal["abort", "retract", "in_place"] = "in_place"
    ) -> None:
        """Stop decoding. `in_place` (default here) keeps running requests for later;
        `abort` ends them with `finish_reason` abort (SGLang's default when no body is sent)."""
        self._check(
            "/pause_generation", await self._send("POST", "/pause_generation", {"mode": mode})
        )

    async def continue_generation(self) -> None:
        """Resume after `pause_generation`."""
        self._check("/continue_generation", await self._send("POST", "/continue_generation", {}))
