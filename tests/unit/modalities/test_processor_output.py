"""SGLang's `processor_output` media form: what `processor_output` writes, the Qwen-Omni
processor's `split_processor_output` reads back exactly (through JSON, several items of a
kind at once), and a dict that the processor would never make is a `MediaError` naming it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from omniloop.errors import MediaError
from omniloop.modalities import MediaConfig, MediaKind, ProcessedMedia, synth
from omniloop.modalities.processing import processor_output
from omniloop.modalities.qwen_omni import QwenOmniProcessor

PROCESSOR = QwenOmniProcessor()
ITEMS = {
    MediaKind.IMAGE: [synth.solid_png(64, 48), synth.solid_png(120, 90, (0, 0, 255))],
    MediaKind.AUDIO: [synth.tone_wav(1.0), synth.tone_wav(2.5)],
    MediaKind.VIDEO: [
        synth.moving_square_mp4(),
        synth.moving_square_mp4(frames=12, width=96, height=64),
    ],
}


def processed(kind: MediaKind) -> list[ProcessedMedia]:
    return [
        PROCESSOR.process(kind, data, label=f"{kind} {i}") for i, data in enumerate(ITEMS[kind])
    ]


def over_json(kind: MediaKind) -> dict[str, Any]:
    """The dict as an engine receives it: written, sent as JSON, parsed."""
    loaded: dict[str, Any] = json.loads(json.dumps(processor_output(processed(kind))))
    return loaded


@pytest.mark.parametrize("kind", list(MediaKind))
def test_a_dict_through_json_gives_back_every_item_bit_for_bit(kind: MediaKind) -> None:
    sent = processed(kind)
    received = PROCESSOR.split_processor_output(kind, over_json(kind), label=f"{kind}_data")
    assert [item.tokens for item in received] == [item.tokens for item in sent]
    for got, want in zip(received, sent, strict=True):
        assert got.kind is kind
        assert got.inputs.keys() == want.inputs.keys()
        for key, tensor in want.inputs.items():
            assert got.inputs[key].dtype == tensor.dtype, key
            assert torch.equal(got.inputs[key], tensor), key


def test_tensors_are_taken_as_they_are() -> None:
    """The offline form (tensors, as a Hugging Face processor returns them) reads the same."""
    sent = processed(MediaKind.IMAGE)
    fields = {
        "pixel_values": torch.cat([s.inputs["pixel_values"] for s in sent]),
        "image_grid_thw": torch.cat([s.inputs["image_grid_thw"] for s in sent]),
    }
    received = PROCESSOR.split_processor_output(MediaKind.IMAGE, fields, label="image_data")
    assert [r.tokens for r in received] == [s.tokens for s in sent]


def broken(kind: MediaKind, **changes: Any) -> dict[str, Any]:
    fields = over_json(kind)
    for key, value in changes.items():
        if value is None:
            del fields[key]
        else:
            fields[key] = value
    return fields


def refused(
    kind: MediaKind, fields: dict[str, Any], processor: QwenOmniProcessor = PROCESSOR
) -> str:
    with pytest.raises(MediaError) as caught:
        processor.split_processor_output(kind, fields, label=f"{kind}_data")
    message = str(caught.value)
    assert message.startswith(f"{kind}_data: "), message
    return message


def test_a_missing_or_malformed_field_is_refused_naming_it() -> None:
    image = MediaKind.IMAGE
    assert "no 'image_grid_thw' field" in refused(image, broken(image, image_grid_thw=None))
    ragged = broken(image, image_grid_thw=[[1, 4, 4], [1, 6]])
    assert "image_grid_thw is not a rectangular array" in refused(image, ragged)
    assert "has 1 dimensions, expected 2" in refused(image, broken(image, image_grid_thw=[1, 4, 4]))
    halves = broken(image, image_grid_thw=[[1, 4, 4], [1.5, 6, 8]])
    assert "image_grid_thw must hold integers" in refused(image, halves)
    pixels = over_json(image)["pixel_values"]
    pixels[3][7] = float("nan")
    assert "pixel_values holds values that are not finite" in refused(
        image, broken(image, pixel_values=pixels)
    )


def test_grids_the_processor_would_never_make_are_refused() -> None:
    image, video = MediaKind.IMAGE, MediaKind.VIDEO
    fields = over_json(image)
    (_, h0, w0), (_, h1, w1) = fields["image_grid_thw"]
    odd = broken(image, image_grid_thw=[[1, h0, w0], [1, h1 + 1, w1]])
    assert f"image 1's grid [1, {h1 + 1}, {w1}] is not one the processor makes" in refused(
        image, odd
    )
    assert "t at most 1" in refused(image, broken(image, image_grid_thw=[[2, h0, w0], [1, h1, w1]]))
    # Rows that do not add up to the grids.
    short = broken(image, pixel_values=fields["pixel_values"][:-1])
    assert f"but the grids need [{h0 * w0 + h1 * w1}, 1176]" in refused(image, short)
    # Bigger than the config lets an image be: the processor would have downscaled it.
    small = QwenOmniProcessor(MediaConfig(image_min_pixels=28 * 28, image_max_pixels=4 * 28 * 28))
    assert "at most 3,136 pixels" in refused(image, fields, small)
    seconds = broken(video, video_second_per_grid=[1.0])
    assert "one positive value per video (2)" in refused(video, seconds)


def test_audio_masks_must_be_ones_and_zeros_within_the_longest_clip() -> None:
    audio = MediaKind.AUDIO
    fields = over_json(audio)
    mask = fields["feature_attention_mask"]
    mask[0] = [2, *mask[0][1:]]
    assert "audio 0's feature_attention_mask must be 0s and 1s" in refused(audio, fields)
    silent = over_json(audio)
    silent["feature_attention_mask"][1] = [0] * 3000
    assert "got 0 ones" in refused(audio, silent)
    shorter = QwenOmniProcessor(MediaConfig(audio_max_seconds=2.0))
    assert "with 1 to 200 ones" in refused(audio, over_json(audio), shorter)
    cut = over_json(audio)
    cut["input_features"] = [row[:64] for row in cut["input_features"]]
    assert "must be [n, 128, 3000] and [n, 3000]" in refused(audio, cut)


def test_one_dict_holds_items_of_one_kind() -> None:
    with pytest.raises(ValueError, match="items of one kind"):
        processor_output([*processed(MediaKind.IMAGE), *processed(MediaKind.AUDIO)])
