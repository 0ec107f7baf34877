"""TrainBatch with media: each row's media inputs stay with the row through every slicing, and a
(micro-)batch's forward inputs are the rows' inputs concatenated in row order."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from omniloop.trainer.batch import TrainBatch, TrainRow, batch_from_trajectories
from omniloop.trainer.config import AdvantageConfig
from omniloop.trajectory import TrajectoryBuilder, TrajectoryMeta


def image(patches: int, fill: float) -> dict[str, Tensor]:
    """Inputs of one image of `patches` patches (a 1 x patches/4 x 4 grid), every value `fill`."""
    return {
        "pixel_values": torch.full((patches, 6), fill),
        "image_grid_thw": torch.tensor([[1, patches // 4, 4]]),
    }


def audio(frames: int, width: int = 10) -> dict[str, Tensor]:
    """Inputs of one clip with `frames` valid feature frames out of `width`."""
    mask = torch.zeros(1, width, dtype=torch.int32)
    mask[0, :frames] = 1
    features = torch.ones(1, 3, width) * mask[:, None]
    return {"input_features": features, "feature_attention_mask": mask}


def row(name: str, length: int, media: dict[str, Tensor] | None = None) -> TrainRow:
    return TrainRow(
        id=name,
        input_ids=list(range(1, length + 1)),
        loss_mask=[0] + [1] * (length - 1),
        rollout_logprobs=[0.0] * length,
        weight_version=[0] * length,
        advantages=1.0,
        stop_reason="stop",
        media_inputs=media,
    )


def mixed_rows() -> list[TrainRow]:
    return [
        row("text", 5),
        row("img-a", 7, image(8, 1.0)),
        row("aud", 4, audio(6)),
        row("img-b", 6, image(4, 2.0)),
    ]


def test_rows_keep_their_media_and_text_only_batches_have_none() -> None:
    batch = TrainBatch.from_rows(mixed_rows())
    assert batch.has_media
    assert [m is None for m in batch.media_inputs] == [True, False, False, False]
    text_only = TrainBatch.from_rows([row("a", 3), row("b", 4)])
    assert text_only.media_inputs == ()
    assert not text_only.has_media
    assert text_only.media_kwargs() == {}


def test_media_kwargs_concatenate_each_key_over_the_rows_that_have_it_in_row_order() -> None:
    kwargs = TrainBatch.from_rows(mixed_rows()).media_kwargs()
    assert set(kwargs) == {
        "pixel_values",
        "image_grid_thw",
        "input_features",
        "feature_attention_mask",
    }
    # img-a's 8 patches, then img-b's 4: the order in which their placeholders appear in the
    # flattened batch.
    assert kwargs["pixel_values"][:, 0].tolist() == [1.0] * 8 + [2.0] * 4
    assert kwargs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 1, 4]]
    assert kwargs["input_features"].shape == (1, 3, 10)


def test_select_split_and_replace_keep_media_aligned_with_rows() -> None:
    batch = TrainBatch.from_rows(mixed_rows())
    for single, original in zip(batch.split(1), batch.media_inputs, strict=True):
        assert single.media_inputs == (() if original is None else (original,))
    picked = batch.select([3, 0, 1])
    assert picked.ids == ("img-b", "text", "img-a")
    assert picked.media_inputs == (batch.media_inputs[3], None, batch.media_inputs[1])
    assert picked.media_kwargs()["pixel_values"][:, 0].tolist() == [2.0] * 4 + [1.0] * 8
    # A micro-batch of text-only rows carries no media at all.
    assert batch.select([0]).media_inputs == ()
    first, second = batch.split(2)
    assert first.media_inputs == batch.media_inputs[:2]
    assert second.media_inputs == batch.media_inputs[2:]
    replaced = batch.replace(old_logprobs=torch.zeros(batch.input_ids.shape))
    assert replaced.media_inputs == batch.media_inputs


def test_to_moves_media_and_moves_a_shared_tensor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = image(4, 3.0)
    batch = TrainBatch.from_rows([row(f"g{i}", 4 + i, shared) for i in range(4)])
    moves: list[Tensor] = []

    def move(self: Tensor, *args: object, **kwargs: object) -> Tensor:
        # A copy stands for a transfer to another device (the CPU has no other device).
        moves.append(self)
        return self.clone()

    monkeypatch.setattr(Tensor, "to", move)
    moved = batch.to("elsewhere")
    monkeypatch.undo()
    entries = [m for m in moved.media_inputs if m is not None]
    assert len(entries) == 4
    assert all(m["pixel_values"] is not shared["pixel_values"] for m in entries)
    # The group's rows still share one moved tensor (not one copy per row).
    assert len({id(m["pixel_values"]) for m in entries}) == 1
    assert sum(t is shared["pixel_values"] for t in moves) == 1
    # The forward inputs repeat the item once per row: each row shows the model its prompt.
    assert moved.media_kwargs()["pixel_values"].shape == (16, 6)


def test_audio_features_of_different_lengths_are_right_padded_with_a_masked_tail() -> None:
    batch = TrainBatch.from_rows([row("a", 3, audio(4, width=6)), row("b", 3, audio(5, width=9))])
    kwargs = batch.media_kwargs()
    assert kwargs["input_features"].shape == (2, 3, 9)
    assert kwargs["feature_attention_mask"].sum(-1).tolist() == [4, 5]
    assert kwargs["input_features"][0, :, 6:].abs().sum() == 0


def test_items_of_different_shapes_are_refused_by_name() -> None:
    odd = {"pixel_values": torch.ones(4, 7), "image_grid_thw": torch.tensor([[1, 1, 4]])}
    batch = TrainBatch.from_rows([row("a", 3, image(4, 1.0)), row("b", 3, odd)])
    with pytest.raises(ValueError, match="'pixel_values'"):
        batch.media_kwargs()


def test_construction_checks_one_media_entry_per_row() -> None:
    batch = TrainBatch.from_rows(mixed_rows())
    with pytest.raises(ValueError, match="3 media_inputs for 4 rows"):
        batch.replace(media_inputs=batch.media_inputs[:3])
    with pytest.raises(ValueError, match="must be tensors"):
        batch.replace(media_inputs=(None, {"pixel_values": [1.0]}, None, None))
    scoring = TrainBatch.for_scoring([[1, 2, 3], [4, 5]], media_inputs=[None, image(4, 1.0)])
    assert scoring.media_inputs[0] is None
    assert scoring.media_inputs[1] is not None
    with pytest.raises(ValueError, match="1 media_inputs for 2 sequences"):
        TrainBatch.for_scoring([[1, 2, 3], [4, 5]], media_inputs=[None])


def test_batch_from_trajectories_drops_the_media_of_excluded_trajectories() -> None:
    trajs = []
    for i, stop in enumerate(["stop", "engine_error", "stop"]):
        builder = TrajectoryBuilder([10, 11])
        builder.add_sampled([20 + i, 21], [-0.5, -0.5], 0)
        traj = builder.build(TrajectoryMeta(episode_id=f"e{i}", group_id="g"))
        traj.reward = float(i)
        traj.meta.stop_reason = stop  # type: ignore[assignment]
        trajs.append(traj)
    media = [image(4, 1.0), image(4, 2.0), image(4, 3.0)]
    batch, _ = batch_from_trajectories(trajs, AdvantageConfig(), media_inputs=media)
    assert batch.media_inputs == (media[0], media[2])
