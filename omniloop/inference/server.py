"""The CPU engine's HTTP server: SGLang's native endpoints over an `EngineCore`.

Endpoints (methods as SGLang's `http_server.py`):
- `POST|PUT /generate`: `input_ids` single or batched → one result object or a list. With a
  model that takes media, SGLang's `image_data`, `audio_data` and `video_data` too (files, or
  pre-processed `processor_output` dicts): each item is read and processed off the event
  loop (`media_input.MediaPreparer`, by the model family's processor built from
  `EngineServerConfig.media`) and must match its placeholder block in `input_ids`
  (`media_input.check_placeholders`); `input_ids` are never re-tokenized.
- `GET /health`: 200 while the scheduler runs, 503 otherwise (cheap; no forward pass).
- `GET /health_generate`: queues a 1-token greedy generation; 200 as soon as it, or any other
  forward pass, completes; 503 if none does within 20 s. While generation is paused, or a
  bucketed weight update is under way, it only checks that the scheduler is alive, since
  nothing is admitted until `/continue_generation` (or the update's last bucket).
- `GET /get_model_info` (with omniloop's `modalities`: `text`, and the media the model takes),
  `GET /get_weight_version`.
- `GET|POST /flush_cache`: 200 once the prefix cache is empty.
- `POST /update_weights_from_disk`: see `EngineCore.update_weights` for the guarantees.
- `POST /init_weights_update_group`, `POST /update_weights_from_distributed`,
  `POST /destroy_weights_update_group`: a trainer's torch.distributed broadcast (gloo), bucket
  by bucket; answered with SGLang's `{success, message}`, 200 or 400. Joining and receiving
  run on daemon threads (never on the event loop), since a peer that never comes blocks them
  until the group's timeout.
- `POST /update_weights_from_tcp` (omniloop's own): fetch a version's checksummed buckets
  from a bucket server over HTTP and load them (`omniloop.inference.weight_fetch`); the
  engine side of the DCS `tcp` backend. `{success, message, weight_version, bytes, seconds,
  resumed, refetched}`, 200 or 400.
- `POST /pause_generation`, `POST /continue_generation`.
- `GET /metrics`: Prometheus text (`omniloop.inference.engine_metrics`): requests and tokens
  served, prefix-cache hits, running and waiting requests, the weight version.

Validation errors are answered with 400 and SGLang's `ErrorResponse` body, the message naming
each bad field; a request the engine cannot serve (prompt too long, token id out of range,
media that cannot be decoded, that do not match their placeholder blocks, or sent to a
text-only model) is also a 400, naming the item (`image 0: ...`; `prompt 2: ...` in a batch).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omniloop.errors import ConfigError, EngineError
from omniloop.inference.core import EngineCore, GenerationRequest, GenerationResult
from omniloop.inference.engine_metrics import engine_registry
from omniloop.inference.media_input import (
    MediaItem,
    MediaPreparer,
    check_counts,
    placeholder_blocks,
)
from omniloop.inference.protocol import (
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    ErrorResponse,
    FinishReason,
    GenerateMetaInfo,
    GenerateReqInput,
    GenerateResponse,
    InitWeightsUpdateGroupReqInput,
    ModelInfo,
    PauseGenerationReqInput,
    StatusMessage,
    SuccessMessage,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTcpReqInput,
    UpdateWeightsFromTcpReqOutput,
    format_validation_errors,
    parse_weight_version,
)
from omniloop.inference.weight_fetch import WeightFetcher
from omniloop.inference.weight_groups import FLATTENED_BUCKET, in_daemon_thread
from omniloop.modalities import MediaConfig, ProcessedMedia
from omniloop.modalities.families import processor_for

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT = 20.0
"""Seconds `/health_generate` waits for its token (SGLang's default)."""


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequest" if status < 500 else "InternalServerError"
    body = ErrorResponse(message=message, type=kind, code=status)
    return JSONResponse(body.model_dump(), status_code=status)


def _success(ok: bool, message: str) -> JSONResponse:
    body = SuccessMessage(success=ok, message=message)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 400)


def _to_request(
    body: GenerateReqInput, i: int, prompt: list[int], media: tuple[ProcessedMedia, ...]
) -> GenerationRequest:
    sp = body.item_sampling(i)
    return GenerationRequest(
        input_ids=prompt,
        media=media,
        rid=body.item_rid(i, uuid.uuid4().hex),
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop=tuple(sp.stop_list()),
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        seed=sp.sampling_seed,
        skip_special_tokens=sp.skip_special_tokens,
        no_stop_trim=sp.no_stop_trim,
        token_texts=body.return_text_in_logprobs and body.item_return_logprob(i),
        top_logprobs_num=body.item_top_logprobs_num(i),
    )


def _top_triples(
    result: GenerationResult,
) -> list[list[tuple[float | None, int, str | None]] | None] | None:
    """SGLang's `output_top_logprobs`: per output token, `[logprob, token_id, text|None]`
    triples, highest first; None when the request asked for none."""
    if result.output_top_logprobs is None:
        return None
    out: list[list[tuple[float | None, int, str | None]] | None] = []
    for k, step in enumerate(result.output_top_logprobs):
        texts: list[str | None] = (
            list(result.top_token_texts[k]) if result.top_token_texts else [None] * len(step)
        )
        out.append([(lp, t, text) for (lp, t), text in zip(step, texts, strict=True)])
    return out


def _to_response(result: GenerationResult, return_logprob: bool) -> dict[str, Any]:
    if result.finish_type == "stop":
        finish = FinishReason(type="stop", matched=result.matched)
    elif result.finish_type == "length":
        finish = FinishReason(type="length", length=len(result.output_ids))
    else:
        finish = FinishReason(type="abort", message=result.finish_message)
    logprobs = None
    top = None
    if return_logprob:
        texts: list[str | None] = (
            list(result.token_texts) if result.token_texts else [None] * len(result.output_ids)
        )
        logprobs = list(zip(result.output_logprobs, result.output_ids, texts, strict=True))
        top = _top_triples(result)
    response = GenerateResponse(
        text=result.text,
        output_ids=result.output_ids,
        meta_info=GenerateMetaInfo(
            id=result.rid,
            finish_reason=finish,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=len(result.output_ids),
            cached_tokens=result.cached_tokens,
            weight_version=str(result.weight_version),
            output_token_weight_versions=result.output_versions if return_logprob else None,
            e2e_latency=result.e2e_latency,
            output_token_logprobs=logprobs,
            output_top_logprobs=top,
        ),
    )
    return response.model_dump(exclude_none=True)


def _media_preparer(core: EngineCore, config: MediaConfig) -> MediaPreparer | None:
    """The reader and processor of `/generate`'s media; None for a text-only model."""
    if not core.media_kinds:
        return None
    processor = processor_for(core.model_path, config)
    if processor is None:
        raise ConfigError(
            f"{core.model_path}: the model takes {[k.value for k in core.media_kinds]} but "
            "omniloop has no media processor for its family"
        )
    return MediaPreparer(processor, config.max_bytes)


def create_app(core: EngineCore, media: MediaConfig | None = None) -> FastAPI:
    """The FastAPI app serving `core`; its lifespan starts and stops the scheduler thread.

    `media`: how request media are read and processed (default `MediaConfig()`); it must
    equal the config the prompts' placeholder blocks were counted with."""
    preparer = _media_preparer(core, media or MediaConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        core.start()
        try:
            yield
        finally:
            if preparer is not None:
                preparer.close()
            await asyncio.to_thread(core.shutdown)

    app = FastAPI(title="omniloop engine", lifespan=lifespan)
    app.state.core = core

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, format_validation_errors(list(exc.errors())))

    async def prepare_media(
        prompts: list[list[int]], items: list[list[MediaItem]], where: list[str]
    ) -> list[tuple[ProcessedMedia, ...]]:
        """Each prompt's media, processed; `ValueError` (a `MediaError` too) naming the item."""
        if not any(items):
            return [()] * len(prompts)
        if preparer is None or core.media_tokens is None:
            kinds = "/".join(sorted({kind.value for its in items for kind, _ in its}))
            raise ValueError(
                f"the model served ({', '.join(core.info.architectures)}) takes no {kinds} "
                "input: send input_ids alone, or serve a model that takes media "
                "(e.g. tiny-omni)"
            )
        # Blocks against items first: a mismatch is refused before anything is decoded (a
        # processor_output dict's items are counted once it is split, in `core.validate`).
        for prompt, its, prefix in zip(prompts, items, where, strict=True):
            blocks = placeholder_blocks(prompt, core.media_tokens)
            if all(isinstance(source, str) for _, source in its):
                check_counts(blocks, [kind for kind, _ in its], prefix)
        calls = [preparer.prepare(its, prefix) for its, prefix in zip(items, where, strict=True)]
        return list(await asyncio.gather(*calls))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateReqInput) -> Any:
        prompts = body.batch_input_ids()
        where = [f"prompt {i}: " if body.is_batch else "" for i in range(len(prompts))]
        try:
            media = await prepare_media(
                prompts, [body.item_media(i) for i in range(len(prompts))], where
            )
        except ValueError as err:
            return _error(400, str(err))
        requests = [_to_request(body, i, p, media[i]) for i, p in enumerate(prompts)]
        for req, prefix in zip(requests, where, strict=True):
            try:
                core.validate(req)
            except ValueError as err:
                return _error(400, f"{prefix}{err}")
        try:
            futures = [asyncio.wrap_future(core.submit(req)) for req in requests]
        except EngineError as err:
            return _error(503, str(err))
        try:
            results = await asyncio.gather(*futures)
        except EngineError as err:
            return _error(500, str(err))
        finally:
            # If this handler is cancelled (client gone), drop the requests from the batch.
            for f in futures:
                f.cancel()
        out = [_to_response(r, body.item_return_logprob(i)) for i, r in enumerate(results)]
        return out if body.is_batch else out[0]

    registry = engine_registry(core)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if core.is_alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not core.is_alive():
            return Response(status_code=503)
        if core.paused or core.updating:
            return Response(status_code=200)
        bos = core.tokenizer.bos_token_id
        req = GenerationRequest(
            input_ids=[bos if bos is not None else 0],
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            max_new_tokens=1,
            temperature=0.0,
        )
        passes = core.forward_passes
        future = asyncio.wrap_future(core.submit(req))
        deadline = asyncio.get_running_loop().time() + HEALTH_GENERATE_TIMEOUT
        try:
            while asyncio.get_running_loop().time() < deadline:
                done, _ = await asyncio.wait({future}, timeout=0.1)
                if done:
                    return Response(status_code=200 if future.exception() is None else 503)
                # A busy engine may not reach the probe soon; any forward pass completed
                # since it was queued shows the same thing (as SGLang's check does).
                if core.forward_passes > passes:
                    return Response(status_code=200)
            return Response(status_code=503)
        finally:
            future.cancel()

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        info = ModelInfo(
            model_path=str(core.model_path),
            tokenizer_path=str(core.model_path),
            is_generation=True,
            preferred_sampling_params=None,
            weight_version=str(core.weight_version),
            model_type=core.info.model_type,
            architectures=list(core.info.architectures),
            modalities=["text", *(kind.value for kind in core.media_kinds)],
        )
        return info.model_dump()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": str(core.weight_version)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        dropped = await asyncio.wrap_future(core.flush_cache())
        return PlainTextResponse(f"Cache flushed ({dropped} cached prefixes dropped).\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput) -> JSONResponse:
        version = parse_weight_version(body.weight_version)
        try:
            future = await asyncio.to_thread(
                core.update_weights_from_disk,
                body.model_path,
                version=version,
                abort_all=body.abort_all_requests,
                keep_pause=body.keep_pause,
            )
            result = await asyncio.wrap_future(future)
        except (ConfigError, EngineError, OSError) as err:
            out = UpdateWeightFromDiskReqOutput(success=False, message=str(err))
            return JSONResponse(out.model_dump(), status_code=400)
        out = UpdateWeightFromDiskReqOutput(
            success=True,
            message=(
                f"Succeeded to update model weights from {body.model_path}. "
                f"Weight version updated to {result.weight_version}."
            ),
            num_paused_requests=result.num_waiting,
        )
        return JSONResponse(out.model_dump())

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        try:
            await in_daemon_thread(
                core.init_weights_update_group,
                master_address=body.master_address,
                master_port=body.master_port,
                rank_offset=body.rank_offset,
                world_size=body.world_size,
                group_name=body.group_name,
                backend=body.backend,
            )
        except (ConfigError, EngineError) as err:
            return _success(False, f"Failed to init weights update group: {err}")
        return _success(True, f"Joined weights update group {body.group_name!r}.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        body: UpdateWeightsFromDistributedReqInput,
    ) -> JSONResponse:
        version = parse_weight_version(body.weight_version)
        try:
            future = await in_daemon_thread(
                core.update_weights_from_distributed,
                body.names,
                body.dtypes,
                body.shapes,
                group_name=body.group_name,
                flattened=body.load_format == FLATTENED_BUCKET,
                version=version,
                abort_all=body.abort_all_requests,
            )
            if version is None:
                # Answer once the part is received and queued, so the next bucket travels
                # while this one waits for the drain and its copy; the last bucket waits for
                # every part and reports any that failed to load.
                return _success(True, f"Received {len(body.names)} tensors; more to come.")
            result = await asyncio.wrap_future(future)
        except (ConfigError, EngineError, RuntimeError) as err:
            # RuntimeError: torch.distributed's (a peer gone, a timeout).
            return _success(False, f"Failed to update weights from distributed: {err}")
        return _success(
            True,
            f"Succeeded to update parameter online. Weight version updated to "
            f"{result.weight_version}.",
        )

    fetcher = WeightFetcher(core)

    @app.post("/update_weights_from_tcp")
    async def update_weights_from_tcp(body: UpdateWeightsFromTcpReqInput) -> JSONResponse:
        try:
            result, stats = await in_daemon_thread(
                fetcher.fetch,
                body.source_url,
                token=body.token,
                version=parse_weight_version(body.weight_version),
                retries=body.retries,
                timeout_s=body.timeout_s,
                abort_all=body.abort_all_requests,
            )
        except (ConfigError, EngineError) as err:
            out = UpdateWeightsFromTcpReqOutput(
                success=False, message=f"Failed to update weights from tcp: {err}"
            )
            return JSONResponse(out.model_dump(), status_code=400)
        out = UpdateWeightsFromTcpReqOutput(
            success=True,
            message=f"Weight version updated to {result.weight_version}.",
            weight_version=result.weight_version,
            bytes=stats.bytes,
            seconds=stats.seconds,
            resumed=stats.resumed,
            refetched=stats.refetched,
        )
        return JSONResponse(out.model_dump())

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(
        body: DestroyWeightsUpdateGroupReqInput | None = None,
    ) -> JSONResponse:
        name = body.group_name if body is not None else "weight_update_group"
        try:
            await in_daemon_thread(core.destroy_weights_update_group, name)
        except (ConfigError, RuntimeError) as err:
            return _success(False, f"Failed to destroy weights update group: {err}")
        return _success(True, f"Destroyed weights update group {name!r}.")

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationReqInput | None = None) -> dict[str, Any]:
        mode = body.mode if body is not None else "abort"
        await asyncio.wrap_future(core.pause(mode))
        return StatusMessage(message="Generation paused successfully.").model_dump()

    @app.post("/continue_generation")
    async def continue_generation(
        body: ContinueGenerationReqInput | None = None,
    ) -> dict[str, Any]:
        await asyncio.wrap_future(core.resume())
        return StatusMessage(message="Generation continued successfully.").model_dump()

    return app
