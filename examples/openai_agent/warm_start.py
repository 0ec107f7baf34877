"""Warm-start the tiny random model on the treasure hunt's call format (supervised, seconds).

Each task prompt, rendered as the gateway renders the agent's one message, is followed by a
tool call naming each of the eight directions once (`<tool_call>{"name": ...}</tool_call>`,
then the end of the turn). Every prompt is paired with every direction equally often, so the
warm-started model writes well-formed calls and picks a direction about uniformly: right one
time in eight. Which direction pays is left to RL. Unlike `examples/toy_tool`, nothing is
prefilled (an OpenAI client cannot prefill), so the call's opening is learned too.

    python examples/openai_agent/warm_start.py runs/openai_agent/model
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from omniloop.agents.chat import ChatFormat
from omniloop.gateway.openai_wire import hermes_call
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.components import load_tasks
from omniloop.trainer.batch import TrainRow
from omniloop.trainer.warm_start import completion_row, supervised_warm_start

HERE = Path(__file__).resolve().parent
TASKS = HERE.parent / "toy_tool" / "tasks.jsonl"
sys.path.insert(0, str(HERE))

from agent import DIRECTIONS  # noqa: E402


def call_rows(model: str = "tiny") -> list[TrainRow]:
    """Every (task prompt, direction) pair: the prompt, then the call and the end of the turn."""
    tokenizer = load_tokenizer(model)
    chat = ChatFormat(tokenizer)
    rows = []
    for task in load_tasks(str(TASKS)):
        prompt = chat.prompt_ids([{"role": "user", "content": task.prompt}])
        for name in DIRECTIONS:
            call = tokenizer.encode(hermes_call(name, {}), add_special_tokens=False)
            completion = [*call, chat.stop_token_ids[0]]
            rows.append(completion_row(f"{task.id}/{name}", prompt, completion))
    return rows


def warm_start(
    out: Path, *, steps: int = 80, batch_size: int = 16, lr: float = 1e-2, seed: int = 0
) -> Path:
    """Train the tiny model on the call format for `steps` steps and save it to `out`."""
    return supervised_warm_start(
        "tiny", call_rows(), out, steps=steps, batch_size=batch_size, lr=lr, seed=seed
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/openai_agent/model")
    print(f"warm-started model written to {warm_start(target)}")
