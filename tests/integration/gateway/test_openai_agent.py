"""`OpenAIAgent` episodes through `run_episode`, on the real tiny engine over HTTP.

What must hold:
- an agent written with the `openai` package, as a callable and as a command (a real
  subprocess given `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `OMNILOOP_TASK`), yields a trajectory
  whose sampled tokens are the ones the engine returned to the agent, whose final response is
  the agent's answer, scored by the rewards;
- the rollout's sampling governs the agent's calls (its `max_new_tokens` caps what the agent
  asks for);
- an engine failure behind a call is `engine_error` whatever the agent does with it; a call past
  `max_turns` ends the episode `max_turns`; an agent that raises on its own is counted and its
  episode scored.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from omniloop.agents.base import Task
from omniloop.agents.chat import ChatFormat
from omniloop.gateway.agent import OpenAIAgent, OpenAIEndpoint
from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.episode import EpisodeSettings, run_episode
from omniloop.rewards import reward

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "openai_agent" / "agent.py"
TASK = Task(
    id="t0",
    prompt="Where is the treasure?",
    answer="east",
    metadata={"treasure": "east", "code": "6bdb262b"},
)
seen: list[Any] = []


class NoSandboxes:
    async def acquire(self) -> Any:
        raise AssertionError("an OpenAIAgent episode never asks for a sandbox here")

    async def release(self, sandbox: Any) -> None: ...


@reward
def says_hello(response: str) -> float:
    return float(response == "hello")


async def episode(
    agent: OpenAIAgent, engine_url: str, *, max_turns: int = 3, max_new_tokens: int = 8
) -> Any:
    async with EngineClient(engine_url) as engine:
        return await run_episode(
            agent,
            TASK,
            engine=engine,
            chat=ChatFormat(load_tokenizer("tiny")),
            sandbox_provider=NoSandboxes(),  # type: ignore[arg-type]
            rewards=[says_hello],
            settings=EpisodeSettings(
                run_id="r", episode_id="step0/t0/3", max_turns=max_turns, max_context=256,
                sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=5),
            ),
        )  # fmt: skip


async def two_calls_then_hello(task: Task, endpoint: OpenAIEndpoint) -> str:
    """Asks for far more tokens than the rollout allows, twice, resending its history."""
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
        messages: list[Any] = [{"role": "user", "content": task.prompt}]
        for _ in range(2):
            reply = await client.chat.completions.create(
                model=endpoint.model, messages=messages, max_tokens=400, temperature=0.0
            )
            seen.append(reply)
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "Go on."}]
    return "hello"


async def test_a_callable_agent_s_calls_are_the_trajectory(tiny_engine_url: str) -> None:
    seen.clear()
    trajectory = await episode(OpenAIAgent(two_calls_then_hello), tiny_engine_url)
    assert trajectory.meta.stop_reason == "stop"
    assert trajectory.reward == 1.0  # the agent's answer is the final response
    sampled = [t for t, m in zip(trajectory.input_ids, trajectory.loss_mask, strict=True) if m]
    replies = [r.choices[0].model_extra["token_ids"] for r in seen]
    assert sampled == [t for ids in replies for t in ids]
    assert all(len(ids) <= 8 for ids in replies)  # the rollout's cap, not the agent's 400
    assert len(trajectory.meta.turns) == 2
    assert trajectory.meta.metrics["gateway/calls"] == 2
    assert trajectory.meta.metrics["gateway/resent_calls"] == 1.0  # the second call
    assert trajectory.meta.metrics["gateway/stable_calls"] == 1.0


async def test_a_command_agent_gets_the_endpoint_and_the_task(
    tiny_engine_url: str, tmp_path: Path
) -> None:
    agent = OpenAIAgent(command=[sys.executable, str(EXAMPLE)], timeout_s=120)
    trajectory = await episode(agent, tiny_engine_url, max_new_tokens=16)
    assert trajectory.meta.stop_reason == "stop"
    assert trajectory.meta.error is None
    assert len(trajectory.meta.turns) == 1
    assert sum(trajectory.loss_mask) == trajectory.meta.turns[0].num_sampled >= 1
    assert "gateway/agent_errors" not in trajectory.meta.metrics


async def test_an_engine_failure_is_an_engine_error(unused_tcp_port: int) -> None:
    trajectory = await episode(
        OpenAIAgent(two_calls_then_hello), f"http://127.0.0.1:{unused_tcp_port}"
    )
    assert trajectory.meta.stop_reason == "engine_error"
    assert trajectory.is_infra_failure
    assert trajectory.reward is None


async def test_a_call_past_max_turns_ends_the_episode(tiny_engine_url: str) -> None:
    trajectory = await episode(OpenAIAgent(two_calls_then_hello), tiny_engine_url, max_turns=1)
    assert trajectory.meta.stop_reason == "max_turns"
    assert len(trajectory.meta.turns) == 1


async def test_an_agent_that_raises_is_counted_and_scored(tiny_engine_url: str) -> None:
    def broken(task: Task, endpoint: OpenAIEndpoint) -> str:
        raise KeyError("the agent's own bug")

    trajectory = await episode(OpenAIAgent(broken), tiny_engine_url)
    assert trajectory.meta.stop_reason == "stop"
    assert trajectory.meta.metrics["gateway/agent_errors"] == 1.0
    assert trajectory.reward == 0.0


def test_an_agent_needs_a_callable_or_a_command() -> None:
    with pytest.raises(Exception, match="exactly one"):
        OpenAIAgent()
