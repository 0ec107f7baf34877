"""Decoding media bytes into pixels and samples, within the bounds of `MediaConfig`.

Every failure is a `MediaError` naming the item and the bound or defect: a truncated PNG, a WAV
with no samples, an MP4 with no frames, an image of 100 megapixels, a video of two hours. Each
is refused from what its header says wherever possible, before any pixel or sample is decoded,
so a hostile file costs no memory.

Libraries: Pillow for images, soundfile (libsndfile) and soxr for audio, PyAV (FFmpeg) for
video. torchvision and torchaudio are not used: neither imports beside the pinned CPU torch.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import soundfile
import soxr
from PIL import Image, UnidentifiedImageError

from omniloop.errors import MediaError
from omniloop.modalities.config import MediaConfig

if TYPE_CHECKING:
    from av.container import InputContainer
    from av.video.stream import VideoStream


def decode_image(data: bytes, config: MediaConfig, *, label: str = "image") -> Image.Image:
    """An RGB image (transparency composited over white), first frame of an animation.

    The stored size is checked against `image_max_source_pixels` before the pixels are read.
    """
    try:
        with warnings.catch_warnings():
            # The bound below replaces Pillow's own decompression-bomb warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MediaError(
            f"{label} declares more pixels than Pillow will decode; it cannot be an image for "
            "a model (media.image_max_source_pixels bounds what is accepted)"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise MediaError(f"{label} is not an image Pillow can read: {exc}") from None
    width, height = image.size
    if width * height > config.image_max_source_pixels:
        raise MediaError(
            f"{label} is {width}x{height} ({width * height / 1e6:.1f} megapixels), above "
            f"media.image_max_source_pixels={config.image_max_source_pixels:,}; downscale it "
            "before use or raise the bound"
        )
    if width < 1 or height < 1:
        raise MediaError(f"{label} is {width}x{height}: no pixels")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"{label} is truncated or corrupt ({exc}); re-encode it") from None
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_audio(data: bytes, config: MediaConfig, *, label: str = "audio") -> np.ndarray:
    """Mono float32 samples at `config.audio_sample_rate` (channels averaged, soxr resampling).

    The duration is checked against `audio_max_seconds` from the header, before decoding.
    """
    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise MediaError(
            f"{label} is not audio libsndfile can read (WAV, FLAC, OGG): {exc}"
        ) from None
    if info.frames <= 0 or info.samplerate <= 0:
        raise MediaError(f"{label} has no samples (a {info.format} header and nothing else)")
    seconds = info.frames / info.samplerate
    if seconds > config.audio_max_seconds:
        raise MediaError(
            f"{label} lasts {seconds:.1f} s, above media.audio_max_seconds="
            f"{config.audio_max_seconds:g}; cut it into clips (a tool can return one)"
        )
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError) as exc:
        raise MediaError(f"{label} is truncated or corrupt: {exc}") from None
    if samples.shape[0] == 0:
        raise MediaError(f"{label} has no samples")
    mono = samples.mean(axis=1, dtype=np.float32)
    if rate != config.audio_sample_rate:
        mono = soxr.resample(mono, rate, config.audio_sample_rate, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)


@dataclass(frozen=True)
class DecodedVideo:
    """Frames sampled from a video, and the time they span."""

    frames: np.ndarray
    """uint8 RGB frames, shape (T, H, W, 3); T is even and within the configured bounds."""
    seconds: float
    """Duration of the video (frames in the file / their rate)."""

    @property
    def sample_fps(self) -> float:
        """Sampled frames per second of video (lower than `video_fps` for a long video)."""
        return len(self.frames) / self.seconds


def sample_count(total_frames: int, seconds: float, config: MediaConfig) -> int:
    """How many frames to sample: `video_fps` per second, within the frame bounds, even (two
    frames make one temporal patch)."""
    wanted = round(seconds * config.video_fps)
    count = min(max(wanted, config.video_min_frames), config.video_max_frames)
    if count % 2:
        count = count + 1 if count + 1 <= config.video_max_frames else count - 1
    return max(count, 2)


def decode_video(data: bytes, config: MediaConfig, *, label: str = "video") -> DecodedVideo:
    """Frames sampled evenly over the video (by frame index), as RGB uint8.

    The duration is checked against `video_max_seconds` from the container before decoding;
    only the sampled frames are kept, so memory is bounded by `video_max_frames`.
    """
    import av  # PyAV loads FFmpeg's libraries: only when a video is read.

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(f"{label} is not a video FFmpeg can read: {exc}") from None
    with container:
        if not container.streams.video:
            raise MediaError(f"{label} has no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.base_rate or 0) or None
        declared = None
        if stream.duration and stream.time_base:
            declared = float(stream.duration * stream.time_base)
        elif container.duration:
            declared = container.duration / av.time_base
        if declared is not None and declared > config.video_max_seconds:
            raise MediaError(
                f"{label} lasts {declared:.0f} s, above media.video_max_seconds="
                f"{config.video_max_seconds:g}; cut a clip from it (a tool can) or raise it"
            )
        try:
            total = sum(1 for packet in container.demux(stream) if packet.size > 0)
            if total == 0:
                raise MediaError(f"{label} has no frames")
            seconds = total / rate if rate else (declared or total / config.video_fps)
            if seconds > config.video_max_seconds:
                raise MediaError(
                    f"{label} lasts {seconds:.0f} s, above media.video_max_seconds="
                    f"{config.video_max_seconds:g}"
                )
            count = sample_count(total, seconds, config)
            wanted = np.linspace(0, total - 1, count).round().astype(int).tolist()
            container.seek(0)
            frames = _decode_frames(container, stream, wanted)
        except av.FFmpegError as exc:
            raise MediaError(f"{label} is truncated or corrupt: {exc}") from None
    if not frames:
        raise MediaError(f"{label} has no decodable frames")
    # A stream that decodes fewer frames than it has packets repeats its last frame.
    frames += [frames[-1]] * (count - len(frames))
    return DecodedVideo(frames=np.stack(frames), seconds=seconds)


def _decode_frames(
    container: InputContainer, stream: VideoStream, wanted: list[int]
) -> list[np.ndarray]:
    """The frames at indices `wanted` (sorted, repeats allowed), in order."""
    out: list[np.ndarray] = []
    position = 0
    for index, frame in enumerate(container.decode(stream)):
        if position >= len(wanted):
            break
        if index < wanted[position]:
            continue
        array = frame.to_ndarray(format="rgb24")
        while position < len(wanted) and wanted[position] <= index:
            out.append(array)
            position += 1
    return out
