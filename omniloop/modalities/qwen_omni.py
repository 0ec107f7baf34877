"""The Qwen2.5-Omni family's media processor (image, audio, video) without torchvision.

Images go through transformers' `Qwen2VLImageProcessorPil` (its Pillow backend) and audio
through `WhisperFeatureExtractor` (128 mel bins, padded to 30 s as the Qwen2.5-Omni processor
does). transformers' video processors all need torchvision, which does not import beside the
pinned CPU torch, so a video's frames go through the same image processor one by one (resize,
rescale, normalize, patchify: identical per frame) and each pair of frames becomes one
temporal patch, in the layout of `Qwen2VLVideoProcessor`: patches ordered by (t, h/2, w/2,
merge row, merge column), each flattened as (channel, time, patch row, patch column).

Placeholder counts: an image or video item is `grid.prod() / merge²` tokens; an audio item is
`((L - 1) // 2 + 1 - 2) // 2 + 1` tokens for `L` valid feature frames (25 per second).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from omniloop.errors import MediaError
from omniloop.modalities.config import MediaConfig
from omniloop.modalities.decode import DecodedVideo, decode_audio, decode_image, decode_video
from omniloop.modalities.media import MediaKind
from omniloop.modalities.processing import ProcessedMedia

if TYPE_CHECKING:
    from PIL import Image


def audio_token_count(feature_frames: int) -> int:
    """Placeholder tokens of a Qwen2.5-Omni audio item with `feature_frames` valid mel frames
    (two stride-2 stages of the audio tower)."""
    after_conv = (feature_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class QwenOmniProcessor:
    """`MediaProcessor` for Qwen2.5-Omni thinkers (patch 14, merge 2, temporal patch 2)."""

    patch_size = 14
    merge_size = 2
    temporal_patch_size = 2

    def __init__(self, config: MediaConfig | None = None) -> None:
        from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

        self.config = config or MediaConfig()
        c = self.config
        common = {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
        }
        self.image_processor = Qwen2VLImageProcessorPil(
            size={"shortest_edge": c.image_min_pixels, "longest_edge": c.image_max_pixels},
            **common,  # type: ignore[arg-type]
        )
        self.frame_processor = Qwen2VLImageProcessorPil(
            size={"shortest_edge": c.video_min_pixels, "longest_edge": c.video_max_pixels},
            **common,  # type: ignore[arg-type]
        )
        self.feature_extractor = WhisperFeatureExtractor(
            feature_size=128, sampling_rate=c.audio_sample_rate, hop_length=160,
            chunk_length=30, n_fft=400,
        )  # fmt: skip

    # -- MediaProcessor -----------------------------------------------------------------------

    def process(self, kind: MediaKind, data: bytes, *, label: str) -> ProcessedMedia:
        """Decode `data` as `kind` and preprocess it; `MediaError` naming `label` if either
        fails (an aspect ratio over 200:1 included)."""
        started = time.perf_counter()
        kind = MediaKind(kind)
        try:
            if kind is MediaKind.IMAGE:
                out = self.image(decode_image(data, self.config, label=label))
            elif kind is MediaKind.AUDIO:
                out = self.audio(decode_audio(data, self.config, label=label))
            else:
                out = self.video(decode_video(data, self.config, label=label))
        except MediaError:
            raise
        except ValueError as exc:
            raise MediaError(f"{label} cannot be prepared for the model: {exc}") from None
        return ProcessedMedia(
            kind=out.kind, tokens=out.tokens, inputs=out.inputs,
            seconds=time.perf_counter() - started,
        )  # fmt: skip

    # -- one modality each ----------------------------------------------------------------

    def image(self, image: Image.Image) -> ProcessedMedia:
        """`pixel_values` (patches × 1176) and `image_grid_thw` (1 × 3) of one RGB image."""
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"]
        return ProcessedMedia(
            kind=MediaKind.IMAGE,
            tokens=int(grid.prod()) // self.merge_size**2,
            inputs={"pixel_values": out["pixel_values"], "image_grid_thw": grid},
        )

    def audio(self, samples: np.ndarray) -> ProcessedMedia:
        """`input_features` (1 × 128 × 3000) and `feature_attention_mask` (1 × 3000) of one
        mono clip at the configured rate."""
        out = self.feature_extractor(
            samples, sampling_rate=self.config.audio_sample_rate, return_attention_mask=True,
            padding="max_length", return_tensors="pt",
        )  # fmt: skip
        mask = out["attention_mask"]
        return ProcessedMedia(
            kind=MediaKind.AUDIO,
            tokens=audio_token_count(int(mask.sum())),
            inputs={"input_features": out["input_features"], "feature_attention_mask": mask},
        )

    def video(self, video: DecodedVideo) -> ProcessedMedia:
        """`pixel_values_videos`, `video_grid_thw` (1 × 3) and `video_second_per_grid` (1) of
        sampled frames (an even number of them)."""
        import torch
        from PIL import Image

        frames = [Image.fromarray(frame) for frame in video.frames]
        if len(frames) % self.temporal_patch_size:
            frames.append(frames[-1])
        out = self.frame_processor(images=frames, return_tensors="np")
        per_frame = out["pixel_values"]
        grid = out["image_grid_thw"]
        patches = int(grid[0, 1] * grid[0, 2])
        t = self.temporal_patch_size
        p = self.patch_size
        # Each frame's rows carry the frame twice along time (an image is a still clip); keep
        # one copy per frame and put consecutive frames side by side along time.
        frame_rows = per_frame.reshape(len(frames), patches, 3, t, p, p)[:, :, :, 0]
        grouped = frame_rows.reshape(len(frames) // t, t, patches, 3, p, p)
        pixel_values = np.ascontiguousarray(grouped.transpose(0, 2, 3, 1, 4, 5)).reshape(
            len(frames) // t * patches, 3 * t * p * p
        )
        grid_thw = torch.tensor([[len(frames) // t, int(grid[0, 1]), int(grid[0, 2])]])
        return ProcessedMedia(
            kind=MediaKind.VIDEO,
            tokens=int(grid_thw.prod()) // self.merge_size**2,
            inputs={
                "pixel_values_videos": torch.from_numpy(pixel_values),
                "video_grid_thw": grid_thw,
                "video_second_per_grid": torch.tensor([t / video.sample_fps]),
            },
        )
