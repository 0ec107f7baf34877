"""The teacher of on-policy distillation: its rows' advantages, and the check of its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omniloop.errors import ConfigError
from omniloop.platform.control.local import scoring_roles, train_fields, train_rows
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.run import check_teacher
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.data import MicroBatch
from omniloop.trainer.config import LossConfig, TeacherConfig, TrainerConfig


def _config(teacher: str | None, **trainer: object) -> RunConfig:
    return RunConfig(
        model="tiny",
        rollout=RolloutConfig(tasks="unused.jsonl", agent="unused.py:agent", samples_per_task=2),
        trainer=TrainerConfig(
            teacher=TeacherConfig(model=teacher) if teacher else None,
            **trainer,  # type: ignore[arg-type]
        ),
    )


def _batch(with_teacher: bool) -> MicroBatch:
    fields = {
        "input_ids": [torch.tensor([1, 2, 3, 4])],
        "loss_mask": [torch.tensor([0, 0, 1, 1], dtype=torch.int8)],
        "rollout_logprobs": [torch.tensor([0.0, 0.0, -1.5, -1.0])],
        "weight_version": [torch.tensor([-1, -1, 0, 0], dtype=torch.int32)],
        "prompt_length": torch.tensor([2]),
        "advantages": [torch.tensor([0.0, 0.0, 1.0, 1.0])],
        "multimodal": [[]],
        "meta": [{"stop_reason": "stop"}],
    }
    if with_teacher:
        fields["teacher_logprobs"] = [torch.tensor([0.0, -3.0, -1.0, -2.0])]
    return MicroBatch(step=0, consumer="actor", ids=["a"], fields=fields)


def test_the_actor_trains_on_the_reward_and_the_teacher_s_signal() -> None:
    teacher = TeacherConfig(model="tiny", coef=0.5, reward_weight=2.0)
    [row] = train_rows(_batch(True), None, teacher)
    torch.testing.assert_close(row.advantages, torch.tensor([0.0, 0.0, 2.25, 1.5]))
    [plain] = train_rows(_batch(False))
    torch.testing.assert_close(plain.advantages, torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_a_teacher_is_a_role_and_the_actor_waits_for_its_logprobs() -> None:
    assert scoring_roles(_config(None)) == []
    assert "teacher_logprobs" not in train_fields(_config(None))
    both = _config("tiny", loss=LossConfig(kl_coef=0.1), reference="external")
    assert scoring_roles(both) == ["reference", "teacher"]
    assert {"ref_logprobs", "teacher_logprobs"} <= set(train_fields(both))


def test_a_teacher_of_another_vocabulary_is_refused_by_name(tmp_path: Path) -> None:
    check_teacher(_config(None))
    check_teacher(_config("tiny"))
    with pytest.raises(ConfigError, match=r"trainer.teacher.model='tiny-omni' has another vocab"):
        check_teacher(_config("tiny-omni"))
    with pytest.raises(ConfigError, match=r"trainer.teacher.model='.*nowhere' cannot be loaded"):
        check_teacher(_config(str(tmp_path / "nowhere")))
