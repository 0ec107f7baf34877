"""What a model family makes of a media item: its input tensors and its placeholder tokens.

A `MediaProcessor` turns one decoded item into `ProcessedMedia`: the tensors the model's
forward takes for it (pixel patches and grid, audio features and mask, ...) and how many
placeholder tokens stand for it in the token stream. Token ids are then *assembled*, never
re-tokenized: `MediaTokens.block` gives the ids of one item's placeholder block
(`<|vision_bos|>` + `<|IMAGE|>` × n + `<|vision_eos|>` for Qwen-Omni), which the chat format puts
between text segments encoded once.

The same tensors may also travel to an engine already processed, as SGLang's
`processor_output` items: one dict per kind and prompt, `format: "processor_output"` beside
the Hugging Face processor's fields with every item of that kind concatenated along dim 0
(`processor_output` builds it; a family's `MediaProcessor.split_processor_output` takes it
apart again, checking it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from omniloop.errors import ConfigError
from omniloop.modalities.media import Media, MediaKind

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ProcessedMedia:
    """One item as a model takes it."""

    kind: MediaKind
    tokens: int
    """Placeholder tokens that stand for the item (inside its begin/end markers)."""
    inputs: dict[str, torch.Tensor]
    """Forward inputs for this item alone, batched along dim 0 by `concat_inputs`."""
    media: Media | None = None
    """The stored item this came from, when it came from a store."""
    seconds: float = 0.0
    """Preprocessing time (decode and features), for the per-modality metrics."""


class MediaProcessor(Protocol):
    """Turns encoded media into a model family's inputs (one implementation per family)."""

    def process(self, kind: MediaKind, data: bytes, *, label: str) -> ProcessedMedia:
        """Decode and preprocess one item; `MediaError` (naming `label`) if it cannot be."""
        ...

    def split_processor_output(
        self, kind: MediaKind, fields: Mapping[str, Any], *, label: str
    ) -> list[ProcessedMedia]:
        """The items of one `processor_output` dict of `kind` (its fields as JSON values or
        tensors), in order; `MediaError` naming `label` for a field that is missing, of the
        wrong shape or type, or beyond the bounds `process` keeps to."""
        ...


@dataclass(frozen=True)
class MediaTokens:
    """The special token ids that mark media in a tokenizer's vocabulary."""

    image: int
    audio: int
    video: int
    vision_bos: int
    vision_eos: int
    audio_bos: int
    audio_eos: int
    placeholders: frozenset[int] = field(init=False)
    """Every id above: a sampled one is neutralised, since no media stands behind it."""

    def __post_init__(self) -> None:
        ids = (self.image, self.audio, self.video, self.vision_bos, self.vision_eos)
        object.__setattr__(self, "placeholders", frozenset((*ids, self.audio_bos, self.audio_eos)))

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> MediaTokens:
        """Read the ids of a tokenizer with named multimodal tokens (Qwen-Omni style:
        `tokenizer.image_token_id`, ..., `tokenizer.audio_eos_token_id`)."""
        names = ["image", "audio", "video", "vision_bos", "vision_eos", "audio_bos", "audio_eos"]
        ids: dict[str, Any] = {name: getattr(tokenizer, f"{name}_token_id", None) for name in names}
        missing = [name for name, value in ids.items() if not isinstance(value, int)]
        if missing:
            raise ConfigError(
                f"tokenizer {tokenizer.name_or_path!r} has no multimodal tokens "
                f"({', '.join(f'{m}_token' for m in missing)}); use a model that takes media "
                "(e.g. model: tiny-omni)"
            )
        return cls(**ids)

    def block(self, kind: MediaKind, count: int) -> list[int]:
        """The ids of one item's placeholder block: begin marker, `count` pads, end marker."""
        if count < 1:
            raise ValueError(f"a {kind} block needs at least one placeholder token, got {count}")
        if kind is MediaKind.AUDIO:
            return [self.audio_bos, *([self.audio] * count), self.audio_eos]
        pad = self.image if kind is MediaKind.IMAGE else self.video
        return [self.vision_bos, *([pad] * count), self.vision_eos]


def concat_inputs(items: list[ProcessedMedia]) -> dict[str, torch.Tensor]:
    """The forward inputs of several items of one sequence, in order: every tensor is
    concatenated along dim 0 (patch lists, grids, per-clip features and masks)."""
    import torch

    keyed: dict[str, list[torch.Tensor]] = {}
    for item in items:
        for key, tensor in item.inputs.items():
            keyed.setdefault(key, []).append(tensor)
    return {key: torch.cat(tensors, dim=0) for key, tensors in keyed.items()}


PROCESSOR_OUTPUT = "processor_output"
"""SGLang's `format` of a media dict that holds processor fields instead of a file."""


def processor_output(items: Sequence[ProcessedMedia]) -> dict[str, Any]:
    """SGLang's `processor_output` dict of `items` (all of one kind, in order), JSON-ready:
    each field concatenated along dim 0 and written as nested lists (float32 values survive
    JSON exactly)."""
    kinds = {item.kind for item in items}
    if len(kinds) != 1:
        raise ValueError(f"a processor_output dict holds items of one kind, got {kinds or 'none'}")
    fields = {key: tensor.tolist() for key, tensor in concat_inputs(list(items)).items()}
    return {"format": PROCESSOR_OUTPUT, **fields}
