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
