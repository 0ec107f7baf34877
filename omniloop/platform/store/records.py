"""What the run store hands back: immutable pydantic records, detached from any session.

Records never hold a live database object, so they can cross threads, be cached, and be
serialized by the REST layer without lazy loads firing against a closed session.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field

from omniloop.trajectory import Trajectory

RunStatus = Literal["created", "running", "completed", "failed", "cancelled"]
"""A run's lifecycle. Any status may follow any other: a finished run can be resumed."""

EpisodeStatus = Literal["queued", "running", "completed", "failed", "cancelled"]
"""An episode's lifecycle: `queued` → `running` → one terminal status (the last three)."""

RUN_STATUSES: frozenset[str] = frozenset(get_args(RunStatus))
EPISODE_STATUSES: frozenset[str] = frozenset(get_args(EpisodeStatus))
TERMINAL_EPISODE_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
TERMINAL_RUN_STATUSES: frozenset[str] = TERMINAL_EPISODE_STATUSES

T = TypeVar("T")


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunRecord(_Record):
    """One training or rollout run."""

    id: str
    name: str
    status: RunStatus
    config: dict[str, Any]
    """The resolved configuration the run was started with."""
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    """When the run last entered a terminal status; None while it is live."""
    status_reason: str | None = None
    """Why the run is in its status, in a sentence, where there is something to say: the
    error that failed it, the `stop_when` target that ended it before its last step. None
    while it is live and for a run that simply ran its steps."""


class EpisodeRecord(_Record):
    """One episode: what was asked, where it stands, and a summary of its trajectory."""

    id: str
    run_id: str | None
    """None for episodes submitted through the REST API outside any run."""
    status: EpisodeStatus
    task: dict[str, Any]
    agent: str
    sampling: dict[str, Any]
    """Sampling options (temperature, max_tokens, ...) as submitted."""
    reward: float | None
    reward_info: dict[str, float]
    """Named reward components."""
    stop_reason: str | None
    error_type: str | None
    error_message: str | None
    timings: dict[str, float]
    num_turns: int | None
    response_length: int | None
    trajectory_id: str | None
    """Id of the stored trajectory (DESIGN.md §2); None until the episode is finished."""
    idempotency_key: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    trajectory: Trajectory | None = None
    """The full trajectory; filled only by `Store.get_episode(..., with_trajectory=True)`."""


class EventRecord(_Record):
    """One entry of an episode's or run's event stream; `id` is the SSE event id."""

    id: int
    """Strictly increasing in commit order (see `Store.append_event`)."""
    run_id: str | None
    episode_id: str | None
    type: str
    data: dict[str, Any]
    created_at: datetime


class MetricPoint(_Record):
    """One value of one metric at one step."""

    step: int
    value: float
    """NaN when the recorded value was NaN (a diverged loss is data, not an error)."""
    time: datetime
    """When the value was (last) recorded."""


class RunSummary(_Record):
    """A run at a glance (the dashboard's runs list): progress, reward trend, failures.

    Progress and reward follow one metric, `reward/mean` (`SUMMARY_METRIC` in `store.py`),
    which a training run records at every step it trains (`step_metrics`).
    """

    run_id: str
    steps_done: int
    """The newest step with a `reward/mean` value, plus one (steps count from 0); 0 before the
    first. A resumed run that logs its last steps again does not count them twice."""
    latest_reward: float | None
    """`reward/mean` at the newest step (NaN where it was recorded as NaN, e.g. a step whose
    episodes all failed); None before the first step."""
    reward_trend: list[MetricPoint]
    """`reward/mean` at up to `trend_points` steps spread evenly from the first recorded step to
    the newest, both included, in step order (every step when there are no more than that).
    Sampled, not averaged: each point is a recorded value."""
    infra_errors: int
    """Episodes of the run that ended in an infrastructure or input failure (stop reason
    `sandbox_error`, `reward_error`, `engine_error`, `media_error` or `cancelled`: those
    training leaves out, and `episodes/errors` counts)."""


class RoleFaults(_Record):
    """The faults one role of a run has had (events of type `fault`, see `Store.role_faults`)."""

    run_id: str
    role: str
    """The role the fault events name (`rollout`, `advantage`, `actor`), as text; `unknown` for
    an event without a `role`."""
    count: int
    """Fault events of the role."""
    latest_recovery_seconds: float | None
    """`recovery_seconds` of the role's newest fault that recovered; None when none has (or
    that event holds no finite number there)."""


class Page(BaseModel, Generic[T]):
    """One page of a keyset-paginated listing."""

    model_config = ConfigDict(frozen=True)

    items: list[T] = Field(default_factory=list)
    next_cursor: str | None = None
    """Pass back as `cursor` for the next page; None when this is the last page."""
