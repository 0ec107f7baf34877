"""Who must show the bearer token, decided by method and path before any route runs.

The rule (`AccessPolicy.needs_token`), for a server with a token:

- every request that may change something (any method but GET, HEAD and OPTIONS) needs it;
- on a server bound beyond loopback, every request under `/v1` needs it too, reads and event
  streams included, and `/metrics` does unless `metrics_need_token` is off;
- `/healthz`, `/readyz`, the OpenAPI document, `/docs` and the dashboard's static files never
  do (they hold no data; the dashboard asks the user for the token when the API answers 401).

A server without a token (allowed on loopback only) needs none. The guard is ASGI middleware
that matches path prefixes, not a dependency of each route, so a route added later under `/v1`
(by the API or by `extra_routes`) is guarded without anyone remembering to. Its 401s are
counted by the request metrics under the route label `unmatched`, since they are answered
before routing.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from omniloop.platform.api.problems import problem_response, problem_type
from omniloop.platform.api.settings import ApiSettings, is_loopback

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that only read; every other method needs the token wherever there is one."""
API_PREFIX = "/v1"
METRICS_PATH = "/metrics"
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="omniloop"'}


@dataclass(frozen=True)
class AccessPolicy:
    """The token rule of one server (see the module docstring)."""

    token: bytes | None
    """The server's token; None: an open server (loopback only)."""
    reads_need_token: bool
    """Reads under `/v1` need the token: the server binds beyond loopback."""
    metrics_need_token: bool
    """`/metrics` needs the token (only where reads do)."""

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> AccessPolicy:
        token = settings.token_bytes()
        beyond = token is not None and not is_loopback(settings.host)
        return cls(
            token=token,
            reads_need_token=beyond,
            metrics_need_token=beyond and settings.metrics_need_token,
        )

    def needs_token(self, method: str, path: str) -> bool:
        """Whether a `method` request for `path` (or a route template) must carry the token."""
        if self.token is None:
            return False
        if method.upper() not in SAFE_METHODS:
            return True
        if path == API_PREFIX or path.startswith(f"{API_PREFIX}/"):
            return self.reads_need_token
        if path == METRICS_PATH:
            return self.metrics_need_token
        return False

    def check(self, authorization: str | None) -> str | None:
        """None when `authorization` (the header's value) carries the token, else why not.

        The comparison takes the same time whatever the given token shares with the real one.
        """
        assert self.token is not None
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return "this endpoint needs `Authorization: Bearer <token>` with the server's token"
        if not hmac.compare_digest(credentials.strip().encode(), self.token):
            return "the bearer token is not the server's"
        return None


class TokenGuardMiddleware:
    """Answer requests that need the token and lack it with an `unauthorized` problem (401)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.policy.needs_token(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        refused = self.policy.check(authorization)
        if refused is None:
            await self.app(scope, receive, send)
            return
        response = problem_response(
            401,
            type=problem_type("unauthorized"),
            detail=refused,
            instance=scope["path"],
            headers=CHALLENGE,
        )
        await response(scope, receive, send)
