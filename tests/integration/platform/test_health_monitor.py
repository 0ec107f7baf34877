"""The health monitor against a real Ray Serve controller that stops answering.

A controller that is alive but stuck (here: stopped with SIGSTOP) must count as failed polls,
each one ending after `poll_timeout_s`, and the monitor must end the run with
`ServeControllerLost` once `max_failed_polls` are used up, rather than wait on it forever. The
script runs in its own process so that its Ray and Serve leave nothing behind in pytest's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_STUCK_CONTROLLER = """
import asyncio, os, signal, time

import psutil
import ray
from ray import serve

from omniloop.platform.control.faults import FaultTimeline
from omniloop.platform.control.health import HealthMonitor, ServeControllerLost


@serve.deployment(name="role")
class Role:
    def __call__(self) -> str:
        return "ok"


ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
serve.start(proxy_location="Disabled")  # no HTTP: a proxy is one more start to wait for
serve.run(Role.bind(), name="role", route_prefix=None)
[controller] = [
    p for p in psutil.process_iter(["cmdline"])
    if (p.info["cmdline"] or [""])[0].startswith("ray::ServeController")
]
timeline = FaultTimeline(settle_s=60.0)
monitor = HealthMonitor(
    {"role": 1}, timeline, period_s=0.1, poll_timeout_s=1.0, max_failed_polls=3
)


async def main() -> None:
    watching = asyncio.create_task(monitor.run())
    await asyncio.sleep(2.0)
    print("running while the controller answers:", not watching.done())
    print("faults while it answers:", [f.cause for f in timeline.faults])
    os.kill(controller.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        await asyncio.wait_for(watching, timeout=60)
    except ServeControllerLost as err:
        print(f"lost after {time.monotonic() - stopped_at:.1f} s: {err}")
    finally:
        os.kill(controller.pid, signal.SIGCONT)


asyncio.run(main())
serve.shutdown()
ray.shutdown()
"""


def test_a_controller_that_stops_answering_ends_the_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_CONTROLLER],
        capture_output=True, text=True, timeout=170, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "running while the controller answers: True" in out, out
    assert "faults while it answers: []" in out, out
    [lost] = [line for line in out.splitlines() if line.startswith("lost after ")]
    # Three polls of 1 s each and two 0.1-s pauses: it ends in seconds, not never.
    seconds = float(lost.split()[2])
    assert 3.0 <= seconds < 30.0, lost
    assert "could not be read 3 times in a row (GetTimeoutError" in lost, lost
