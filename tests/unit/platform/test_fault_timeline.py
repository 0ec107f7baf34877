"""`FaultTimeline`: one open fault per role, told as it opens, closed by the health monitor."""

from __future__ import annotations

import time

from omniloop.platform.control.faults import Fault, FaultTimeline


def test_each_fault_is_told_once_as_it_opens_and_keeps_its_id_to_recovery() -> None:
    opened: list[tuple[str, dict[str, object]]] = []
    timeline = FaultTimeline(
        settle_s=60.0, on_open=lambda fault: opened.append((fault.fault_id, fault.to_json()))
    )
    first = timeline.failed("rollout", "r1", "ActorDiedError: gone", "step 1 episode 2")
    again = timeline.failed("rollout", "r1", "ActorDiedError: gone", "step 1 episode 3")
    timeline.role_down("reward", "1 of 2 replicas running: x")
    assert again is first
    assert [fault_id for fault_id, _ in opened] == [first.fault_id, timeline.faults[1].fault_id]
    # Told before the work it cut off is noted: the detection record is the fault as first seen.
    assert opened[0][1]["recovered_at"] is None
    assert opened[0][1]["retried"] == []
    assert first.retried == ["step 1 episode 2", "step 1 episode 3"]

    timeline.role_up("rollout", time.time() + 1)  # not seen down, settle not passed: open
    assert timeline.take_finished() == []
    timeline.role_down("rollout", "0 of 1 replicas running")  # joins the open fault
    timeline.role_up("rollout", time.time() + 1)
    [done] = timeline.take_finished()
    assert done.fault_id == first.fault_id
    assert done.recovery_seconds is not None
    assert len(opened) == 2


def test_fault_ids_differ() -> None:
    faults = [Fault("actor", "", "x", detected_at=0.0) for _ in range(100)]
    assert len({f.fault_id for f in faults}) == 100


def test_the_monitor_follows_launched_engines_from_their_first_healthy_poll() -> None:
    from omniloop.platform.control.health import HealthMonitor

    timeline = FaultTimeline(settle_s=60.0)
    monitor = HealthMonitor(
        {"actor": 1},
        timeline,
        period_s=1.0,
        poll_timeout_s=1.0,
        max_failed_polls=3,
        follow={"engine+": 1},
    )
    now = time.time()

    def poll(launched: dict[str, tuple[str, int, str]]) -> None:
        nonlocal now
        now += 1
        monitor.observe({"actor": ("HEALTHY", 1, ""), **launched}, now)

    healthy = ("HEALTHY", 1, "")
    poll({"engine+1": ("DEPLOYING", 0, "starting its engine")})  # being launched: no fault
    assert timeline.faults == []
    poll({"engine+1": healthy})
    poll(
        {"engine+1": ("UNHEALTHY", 0, "stopped answering\nmore"), "engine+2": ("DEPLOYING", 0, "")}
    )
    [down] = timeline.faults
    assert (down.role, down.cause) == ("engine+1", "0 of 1 replicas running: stopped answering")
    poll({"engine+1": healthy, "engine+2": healthy})
    [recovered] = timeline.take_finished()
    assert recovered is down
    # One removed while down (a DELETE of a broken engine) leaves no fault open.
    poll({"engine+1": healthy, "engine+2": ("UNHEALTHY", 0, "gone")})
    poll({"engine+1": healthy})
    [removed] = timeline.take_finished()
    assert removed.role == "engine+2"
    assert all(f.recovered_at is not None for f in timeline.faults)


def test_a_lost_role_is_named_through_ray_s_wrapper_of_a_remote_error() -> None:
    from ray.exceptions import RayTaskError

    from omniloop.errors import RoleLost
    from omniloop.platform.control.faults import failed_role

    lost = RoleLost("step 2 episode 5: its sandbox died", "sandbox")
    assert failed_role(lost) == "sandbox"
    # What a caller of a Serve replica gets: the class is RoleLost's too, the instance is not.
    try:
        raise lost
    except RoleLost as err:
        wrapped = RayTaskError("episodes", "traceback", err).as_instanceof_cause()
    assert isinstance(wrapped, RoleLost)
    assert failed_role(wrapped) == "sandbox"
    assert failed_role(RuntimeError("bug")) == ""
