"""On-policy distillation: a teacher role scores every token the policy samples, and the policy,
trained on the teacher's signal alone (`reward_weight: 0`), moves toward it.

The student is the toy task's warm-started model, which names a direction about uniformly; the
teacher is the same model trained further, on calls that always name `east` (where the treasure
lies). The run never trains on the reward: it rises only because the student's sampled tokens
are pushed toward the teacher's logprobs. The teacher is a role of its own (a Ray Serve
deployment), like the reference.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.trainer.warm_start import supervised_warm_start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOY = Path(__file__).resolve().parents[3] / "examples" / "toy_tool"
STEPS = 14
TASKS_PER_STEP = 4
SAMPLES = 8


@pytest.fixture(scope="module")
def teacher(toy_model: Path, example_script: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm-started model trained on its call format with `east` as the only direction
    (a few steps: every other direction about e^-6 as likely as `east`, not impossible, so
    that the sampled per-token signal stays moderate)."""
    warm_start = example_script(TOY, "warm_start")
    examples = warm_start.format_examples(warm_start.load_tasks(str(TOY / "tasks.jsonl")))
    east = [row for row in examples if row.id.endswith("/east")]
    out = tmp_path_factory.mktemp("teacher") / "model"
    return supervised_warm_start(str(toy_model), east, out, steps=6, batch_size=8, lr=1e-2)


@pytest.fixture(scope="module")
def metrics(toy_config: Any, teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> list:
    run_dir = tmp_path_factory.mktemp("distill")
    config = toy_config(
        run_dir,
        {
            "steps": STEPS,
            "tasks_per_step": TASKS_PER_STEP,
            "rollout.samples_per_task": SAMPLES,
            "checkpoint_every": STEPS,
            "services.mode": "services",
            "services.api": False,
            "trainer.teacher": {"model": str(teacher), "coef": 1.0, "reward_weight": 0.0},
        },
    )
    asyncio.run(run(config))
    return read_jsonl(run_dir / "metrics.jsonl")


def test_the_teacher_role_scores_every_row_of_every_step(metrics: list) -> None:
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["teacher/rows"] == TASKS_PER_STEP * SAMPLES for m in metrics)


def test_the_student_moves_toward_the_teacher(metrics: list) -> None:
    gaps = [m["teacher/reverse_kl"] for m in metrics]
    rewards = [m["reward/mean"] for m in metrics]
    assert sum(gaps[-3:]) < 0.6 * sum(gaps[:3]), gaps
    # Trained on the teacher's signal alone, the student finds the treasure as the teacher
    # does: from about 1 in 8 (any direction) to most of the time.
    assert sum(rewards[:2]) / 2 <= 0.35, rewards
    assert max(sum(rewards[k : k + 3]) / 3 for k in range(STEPS - 2)) >= 0.5, rewards
