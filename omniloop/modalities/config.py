"""How media are read and sampled before they reach a model: bounds and sampling rules.

The defaults suit the tiny CPU models of the tests and examples; a real Qwen-Omni run raises
the pixel bounds (the Qwen2.5-Omni processor's own defaults are 3,136 to 1,003,520 pixels per
image and 100,352 to 602,112 per video frame).
"""

from __future__ import annotations

from pydantic import model_validator

from omniloop.config import StrictModel


class MediaConfig(StrictModel):
    """Bounds on what a media item may be, and how video frames and audio are sampled."""

    max_bytes: int = 64 * 1024 * 1024
    """Largest encoded item accepted (bytes); a larger one is refused before it is decoded."""

    image_min_pixels: int = 4 * 28 * 28
    """An image smaller than this (width × height) is upscaled to at least this many pixels."""

    image_max_pixels: int = 256 * 28 * 28
    """An image larger than this is downscaled (aspect kept) to at most this many pixels; the
    model sees (pixels / 28²) placeholder tokens per image."""

    image_max_source_pixels: int = 40_000_000
    """Largest decoded size accepted (width × height of the file as stored): a bigger image is
    refused before its pixels are read, so a decompression bomb costs nothing."""

    video_fps: float = 2.0
    """Frames sampled per second of video."""

    video_min_frames: int = 2
    """Fewest frames sampled from a video (a short clip repeats frames to reach it)."""

    video_max_frames: int = 64
    """Most frames sampled from a video: a longer video is sampled evenly at a lower rate."""

    video_min_pixels: int = 4 * 28 * 28
    """Smallest frame size after resizing (width × height)."""

    video_max_pixels: int = 64 * 28 * 28
    """Largest frame size after resizing (width × height)."""

    video_max_seconds: float = 600.0
    """Longest video accepted; a longer one is refused from its header, before decoding."""

    audio_sample_rate: int = 16_000
    """Rate audio is resampled to (the feature extractor's rate)."""

    audio_max_seconds: float = 30.0
    """Longest audio clip accepted; Whisper-style feature extractors see at most 30 s."""

    @model_validator(mode="after")
    def _bounds_ordered(self) -> MediaConfig:
        pairs = [
            ("image_min_pixels", "image_max_pixels"),
            ("video_min_pixels", "video_max_pixels"),
            ("video_min_frames", "video_max_frames"),
        ]
        for low, high in pairs:
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"media.{low}={getattr(self, low)} is above media.{high}="
                    f"{getattr(self, high)}; lower the first or raise the second"
                )
        for name in ("max_bytes", "video_min_frames", "audio_sample_rate"):
            if getattr(self, name) < 1:
                raise ValueError(f"media.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("video_fps", "video_max_seconds", "audio_max_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"media.{name} must be positive, got {getattr(self, name)}")
        return self
