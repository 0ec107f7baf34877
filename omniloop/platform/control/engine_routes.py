"""`/v1/rollout/engines`: a run's inference engines, added and removed while it trains.

Served by the run's api role beside the REST API. The engines are the actor's (the DCS
`WeightCoordinator`): the weights go to every engine listed, and rollouts send requests to
those `in_rotation` (serving the current weights).

- `GET /v1/rollout/engines`: the engines, each with `url` and `in_rotation`.
- `POST /v1/rollout/engines` `{"url": ...}`: add an engine started anywhere (omniloop's engine
  or SGLang, reachable from the actor and the rollouts). It is given the current weights, then
  enters the rotation; answered 201 once it has. An engine that does not answer is a 422.
- `POST /v1/rollout/engines` `{"launch": true}`: the run launches one more engine of its model
  (an `EngineLauncher`: on services, a Serve application of its own on the engine role's
  placement); answered 201 once it is in rotation with the current weights, 422 when it could
  not be launched, 501 where the server launches none.
- `DELETE /v1/rollout/engines?url=...`: take an engine out of the rotation at once (no new
  request goes to it), wait `drain_s` (default 5) for the requests it serves, then out of the
  run (no more weights); answered once it has left. Its episodes in flight go on elsewhere.
  An engine launched on request is then stopped; one of the run's own engines stays out
  until added again by hand. 404 if not in the run.

Like every `/v1` route, these follow the server's token rules (POST and DELETE always need
the token when the server has one).

The same table is in the api role's `/metrics` (`RunEnginesCollector`), one series per engine
labelled `engine` (its URL): `omniloop_dcs_engine_in_rotation`,
`omniloop_dcs_engine_weight_version`, `omniloop_dcs_engine_updates_total`,
`omniloop_dcs_engine_update_bytes_total`, `omniloop_dcs_engine_update_seconds_total` and
`omniloop_dcs_engine_last_update_seconds`. An engine that leaves the run leaves the scrape; one
that joins again (or restarts) counts from zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from fastapi import APIRouter, Query
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omniloop.errors import EngineError
from omniloop.platform.api.problems import ApiProblem, problem_responses

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
"""How long a `/metrics` scrape waits for the actor's engine table before leaving it out."""


class EngineEntry(BaseModel):
    """One engine of the run, and the weight updates it received since it joined."""

    url: str
    in_rotation: bool
    """Serves the current weights, and rollouts send it requests."""
    weight_version: int
    """The version of the weights it serves."""
    updates: int
    """Weight updates it received."""
    bytes: int
    """Bytes of weights those updates delivered."""
    update_seconds: float
    """Seconds of the publishes that updated it, summed (a broadcast updates every engine in
    the same seconds)."""
    last_update_seconds: float | None
    """Seconds of its newest update; null before the first."""


class EngineList(BaseModel):
    engines: list[EngineEntry]


class AddEngine(BaseModel):
    """Body of `POST /v1/rollout/engines`: exactly one of `url` and `launch`."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2000)
    """The base URL of an engine started elsewhere, e.g. `http://10.0.0.7:30000`."""
    launch: bool = False
    """Have the run launch one more engine of its model."""

    @model_validator(mode="after")
    def _one_of(self) -> AddEngine:
        if (self.url is None) == (not self.launch):
            raise ValueError('give either "url" (an engine to add) or "launch": true')
        return self


class EngineLauncher(Protocol):
    """Starts and stops engines for the run (`deployments.ServeEngineLauncher`)."""

    async def launch(self) -> str:
        """Start an engine; its URL once it is in rotation. Raises `EngineError`."""
        ...

    async def stop(self, url: str) -> bool:
        """Stop the engine at `url` if it was launched here; whether it was."""
        ...


class RemovedEngine(BaseModel):
    url: str
    removed: bool = True


def _actor() -> Any:
    import ray
    from ray import serve

    if not ray.is_initialized():  # not inside a run (a Serve replica is always in Ray)
        raise ApiProblem(503, "no-actor", "no run's actor role is reachable from this server")
    try:
        return serve.get_app_handle("actor")
    except Exception as err:  # the actor role is not deployed (yet)
        raise ApiProblem(503, "no-actor", f"the run's actor role is not up: {err}") from err


async def _table() -> EngineList:
    rows: list[dict[str, Any]] = await _actor().engine_table.remote()
    return EngineList(engines=[EngineEntry.model_validate(r) for r in rows])


class RunEnginesCollector:
    """The run's engines and their weight updates, read from the actor at each scrape."""

    def __init__(self) -> None:
        self.engines: list[EngineEntry] = []

    async def refresh(self) -> None:
        try:
            self.engines = (await asyncio.wait_for(_table(), SCRAPE_TIMEOUT_S)).engines
        except Exception as err:  # no actor (yet, or not in a run, or busy): no series
            log.debug("engine table unreadable for /metrics: %s", err)
            self.engines = []

    def describe(self) -> Iterable[Metric]:
        return self._families([])

    def collect(self) -> Iterable[Metric]:
        return self._families(self.engines)

    @staticmethod
    def _families(engines: list[EngineEntry]) -> list[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"omniloop_dcs_engine_{name}", doc, labels=["engine"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"omniloop_dcs_engine_{name}", doc, labels=["engine"])

        in_rotation = gauge("in_rotation", "1 while rollouts send the engine requests.")
        version = gauge("weight_version", "The version of the weights the engine serves.")
        updates = counter("updates", "Weight updates the engine received since it joined.")
        nbytes = counter("update_bytes", "Bytes of weights delivered to the engine.")
        seconds = counter("update_seconds", "Seconds of the publishes that updated the engine.")
        last = gauge("last_update_seconds", "Seconds of the engine's newest weight update.")
        for e in engines:
            in_rotation.add_metric([e.url], float(e.in_rotation))
            version.add_metric([e.url], e.weight_version)
            updates.add_metric([e.url], e.updates)
            nbytes.add_metric([e.url], e.bytes)
            seconds.add_metric([e.url], e.update_seconds)
            if e.last_update_seconds is not None:
                last.add_metric([e.url], e.last_update_seconds)
        return [in_rotation, version, updates, nbytes, seconds, last]


def engine_router(launcher: EngineLauncher | None = None) -> APIRouter:
    """The `/v1/rollout/engines` routes (module docstring); `launcher` serves `launch`."""
    router = APIRouter(prefix="/v1/rollout/engines", tags=["rollout"])

    @router.get("", response_model=EngineList, responses=problem_responses(503))
    async def list_engines() -> EngineList:
        return await _table()

    @router.post(
        "",
        status_code=201,
        response_model=EngineEntry,
        responses=problem_responses(422, 501, 503),
    )
    async def add_engine(body: AddEngine) -> EngineEntry:
        actor = _actor()
        if body.url is None:
            if launcher is None:
                raise ApiProblem(501, "no-launcher", "this server launches no engines")
            try:
                url = await launcher.launch()
            except EngineError as err:
                raise ApiProblem(422, "engine-unusable", str(err)) from err
        else:
            url = body.url.rstrip("/")
            failure: str | None = await actor.add_engine.remote(url)
            if failure is not None:
                raise ApiProblem(422, "engine-unusable", f"engine {url} was not added: {failure}")
        entry = next((e for e in (await _table()).engines if e.url == url), None)
        if entry is None:  # it failed an update, or was removed, right after it joined
            raise ApiProblem(422, "engine-unusable", f"engine {url} left the run as it joined")
        return entry

    @router.delete("", response_model=RemovedEngine, responses=problem_responses(404, 503))
    async def remove_engine(
        url: str = Query(max_length=2000, description="The engine's base URL, as listed."),
        drain_s: float = Query(default=5.0, ge=0, le=600),
    ) -> RemovedEngine:
        url = url.rstrip("/")
        detached = await _actor().remove_engine.remote(url, drain_s)
        stopped = launcher is not None and await launcher.stop(url)
        if not (detached or stopped):
            raise ApiProblem(404, "no-such-engine", f"engine {url} is not in the run")
        return RemovedEngine(url=url)

    return router
