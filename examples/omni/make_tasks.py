"""Write the toy omni task set: images, audio clips and videos made here, and a JSONL of tasks
that name them. Deterministic; nothing is downloaded.

Three questions, one per modality (`tasks.jsonl`):
- image: "How many red squares?" over a picture with 1 to 3 red squares and blue distractors;
- audio: "How many beeps?" over a one-second clip with 1 to 3 beeps;
- video: "Which way does the square move?" over a short clip of a square moving left or right.

And one that the tiny random model learns in minutes (`colors.jsonl`, see `learn.yaml`):
"Color?" over a picture of one color, red or blue, its shade jittered.

    python examples/omni/make_tasks.py   # writes examples/omni/media/, tasks.jsonl, colors.jsonl
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import numpy as np

from omniloop.modalities import synth

HERE = Path(__file__).resolve().parent
COUNTS = ("1", "2", "3")
DIRECTIONS = ("left", "right")
QUESTIONS = {
    "image": "How many red squares?",
    "audio": "How many beeps?",
    "video": "Which way does the square move?",
}


def squares_png(red: int, rng: random.Random, size: int = 112, side: int = 24) -> bytes:
    """`red` red squares and 1 to 2 blue ones on white, none overlapping."""
    image = np.full((size, size, 3), 255, dtype=np.uint8)
    cells = [(r, c) for r in range(size // side) for c in range(size // side)]
    chosen = rng.sample(cells, red + rng.randint(1, 2))
    for i, (r, c) in enumerate(chosen):
        color = (220, 20, 20) if i < red else (20, 40, 220)
        top, left = r * side + 2, c * side + 2
        image[top : top + side - 4, left : left + side - 4] = color
    return synth.png(image)


def beeps_wav(count: int, rng: random.Random, rate: int = 16_000) -> bytes:
    """One second of faint noise with `count` 0.1-s beeps at 880 Hz, evenly spaced."""
    samples = np.random.default_rng(rng.randrange(2**32)).normal(0, 0.01, rate)
    beep = round(0.1 * rate)
    t = np.arange(beep) / rate
    tone = 0.6 * np.sin(2 * np.pi * 880 * t)
    gap = (rate - count * beep) // (count + 1)
    for i in range(count):
        start = gap * (i + 1) + beep * i
        samples[start : start + beep] += tone
    return synth.wav(samples.astype(np.float32), rate)


def moving_mp4(direction: str, rng: random.Random) -> bytes:
    """Eight frames of a white square sliding left or right across black."""
    frames = synth.square_frames(frames=8, width=64, height=48, step=6)
    if direction == "left":
        frames = frames[::-1]
    offset = rng.randint(0, 4)
    return synth.mp4([np.roll(f, offset, axis=0) for f in frames], fps=4)


COLORS = {"red": (210, 30, 30), "blue": (30, 50, 210)}


def color_png(rgb: tuple[int, int, int], rng: random.Random, size: int = 112) -> bytes:
    """A `size`-pixel square of the color `rgb`, each channel shifted by up to 15."""
    r, g, b = (min(255, max(0, c + rng.randint(-15, 15))) for c in rgb)
    return synth.solid_png(size, size, (r, g, b))


def color_tasks(per_color: int = 8, seed: int = 1) -> list[dict[str, object]]:
    """`per_color` "Color?" tasks for red and for blue, alternating; media written to `media/`."""
    rng = random.Random(seed)
    media = HERE / "media"
    media.mkdir(exist_ok=True)
    tasks: list[dict[str, object]] = []
    for i in range(per_color):
        for color, rgb in COLORS.items():
            path = media / f"color-{color}-{i}.png"
            path.write_bytes(color_png(rgb, rng))
            content = [
                {"type": "image", "image": f"media/{path.name}"},
                {"type": "text", "text": "Color?"},
            ]
            tasks.append(
                {
                    "id": f"color-{color}-{i}",
                    "prompt": [{"role": "user", "content": content}],
                    "answer": color,
                    "metadata": {"kind": "image"},
                }
            )
    return tasks


def make_tasks(per_answer: int = 4, seed: int = 0) -> list[dict[str, object]]:
    """`per_answer` tasks for every answer of every modality; media written to `media/`."""
    rng = random.Random(seed)
    media = HERE / "media"
    media.mkdir(exist_ok=True)
    tasks: list[dict[str, object]] = []
    # Interleaved, so that every step (consecutive tasks) holds every modality.
    image = [("image", a, i) for i in range(per_answer) for a in COUNTS]
    audio = [("audio", a, i) for i in range(per_answer) for a in COUNTS]
    video = [("video", a, i) for i in range(per_answer) for a in DIRECTIONS]
    plan = [item for group in itertools.zip_longest(image, audio, video) for item in group if item]
    for kind, answer, i in plan:
        name = f"{kind}-{answer}-{i}"
        if kind == "image":
            data, suffix = squares_png(int(answer), rng), "png"
        elif kind == "audio":
            data, suffix = beeps_wav(int(answer), rng), "wav"
        else:
            data, suffix = moving_mp4(answer, rng), "mp4"
        path = media / f"{name}.{suffix}"
        path.write_bytes(data)
        content = [
            {"type": kind, kind: f"media/{path.name}"},
            {"type": "text", "text": QUESTIONS[kind]},
        ]
        tasks.append(
            {
                "id": name,
                "prompt": [{"role": "user", "content": content}],
                "answer": answer,
                "metadata": {"kind": kind},
            }
        )
    return tasks


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} tasks written to {path}")


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    write_jsonl(out / "tasks.jsonl", make_tasks())
    write_jsonl(out / "colors.jsonl", color_tasks())
