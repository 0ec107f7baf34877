"""The calculator example end to end on the docker backend: `omniloop rollout` with the real
tiny engine over HTTP, each episode's `python` call run in a hardened container."""

from __future__ import annotations

import json
from pathlib import Path

from omniloop.config import load_config
from omniloop.platform.control.rollout import run_rollout, summarize
from omniloop.platform.control.rollout_config import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator"


async def test_calculator_example_runs_end_to_end_on_docker(
    tmp_path: Path, tiny_engine_url: str, sandbox_image: str
) -> None:
    # The example's own config, agent and tasks; only the model, the engine and sampling that
    # keeps the random tiny model's turns short are overridden. The prefill hands the model the
    # task's whole call (it cannot write one), so every episode runs code in a container.
    prefill = tmp_path / "agent.py"
    prefill.write_text(
        "import json\n"
        "from omniloop import ToolAgent\n"
        "from omniloop.tools import python\n"
        "def call(task):\n"
        "    code = 'print(' + task.metadata['expression'] + ')'\n"
        "    args = {'name': 'python', 'arguments': {'code': code}}\n"
        "    return '<tool_call>\\n' + json.dumps(args) + '\\n</tool_call>\\n'\n"
        "def build_agent():\n"
        "    return ToolAgent([python], prefill=call)\n"
    )
    config = load_config(
        RolloutConfig,
        EXAMPLE / "config.yaml",
        [
            f"agent={prefill}:build_agent",
            f"engine.url={tiny_engine_url}",
            "engine.model=tiny",
            "sandbox.backend=docker",
            f"sandbox.image={sandbox_image}",
            "sandbox.pool_size=2",
            "sampling.temperature=0",
            "sampling.max_new_tokens=8",
            "sampling.stop_token_ids=[198]",
            "num_tasks=4",
            "concurrency=4",
            f"output={tmp_path / 'trajectories.jsonl'}",
        ],
    )
    trajectories = await run_rollout(config)

    assert len(trajectories) == 4
    assert summarize(trajectories)["errors"] == 0
    tasks = {
        t["id"]: t for t in map(json.loads, (EXAMPLE / "tasks.jsonl").read_text().splitlines()[:4])
    }
    for traj in trajectories:
        assert traj.meta.error is None, traj.meta.error
        call = traj.meta.tool_calls[0]
        assert call.error is None, call
        # The container computed the task's answer.
        assert call.output.strip() == tasks[traj.meta.task_id]["answer"]
