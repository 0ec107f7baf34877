"""`omniloop rollout`: run N episodes of a task set and write their trajectories.

The rollout worker's loop: for each (task, sample) pair, run an episode under a concurrency
bound, write its trajectory as one JSONL line as soon as it finishes, and summarise at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from omniloop.agents.base import Agent, Task
from omniloop.agents.chat import ChatFormat
from omniloop.config import StrictModel, import_object
from omniloop.errors import ConfigError
from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.inference.models import load_tokenizer
from omniloop.platform.engines import local_engine
from omniloop.platform.episode import EpisodeSettings, run_episode
from omniloop.rewards import RewardFn
from omniloop.sandboxes.base import Sandbox
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.factory import create_sandbox, resolve_backend
from omniloop.sandboxes.pool import SandboxPool
from omniloop.trajectory import Trajectory


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


console = Console(stderr=True)

BUILTIN_REWARDS = ("exact_match", "math_equal", "format_reward")


def load_tasks(path: str, limit: int | None = None) -> list[Task]:
    """Read a JSONL task set; a bad line is reported with its number and the fix."""
    tasks: list[Task] = []
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"task file {path!r} does not exist")
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(Task.model_validate_json(line))
        except ValueError as err:
            raise ConfigError(f"{path}:{number}: not a valid task ({err})") from None
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks:
        raise ConfigError(f"task file {path!r} holds no tasks")
    return tasks


def build_agent(spec: str) -> Agent:
    """Import an agent, calling it if it is a factory."""
    obj = import_object(spec)
    agent = obj() if callable(obj) and not hasattr(obj, "run") else obj
    for attribute in ("run", "opening", "tool_schemas"):
        if not hasattr(agent, attribute):
            raise ConfigError(f"agent {spec!r} has no {attribute!r}; it must satisfy Agent")
    return agent


def build_rewards(specs: list[str]) -> list[RewardFn]:
    """Resolve reward names and paths to reward functions."""
    import omniloop.rewards as builtin

    return [
        getattr(builtin, spec) if spec in BUILTIN_REWARDS else import_object(spec) for spec in specs
    ]


def episode_seed(seed: int, episode_id: str) -> int:
    """A sampling seed per episode, stable across runs."""
    digest = hashlib.blake2b(f"{seed}:{episode_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def episode_plan(
    config: RolloutConfig, tasks: list[Task], prefix: str = ""
) -> Iterator[tuple[Task, EpisodeSettings]]:
    """Every (task, settings) pair of the run, in a stable order.

    `prefix` starts every episode id (and so changes trajectory ids and sampling seeds): a
    training run that meets the same task in several steps gives each step its own, `step3/`.
    """
    for task in tasks:
        for sample in range(config.samples_per_task):
            episode_id = f"{prefix}{task.id}/{sample}"
            sampling = config.sampling.model_copy(
                update={"seed": episode_seed(config.seed, episode_id)}
            )
            yield (
                task,
                EpisodeSettings(
                    run_id=config.run_id,
                    episode_id=episode_id,
                    group_id=task.id,
                    sampling=sampling,
                    max_turns=config.max_turns,
                    max_context=config.max_context,
                    reward_timeout=config.reward_timeout,
                ),
            )


@contextlib.asynccontextmanager
async def engine_url(config: EngineConfig, log_dir: Path | None = None) -> AsyncIterator[str]:
    """The configured engine's URL, starting a local engine for the block if none is given."""
    if config.url:
        yield config.url.rstrip("/")
        return
    log = log_dir / "engine.log" if log_dir else None
    async with local_engine(
        config.model, threads=config.threads, log_path=log, startup_timeout=config.startup_timeout
    ) as url:
        yield url


def write_trajectory(stream: Any, trajectory: Trajectory) -> None:
    """Append one trajectory as a JSON line and flush (a crash loses at most one line)."""
    stream.write(trajectory.model_dump_json() + "\n")
    stream.flush()


def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Counts and means; infrastructure failures are counted, not averaged into rewards."""
    scored = [t.reward for t in trajectories if t.reward is not None and not t.is_infra_failure]
    stops: dict[str, int] = {}
    for t in trajectories:
        stops[str(t.meta.stop_reason)] = stops.get(str(t.meta.stop_reason), 0) + 1
    n = len(trajectories)
    return {
        "episodes": n,
        "errors": sum(t.is_infra_failure for t in trajectories),
        "reward_mean": sum(scored) / len(scored) if scored else None,
        "response_length_mean": sum(t.response_length for t in trajectories) / n if n else 0.0,
        "turns_mean": sum(len(t.meta.turns) for t in trajectories) / n if n else 0.0,
        "tool_calls": sum(len(t.meta.tool_calls) for t in trajectories),
        "stop_reasons": dict(sorted(stops.items())),
    }


@contextlib.asynccontextmanager
async def sandbox_pool(config: SandboxConfig) -> AsyncIterator[SandboxPool[Sandbox]]:
    """A warm pool of the configured backend's sandboxes; the choice of backend is printed."""
    backend = resolve_backend(config)
    console.print(f"[bold]sandbox backend:[/bold] {backend}")
    resolved = config.model_copy(update={"backend": backend})
    async with SandboxPool(lambda: create_sandbox(resolved), config.pool_size) as pool:
        yield pool


async def run_rollout(config: RolloutConfig) -> list[Trajectory]:
    """Run every episode of `config`, writing trajectories as they finish; return them all."""
    tasks = load_tasks(config.tasks, config.num_tasks)
    agent = build_agent(config.agent)
    rewards = build_rewards(config.rewards)
    tokenizer = load_tokenizer(config.engine.model)
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    plan = list(episode_plan(config, tasks))
    output = Path(config.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    limit = asyncio.Semaphore(config.concurrency)
    results: list[Trajectory] = []

    async with (
        engine_url(config.engine, log_dir=output.parent) as url,
        EngineClient(url) as engine,
        sandbox_pool(config.sandbox) as pool,
    ):

        async def one(task: Task, settings: EpisodeSettings) -> Trajectory:
            async with limit:
                return await run_episode(
                    agent,
                    task,
                    engine=engine,
                    chat=chat,
                    sandbox_provider=pool,
                    rewards=rewards,
                    settings=settings,
                )

        with output.open("w") as stream, progress_bar() as bar:  # noqa: ASYNC230
            job = bar.add_task("episodes", total=len(plan))
            for finished in asyncio.as_completed([one(t, s) for t, s in plan]):
                trajectory = await finished
                write_trajectory(stream, trajectory)
                results.append(trajectory)
                bar.advance(job)
    return results


def progress_bar() -> Progress:
    """The progress bar used by rollout and training."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
