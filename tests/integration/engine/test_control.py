"""Control endpoints: pause/continue, weight updates from disk, health, model info, cache.

These tests share the session's engine, so each restores what it changes (generation
resumed, the original tiny weights loaded back) in a `finally`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from omniloop.inference.client import EngineClient, EngineHTTPError
from omniloop.inference.models import resolve_model

PROMPT = [1, 4093, 314, 260, 3575, 282, 4649, 47]
LONG = 480  # new tokens of a "long" request: enough decode steps to pause in the middle


def long_body(seed: int = 11) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": LONG,
            "temperature": 1.0,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }


async def post_generate(http: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def logprobs(result: Any) -> list[float]:
    return [t[0] for t in result["meta_info"]["output_token_logprobs"]]


async def timed_reference(http: httpx.AsyncClient, seed: int = 11) -> tuple[Any, float]:
    """The long request run alone, and how long it took."""
    start = time.perf_counter()
    out = await post_generate(http, long_body(seed))
    return out, time.perf_counter() - start


def save_random_tiny(folder: Path, seed: int, **changes: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(resolve_model("tiny"))
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with the same shapes as `tiny` and other random weights."""
    return save_random_tiny(tmp_path_factory.mktemp("tiny-other"), seed=1)


@pytest.fixture
async def restore_tiny(engine: EngineClient) -> Any:
    """Load the original tiny weights and version back after the test."""
    version = await engine.get_weight_version()
    yield version
    await engine.continue_generation()
    await engine.update_weights_from_disk(str(resolve_model("tiny")), weight_version=version)


async def test_pause_in_place_holds_requests_until_continue(
    http: httpx.AsyncClient, engine: EngineClient
) -> None:
    reference, duration = await timed_reference(http)
    running = asyncio.create_task(post_generate(http, long_body()))
    await asyncio.sleep(duration / 4)
    await engine.pause_generation("in_place")
    try:
        assert not running.done(), "the request finished before the pause; make LONG longer"
        late = asyncio.create_task(post_generate(http, long_body(seed=12) | {"rid": "late"}))
        # Far longer than the rest of the work would take: nothing may finish while paused.
        done, _ = await asyncio.wait({running, late}, timeout=max(1.0, 2 * duration))
        assert not done
        assert await engine.health_generate()
    finally:
        await engine.continue_generation()
    resumed = await running
    assert resumed["output_ids"] == reference["output_ids"]
    assert resumed["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert (await late)["meta_info"]["completion_tokens"] == LONG


async def test_pause_abort_ends_running_requests_with_partial_output(
    http: httpx.AsyncClient, engine: EngineClient
) -> None:
    reference, duration = await timed_reference(http)
    running = asyncio.create_task(post_generate(http, long_body()))
    await asyncio.sleep(duration / 4)
    try:
        response = await http.post("/pause_generation", json={"mode": "abort"})
        assert response.json() == {"message": "Generation paused successfully.", "status": "ok"}
        aborted = await asyncio.wait_for(running, timeout=30)
    finally:
        response = await http.post("/continue_generation")
        assert response.json()["status"] == "ok"
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert "pause_generation" in meta["finish_reason"]["message"]
    n = len(aborted["output_ids"])
    assert 0 < n < LONG
    assert aborted["output_ids"] == reference["output_ids"][:n]
    assert len(meta["output_token_logprobs"]) == n == meta["completion_tokens"]


async def test_update_weights_from_disk_changes_outputs_and_version(
    http: httpx.AsyncClient, engine: EngineClient, other_tiny: Path, restore_tiny: int
) -> None:
    v0 = restore_tiny
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 3},
        "return_logprob": True,
    }
    before = await post_generate(http, body)
    assert before["meta_info"]["weight_version"] == str(v0)

    response = await http.post("/update_weights_from_disk", json={"model_path": str(other_tiny)})
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True
    after = await post_generate(http, body)
    assert after["meta_info"]["weight_version"] == str(v0 + 1)
    old, new = logprobs(before), logprobs(after)
    assert max(abs(a - b) for a, b in zip(old, new, strict=True)) > 1e-3
    assert (await engine.get_model_info()).weight_version == str(v0 + 1)

    result = await engine.update_weights_from_disk(str(other_tiny), weight_version=41)
    assert result.success
    assert await engine.get_weight_version() == 41

    await engine.update_weights_from_disk(str(resolve_model("tiny")), weight_version=v0)
    restored = await post_generate(http, body)
    assert restored["output_ids"] == before["output_ids"]
    assert (
        restored["meta_info"]["output_token_logprobs"]
        == before["meta_info"]["output_token_logprobs"]
    )
    assert restored["meta_info"]["weight_version"] == str(v0)


async def test_weight_update_waits_for_running_requests(
    http: httpx.AsyncClient, engine: EngineClient, other_tiny: Path, restore_tiny: int
) -> None:
    """A request is sampled by one version only: the update lands after it finishes."""
    v0 = restore_tiny
    reference, duration = await timed_reference(http)
    running = asyncio.create_task(post_generate(http, long_body()))
    await asyncio.sleep(duration / 4)
    update = asyncio.create_task(engine.update_weights_from_disk(str(other_tiny)))
    # Long enough for the update request to reach the engine on a loaded machine; any later
    # request must then wait for the new weights (a longer wait cannot make `late` older).
    await asyncio.sleep(0.5)
    late = asyncio.create_task(post_generate(http, long_body(seed=5) | {"rid": "late"}))
    first = await running
    assert first["output_ids"] == reference["output_ids"]
    assert logprobs(first) == pytest.approx(logprobs(reference), abs=1e-5)
    assert first["meta_info"]["weight_version"] == str(v0)
    assert (await update).success
    assert (await late)["meta_info"]["weight_version"] == str(v0 + 1)


async def test_failed_weight_updates_change_nothing(
    http: httpx.AsyncClient, engine: EngineClient, tmp_path: Path
) -> None:
    version = await engine.get_weight_version()
    response = await http.post(
        "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")}
    )
    assert response.status_code == 400
    assert response.json()["success"] is False
    assert "config.json" in response.json()["message"]

    wrong = save_random_tiny(tmp_path / "wrong", seed=2, intermediate_size=64)
    with pytest.raises(EngineHTTPError) as info:
        await engine.update_weights_from_disk(str(wrong))
    assert info.value.status_code == 400
    assert "shape" in info.value.body

    bad_version = await http.post(
        "/update_weights_from_disk",
        json={"model_path": str(resolve_model("tiny")), "weight_version": "v2"},
    )
    assert bad_version.status_code == 400
    assert "weight_version" in bad_version.json()["message"]
    assert await engine.get_weight_version() == version


async def test_health_info_and_cache(http: httpx.AsyncClient, engine: EngineClient) -> None:
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/health_generate")).status_code == 200
    assert await engine.health()
    assert await engine.health_generate()
    info = (await http.get("/get_model_info")).json()
    assert info["model_path"] == str(resolve_model("tiny"))
    assert info["is_generation"] is True
    assert int(info["weight_version"]) == await engine.get_weight_version()
    assert (await http.get("/flush_cache")).status_code == 200
    assert (await http.post("/flush_cache")).status_code == 200
    await engine.flush_cache()
