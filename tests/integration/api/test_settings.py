"""`ApiSettings`: a server whose configuration cannot work refuses to start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omniloop.errors import ConfigError
from omniloop.platform.api import ApiSettings
from omniloop.platform.api.app import create_app


def test_agent_defaults_must_fit_the_servers_limits():
    agent = {"agent": "x.py:a", "sampling": {"max_new_tokens": 512}, "max_turns": 4}
    with pytest.raises(ValidationError, match=r"over limits\.max_new_tokens 256"):
        ApiSettings(agents={"a": agent}, limits={"max_new_tokens": 256})
    with pytest.raises(ValidationError, match=r"max_turns 4 is over limits\.max_turns 2"):
        ApiSettings(agents={"a": agent}, limits={"max_turns": 2})
    with pytest.raises(ValidationError, match="agent name"):
        ApiSettings(agents={"bad name": agent})


def test_an_agent_that_cannot_be_imported_stops_the_server_before_it_starts(tmp_path):
    settings = ApiSettings(
        db_url=f"sqlite:///{tmp_path / 'x.db'}",
        agents={"ghost": {"agent": f"{tmp_path / 'missing.py'}:build"}},
    )
    with pytest.raises(ConfigError, match="agent 'ghost'"):
        create_app(settings)


def test_config_file_paths_are_relative_to_the_file(tmp_path):
    from omniloop.config import load_config

    (tmp_path / "api.yaml").write_text(
        "agents:\n"
        "  a:\n"
        "    agent: agents/mine.py:build\n"
        "    rewards: [rewards.py:score, exact_match]\n"
    )
    settings = load_config(ApiSettings, tmp_path / "api.yaml")
    assert settings.agents["a"].agent == f"{tmp_path / 'agents/mine.py'}:build"
    assert settings.agents["a"].rewards == [f"{tmp_path / 'rewards.py'}:score", "exact_match"]


def test_the_example_server_config_loads_its_agent(tmp_path):
    from pathlib import Path

    from omniloop.config import load_config
    from omniloop.platform.api.worker import load_agents

    example = Path(__file__).parents[3] / "examples" / "calculator" / "serve.yaml"
    settings = load_config(ApiSettings, example, [f"db_url=sqlite:///{tmp_path / 'x.db'}"])
    loaded = load_agents(settings)
    assert sorted(loaded) == ["calculator"]
    assert loaded["calculator"].agent.tool_schemas[0]["function"]["name"] == "python"
