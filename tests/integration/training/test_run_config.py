"""`RunConfig` and the run's data position: what a user gets wrong is refused with a fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omniloop.agents.base import Task
from omniloop.config import load_config
from omniloop.errors import ConfigError
from omniloop.platform.control.local import step_tasks
from omniloop.platform.control.run_config import RunConfig, config_yaml

REPO = Path(__file__).resolve().parents[3]
CONFIGS = [
    REPO / "examples" / "toy_tool" / "train.yaml",
    REPO / "examples" / "calculator" / "train.yaml",
    REPO / "examples" / "omni" / "train.yaml",
    REPO / "examples" / "omni" / "learn.yaml",
]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_example_configs_load_and_their_saved_form_loads_again(path: Path, tmp_path: Path) -> None:
    config = load_config(RunConfig, path, [f"run_dir={tmp_path}"])
    assert Path(config.rollout.tasks).is_file()
    saved = tmp_path / "config.yaml"
    saved.write_text(config_yaml(config))
    again = load_config(RunConfig, saved, ["seed=3"])
    assert again.rollout.seed == 3
    assert again.rollout.engine.model == config.model
    assert again.model_dump(exclude={"seed", "rollout"}) == config.model_dump(
        exclude={"seed", "rollout"}
    )


def test_fields_the_run_owns_cannot_be_set_to_something_else(tmp_path: Path) -> None:
    path = CONFIGS[0]
    with pytest.raises(ConfigError, match=r"rollout\.engine\.model is set by the run"):
        load_config(RunConfig, path, ["model=tiny", "rollout.engine.model=smollm2"])
    with pytest.raises(ConfigError, match=r"rollout\.seed is set by the run"):
        load_config(RunConfig, path, ["seed=1", "rollout.seed=2"])
    with pytest.raises(ConfigError, match=r"rollout\.output is set by the run"):
        load_config(RunConfig, path, [f"run_dir={tmp_path}", "rollout.output=elsewhere"])
    with pytest.raises(ConfigError, match=r"rollout\.run_id is set by the run"):
        load_config(RunConfig, path, ["rollout.run_id=mine"])
    config = load_config(RunConfig, path, ["run_id=mine"])
    assert config.rollout.run_id == "mine"


def test_a_group_of_one_sample_is_refused() -> None:
    with pytest.raises(ConfigError, match="samples_per_task must be at least 2"):
        load_config(RunConfig, CONFIGS[0], ["rollout.samples_per_task=1"])


def test_unknown_keys_name_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"valid keys here:.*max_staleness"):
        load_config(RunConfig, CONFIGS[0], ["max_stalenes=2"])


@pytest.mark.parametrize("value", ["-1", "1.5", "infinite"])
def test_max_staleness_is_a_non_negative_integer_or_inf(value: str) -> None:
    with pytest.raises(ConfigError):
        load_config(RunConfig, CONFIGS[0], [f"max_staleness={value}"])
    assert load_config(RunConfig, CONFIGS[0], ["max_staleness=inf"]).max_staleness == "inf"


def test_stale_samples_are_corrected_by_truncated_importance_sampling_unless_told_not_to(
    tmp_path: Path,
) -> None:
    def tis_cap(*overrides: str) -> float | None:
        return load_config(RunConfig, CONFIGS[0], list(overrides)).trainer.loss.tis_cap

    assert tis_cap("max_staleness=0") is None
    assert tis_cap("max_staleness=1") == tis_cap("max_staleness=inf") == 2.0
    assert tis_cap("max_staleness=2", "trainer.loss.tis_cap=null") is None
    assert tis_cap("max_staleness=2", "trainer.loss.tis_cap=3") == 3.0
    # The saved config holds the cap, so a resumed run keeps it.
    saved = tmp_path / "config.yaml"
    saved.write_text(config_yaml(load_config(RunConfig, CONFIGS[0], ["max_staleness=2"])))
    assert load_config(RunConfig, saved, ["max_staleness=0"]).trainer.loss.tis_cap == 2.0


def test_tasks_cycle_by_data_position() -> None:
    tasks = [Task(id=str(i), prompt=str(i)) for i in range(5)]
    steps = [[t.id for t in step_tasks(tasks, k, 2)] for k in range(4)]
    assert steps == [["0", "1"], ["2", "3"], ["4", "0"], ["1", "2"]]
    with pytest.raises(ValueError, match="holds only 5"):
        step_tasks(tasks, 0, 6)


def test_saved_config_omits_only_the_derived_fields(tmp_path: Path) -> None:
    config = load_config(RunConfig, CONFIGS[0], [f"run_dir={tmp_path}"])
    saved = yaml.safe_load(config_yaml(config))
    assert "seed" not in saved["rollout"]
    assert "output" not in saved["rollout"]
    assert "run_id" not in saved["rollout"]
    assert "model" not in saved["rollout"]["engine"]
    assert saved["max_staleness"] == config.max_staleness
