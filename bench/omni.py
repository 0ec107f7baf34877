"""Omni-modal throughput: media preprocessing, the engine with and without media, and
synchronous vs asynchronous RL on a mixed workload whose video episodes take 10x longer.

1. Preprocessing (`preprocess_items_s`, modality -> items per second): distinct items made with
   `omniloop.modalities.synth` (a 112x112 PNG, a 1-s WAV at 22.05 kHz, an 8-frame 64x48 MP4),
   decoded and turned into Qwen2.5-Omni inputs by `QwenOmniProcessor`, one thread.
2. The engine (`engine_tok_s`, `text` and `media`): `omniloop engine serve --model tiny-omni`,
   8 concurrent requests of 32 sampled tokens each, text-only prompts against prompts holding
   an image, an audio clip and a video each (same text), side by side in one invocation.
3. The mixed workload (`speedup_mixed`): the colour task the tiny omni model learns
   (`examples/omni/learn.yaml`, warm-started by `examples/omni/warm_start.py`) through the role
   services, trained twice for the same steps, `max_staleness=0` then `2`. Before its turn
   each episode waits (no CPU: a remote tool) 0.3 s, and every fourth task's episodes 3 s:
   the long tail that video episodes make in a mixed workload (the tasks are pictures; what
   is measured is how the loop absorbs the tail). `speedup_mixed` is the synchronous run's
   loop seconds over the asynchronous run's; `final_reward_sync` / `final_reward_async` are
   the mean rewards of each run's last `FINAL_STEPS` steps.

Prints ONE JSON line.

    .venv/bin/python bench/omni.py [--steps N] [--skip-runs]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OMNI = REPO / "examples" / "omni"
sys.path.insert(0, str(OMNI))

from agent import build_color_agent  # noqa: E402

from omniloop.agents.base import Session, Task  # noqa: E402
from omniloop.modalities import MediaKind, synth  # noqa: E402
from omniloop.tools.base import ToolContext  # noqa: E402

FINAL_STEPS = 5
WAIT_S, LONG_WAIT_S = 0.3, 3.0
LONG_TASKS = {
    json.loads(line)["id"]
    for i, line in enumerate((OMNI / "colors.jsonl").read_text().splitlines())
    if i % 4 == 3
}
"""Every fourth task of the file: one in each step's four."""


class LongTailAgent:
    """The colour task's agent, each episode first waiting as a remote tool would."""

    def __init__(self) -> None:
        self.inner = build_color_agent()
        self.tool_schemas: list[dict[str, Any]] = self.inner.tool_schemas

    def opening(self, task: Task) -> list[dict[str, Any]]:
        return self.inner.opening(task)

    async def run(self, task: Task, session: Session, context: ToolContext) -> None:
        await asyncio.sleep(LONG_WAIT_S if task.id in LONG_TASKS else WAIT_S)
        await self.inner.run(task, session, context)


def build_agent() -> LongTailAgent:
    return LongTailAgent()


def preprocess_rates(items: int = 24) -> dict[str, float]:
    from omniloop.modalities.qwen_omni import QwenOmniProcessor

    processor = QwenOmniProcessor()
    rng = np.random.default_rng(0)
    made = {
        MediaKind.IMAGE: [
            synth.png(rng.integers(0, 255, (112, 112, 3), np.uint8)) for _ in range(items)
        ],
        MediaKind.AUDIO: [
            synth.wav(rng.normal(0, 0.2, 22050).astype(np.float32), 22050) for _ in range(items)
        ],
        MediaKind.VIDEO: [
            synth.mp4(list(rng.integers(0, 255, (8, 48, 64, 3), np.uint8)), fps=4)
            for _ in range(items)
        ],
    }
    rates = {}
    for kind, blobs in made.items():
        started = time.perf_counter()
        for i, data in enumerate(blobs):
            processor.process(kind, data, label=f"{kind}:{i}")
        rates[str(kind)] = round(items / (time.perf_counter() - started), 1)
    return rates


async def engine_rates(requests: int = 8, tokens: int = 32) -> dict[str, float]:
    import httpx

    from omniloop.agents.chat import ChatFormat
    from omniloop.inference.models import load_tokenizer
    from omniloop.modalities.qwen_omni import QwenOmniProcessor
    from omniloop.platform.control.engines import start_engine
    from omniloop.processes import stop_process

    chat = ChatFormat(load_tokenizer("tiny-omni"))
    processor = QwenOmniProcessor()
    media = [
        (MediaKind.IMAGE, synth.solid_png(112, 112)),
        (MediaKind.AUDIO, synth.tone_wav(1.0)),
        (MediaKind.VIDEO, synth.moving_square_mp4()),
    ]
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe what you see and hear."}]
    with_media = parts + [
        {"type": str(kind), "tokens": processor.process(kind, data, label=str(kind)).tokens}
        for kind, data in media
    ]
    fields: dict[str, list[str]] = {}
    for kind, data in media:
        fields.setdefault(f"{kind}_data", []).append(
            "data:application/octet-stream;base64," + base64.b64encode(data).decode()
        )
    proc, url = start_engine("tiny-omni", threads=1)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:

            async def one(i: int, ids: list[int], extra: dict[str, Any]) -> int:
                body = {
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": tokens,
                        "ignore_eos": True,
                        "sampling_seed": i,
                    },
                    **extra,
                }
                response = await http.post("/generate", json=body)
                response.raise_for_status()
                return len(response.json()["output_ids"])

            rates = {}
            for name, content, extra in (
                ("text", parts, {}),
                ("media", with_media, fields),
                ("text_again", parts, {}),
            ):
                ids = chat.prompt_ids([{"role": "user", "content": content}])
                started = time.perf_counter()
                made = await asyncio.gather(*(one(i, ids, extra) for i in range(requests)))
                rates[name] = round(sum(made) / (time.perf_counter() - started), 1)
    finally:
        stop_process(proc)
    rates["text"] = round((rates["text"] + rates.pop("text_again")) / 2, 1)
    return rates


def train_once(run_dir: Path, model: Path, max_staleness: int, steps: int) -> dict[str, Any]:
    from omniloop.config import load_config
    from omniloop.platform.control.run import run
    from omniloop.platform.control.run_config import RunConfig

    bench = Path(__file__).resolve()
    config = load_config(
        RunConfig,
        OMNI / "learn.yaml",
        [
            f"model={model}",
            f"run_dir={run_dir}",
            f"database=sqlite:///{run_dir}/omniloop.db",
            "tensorboard=false",
            f"steps={steps}",
            f"checkpoint_every={steps}",
            f"max_staleness={max_staleness}",
            f"rollout.agent={bench}:build_agent",
        ],
    )
    asyncio.run(run(config))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "loop_s": sum(m["perf/step_seconds"] for m in metrics),
        "final_reward": sum(m["reward/mean"] for m in metrics[-FINAL_STEPS:])
        / min(FINAL_STEPS, len(metrics)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per training run")
    parser.add_argument("--skip-runs", action="store_true", help="preprocessing and engine only")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    random.seed(0)
    out: dict[str, Any] = {"bench": "omni", "preprocess_items_s": preprocess_rates()}
    out["engine_tok_s"] = asyncio.run(engine_rates())
    out["engine_media_over_text"] = round(
        out["engine_tok_s"]["media"] / out["engine_tok_s"]["text"], 3
    )
    if not args.skip_runs:
        from warm_start import warm_start

        with tempfile.TemporaryDirectory(prefix="omni-bench-") as tmp:
            model = warm_start(Path(tmp) / "model")
            sync = train_once(Path(tmp) / "sync", model, 0, args.steps)
            asynchronous = train_once(Path(tmp) / "async", model, 2, args.steps)
        out["speedup_mixed"] = round(sync["loop_s"] / asynchronous["loop_s"], 3)
        out["final_reward_sync"] = round(sync["final_reward"], 3)
        out["final_reward_async"] = round(asynchronous["final_reward"], 3)
        out["loop_s"] = {
            "sync": round(sync["loop_s"], 1),
            "async": round(asynchronous["loop_s"], 1),
        }
        out["steps"] = args.steps
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
