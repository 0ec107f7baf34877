"""End to end: the tiny model in the CPU engine over HTTP, bubblewrap sandboxes, rewards,
through `omniloop rollout` → trajectories on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omniloop.config import load_config
from omniloop.platform.control.rollout import run_rollout, summarize
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.trajectory import Trajectory

HERE = Path(__file__).parent


def write_config(tmp_path: Path, engine_url: str, **extra: object) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "prompt": f"What is 6 * 7? ({i})", "answer": "42"}) + "\n"
            for i in range(6)
        )
    )
    config = {
        "tasks": str(tasks),
        "agent": f"{HERE / 'agent_fixture.py'}:build_agent",
        "rewards": [f"{HERE / 'agent_fixture.py'}:tool_said_42"],
        "engine": {"url": engine_url, "model": "tiny"},
        "sandbox": {"backend": "bwrap", "pool_size": 2, "limits": {"timeout": 10}},
        # The random tiny model, greedy, repeats the prompt's last token (here the newline
        # that ends the prefill and the generation prompt); stopping on it ends each turn.
        "sampling": {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [198]},
        "max_turns": 2,
        "samples_per_task": 2,
        "concurrency": 4,
        "output": str(tmp_path / "out" / "trajectories.jsonl"),
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


async def test_rollout_runs_real_tools_in_real_sandboxes(tmp_path, tiny_engine_url):
    config = load_config(RolloutConfig, write_config(tmp_path, tiny_engine_url))
    trajectories = await run_rollout(config)

    assert len(trajectories) == 12
    assert len({t.id for t in trajectories}) == 12
    for traj in trajectories:
        traj.check()
        assert traj.meta.error is None, traj.meta.error
        assert traj.meta.stop_reason == "stop"
        assert traj.meta.tool_calls, "the prefilled call must have run"
        assert traj.meta.tool_calls[0].output.strip() == "42"
        assert traj.reward == 1.0
        # The engine sampled every mask-1 token, with its logprob and version.
        sampled = [i for i, m in enumerate(traj.loss_mask) if m]
        assert sampled
        assert all(traj.rollout_logprobs[i] < 0 for i in sampled)
        assert all(traj.weight_version[i] == 0 for i in sampled)
        assert traj.meta.timings["total"] > 0
    on_disk = [
        Trajectory.model_validate_json(line)
        for line in Path(config.output).read_text().splitlines()
    ]
    assert sorted(t.id for t in on_disk) == sorted(t.id for t in trajectories)
    summary = summarize(trajectories)
    assert summary["errors"] == 0
    assert summary["reward_mean"] == 1.0


def test_rollout_cli_writes_jsonl_and_prints_a_summary(tmp_path, tiny_engine_url):
    path = write_config(tmp_path, tiny_engine_url)
    proc = subprocess.run(
        [sys.executable, "-m", "omniloop", "rollout", str(path), "num_tasks=2"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 4
    assert summary["errors"] == 0
    assert "sandbox backend: bwrap" in proc.stderr
    lines = (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_rollout_cli_rejects_unknown_keys_with_the_valid_ones(tmp_path, tiny_engine_url):
    path = write_config(tmp_path, tiny_engine_url)
    proc = subprocess.run(
        [sys.executable, "-m", "omniloop", "rollout", str(path), "sampling.temprature=0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "sampling.temprature: unknown key" in proc.stderr
    assert "temperature" in proc.stderr


@pytest.mark.parametrize("line", ['{"prompt": "no id"}', "not json"])
def test_bad_task_lines_are_reported_with_their_line_number(tmp_path, line):
    from omniloop.errors import ConfigError
    from omniloop.platform.control.components import load_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "a", "prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=r"tasks.jsonl:2"):
        load_tasks(str(path))
