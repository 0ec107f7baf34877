"""OpenAI-compatible chat completions on the REST server: the gateway (`omniloop.gateway`)
over the engine the server's episode worker runs.

`omniloop serve` serves the gateway's routes (`/v1/chat/completions`, `/v1/models`,
`/v1/sessions/{id}...`, see `omniloop.gateway.app`) beside its REST API, behind the same token
guard as every other `/v1` route: with a token, a completion (a POST) always needs it, and on
a server bound beyond loopback so do the reads. They are OpenAI's API, so they are not in the
server's OpenAPI document, and their errors are OpenAI's shape (the guard's 401 excepted,
which is a problem document like every other 401 of the server).

The gateway exists while the worker's engine runs, and shares it with the episodes. While the
engine starts, its routes answer 503 with `Retry-After`; on a server that runs no engine
(`concurrency: 0`, or no agents) or whose worker failed, 503 saying why. Sessions live in the
server's memory: its `max_sessions` most recent, lost when it restarts.
"""

from __future__ import annotations

from collections.abc import Callable

from omniloop.gateway.app import GatewayUnavailable
from omniloop.gateway.completions import Gateway
from omniloop.platform.api.worker import EpisodeWorker

STARTING_RETRY_AFTER = 5
"""`Retry-After` seconds while the engine starts (a local engine loads in seconds)."""


class WorkerGateway:
    """`Routes` (`omniloop.gateway.app`) to the gateway of the server's episode worker."""

    def __init__(self, worker: Callable[[], EpisodeWorker | None]) -> None:
        """`worker`: the server's worker (None before the server has started one)."""
        self._worker = worker

    def gateway_for(self, session_id: str | None) -> Gateway | None:
        worker = self._worker()
        if worker is not None and worker.gateway is not None:
            return worker.gateway
        if worker is None or worker.state == "starting":
            raise GatewayUnavailable("the server's engine is starting", STARTING_RETRY_AFTER)
        if worker.state == "paused":
            raise GatewayUnavailable(
                "this server runs no engine (it has `concurrency: 0` or no agents); give it "
                "an agent and a concurrency, or serve a gateway alone with `omniloop gateway "
                "serve --engine-url ...`"
            )
        why = f": {worker.error}" if worker.error else ""
        raise GatewayUnavailable(f"the server's engine is not running (worker {worker.state}{why})")

    def authorized(self, session_id: str | None, authorization: str) -> bool:
        # The server's token guard decided before routing (`auth.TokenGuardMiddleware`).
        return True
