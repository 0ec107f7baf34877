"""The CPU engine serving `tiny-omni` (a Qwen2.5-Omni thinker) with images, audio and video.

`omniloop engine serve --model tiny-omni` runs as a subprocess (the generic transformers
runner). What must hold:
- sampled logprobs are those a full teacher-forced forward of the same model over the same
  ids and media recomputes (mean |Δ| ≤ 1e-5), and greedy output is the model's argmax;
- requests with different media and lengths decoded in one batch get what each gets alone;
- a text-only prompt works; a mismatched placeholder block, unreadable media, or media sent to
  a text-only (Llama) engine get a 400 naming the item;
- a weight update by any path (a `save_pretrained` folder, and the trainer's disk, gloo
  broadcast and tcp publishes of its `named_parameters()`) makes the engine sample what the
  new weights do.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from omniloop.agents.chat import ChatFormat
from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient, ProcessorOutputFields
from omniloop.inference.models import load_omni_model, load_tokenizer, resolve_model
from omniloop.modalities import MediaData, MediaKind, ProcessedMedia, concat_inputs, synth
from omniloop.modalities.qwen_omni import QwenOmniProcessor
from omniloop.platform.dcs import WeightSyncConfig, make_weight_sync

MAX_CONTEXT = 512
MIME = {MediaKind.IMAGE: "image/png", MediaKind.AUDIO: "audio/wav", MediaKind.VIDEO: "video/mp4"}
_versions = itertools.count(100)


@pytest.fixture(scope="module")
def omni_url(tmp_path_factory: pytest.TempPathFactory, engine_server: Any) -> Iterator[str]:
    """URL of `omniloop engine serve --model tiny-omni` (one thread, 8 slots)."""
    log = tmp_path_factory.mktemp("omni-engine") / "engine.log"
    options = ["--max-batch", "8", "--max-context", str(MAX_CONTEXT)]
    with engine_server(log, "tiny-omni", *options) as url:
        yield url


@pytest.fixture
async def omni_http(omni_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=omni_url, timeout=120) as client:
        yield client


@dataclass
class Omni:
    """The client's side: tokenizer, chat format, processor, and the model as a trainer has
    it (the reference every engine output is checked against)."""

    chat: ChatFormat
    processor: QwenOmniProcessor
    model: Any


@pytest.fixture(scope="module")
def omni() -> Omni:
    tokenizer = load_tokenizer("tiny-omni")
    return Omni(ChatFormat(tokenizer), QwenOmniProcessor(), load_omni_model("tiny-omni"))


@dataclass
class Prompt:
    ids: list[int]
    media: list[tuple[MediaKind, bytes]]
    processed: list[ProcessedMedia]

    def fields(self, style: str = "uri", folder: Path | None = None) -> dict[str, list[str]]:
        """SGLang's media fields: `data:` URIs, bare base64, or files written to `folder`."""
        out: dict[str, list[str]] = {}
        for i, (kind, data) in enumerate(self.media):
            if style == "uri":
                item = f"data:{MIME[kind]};base64," + base64.b64encode(data).decode()
            elif style == "base64":
                item = base64.b64encode(data).decode()
            else:
                assert folder is not None
                path = folder / f"item{i}.{MIME[kind].split('/')[1]}"
                path.write_bytes(data)
                item = str(path)
            out.setdefault(f"{kind}_data", []).append(item)
        return out


def prompt(omni: Omni, text: str, media: list[tuple[MediaKind, bytes]]) -> Prompt:
    """A user turn of `text` then the media (placeholder blocks assembled as ids)."""
    processed = [omni.processor.process(kind, data, label=str(kind)) for kind, data in media]
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": item.kind.value, "tokens": item.tokens} for item in processed]
    ids = omni.chat.prompt_ids([{"role": "user", "content": parts}])
    return Prompt(ids, media, processed)


def all_three(omni: Omni) -> Prompt:
    return prompt(
        omni,
        "What do you see and hear?",
        [
            (MediaKind.IMAGE, synth.solid_png(64, 48)),
            (MediaKind.AUDIO, synth.tone_wav(1.0)),
            (MediaKind.VIDEO, synth.moving_square_mp4()),
        ],
    )


def body(p: Prompt, **sampling: Any) -> dict[str, Any]:
    return {
        "input_ids": p.ids,
        "sampling_params": {"ignore_eos": True, **sampling},
        "return_logprob": True,
        **p.fields(),
    }


async def generate(
    http: httpx.AsyncClient, payload: dict[str, Any]
) -> tuple[list[int], list[float]]:
    response = await http.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    logprobs = meta["output_token_logprobs"]
    return [t for _, t, _ in logprobs], [lp for lp, _, _ in logprobs]


def teacher_forced(model: Any, p: Prompt, output: list[int]) -> tuple[list[float], list[int]]:
    """One full forward of prompt + output with the prompt's media: each output token's
    logprob and the argmax at each output position."""
    ids = torch.tensor([p.ids + output])
    with torch.inference_mode():
        logits = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), **concat_inputs(p.processed)
        ).logits[0]
    rows = torch.log_softmax(logits.float(), dim=-1)[len(p.ids) - 1 : len(p.ids) - 1 + len(output)]
    chosen = rows.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    return chosen.tolist(), rows.argmax(dim=-1).tolist()


async def test_sampled_logprobs_are_what_a_full_forward_recomputes(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = all_three(omni)
    output, logprobs = await generate(
        omni_http, body(p, max_new_tokens=32, temperature=1.0, sampling_seed=1234)
    )
    assert len(output) == 32
    reference, _ = teacher_forced(omni.model, p, output)
    gap = (torch.tensor(logprobs) - torch.tensor(reference)).abs()
    print(f"\nomni sampled vs teacher-forced: mean |Δ| {gap.mean():.3g}, max {gap.max():.3g}")
    assert float(gap.mean()) <= 1e-5
    assert float(gap.max()) <= 1e-4


async def test_greedy_output_is_the_models_argmax(omni_http: httpx.AsyncClient, omni: Omni) -> None:
    p = all_three(omni)
    output, logprobs = await generate(omni_http, body(p, max_new_tokens=16, temperature=0.0))
    reference, argmax = teacher_forced(omni.model, p, output)
    # Teacher-forced argmax at every position equals the output: it is the model's greedy one.
    assert output == argmax
    assert logprobs == pytest.approx(reference, abs=1e-5)


async def test_data_uris_bare_base64_and_file_paths_give_the_same_output(
    omni_http: httpx.AsyncClient, omni: Omni, tmp_path: Path
) -> None:
    p = all_three(omni)
    outputs = []
    for style in ("uri", "base64", "path"):
        payload = {
            "input_ids": p.ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
            "modalities": ["image", "audio", "video"],  # SGLang's hint: accepted, not needed
            **p.fields(style, tmp_path),
        }
        outputs.append(await generate(omni_http, payload))
    assert outputs[0] == outputs[1] == outputs[2]


def processor_output_fields(omni: Omni, p: Prompt) -> dict[str, Any]:
    """SGLang's `processor_output` form of the prompt's media, as the rollout sends it."""
    return ProcessorOutputFields(omni.processor)([MediaData(kind=k, data=d) for k, d in p.media])


async def test_processor_output_dicts_give_what_the_files_give(
    omni_url: str, omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = all_three(omni)
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    files = await generate(omni_http, {**body(p), "sampling_params": sampling})
    dicts = processor_output_fields(omni, p)
    assert all(v["format"] == "processor_output" for v in dicts.values())
    payload = {"input_ids": p.ids, "sampling_params": sampling, "return_logprob": True, **dicts}
    assert await generate(omni_http, payload) == files
    # The same through the client, each kind's dict wrapped in a list as SGLang also takes it.
    wrapped = {key: [value] for key, value in dicts.items()}
    assert await generate(omni_http, {**payload, **wrapped}) == files
    # In a batch, an entry per prompt: its dict, or null for a text-only prompt.
    text_only = prompt(omni, "Only words.", [])
    batch = {
        "input_ids": [p.ids, text_only.ids],
        "sampling_params": sampling,
        "return_logprob": True,
        **{key: [value, None] for key, value in dicts.items()},
    }
    response = await omni_http.post("/generate", json=batch)
    assert response.status_code == 200, response.text
    first = response.json()[0]["meta_info"]["output_token_logprobs"]
    # Batched with another prompt: the same tokens, logprobs within the engine's batching
    # rounding (`test_requests_batched_together_get_what_each_gets_alone`).
    assert [t for _, t, _ in first] == files[0]
    assert [lp for lp, _, _ in first] == pytest.approx(files[1], abs=1e-5)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    media = [MediaData(kind=k, data=d) for k, d in p.media]
    encoder = ProcessorOutputFields(omni.processor)
    async with EngineClient(omni_url, media_encoder=encoder) as client:
        out = await client.generate(p.ids, params, media)
    async with EngineClient(omni_url) as client:
        sent_as_files = await client.generate(p.ids, params, media)
    assert out.output_ids
    assert out.output_ids == sent_as_files.output_ids
    assert out.output_logprobs == sent_as_files.output_logprobs


async def test_processor_output_dicts_that_do_not_fit_are_refused(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = all_three(omni)
    dicts = processor_output_fields(omni, p)
    files = p.fields()
    base = {"input_ids": p.ids, "sampling_params": {"max_new_tokens": 2}}
    mixed = {**base, **dicts, "audio_data": files["audio_data"]}
    assert "mix files and processor_output dicts" in await rejected(omni_http, mixed)
    embedded = {**base, **dicts, "image_data": {"format": "precomputed_embedding", "feature": []}}
    message = await rejected(omni_http, embedded)
    assert message.startswith("image_data: a media dict needs format 'processor_output'")
    twice = {**base, **dicts, "video_data": [dicts["video_data"]] * 2}
    assert "got several" in await rejected(omni_http, twice)
    # A dict of another image than the one whose block the ids hold.
    other = prompt(omni, "x", [(MediaKind.IMAGE, synth.solid_png(200, 120))])
    swapped = {**base, **dicts, "image_data": processor_output_fields(omni, other)["image_data"]}
    message = await rejected(omni_http, swapped)
    assert message.startswith("image 0: its placeholder block has")
    grid = {**dicts["image_data"], "image_grid_thw": [[1, 3, 4]]}
    message = await rejected(omni_http, {**base, **dicts, "image_data": grid})
    assert message.startswith("image_data: image 0's grid [1, 3, 4] is not one the processor")


def mixed_prompts(omni: Omni) -> list[tuple[Prompt, int]]:
    """Prompts with different media and lengths, and how many tokens each samples."""
    return [
        (prompt(omni, "A picture.", [(MediaKind.IMAGE, synth.solid_png(96, 64, (0, 90, 200)))]), 5),
        (
            prompt(
                omni,
                "Sound, then a clip.",
                [
                    (MediaKind.AUDIO, synth.tone_wav(0.6, hertz=660.0)),
                    (MediaKind.VIDEO, synth.moving_square_mp4(frames=6, step=9)),
                ],
            ),
            9,
        ),
        (all_three(omni), 13),
        (prompt(omni, "Just text, nothing else at all, a little longer than the rest.", []), 17),
        (
            prompt(
                omni,
                "Two images.",
                [
                    (MediaKind.IMAGE, synth.solid_png(32, 32, (250, 250, 0))),
                    (MediaKind.IMAGE, synth.solid_png(120, 40)),
                ],
            ),
            7,
        ),
    ]


async def waiting_requests(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    line = next(ln for ln in text.splitlines() if ln.startswith("omniloop_engine_waiting_requests"))
    return float(line.split()[-1])


async def test_requests_batched_together_get_what_each_gets_alone(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    cases = mixed_prompts(omni)
    payloads = [
        body(p, max_new_tokens=n, temperature=1.0, sampling_seed=40 + i)
        for i, (p, n) in enumerate(cases)
    ]
    alone = [await generate(omni_http, payload) for payload in payloads]
    # Paused, every request waits; continued, all are admitted at once and decoded together.
    await omni_http.post("/pause_generation", json={"mode": "in_place"})
    try:
        tasks = [asyncio.create_task(generate(omni_http, payload)) for payload in payloads]
        deadline = time.monotonic() + 60
        while await waiting_requests(omni_http) < len(payloads):
            assert time.monotonic() < deadline, "the requests never reached the queue"
            await asyncio.sleep(0.05)
    finally:
        await omni_http.post("/continue_generation", json={})
    together = await asyncio.gather(*tasks)
    worst = 0.0
    for (ids_alone, lp_alone), (ids_batched, lp_batched) in zip(alone, together, strict=True):
        assert ids_batched == ids_alone
        worst = max(worst, max(abs(a - b) for a, b in zip(lp_alone, lp_batched, strict=True)))
    print(f"\nomni batched vs alone: max |Δ logprob| {worst:.3g}")
    assert worst <= 1e-5
    # Each one is also what the model computes for it.
    for (p, _), (ids, lps) in zip(cases, together, strict=True):
        reference, _ = teacher_forced(omni.model, p, ids)
        assert lps == pytest.approx(reference, abs=1e-4)


async def test_a_text_only_prompt_works_and_the_model_info_lists_the_modalities(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = prompt(omni, "Hello there.", [])
    output, logprobs = await generate(omni_http, body(p, max_new_tokens=8, temperature=0.0))
    reference, argmax = teacher_forced(omni.model, p, output)
    assert output == argmax
    assert logprobs == pytest.approx(reference, abs=1e-5)
    info = (await omni_http.get("/get_model_info")).json()
    assert info["modalities"] == ["text", "image", "audio", "video"]
    assert info["model_type"] == "qwen2_5_omni_thinker"
    assert info["architectures"] == ["Qwen2_5OmniThinkerForConditionalGeneration"]


async def rejected(http: httpx.AsyncClient, payload: dict[str, Any]) -> str:
    response = await http.post("/generate", json=payload)
    assert response.status_code == 400, response.text
    return str(response.json()["message"])


async def test_a_block_of_another_length_is_refused_naming_the_item(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = all_three(omni)
    image = p.processed[0]
    # The client counted two placeholder tokens fewer than the engine's processor makes.
    start = p.ids.index(omni.chat.media_tokens.image)
    short = p.ids[:start] + p.ids[start + 2 :]
    message = await rejected(omni_http, {**body(p, max_new_tokens=2), "input_ids": short})
    assert message == (
        f"image 0: its placeholder block has {image.tokens - 2} tokens but the processor makes "
        f"{image.tokens} of it (engine and client media configs differ?)"
    )


async def test_blocks_and_items_that_do_not_pair_up_are_refused(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = all_three(omni)
    missing = {k: v for k, v in body(p, max_new_tokens=2).items() if k != "audio_data"}
    message = await rejected(omni_http, missing)
    assert "1 audio placeholder block(s) but audio_data has 0 item(s)" in message
    text_only = prompt(omni, "No media here.", [])
    extra = {**body(text_only, max_new_tokens=2), **p.fields()}
    assert "0 image placeholder block(s) but image_data has 1 item(s)" in await rejected(
        omni_http, extra
    )
    stray = [*text_only.ids[:3], omni.chat.media_tokens.vision_bos, *text_only.ids[3:]]
    message = await rejected(omni_http, {**body(text_only, max_new_tokens=2), "input_ids": stray})
    assert "opens or closes no placeholder block" in message


async def test_unreadable_media_are_refused_naming_the_item(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    p = all_three(omni)
    not_a_png = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()
    message = await rejected(omni_http, {**body(p, max_new_tokens=2), "image_data": [not_a_png]})
    assert message.startswith("image 0 is not an image Pillow can read")
    url = {**body(p, max_new_tokens=2), "video_data": "https://example.com/clip.mp4"}
    message = await rejected(omni_http, url)
    assert message.startswith("video 0: ")
    assert "is a URL" in message
    # In a batch, the prompt is named too.
    batch = {
        "input_ids": [p.ids, p.ids],
        "sampling_params": {"max_new_tokens": 2},
        "image_data": [p.fields()["image_data"], [not_a_png]],
        "audio_data": [p.fields()["audio_data"]] * 2,
        "video_data": [p.fields()["video_data"]] * 2,
    }
    assert (await rejected(omni_http, batch)).startswith("prompt 1: image 0 is not an image")
    wrong_length = {**batch, "image_data": [p.fields()["image_data"]]}
    assert "image_data has 1 entries for a batch of 2" in await rejected(omni_http, wrong_length)


async def test_a_batch_takes_a_list_of_items_per_prompt(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    with_media = all_three(omni)
    text_only = prompt(omni, "Only words.", [])
    fields = with_media.fields()
    payload = {
        "input_ids": [with_media.ids, text_only.ids],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        **{key: [items, None] for key, items in fields.items()},
    }
    response = await omni_http.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    results = response.json()
    for p, result in zip([with_media, text_only], results, strict=True):
        _, argmax = teacher_forced(omni.model, p, result["output_ids"])
        assert result["output_ids"] == argmax


async def test_media_sent_to_a_text_only_engine_are_refused(tiny_engine_url: str) -> None:
    png = "data:image/png;base64," + base64.b64encode(synth.solid_png(8, 8)).decode()
    async with httpx.AsyncClient(base_url=tiny_engine_url, timeout=60) as http:
        message = await rejected(
            http,
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "image_data": png},
        )
        info = (await http.get("/get_model_info")).json()
    assert message.startswith("the model served (LlamaForCausalLM) takes no image input")
    assert info["modalities"] == ["text"]


# -- weight updates ---------------------------------------------------------------------------


def perturbed(seed: int) -> Any:
    """tiny-omni with every weight moved by noise (other greedy outputs)."""
    model = load_omni_model("tiny-omni")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.numel() > 1 and float(param.std()) > 0:
                param.add_(torch.randn(param.shape, generator=gen) * 0.5 * param.std())
    return model


async def publish(method: str, model: Any, url: str, tmp_path: Path, version: int) -> None:
    """Give the engine `model`'s weights as `version` the way `method` names."""
    if method == "save_pretrained":
        folder = tmp_path / "saved"
        model.save_pretrained(folder)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            response = await http.post(
                "/update_weights_from_disk",
                json={"model_path": str(folder), "weight_version": str(version)},
            )
        assert response.status_code == 200, response.text
        return
    kind, _, each = method.partition("-")
    config = WeightSyncConfig(
        method=kind,  # type: ignore[arg-type]
        flattened=kind == "distributed" and not each,
        bucket_mb=1.0,
        staging_dir=str(tmp_path / "staging"),
        timeout_s=120,
    )
    sync = make_weight_sync(config, [url])
    try:
        await sync.publish(list(model.named_parameters()), version)
    finally:
        await sync.close()


UPDATE_METHODS = ["save_pretrained", "disk", "distributed", "distributed-each", "tcp"]
"""`save_pretrained`: a perturbed copy saved by transformers, loaded with
`/update_weights_from_disk`; the others: the trainer's publish of `named_parameters()`
(`distributed-each`: a broadcast per tensor, received straight into the paused model)."""


async def restore(http: httpx.AsyncClient) -> None:
    """Back to tiny-omni's own weights, generating, for the other tests (a failed publish
    leaves the engine paused until a later one completes: here, this load)."""
    response = await http.post(
        "/update_weights_from_disk", json={"model_path": str(resolve_model("tiny-omni"))}
    )
    assert response.status_code == 200, response.text
    response = await http.post("/continue_generation", json={})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("method", UPDATE_METHODS)
async def test_a_weight_update_makes_the_engine_sample_what_the_new_weights_do(
    method: str, omni_url: str, omni_http: httpx.AsyncClient, omni: Omni, tmp_path: Path
) -> None:
    p = all_three(omni)
    greedy = body(p, max_new_tokens=12, temperature=0.0)
    new = perturbed(seed=UPDATE_METHODS.index(method) + 1)
    before, _ = await generate(omni_http, greedy)
    version = next(_versions)
    try:
        await publish(method, new, omni_url, tmp_path, version)
        assert (await omni_http.get("/get_weight_version")).json()["weight_version"] == str(version)
        output, logprobs = await generate(omni_http, greedy)
        reference, argmax = teacher_forced(new, p, output)
        assert output == argmax
        assert output != before, "the new weights sample what the old ones did: nothing tested"
        assert logprobs == pytest.approx(reference, abs=1e-5)
    finally:
        await restore(omni_http)
    assert (await generate(omni_http, greedy))[0] == before


async def test_weights_of_another_shape_or_name_are_refused(
    omni_url: str, omni_http: httpx.AsyncClient, tmp_path: Path
) -> None:
    response = await omni_http.post(
        "/update_weights_from_disk", json={"model_path": str(resolve_model("tiny"))}
    )
    assert response.status_code == 400
    assert "'llama' model, the engine serves a 'qwen2_5_omni_thinker'" in response.json()["message"]
    model = load_omni_model("tiny-omni")
    named = [(n, t) for n, t in model.named_parameters()]
    wrong = [(named[0][0], torch.zeros(3, 3)), *named[1:]]
    sync = make_weight_sync(WeightSyncConfig(method="tcp", bucket_mb=1.0, timeout_s=60), [omni_url])
    try:
        with pytest.raises(Exception, match="has shape"):
            await sync.publish(wrong, next(_versions))
        # A text model's name (the omni thinker nests it under `model.language_model`).
        name = "model.layers.0.mlp.up_proj.weight"
        with pytest.raises(Exception, match=re.escape(f"unknown weight {name!r}")):
            await sync.publish([(name, named[0][1])], next(_versions))
    finally:
        await sync.close()
        await restore(omni_http)


async def test_the_trainer_scores_what_the_engine_sampled(
    omni_http: httpx.AsyncClient, omni: Omni
) -> None:
    """Engine vs trainer on multimodal sequences, fp32: the torch backend, scoring a right-
    padded batch that mixes an all-three-media row, an image row and a text-only row, gives
    the logprobs the engine sampled with (mean |Δ| ≤ 1e-5)."""
    from omniloop.trainer.batch import TrainBatch
    from omniloop.trainer.config import TrainerConfig
    from omniloop.trainer.torch_backend import TorchTrainerBackend

    prompts = [
        all_three(omni),
        prompt(omni, "Count the squares.", [(MediaKind.IMAGE, synth.solid_png(90, 30))]),
        prompt(omni, "Just text.", []),
    ]
    sampled = [
        await generate(
            omni_http, body(p, max_new_tokens=12 + 4 * i, temperature=1.0, sampling_seed=7)
        )
        for i, p in enumerate(prompts)
    ]
    backend = TorchTrainerBackend("tiny-omni", TrainerConfig(device="cpu", micro_batch_size=3))
    batch = TrainBatch.for_scoring(
        [p.ids + out for p, (out, _) in zip(prompts, sampled, strict=True)],
        media_inputs=[concat_inputs(p.processed) if p.processed else None for p in prompts],
    )
    scored = backend.logprobs(batch)
    gaps = []
    for row, (p, (out, logprobs)) in enumerate(zip(prompts, sampled, strict=True)):
        trainer = scored[row, len(p.ids) : len(p.ids) + len(out)]
        gaps.append((trainer - torch.tensor(logprobs)).abs())
    gap = torch.cat(gaps)
    print(f"\nomni engine vs trainer: mean |Δ| {gap.mean():.3g}, max {gap.max():.3g}")
    assert float(gap.mean()) <= 1e-5
    assert float(gap.max()) <= 1e-4
