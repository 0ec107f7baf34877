"""Warm-start the tiny random model on the toy task's call *format* (supervised, seconds).

The data: every task prompt, followed by the prefilled call opening and a completion naming
each of the eight tools exactly once (`{name}"}` and the closing tag). Every prompt is paired
with every direction equally often, so the data says nothing about where the treasure is: the
warm-started model writes well-formed calls and picks a direction about uniformly, right ~1/8
of the time. Finding the right one is left to RL.

Supervised steps reuse the RL trainer (`omniloop.trainer.warm_start`).

    python examples/toy_tool/warm_start.py runs/toy_tool/model
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from omniloop.agents.base import Task
from omniloop.agents.chat import ChatFormat
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.components import load_tasks
from omniloop.trainer.batch import TrainRow
from omniloop.trainer.warm_start import completion_row, supervised_warm_start

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent import DIRECTIONS, PREFILL, build_agent  # noqa: E402

COMPLETION = '{}"}}\n</tool_call>'


def format_examples(tasks: list[Task], tokenizer_model: str = "tiny") -> list[TrainRow]:
    """Every (task prompt, tool name) pair as a row whose completion is the call."""
    tokenizer = load_tokenizer(tokenizer_model)
    agent = build_agent()
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    prefill = tokenizer.encode(PREFILL, add_special_tokens=False, split_special_tokens=True)
    return [
        completion_row(
            f"{task.id}/{name}",
            chat.prompt_ids(agent.opening(task)),
            tokenizer.encode(COMPLETION.format(name), add_special_tokens=False),
            prefix=prefill,
        )
        for task in tasks
        for name in DIRECTIONS
    ]


def warm_start(
    out: Path,
    *,
    steps: int = 60,
    batch_size: int = 16,
    lr: float = 1e-2,
    seed: int = 0,
) -> Path:
    """Train the tiny model on the format for `steps` steps and save it to `out`."""
    rows = format_examples(load_tasks(str(HERE / "tasks.jsonl")), "tiny")
    return supervised_warm_start(
        "tiny", rows, out, steps=steps, batch_size=batch_size, lr=lr, seed=seed
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/toy_tool/model")
    print(f"warm-started model written to {warm_start(target)}")
