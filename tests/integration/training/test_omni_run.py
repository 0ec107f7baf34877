"""A training run on the toy omni task, end to end through the role services: images, audio
and video in the prompts and in tool results travel from the rollout (the real CPU engine
serving the tiny Qwen2.5-Omni thinker over HTTP) through TransferQueue to the torch trainer,
whose weights go back to the engine after every step.

What this checks is the plumbing, not learning: every episode's media are placed where their
blocks sit, the engine samples with them (no `media_error`, no engine error), every trained
row is trained once, and the per-modality metrics are recorded. The rollout sends media as
SGLang's `processor_output` dicts here (`rollout.engine.media_form`); the learning tests send
files.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omniloop.config import load_config
from omniloop.inference.models import load_tokenizer
from omniloop.modalities import MediaStore
from omniloop.modalities.media import MediaPlacement
from omniloop.platform.control.metrics import read_jsonl
from omniloop.platform.control.run import run
from omniloop.platform.control.run_config import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "omni" / "train.yaml"
AGENTS = Path(__file__).with_name("omni_agents.py")
STEPS = 3


@pytest.fixture(scope="module")
def omni_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("omni")
    overrides = [
        f"run_dir={run_dir}",
        f"database=sqlite:///{run_dir}/omniloop.db",
        "tensorboard=false",
        f"steps={STEPS}",
        f"checkpoint_every={STEPS}",
        f"rollout.agent={AGENTS}:build",
        "rollout.sampling.max_new_tokens=6",
        "rollout.samples_per_task=2",
        "tasks_per_step=6",
        "rollout.engine.media_form=processor_output",
    ]
    config = load_config(RunConfig, CONFIG, overrides)
    asyncio.run(run(config))
    return run_dir


def test_media_of_prompts_and_tool_results_reach_the_trainer(omni_run: Path) -> None:
    tokenizer = load_tokenizer("tiny-omni")
    pads = {
        "image": tokenizer.image_token_id,
        "audio": tokenizer.audio_token_id,
        "video": tokenizer.video_token_id,
    }
    store = MediaStore(omni_run / "media")
    steps = [omni_run / "trajectories" / f"step_{step}.jsonl" for step in range(STEPS)]
    trajectories = [t for path in steps for t in read_jsonl(path)]
    assert len(trajectories) == STEPS * 12
    kinds = set()
    for traj in trajectories:
        meta = traj["meta"]
        assert meta["stop_reason"] in ("stop", "length", "max_turns"), meta.get("error")
        assert len(meta["turns"]) == 1
        task_kind = meta["task"]["metadata"]["kind"]
        placed = [MediaPlacement.model_validate(e) for e in traj["multimodal"]]
        # The prompt's item, then the tool's (a spectrogram is a picture of the audio).
        tool_kind = "image" if task_kind in ("image", "audio") else "video"
        assert [p.kind for p in placed] == [task_kind, tool_kind]
        assert placed[0].offset < traj["prompt_length"] < placed[1].offset
        assert placed[1].offset < meta["turns"][0]["start"]  # sampled with both items
        for p in placed:
            run_ids = traj["input_ids"][p.offset : p.offset + p.tokens]
            assert run_ids == [pads[p.kind]] * p.tokens
            assert traj["input_ids"][p.offset + p.tokens] != pads[p.kind]
            assert store.read(p.media)  # stored once, readable by the trainer
        kinds.add(task_kind)
    assert kinds == {"image", "audio", "video"}


def test_every_row_is_trained_once_and_media_metrics_are_recorded(omni_run: Path) -> None:
    trained = read_jsonl(omni_run / "trained.jsonl")
    ids = [sample[0] for step in trained for sample in step["samples"]]
    assert len(ids) == len(set(ids)) == STEPS * 12
    metrics = read_jsonl(omni_run / "metrics.jsonl")
    assert len(metrics) == STEPS
    for step in metrics:
        assert step["episodes/errors"] == 0
        for kind in ("image", "audio", "video"):
            assert step[f"media/{kind}"] > 0
            assert step[f"media/{kind}_tokens"] >= step[f"media/{kind}"]
        assert step["weight_sync/engines"] == 1
