"""The engine's Prometheus series (`GET /metrics`), read from its core at scrape time.

Counters since the engine started: `omniloop_engine_requests_total{finish}` (requests
answered, by finish type: `stop`, `length`, `abort`), `omniloop_engine_prompt_tokens_total`,
`omniloop_engine_generation_tokens_total`, `omniloop_engine_cached_tokens_total` (prompt
tokens served from the prefix cache) and `omniloop_engine_forward_passes_total`. Gauges:
`omniloop_engine_running_requests`, `omniloop_engine_waiting_requests`,
`omniloop_engine_weight_version` and `omniloop_engine_paused` (1 while generation is paused).

The scheduler thread writes these numbers while a scrape reads them, with no lock: a scrape
may see a request counted and its tokens not yet, and a forward pass is counted once it has
completed, which may be just after the requests it answered got their responses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from omniloop.inference.core import EngineCore

FINISH_TYPES = ("stop", "length", "abort")


class EngineCollector:
    """Collects the series of the module docstring from `core`."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def collect(self) -> Iterable[Metric]:
        core = self._core
        requests = CounterMetricFamily(
            "omniloop_engine_requests", "Requests answered, by finish type.", labels=["finish"]
        )
        for kind in FINISH_TYPES:
            requests.add_metric([kind], core.finished[kind])
        yield requests

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"omniloop_engine_{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"omniloop_engine_{name}", doc, value=value)

        yield counter("prompt_tokens", "Prompt tokens of answered requests.", core.prompt_tokens)
        yield counter(
            "generation_tokens", "Tokens sampled for answered requests.", core.generated_tokens
        )
        yield counter(
            "cached_tokens", "Prompt tokens served from the prefix cache.", core.cached_tokens
        )
        yield counter("forward_passes", "Forward passes completed.", core.forward_passes)
        yield gauge("running_requests", "Requests being generated.", core.running)
        yield gauge("waiting_requests", "Requests queued for admission.", core.waiting)
        yield gauge("weight_version", "Version of the weights loaded.", core.weight_version)
        yield gauge("paused", "1 while generation is paused.", float(core.paused))


def engine_registry(core: EngineCore) -> CollectorRegistry:
    """A registry of `core`'s series (one per app: nothing global)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(core))
    return registry
