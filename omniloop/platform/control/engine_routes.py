"""`/v1/rollout/engines`: a run's inference engines, added and removed while it trains.

Served by the run's api role beside the REST API. The engines are the actor's (the DCS
`WeightCoordinator`): the weights go to every engine listed, and rollouts send requests to
those `in_rotation` (serving the current weights).

- `GET /v1/rollout/engines`: the engines, each with `url` and `in_rotation`.
- `POST /v1/rollout/engines` `{"url": ...}`: add an engine started anywhere (omniloop's engine
  or SGLang, reachable from the actor and the rollouts). It is given the current weights, then
  enters the rotation; answered 201 once it has. An engine that does not answer is a 422.
- `DELETE /v1/rollout/engines?url=...`: take an engine out of the rotation at once (no new
  request goes to it), wait `drain_s` (default 5) for the requests it serves, then out of the
  run (no more weights); answered once it has left. Its episodes in flight go on elsewhere.
  An engine the run launched stays out until added again by hand. 404 if not in the run.

Like every `/v1` route, these follow the server's token rules (POST and DELETE always need
the token when the server has one).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from omniloop.platform.api.problems import ApiProblem, problem_responses


class EngineEntry(BaseModel):
    """One engine of the run."""

    url: str
    in_rotation: bool
    """Serves the current weights, and rollouts send it requests."""


class EngineList(BaseModel):
    engines: list[EngineEntry]


class AddEngine(BaseModel):
    """Body of `POST /v1/rollout/engines`."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2000)
    """The engine's base URL, e.g. `http://10.0.0.7:30000`."""


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


def engine_router() -> APIRouter:
    """The `/v1/rollout/engines` routes (module docstring)."""
    router = APIRouter(prefix="/v1/rollout/engines", tags=["rollout"])

    @router.get("", response_model=EngineList, responses=problem_responses(503))
    async def list_engines() -> EngineList:
        return await _table()

    @router.post(
        "", status_code=201, response_model=EngineEntry, responses=problem_responses(422, 503)
    )
    async def add_engine(body: AddEngine) -> EngineEntry:
        url = body.url.rstrip("/")
        failure: str | None = await _actor().add_engine.remote(url)
        if failure is not None:
            raise ApiProblem(422, "engine-unusable", f"engine {url} was not added: {failure}")
        return next(e for e in (await _table()).engines if e.url == url)

    @router.delete("", response_model=RemovedEngine, responses=problem_responses(404, 503))
    async def remove_engine(
        url: str = Query(max_length=2000, description="The engine's base URL, as listed."),
        drain_s: float = Query(default=5.0, ge=0, le=600),
    ) -> RemovedEngine:
        url = url.rstrip("/")
        if not await _actor().remove_engine.remote(url, drain_s):
            raise ApiProblem(404, "no-such-engine", f"engine {url} is not in the run")
        return RemovedEngine(url=url)

    return router
