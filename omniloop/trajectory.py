"""The trajectory contract (DESIGN.md §2): tokens in, tokens out.

A trajectory is built only from token ids: the prompt as tokenized once, the engine's sampled
ids kept verbatim, and observation deltas appended after them. Nothing here ever decodes and
re-encodes history. `TrajectoryBuilder` is the only way agents add tokens, so the per-token
arrays (`loss_mask`, `rollout_logprobs`, `weight_version`) can never drift out of step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omniloop.modalities.media import MediaData

StopReason = Literal[
    "stop",
    "length",
    "max_turns",
    "context_limit",
    "tool_timeout",
    "sandbox_error",
    "reward_error",
    "cancelled",
    "engine_error",
    "media_error",
]
"""Why an episode ended. The last five (`INFRA_STOP_REASONS`) are failures of the
infrastructure or of the task's input (`media_error`: a prompt's image, audio or video cannot
be used): such trajectories are recorded but never trained as a zero reward."""

INFRA_STOP_REASONS: frozenset[str] = frozenset(
    {"sandbox_error", "reward_error", "cancelled", "engine_error", "media_error"}
)


def trajectory_id(run: str, episode: str, segment: int = 0) -> str:
    """Deterministic id of one trajectory segment: the same inputs always give the same id.

    The attempt is not part of it: an episode re-run after its rollout replica died (`attempt`
    + 1 in the meta) takes the same id, so the data plane holds one row for it (the first
    attempt that wrote one: `EpisodeWriter.written_before`) and the trainer counts it once.
    """
    key = f"{run}\x1f{episode}\x1f{segment}".encode()
    return hashlib.blake2b(key, digest_size=12).hexdigest()


class ErrorInfo(BaseModel):
    """An infrastructure error recorded on a trajectory instead of raised."""

    model_config = ConfigDict(extra="forbid")

    type: str
    """The exception class name, e.g. `SandboxError`; dashboards filter on it."""
    message: str
    """The exception message."""
    failed_role: str | None = None
    """Set when the error is a `RoleLost`: the role whose replica died with the episode's work
    (`sandbox`…). Such an episode is run again instead of being recorded."""


class ToolCallRecord(BaseModel):
    """One tool call the model made and what came of it."""

    model_config = ConfigDict(extra="forbid")

    turn: int
    """The turn (0-based) in which the model made the call."""
    name: str | None
    """The tool name the model asked for; None when the call could not be parsed."""
    arguments: dict[str, Any] | None
    """The parsed arguments; None when they could not be parsed."""
    raw: str
    """The call's text as the model wrote it."""
    output: str
    """What the model was shown as the result."""
    error: str | None = None
    """Why the call failed (`parse_error`, `unknown_tool`, `invalid_arguments`, `tool_error`,
    `tool_timeout`); None on success."""
    duration: float = 0.0
    """Seconds spent running the tool."""
    sanitized_chars: int = 0
    """Characters of the output replaced by U+FFFD because no tokenizer or store takes them
    (lone surrogates, e.g. from undecodable bytes or file names, and NUL)."""
    truncated_chars: int = 0
    """Characters cut from the middle of an output longer than the toolset's cap."""
    media: list[MediaData] = Field(default_factory=list, exclude=True, repr=False)
    """Images, audio clips or videos the tool returned with its text (`ToolResult.media`),
    shown to the model after the text. Not serialised: the trajectory keeps them by
    reference (`Trajectory.multimodal`), the bytes live in the run's media store."""


class TurnRecord(BaseModel):
    """Where one model turn sits in the token stream."""

    model_config = ConfigDict(extra="forbid")

    start: int
    """Index in `input_ids` of the first token sampled in this turn."""
    num_sampled: int
    """How many tokens the engine sampled in this turn."""
    num_observation: int = 0
    """How many observation (mask-0) tokens followed the turn."""
    finish_reason: str
    """The engine's finish reason for this turn: `stop`, `length`, or `abort` (the engine
    aborted the request; the episode then ends as `engine_error`)."""
    weight_version: int
    """The weight version that sampled this turn."""
    generate_seconds: float = 0.0
    """Seconds the engine call took."""


class TrajectoryMeta(BaseModel):
    """Identity and bookkeeping of a trajectory."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = "local"
    episode_id: str
    group_id: str = ""
    """Trajectories of the same task and sampling group share it (GRPO groups)."""
    attempt: int = 0
    """0 for the first run of the episode, +1 for each re-run after an infrastructure failure
    of the role that ran it (the trajectory id stays the same)."""
    segment: int = 0
    task_id: str = ""
    task: dict[str, Any] = Field(default_factory=dict)
    """The task as given (prompt, answer, metadata)."""
    turns: list[TurnRecord] = Field(default_factory=list)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    error: ErrorInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds per phase: `generate`, `tools`, `reward`, `total`."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Counters such as `tool_calls/parse_errors`."""


class Trajectory(BaseModel):
    """A loss-masked, token-exact record of one episode (or one segment of it)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    input_ids: list[int]
    """Prompt and every turn, as token ids, in order."""
    loss_mask: list[int]
    """1 for tokens the policy sampled, 0 for everything else."""
    rollout_logprobs: list[float]
    """Engine logprob of each sampled token; 0.0 where the mask is 0."""
    weight_version: list[int]
    """Weight version that sampled each token; -1 where the mask is 0."""
    prompt_length: int
    """Number of leading prompt tokens."""
    multimodal: list[dict[str, Any]] = Field(default_factory=list)
    """The media in the sequence, in order: `modalities.MediaPlacement` as dicts (kind,
    content hash, size, format, `offset` of the first placeholder token, `tokens`). The bytes
    are in the run's media store, addressed by hash."""
    reward: float | None = None
    reward_info: dict[str, float] = Field(default_factory=dict)
    meta: TrajectoryMeta

    @property
    def is_infra_failure(self) -> bool:
        """True when the episode ended by an infrastructure failure (never trained as reward 0)."""
        return self.meta.stop_reason in INFRA_STOP_REASONS

    @property
    def response_length(self) -> int:
        """Number of tokens after the prompt."""
        return len(self.input_ids) - self.prompt_length

    def check(self) -> None:
        """Raise `ValueError` if the per-token arrays disagree in length or content."""
        n = len(self.input_ids)
        for name in ("loss_mask", "rollout_logprobs", "weight_version"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.id}: {name} has {len(getattr(self, name))} entries "
                    f"but input_ids has {n}"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"trajectory {self.id}: loss_mask holds values other than 0 and 1")
        if any(self.loss_mask[: self.prompt_length]):
            raise ValueError(f"trajectory {self.id}: prompt tokens are in the loss mask")
        end = 0
        for item in self.multimodal:
            offset, tokens = item.get("offset"), item.get("tokens")
            if not isinstance(offset, int) or not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"trajectory {self.id}: media entry {item} has no placement")
            if offset < end or offset + tokens > n:
                raise ValueError(
                    f"trajectory {self.id}: media at {offset}..{offset + tokens} overlaps the "
                    f"previous item or runs past the {n} tokens"
                )
            if any(self.loss_mask[offset : offset + tokens]):
                raise ValueError(f"trajectory {self.id}: media placeholders are in the loss mask")
            end = offset + tokens


class TrajectoryBuilder:
    """Appends tokens to a trajectory, keeping every per-token array in step.

    `add_sampled` takes the engine's ids verbatim; `add_observation` takes ids produced by the
    chat format for text the model did not write. Neither ever re-tokenizes what is already there.
    """

    def __init__(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("a trajectory needs a non-empty prompt")
        self.input_ids: list[int] = list(prompt_ids)
        self.loss_mask: list[int] = [0] * len(prompt_ids)
        self.rollout_logprobs: list[float] = [0.0] * len(prompt_ids)
        self.weight_version: list[int] = [-1] * len(prompt_ids)
        self.prompt_length = len(prompt_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_sampled(
        self, ids: list[int], logprobs: list[float], version: int | Sequence[int]
    ) -> None:
        """Append tokens the policy sampled (mask 1), with the weight version that sampled
        them: one for all, or one per token."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
        versions = [version] * len(ids) if isinstance(version, int) else list(version)
        if len(versions) != len(ids):
            raise ValueError(f"{len(ids)} sampled ids but {len(versions)} weight versions")
        self.input_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.rollout_logprobs.extend(logprobs)
        self.weight_version.extend(versions)

    def replace_sampled(self, index: int, token_id: int) -> None:
        """Put `token_id` in place of the sampled token at `index`, out of the loss (mask 0, no
        logprob, no version): for a sampled id that cannot stand in the sequence as it is (a
        media placeholder with no media behind it). The replacement was not sampled, so it is
        not trained."""
        if not self.loss_mask[index]:
            raise ValueError(f"token {index} was not sampled")
        self.input_ids[index] = token_id
        self.loss_mask[index] = 0
        self.rollout_logprobs[index] = 0.0
        self.weight_version[index] = -1

    def add_observation(self, ids: list[int]) -> None:
        """Append tokens the policy did not sample (mask 0): tool output, template glue."""
        self.input_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))
        self.weight_version.extend([-1] * len(ids))

    def build(
        self, meta: TrajectoryMeta, multimodal: list[dict[str, Any]] | None = None
    ) -> Trajectory:
        """Freeze into a `Trajectory` whose id is derived from the meta's ids."""
        traj = Trajectory(
            id=trajectory_id(meta.run_id, meta.episode_id, meta.segment),
            input_ids=list(self.input_ids),
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.rollout_logprobs),
            weight_version=list(self.weight_version),
            prompt_length=self.prompt_length,
            multimodal=list(multimodal or []),
            meta=meta,
        )
        traj.check()
        return traj
