"""Errors as RFC 9457 problem details (`application/problem+json`), for every error status.

Every error the API sends is a JSON object with `type`, `title`, `status`, `detail` and
`instance` (the request path). `type` is `about:blank` for plain HTTP errors (an unknown path,
a method a path does not allow) and `urn:omniloop:problem:<name>` for the API's own problems:

| name | status | when |
| --- | --- | --- |
| `validation-error` | 422 | a field, query parameter or header is invalid; `errors` lists each |
| `idempotency-key-reused` | 422 | an `Idempotency-Key` was first used with a different body |
| `idempotency-key-in-use` | 409 | the first request with that key is still being handled |
| `not-found` | 404 | the episode or run does not exist |
| `invalid-transition` | 409 | e.g. cancelling an episode that already completed |
| `bad-request` | 400 | a body or `Content-Length` that cannot be parsed |
| `unauthorized` | 401 | no or another bearer token where one is needed (see `auth.py`) |
| `body-too-large` | 413 | the body is over `limits.max_body_bytes` |
| `not-ready` | 503 | the database or the episode worker is not usable |
| `queue-full` | 503 | `max_queued_episodes` episodes queued: nothing created; see `Retry-After` |
| `internal-error` | 500 | a bug; the detail says nothing about internals |

A validation problem's `errors` is a list of `{"location", "field", "message", "type"}`:
`location` is `body`, `query`, `header` or `path`; `field` is the dotted path inside it
(`task.prompt`, `limit`, `idempotency-key`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from omniloop.platform.store import (
    Conflict,
    IdempotencyConflict,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    QueueFull,
    SchemaNotReady,
    StoreError,
)
from omniloop.platform.store.engine import json_dumps

logger = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"


def problem_type(name: str) -> str:
    """The `type` URI of one of the API's own problems (see the module docstring)."""
    return f"urn:omniloop:problem:{name}"


class FieldError(BaseModel):
    """One invalid input of a validation problem."""

    location: str
    """`body`, `query`, `header` or `path`."""
    field: str
    """Dotted path of the input inside its location, e.g. `task.prompt`."""
    message: str
    type: str
    """Machine-readable kind, e.g. `string_too_long`, `missing`, `unknown_agent`."""


class Problem(BaseModel):
    """An RFC 9457 problem document; problems may add extension members (`errors`, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int = Field(ge=400, le=599)
    detail: str | None = None
    instance: str | None = None
    errors: list[FieldError] | None = None
    """Only on validation problems: every invalid input."""


class ApiProblem(Exception):
    """Raise inside a handler to answer with a problem document."""

    def __init__(
        self,
        status: int,
        name: str,
        detail: str,
        *,
        title: str | None = None,
        headers: Mapping[str, str] | None = None,
        errors: Sequence[FieldError] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.name = name
        self.detail = detail
        self.title = title or HTTPStatus(status).phrase
        self.headers = dict(headers or {})
        self.errors = list(errors) if errors is not None else None
        self.extensions = extensions


def validation_problem(errors: Sequence[FieldError], detail: str | None = None) -> ApiProblem:
    """A 422 naming each bad input."""
    listed = "; ".join(f"{e.location}.{e.field}: {e.message}" for e in errors)
    return ApiProblem(
        422,
        "validation-error",
        detail or f"invalid request: {listed}",
        title="Invalid request",
        errors=errors,
    )


def problem_response(
    status: int,
    *,
    type: str = "about:blank",
    title: str | None = None,
    detail: str | None = None,
    instance: str | None = None,
    headers: Mapping[str, str] | None = None,
    errors: Sequence[FieldError] | None = None,
    extensions: Mapping[str, Any] | None = None,
) -> Response:
    """A complete problem+json response (usable from ASGI middleware, before routing)."""
    doc: dict[str, Any] = {
        "type": type,
        "title": title or HTTPStatus(status).phrase,
        "status": status,
    }
    if detail is not None:
        doc["detail"] = detail
    if instance is not None:
        doc["instance"] = instance
    if errors is not None:
        doc["errors"] = [e.model_dump() for e in errors]
    for key, value in (extensions or {}).items():
        doc.setdefault(key, value)
    body = json_dumps(doc, default=str)
    return Response(body, status_code=status, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def _field_errors(raw: Sequence[Any]) -> list[FieldError]:
    fields = []
    for error in raw:
        loc = [str(part) for part in error.get("loc", ())]
        location = loc[0] if loc else "body"
        fields.append(
            FieldError(
                location=location,
                field=".".join(loc[1:]) or location,
                message=str(error.get("msg", "invalid")),
                type=str(error.get("type", "invalid")),
            )
        )
    return fields


def _http_detail(request: Request, exc: StarletteHTTPException) -> str:
    phrase = HTTPStatus(exc.status_code).phrase
    if exc.detail and exc.detail != phrase:
        return str(exc.detail)
    if exc.status_code == 404:
        return f"no endpoint at {request.url.path}"
    if exc.status_code == 405:
        return (
            f"{request.url.path} does not allow {request.method}; "
            f"it allows {_allowed_methods(request)}"
        )
    return phrase


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path. (The router's own `Allow` names
    only the first route that matched the path, when several do.)"""
    methods = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            methods.append(method)
    return ", ".join(methods)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


# The statuses and problem names store errors map to (see store/errors.py).
_STORE_PROBLEMS: list[tuple[type[StoreError], int, str]] = [
    (NotFound, 404, "not-found"),
    (IdempotencyConflict, 422, "idempotency-key-reused"),
    (InvalidTransition, 409, "invalid-transition"),
    (Conflict, 409, "conflict"),
    (InvalidArgument, 400, "bad-request"),
    (SchemaNotReady, 503, "not-ready"),
    (QueueFull, 503, "queue-full"),
]


def install_problem_handlers(app: FastAPI) -> None:
    """Answer every error of `app` with a problem document."""

    async def on_problem(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiProblem)
        return problem_response(
            exc.status,
            type=problem_type(exc.name),
            title=exc.title,
            detail=exc.detail,
            instance=request.url.path,
            headers=exc.headers,
            errors=exc.errors,
            extensions=exc.extensions,
        )

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        name = {401: "unauthorized", 413: "body-too-large", 400: "bad-request"}.get(exc.status_code)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)
        return problem_response(
            exc.status_code,
            type=problem_type(name) if name else "about:blank",
            detail=_http_detail(request, exc),
            instance=request.url.path,
            headers=headers,
        )

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problem = validation_problem(_field_errors(exc.errors()))
        return await on_problem(request, problem)

    async def on_store(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StoreError)
        status, name = next(
            ((s, n) for kind, s, n in _STORE_PROBLEMS if isinstance(exc, kind)),
            (500, "internal-error"),
        )
        extensions: dict[str, Any] = {}
        if isinstance(exc, IdempotencyConflict):
            extensions["episode_id"] = exc.episode_id
        return await on_problem(request, ApiProblem(status, name, str(exc), **extensions))

    async def on_crash(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return problem_response(
            500,
            type=problem_type("internal-error"),
            detail="the server failed to handle the request; the error is in its log",
            instance=request.url.path,
        )

    app.add_exception_handler(ApiProblem, on_problem)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StoreError, on_store)
    app.add_exception_handler(Exception, on_crash)


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting problem documents for `statuses`."""
    return {
        status: {
            "description": HTTPStatus(status).phrase,
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for status in statuses
    }
