"""Many engines: the DCS coordinator's membership and rotation, and the rollout's router, against
real engine processes."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.inference.models import resolve_model
from omniloop.inference.router import EngineRouter
from omniloop.platform.dcs import WeightSyncConfig, make_weight_sync
from omniloop.platform.dcs.coordinator import WeightCoordinator
from omniloop.processes import free_port
from omniloop.trainer.torch_backend import TorchTrainerBackend

PROMPT = [1, 4093, 314, 260, 3575]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
METHOD = ["distributed", "tcp"]


def coordinator(
    trainer: TorchTrainerBackend, urls: list[str], method: str = "distributed"
) -> WeightCoordinator:
    config = WeightSyncConfig(method=method, bucket_mb=0.05, timeout_s=60)  # type: ignore[arg-type]
    return WeightCoordinator(trainer, functools.partial(make_weight_sync, config), urls)


def odd_model(folder: Path) -> str:
    """A tiny model of another shape (a wider MLP): an engine serving it refuses the tiny
    model's weights."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tiny = resolve_model("tiny")
    config = LlamaConfig.from_pretrained(tiny)
    config.intermediate_size = 96
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("method", METHOD)
async def test_an_engine_that_joins_gets_the_current_weights_before_it_enters_the_rotation(
    method: str,
    engine_urls: list[str],
    make_trainer: Callable[..., TorchTrainerBackend],
    greedy: Callable[[TorchTrainerBackend, list[int], int], list[int]],
    next_version: Callable[[], int],
) -> None:
    trainer = make_trainer(perturb_seed=51 + METHOD.index(method))
    expected = greedy(trainer, PROMPT, GREEDY.max_new_tokens)
    coord = coordinator(trainer, engine_urls[:1], method)
    try:
        trainer.version = next_version()
        await coord.publish(trainer.version)
        async with EngineClient(engine_urls[1]) as joining:
            served = await joining.get_weight_version()
            assert served != trainer.version
            seen: list[list[str]] = []

            async def watch() -> None:
                while True:
                    seen.append(coord.engine_urls)
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            try:
                await coord.attach(engine_urls[1], served_version=served)
            finally:
                watcher.cancel()
            # While it was being given the weights, the rotation did not hold it.
            assert seen
            assert all(engine_urls[1] not in urls for urls in seen)
            assert coord.engine_urls == engine_urls
            assert await joining.get_weight_version() == trainer.version
            assert (await joining.generate(PROMPT, GREEDY)).output_ids == expected
        # Per engine: the member got the publish and the joiner's update; the joiner one.
        nbytes = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
        rows = {row["url"]: row for row in coord.table()}
        assert [rows[u]["updates"] for u in engine_urls] == [2, 1]
        assert [rows[u]["bytes"] for u in engine_urls] == [2 * nbytes, nbytes]
        for row in rows.values():
            assert row["in_rotation"] is True
            assert row["weight_version"] == trainer.version
            assert 0 < row["last_update_seconds"] <= row["update_seconds"]  # type: ignore[operator]
    finally:
        await coord.close()


async def test_a_member_that_fails_an_update_leaves_the_rotation_and_the_rest_get_it(
    engine_urls: list[str],
    serve_engine: Callable[[str], str],
    tmp_path: Path,
    make_trainer: Callable[..., TorchTrainerBackend],
    greedy: Callable[[TorchTrainerBackend, list[int], int], list[int]],
    next_version: Callable[[], int],
) -> None:
    odd = serve_engine(odd_model(tmp_path / "odd"))
    dead = f"http://127.0.0.1:{free_port()}"
    trainer = make_trainer(perturb_seed=53)
    coord = coordinator(trainer, [*engine_urls, odd, dead])
    try:
        version = next_version()
        metrics = await coord.publish(version)
        assert coord.engine_urls == engine_urls
        assert coord.members == engine_urls
        assert metrics["weight_sync/engines"] == 2
        assert metrics["weight_sync/dropped_engines"] == 1  # the odd one; the dead one is gone
        assert [(r["url"], r["updates"], r["weight_version"]) for r in coord.table()] == [
            (url, 1, version) for url in engine_urls
        ]
        expected = greedy(trainer, PROMPT, GREEDY.max_new_tokens)
        for url in engine_urls:
            async with EngineClient(url) as engine:
                assert (await engine.generate(PROMPT, GREEDY)).output_ids == expected
        async with EngineClient(odd) as engine:
            assert await engine.get_weight_version() != version
    finally:
        await coord.close()


async def test_a_detached_engine_leaves_the_rotation_at_once_and_the_members_after_draining(
    engine_urls: list[str],
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    trainer = make_trainer(perturb_seed=54)
    coord = coordinator(trainer, list(engine_urls))
    try:
        detaching = asyncio.create_task(coord.detach(engine_urls[1], drain_s=1.5))
        await asyncio.sleep(0.1)
        assert coord.engine_urls == engine_urls[:1]
        assert coord.members == engine_urls
        # Still a member while it drains: a publish reaches it, but it stays out of rotation.
        during = next_version()
        await coord.publish(during)
        assert coord.engine_urls == engine_urls[:1]
        async with EngineClient(engine_urls[1]) as engine:
            assert await engine.get_weight_version() == during
        assert await detaching
        assert coord.members == engine_urls[:1]
        metrics = await coord.publish(next_version())
        assert metrics["weight_sync/engines"] == 1
        assert not await coord.detach(engine_urls[1])
    finally:
        await coord.close()


async def test_the_router_keeps_each_session_on_one_engine_and_spreads_the_sessions(
    engine_urls: list[str],
) -> None:
    router = EngineRouter.over(engine_urls)
    try:
        # 20-token openings: the first turn leaves a full 16-token block for the second. They
        # differ from their first token on, so that no first turn copies another's opening.
        histories = {f"episode-{i}": [4649 + i, *range(300, 319)] for i in range(4)}
        cached: dict[str, list[int]] = {key: [] for key in histories}
        for _turn in range(3):
            outs = await asyncio.gather(
                *(router.session(key).generate(ids, GREEDY) for key, ids in histories.items())
            )
            for (key, ids), out in zip(histories.items(), outs, strict=True):
                ids.extend([*out.output_ids, 198, 30])  # the turn, then a user's reply
                cached[key].append(out.cached_tokens)
        engines = {key: router.engine_of(key) for key in histories}
        assert sorted(list(engines.values()).count(url) for url in engine_urls) == [2, 2]
        # Every later turn found its history in its engine's prefix cache.
        assert all(c[0] == 0 and c[1] > 0 and c[2] > c[1] for c in cached.values()), cached
    finally:
        await router.aclose()


async def test_the_sessions_of_an_engine_that_does_not_answer_move_to_another(
    engine_urls: list[str],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = EngineRouter.over([dead, engine_urls[0]], wait_s=30)
    try:
        outs = await asyncio.gather(
            *(router.session(f"s{i}").generate(PROMPT, GREEDY) for i in range(4))
        )
        assert all(len(out.output_ids) == GREEDY.max_new_tokens for out in outs)
        assert {router.engine_of(f"s{i}") for i in range(4)} == {engine_urls[0]}
    finally:
        await router.aclose()
