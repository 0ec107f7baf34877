"""The health manager: watches every role service and puts its failures on the fault timeline.

Two layers, each with its own period (typed config, `services.*`):

- per replica, Ray Serve calls the role's `check_health` every `health_check_period_s` (the
  role tests what it needs: the engine answers, the model is loaded, the data plane is
  reachable) and treats a replica that fails it, takes longer than `health_check_timeout_s`,
  or dies as failed: it is stopped and replaced. This is the heartbeat of each replica.
- per role, `HealthMonitor` polls Serve's status of each role's deployment every
  `health_poll_s`: a deployment that is not HEALTHY, or runs fewer replicas than it should, is
  down (`FaultTimeline.role_down`, with Serve's message as the cause); once it is back it is up
  (`role_up`, which closes the fault with its recovery time). A poll that fails (the Serve
  controller itself not answering) counts against `max_failed_polls`; past it the run fails,
  since no role can be recovered without the controller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from omniloop.errors import OmniloopError
from omniloop.platform.control.faults import FaultTimeline


class ServeControllerLost(OmniloopError):
    """Ray Serve's controller stopped answering; roles can no longer be recovered."""


class HealthMonitor:
    """Polls the roles' deployments and reports their health to a `FaultTimeline`."""

    def __init__(
        self,
        replicas: Mapping[str, int],
        timeline: FaultTimeline,
        *,
        period_s: float,
        max_failed_polls: int,
    ) -> None:
        self._replicas = dict(replicas)
        """Role (Serve application and deployment name) -> replicas it should run."""
        self._timeline = timeline
        self._period_s = period_s
        self._max_failed_polls = max_failed_polls

    async def run(self) -> None:
        """Poll until cancelled; raises `ServeControllerLost` after too many failed polls."""
        failed = 0
        while True:
            polled_at = time.time()
            try:
                status = await asyncio.to_thread(_deployment_status)
            except Exception as err:
                failed += 1
                if failed >= self._max_failed_polls:
                    raise ServeControllerLost(
                        f"Ray Serve's status could not be read {failed} times in a row "
                        f"({type(err).__name__}: {err})"
                    ) from err
            else:
                failed = 0
                self.observe(status, polled_at)
            await asyncio.sleep(self._period_s)

    def observe(self, status: Mapping[str, tuple[str, int, str]], polled_at: float) -> None:
        """Report each role's `(status, running replicas, message)` as seen at `polled_at`."""
        for role, wanted in self._replicas.items():
            state, running, message = status.get(role, ("MISSING", 0, "not deployed"))
            if state == "HEALTHY" and running >= wanted:
                self._timeline.role_up(role, polled_at)
            else:
                cause = message.splitlines()[0][:300] if message else state
                self._timeline.role_down(role, f"{running} of {wanted} replicas running: {cause}")


def _deployment_status() -> dict[str, tuple[str, int, str]]:
    """Role -> (deployment status, running replicas, message), from Ray Serve."""
    from ray import serve

    out: dict[str, tuple[str, int, str]] = {}
    for app_name, app in serve.status().applications.items():
        for name, deployment in app.deployments.items():
            if name != app_name:
                continue
            running = sum(
                count
                for state, count in deployment.replica_states.items()
                if getattr(state, "value", state) == "RUNNING"
            )
            state = getattr(deployment.status, "value", deployment.status)
            out[app_name] = (str(state), running, deployment.message or "")
    return out
