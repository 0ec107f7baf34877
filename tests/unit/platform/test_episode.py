"""run_episode turns every way an episode can end into data: limits, engine and sandbox
failures, rewards that raise or hang, cancellation. (Scripted engine and in-memory sandbox:
fakes inside a unit test of this one module; the real path is tested end to end.)"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from omniloop import Task, ToolAgent, reward
from omniloop.agents.chat import ChatFormat
from omniloop.errors import EngineError, SandboxError
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.episode import EpisodeCancelled, EpisodeSettings, run_episode
from omniloop.sandboxes.base import ExecResult
from omniloop.tools import python

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


class Engine:
    def __init__(self, tokenizer, texts: list[str], fail_at: int | None = None, hang: bool = False):
        self.replies = [[*tokenizer.encode(t, add_special_tokens=False), 2] for t in texts]
        self.fail_at = fail_at
        self.hang = hang
        self.calls = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        turn = self.calls
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        if turn == self.fail_at:
            raise EngineError("engine answered 503")
        ids = self.replies[min(turn, len(self.replies) - 1)]
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[-1.0] * len(ids),
            finish_reason="stop",
            weight_version=0,
        )


class Sandbox:
    def __init__(self, broken: bool = False):
        self.id = "mem"
        self.broken = broken
        self.closed = False

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        if self.broken:
            raise SandboxError("container vanished")
        return ExecResult(exit_code=0, stdout="1\n", stderr="", duration=0.01)

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def read_file(self, path: str) -> bytes:
        return b""

    async def close(self) -> None:
        self.closed = True


class Provider:
    def __init__(self, broken: bool = False):
        self.broken = broken
        self.handed: list[Sandbox] = []
        self.released: list[Sandbox] = []
        self.acquired = asyncio.Event()

    async def acquire(self) -> Sandbox:
        sandbox = Sandbox(self.broken)
        self.handed.append(sandbox)
        self.acquired.set()
        return sandbox

    async def release(self, sandbox) -> None:
        self.released.append(sandbox)


@reward
def always_one(task: dict, response: str) -> float:
    return 1.0


@reward
def raises(task: dict, response: str) -> float:
    raise ValueError("reward bug")


@reward(timeout=0.05)
async def hangs(task: dict, response: str) -> float:
    await asyncio.sleep(5)
    return 1.0


async def episode(tokenizer, engine, provider=None, rewards=(always_one,), max_turns=4):
    agent = ToolAgent([python])
    provider = provider or Provider()
    traj = await run_episode(
        agent,
        Task(id="t", prompt="q", answer="1"),
        engine=engine,
        chat=ChatFormat(tokenizer, agent.tool_schemas),
        sandbox_provider=provider,
        rewards=list(rewards),
        settings=EpisodeSettings(run_id="r", episode_id="t/0", group_id="t", max_turns=max_turns),
    )
    return traj, provider


async def test_a_finished_episode_is_scored_and_its_sandbox_released(tokenizer):
    traj, provider = await episode(tokenizer, Engine(tokenizer, [CALL, "It is 1."]))
    assert traj.meta.stop_reason == "stop"
    assert traj.reward == 1.0
    assert traj.reward_info == {"always_one": 1.0}
    assert [c.output for c in traj.meta.tool_calls] == ["1\n"]
    assert traj.meta.metrics["tool_calls/ok"] == 1
    assert provider.released == provider.handed
    assert len(provider.handed) == 1


async def test_an_episode_without_tool_calls_never_takes_a_sandbox(tokenizer):
    traj, provider = await episode(tokenizer, Engine(tokenizer, ["It is 1."]))
    assert traj.meta.stop_reason == "stop"
    assert provider.handed == []


async def test_max_turns_is_a_stop_reason_and_still_scored(tokenizer):
    traj, _ = await episode(tokenizer, Engine(tokenizer, [CALL]), max_turns=2)
    assert traj.meta.stop_reason == "max_turns"
    assert traj.reward == 1.0
    assert len(traj.meta.turns) == 2


async def test_engine_failure_is_recorded_not_trained_as_zero(tokenizer):
    traj, provider = await episode(tokenizer, Engine(tokenizer, [CALL], fail_at=1))
    assert traj.meta.stop_reason == "engine_error"
    assert traj.meta.error is not None
    assert traj.meta.error.type == "EngineError"
    assert traj.reward is None
    assert traj.is_infra_failure
    assert provider.released == provider.handed


async def test_sandbox_failure_is_recorded_not_shown_to_the_model(tokenizer):
    traj, _ = await episode(tokenizer, Engine(tokenizer, [CALL]), provider=Provider(broken=True))
    assert traj.meta.stop_reason == "sandbox_error"
    assert traj.meta.error.type == "SandboxError"
    assert traj.reward is None
    assert traj.meta.tool_calls == []


@pytest.mark.parametrize("bad", [raises, hangs])
async def test_a_reward_that_raises_or_times_out_marks_reward_error(tokenizer, bad):
    traj, _ = await episode(tokenizer, Engine(tokenizer, ["It is 1."]), rewards=[bad])
    assert traj.meta.stop_reason == "reward_error"
    assert traj.meta.error.type == "RewardError"
    assert traj.reward is None
    assert traj.is_infra_failure


async def test_cancellation_releases_the_sandbox_and_propagates(tokenizer):
    provider = Provider()

    class SlowSecondTurn(Engine):
        async def generate(self, input_ids, sampling):
            if self.calls == 1:
                await asyncio.sleep(3600)
            return await super().generate(input_ids, sampling)

    carried: list[EpisodeCancelled] = []

    async def run() -> None:
        try:
            await episode(tokenizer, SlowSecondTurn(tokenizer, [CALL]), provider)
        except EpisodeCancelled as err:
            carried.append(err)
            raise

    task = asyncio.create_task(run())
    await provider.acquired.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert provider.released == provider.handed
    # What ran is kept: the first turn, its tool call, stop reason `cancelled`, no reward.
    trajectory = carried[0].trajectory
    assert trajectory.meta.stop_reason == "cancelled"
    assert trajectory.reward is None
    assert len(trajectory.meta.turns) == 1
    assert len(trajectory.meta.tool_calls) == 1
    trajectory.check()
