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
  controller itself gone: the call raises; or alive but stuck: no answer within
  `health_poll_timeout_s`) counts against `max_failed_polls`; past it the run fails, since no
  role can be recovered without the controller. A poll that timed out is abandoned, not
  cancelled: the controller answers it, unread, if it ever resumes.

Applications that come and go while the run lasts (the engines the api role launches on
request, `engine+N`) are followed by name prefix (`follow`) from their first healthy poll until
they are undeployed: each is a role of its own on the timeline. One undeployed while down
leaves nothing to recover: its fault ends at that poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

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
        poll_timeout_s: float,
        max_failed_polls: int,
        follow: Mapping[str, int] | None = None,
    ) -> None:
        self._replicas = dict(replicas)
        """Role (Serve application and deployment name) -> replicas it should run."""
        self._follow = dict(follow or {})
        """Name prefix of applications deployed and removed during the run -> replicas each
        should run (module docstring)."""
        self._followed: set[str] = set()
        """Followed applications that have been healthy, while they are deployed."""
        self._timeline = timeline
        self._period_s = period_s
        self._poll_timeout_s = poll_timeout_s
        self._max_failed_polls = max_failed_polls

    async def run(self) -> None:
        """Poll until cancelled; raises `ServeControllerLost` after too many failed polls."""
        failed = 0
        while True:
            polled_at = time.time()
            try:
                status = await asyncio.to_thread(_deployment_status, self._poll_timeout_s)
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
        roles = dict(self._replicas)
        deployed = set()
        for name, (state, running, _) in status.items():
            for prefix, wanted in self._follow.items():
                if not name.startswith(prefix) or name in self._replicas:
                    continue
                deployed.add(name)
                # Followed from its first healthy poll on: not while it is being deployed.
                if name in self._followed or (state == "HEALTHY" and running >= wanted):
                    self._followed.add(name)
                    roles[name] = wanted
        for gone in self._followed - deployed:
            self._timeline.role_up(gone, polled_at)  # undeployed: nothing left to recover
            self._followed.discard(gone)
        for role, wanted in roles.items():
            state, running, message = status.get(role, ("MISSING", 0, "not deployed"))
            if state == "HEALTHY" and running >= wanted:
                self._timeline.role_up(role, polled_at)
            else:
                cause = message.splitlines()[0][:300] if message else state
                self._timeline.role_down(role, f"{running} of {wanted} replicas running: {cause}")


def _deployment_status(timeout_s: float) -> dict[str, tuple[str, int, str]]:
    """Role -> (deployment status, running replicas, message), from Ray Serve's controller;
    `ray.exceptions.GetTimeoutError` when it does not answer within `timeout_s`.

    The controller's details are read as it sends them (plain JSON-ready dicts), not through
    `serve.status()`: that re-validates them into pydantic models on this side, which pickles
    each deployment's request-router class again, about 20 ms of the driver's CPU a poll
    against under 2 ms. The call is the one Serve's client makes for `serve.status()`, made
    here on the client's controller handle so that it can have a timeout (the client's own
    waits forever); Ray is pinned, and `tests/unit/platform/test_health_status.py` holds the
    shape read here."""
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # it raises when no controller runs
    details = ray.get(client._controller.get_serve_instance_details.remote(), timeout=timeout_s)
    return statuses_from_details(details)


def statuses_from_details(details: Mapping[str, Any]) -> dict[str, tuple[str, int, str]]:
    """Role -> (status, running replicas, message) out of Serve's instance details: each role
    is an application whose ingress deployment has the application's name."""
    out: dict[str, tuple[str, int, str]] = {}
    for app_name, app in (details.get("applications") or {}).items():
        deployment = (app.get("deployments") or {}).get(app_name)
        if deployment is None:
            continue
        running = sum(
            1
            for replica in deployment.get("replicas") or []
            if _value(replica.get("state")) == "RUNNING"
        )
        state = _value(deployment.get("status"))
        out[app_name] = (state, running, deployment.get("message") or "")
    return out


def _value(field: Any) -> str:
    """An enum member or its value (Serve sends either, by version) as the value's text."""
    return str(getattr(field, "value", field))
