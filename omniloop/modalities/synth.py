"""Small media made in code, for examples, tests and benchmarks (nothing is downloaded).

Each function returns encoded bytes in a common container: PNG for images, 16-bit PCM WAV for
audio, H.264 MP4 for video (PyAV's libx264).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import soundfile
from PIL import Image


def png(pixels: np.ndarray) -> bytes:
    """PNG of an RGB (H, W, 3) or RGBA (H, W, 4) uint8 array."""
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def solid_png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """PNG of one color."""
    return png(np.full((height, width, 3), color, dtype=np.uint8))


def wav(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM WAV of float samples in [-1, 1], mono (N,) or channels last (N, C)."""
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def tone_wav(seconds: float, rate: int = 22_050, hertz: float = 440.0) -> bytes:
    """WAV of a sine tone."""
    t = np.arange(round(seconds * rate)) / rate
    return wav((0.5 * np.sin(2 * np.pi * hertz * t)).astype(np.float32), rate)


def mp4(frames: Sequence[np.ndarray] | np.ndarray, fps: int = 4) -> bytes:
    """H.264 MP4 of RGB uint8 frames (each (H, W, 3), even H and W)."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # x264's threads make the bytes vary run to run
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def square_frames(
    frames: int = 8, width: int = 64, height: int = 48, step: int = 6
) -> list[np.ndarray]:
    """RGB frames of a white square moving right by `step` pixels a frame over black."""
    side = min(width, height) // 4
    out = []
    for i in range(frames):
        frame = np.zeros((height, width, 3), dtype=np.uint8)
        left = min(i * step, width - side)
        top = (height - side) // 2
        frame[top : top + side, left : left + side] = 255
        out.append(frame)
    return out


def moving_square_mp4(
    frames: int = 8, width: int = 64, height: int = 48, fps: int = 4, step: int = 6
) -> bytes:
    """MP4 of a white square moving right by `step` pixels a frame over black."""
    return mp4(square_frames(frames, width, height, step), fps=fps)
