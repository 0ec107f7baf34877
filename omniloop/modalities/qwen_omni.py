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

`split_processor_output` reads the same fields back from SGLang's `processor_output` dict (as
`processor_output` writes them, or as the Hugging Face processor returns them): the grids and
masks say where each item's rows end, and an item beyond the config's bounds is refused as
`process` would never make it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from omniloop.errors import MediaError
from omniloop.modalities.config import MediaConfig
from omniloop.modalities.decode import DecodedVideo, decode_audio, decode_image, decode_video
from omniloop.modalities.media import MediaKind
from omniloop.modalities.processing import ProcessedMedia

if TYPE_CHECKING:
    import torch
    from PIL import Image

# Fields of a `processor_output` dict per kind: (name, dtype name, dimensions).
_FIELDS: dict[MediaKind, tuple[tuple[str, str, int], ...]] = {
    MediaKind.IMAGE: (("pixel_values", "float32", 2), ("image_grid_thw", "int64", 2)),
    MediaKind.AUDIO: (("input_features", "float32", 3), ("feature_attention_mask", "int32", 2)),
    MediaKind.VIDEO: (
        ("pixel_values_videos", "float32", 2),
        ("video_grid_thw", "int64", 2),
        ("video_second_per_grid", "float32", 1),
    ),
}


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

    def split_processor_output(
        self, kind: MediaKind, fields: Mapping[str, Any], *, label: str
    ) -> list[ProcessedMedia]:
        """The items of one `processor_output` dict (module docstring); `MediaError` naming
        `label` for a missing or malformed field or an item beyond the config's bounds."""
        kind = MediaKind(kind)
        tensors = {
            name: _tensor(fields, name, dtype, dims, label) for name, dtype, dims in _FIELDS[kind]
        }
        if kind is MediaKind.AUDIO:
            return self._split_audio(tensors, label)
        return self._split_patches(kind, tensors, label)

    def _split_patches(
        self, kind: MediaKind, tensors: dict[str, torch.Tensor], label: str
    ) -> list[ProcessedMedia]:
        image = kind is MediaKind.IMAGE
        pixels, grid = (name for name, _, _ in _FIELDS[kind][:2])
        patches, grids = tensors[pixels], tensors[grid]
        width = 3 * self.temporal_patch_size * self.patch_size**2
        if grids.shape[1] != 3 or grids.shape[0] < 1:
            raise MediaError(f"{label}: {grid} must be a list of [t, h, w] rows, one per item")
        max_pixels = self.config.image_max_pixels if image else self.config.video_max_pixels
        max_t = 1 if image else (self.config.video_max_frames + 1) // self.temporal_patch_size
        for index, (t, h, w) in enumerate(grids.tolist()):
            bad = (
                min(t, h, w) < 1
                or h % self.merge_size
                or w % self.merge_size
                or t > max_t
                or h * w * self.patch_size**2 > max_pixels
            )
            if bad:
                raise MediaError(
                    f"{label}: {kind} {index}'s grid [{t}, {h}, {w}] is not one the processor "
                    f"makes (h and w even, h·w·{self.patch_size}² at most {max_pixels:,} "
                    f"pixels, t at most {max_t})"
                )
        rows = grids.prod(dim=1)
        if patches.shape[1] != width or patches.shape[0] != int(rows.sum()):
            raise MediaError(
                f"{label}: {pixels} has shape {list(patches.shape)} but the grids need "
                f"[{int(rows.sum())}, {width}]"
            )
        seconds = tensors.get("video_second_per_grid")
        if seconds is not None and (
            seconds.shape[0] != grids.shape[0] or not bool((seconds > 0).all())
        ):
            raise MediaError(
                f"{label}: video_second_per_grid needs one positive value per video "
                f"({grids.shape[0]}), got {seconds.tolist()}"
            )
        items = []
        for index, chunk in enumerate(patches.split(rows.tolist())):
            inputs = {pixels: chunk.contiguous(), grid: grids[index : index + 1].clone()}
            if seconds is not None:
                inputs["video_second_per_grid"] = seconds[index : index + 1].clone()
            tokens = int(rows[index]) // self.merge_size**2
            items.append(ProcessedMedia(kind=kind, tokens=tokens, inputs=inputs))
        return items

    def _split_audio(self, tensors: dict[str, torch.Tensor], label: str) -> list[ProcessedMedia]:
        features, mask = tensors["input_features"], tensors["feature_attention_mask"]
        mel_bins = self.feature_extractor.feature_size
        frames = self.feature_extractor.nb_max_frames
        if features.shape[1:] != (mel_bins, frames) or mask.shape != (features.shape[0], frames):
            raise MediaError(
                f"{label}: input_features has shape {list(features.shape)} and "
                f"feature_attention_mask {list(mask.shape)}; they must be [n, {mel_bins}, "
                f"{frames}] and [n, {frames}]"
            )
        frames_per_second = self.config.audio_sample_rate / self.feature_extractor.hop_length
        most = int(self.config.audio_max_seconds * frames_per_second)
        items = []
        for index in range(features.shape[0]):
            row = mask[index]
            valid = int(row.sum())
            if not bool(((row == 0) | (row == 1)).all()) or not 1 <= valid <= most:
                raise MediaError(
                    f"{label}: audio {index}'s feature_attention_mask must be 0s and 1s with "
                    f"1 to {most} ones (media.audio_max_seconds), got {valid} ones"
                )
            inputs = {
                "input_features": features[index : index + 1].clone(),
                "feature_attention_mask": mask[index : index + 1].clone(),
            }
            items.append(
                ProcessedMedia(kind=MediaKind.AUDIO, tokens=audio_token_count(valid), inputs=inputs)
            )
        return items

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


def _tensor(
    fields: Mapping[str, Any], name: str, dtype: str, dims: int, label: str
) -> torch.Tensor:
    """Field `name` of a `processor_output` dict as a `dims`-dimensional tensor of `dtype`."""
    import torch

    if name not in fields:
        raise MediaError(f"{label}: the processor_output dict has no {name!r} field")
    value = fields[name]
    try:
        tensor = torch.as_tensor(value, dtype=getattr(torch, dtype))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise MediaError(f"{label}: {name} is not a rectangular array of numbers ({exc})") from None
    if tensor.dim() != dims:
        raise MediaError(f"{label}: {name} has {tensor.dim()} dimensions, expected {dims}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MediaError(f"{label}: {name} holds values that are not finite")
    if not tensor.is_floating_point() and isinstance(value, list):
        # as_tensor truncates 1.5 to 1; an integer field must hold integers.
        exact = torch.as_tensor(value, dtype=torch.float64)
        if not bool((exact == tensor.to(torch.float64)).all()):
            raise MediaError(f"{label}: {name} must hold integers")
    return tensor
