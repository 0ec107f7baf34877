"""Request and response bodies of the REST API (`*Request` in, `*Out` back).

Input models forbid unknown fields and bound every string and list, so a request that is too
big in any one place is refused with a validation problem naming the field, before anything is
stored. The body as a whole is bounded by `ApiLimits.max_body_bytes` (413).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
)

from omniloop.platform.api.settings import AGENT_NAME_PATTERN
from omniloop.platform.store import (
    EpisodeRecord,
    EpisodeStatus,
    EventRecord,
    RunRecord,
    RunStatus,
    RunSummary,
)
from omniloop.platform.store.store import UNKNOWN_ROLE
from omniloop.trajectory import Trajectory

MAX_TASK_ID = 128
MAX_TEXT = 100_000
"""Most characters in a prompt or one message."""
MAX_MESSAGES = 256
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_METADATA_KEYS = 64
MAX_PAGE_SIZE = 200
DEFAULT_PAGE_SIZE = 50

MAX_TURNS_FIELD = "max_turns"
"""Key under which an episode's turn limit is kept in its stored sampling document."""

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]


def _not_a_bool(value: Any) -> Any:
    # JSON `true` is no number, though Python's bool is an int: refuse it where numbers go.
    if isinstance(value, bool):
        raise ValueError("must be a number, not true or false")
    return value


# After the constraints in `Annotated[...]`, or they leave the JSON schema.
NOT_BOOL = BeforeValidator(_not_a_bool)


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "messages"
    return None


def _finite_json(value: Any) -> Any:
    """Refuse NaN and infinities anywhere inside `value`: JSON has no such numbers (Python's
    parser accepts `NaN` and `Infinity` all the same), and the store keeps strict JSON."""
    stack = [value]
    while stack:  # iterative: a deeply nested document must not exhaust the call stack
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item} is not a JSON number")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


FiniteJson = AfterValidator(_finite_json)


class TextPartIn(_Input):
    """Text inside a message's list of parts."""

    type: Literal["text"]
    text: Text


DataUri = Annotated[str, StringConstraints(pattern=r"^data:[^,]*,")]


class ImagePartIn(_Input):
    """An image inside a message, inline: `{"type": "image", "image": "data:image/png;base64,
    ..."}`. Server file paths and URLs are not accepted; the request body limit bounds the size."""

    type: Literal["image"]
    image: DataUri


class AudioPartIn(_Input):
    """An audio clip inside a message, inline as a `data:` URI (WAV, FLAC, OGG)."""

    type: Literal["audio"]
    audio: DataUri


class VideoPartIn(_Input):
    """A video inside a message, inline as a `data:` URI (MP4, WebM, ...)."""

    type: Literal["video"]
    video: DataUri


ContentPartIn = Annotated[
    TextPartIn | ImagePartIn | AudioPartIn | VideoPartIn, Field(discriminator="type")
]


class MessageIn(_Input):
    """One chat message of a task given as a conversation: text, or a list of parts (text,
    images, audio, video)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPartIn], Field(min_length=1, max_length=MAX_MESSAGES)]


class TaskIn(_Input):
    """What the agent is asked to do (the fields of a task-set line)."""

    id: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TASK_ID)] | None = None
    """Stable id of the task; defaults to the episode's id."""
    prompt: Annotated[
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT), Tag("text")]
        | Annotated[list[MessageIn], Field(min_length=1, max_length=MAX_MESSAGES), Tag("messages")],
        Discriminator(
            _prompt_kind,
            custom_error_type="prompt_type",
            custom_error_message="prompt must be a string or a list of chat messages",
        ),
    ]
    """The user's request, or a whole conversation. (A validation error inside it is reported
    at `task.prompt.text` or `task.prompt.messages...`.)"""
    answer: Annotated[Any, FiniteJson] = None
    """The reference answer, for rewards that need one (any JSON value)."""
    metadata: Annotated[dict[str, Any], Field(max_length=MAX_METADATA_KEYS), FiniteJson] = Field(
        default_factory=dict
    )
    """Anything else the agent, tools or rewards need."""


class SamplingOptions(_Input):
    """Sampling options; a field left out takes the agent's configured value."""

    max_new_tokens: Annotated[int, Field(ge=1, le=65536), NOT_BOOL] | None = None
    """Most tokens sampled per turn (the server may allow fewer: `limits.max_new_tokens`)."""
    temperature: Annotated[float, Field(ge=0.0, le=10.0), NOT_BOOL] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0), NOT_BOOL] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000), NOT_BOOL] | None = None
    """-1 samples among all tokens."""
    stop: (
        Annotated[
            list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP),
        ]
        | None
    ) = None
    stop_token_ids: (
        Annotated[
            list[Annotated[int, Field(ge=0, le=2**31 - 1), NOT_BOOL]],
            Field(max_length=MAX_STOP_TOKEN_IDS),
        ]
        | None
    ) = None
    seed: Annotated[int, Field(ge=0, le=2**53 - 1), NOT_BOOL] | None = None
    """Sampling seed; at most 2**53 - 1, so that JavaScript clients hold it exactly."""


class EpisodeRequest(_Input):
    """`POST /v1/episodes`: run `agent` on `task`."""

    agent: Annotated[str, StringConstraints(pattern=AGENT_NAME_PATTERN)]
    """One of the server's agents (`GET /v1/agents`)."""
    task: TaskIn
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    max_turns: Annotated[int, Field(ge=1, le=1024), NOT_BOOL] | None = None
    """Most assistant turns; defaults to the agent's (the server may allow fewer)."""


class ErrorOut(_Output):
    """An infrastructure error recorded on an episode."""

    type: str
    """The exception class, e.g. `EngineError`."""
    message: str | None


class EpisodeAccepted(_Output):
    """The answer to `POST /v1/episodes`."""

    id: str
    status: EpisodeStatus
    created: bool
    """False when an `Idempotency-Key` replay returned the episode an earlier request made."""
    href: str
    """Where to `GET` the episode."""
    events_href: str
    """Its Server-Sent Events stream."""


class EpisodeOut(_Output):
    """One episode as listed: where it stands and a summary of how it ended."""

    id: str
    status: EpisodeStatus
    """`queued` → `running` → `completed` | `failed` | `cancelled`."""
    agent: str
    run_id: str | None
    """The run the episode belongs to; None for episodes submitted over REST."""
    task_id: str | None
    reward: float | None
    """None until scored, and for failed or cancelled episodes (never a stand-in zero)."""
    reward_info: dict[str, float]
    """Named reward components."""
    stop_reason: str | None
    error: ErrorOut | None
    num_turns: int | None
    response_length: int | None
    """Tokens after the prompt."""
    trajectory_id: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    href: str
    events_href: str


class EpisodeDetail(EpisodeOut):
    """One episode in full: the request, timings and the token-level trajectory."""

    task: dict[str, Any]
    sampling: dict[str, Any]
    """The sampling options the episode runs with (request merged over the agent's)."""
    max_turns: int | None
    timings: dict[str, float]
    """Seconds per phase: `generate`, `tools`, `reward`, `total`."""
    idempotency_key: str | None
    trajectory: Trajectory | None
    """Token ids, loss mask, logprobs, weight versions, turns (`meta.turns`) and tool calls
    (`meta.tool_calls`); None until the episode finished, or when `?trajectory=false`."""


class Page(_Output):
    """Keyset pagination: pass `next_cursor` back as `cursor` (or follow `next`)."""

    next_cursor: str | None
    next: str | None
    """The URL (path and query) of the next page; None on the last page."""


class EpisodeList(Page):
    items: list[EpisodeOut]


class TrendPoint(_Output):
    step: int
    value: float | None
    """None where the recorded value was NaN or infinite."""


class RunOut(_Output):
    id: str
    name: str
    status: RunStatus
    config: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    status_reason: str | None
    """Why the run is in its status, where there is something to say: the error that failed
    it, the `stop_when` target that ended it before its last step; None otherwise."""
    steps_done: int
    """The newest step with a `reward/mean` value, plus one (steps count from 0); 0 before
    the first."""
    steps_total: int | None
    """The run's planned steps (its configuration's `steps`); None when it has none."""
    latest_reward: float | None
    """`reward/mean` at the newest step; None before the first step, or where it was NaN."""
    reward_trend: list[TrendPoint]
    """`reward/mean` at up to 32 steps spread evenly over the run, first and newest included,
    in step order (every step of a shorter run): a sparkline's worth."""
    infra_errors: int
    """Episodes of the run that ended in an infrastructure failure (`sandbox_error`,
    `reward_error`, `engine_error`, `cancelled`)."""
    duration_seconds: float
    """From creation to `finished_at`, or to now while the run is live."""
    href: str
    metrics_href: str
    faults_href: str
    """The run's fault timeline (`GET /v1/runs/{run_id}/faults`)."""
    episodes_href: str


class RunList(Page):
    items: list[RunOut]


class MetricPointOut(_Output):
    step: int
    value: float | None
    """None where the recorded value was NaN or infinite (JSON has no such numbers)."""
    time: datetime


class RunMetrics(_Output):
    run_id: str
    metrics: dict[str, list[MetricPointOut]]
    """Metric name → points in step order."""


class FaultOut(_Output):
    """One fault of a run's roles: a replica that failed, from detection to recovery.

    Read from the run's `fault` events. `control/record.py` writes two per fault, under one
    `fault_id`: when it is detected (`recovered_at` null) and when its role is back (or the
    run ended with it open); the later item supersedes the earlier. A field the recorded event
    lacks, or holds in another shape, reads as null."""

    id: int
    """The event's id; items are listed in increasing id (recording) order, and `cursor`
    takes the id of the last item seen."""
    fault_id: str | None
    """Names the fault across its items (null for an event recorded without one: a fault of
    its own)."""
    step: int | None
    """The training step that saw the fault (at detection: the oldest step in production)."""
    role: str
    """The role that failed: `engine`, `reward`, `rollout`, `advantage` or `actor` (`unknown`
    when the event names none)."""
    replica: str | None
    """The failed replica (Ray actor id); null when the fault was seen by the health monitor
    before any call named a replica."""
    cause: str | None
    """The error that revealed it, `Type: first line of the message`."""
    detected_at: datetime | None
    """When the failure was seen."""
    recovered_at: datetime | None
    """When the role was back at full strength (as the health monitor saw it); null if it was
    still down when the run ended."""
    recovery_seconds: float | None
    """From `detected_at` to `recovered_at`; null while down."""
    retried: list[str]
    """The work re-run because of the fault (`step 3 advantages`, `step 3 episode 5`...)."""
    recorded_at: datetime
    """When the fault event was stored."""


class FaultList(Page):
    """`GET /v1/runs/{run_id}/faults`: the run's faults, oldest first."""

    run_id: str
    items: list[FaultOut]


class AgentOut(_Output):
    name: str
    description: str
    tools: list[str]
    """Names of the tools the agent offers the model."""
    max_turns: int
    sampling: dict[str, Any]
    """Default sampling options."""


class AgentList(_Output):
    items: list[AgentOut]


class Health(_Output):
    status: Literal["ok"]


class Readiness(_Output):
    status: Literal["ready"]
    checks: dict[str, str]
    """Each check's state: `database` (`ok`), `worker` (`running`, `starting`, `paused`)."""


def episode_href(episode_id: str) -> str:
    return f"/v1/episodes/{quote(episode_id, safe='')}"


def episode_out(record: EpisodeRecord) -> EpisodeOut:
    """The summary of a stored episode."""
    return EpisodeOut(**_episode_fields(record))


def episode_detail(record: EpisodeRecord) -> EpisodeDetail:
    """The full view of a stored episode (with its trajectory when the record has it)."""
    sampling = dict(record.sampling)
    max_turns = sampling.pop(MAX_TURNS_FIELD, None)
    return EpisodeDetail(
        **_episode_fields(record),
        task=record.task,
        sampling=sampling,
        max_turns=max_turns if isinstance(max_turns, int) else None,
        timings=record.timings,
        idempotency_key=record.idempotency_key,
        trajectory=record.trajectory,
    )


def _episode_fields(record: EpisodeRecord) -> dict[str, Any]:
    task_id = record.task.get("id")
    error = None
    if record.error_type is not None:
        error = ErrorOut(type=record.error_type, message=record.error_message)
    href = episode_href(record.id)
    return {
        "id": record.id,
        "status": record.status,
        "agent": record.agent,
        "run_id": record.run_id,
        "task_id": task_id if isinstance(task_id, str) else None,
        "reward": record.reward,
        "reward_info": record.reward_info,
        "stop_reason": record.stop_reason,
        "error": error,
        "num_turns": record.num_turns,
        "response_length": record.response_length,
        "trajectory_id": record.trajectory_id,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "href": href,
        "events_href": f"{href}/events",
    }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _text_field(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) and value else None


def _role(data: dict[str, Any]) -> str:
    # As `Store.role_faults` reads it (so the API and `/metrics` agree): a number as its text.
    value = data.get("role")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return json.dumps(value)
    return value if isinstance(value, str) else UNKNOWN_ROLE


def _number_field(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _unix_time(data: dict[str, Any], key: str) -> datetime | None:
    seconds = _number_field(data, key)
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):  # a year past 9999, say
        return None


def fault_out(record: EventRecord) -> FaultOut:
    """The API's view of a stored `fault` event (see `FaultOut` for what a gap reads as)."""
    data = record.data if isinstance(record.data, dict) else {}
    step = data.get("step")
    retried = data.get("retried")
    return FaultOut(
        id=record.id,
        fault_id=_text_field(data, "fault_id"),
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        role=_role(data),
        replica=_text_field(data, "replica"),
        cause=_text_field(data, "cause"),
        detected_at=_unix_time(data, "detected_at"),
        recovered_at=_unix_time(data, "recovered_at"),
        recovery_seconds=_number_field(data, "recovery_seconds"),
        retried=[w for w in retried if isinstance(w, str)] if isinstance(retried, list) else [],
        recorded_at=record.created_at,
    )


def run_out(record: RunRecord, summary: RunSummary | None, now: datetime | None = None) -> RunOut:
    """The API's view of a run; `summary` None (a run deleted between the two reads) reads
    as a run with no steps and no errors."""
    href = f"/v1/runs/{quote(record.id, safe='')}"
    steps = record.config.get("steps")
    end = record.finished_at or now or datetime.now(UTC)
    return RunOut(
        id=record.id,
        name=record.name,
        status=record.status,
        config=record.config,
        created_at=record.created_at,
        updated_at=record.updated_at,
        finished_at=record.finished_at,
        status_reason=record.status_reason,
        steps_done=summary.steps_done if summary is not None else 0,
        steps_total=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
        latest_reward=_finite(summary.latest_reward) if summary is not None else None,
        reward_trend=[
            TrendPoint(step=p.step, value=_finite(p.value))
            for p in (summary.reward_trend if summary is not None else [])
        ],
        infra_errors=summary.infra_errors if summary is not None else 0,
        duration_seconds=max((end - record.created_at).total_seconds(), 0.0),
        href=href,
        metrics_href=f"{href}/metrics",
        faults_href=f"{href}/faults",
        episodes_href=f"/v1/episodes?run_id={quote(record.id, safe='')}",
    )
