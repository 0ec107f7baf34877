"""The data plane's field schema and micro-batch assembly, without a queue behind them."""

from __future__ import annotations

import pytest
import torch

from omniloop.config import load_config
from omniloop.errors import ConfigError
from omniloop.platform.data import FIELDS, ROLLOUT_FIELDS, DataPlaneConfig, MicroBatch
from omniloop.platform.data.base import (
    Row,
    decode_json,
    encode_json,
    encode_scalars,
    encode_tokens,
    field_spec,
    partition_id,
    rollout_values,
)
from omniloop.trajectory import TrajectoryBuilder, TrajectoryMeta


def test_every_trajectory_field_of_the_contract_is_registered() -> None:
    for name in (*ROLLOUT_FIELDS, "reward", "reward_info", "ref_logprobs", "old_logprobs"):
        assert name in FIELDS
    for name in ("values", "advantages", "returns"):
        assert FIELDS[name].kind == "tokens"


def test_rollout_values_cover_the_rollout_fields_in_row_order() -> None:
    builder = TrajectoryBuilder([5, 6])
    builder.add_sampled([7, 8], [-0.5, -0.25], version=2)
    traj = builder.build(TrajectoryMeta(episode_id="e"))
    values = rollout_values([traj, traj])
    assert set(values) == set(ROLLOUT_FIELDS)
    assert values["input_ids"] == [[5, 6, 7, 8]] * 2
    assert values["weight_version"][0] == [-1, -1, 2, 2]
    assert values["prompt_length"] == [2, 2]


def test_field_spec_needs_a_kind_for_new_fields_and_keeps_registered_ones() -> None:
    assert field_spec("reward").kind == "scalar"
    assert field_spec("reward", "scalar") is FIELDS["reward"]
    assert field_spec("draft_logprobs", "tokens").dtype == torch.float32
    with pytest.raises(ValueError, match="not one of the known fields"):
        field_spec("draft_logprobs")
    with pytest.raises(ValueError, match="stored as 'tokens'"):
        field_spec("advantages", "scalar")


def test_encoders_reject_values_that_do_not_fit_the_kind() -> None:
    assert encode_tokens([[1, 2], []], torch.int64)[1].shape == (0,)
    with pytest.raises(ValueError, match="1-D"):
        encode_tokens([[[1, 2]]], torch.int64)
    assert encode_scalars([1, 2.5, torch.tensor(3.0)], torch.float32).tolist() == [1, 2.5, 3]
    with pytest.raises(ValueError, match="None"):
        encode_scalars([None], torch.float32)
    with pytest.raises(ValueError, match="one number"):
        encode_scalars([[1.0, 2.0]], torch.float32)


def test_json_round_trips_models_and_nan() -> None:
    meta = TrajectoryMeta(episode_id="e", metrics={"x": float("nan")})
    (decoded,) = decode_json(encode_json([meta]))
    assert decoded["episode_id"] == "e"
    assert decoded["metrics"]["x"] != decoded["metrics"]["x"]  # NaN survives


def test_micro_batch_stacks_scalars_and_keeps_per_row_lists() -> None:
    rows = [
        Row("a", {"reward": torch.tensor(1.0), "input_ids": torch.tensor([1, 2]), "meta": {}}),
        Row("b", {"reward": torch.tensor(2.0), "input_ids": torch.tensor([3]), "meta": {"k": 1}}),
    ]
    mb = MicroBatch.from_rows(4, "actor", rows, ["reward", "input_ids", "meta"])
    assert len(mb) == 2
    assert mb.ids == ["a", "b"]
    assert mb["reward"].tolist() == [1.0, 2.0]
    assert [t.tolist() for t in mb["input_ids"]] == [[1, 2], [3]]
    assert mb["meta"] == [{}, {"k": 1}]


def test_partition_names_follow_the_step() -> None:
    assert partition_id(0) == "step_0"
    assert partition_id(12) == "step_12"
    with pytest.raises(ValueError):
        partition_id(-1)


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    assert DataPlaneConfig().num_cpus == 8
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(DataPlaneConfig, None, ["num_gpus=1"])
    with pytest.raises(ConfigError):
        load_config(DataPlaneConfig, None, ["max_poll_interval_s=0"])
    with pytest.raises(ConfigError, match=r"min_poll_interval_s=0.1 is above max_poll_interval"):
        load_config(DataPlaneConfig, None, ["min_poll_interval_s=0.1"])
