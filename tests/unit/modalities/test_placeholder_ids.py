"""Placeholder-exact token ids: what `ChatFormat` assembles equals what the Hugging Face
Qwen2.5-Omni processor produces (used here only as the oracle), for prompts mixing images,
audio and video, multi-turn, with media in tool results; and the processor's tensors equal.

The oracle's video processor is an independent numpy rendering of `Qwen2VLVideoProcessor`'s
layout (transformers' own needs torchvision, which cannot be imported beside the CPU torch).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omniloop.agents.chat import ChatFormat
from omniloop.inference.models import load_tokenizer
from omniloop.modalities import MediaConfig, MediaKind, ProcessedMedia, concat_inputs, synth
from omniloop.modalities.decode import DecodedVideo, decode_audio, decode_image, decode_video
from omniloop.modalities.qwen_omni import QwenOmniProcessor

CONFIG = MediaConfig(image_max_pixels=64 * 28 * 28, video_max_pixels=16 * 28 * 28)
MARKERS = {
    MediaKind.IMAGE: "<|vision_bos|><|IMAGE|><|vision_eos|>",
    MediaKind.AUDIO: "<|audio_bos|><|AUDIO|><|audio_eos|>",
    MediaKind.VIDEO: "<|vision_bos|><|VIDEO|><|vision_eos|>",
}
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def oracle_video_patches(frames: np.ndarray, config: MediaConfig) -> tuple[np.ndarray, list[int]]:
    """`Qwen2VLVideoProcessor`'s output for uint8 frames (T, H, W, 3), written from its
    documented layout: bicubic resize, rescale, normalize, then patches (t, h/2, w/2, 2, 2)
    each flattened as (channel, time, 14, 14)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = smart_resize(
        frames.shape[1], frames.shape[2], factor=28,
        min_pixels=config.video_min_pixels, max_pixels=config.video_max_pixels,
    )  # fmt: skip
    resized = [
        np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC))
        for f in frames
    ]
    x = (np.stack(resized).astype(np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD
    x = x.transpose(0, 3, 1, 2)  # T, C, H, W
    if len(x) % 2:
        x = np.concatenate([x, x[-1:]])
    gt, gh, gw = len(x) // 2, height // 14, width // 14
    x = x.reshape(gt, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, 3 * 2 * 14 * 14), [gt, gh, gw]


class OracleVideoProcessor:
    """The video slot of the oracle processor (see `oracle_video_patches`)."""

    temporal_patch_size = 2
    merge_size = 2
    patch_size = 14

    def __call__(self, videos: list[np.ndarray], **_: Any) -> dict[str, torch.Tensor]:
        from transformers import BatchFeature

        patches, grids = zip(*(oracle_video_patches(v, CONFIG) for v in videos), strict=True)
        return BatchFeature(
            {
                "pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
                "video_grid_thw": torch.tensor(grids),
            }
        )

    def to_dict(self) -> dict[str, Any]:
        return {}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny-omni")


@pytest.fixture(scope="module")
def processor() -> QwenOmniProcessor:
    return QwenOmniProcessor(CONFIG)


@pytest.fixture(scope="module")
def oracle(tokenizer: Any) -> Any:
    import transformers.processing_utils as processing_utils
    import transformers.video_processing_utils as video_utils
    from transformers import Qwen2_5OmniProcessor, Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    # The processor checks its video slot's class by name on a module object that does not
    # export VideoProcessorMixin without torchvision (see ../shared/OMNI-CPU.md §2.3).
    if not hasattr(processing_utils.transformers_module, "VideoProcessorMixin"):
        processing_utils.transformers_module.VideoProcessorMixin = video_utils.VideoProcessorMixin
    video_slot = type("OracleVideo", (OracleVideoProcessor, video_utils.VideoProcessorMixin), {})
    image = Qwen2VLImageProcessorPil(
        size={"shortest_edge": CONFIG.image_min_pixels, "longest_edge": CONFIG.image_max_pixels}
    )
    return Qwen2_5OmniProcessor(
        image_processor=image, video_processor=video_slot(),
        feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
    )  # fmt: skip


@dataclass
class Item:
    """One media item of a test conversation: what the oracle takes and what we made of it."""

    kind: MediaKind
    raw: Any
    processed: ProcessedMedia


def make_item(processor: QwenOmniProcessor, kind: MediaKind, data: bytes) -> Item:
    if kind is MediaKind.IMAGE:
        image = decode_image(data, CONFIG)
        return Item(kind, image, processor.image(image))
    if kind is MediaKind.AUDIO:
        samples = decode_audio(data, CONFIG)
        return Item(kind, samples, processor.audio(samples))
    video = decode_video(data, CONFIG)
    return Item(kind, video.frames, processor.video(video))


def part(item: Item) -> dict[str, Any]:
    return {"type": str(item.kind), "tokens": item.processed.tokens}


def as_text(messages: list[dict[str, Any]], items: iter) -> list[dict[str, Any]]:  # type: ignore[valid-type]
    """The messages with each media part replaced by its one-placeholder marker text."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = "".join(
                p["text"] if p["type"] == "text" else MARKERS[MediaKind(p["type"])] for p in content
            )
        out.append({**message, "content": content})
    return out


def oracle_call(oracle: Any, text: str, items: list[Item]) -> Any:
    by_kind = {kind: [i.raw for i in items if i.kind is kind] for kind in MediaKind}
    return oracle(
        text=[text], images=by_kind[MediaKind.IMAGE] or None,
        audio=by_kind[MediaKind.AUDIO] or None, videos=by_kind[MediaKind.VIDEO] or None,
        return_tensors="pt",
    )  # fmt: skip


def assert_same_inputs(expected: Any, items: list[Item]) -> None:
    ours = {
        kind: concat_inputs([i.processed for i in items if i.kind is kind]) for kind in MediaKind
    }
    for kind, keys in {
        MediaKind.IMAGE: ["pixel_values", "image_grid_thw"],
        MediaKind.AUDIO: ["input_features", "feature_attention_mask"],
        MediaKind.VIDEO: ["pixel_values_videos", "video_grid_thw"],
    }.items():
        for key in keys:
            if not ours[kind]:
                assert key not in expected
                continue
            torch.testing.assert_close(
                ours[kind][key].to(expected[key].dtype), expected[key], atol=2e-6, rtol=0
            )


def test_prompt_mixing_all_three_modalities(tokenizer, processor, oracle) -> None:
    items = [
        make_item(processor, MediaKind.IMAGE, synth.solid_png(96, 64)),
        make_item(processor, MediaKind.AUDIO, synth.tone_wav(1.0)),
        make_item(processor, MediaKind.VIDEO, synth.moving_square_mp4()),
        make_item(processor, MediaKind.IMAGE, synth.solid_png(20, 300, (0, 90, 200))),
    ]
    messages = [
        {"role": "system", "content": "Look and listen."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Picture: "}, part(items[0]),
                {"type": "text", "text": " sound "}, part(items[1]), part(items[2]),
                {"type": "text", "text": "How many red shapes?"}, part(items[3]),
            ],
        },
    ]  # fmt: skip
    ids = ChatFormat(tokenizer).prompt_ids(messages)
    text = tokenizer.apply_chat_template(
        as_text(messages, iter(items)), add_generation_prompt=True, tokenize=False
    )
    expected = oracle_call(oracle, text, items)
    assert ids == expected["input_ids"][0].tolist()
    assert [i.processed.tokens for i in items] == [6, 25, 8, 11]
    assert_same_inputs(expected, items)


def test_multi_turn_with_media_in_tool_results(tokenizer, processor, oracle) -> None:
    chat = ChatFormat(tokenizer, [{"type": "function", "function": {"name": "crop"}}])
    first = make_item(processor, MediaKind.IMAGE, synth.solid_png(120, 90))
    clip = make_item(processor, MediaKind.AUDIO, synth.tone_wav(0.6))
    crop = make_item(processor, MediaKind.IMAGE, synth.solid_png(40, 40, (10, 200, 10)))
    cut = make_item(processor, MediaKind.VIDEO, synth.moving_square_mp4(frames=5))
    opening = [{"role": "user", "content": [part(first), {"type": "text", "text": "Zoom in."}]}]
    ids = chat.prompt_ids(opening)
    sampled = tokenizer.encode("Calling crop.<|im_end|>", add_special_tokens=False)
    ids += sampled
    tool_1 = [{"role": "tool", "content": [{"type": "text", "text": "cropped "}, part(crop)]}]
    ids += chat.observation_ids(tool_1, closed=True)
    ids += tokenizer.encode("And the clip?<|im_end|>", add_special_tokens=False)
    tool_2 = [{"role": "tool", "content": [part(clip), part(cut), {"type": "text", "text": "."}]}]
    ids += chat.observation_ids(tool_2, closed=True)

    conversation = [
        *opening,
        {"role": "assistant", "content": "Calling crop."},
        *tool_1,
        {"role": "assistant", "content": "And the clip?"},
        *tool_2,
    ]
    text = tokenizer.apply_chat_template(
        as_text(conversation, iter([])), tools=chat.tools, add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    items = [first, crop, clip, cut]
    expected = oracle_call(oracle, text, items)
    assert ids == expected["input_ids"][0].tolist()
    assert_same_inputs(expected, items)


def test_placeholder_text_in_a_tool_result_stays_text(tokenizer) -> None:
    chat = ChatFormat(tokenizer)
    ids = chat.observation_ids(
        [{"role": "tool", "content": "see <|IMAGE|> and <|vision_bos|> here"}], closed=True
    )
    assert not chat.media_tokens.placeholders & set(ids)
    assert "<|IMAGE|>" in tokenizer.decode(ids)


def test_still_video_equals_the_image_processor(processor) -> None:
    """A 2-frame clip of one image gives the image's own patches (OMNI-CPU.md §2.3)."""
    same = MediaConfig(video_min_pixels=CONFIG.image_min_pixels, video_max_pixels=64 * 28 * 28)
    frame = np.asarray(Image.open(io.BytesIO(synth.solid_png(96, 64, (30, 160, 90)))))
    frame = frame.copy()
    frame[10:30, 20:50] = (250, 250, 0)
    still = QwenOmniProcessor(same).video(DecodedVideo(np.stack([frame, frame]), seconds=1.0))
    image = QwenOmniProcessor(MediaConfig(image_max_pixels=64 * 28 * 28)).image(
        Image.fromarray(frame)
    )
    assert torch.equal(still.inputs["pixel_values_videos"], image.inputs["pixel_values"])
    assert still.tokens == image.tokens
    assert still.inputs["video_second_per_grid"].item() == pytest.approx(1.0)


def test_a_media_part_needs_its_token_count(tokenizer) -> None:
    from omniloop.errors import ConfigError

    chat = ChatFormat(tokenizer)
    with pytest.raises(ConfigError, match="tokens"):
        chat.prompt_ids([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ConfigError, match="not text, image"):
        chat.prompt_ids([{"role": "user", "content": [{"type": "pdf", "tokens": 3}]}])
    text_only = ChatFormat(load_tokenizer("tiny"))
    with pytest.raises(ConfigError, match="no multimodal tokens"):
        text_only.prompt_ids([{"role": "user", "content": [{"type": "audio", "tokens": 3}]}])


# Texts that BPE does not merge with the template's glue around them: content is tokenized
# apart from the glue by design (agents/chat.py), the oracle tokenizes the whole text, so a
# trailing newline before the template's own one would differ for reasons that are not media.
WORDS = st.sampled_from(["red", " blue", "How many?", " shapes", "beep", "x = 3", "é", "a\nb"])
IMAGES = st.tuples(st.integers(8, 160), st.integers(8, 160)).map(
    lambda wh: (MediaKind.IMAGE, synth.solid_png(*wh, (wh[0] % 256, 80, wh[1] % 256)))
)
AUDIO = st.floats(0.05, 4.0).map(lambda s: (MediaKind.AUDIO, synth.tone_wav(s, rate=16000)))
VIDEOS = st.tuples(st.integers(1, 6), st.sampled_from([16, 32, 48])).map(
    lambda fw: (
        MediaKind.VIDEO,
        synth.moving_square_mp4(frames=fw[0], width=fw[1] * 2, height=fw[1]),
    )
)
PARTS = st.lists(st.one_of(WORDS, IMAGES, AUDIO, VIDEOS), min_size=1, max_size=6)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(user=PARTS, tool=PARTS)
def test_ids_equal_the_oracle_for_any_sizes_counts_and_orders(
    tokenizer, processor, oracle, user, tool
) -> None:
    items: list[Item] = []

    def content(parts: list[Any]) -> list[dict[str, Any]]:
        out = []
        for p in parts:
            if isinstance(p, str):
                out.append({"type": "text", "text": p})
            else:
                items.append(make_item(processor, *p))
                out.append(part(items[-1]))
        return out

    chat = ChatFormat(tokenizer)
    opening = [{"role": "user", "content": content(user)}]
    reply = tokenizer.encode("ok<|im_end|>", add_special_tokens=False)
    observation = [{"role": "tool", "content": content(tool)}]
    ids = chat.prompt_ids(opening) + reply + chat.observation_ids(observation, closed=True)
    conversation = [*opening, {"role": "assistant", "content": "ok"}, *observation]
    text = tokenizer.apply_chat_template(
        as_text(conversation, iter([])), add_generation_prompt=True, tokenize=False
    )
    expected = oracle_call(oracle, text, items)
    assert ids == expected["input_ids"][0].tolist()
    assert_same_inputs(expected, items)
