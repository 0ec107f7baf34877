"""The reaper: removes Docker sandboxes that nobody will close, by label, whatever their state.

Everything a Docker sandbox is made of (its container, and in allowlist mode its proxy and
network) carries `omniloop.sandbox=1`, `omniloop.expires_at` and `omniloop.owner`. A thing is
removed when

- its `expires_at` has passed (running or not: a `sleep infinity` left behind is the classic
  leak reapers that match only exited containers miss);
- its owner process is gone (same machine and pid namespace; see `docker.owner_alive`), e.g. a
  worker or the service was SIGKILLed;
- its owner is this very process and it is no longer in use here (its `close` failed, say after
  the Docker connection broke);
- it has stopped (exited or dead) and is older than `grace` (a container whose init died;
  auto-remove normally takes those at once). A container that is `created` but not yet running
  is left to its owner: a loaded daemon can take longer than the grace to start one, and the
  owner is about to use it; one left behind goes with its owner or at its expiry;
- it is a network or volume older than `grace` whose sandbox container no longer exists.

Removal failures are logged and counted (`docker.cleanup_failures`), never ignored. Run it at
start-up and every `period` seconds (`Reaper.start`); `reap_once` is one pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from docker.errors import DockerException, NotFound
from requests.exceptions import RequestException

from omniloop.errors import SandboxError
from omniloop.sandboxes.docker import (
    LABEL_EXPIRES,
    LABEL_OWNER,
    LABEL_SANDBOX,
    DockerHost,
    count_cleanup_failure,
    owned_live_names,
    owner_alive,
    process_owner,
    remove_resources,
)

logger = logging.getLogger(__name__)

_FILTER = {"label": [f"{LABEL_SANDBOX}=1"]}
_STOPPED = frozenset({"exited", "dead"})
"""Docker's container states in which its init has ended (`created`, `running`, `paused`,
`restarting` and `removing` are the others)."""
_PARALLEL_REMOVALS = 8  # a leak of hundreds must go within one period, without flooding Docker


@dataclass
class ReapReport:
    """What one pass removed, and how many removals failed."""

    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    failures: int = 0

    @property
    def removed(self) -> int:
        """Containers, networks and volumes removed."""
        return len(self.containers) + len(self.networks) + len(self.volumes)


def reap_reason(
    labels: dict[str, str],
    *,
    name: str,
    state: str,
    age: float,
    now: float,
    grace: float,
    live: Collection[str],
    me: str,
) -> str | None:
    """Why a labelled thing must go (see the module docstring), or None to keep it."""
    expires = labels.get(LABEL_EXPIRES, "")
    try:
        if float(expires) <= now:
            return "expired"
    except ValueError:
        if age > grace:
            return "no valid expiry label"
    owner = labels.get(LABEL_OWNER, "")
    if owner == me:
        if name not in live:
            return "abandoned by this process"
    elif owner and owner_alive(owner) is False:
        return "owner process gone"
    if state in _STOPPED and age > grace:
        return "stopped"
    return None


def _created(value: Any) -> float:
    """Docker gives containers a unix time and networks/volumes an RFC 3339 string."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value:
        text = value.replace("Z", "+00:00")
        # Python's parser takes at most microseconds; Docker writes nanoseconds.
        if "." in text:
            head, _, tail = text.partition(".")
            digits = "".join(ch for ch in tail if ch.isdigit())
            zone = tail[len(digits) :]
            text = f"{head}.{digits[:6]}{zone}"
        try:
            return datetime.fromisoformat(text).timestamp()
        except ValueError:
            return 0.0
    return 0.0


class Reaper:
    """Removes orphaned and expired sandboxes of one Docker daemon (see the module docstring).

    `live` names extra things this process still uses, beyond the sandboxes it created through
    `docker.create_docker_sandbox` (those are known already)."""

    def __init__(
        self,
        host: DockerHost,
        *,
        period: float = 30.0,
        grace: float = 60.0,
        live: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.host = host
        self.period = period
        self.grace = grace
        self._extra_live = live
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        self.removed_total = 0
        self.last_report: ReapReport | None = None

    def _live(self) -> set[str]:
        names = set(owned_live_names())
        if self._extra_live is not None:
            names.update(self._extra_live())
        return names

    async def reap_once(self) -> ReapReport:
        """One pass over containers, then networks, then volumes. Raises `SandboxError` only
        when Docker cannot be listed; each failed removal is counted in the report."""
        report = ReapReport()
        api = self.host.api
        try:
            containers = await self.host.call(api.containers, all=True, filters=_FILTER)
        except (DockerException, RequestException, OSError) as err:
            raise SandboxError(f"reaper cannot list containers: {err}") from err
        now = time.time()
        me = process_owner()
        live = self._live()
        existing_sandboxes: set[str] = set()
        doomed: list[tuple[str, str, str]] = []
        for item in containers:
            labels = item.get("Labels") or {}
            name = (item.get("Names") or ["/?"])[0].lstrip("/")
            reason = reap_reason(
                labels,
                name=name,
                state=str(item.get("State", "")),
                age=now - _created(item.get("Created")),
                now=now,
                grace=self.grace,
                live=live,
                me=me,
            )
            if reason is None:
                existing_sandboxes.add(labels.get("omniloop.sandbox_id", ""))
            else:
                doomed.append((item["Id"], name, reason))
        slots = asyncio.Semaphore(_PARALLEL_REMOVALS)

        async def remove(container_id: str, name: str, reason: str) -> None:
            async with slots:
                if await remove_resources(self.host, [container_id], []):
                    logger.info("reaped container %s (%s)", name, reason)
                    report.containers.append(name)
                else:
                    report.failures += 1

        await asyncio.gather(*(remove(*item) for item in doomed))
        await self._reap_networks(report, now, me, live, existing_sandboxes)
        await self._reap_volumes(report, now, me, live, existing_sandboxes)
        self.passes += 1
        self.removed_total += report.removed
        self.last_report = report
        return report

    def _other_reason(
        self,
        labels: dict[str, str],
        name: str,
        created: Any,
        now: float,
        me: str,
        live: Collection[str],
        existing: set[str],
    ) -> str | None:
        age = now - _created(created)
        reason = reap_reason(
            labels, name=name, state="running", age=age, now=now, grace=self.grace, live=live, me=me
        )
        sandbox_id = labels.get("omniloop.sandbox_id", "")
        if reason is None and age > self.grace and sandbox_id not in existing:
            reason = "its sandbox is gone"
        return reason

    async def _reap_networks(
        self, report: ReapReport, now: float, me: str, live: Collection[str], existing: set[str]
    ) -> None:
        api = self.host.api
        try:
            networks = await self.host.call(api.networks, filters=_FILTER)
        except (DockerException, RequestException, OSError) as err:
            logger.error("reaper cannot list networks: %s", err)
            report.failures += 1
            return
        for item in networks:
            name = item.get("Name", "")
            reason = self._other_reason(
                item.get("Labels") or {}, name, item.get("Created"), now, me, live, existing
            )
            if reason is None:
                continue
            if await remove_resources(self.host, [], [item["Id"]]):
                logger.info("reaped network %s (%s)", name, reason)
                report.networks.append(name)
            else:
                report.failures += 1

    async def _reap_volumes(
        self, report: ReapReport, now: float, me: str, live: Collection[str], existing: set[str]
    ) -> None:
        api = self.host.api
        try:
            listing = await self.host.call(api.volumes, filters=_FILTER)
        except (DockerException, RequestException, OSError) as err:
            logger.error("reaper cannot list volumes: %s", err)
            report.failures += 1
            return
        for item in (listing or {}).get("Volumes") or []:
            name = item.get("Name", "")
            reason = self._other_reason(
                item.get("Labels") or {}, name, item.get("CreatedAt"), now, me, live, existing
            )
            if reason is None:
                continue
            try:
                await self.host.call(api.remove_volume, name, force=True)
            except NotFound:
                continue
            except (DockerException, RequestException, OSError, SandboxError) as err:
                count_cleanup_failure(f"volume {name}", err)
                report.failures += 1
                continue
            logger.info("reaped volume %s (%s)", name, reason)
            report.volumes.append(name)

    async def _loop(self) -> None:
        while True:
            try:
                await self.reap_once()
            except SandboxError as err:
                logger.error("%s", err)
            await asyncio.sleep(self.period)

    def start(self) -> None:
        """Reap now and then every `period` seconds, in a background task of the running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the periodic passes."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
