"""The rollout's configuration: a task set, an agent, rewards, an engine and sandboxes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from omniloop.config import StrictModel
from omniloop.inference.base import SamplingParams
from omniloop.modalities.config import MediaConfig
from omniloop.sandboxes.config import SandboxConfig


class EngineConfig(StrictModel):
    """Where episodes get their tokens."""

    url: str | None = None
    """Base URL of a running engine (SGLang or omniloop's); None starts a local CPU engine."""
    model: str = "smollm2"
    """The local engine's model and the tokenizer: `smollm2`, `tiny`, or a model folder."""
    threads: int | None = None
    """Torch threads of the local engine; None lets it choose."""
    startup_timeout: float = 300.0
    """Seconds to wait for a local engine to become healthy."""
    media_form: Literal["files", "processor_output"] = "files"
    """How media go to the engine: `files` sends each item's encoded file (the engine
    processes it; SGLang then decodes `input_ids` to text and re-tokenizes them, so its ids
    may drift from the trajectory's); `processor_output` sends SGLang's pre-processed dicts,
    processed on the rollout's side, with which SGLang and omniloop's engine use `input_ids`
    verbatim (larger requests)."""


def _resolve_path(value: str, info: ValidationInfo) -> str:
    base = (info.context or {}).get("base_dir")
    path = Path(value)
    if base is not None and not path.is_absolute():
        candidate = Path(base) / path
        if candidate.exists() or not path.exists():
            return str(candidate)
    return str(path)


class RolloutConfig(StrictModel):
    """A task set, an agent, rewards, and how to run them."""

    tasks: str
    """JSONL file of tasks (`id`, `prompt`, `answer`, `metadata`); relative to the config file."""
    agent: str
    """`file.py:name` or `module:name` of an Agent, or of a function returning one."""
    rewards: list[str] = Field(default_factory=list)
    """Reward functions: built-in names (`exact_match`, `math_equal`, `format_reward`) or
    `file.py:name` / `module:name`. Their values are summed."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The inference engine."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Tool sandboxes."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling options for every turn."""
    media: MediaConfig = Field(default_factory=MediaConfig)
    """Bounds and sampling rules of images, audio and video in prompts and tool results (the
    engines this config launches use the same, so placeholder counts agree)."""
    max_turns: int = Field(default=8, ge=1)
    """Most assistant turns per episode."""
    max_context: int = Field(default=2048, ge=16)
    """Most tokens in one episode (prompt + all turns)."""
    samples_per_task: int = Field(default=1, ge=1)
    """Episodes per task (a GRPO group)."""
    num_tasks: int | None = Field(default=None, ge=1)
    """Use only the first N tasks; None uses all."""
    concurrency: int = Field(default=8, ge=1)
    """Episodes running at once."""
    reward_timeout: float = Field(default=30.0, gt=0)
    """Seconds a reward may take before the episode is marked `reward_error`."""
    seed: int = 0
    """Base seed; each episode's sampling seed derives from it and the episode id."""
    run_id: str = "rollout"
    """Id of this run; part of every trajectory id."""
    output: str = "runs/rollout/trajectories.jsonl"
    """Where trajectories are written, one JSON object per line."""

    @field_validator("tasks")
    @classmethod
    def _tasks_path(cls, value: str, info: ValidationInfo) -> str:
        return _resolve_path(value, info)

    @field_validator("agent", "rewards")
    @classmethod
    def _object_paths(cls, value: Any, info: ValidationInfo) -> Any:
        def fix(spec: str) -> str:
            module, sep, attr = spec.partition(":")
            if sep and module.endswith(".py"):
                return f"{_resolve_path(module, info)}:{attr}"
            return spec

        return [fix(v) for v in value] if isinstance(value, list) else fix(value)
