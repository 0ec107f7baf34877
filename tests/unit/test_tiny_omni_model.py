"""The `tiny-omni` alias: a random Qwen2.5-Omni thinker with SmolLM2's tokenizer plus media tokens.

Built once for the module into a private cache. Prompts are built token-id first, the way the
trainer builds them: text ids, then `[bos] + [placeholder] * n + [eos]` per media item, with n
taken from the image processor's grid and the audio feature mask.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

from omniloop.errors import ConfigError
from omniloop.inference.models import (
    MODEL_ALIASES,
    OMNI_MEDIA_TOKENS,
    _write_tiny_omni,
    load_omni_model,
    resolve_model,
)

EXPECTED_IDS = {
    "image_token": 49152,
    "audio_token": 49153,
    "video_token": 49154,
    "vision_bos_token": 49155,
    "vision_eos_token": 49156,
    "audio_bos_token": 49157,
    "audio_eos_token": 49158,
}
VOCAB = 49159  # the tokenizer's ids exactly: no row that no token stands for
SPATIAL_MERGE = 2
SAMPLE_RATE = 16_000


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`tiny-omni` built through `resolve_model` into a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNILOOP_CACHE", str(tmp_path_factory.mktemp("omniloop-cache")))
        folder = resolve_model("tiny-omni")
        # Resolving again reuses the folder instead of rebuilding it.
        assert resolve_model("tiny-omni") == folder
        yield folder


@pytest.fixture(scope="module")
def tok(omni_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(omni_dir)


@pytest.fixture(scope="module")
def model(omni_dir: Path) -> Any:
    return load_omni_model(omni_dir)


def _image_and_audio_inputs(tok: PreTrainedTokenizerBase) -> dict[str, torch.Tensor]:
    """A prompt with one 64x48 image and 1 s of 440 Hz sine, plus a short completion."""
    rows, cols = np.mgrid[0:48, 0:64]
    pixels = np.stack([rows * 5, cols * 4, (rows + cols) * 2], axis=-1).astype(np.uint8)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=SPATIAL_MERGE,
    )
    image = image_processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    n_image = int(image["image_grid_thw"].prod()) // SPATIAL_MERGE**2

    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    wave = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    audio = WhisperFeatureExtractor(feature_size=128)(
        [wave],
        sampling_rate=SAMPLE_RATE,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="pt",
    )
    frames = int(audio["attention_mask"].sum())
    # Qwen2.5-Omni's audio tower: a stride-2 conv, then a 2x average pool.
    n_audio = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    assert (n_image, n_audio) == (4, 25)

    def text(s: str) -> list[int]:
        ids: list[int] = tok(s, add_special_tokens=False)["input_ids"]
        return ids

    ids = [
        *text("<|im_start|>user\nWhat do you see and hear?"),
        tok.vision_bos_token_id,
        *[tok.image_token_id] * n_image,
        tok.vision_eos_token_id,
        tok.audio_bos_token_id,
        *[tok.audio_token_id] * n_audio,
        tok.audio_eos_token_id,
        *text("<|im_end|>\n<|im_start|>assistant\nA tone.<|im_end|>"),
    ]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": image["pixel_values"],
        "image_grid_thw": image["image_grid_thw"],
        "input_features": audio["input_features"],
        "feature_attention_mask": audio["attention_mask"],
    }


def test_tiny_omni_is_an_alias() -> None:
    assert "tiny-omni" in MODEL_ALIASES


def test_media_tokens_are_named_special_tokens(tok: PreTrainedTokenizerBase) -> None:
    assert len(tok) == 49159
    assert set(OMNI_MEDIA_TOKENS) == set(EXPECTED_IDS)
    for name, text in OMNI_MEDIA_TOKENS.items():
        assert getattr(tok, name) == text
        assert getattr(tok, f"{name}_id") == EXPECTED_IDS[name], name
        # A placeholder is one token, never split into BPE pieces.
        assert tok(text, add_special_tokens=False)["input_ids"] == [EXPECTED_IDS[name]]
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert "<tools>" in str(tok.chat_template)


def test_config_names_the_class_and_the_tokenizer_ids(omni_dir: Path) -> None:
    config = json.loads((omni_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5OmniThinkerForConditionalGeneration"]
    assert config["model_type"] == "qwen2_5_omni_thinker"
    assert config["dtype"] == "float32"
    assert config["text_config"]["vocab_size"] == VOCAB
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert config["image_token_index"] == EXPECTED_IDS["image_token"]
    assert config["audio_token_index"] == EXPECTED_IDS["audio_token"]
    assert config["video_token_index"] == EXPECTED_IDS["video_token"]
    assert config["vision_start_token_id"] == EXPECTED_IDS["vision_bos_token"]
    assert config["vision_end_token_id"] == EXPECTED_IDS["vision_eos_token"]
    assert config["audio_start_token_id"] == EXPECTED_IDS["audio_bos_token"]
    assert config["audio_end_token_id"] == EXPECTED_IDS["audio_eos_token"]


def test_model_loads_fp32_and_the_alias_resolves_to_it(omni_dir: Path, model: Any) -> None:
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"
    # The module fixture's cache is still in force, so the alias finds the same folder.
    by_alias = load_omni_model("tiny-omni")
    assert by_alias.config.to_dict() == model.config.to_dict()


def test_a_non_omni_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="qwen2_5_omni_thinker"):
        load_omni_model(tmp_path)


def test_forward_with_an_image_and_audio(tok: PreTrainedTokenizerBase, model: Any) -> None:
    inputs = _image_and_audio_inputs(tok)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_teacher_forced_forward_is_bitwise_repeatable(
    tok: PreTrainedTokenizerBase, model: Any
) -> None:
    inputs = _image_and_audio_inputs(tok)
    ids = inputs["input_ids"]
    with torch.no_grad():
        first = model(**inputs).logits
        second = model(**inputs).logits
    assert torch.equal(first, second)
    # The same holds for the per-token logprobs a trainer recomputes.
    logprobs = [
        torch.log_softmax(x[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]) for x in (first, second)
    ]
    assert torch.equal(logprobs[0], logprobs[1])
    assert torch.isfinite(logprobs[0]).all()


def test_building_again_gives_the_same_folder(omni_dir: Path, tmp_path: Path) -> None:
    # Rebuild from the saved tokenizer: reloading the GGUF tokenizer would cost seconds and the
    # weights depend only on its length and special-token ids.
    rng_before = torch.get_rng_state()
    _write_tiny_omni(tmp_path, AutoTokenizer.from_pretrained(omni_dir))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone

    first = load_file(omni_dir / "model.safetensors")
    again = load_file(tmp_path / "model.safetensors")
    assert first.keys() == again.keys()
    for key, tensor in first.items():
        assert torch.equal(tensor, again[key]), key
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (omni_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name
