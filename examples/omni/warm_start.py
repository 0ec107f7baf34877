"""Warm-start the tiny random omni model for the colour task (supervised, seconds).

Two kinds of rows, each a "Color?" prompt (a picture as a placeholder block, then the question)
followed by a colour word and the end of the turn:
- the task's own pictures (`colors.jsonl`, red or blue), each paired with each of eight colour
  words equally often: the answer *format*, and nothing about which word fits which picture;
- pictures of the six other colours, made here, each with its own word: reading a colour from
  a picture in general, never red or blue.
The warm-started model answers a red or blue picture with one of the eight words about
uniformly, right about one time in eight. Telling red from blue is left to RL.

Supervised steps reuse the RL trainer (`omniloop.trainer.warm_start`). The rows carry their
pictures' forward inputs, so the vision tower is in the graph as it is in RL.

    python examples/omni/warm_start.py runs/omni/model
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

from omniloop.agents.base import Task
from omniloop.agents.chat import ChatFormat
from omniloop.agents.media import EpisodeMedia, media_resolver
from omniloop.inference.models import load_tokenizer, resolve_model
from omniloop.modalities import MediaConfig
from omniloop.platform.control.components import load_tasks
from omniloop.trainer.batch import TrainRow
from omniloop.trainer.warm_start import completion_row, supervised_warm_start

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent import build_color_agent  # noqa: E402
from make_tasks import color_png  # noqa: E402

OTHER_COLORS = {
    "green": (30, 190, 40),
    "yellow": (225, 210, 30),
    "purple": (130, 40, 170),
    "orange": (240, 130, 20),
    "white": (235, 235, 235),
    "black": (20, 20, 20),
}
"""Colours taught with their words; never the task's."""
WORDS = ("red", "blue", *OTHER_COLORS)
"""The answers the warm start teaches, six of them never right: chance is 1/8."""


def warm_start_rows(
    tasks_file: Path = HERE / "colors.jsonl", model: str = "tiny-omni", per_color: int = 8
) -> list[TrainRow]:
    """The rows of the module docstring: the prompt as the run renders it, then the word and
    the end of the turn; `per_color` pictures of each other colour, seeded."""
    tokenizer = load_tokenizer(model)
    agent = build_color_agent()
    chat = ChatFormat(tokenizer, agent.tool_schemas)
    store = Path(tempfile.mkdtemp(prefix="omniloop-warm-start-"))
    resolver = media_resolver(resolve_model(model), tokenizer, MediaConfig(), store)
    rng = random.Random(0)
    tasks = [(task, WORDS) for task in load_tasks(str(tasks_file))]
    for word, rgb in OTHER_COLORS.items():
        for i in range(per_color):
            picture = {"type": "image", "image": color_png(rgb, rng)}
            prompt = [{"role": "user", "content": [picture, {"type": "text", "text": "Color?"}]}]
            tasks.append((Task(id=f"{word}-{i}", prompt=prompt, answer=word), (word,)))
    rows = []
    for task, words in tasks:
        media = EpisodeMedia(resolver)
        prompt = chat.prompt_ids(media.prepare(agent.opening(task), strict=True))
        media.place(prompt, 0)
        inputs = resolver.model_inputs([p.model_dump() for p in media.placements])
        for word in words:
            completion = [*tokenizer.encode(word, add_special_tokens=False), chat.stop_token_ids[0]]
            row_id = f"{task.id}/{word}"
            rows.append(completion_row(row_id, prompt, completion, media_inputs=inputs))
    return rows


def warm_start(
    out: Path, *, steps: int = 40, batch_size: int = 16, lr: float = 1e-2, seed: int = 0
) -> Path:
    """Train `tiny-omni` on the rows for `steps` steps and save it to `out`."""
    return supervised_warm_start(
        "tiny-omni", warm_start_rows(), out, steps=steps, batch_size=batch_size, lr=lr, seed=seed
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/omni/model")
    print(f"warm-started model written to {warm_start(target)}")
