"""The toy omni task: count red squares in a picture, beeps in a clip, and tell which way a
square moves in a video (tasks and media from `make_tasks.py`).

Each modality has a tool that returns media: `crop` cuts a region of the task's picture,
`clip` cuts a stretch of its audio or video, `spectrogram` draws its audio as a picture. A
tool's media reach the model after the tool's text, as placeholder blocks, and stay in its
input for the rest of the episode.

The reward is 1 when the final answer is the task's answer: the count, or `left` / `right`.
The colour task (`colors.jsonl`, `learn.yaml`) has the same reward and no tools.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from omniloop.agents.tool_agent import ToolAgent
from omniloop.errors import ToolError
from omniloop.modalities import MediaConfig, MediaData, synth
from omniloop.modalities.decode import decode_audio, decode_image, decode_video
from omniloop.rewards import reward
from omniloop.tools import ToolContext, ToolResult, tool

SYSTEM_PROMPT = "Answer with one word or number."
MEDIA = MediaConfig(video_max_frames=16)


def task_media(ctx: ToolContext, kind: str) -> bytes:
    """The bytes of the task's `kind` item (the file its prompt names)."""
    for message in ctx.task.get("prompt", []):
        for part in message.get("content", []) if isinstance(message, dict) else []:
            if isinstance(part, dict) and part.get("type") == kind:
                return Path(str(part[kind])).read_bytes()
    raise ToolError(f"this task has no {kind}")


@tool
def crop(left: float, top: float, right: float, bottom: float, ctx: ToolContext) -> ToolResult:
    """Cut a region of the task's picture.

    Args:
        left: Left edge, as a fraction of the width (0 to 1).
        top: Top edge, as a fraction of the height (0 to 1).
        right: Right edge, as a fraction of the width (0 to 1).
        bottom: Bottom edge, as a fraction of the height (0 to 1).
    """
    image = decode_image(task_media(ctx, "image"), MEDIA)
    width, height = image.size
    box = (int(left * width), int(top * height), int(right * width), int(bottom * height))
    if box[2] - box[0] < 2 or box[3] - box[1] < 2:
        raise ToolError(f"the region {box} is empty; give right > left and bottom > top")
    region = np.asarray(image.crop(box))
    return ToolResult(
        text=f"region {box}:", media=[MediaData(kind="image", data=synth.png(region))]
    )


@tool
def clip(start: float, end: float, ctx: ToolContext) -> ToolResult:
    """Cut a stretch of the task's audio or video.

    Args:
        start: First second of the stretch.
        end: Last second of the stretch.
    """
    if end <= start:
        raise ToolError(f"end ({end}) must come after start ({start})")
    kind = str(ctx.task.get("metadata", {}).get("kind"))
    if kind == "audio":
        samples = decode_audio(task_media(ctx, "audio"), MEDIA)
        rate = MEDIA.audio_sample_rate
        cut = samples[int(start * rate) : int(end * rate)]
        return ToolResult(
            text=f"{start:g}-{end:g} s:", media=[MediaData(kind="audio", data=synth.wav(cut, rate))]
        )
    if kind == "video":
        video = decode_video(task_media(ctx, "video"), MEDIA)
        fps = video.sample_fps
        frames = list(video.frames[int(start * fps) : max(int(end * fps), int(start * fps) + 1)])
        return ToolResult(
            text=f"{start:g}-{end:g} s:",
            media=[MediaData(kind="video", data=synth.mp4(frames, fps=max(1, round(fps))))],
        )
    raise ToolError("this task has no audio or video")


@tool
def spectrogram(ctx: ToolContext) -> ToolResult:
    """Draw the task's audio as a picture: time left to right, pitch bottom to top."""
    samples = decode_audio(task_media(ctx, "audio"), MEDIA)
    window = 256
    frames = np.lib.stride_tricks.sliding_window_view(samples, window)[::128]
    power = np.abs(np.fft.rfft(frames * np.hanning(window), axis=1)) ** 2
    db = 10 * np.log10(power + 1e-10)
    scaled = np.clip((db - db.max() + 60) / 60, 0, 1)
    picture = (255 * scaled.T[::-1]).astype(np.uint8)
    rgb = np.repeat(picture[:, :, None], 3, axis=2)
    return ToolResult(text="spectrogram:", media=[MediaData(kind="image", data=synth.png(rgb))])


def build_agent() -> ToolAgent:
    """The tool agent of the toy omni task."""
    return ToolAgent([crop, clip, spectrogram], system_prompt=SYSTEM_PROMPT)


def build_color_agent() -> ToolAgent:
    """The colour task's agent: the prompt as it is, one answer, no tools."""
    return ToolAgent()


@reward
def correct(task: dict[str, Any], response: str) -> float:
    """1 when the final answer is the task's answer (case and surrounding punctuation aside)."""
    words = response.strip().strip(".!").lower().split()
    return 1.0 if words and words[-1] == str(task["answer"]).lower() else 0.0
