"""Warm-start the tiny random model on the toy task's call *format* (supervised, seconds).

The data: every task prompt, followed by the prefilled call opening and a completion naming
each of the eight tools exactly once (`{name}"}` and the closing tag). Every prompt is paired
with every direction equally often, so the data says nothing about where the treasure is: the
warm-started model writes well-formed calls and picks a direction about uniformly, right ~1/8
of the time. Finding the right one is left to RL.

Supervised steps reuse the RL trainer: a policy-gradient step with advantage 1 on every
completion token, at ratio 1 (one optimizer step per batch), is exactly a negative
log-likelihood step on those tokens.

    python examples/toy_tool/warm_start.py runs/toy_tool/model
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from omniloop.agents.base import Task
from omniloop.agents.chat import ChatFormat
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.components import load_tasks
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent import DIRECTIONS, PREFILL, build_agent  # noqa: E402

COMPLETION = '{}"}}\n</tool_call>'


def format_examples(tasks: list[Task], tokenizer_model: str = "tiny") -> list[Trajectory]:
    """Every (task prompt, tool name) pair as a trajectory whose completion is the call."""
    tokenizer = load_tokenizer(tokenizer_model)
    agent = build_agent()
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    prefill = tokenizer.encode(PREFILL, add_special_tokens=False, split_special_tokens=True)
    examples = []
    for task in tasks:
        prompt = chat.prompt_ids(agent.opening(task))
        for name in DIRECTIONS:
            builder = TrajectoryBuilder(prompt)
            builder.add_observation(prefill)
            ids = tokenizer.encode(COMPLETION.format(name), add_special_tokens=False)
            builder.add_sampled(ids, [0.0] * len(ids), 0)
            meta = TrajectoryMeta(episode_id=f"{task.id}/{name}", stop_reason="stop")
            examples.append(builder.build(meta))
    return examples


def warm_start(
    out: Path,
    *,
    steps: int = 60,
    batch_size: int = 16,
    lr: float = 1e-2,
    seed: int = 0,
) -> Path:
    """Train the tiny model on the format for `steps` steps and save it to `out`."""
    tasks = load_tasks(str(HERE / "tasks.jsonl"))
    examples = format_examples(tasks, "tiny")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = TrainerConfig(lr=lr, micro_batch_size=batch_size, device="cpu", weight_decay=0.0)
    backend = TorchTrainerBackend("tiny", config)
    for _ in range(steps):
        batch = rng.sample(examples, batch_size)
        backend.train_step(TrainBatch.from_trajectories(batch, [1.0] * len(batch)))
    backend.save_hf(out)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/toy_tool/model")
    print(f"warm-started model written to {warm_start(target)}")
