"""Rewards: plain functions that score an episode, and `score`, the one place they are run.

What a reward function receives. Parameters are matched by name, so a function declares only
what it needs, in any order:

- `task`: the task as a plain dict (`Task.model_dump()`: `id`, `prompt`, `answer`, `metadata`).
- `response`: the decoded text of the model's final turn, exactly as sampled (reasoning and
  tool calls included; use `final_answer`/`parse_tool_calls` to pick out parts).
- `transcript`: every message of the episode as chat dicts (`{"role", "content"}`), or None
  when the caller has none.
- `trajectory` (or `traj`): the token-level `Trajectory` with its `meta` (tool calls, stop
  reason, turns), or None.

A function may also take `**kwargs` to receive all four. Any other parameter without a default
is an error at decoration time.

What it returns: a number (`bool` counts), or a dict of named components whose total is the
sum (or the weighted sum with `@reward(weights={...})`). Non-finite values are errors.

How failures surface: `score` raises `RewardError` when a reward raises, returns something
else, or runs past its timeout. The rollout then records the trajectory as `reward_error`,
which is never trained as a zero reward (DESIGN.md §2). A sync reward runs in a worker thread;
one that overruns its timeout is abandoned (its thread finishes on its own), so a reward that
can hang in C code should isolate itself in a process, as `math_equal` does.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import (
    Any,
    Generic,
    NamedTuple,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
    runtime_checkable,
)

from pydantic import BaseModel

from omniloop.errors import RewardError
from omniloop.trajectory import Trajectory

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_REWARD_TIMEOUT = 30.0
"""Seconds a reward may run when neither it nor the caller of `score` sets a timeout."""

Transcript = Sequence[Mapping[str, Any]]
"""An episode's chat messages, each at least `{"role": ..., "content": ...}`."""

_INJECTABLE = frozenset({"task", "response", "transcript", "trajectory", "traj"})
EPISODE_INPUTS = frozenset({"task", "response", "transcript", "trajectory"})
"""Everything a reward can be given of an episode (the keyword names of `evaluate`)."""


def reward_inputs(fn: RewardFn) -> frozenset[str]:
    """What of an episode `fn` reads: its `inputs` attribute when it declares one (a subset of
    `EPISODE_INPUTS`), else everything. A caller that ships episodes to a reward elsewhere
    (the reward role) sends only these."""
    declared = getattr(fn, "inputs", None)
    return EPISODE_INPUTS if declared is None else frozenset(declared)


class RewardScore(NamedTuple):
    """One reward's result: its total and its named components (empty for a plain number)."""

    total: float
    components: dict[str, float]


@runtime_checkable
class RewardFn(Protocol):
    """What `score` runs. `@reward` functions, `combine(...)` and the built-ins satisfy it.

    `weight` scales the reward's total in the episode's reward; `timeout` (seconds, None for
    the caller's default) bounds one evaluation. `evaluate` may raise anything: `score` turns
    it into `RewardError`.
    """

    name: str
    weight: float
    timeout: float | None

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        """Score one episode."""
        ...


def _finite(name: str, key: str | None, value: Any) -> float:
    where = f"reward {name!r}" + (f" component {key!r}" if key is not None else "")
    if not isinstance(value, bool | int | float):
        raise RewardError(f"{where} returned {type(value).__name__} {value!r}, not a number")
    result = float(value)
    if not math.isfinite(result):
        raise RewardError(f"{where} returned {result}, which is not a finite number")
    return result


def normalize_reward(
    name: str, value: Any, weights: Mapping[str, float] | None = None
) -> RewardScore:
    """Turn what a reward function returned into a `RewardScore`.

    A number is the total. A dict's total is the sum of its components, or, with `weights`,
    the weighted sum; with `weights` every component must have a weight (a component without
    one is more likely a typo than an intent), while a weighted component may be absent.
    """
    if isinstance(value, Mapping):
        components: dict[str, float] = {}
        for key, component in value.items():
            if not isinstance(key, str):
                raise RewardError(f"reward {name!r} returned a component named {key!r}, not a str")
            components[key] = _finite(name, key, component)
        if weights is None:
            return RewardScore(math.fsum(components.values()), components)
        unweighted = sorted(set(components) - set(weights))
        if unweighted:
            raise RewardError(
                f"reward {name!r} returned components {unweighted} that have no weight; "
                f"weights are given for {sorted(weights)}"
            )
        total = math.fsum(weights[k] * v for k, v in components.items())
        return RewardScore(total, components)
    return RewardScore(_finite(name, None, value), {})


class Reward(Generic[P, R]):
    """A reward function with its name, weight and timeout (built by `@reward`).

    Calling the object calls the function unchanged; `evaluate` is how `score` runs it.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        weight: float = 1.0,
        timeout: float | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"reward timeout must be positive, got {timeout}")
        if not math.isfinite(weight):
            raise ValueError(f"reward weight must be finite, got {weight}")
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", type(fn).__name__))
        self.weight = float(weight)
        self.timeout = timeout
        self.weights = dict(weights) if weights is not None else None
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 -- async callable objects
        )
        self._wants_all = False
        self._wanted: list[str] = []
        for param in inspect.signature(fn).parameters.values():
            if param.kind is param.VAR_KEYWORD:
                self._wants_all = True
            elif param.kind is param.VAR_POSITIONAL:
                continue
            elif param.name in _INJECTABLE and param.kind is not param.POSITIONAL_ONLY:
                self._wanted.append(param.name)
            elif param.default is inspect.Parameter.empty:
                raise TypeError(
                    f"reward {self.name!r}: parameter {param.name!r} cannot be filled; a reward "
                    f"takes any of {sorted(_INJECTABLE)} by name (or **kwargs)"
                )
        self.inputs = (
            EPISODE_INPUTS
            if self._wants_all
            else frozenset("trajectory" if name == "traj" else name for name in self._wanted)
        )
        """What of an episode the function declared (`reward_inputs`)."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<reward {self.name} weight={self.weight:g}>"

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        """Call the function with the inputs it declared and normalize what it returns."""
        available: dict[str, Any] = {
            "task": task,
            "response": response,
            "transcript": transcript,
            "trajectory": trajectory,
            "traj": trajectory,
        }
        if self._wants_all:
            kwargs = {k: v for k, v in available.items() if k != "traj"}
            kwargs.update({k: available[k] for k in self._wanted})
        else:
            kwargs = {k: available[k] for k in self._wanted}
        fn: Callable[..., Any] = self.fn
        if self.is_async:
            value = await fn(**kwargs)
        else:
            value = await asyncio.to_thread(fn, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        return normalize_reward(self.name, value, self.weights)


@overload
def reward(fn: Callable[P, R], /) -> Reward[P, R]: ...


@overload
def reward(
    *,
    name: str | None = None,
    weight: float = 1.0,
    timeout: float | None = None,
    weights: Mapping[str, float] | None = None,
) -> Callable[[Callable[P, R]], Reward[P, R]]: ...


def reward(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    weight: float = 1.0,
    timeout: float | None = None,
    weights: Mapping[str, float] | None = None,
) -> Reward[P, R] | Callable[[Callable[P, R]], Reward[P, R]]:
    """Make a sync or async function a reward.

    Use as `@reward` or `@reward(name=..., weight=..., timeout=..., weights=...)`. The function
    takes any of `task`, `response`, `transcript`, `trajectory`/`traj` by name (see the module
    doc for what each holds) and returns a number or a dict of named components:

        @reward
        def correct(task: dict, response: str) -> float:
            return float(final_answer(response) == str(task["answer"]))

        @reward(weights={"tests": 1.0, "lint": 0.1})
        async def code(task: dict, response: str, trajectory: Trajectory | None) -> dict: ...

    `weight` scales the total in the episode's reward (default 1.0); `weights` weighs a dict's
    components (default: their plain sum); `timeout` bounds one call in seconds (default: the
    timeout given to `score`).
    """

    def wrap(f: Callable[P, R]) -> Reward[P, R]:
        return Reward(f, name=name, weight=weight, timeout=timeout, weights=weights)

    return wrap(fn) if fn is not None else wrap


def as_reward_fn(obj: Any) -> RewardFn:
    """A `RewardFn` as it is; a plain function wrapped as if decorated with `@reward`."""
    if isinstance(obj, RewardFn):
        return obj
    if callable(obj):
        return Reward(obj)
    raise TypeError(f"{obj!r} is not a reward function")


async def _evaluate_one(
    fn: RewardFn,
    task: dict[str, Any],
    response: str,
    transcript: Transcript | None,
    trajectory: Trajectory | None,
    default_timeout: float | None,
) -> RewardScore:
    """Run one reward under its timeout; every failure becomes a `RewardError` naming it."""
    timeout = fn.timeout if fn.timeout is not None else default_timeout
    try:
        # asyncio.timeout (not wait_for) so a TimeoutError raised *by* the reward is told apart
        # from the reward running out of time.
        async with asyncio.timeout(timeout) as scope:
            result = await fn.evaluate(task, response, transcript=transcript, trajectory=trajectory)
    except RewardError as err:
        message = str(err)
        if fn.name not in message:
            message = f"reward {fn.name!r}: {message}"
        raise RewardError(message) from err
    except TimeoutError as err:
        if scope.expired():
            raise RewardError(f"reward {fn.name!r} did not finish within {timeout:g}s") from err
        raise RewardError(f"reward {fn.name!r} raised TimeoutError: {err}") from err
    except Exception as err:
        raise RewardError(f"reward {fn.name!r} raised {type(err).__name__}: {err}") from err
    if not isinstance(result, RewardScore):
        raise RewardError(
            f"reward {fn.name!r}: evaluate returned {type(result).__name__}, not a RewardScore"
        )
    return result


async def _evaluate_all(
    fns: Sequence[RewardFn],
    weights: Sequence[float],
    task: dict[str, Any],
    response: str,
    transcript: Transcript | None,
    trajectory: Trajectory | None,
    default_timeout: float | None,
) -> RewardScore:
    """Run rewards concurrently; the weighted total and `{name: total, name/part: value}`.

    The first failure cancels the others and is raised as `RewardError`.
    """
    names = [fn.name for fn in fns]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique; repeated: {duplicates}")
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(
                    _evaluate_one(fn, task, response, transcript, trajectory, default_timeout)
                )
                for fn in fns
            ]
    except BaseExceptionGroup as group_error:
        reward_errors = group_error.subgroup(RewardError)
        if reward_errors is None:
            raise
        first = reward_errors.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from first.__cause__
    info: dict[str, float] = {}
    total = 0.0
    for fn, weight, t in zip(fns, weights, tasks, strict=True):
        result = t.result()
        info[fn.name] = result.total
        for key, value in result.components.items():
            info[f"{fn.name}/{key}"] = value
        total += weight * result.total
    return RewardScore(total, info)


def _task_dict(task: Mapping[str, Any] | BaseModel) -> dict[str, Any]:
    if isinstance(task, BaseModel):
        return task.model_dump()
    return dict(task)


class CombinedReward:
    """Several rewards scored together as one (built by `combine`)."""

    def __init__(
        self,
        rewards: Sequence[RewardFn],
        weights: Sequence[float],
        *,
        name: str,
        weight: float,
        timeout: float | None,
    ) -> None:
        self.rewards = list(rewards)
        self.weights = [float(w) for w in weights]
        self.inputs = frozenset[str]().union(*(reward_inputs(r) for r in self.rewards))
        self.name = name
        self.weight = float(weight)
        self.timeout = timeout

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{w:g}*{r.name}" for r, w in zip(self.rewards, self.weights, strict=True)
        )
        return f"<reward {self.name} = {parts}>"

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        """The weighted sum of the members; components `member` and `member/component`.

        Members keep their own timeouts; one without runs under this reward's timeout only.
        """
        return await _evaluate_all(
            self.rewards, self.weights, task, response, transcript, trajectory, None
        )


def combine(
    *rewards: RewardFn | Callable[..., Any],
    weights: Sequence[float] | None = None,
    name: str = "combined",
    weight: float = 1.0,
    timeout: float | None = None,
) -> CombinedReward:
    """One reward that is the weighted sum of several: `combine(correct, fmt, weights=[1, .1])`.

    `weights` default to each reward's own `weight`. The result is a `RewardFn`, so it can be
    used wherever one reward is expected; its components are the members' totals (by name)
    and the members' components (`member/component`).
    """
    fns = [as_reward_fn(r) for r in rewards]
    if not fns:
        raise ValueError("combine needs at least one reward")
    if weights is None:
        weights = [fn.weight for fn in fns]
    if len(weights) != len(fns):
        raise ValueError(f"{len(fns)} rewards but {len(weights)} weights")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward weights must be finite, got {list(weights)}")
    return CombinedReward(fns, weights, name=name, weight=weight, timeout=timeout)


async def score(
    rewards: RewardFn | Callable[..., Any] | Sequence[RewardFn | Callable[..., Any]],
    task: Mapping[str, Any] | BaseModel,
    response: str,
    *,
    transcript: Transcript | None = None,
    trajectory: Trajectory | None = None,
    timeout: float | None = DEFAULT_REWARD_TIMEOUT,
) -> tuple[float, dict[str, float]]:
    """Score one episode: `(reward, reward_info)` for the trajectory.

    `reward` is the sum over rewards of `weight * total`; `reward_info` holds each reward's
    total under its name and each of its components under `name/component`. Rewards run
    concurrently, each bounded by its own `timeout` or, when it has none, by `timeout` here
    (None: unbounded). `task` may be a `Task` model or a mapping; rewards get a dict. With no
    rewards the result is `(0.0, {})`.

    Raises `RewardError` when any reward raises, returns something that is not a finite number
    or a dict of them, or times out (the rollout records the episode as `reward_error`), and
    `ValueError` when two rewards share a name.
    """
    if isinstance(rewards, Sequence):
        fns = [as_reward_fn(r) for r in rewards]
    else:
        fns = [as_reward_fn(rewards)]
    if not fns:
        return 0.0, {}
    result = await _evaluate_all(
        fns,
        [fn.weight for fn in fns],
        _task_dict(task),
        response,
        transcript,
        trajectory,
        timeout,
    )
    return result.total, result.components
