"""Episodes per second: 32 concurrent calculator episodes on the tiny model.

Each episode is a real one: the CPU engine over HTTP samples every turn, the first turn opens
with the task's `python` call (the random tiny model cannot write one), the call runs in a
bubblewrap sandbox from the warm pool, its output goes back to the model, and the reward is
scored. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from omniloop import Task, ToolAgent
from omniloop.platform.control.engines import local_engine
from omniloop.platform.control.rollout import run_rollout, summarize
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.tools import python

ROOT = Path(__file__).resolve().parent.parent


def calculator_call(task: Task) -> str:
    call = {"name": "python", "arguments": {"code": f"print({task.metadata['expression']})"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n"


def build_agent() -> ToolAgent:
    return ToolAgent([python], system_prompt="Compute.", prefill=calculator_call)


async def main(episodes: int, concurrency: int, threads: int) -> dict[str, object]:
    async with local_engine("tiny", threads=threads) as url:
        return await measure(url, episodes, concurrency, threads)


async def measure(url: str, episodes: int, concurrency: int, threads: int) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix="omniloop-bench-")) / "trajectories.jsonl"
    config = RolloutConfig.model_validate(
        {
            "tasks": str(ROOT / "examples/calculator/tasks.jsonl"),
            "agent": f"{Path(__file__).resolve()}:build_agent",
            "rewards": [f"{ROOT / 'examples/calculator/agent.py'}:exact_answer"],
            "engine": {"url": url, "model": "tiny"},
            "sandbox": {"backend": "bwrap", "pool_size": concurrency},
            # Greedy, the random tiny model repeats the prompt's last token: the newline that
            # ends each generation prompt. Stopping on it keeps every turn short and equal.
            "sampling": {"max_new_tokens": 16, "temperature": 0.0, "stop_token_ids": [198]},
            "max_turns": 3,
            "num_tasks": episodes,
            "concurrency": concurrency,
            "output": str(out),
        }
    )
    await run_rollout(config)  # warm-up: imports, first requests
    started, cpu = time.perf_counter(), time.process_time()
    trajectories = await run_rollout(config)
    wall = time.perf_counter() - started
    summary = summarize(trajectories)
    return {
        "bench": "episodes",
        "model": "tiny",
        "sandbox": "bwrap",
        "episodes": len(trajectories),
        "concurrency": concurrency,
        "engine_threads": threads,
        "wall_s": round(wall, 3),
        "episodes_per_s": round(len(trajectories) / wall, 2),
        "cpu_s_rollout_process": round(time.process_time() - cpu, 2),
        "tool_calls": summary["tool_calls"],
        "turns_mean": summary["turns_mean"],
        "errors": summary["errors"],
        "reward_mean": summary["reward_mean"],
        "loadavg": os.getloadavg(),
        "note": "wall includes filling the warm sandbox pool (created per run)",
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.episodes, args.concurrency, args.threads))))
