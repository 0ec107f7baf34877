"""What a rollout config names, built: the task set, the agent, the rewards, the episode plan."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from omniloop.agents.base import Agent, Task
from omniloop.agents.media import absolute_sources
from omniloop.config import import_object
from omniloop.errors import ConfigError
from omniloop.platform.control.episode import EpisodeSettings
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.rewards import RewardFn

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
            task = Task.model_validate_json(line)
        except ValueError as err:
            raise ConfigError(f"{path}:{number}: not a valid task ({err})") from None
        if isinstance(task.prompt, list):
            # Media files named by a task are relative to the task file.
            task.prompt = absolute_sources(task.prompt, file.resolve().parent)
        tasks.append(task)
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
    config: RolloutConfig, tasks: list[Task], prefix: str = "", group_prefix: str = ""
) -> Iterator[tuple[Task, EpisodeSettings]]:
    """Every (task, settings) pair of the run, in a stable order.

    `prefix` starts every episode id (and so changes trajectory ids and sampling seeds): a
    training run that meets the same task in several steps gives each step its own, `step3/`.
    `group_prefix` starts every group id (the task's id), for groups of one task that share a
    step (dynamic sampling's extra groups).
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
                    group_id=f"{group_prefix}{task.id}",
                    sampling=sampling,
                    max_turns=config.max_turns,
                    max_context=config.max_context,
                    reward_timeout=config.reward_timeout,
                ),
            )
