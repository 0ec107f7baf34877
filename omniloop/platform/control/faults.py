"""Role failures and recovery: the fault timeline, and retrying work a failed replica cut off.

A call to a role fails in one of three ways, told apart by a `Classify` function the role's
transport provides (`deployments.classify_failure` for Ray Serve; in this process nothing is
retried):

- `busy`: the role refused the call (back-pressure: its queue is full). Waited out and retried;
  neither a fault nor an attempt.
- `lost`: the replica running the call died (its process was killed, its node was lost), or
  one the work depended on did (an error with a `failed_role`, such as `SandboxLost`: the fault
  is filed under that role). A fault on the timeline; the work is re-run as `attempt + 1`
  (the role replaces the replica; every call here is idempotent: an episode keeps its
  trajectory id, a step's advantages are recomputed from its rows).
- anything else is the work's own error and is raised as it is.

The timeline holds one `Fault` per failure of a role: when it was detected, the work that was
retried, and when the role was back to full strength (`recovered_at`, seen by the
`health.HealthMonitor`). Through `RunRecord`, every fault goes to the run store twice, as
events of type `fault` under its `fault_id`: once when it is detected (still down) and once
when it has recovered (or the run ended with it open); the second supersedes the first. The
finished fault also goes to `RUN_DIR/faults.jsonl` and the step's metrics (`faults/count`,
`faults/recovery_seconds`); refused calls are counted in the step's `faults/refused_calls`.
"""

from __future__ import annotations

import asyncio
import secrets
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
    fault_id: str = field(default_factory=lambda: secrets.token_hex(8))
    """Names the fault across the events that record it (detected, then recovered)."""

    @property
    def recovery_seconds(self) -> float | None:
        """Seconds from detection to recovery, None while still down."""
        return None if self.recovered_at is None else self.recovered_at - self.detected_at

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON object (`recovery_seconds` included)."""
        return {**asdict(self), "recovery_seconds": self.recovery_seconds}


class FaultTimeline:
    """The run's faults in order of detection: at most one open fault per role, which every
    report of the same role joins until the role is back to full strength.

    Two sources report: `Retry` (work cut off: `failed`) and the `HealthMonitor` (the role's
    replicas as Ray Serve sees them: `role_down`, `role_up`). Only the monitor closes a fault,
    when a poll that started after the fault was opened finds every replica running and
    healthy, and either it had seen the role down or `settle_s` have passed (a replica replaced
    faster than a poll). `take_finished` hands each closed fault out once; `on_open` is given
    each fault as it opens.
    """

    def __init__(
        self,
        settle_s: float = 10.0,
        on_change: Callable[[str], None] | None = None,
        on_open: Callable[[Fault], None] | None = None,
    ) -> None:
        self._on_change = on_change or (lambda _: None)
        """Told each change in words (a fault opened, work retried, a role recovered)."""
        self._on_open = on_open or (lambda _: None)
        """Given each new fault as it opens (before any work is retried under it)."""
        self.faults: list[Fault] = []
        self._settle_s = settle_s
        self._open: dict[str, Fault] = {}
        self._seen_down: set[str] = set()
        self._handed_out: set[int] = set()
        self._refused = 0

    def refused(self, role: str) -> None:
        """`role` refused a call (its queue was full); it will be retried, and is no fault."""
        self._refused += 1

    def take_refused(self) -> int:
        """Calls refused since the last take."""
        count, self._refused = self._refused, 0
        return count

    def failed(self, role: str, replica: str, cause: str, work: str | None = None) -> Fault:
        """Note a failure of `role` (and the `work` it cut off, if any)."""
        fault = self._open.get(role)
        if fault is None:
            fault = Fault(role, replica, cause, detected_at=time.time())
            self._open[role] = fault
            self.faults.append(fault)
            self._on_change(f"{role} failed: {cause}")
            self._on_open(fault)
        elif replica and not fault.replica:
            fault.replica = replica
        if work is not None:
            fault.retried.append(work)
            self._on_change(f"{role}: re-running {work}")
        return fault

    def role_down(self, role: str, cause: str) -> None:
        """The monitor found `role` short of replicas or unhealthy."""
        self.failed(role, "", cause)
        self._seen_down.add(role)

    def role_up(self, role: str, polled_at: float) -> None:
        """The monitor found every replica of `role` running and healthy at `polled_at`."""
        fault = self._open.get(role)
        if fault is None or polled_at <= fault.detected_at:
            return
        if role in self._seen_down or polled_at - fault.detected_at >= self._settle_s:
            fault.recovered_at = polled_at
            del self._open[role]
            self._seen_down.discard(role)
            self._on_change(f"{role} recovered after {fault.recovery_seconds:.1f}s")

    def take_all(self) -> list[Fault]:
        """Every fault not handed out before, recovered or not, oldest first."""
        left = [f for f in self.faults if id(f) not in self._handed_out]
        self._handed_out.update(id(f) for f in left)
        return left

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
        while True:
            try:
                result = await work(attempt)
            except Exception as err:
                failure = self._classify(err)
                if failure is None:
                    raise
                kind, replica = failure
                if kind == "busy":
                    self._timeline.refused(role)
                if kind == "lost":
                    cause = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    failed = failed_role(err) or role
                    self._timeline.failed(failed, replica, cause, what or role)
                    attempt += 1
                    if attempt >= self._config.max_attempts:
                        raise RoleFailed(
                            f"the {failed} role lost {what or 'a call'} {attempt} times (last: "
                            f"{cause}); faults.max_attempts={self._config.max_attempts}"
                        ) from err
                await asyncio.sleep(self._config.retry_pause_s)
                continue
            return result


def failed_role(err: BaseException) -> str:
    """The role an error names as the one whose failure it is (`RoleLost.failed_role`), also
    through the wrapper Ray raises for an error from another process (`RayTaskError`, which
    subclasses the error's class but keeps the instance, and its attributes, as `cause`); ""
    if it names none."""
    named = getattr(err, "failed_role", "") or getattr(
        getattr(err, "cause", None), "failed_role", ""
    )
    return str(named or "")


def never_retry(err: BaseException) -> tuple[Failure, str] | None:
    """The `Classify` of roles in this process: every error is the work's own."""
    return None
