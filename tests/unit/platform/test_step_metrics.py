"""`step_metrics`: episodes' counters summed per step, and the gateway's prefix stability as
the step's stable calls over its resent calls (a ratio summed over episodes would mean
nothing)."""

from __future__ import annotations

from omniloop.platform.control.controller import EpisodeSummary
from omniloop.platform.control.metrics import step_metrics


def summary(reward: float, **metrics: float) -> EpisodeSummary:
    return EpisodeSummary(
        id="e", reward=reward, infra_failure=False, stop_reason="stop", response_length=3,
        turns=1, sampled_tokens=3, metrics=metrics,
    )  # fmt: skip


def test_counters_are_summed_and_prefix_stability_is_a_ratio_of_sums() -> None:
    episodes = [
        summary(1.0, **{"gateway/calls": 3, "gateway/resent_calls": 2, "gateway/stable_calls": 2}),
        summary(0.0, **{"gateway/calls": 4, "gateway/resent_calls": 3, "gateway/stable_calls": 1}),
        summary(0.5, **{"tool_calls/total": 2}),
    ]
    out = step_metrics(episodes)
    assert out["gateway/calls"] == 7
    assert out["tool_calls/total"] == 2
    assert out["gateway/prefix_stability"] == 3 / 5
    assert out["reward/mean"] == 0.5


def test_no_resent_call_means_no_prefix_stability() -> None:
    out = step_metrics([summary(1.0, **{"gateway/calls": 1, "gateway/resent_calls": 0})])
    assert "gateway/prefix_stability" not in out
