"""bench/side_by_side.py's variants, and the CPU sampler it shares with services_overhead.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import side_by_side  # noqa: E402
from services_overhead import CpuSampler  # noqa: E402


def test_a_variant_splits_into_overrides_and_environment() -> None:
    name, overrides, env = side_by_side.parse_variant(
        "quiet=services.mode=services,ENV:RAY_event_stats=0,trainer.lr=1e-3"
    )
    assert name == "quiet"
    assert overrides == ["services.mode=services", "trainer.lr=1e-3"]
    assert env == {"RAY_event_stats": "0"}
    assert side_by_side.parse_variant("plain=") == ("plain", [], {})


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("steps", "'steps': write NAME=SETTING"),
        ("=trainer.lr=1", "'=trainer.lr=1': write NAME=SETTING"),
        ("a=steps", "'steps' is not a dotted KEY=VALUE"),
        ("a=ENV:FLAG", "'ENV:FLAG' is not ENV:NAME=VALUE"),
    ],
)
def test_a_malformed_variant_is_refused_with_the_setting_named(text: str, named: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(named)):
        side_by_side.parse_variant(text)


def test_an_ended_child_counts_as_its_parent_s_children() -> None:
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    with CpuSampler(period_s=0.2) as sampler:
        time.sleep(0.5)
        started = time.time()
        subprocess.run([sys.executable, "-c", burn], check=True)
        time.sleep(0.5)
        spent = sampler.between(started - 0.3, time.time())
    assert spent.get("driver children", 0.0) >= 0.25, spent
