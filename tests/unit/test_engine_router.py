"""`EngineRouter`'s choice of engine for a new session, on fake engine clients."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from omniloop.errors import EngineError
from omniloop.http_client import HttpTransportError
from omniloop.inference import router as router_module
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.router import EngineRouter

SAMPLING = SamplingParams(max_new_tokens=1)
ANSWER = GenerateOutput(
    output_ids=[1], output_logprobs=[0.0], finish_reason="length", weight_version=0
)


class _Engine:
    """Answers every request at once, or cannot be reached while `down`."""

    def __init__(self) -> None:
        self.down = False
        self.requests = 0

    async def generate(
        self, input_ids: list[int], *_args: object, **_kwargs: object
    ) -> GenerateOutput:
        if self.down:
            raise EngineError("no answer") from HttpTransportError("connection refused")
        self.requests += 1
        return ANSWER


def _router(urls: Sequence[str]) -> tuple[EngineRouter, dict[str, _Engine]]:
    engines = {url: _Engine() for url in urls}
    router = EngineRouter.over(urls, wait_s=5.0)
    router._client = engines.__getitem__  # type: ignore[method-assign]
    return router, engines


async def _start(router: EngineRouter, key: str) -> str | None:
    await router.session(key).generate([1, 2, 3], SAMPLING)
    return router.engine_of(key)


async def test_a_new_session_goes_to_the_engine_that_holds_the_fewest_sessions() -> None:
    router, _ = _router(["http://a", "http://b"])
    assert [await _start(router, f"s{i}") for i in range(4)] == ["http://a", "http://b"] * 2
    # A later request of a session stays on its engine and adds no session to it.
    assert await _start(router, "s0") == "http://a"
    assert await _start(router, "s4") == "http://a"
    assert await _start(router, "s5") == "http://b"


async def test_forgotten_sessions_no_longer_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "MAX_SESSIONS", 2)
    router, _ = _router(["http://a", "http://b"])
    assert await _start(router, "s0") == "http://a"
    assert await _start(router, "s1") == "http://b"
    assert await _start(router, "s2") == "http://a"  # a tie, a listed first; s0 forgotten
    assert router.engine_of("s0") is None
    assert await _start(router, "s3") == "http://a"  # one each: a tie again; s1 forgotten
    assert await _start(router, "s4") == "http://b"  # a holds s2 and s3, b none


async def test_a_session_that_moves_counts_on_its_new_engine_only() -> None:
    router, engines = _router(["http://a", "http://b"])
    assert await _start(router, "s0") == "http://a"
    assert await _start(router, "s1") == "http://b"
    engines["http://a"].down = True
    assert await _start(router, "s0") == "http://b"  # a set aside: s0 moves to b
    engines["http://a"].down = False
    router._aside.clear()  # a is back
    # b holds both sessions and a none: the next three go to a (the third on a tie, a being
    # listed first), then one to b.
    assert [await _start(router, f"s{i}") for i in (2, 3, 4, 5)] == [
        "http://a",
        "http://a",
        "http://a",
        "http://b",
    ]
