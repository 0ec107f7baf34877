"""`reap_reason`: which labelled Docker things the reaper takes, by expiry, owner and state."""

from __future__ import annotations

import time

import pytest

from omniloop.sandboxes.docker.ownership import LABEL_EXPIRES, LABEL_OWNER, process_owner
from omniloop.sandboxes.reaper import reap_reason

GRACE = 5.0


def reason(
    *,
    state: str = "running",
    age: float = 60.0,
    owner: str | None = None,
    expires_in: float = 600.0,
    live: frozenset[str] = frozenset({"omniloop-sbx-a"}),
) -> str | None:
    now = time.time()
    labels = {
        LABEL_EXPIRES: str(int(now + expires_in)),
        LABEL_OWNER: process_owner() if owner is None else owner,
    }
    return reap_reason(
        labels,
        name="omniloop-sbx-a",
        state=state,
        age=age,
        now=now,
        grace=GRACE,
        live=live,
        me=process_owner(),
    )


@pytest.mark.parametrize("state", ["created", "running", "paused", "restarting", "removing"])
def test_a_live_owners_container_that_has_not_stopped_is_kept_past_the_grace(state: str) -> None:
    # `created` lasts until the start returns, which a loaded daemon can take past the grace.
    assert reason(state=state) is None


@pytest.mark.parametrize("state", ["exited", "dead"])
def test_a_stopped_container_goes_after_the_grace(state: str) -> None:
    assert reason(state=state, age=GRACE + 1) == "stopped"
    assert reason(state=state, age=GRACE - 1) is None


def test_expiry_abandonment_and_a_gone_owner_take_any_state() -> None:
    assert reason(state="created", expires_in=-1) == "expired"
    assert reason(state="created", live=frozenset()) == "abandoned by this process"
    scope, pid_and_start = process_owner().rsplit("/", 2)[0], "999999999/1"
    assert reason(state="created", owner=f"{scope}/{pid_and_start}") == "owner process gone"


def test_an_owner_that_cannot_be_told_keeps_its_unstopped_containers() -> None:
    assert reason(state="created", owner="elsewhere/1/2/3") is None
    assert reason(state="exited", owner="elsewhere/1/2/3") == "stopped"
