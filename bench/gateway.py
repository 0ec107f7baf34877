"""The OpenAI-compatible gateway: its per-call overhead, its prefix stability, and an
OpenAI-SDK agent's episodes per second against the same agent in process.

1. Overhead (`overhead_p50_ms`): `omniloop engine serve --model tiny` (one thread, prefix
   cache off, so neither path gains from the other's prefill) and `omniloop gateway serve` in
   front of it, both subprocesses. Conversations of `TURNS` turns (a user follow-up after each
   reply) go through the gateway as an OpenAI client sends them (the whole history each call,
   raw JSON over httpx); after each call the same prompt ids (read back from the session) go
   straight to the engine's `/generate` with the same sampling and seed. Both answers must be
   the same ids. The overhead is the p50 over calls of (gateway seconds - direct seconds).
2. Prefix stability (`prefix_stability`): `CONVERSATIONS` conversations, 16 at once, through
   the same gateway: random system prompts, user turns and tool results with unicode, odd
   whitespace and special-token look-alikes, the model's replies (tool calls included, when the
   random model writes one) resent as the SDK returns them. The share of resent calls that
   extended a recorded prefix, over all sessions.
3. Episodes per second (`episodes_per_s_ratio`): the treasure hunt of
   `examples/openai_agent` (one call, a search, an answer), `EPISODES` episodes, 16 at once,
   through `run_episode` on the tiny model: the agent as written with the `openai` package
   (`OpenAIAgent`, an episode gateway each) against the same steps as an in-process `Agent`
   (one `Session.generate`), alternating, `ROUNDS` rounds each. Ratio: SDK / in process. The
   example passes `endpoint.http_client()` to the SDK; `*_default_client` is the same agent
   with the SDK's own HTTP client, which builds a TLS context per episode.

Prints ONE JSON line.

    .venv/bin/python bench/gateway.py [--conversations 1000] [--episodes 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "openai_agent"
sys.path.insert(0, str(EXAMPLE))

from agent import search, solve  # noqa: E402

from omniloop.agents.base import Session, Task  # noqa: E402
from omniloop.agents.chat import ChatFormat  # noqa: E402
from omniloop.gateway.agent import OpenAIAgent  # noqa: E402
from omniloop.inference.base import SamplingParams  # noqa: E402
from omniloop.inference.client import EngineClient  # noqa: E402
from omniloop.inference.models import load_tokenizer  # noqa: E402
from omniloop.platform.control.episode import EpisodeSettings, run_episode  # noqa: E402
from omniloop.tools import parse_tool_calls  # noqa: E402

TURNS = 4
MAX_TOKENS = 8
ROUNDS = 2
OMNILOOP = str(Path(sys.executable).with_name("omniloop"))
STOP_IDS = ChatFormat(load_tokenizer("tiny")).stop_token_ids
LOOK_ALIKES = ["<|im_end|>", "<tool_call>", "</tool_call>", "<|im_start|>", "<think>", "\u2063"]


def serve(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start an `omniloop ... serve` subprocess; its URL once it prints that it is ready."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([OMNILOOP, *args], stdout=subprocess.PIPE, stderr=out, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited; see {log}")
        found = re.search(r"ready at (http://\S+)", line)
        if found:
            return proc, found.group(1).removesuffix("/v1")
    raise RuntimeError(f"{args[0]} did not start; see {log}")


def noise(rng: random.Random) -> str:
    words = ["alpha", "béta", "中文", "🙂", "  ", "\n", "\t", *LOOK_ALIKES]
    return "".join(rng.choice(words) for _ in range(rng.randint(1, 6)))


async def overhead(engine: str, gateway: str, conversations: int) -> tuple[list[float], int]:
    """Gateway minus direct seconds per call; and how many answers differed (must be 0)."""
    gaps: list[float] = []
    differed = 0
    async with httpx.AsyncClient(timeout=60) as http:
        for c in range(conversations):
            session = f"overhead-{c}"
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Question {c}?"}]
            for turn in range(TURNS):
                seed = 1000 * c + turn
                body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS,
                        "seed": seed, "temperature": 1.0}  # fmt: skip
                started = time.perf_counter()
                reply = await http.post(
                    f"{gateway}/v1/sessions/{session}/chat/completions", json=body
                )
                via_gateway = time.perf_counter() - started
                reply.raise_for_status()
                choice = reply.json()["choices"][0]
                view = (await http.get(f"{gateway}/v1/sessions/{session}")).json()
                trajectory = view["trajectories"][-1]
                start = trajectory["meta"]["turns"][-1]["start"]
                direct_body = {
                    "input_ids": trajectory["input_ids"][:start],
                    "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 1.0,
                                        "sampling_seed": seed, "stop_token_ids": STOP_IDS},
                    "return_logprob": True,
                }  # fmt: skip
                started = time.perf_counter()
                direct = await http.post(f"{engine}/generate", json=direct_body)
                via_engine = time.perf_counter() - started
                direct.raise_for_status()
                differed += direct.json()["output_ids"] != choice["token_ids"]
                gaps.append(via_gateway - via_engine)
                messages.append({"role": "assistant", "content": choice["message"]["content"]})
                messages.append({"role": "user", "content": f"And {turn}?"})
    return gaps, differed


async def stability(gateway: str, conversations: int, seed: int = 0) -> dict[str, int]:
    """Resent conversations with odd content; the gateway's counts summed over sessions."""
    rng = random.Random(seed)
    totals = {"resent_calls": 0, "stable_calls": 0, "fresh_segments": 0}
    limit = asyncio.Semaphore(16)

    async def one(c: int, http: httpx.AsyncClient) -> None:
        async with limit:
            session = f"stability-{c}"
            messages: list[dict[str, Any]] = []
            if rng.random() < 0.5:
                messages.append({"role": "system", "content": noise(rng)})
            messages.append({"role": "user", "content": noise(rng)})
            for _ in range(rng.randint(2, 4)):
                body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
                reply = await http.post(
                    f"{gateway}/v1/sessions/{session}/chat/completions", json=body
                )
                reply.raise_for_status()
                message = reply.json()["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                if message.get("tool_calls"):
                    for call in message["tool_calls"]:
                        messages.append(
                            {"role": "tool", "tool_call_id": call["id"], "content": noise(rng)}
                        )
                elif rng.random() < 0.3:
                    messages.append({"role": "tool", "content": noise(rng)})
                else:
                    messages.append({"role": "user", "content": noise(rng)})
            view = (await http.delete(f"{gateway}/v1/sessions/{session}")).json()
            for key in totals:
                totals[key] += view[key]

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(c, http) for c in range(conversations)))
    return totals


async def solve_default_client(task: Task, endpoint: Any) -> str:
    """The example agent with the SDK's own HTTP client (a TLS context built per episode)."""
    from agent import hunt
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
        return await hunt(client, endpoint.model, task.prompt, task.metadata["treasure"])


class InProcessHunt:
    """The example agent's steps as an in-process `Agent`: one turn, the search it names."""

    tool_schemas: list[dict[str, Any]] = []

    def opening(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task.prompt}]

    async def run(self, task: Task, session: Session, context: Any) -> None:
        turn = await session.generate()
        calls = parse_tool_calls(turn.text).calls
        answer = search(calls[0].name or "", task.metadata["treasure"]) if calls else turn.text
        session.messages.append({"role": "assistant", "content": answer})


class NoSandboxes:
    async def acquire(self) -> Any:
        raise AssertionError("no sandbox here")

    async def release(self, sandbox: Any) -> None: ...


async def episodes_per_s(engine_url: str, agent: Any, episodes: int) -> float:
    chat = ChatFormat(load_tokenizer("tiny"))
    task = Task(id="t", prompt="Where is the treasure?", metadata={"treasure": "east"})
    limit = asyncio.Semaphore(16)
    async with EngineClient(engine_url) as engine:

        async def one(i: int) -> None:
            async with limit:
                settings = EpisodeSettings(
                    run_id="bench", episode_id=f"e/{i}", max_turns=1, max_context=128,
                    sampling=SamplingParams(max_new_tokens=32, seed=i),
                )  # fmt: skip
                trajectory = await run_episode(
                    agent, task, engine=engine, chat=chat, sandbox_provider=NoSandboxes(),  # type: ignore[arg-type]
                    rewards=[], settings=settings,
                )  # fmt: skip
                assert trajectory.meta.stop_reason in ("stop", "length"), trajectory.meta

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(episodes)))
        return episodes / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--overhead-conversations", type=int, default=25)
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "omniloop-bench-gateway"
    logs.mkdir(parents=True, exist_ok=True)
    engine_proc, engine = serve(
        ["engine", "serve", "--model", "tiny", "--port", "0", "--threads", "1",
         "--prefix-cache-slots", "0"], logs / "engine.log",
    )  # fmt: skip
    gateway_proc, gateway = serve(
        ["gateway", "serve", "--engine-url", engine, "--model", "tiny", "--port", "0"],
        logs / "gateway.log",
    )
    try:
        gaps, differed = asyncio.run(overhead(engine, gateway, args.overhead_conversations))
        totals = asyncio.run(stability(gateway, args.conversations))
        rates: dict[str, list[float]] = {"sdk": [], "sdk_default_client": [], "in_process": []}
        for _ in range(ROUNDS):
            default = OpenAIAgent(solve_default_client)
            rates["sdk_default_client"].append(
                asyncio.run(episodes_per_s(engine, default, args.episodes))
            )
            rates["sdk"].append(
                asyncio.run(episodes_per_s(engine, OpenAIAgent(solve), args.episodes))
            )
            rates["in_process"].append(
                asyncio.run(episodes_per_s(engine, InProcessHunt(), args.episodes))
            )
    finally:
        for proc in (gateway_proc, engine_proc):
            proc.terminate()
            proc.wait(timeout=30)
    sdk, local = statistics.median(rates["sdk"]), statistics.median(rates["in_process"])
    default_client = statistics.median(rates["sdk_default_client"])
    print(
        json.dumps(
            {
                "bench": "gateway",
                "overhead_p50_ms": round(1000 * statistics.median(gaps), 2),
                "overhead_p90_ms": round(1000 * statistics.quantiles(gaps, n=10)[-1], 2),
                "calls_timed": len(gaps),
                "answers_differing": differed,
                "prefix_stability": round(
                    totals["stable_calls"] / max(totals["resent_calls"], 1), 4
                ),
                **totals,
                "conversations": args.conversations,
                "episodes_per_s_sdk": round(sdk, 2),
                "episodes_per_s_in_process": round(local, 2),
                "episodes_per_s_ratio": round(sdk / local, 3),
                "episodes_per_s_sdk_default_client": round(default_client, 2),
                "episodes_per_s_ratio_default_client": round(default_client / local, 3),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
