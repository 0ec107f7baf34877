"""Role failures and recovery: the fault timeline, and retrying work a failed replica cut off.

A call to a role fails in one of three ways, told apart by a `Classify` function the role's
transport provides (`services.classify_failure` for Ray Serve; in this process nothing is
retried):

- `busy`: the role refused the call (back-pressure: its queue is full). Waited out and retried;
  neither a fault nor an attempt.
- `lost`: the replica running the call died (its process was killed, its node was lost). A
  fault on the timeline; the work is re-run as `attempt + 1` (the role replaces the replica;
  every call here is idempotent: an episode keeps its trajectory id, a step's advantages are
  recomputed from its rows).
- anything else is the work's own error and is raised as it is.

The timeline holds one `Fault` per failed replica: when it was detected, the work that was
retried, and when the role served that work again (`recovered_at`). Every fault goes to
`RUN_DIR/faults.jsonl`, the run store (an event of type `fault`) and the step's metrics
(`faults/count`, `faults/recovery_seconds`), through `RunRecord`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

from omniloop.errors import OmniloopError
from omniloop.platform.control.run_config import FaultsConfig

T = TypeVar("T")

Failure = Literal["busy", "lost"]
Classify = Callable[[BaseException], tuple[Failure, str] | None]
"""`error -> (kind, replica)` for a failure of the role rather than of the work, else None."""


class RoleFailed(OmniloopError):
    """A role lost the same work `faults.max_attempts` times; the run cannot go on."""


@dataclass
class Fault:
    """One failed replica of a role, from detection to the role serving its work again."""

    role: str
    replica: str
    cause: str
    detected_at: float
    """Unix time the failure was seen (the first call it cut off returned)."""
    recovered_at: float | None = None
    """Unix time the first retried piece of work succeeded; None while still down."""
    retried: list[str] = field(default_factory=list)
    """The work re-run because of it (`step 3 episode 5`…)."""

    @property
    def recovery_seconds(self) -> float | None:
        """Seconds from detection to recovery, None while still down."""
        return None if self.recovered_at is None else self.recovered_at - self.detected_at

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON object (`recovery_seconds` included)."""
        return {**asdict(self), "recovery_seconds": self.recovery_seconds}


class FaultTimeline:
    """The run's faults in order of detection; `take_finished` hands each recovered one out
    once (to be recorded with the step that saw it)."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self._open: dict[tuple[str, str], Fault] = {}
        self._handed_out: set[int] = set()

    def failed(self, role: str, replica: str, cause: str, work: str) -> Fault:
        """Note `work` cut off by `replica` of `role`; one fault per replica while it is open."""
        fault = self._open.get((role, replica))
        if fault is None:
            fault = Fault(role, replica, cause, detected_at=time.time())
            self._open[(role, replica)] = fault
            self.faults.append(fault)
        fault.retried.append(work)
        return fault

    def recovered(self, fault: Fault) -> None:
        """The role served work of `fault` again."""
        if fault.recovered_at is None:
            fault.recovered_at = time.time()
            self._open.pop((fault.role, fault.replica), None)

    def take_finished(self) -> list[Fault]:
        """Recovered faults not handed out before, oldest first."""
        done = [
            f for f in self.faults if f.recovered_at is not None and id(f) not in self._handed_out
        ]
        self._handed_out.update(id(f) for f in done)
        return done


class Retry:
    """Runs role calls, re-running those a replica failure cut off (module docstring)."""

    def __init__(self, config: FaultsConfig, timeline: FaultTimeline, classify: Classify) -> None:
        self._config = config
        self._timeline = timeline
        self._classify = classify

    async def call(self, role: str, work: Callable[[int], Awaitable[T]], *, what: str = "") -> T:
        """`await work(attempt)` until it succeeds; raise `RoleFailed` after
        `faults.max_attempts` lost attempts, or the work's own error at once."""
        attempt = 0
        faults: list[Fault] = []
        while True:
            try:
                result = await work(attempt)
            except Exception as err:
                failure = self._classify(err)
                if failure is None:
                    raise
                kind, replica = failure
                if kind == "lost":
                    cause = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    faults.append(self._timeline.failed(role, replica, cause, what or role))
                    attempt += 1
                    if attempt >= self._config.max_attempts:
                        raise RoleFailed(
                            f"the {role} role lost {what or 'a call'} {attempt} times (last: "
                            f"{cause}); faults.max_attempts={self._config.max_attempts}"
                        ) from err
                await asyncio.sleep(self._config.retry_pause_s)
                continue
            for fault in faults:
                self._timeline.recovered(fault)
            return result


def never_retry(err: BaseException) -> tuple[Failure, str] | None:
    """The `Classify` of roles in this process: every error is the work's own."""
    return None
