"""Images, audio and video: stored once by hash, decoded within bounds, turned into a model
family's inputs and placeholder tokens.

- `media`: the `Media` reference, the content-addressed `MediaStore`, reading sources.
- `decode`: bytes to pixels, samples and frames (Pillow, soundfile + soxr, PyAV).
- `processing`: the `MediaProcessor` protocol, `ProcessedMedia`, placeholder `MediaTokens`.
- `qwen_omni`: the Qwen2.5-Omni family's processor.
- `config`: `MediaConfig`, the bounds and sampling rules.
"""

from omniloop.modalities.config import MediaConfig
from omniloop.modalities.media import (
    Media,
    MediaData,
    MediaKind,
    MediaPlacement,
    MediaStore,
    read_source,
)
from omniloop.modalities.processing import (
    MediaProcessor,
    MediaTokens,
    ProcessedMedia,
    concat_inputs,
)

__all__ = [
    "Media",
    "MediaConfig",
    "MediaData",
    "MediaKind",
    "MediaPlacement",
    "MediaProcessor",
    "MediaStore",
    "MediaTokens",
    "ProcessedMedia",
    "concat_inputs",
    "read_source",
]
