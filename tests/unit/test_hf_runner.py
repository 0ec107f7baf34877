"""The engine's generic transformers runner, its media checks and wire shapes, in process.

The generic runner (`hf_runner.HFRunner`) must compute what the fast Llama forward computes
for the same Llama weights (prefill, batched decode with sequences of different lengths, slots
moved as sequences finish); placeholder blocks are matched to media items with messages that
name the item; SGLang's media fields are read in its shapes; an update in place keeps the
generic runner's sequences running across it.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omniloop.errors import ConfigError, MediaError
from omniloop.inference.core import EngineCore, GenerationRequest
from omniloop.inference.hf_runner import HFRunner
from omniloop.inference.media_input import check_placeholders, source_bytes
from omniloop.inference.models import load_omni_model, load_tokenizer, resolve_model
from omniloop.inference.protocol import GenerateReqInput
from omniloop.inference.runner import LlamaRunner
from omniloop.modalities import MediaKind, MediaTokens, ProcessedMedia, synth
from omniloop.modalities.config import MediaConfig
from omniloop.modalities.qwen_omni import QwenOmniProcessor

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 100, 200], [1, 4093, 314, 260, 3575, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def runners() -> tuple[HFRunner, LlamaRunner]:
    folder = resolve_model("tiny")
    generic = HFRunner(folder, max_context=128)
    fast = LlamaRunner(folder, max_batch=4, max_context=128, prefix_cache_slots=0)
    return generic, fast


@torch.inference_mode()
def test_the_generic_runner_computes_what_the_fast_llama_forward_does(
    runners: tuple[HFRunner, LlamaRunner],
) -> None:
    generic, fast = runners
    assert generic.info.vocab_size == fast.info.vocab_size
    assert generic.info.eos_token_ids == fast.info.eos_token_ids
    assert not generic.info.prefix_cache
    assert generic.info.media_kinds == ()
    slots = [0, 1, 2]
    args = {"offsets": [0, 0, 0], "media": [(), (), ()]}
    a = generic.prefill(slots, PROMPTS, **args)
    b = fast.prefill(slots, PROMPTS, **args)
    assert (a - b).abs().max() < 1e-4
    tokens = a.argmax(-1)
    positions = torch.tensor([len(p) for p in PROMPTS])
    for step in range(8):
        if step == 4:
            # The first sequence finishes: the last one moves into its slot (as the
            # scheduler keeps the batch packed).
            for runner in runners:
                runner.move(2, 0, int(positions[2]))
            tokens, positions = tokens[[2, 1]], positions[[2, 1]]
        x = generic.decode(tokens, positions)
        y = fast.decode(tokens, positions)
        assert (x - y).abs().max() < 1e-4
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        tokens, positions = x.argmax(-1), positions + 1


def test_weights_are_the_models_parameter_names_and_are_checked(
    runners: tuple[HFRunner, LlamaRunner],
) -> None:
    generic, fast = runners
    weights = generic.weights
    # The same names as the fast path (tiny ties lm_head to the embedding: listed once).
    assert sorted(weights.names()) == sorted(fast.weights.names())
    embed = weights.target("model.embed_tokens.weight")
    assert weights.target("lm_head.weight").data_ptr() == embed.data_ptr()
    with pytest.raises(ConfigError, match=r"unknown weight 'model\.nope\.weight'"):
        weights.check([("model.nope.weight", embed)], full=False)
    with pytest.raises(ConfigError, match="has shape"):
        weights.check([("model.embed_tokens.weight", torch.zeros(2, 2))], full=False)
    with pytest.raises(ConfigError, match="checkpoint lacks"):
        weights.check([("model.embed_tokens.weight", embed)], full=True)
    weights.check(list(weights.state_dict().items()), full=True)


# -- placeholder blocks -----------------------------------------------------------------------

TOKENS = MediaTokens(
    image=100, audio=101, video=102, vision_bos=103, vision_eos=104, audio_bos=105, audio_eos=106
)


def item(kind: MediaKind, tokens: int) -> ProcessedMedia:
    return ProcessedMedia(kind=kind, tokens=tokens, inputs={})


def test_blocks_must_match_the_items_in_number_kind_and_length() -> None:
    ids = [1, *TOKENS.block(MediaKind.IMAGE, 3), 7, *TOKENS.block(MediaKind.AUDIO, 2), 8]
    ids += TOKENS.block(MediaKind.IMAGE, 4)
    check_placeholders(
        ids, [item(MediaKind.IMAGE, 3), item(MediaKind.AUDIO, 2), item(MediaKind.IMAGE, 4)], TOKENS
    )
    # Items of other kinds may come in any order; within a kind, the order of the blocks.
    check_placeholders(
        ids, [item(MediaKind.AUDIO, 2), item(MediaKind.IMAGE, 3), item(MediaKind.IMAGE, 4)], TOKENS
    )
    with pytest.raises(ValueError) as err:
        check_placeholders(
            ids,
            [item(MediaKind.IMAGE, 3), item(MediaKind.IMAGE, 6), item(MediaKind.AUDIO, 2)],
            TOKENS,
        )
    assert str(err.value) == (
        "image 1: its placeholder block has 4 tokens but the processor makes 6 of it "
        "(engine and client media configs differ?)"
    )
    with pytest.raises(ValueError, match=r"hold 2 image placeholder block\(s\) but image_data "):
        check_placeholders(ids, [item(MediaKind.IMAGE, 3), item(MediaKind.AUDIO, 2)], TOKENS)
    with pytest.raises(ValueError, match="not one block between its begin"):
        check_placeholders([1, 100, 100, 104], [item(MediaKind.IMAGE, 2)], TOKENS)
    with pytest.raises(ValueError, match="not one block between its begin"):
        check_placeholders([105, 100, 106], [item(MediaKind.IMAGE, 1)], TOKENS)
    with pytest.raises(ValueError, match="opens or closes no placeholder block"):
        check_placeholders([1, 103, 2], [], TOKENS)
    check_placeholders([1, 2, 3], [], TOKENS)


def test_an_item_is_a_data_uri_bare_base64_or_a_file(tmp_path: Path) -> None:
    data = synth.solid_png(4, 4)
    encoded = base64.b64encode(data).decode()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    for source in (f"data:image/png;base64,{encoded}", encoded, str(path), f"file://{path}"):
        assert source_bytes(source, 1 << 20, "image 0") == data
    with pytest.raises(MediaError, match=r"^image 0: media source .* is a URL"):
        source_bytes("http://example.com/a.png", 1 << 20, "image 0")
    with pytest.raises(MediaError, match=r"^image 2: cannot read media file"):
        source_bytes(str(tmp_path / "missing.png"), 1 << 20, "image 2")
    with pytest.raises(MediaError, match=r"^audio 0 is 60 bytes, above media.max_bytes=10"):
        source_bytes(base64.b64encode(b"x" * 60).decode(), 10, "audio 0")


# -- SGLang's media fields ----------------------------------------------------------------------


def test_media_fields_take_sglangs_shapes() -> None:
    def media(**fields: object) -> list[list[tuple[MediaKind, str]]]:
        body = GenerateReqInput.model_validate(fields)
        return [body.item_media(i) for i in range(len(body.batch_input_ids()))]

    image, audio = MediaKind.IMAGE, MediaKind.AUDIO
    assert media(input_ids=[1], image_data="a") == [[(image, "a")]]
    assert media(input_ids=[1], image_data=["a", "b"], audio_data="c") == [
        [(image, "a"), (image, "b"), (audio, "c")]
    ]
    batch = [[1], [2], [3]]
    # One item for every prompt; an entry per prompt (an item, a list, or none).
    assert media(input_ids=batch, image_data="a") == [[(image, "a")]] * 3
    assert media(input_ids=batch, image_data=["a", ["b", "c"], None], audio_data=[]) == [
        [(image, "a")],
        [(image, "b"), (image, "c")],
        [],
    ]
    assert media(input_ids=[1], modalities=["image"], use_audio_in_video=False) == [[]]
    with pytest.raises(ValueError, match="image_data has 2 entries for a batch of 3"):
        media(input_ids=batch, image_data=["a", "b"])
    with pytest.raises(ValueError, match="video_data of a single prompt is an item or a list"):
        media(input_ids=[1], video_data=[["a"]])
    with pytest.raises(ValueError, match="use_audio_in_video"):
        media(input_ids=[1], use_audio_in_video=True)


# -- the generic runner in the core -------------------------------------------------------------


@pytest.fixture(scope="module")
def omni_core() -> Iterator[EngineCore]:
    core = EngineCore(resolve_model("tiny-omni"), max_batch=4, max_context=256, threads=1)
    core.start()
    yield core
    core.shutdown()


def test_an_update_in_place_keeps_a_media_request_running_on_the_generic_runner(
    omni_core: EngineCore,
) -> None:
    core = omni_core
    tokens = MediaTokens.from_tokenizer(load_tokenizer("tiny-omni"))
    image = QwenOmniProcessor().process(MediaKind.IMAGE, synth.solid_png(64, 48), label="image")
    ids = [1, 504, 2114, *tokens.block(MediaKind.IMAGE, image.tokens), 282, 4649]
    long = GenerationRequest(
        input_ids=ids, max_new_tokens=120, ignore_eos=True, seed=5, media=(image,)
    )
    reference = core.submit(long).result(timeout=120)
    original = list(core.weights.state_dict().items())
    changed = [(name, tensor.clone() * 1.5) for name, tensor in original]
    v0 = core.weight_version
    passes = core.forward_passes
    running = core.submit(long)
    deadline = time.monotonic() + 60
    while core.forward_passes < passes + 10:  # its prefill and a few decode steps
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.001)
    core.pause("in_place").result(timeout=10)
    try:
        core.update_weights(changed, version=v0 + 1).result(timeout=60)
    finally:
        core.resume().result(timeout=10)
    out = running.result(timeout=120)
    try:
        switch = out.output_versions.index(v0 + 1)
        assert 0 < switch < 120, "the update did not land mid-response"
        assert out.output_ids[:switch] == reference.output_ids[:switch]
        assert out.output_logprobs[switch:] != pytest.approx(
            reference.output_logprobs[switch:], abs=1e-3
        )
    finally:
        restored = list(load_omni_model("tiny-omni").named_parameters())
        core.update_weights(restored, version=v0).result(timeout=60)
    assert core.submit(long).result(timeout=120).output_ids == reference.output_ids


def test_the_core_refuses_media_a_model_does_not_take_or_blocks_that_do_not_match(
    omni_core: EngineCore,
) -> None:
    image = ProcessedMedia(kind=MediaKind.IMAGE, tokens=4, inputs={})
    with pytest.raises(ValueError, match=r"hold 0 image placeholder block\(s\)"):
        omni_core.validate(GenerationRequest(input_ids=[1, 2], media=(image,)))


def test_the_cli_reads_the_media_config_from_a_file_or_inline(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from omniloop.inference.cli import _read_media, app
    from omniloop.platform.control.engines import engine_command

    good = tmp_path / "media.yaml"
    good.write_text("image_max_pixels: 50176\nvideo_fps: 1.0\n")
    config = _read_media(str(good))
    assert (config.image_max_pixels, config.video_fps) == (50176, 1.0)
    # What the platform passes to the engines it launches: the rollout's settings, inline.
    argv = engine_command("tiny-omni", 1234, media=config)
    assert _read_media(argv[argv.index("--media") + 1]) == config
    assert "--media" not in engine_command("tiny-omni", 1234, media=MediaConfig())
    bad = tmp_path / "media.json"
    bad.write_text('{"image_min_pixels": 20, "image_max_pixels": 10}')
    result = CliRunner().invoke(app, ["serve", "--model", "tiny-omni", "--media", str(bad)])
    assert result.exit_code == 2
    assert "image_min_pixels=20 is above" in result.output
