"""The actor replica serves the run only once the controller has adopted or restored it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.controller import ActorLost
from omniloop.platform.control.data_roles import ActorReplaced, ActorServer
from omniloop.platform.control.deployments import classify_failure
from omniloop.platform.control.services import ServiceActor


class _Trainer:
    version = 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def train(self, step: int) -> str:
        self.calls.append(f"train {step}")
        return "report"

    async def save(self, path: Path, step: int) -> None:
        self.calls.append(f"save {step}")

    async def load(self, path: Path) -> int:
        self.version = 6
        return 6

    async def reopen_steps(self, from_step: int) -> None:
        self.calls.append(f"reopen from {from_step}")

    def restored(self) -> None:
        self.calls.append("restored")


class _Weights:
    async def publish(self, version: int) -> dict[str, float]:
        return {}


class _Replica(ActorServer):
    def __del__(self) -> None:  # type: ignore[override]  # nothing was entered to close
        pass


def _replica() -> tuple[ActorServer, _Trainer]:
    """A replica as Serve starts it (the constructor's trainer and weight sync, not adopted)."""
    replica = object.__new__(_Replica)
    trainer = _Trainer()
    replica._actor = trainer  # type: ignore[assignment]
    replica._weights = _Weights()  # type: ignore[assignment]
    replica._adopted = False
    return replica, trainer


def test_a_replacement_refuses_work_until_restored() -> None:
    replica, trainer = _replica()
    for call in (replica.train(7), replica.save("/x", 7), replica.publish(7)):
        with pytest.raises(ActorReplaced, match="has not been restored"):
            asyncio.run(call)
    assert trainer.calls == []
    assert asyncio.run(replica.restore("/ckpt")) == (6, 6)
    assert asyncio.run(replica.train(6)) == "report"
    # The steps from the checkpoint's on are produced again: the lost actor cleared some.
    assert trainer.calls == ["reopen from 6", "restored", "train 6"]


def test_the_first_replica_is_adopted_as_it_is() -> None:
    replica, trainer = _replica()
    assert asyncio.run(replica.adopt()) == 0
    asyncio.run(replica.train(0))
    resumed, _ = _replica()
    assert asyncio.run(resumed.load("/ckpt")) == (6, 6)
    asyncio.run(resumed.save("/ckpt2", 6))
    assert trainer.calls == ["train 0"]


def test_the_controller_takes_a_refusal_for_a_lost_actor() -> None:
    assert classify_failure(ActorReplaced("x")) == ("lost", "")

    async def refused(step: int) -> Any:
        raise ActorReplaced("this actor replica replaced a lost one")

    class Method:
        def remote(self, step: int) -> Any:
            return refused(step)

    class Handle:
        train = Method()

    actor = ServiceActor(Handle(), version=6, wait_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ActorLost, match="training step 7"):
        asyncio.run(actor.train(7))
    assert actor.version == 6
