"""The gateway's HTTP API: OpenAI's `/v1/chat/completions` and `/v1/models`, and sessions.

Routes (an OpenAI client's `base_url` is `http://HOST:PORT/v1`, or `.../v1/sessions/ID` to put
its calls in session `ID`):
- `POST /v1/chat/completions`, `POST /v1/sessions/{id}/chat/completions`: a completion, or with
  `stream: true` server-sent chunks (`data: {...}` lines, then `data: [DONE]`). The session is
  the path's, else the `X-Omniloop-Session` header's, else a new one; the answer names it in
  the `X-Omniloop-Session` header. Beside OpenAI's fields a choice carries `token_ids` (the
  sampled ids) and the response `omniloop` (session, segments, weight version).
- `GET /v1/models`, `GET /v1/sessions/{id}/models`.
- `GET /v1/sessions/{id}`: the session's prefix-stability counts and its segments as
  trajectories; `DELETE` the same, and forgets the session.

With a token, every route needs `Authorization: Bearer <token>` (an OpenAI client's
`api_key`). Errors are OpenAI's shape, `{"error": {"message", "type", "code"}}`: 400 for a
request the gateway cannot take (the message names the field), 401, 404 for an unknown
session, 502 when the engine fails, 429 with `Retry-After` when it aborted the request (a
weight sync) and the gateway does not hold calls (`Gateway.on_abort`), 503 (with
`Retry-After` when it is worth retrying) while no engine is at hand (`GatewayUnavailable`).

`gateway_router(routes)` is these routes as a FastAPI router, for a server that serves more
(`omniloop serve` mounts it beside its REST API, whose token guard then decides who may call);
`create_gateway_app` is a server of the gateway alone.

Streaming sends the reply once it is sampled, in pieces: each token's text (or, for a reply
with tool calls, its content and then each call), with the same ids and text as a
non-streaming call with the same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Protocol

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from omniloop.errors import EngineError
from omniloop.gateway.completions import (
    Choice,
    ContextLengthError,
    EngineAborted,
    Gateway,
    TurnLimitError,
)
from omniloop.gateway.openai_wire import ChatCompletionRequest

SESSION_HEADER = "X-Omniloop-Session"


def _error(
    status: int, message: str, kind: str, code: str | None = None, **headers: str
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return JSONResponse(body, status_code=status, headers=headers or None)


def _logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _logprobs(choice: Choice, start: int = 0, end: int | None = None) -> dict[str, Any]:
    texts, logprobs = choice.token_texts[start:end], choice.logprobs[start:end]
    tops = choice.top_logprobs[start:end] or [[] for _ in texts]
    return {
        "content": [
            {**_logprob(t, lp), "top_logprobs": [_logprob(*alt) for alt in top]}
            for t, lp, top in zip(texts, logprobs, tops, strict=True)
        ]
    }


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompt = choices[0].prompt_tokens
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _extension(choices: list[Choice], session: str) -> dict[str, Any]:
    return {
        "session": session,
        "segments": [c.segment for c in choices],
        "weight_version": max(c.weight_version for c in choices),
    }


def completion_body(
    gateway: Gateway, request: ChatCompletionRequest, choices: list[Choice], session: str
) -> dict[str, Any]:
    """The non-streaming response."""
    return {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": gateway.model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c) if request.logprobs else None,
                "token_ids": c.token_ids,
            }
            for c in choices
        ],
        "usage": _usage(choices),
        "omniloop": _extension(choices, session),
    }


def stream_chunks(
    gateway: Gateway, request: ChatCompletionRequest, choices: list[Choice], session: str
) -> list[dict[str, Any]]:
    """The streamed response's chunks, in order (module docstring)."""
    base = {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": gateway.model,
    }

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**base, "choices": [{**choice, **extra}]}

    chunks = []
    for c in choices:
        chunks.append(chunk(c.index, {"role": "assistant", "content": ""}))
        if c.tool_calls:
            if c.content:
                chunks.append(chunk(c.index, {"content": c.content}))
            for i, call in enumerate(c.tool_calls):
                chunks.append(chunk(c.index, {"tool_calls": [{"index": i, **call}]}))
        else:
            # Each token's text, up to the content (a cut stop string is not sent).
            sent = 0
            wanted = c.content or ""
            for i, text in enumerate(c.token_texts):
                piece = wanted[sent : sent + len(text)] if sent < len(wanted) else ""
                sent += len(piece)
                extra = {"logprobs": _logprobs(c, i, i + 1)} if request.logprobs else {}
                delta = {"content": piece}
                chunks.append(chunk(c.index, delta, token_ids=[c.token_ids[i]], **extra))
        final: dict[str, Any] = {"finish_reason": c.finish_reason}
        if request.logprobs and c.tool_calls:
            final["logprobs"] = _logprobs(c)
        chunks.append(chunk(c.index, {}, **final))
    last = {**base, "choices": [], "omniloop": _extension(choices, session)}
    if request.include_usage:
        last["usage"] = _usage(choices)
    chunks.append(last)
    return chunks


class GatewayUnavailable(Exception):
    """No gateway can answer now (e.g. the server's engine is starting, or it runs none)."""

    def __init__(self, reason: str, retry_after: int | None = None) -> None:
        """`reason`: what the client is told; `retry_after`: seconds worth waiting before a
        retry (None: retrying will not help until the server is changed)."""
        super().__init__(reason)
        self.retry_after = retry_after


class Routes(Protocol):
    """Which gateway serves a session, and who may call it."""

    def gateway_for(self, session_id: str | None) -> Gateway | None:
        """The gateway of `session_id` (None: of a call naming no session); None if none.
        Raises `GatewayUnavailable` when no gateway can answer now."""
        ...

    def authorized(self, session_id: str | None, authorization: str) -> bool:
        """Whether a call with this `Authorization` header may use the session."""
        ...


class OneGateway:
    """`Routes` of one gateway for every session, behind one token (or none)."""

    def __init__(self, gateway: Gateway, token: str | None = None) -> None:
        self.gateway = gateway
        self.token = token

    def gateway_for(self, session_id: str | None) -> Gateway | None:
        return self.gateway

    def authorized(self, session_id: str | None, authorization: str) -> bool:
        return self.token is None or bearer_matches(authorization, self.token)


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an `Authorization` header carries `token` (compared in constant time)."""
    return secrets.compare_digest(authorization.encode(), f"Bearer {token}".encode())


class OpenAIErrorRoute(APIRoute):
    """A route whose invalid requests are answered in OpenAI's error shape (400), whatever
    the application around it answers for its own routes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                problems = []
                for err in exc.errors():
                    where = ".".join(str(p) for p in err["loc"] if p != "body")
                    problems.append(f"{where}: {err['msg']}" if where else str(err["msg"]))
                return _error(400, "; ".join(problems), "invalid_request_error")

        return handle


def gateway_router(routes: Routes, *, include_in_schema: bool = True) -> APIRouter:
    """The gateway's routes (module docstring) over `routes`."""
    router = APIRouter(route_class=OpenAIErrorRoute, include_in_schema=include_in_schema)

    def resolve(request: Request, session_id: str | None) -> Gateway | JSONResponse:
        if not routes.authorized(session_id, request.headers.get("authorization", "")):
            return _error(401, "a valid bearer token (api_key) is required",
                          "authentication_error", "invalid_api_key")  # fmt: skip
        try:
            found = routes.gateway_for(session_id)
        except GatewayUnavailable as err:
            retry = {} if err.retry_after is None else {"Retry-After": str(err.retry_after)}
            return _error(503, str(err), "server_error", "unavailable", **retry)
        if found is None:
            return _error(404, f"no session {session_id!r}", "invalid_request_error", "not_found")
        return found

    def models(request: Request, session_id: str | None = None) -> Any:
        found = resolve(request, session_id)
        if isinstance(found, JSONResponse):
            return found
        entry = {"id": found.model, "object": "model", "created": 0, "owned_by": "omniloop"}
        return {"object": "list", "data": [entry]}

    router.get("/v1/models")(models)
    router.get("/v1/sessions/{session_id}/models")(models)

    async def complete(
        body: ChatCompletionRequest, request: Request, session_id: str | None
    ) -> Any:
        found = resolve(request, session_id)
        if isinstance(found, JSONResponse):
            return found
        session_id = session_id or found.new_session_id()
        try:
            choices = await found.complete(body, session_id)
        except ContextLengthError as err:
            return _error(400, str(err), "invalid_request_error", "context_length_exceeded")
        except TurnLimitError as err:
            return _error(400, str(err), "invalid_request_error", "max_turns")
        except EngineAborted as err:
            retry = {"Retry-After": "1"}
            return _error(429, str(err), "rate_limit_error", "engine_aborted", **retry)
        except EngineError as err:
            return _error(502, f"the engine failed: {err}", "server_error", "engine_error")
        except ValueError as err:
            return _error(400, str(err), "invalid_request_error")
        headers = {SESSION_HEADER: session_id}
        if not body.stream:
            answer = completion_body(found, body, choices, session_id)
            return JSONResponse(answer, headers=headers)
        chunks = stream_chunks(found, body, choices, session_id)

        async def events() -> AsyncIterator[str]:
            for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await complete(body, request, request.headers.get(SESSION_HEADER))

    @router.post("/v1/sessions/{session_id}/chat/completions")
    async def session_chat_completions(
        session_id: str, body: ChatCompletionRequest, request: Request
    ) -> Any:
        return await complete(body, request, session_id)

    def session_view(request: Request, session_id: str, forget: bool) -> Any:
        found = resolve(request, session_id)
        if isinstance(found, JSONResponse):
            return found
        recording = found.close(session_id) if forget else found.recording(session_id)
        if recording is None:
            return _error(404, f"no session {session_id!r}", "invalid_request_error", "not_found")
        return {
            "session": session_id,
            **recording.stats(),
            "trajectories": [
                t.model_dump(mode="json") for t in found.trajectories(recording, session_id)
            ],
        }

    @router.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Any:
        return session_view(request, session_id, forget=False)

    @router.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> Any:
        return session_view(request, session_id, forget=True)

    return router


def create_gateway_app(gateway: Gateway | Routes, *, token: str | None = None) -> FastAPI:
    """The gateway's FastAPI application (module docstring): one gateway behind `token`, or
    the sessions of several (`Routes`)."""
    routes = OneGateway(gateway, token) if isinstance(gateway, Gateway) else gateway
    app = FastAPI(title="omniloop gateway", version="1")
    app.include_router(gateway_router(routes))
    return app


class QuietServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: a gateway served inside another program
    (a run's rollout) leaves SIGINT and SIGTERM to that program."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def start_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> tuple[QuietServer, asyncio.Task[None], str]:
    """`app` under uvicorn in this event loop, without signal handlers: the server, its task,
    and its base URL once it listens. Stop it with `server.should_exit = True` and await the
    task."""
    # No lifespan (the app has no start-up or shut-down work): a server that lives as long as
    # its event loop is then cancelled with the loop's other tasks, without a traceback.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
    server = QuietServer(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("the gateway's server stopped before it started")
        await asyncio.sleep(0.005)
    bound = server.servers[0].sockets[0].getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return server, serving, f"http://{shown}:{bound[1]}"


@contextlib.asynccontextmanager
async def serve_gateway(
    gateway: Gateway | Routes,
    *,
    token: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
) -> AsyncIterator[str]:
    """The gateway under uvicorn in this event loop for the block; yields its base URL
    (`http://HOST:PORT`, port 0 picks a free one)."""
    app = create_gateway_app(gateway, token=token)
    server, serving, url = await start_server(app, host, port, log_level)
    try:
        yield url
    finally:
        server.should_exit = True
        await serving
