"""The request body limit, enforced before a byte of an over-long body is buffered.

A declared `Content-Length` over the limit is refused at once (413) without reading the body.
A body without one (chunked) is counted as it arrives, and the request fails with 413 as soon as
it passes the limit, so a client cannot make the server buffer more than `max_bytes`. Either way
the connection is closed after the 413.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniloop.platform.api.problems import problem_response, problem_type

CLOSE = {"Connection": "close"}
"""Sent with a 413: the server then closes the connection instead of reading (and dropping)
the rest of an oversized body."""


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with a `body-too-large` problem (413)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
                break
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                length = -1
            if length < 0:
                response = problem_response(
                    400,
                    type=problem_type("bad-request"),
                    detail=f"Content-Length {declared.decode(errors='replace')!r} is not a size",
                    instance=scope["path"],
                )
                await response(scope, receive, send)
                return
            if length > self.max_bytes:
                await self._too_large(scope, receive, send, f"{length} bytes declared")
                return

        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the app's body read; the app's handlers answer 413.
                    raise HTTPException(
                        413,
                        self._detail(f"more than {self.max_bytes} bytes sent"),
                        headers=CLOSE,
                    )
            return message

        await self.app(scope, counting_receive, send)

    def _detail(self, what: str) -> str:
        return f"the request body is limited to {self.max_bytes} bytes; {what}"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        response = problem_response(
            413,
            type=problem_type("body-too-large"),
            detail=self._detail(what),
            instance=scope["path"],
            extensions={"max_bytes": self.max_bytes},
            headers=CLOSE,
        )
        await response(scope, receive, send)
