"""TorchTrainerBackend on `tiny-omni` (a random Qwen2.5-Omni thinker): rows that carry images,
audio and video are scored and trained exactly as when alone, learn, checkpoint, and fail by
name when their media do not fit their placeholders.

Prompts are built token-id first (`ChatFormat.prompt_ids` with media parts); media are made in
code (`modalities.synth`) and processed by `QwenOmniProcessor`. fp32, one thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import Tensor, nn

from omniloop.agents.chat import ChatFormat
from omniloop.inference.models import load_tokenizer, resolve_model
from omniloop.modalities import ProcessedMedia, concat_inputs, synth
from omniloop.modalities.media import MediaKind
from omniloop.modalities.qwen_omni import QwenOmniProcessor
from omniloop.trainer.batch import TrainBatch, TrainRow
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.losses import token_logprobs
from omniloop.trainer.reference import TorchReference
from omniloop.trainer.torch_backend import (
    TorchTrainerBackend,
    check_media,
    load_hf_model,
    trained_tokens,
)

EXACT = 1e-5
"""fp32 tolerance for the same row's logprobs computed in different batches."""


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(load_tokenizer("tiny-omni"))


@pytest.fixture(scope="module")
def media() -> dict[str, ProcessedMedia]:
    processor = QwenOmniProcessor()
    return {
        "image": processor.process(MediaKind.IMAGE, synth.solid_png(64, 48), label="red"),
        "other_image": processor.process(
            MediaKind.IMAGE, synth.solid_png(64, 48, (20, 200, 40)), label="green"
        ),
        "audio": processor.process(MediaKind.AUDIO, synth.tone_wav(1.0), label="tone"),
        "video": processor.process(MediaKind.VIDEO, synth.moving_square_mp4(), label="square"),
    }


def make_row(
    chat: ChatFormat,
    name: str,
    items: list[ProcessedMedia],
    question: str,
    answer: str,
    advantage: float = 1.0,
    media_inputs: Mapping[str, Tensor] | None = None,
) -> TrainRow:
    """A user turn (media parts, then the question) and a trained assistant answer."""
    parts: list[dict[str, Any]] = [{"type": str(i.kind), "tokens": i.tokens} for i in items]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    prompt = chat.prompt_ids(messages)
    completion = chat.tokenizer.encode(answer, add_special_tokens=False)
    completion.append(chat.stop_token_ids[0])
    ids = prompt + completion
    inputs = media_inputs if media_inputs is not None else concat_inputs(items) if items else None
    return TrainRow(
        id=name,
        input_ids=ids,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        rollout_logprobs=[0.0] * len(ids),
        weight_version=[0] * len(ids),
        advantages=advantage,
        stop_reason="stop",
        media_inputs=inputs,
    )


def mixed_rows(chat: ChatFormat, media: dict[str, ProcessedMedia]) -> list[TrainRow]:
    """A text-only row, an image row, an audio row and a video row: four lengths."""
    return [
        make_row(chat, "text", [], "Say something nice about squares.", "Squares are neat."),
        make_row(chat, "image", [media["image"]], "What color is it?", "Red."),
        make_row(chat, "audio", [media["audio"]], "What do you hear?", "A steady tone."),
        make_row(chat, "video", [media["video"]], "Where does it go?", "To the right."),
    ]


def backend(micro_batch_size: int = 4, **config: Any) -> TorchTrainerBackend:
    cfg = {"device": "cpu", "micro_batch_size": micro_batch_size, **config}
    return TorchTrainerBackend("tiny-omni", TrainerConfig.model_validate(cfg))


@pytest.fixture(scope="module")
def scorer() -> TorchTrainerBackend:
    """A backend only scored with (never trained): shared by the module."""
    return backend()


def completion_logprobs(logprobs: Tensor, batch: TrainBatch) -> list[Tensor]:
    """Each row's logprobs on its trained tokens."""
    return [logprobs[b][batch.loss_mask[b] != 0] for b in range(len(batch))]


# -- (a) a mixed, right-padded batch scores every row as alone ---------------------------------


def test_a_mixed_batch_scores_each_row_as_it_scores_alone(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    batch = TrainBatch.from_rows(mixed_rows(chat, media), pad_id=2)
    assert len(set(batch.attention_mask.sum(-1).tolist())) == 4  # right padding in every row
    together = scorer.logprobs(batch)
    for b in range(len(batch)):
        alone = scorer.logprobs(batch.select([b]))
        width = alone.shape[1]
        torch.testing.assert_close(together[b, :width], alone[0], atol=EXACT, rtol=0)
        assert together[b, width:].abs().sum() == 0  # padding holds 0
    # Teacher forcing is deterministic: scoring again is bitwise equal.
    assert torch.equal(scorer.logprobs(batch), together)


def test_trained_tokens_path_equals_full_logits_with_media(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    # train_step scores only trained tokens through the thinker's base model (which takes the
    # media): it must agree with the full forward that `logprobs` uses.
    batch = TrainBatch.from_rows(mixed_rows(chat, media), pad_id=2)
    full = scorer.logprobs(batch)
    rows, positions = trained_tokens(batch.loss_mask)
    with torch.no_grad():
        logits = scorer.scorer.token_logits(scorer.model, batch, rows, positions)
    fast = token_logprobs(logits, batch.input_ids[rows, positions])
    torch.testing.assert_close(fast, full[rows, positions], atol=EXACT, rtol=0)


def test_the_media_reach_the_model(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    red = make_row(chat, "red", [media["image"]], "What color is it?", "Red.")
    green = make_row(chat, "green", [media["other_image"]], "What color is it?", "Red.")
    assert red.input_ids == green.input_ids  # same placeholders, different pixels
    batch = TrainBatch.from_rows([red, green])
    red_lp, green_lp = completion_logprobs(scorer.logprobs(batch), batch)
    assert (red_lp - green_lp).abs().max() > 1e-4


# -- (b) micro-batching changes nothing ---------------------------------------------------------


def test_micro_batch_size_changes_neither_logprobs_nor_gradients(
    chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    advantages = [1.0, -1.0, 0.5, -0.5]
    rows = [
        dataclasses.replace(r, advantages=a)
        for r, a in zip(mixed_rows(chat, media), advantages, strict=True)
    ]
    batch = TrainBatch.from_rows(rows, pad_id=2)
    one, four = backend(micro_batch_size=1, lr=1e-3), backend(micro_batch_size=4, lr=1e-3)
    torch.testing.assert_close(one.logprobs(batch), four.logprobs(batch), atol=EXACT, rtol=0)
    m1, m4 = one.train_step(batch), four.train_step(batch)
    assert m1["actor/grad_norm"] == pytest.approx(m4["actor/grad_norm"], rel=1e-5)
    assert m1["actor/pg_loss"] == pytest.approx(m4["actor/pg_loss"], rel=1e-5, abs=1e-7)
    grads_one = dict(one.model.named_parameters())
    for name, param in four.model.named_parameters():
        g1, g4 = grads_one[name].grad, param.grad
        if g1 is None or g4 is None:
            # A parameter the forward never uses (the audio tower's `audio_bos_eos_token`) has
            # no gradient either way.
            assert g1 is None, name
            assert g4 is None, name
            continue
        torch.testing.assert_close(g1, g4, atol=1e-6, rtol=1e-4, msg=name)
    # Every part of the model learned from this batch: the towers through their placeholders.
    for part in ("model.visual.", "model.audio_tower.", "model.language_model."):
        norms = [
            p.grad.norm()
            for n, p in four.model.named_parameters()
            if n.startswith(part) and p.grad is not None
        ]
        assert norms
        assert float(torch.stack(norms).norm()) > 0, part


# -- (c) a GRPO-style step learns from a multimodal group --------------------------------------


def test_a_grpo_step_on_a_multimodal_group_moves_logprobs_with_the_advantages(
    chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    items = [media["image"], media["audio"], media["video"]]
    answers = ["A red square.", "It moves right, slowly.", "A tone.", "Nothing at all, really."]
    advantages = [1.0, -1.0, 1.0, -1.0]
    shared = concat_inputs(items)  # one prompt: its media tensors shared by the group's rows
    rows = [
        make_row(chat, f"s{i}", items, "Describe all of it.", answer, adv, shared)
        for i, (answer, adv) in enumerate(zip(answers, advantages, strict=True))
    ]
    batch = TrainBatch.from_rows(rows, pad_id=2)
    b = backend(micro_batch_size=4, lr=1e-2, grad_clip=None, weight_decay=0.0)
    before = b.logprobs(batch)
    # pi_old from the scoring path: the training forward (trained tokens only) agrees with it,
    # so before the update every ratio is 1.
    metrics = b.train_step(batch.replace(old_logprobs=before))
    after = b.logprobs(batch)
    assert metrics["actor/skipped_step"] == 0.0
    assert abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/clipfrac"] == 0.0
    deltas = [
        float((a - o).mean())
        for a, o in zip(
            completion_logprobs(after, batch), completion_logprobs(before, batch), strict=True
        )
    ]
    for delta, adv in zip(deltas, advantages, strict=True):
        assert delta * adv > 0, (deltas, advantages)


# -- (d) checkpoints and exports -----------------------------------------------------------------


def test_save_then_load_into_a_fresh_backend_scores_bitwise_equal(
    tmp_path: Path, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    batch = TrainBatch.from_rows(mixed_rows(chat, media), pad_id=2)
    trained = backend(lr=1e-3)
    trained.train_step(batch)
    trained.save(tmp_path / "ckpt", {"step": 1})
    fresh = backend(lr=1e-3)
    assert fresh.load(tmp_path / "ckpt") == {"step": 1}
    assert fresh.version == trained.version == 1
    assert torch.equal(fresh.logprobs(batch), trained.logprobs(batch))
    # The optimizer resumes too: one more step on each stays bitwise equal.
    trained.train_step(batch)
    fresh.train_step(batch)
    assert torch.equal(fresh.logprobs(batch), trained.logprobs(batch))


def test_named_weights_and_save_hf_use_the_thinkers_own_names(
    tmp_path: Path, scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    weights = dict(scorer.named_weights())
    params = [name for name, _ in scorer.model.named_parameters()]
    assert list(weights)[: len(params)] == params
    assert any(n.startswith("model.visual.") for n in weights)
    assert any(n.startswith("model.audio_tower.") for n in weights)
    scorer.save_hf(tmp_path / "hf")
    # The file holds the original checkpoint layout (`visual.…`, `model.layers.…`), which
    # transformers renames on load: loaded, every weight is back under its in-memory name.
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as saved:
        assert "visual.merger.ln_q.weight" in saved.keys()  # noqa: SIM118
    exported = load_hf_model(tmp_path / "hf")
    assert type(exported) is type(scorer.model)
    reloaded = dict(exported.named_parameters())
    assert list(reloaded) == params
    for name in params:
        assert torch.equal(reloaded[name], weights[name]), name
    batch = TrainBatch.from_rows(mixed_rows(chat, media), pad_id=2)
    again = scorer.scorer.score(exported, batch)
    assert torch.equal(again, scorer.logprobs(batch))
    assert load_tokenizer(str(tmp_path / "hf")).image_token_id == chat.media_tokens.image


def test_the_thinker_loads_as_its_conditional_generation_class() -> None:
    model = load_hf_model(resolve_model("tiny-omni"))
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert next(model.parameters()).dtype == torch.float32


# -- (e) media that do not fit their placeholders fail by name ---------------------------------


@pytest.mark.parametrize("kind", ["image", "audio", "video"])
def test_media_that_do_not_fit_the_placeholders_fail_naming_the_row(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia], kind: str
) -> None:
    # Two items for one block (image, audio: excess audio features would otherwise fill the
    # placeholders silently), or an image's inputs for a video block.
    item = media[kind]
    inputs = concat_inputs([media["image"]] if kind == "video" else [item, item])
    bad = make_row(chat, f"bad-{kind}", [item], "What is it?", "Something.", media_inputs=inputs)
    batch = TrainBatch.from_rows([*mixed_rows(chat, media), bad], pad_id=2)
    with pytest.raises(ValueError, match=f"row 4 \\(bad-{kind}\\): .* placeholder tokens"):
        scorer.logprobs(batch)
    with pytest.raises(ValueError, match=f"bad-{kind}"):
        backend().train_step(batch)


def test_placeholders_without_media_fail_naming_the_row(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    row = make_row(chat, "no-media", [media["image"]], "What is it?", "Red.")
    batch = TrainBatch.from_rows([dataclasses.replace(row, media_inputs=None)])
    with pytest.raises(ValueError, match=r"row 0 \(no-media\): 4 image placeholder tokens"):
        scorer.logprobs(batch)


def test_the_models_own_refusal_is_raised_again_naming_the_rows(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    # Past the backend's own check (a direct call of the scorer), the model's ValueError comes
    # back with the micro-batch's row ids instead of a bare shape message.
    inputs = concat_inputs([media["image"], media["image"]])
    bad = make_row(chat, "bad", [media["image"]], "What is it?", "Red.", media_inputs=inputs)
    batch = TrainBatch.from_rows([bad])
    with pytest.raises(ValueError, match=r"row 0 \(bad\): the model refused the batch: Image"):
        scorer.scorer.logits(scorer.model, batch)


def test_a_model_without_media_refuses_rows_with_media(
    chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    batch = TrainBatch.from_rows(mixed_rows(chat, media))
    with pytest.raises(ValueError, match=r"rows 1, 2, 3 \(image, audio, video\) carry media"):
        check_media(nn.Linear(2, 2), batch)


# -- the reference policy --------------------------------------------------------------------


def test_the_reference_scores_media_rows_as_the_backend_does(
    scorer: TorchTrainerBackend, chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    batch = TrainBatch.from_rows(mixed_rows(chat, media), pad_id=2)
    reference = TorchReference("tiny-omni", scorer.config)
    assert torch.equal(reference.logprobs(batch), scorer.logprobs(batch))


def test_a_kl_penalty_against_the_kept_copy_reads_the_media_too(
    chat: ChatFormat, media: dict[str, ProcessedMedia]
) -> None:
    batch = TrainBatch.from_rows(mixed_rows(chat, media), pad_id=2)
    b = backend(lr=1e-3, loss={"kl_coef": 0.1})
    metrics = b.train_step(batch)
    # Before the first update the policy is its reference: no divergence on any row.
    assert abs(metrics["actor/kl_loss"]) < 1e-6
    assert b.ref_logprobs(batch).shape == batch.input_ids.shape
