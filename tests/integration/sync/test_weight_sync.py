"""Weight sync from a trainer to two real engines: by disk, by gloo broadcast, and by buckets
fetched over HTTP (tcp).

What must hold after `publish(weights, v)`: every engine reports `v`, samples what the trainer
would (greedy tokens, and logprobs within 1e-4 in fp32), and never samples a response with a
mix of old and new weights, also when the sync lands in the middle of an episode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import torch

from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.platform.dcs import (
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
    make_weight_sync,
)
from omniloop.processes import free_port
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.torch_backend import TorchTrainerBackend
from omniloop.trajectory import Trajectory, TrajectoryBuilder, TrajectoryMeta

PROMPTS = [
    [1, 4093, 314, 260, 3575],
    [1, 504, 2114, 282, 4649, 47, 198],
    [1, 9690, 28, 30, 31, 32],
]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
METHODS = ["disk", "distributed", "distributed-each", "tcp"]
"""`distributed-each`: one broadcast per tensor (`flattened: false`), which an engine paused
in place receives straight into its model."""
BUCKETED = ("distributed", "distributed-each", "tcp")


def sync_config(method: str, tmp_path: Path, update_mode: str = "in_place") -> WeightSyncConfig:
    # Small buckets, so the tiny model (a 12.6 MB embedding and 0.3 MB of layers) travels in
    # several: the multi-bucket path.
    method, _, each = method.partition("-")
    return WeightSyncConfig(
        method=method,
        flattened=not each,
        bucket_mb=0.05,
        staging_dir=str(tmp_path / "staging"),
        timeout_s=120,
        update_mode=update_mode,
    )


@pytest.fixture
async def clients(engine_urls: list[str]) -> AsyncIterator[list[EngineClient]]:
    engines = [EngineClient(url, timeout=120) for url in engine_urls]
    yield engines
    for engine in engines:
        await engine.aclose()


@pytest.fixture
async def distributed(engine_urls: list[str], tmp_path: Path) -> AsyncIterator[WeightSync]:
    sync = make_weight_sync(sync_config("distributed", tmp_path), engine_urls)
    yield sync
    await sync.close()


def trainer_logprobs(trainer: TorchTrainerBackend, trajectories: list[Trajectory]) -> TrainBatch:
    """A batch of the trajectories with the trainer's logprobs as `old_logprobs`."""
    batch = TrainBatch.from_trajectories(trajectories, None)
    return batch.replace(old_logprobs=trainer.logprobs(batch))


def sampled_gap(batch: TrainBatch) -> torch.Tensor:
    """|trainer - engine| logprob of every sampled token."""
    assert batch.old_logprobs is not None
    mask = batch.loss_mask != 0
    return (batch.old_logprobs - batch.rollout_logprobs)[mask].abs()


async def rollouts(engine: EngineClient, seed: int, n: int = 48) -> list[Trajectory]:
    """One sampled (temperature 1) response per prompt, as trajectories."""
    sampling = [
        SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed + i, stop_token_ids=[])
        for i in range(len(PROMPTS))
    ]
    calls = [engine.generate(p, s) for p, s in zip(PROMPTS, sampling, strict=True)]
    outs = await asyncio.gather(*calls)
    trajectories = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        builder = TrajectoryBuilder(prompt)
        builder.add_sampled(out.output_ids, out.output_logprobs, out.weight_version)
        trajectories.append(builder.build(TrajectoryMeta(episode_id=f"r{seed}-{i}")))
    return trajectories


@pytest.mark.parametrize("method", METHODS)
async def test_every_engine_generates_what_the_trainer_would(
    method: str,
    engine_urls: list[str],
    clients: list[EngineClient],
    tmp_path: Path,
    make_trainer: Callable[..., TorchTrainerBackend],
    greedy: Callable[[TorchTrainerBackend, list[int], int], list[int]],
    next_version: Callable[[], int],
) -> None:
    trainer = make_trainer(perturb_seed=METHODS.index(method) + 1)
    expected = [greedy(trainer, p, GREEDY.max_new_tokens) for p in PROMPTS]
    before = [(await clients[0].generate(p, GREEDY)).output_ids for p in PROMPTS]
    assert before != expected, "the engines already hold these weights: nothing is tested"

    version = next_version()
    sync = make_weight_sync(sync_config(method, tmp_path), engine_urls)
    try:
        metrics = await sync.publish(trainer.named_weights(), version)
    finally:
        await sync.close()

    size = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    assert metrics["weight_sync/bytes"] == size
    assert metrics["weight_sync/version"] == version
    if method in BUCKETED:
        assert metrics["weight_sync/buckets"] >= 4
    for engine in clients:
        assert await engine.get_weight_version() == version
        outs = [await engine.generate(p, GREEDY) for p in PROMPTS]
        assert [o.output_ids for o in outs] == expected
        assert {o.weight_version for o in outs} == {version}
    if method == "disk":
        staged = list((tmp_path / "staging").iterdir())
        assert [p.name for p in staged] == [f"weights-v{version}"]


async def test_sync_lands_between_turns_and_versions_follow_each_response(
    clients: list[EngineClient],
    distributed: WeightSync,
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    """An episode of three turns with a sync before turns 2 and 3: per-response versions
    become the per-token versions of the trajectory, and each turn's logprobs are those of
    the weights its version names."""
    trainers = [make_trainer(perturb_seed=s) for s in (11, 12, 13)]
    versions = [next_version() for _ in trainers]
    engine = clients[1]
    builder = TrajectoryBuilder(PROMPTS[0])
    outputs: list[GenerateOutput] = []
    observation = [198, 504, 2114, 28]
    for turn, (trainer, version) in enumerate(zip(trainers, versions, strict=True)):
        await distributed.publish(trainer.named_weights(), version)
        if turn:
            builder.add_observation(observation)
        sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=turn, stop_token_ids=[])
        out = await engine.generate(list(builder.input_ids), sampling)
        builder.add_sampled(out.output_ids, out.output_logprobs, out.weight_version)
        outputs.append(out)

    assert [o.weight_version for o in outputs] == versions
    trajectory = builder.build(TrajectoryMeta(episode_id="mid-episode"))
    n_prompt, n_obs = len(PROMPTS[0]), len(observation)
    n = [len(o.output_ids) for o in outputs]
    assert trajectory.weight_version == (
        [-1] * n_prompt
        + [versions[0]] * n[0]
        + [-1] * n_obs
        + [versions[1]] * n[1]
        + [-1] * n_obs
        + [versions[2]] * n[2]
    )
    # Score the whole episode under each version's weights: the tokens of a turn match the
    # trainer whose version the engine reported for that turn, and no other.
    version_of_token = torch.tensor(trajectory.weight_version)
    for trainer, version in zip(trainers, versions, strict=True):
        batch = trainer_logprobs(trainer, [trajectory])
        gap = sampled_gap(batch)
        mine = version_of_token[version_of_token >= 0] == version
        # Float rounding between the engine's kernels and the trainer's over a 40-token
        # history: ~1e-5 usually, a turn at 4.7e-4 once on a loaded machine; other weights
        # move a token's logprob by 0.1 or more (the second assertion).
        assert float(gap[mine].mean()) <= 2e-3
        assert float(gap[~mine].mean()) > 1e-2


async def test_drained_a_request_in_flight_is_sampled_by_one_version_only(
    engine_urls: list[str],
    clients: list[EngineClient],
    tmp_path: Path,
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    """`update_mode=drain`: a sync started while a long request decodes waits for it (the
    first bucket drains the batch, later buckets keep admission closed): the request's every
    logprob is one version's."""
    old, new = make_trainer(perturb_seed=21), make_trainer(perturb_seed=22)
    v_old, v_new = next_version(), next_version()
    distributed = make_weight_sync(sync_config("distributed", tmp_path, "drain"), engine_urls)
    await distributed.publish(old.named_weights(), v_old)
    engine = clients[0]
    long = SamplingParams(max_new_tokens=400, temperature=1.0, seed=5, stop_token_ids=[])
    running = asyncio.create_task(engine.generate(PROMPTS[1], long))
    await asyncio.sleep(0.2)
    await distributed.publish(new.named_weights(), v_new)
    late = await engine.generate(PROMPTS[1], long)
    first = await running

    assert late.weight_version == v_new
    assert first.weight_version in (v_old, v_new)
    for out in (first, late):
        builder = TrajectoryBuilder(PROMPTS[1])
        builder.add_sampled(out.output_ids, out.output_logprobs, out.weight_version)
        trajectory = builder.build(TrajectoryMeta(episode_id=f"in-flight-{out.weight_version}"))
        trainer = old if out.weight_version == v_old else new
        gap = sampled_gap(trainer_logprobs(trainer, [trajectory]))
        assert len(gap) == len(out.output_ids) > 0
        # Other weights (noise 0.2 on every matrix) move a token's logprob by 0.1 or more;
        # float rounding over a 400-token decode stays within a few 1e-3.
        assert float(gap.max()) <= 1e-2, "some tokens were sampled by other weights"
    await distributed.close()


async def test_in_place_a_request_in_flight_changes_version_exactly_at_the_update(
    clients: list[EngineClient],
    distributed: WeightSync,
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    """The default, `in_place`: the engine pauses between two decode steps, swaps the weights
    and goes on. The request is not aborted; the tokens before the first update are the old
    weights' (their logprobs are the old trainer's), and every token says which version
    sampled it."""
    old, new = make_trainer(perturb_seed=23), make_trainer(perturb_seed=24)
    v_old = next_version()
    await distributed.publish(old.named_weights(), v_old)
    engine = clients[0]
    long = SamplingParams(max_new_tokens=400, temperature=1.0, seed=6, stop_token_ids=[])
    # The request alone, timed: the publishes start a quarter of the way into the same
    # request (after it was admitted, however loaded the machine), and go on until it ends.
    started = time.perf_counter()
    alone = await engine.generate(PROMPTS[1], long)
    duration = time.perf_counter() - started
    running = asyncio.create_task(engine.generate(PROMPTS[1], long))
    await asyncio.sleep(duration / 4)
    published: list[int] = []
    paused: list[float] = []
    while not running.done():
        published.append(next_version())
        metrics = await distributed.publish(new.named_weights(), published[-1])
        paused.append(metrics["weight_sync/paused_seconds"])
    out = await running

    assert out.finish_reason == "length"
    assert len(out.output_ids) == 400
    assert out.weight_versions == sorted(out.weight_versions)
    assert set(out.weight_versions) <= {v_old, *published}
    switch = next((i for i, v in enumerate(out.weight_versions) if v != v_old), 400)
    assert 0 < switch < 400, "no update landed while the request decoded"
    assert out.output_ids[:switch] == alone.output_ids[:switch]
    assert min(paused) > 0
    builder = TrajectoryBuilder(PROMPTS[1])
    builder.add_sampled(out.output_ids, out.output_logprobs, out.weight_versions)
    trajectory = builder.build(TrajectoryMeta(episode_id="in-place"))
    assert trajectory.weight_version[len(PROMPTS[1]) :] == out.weight_versions
    gap = sampled_gap(trainer_logprobs(old, [trajectory]))
    assert float(gap[:switch].max()) <= 1e-2
    # After the switch the new weights sample, over keys and values the old ones computed:
    # neither trainer's full recompute is exact there; the old one is clearly off.
    assert float(gap[switch:].mean()) > 1e-2


async def test_no_request_is_aborted_across_50_in_place_syncs_under_load(
    clients: list[EngineClient],
    distributed: WeightSync,
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    """16 requests always running on each engine while the trainer publishes 50 times."""
    trainers = [make_trainer(perturb_seed=30 + i) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, stop_token_ids=[])
    outputs: list[GenerateOutput] = []
    stop = asyncio.Event()

    async def keep_generating(engine: EngineClient, lane: int) -> None:
        seed = lane * 1000
        while not stop.is_set():
            seed += 1
            params = sampling.model_copy(update={"seed": seed})
            outputs.append(await engine.generate(PROMPTS[lane % len(PROMPTS)], params))

    served = {await engine.get_weight_version() for engine in clients}
    lanes = [
        asyncio.create_task(keep_generating(engine, lane))
        for engine in clients
        for lane in range(16)
    ]
    try:
        versions = []
        for i in range(50):
            version = next_version()
            await distributed.publish(trainers[i % 2].named_weights(), version)
            versions.append(version)
        stop.set()
        await asyncio.gather(*lanes)
    finally:
        stop.set()
        for lane in lanes:
            lane.cancel()
    assert outputs
    assert [o for o in outputs if o.finish_reason == "abort"] == []
    assert all(len(o.output_ids) == 64 for o in outputs)
    spanning = [o for o in outputs if len(set(o.weight_versions)) > 1]
    assert spanning, "no update landed while a request decoded"
    for out in spanning:
        assert out.weight_versions == sorted(out.weight_versions)
        assert set(out.weight_versions) <= {*served, *versions}


async def test_trainer_and_engine_logprobs_agree_before_and_after_a_training_step(
    clients: list[EngineClient],
    distributed: WeightSync,
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    trainer = make_trainer(lr=1e-2, grad_clip=None)
    base = next_version()
    await distributed.publish(trainer.named_weights(), base)

    trajectories = await rollouts(clients[0], seed=1)
    assert {v for t in trajectories for v in t.weight_version if v >= 0} == {base}
    batch = trainer_logprobs(trainer, trajectories)
    assert batch.num_tokens >= 20 * len(PROMPTS)
    gap = sampled_gap(batch)
    assert float(gap.mean()) <= 1e-4, f"mean |trainer - engine| = {float(gap.mean()):.2e}"

    advantages = batch.loss_mask * torch.tensor([[1.0], [-1.0], [0.5]])
    metrics = trainer.train_step(batch.replace(advantages=advantages))
    assert metrics["actor/skipped_step"] == 0.0
    trained = next_version()
    await distributed.publish(trainer.named_weights(), trained)

    for engine in clients:
        after = await rollouts(engine, seed=2)
        assert {v for t in after for v in t.weight_version if v >= 0} == {trained}
        batch_after = trainer_logprobs(trainer, after)
        gap_after = sampled_gap(batch_after)
        assert float(gap_after.mean()) <= 1e-4, f"mean gap {float(gap_after.mean()):.2e}"
    # The step moved the policy well beyond the tolerance, so the agreement above is news.
    assert batch.old_logprobs is not None
    moved = (trainer.logprobs(batch) - batch.old_logprobs)[batch.loss_mask != 0].abs()
    assert float(moved.mean()) > 1e-2


@pytest.mark.parametrize("method", METHODS)
async def test_weights_of_the_wrong_shape_fail_the_publish_and_change_nothing(
    method: str,
    engine_urls: list[str],
    clients: list[EngineClient],
    tmp_path: Path,
    make_trainer: Callable[..., TorchTrainerBackend],
    greedy: Callable[[TorchTrainerBackend, list[int], int], list[int]],
    next_version: Callable[[], int],
) -> None:
    trainer = make_trainer(perturb_seed=31)
    sync = make_weight_sync(sync_config(method, tmp_path), engine_urls)
    try:
        good = next_version()
        await sync.publish(trainer.named_weights(), good)
        named = dict(trainer.named_weights())
        named["model.norm.weight"] = torch.ones(7)  # the last weight: in the last bucket
        with pytest.raises(WeightSyncError, match="shape"):
            await sync.publish(named.items(), next_version())
        expected = greedy(trainer, PROMPTS[0], GREEDY.max_new_tokens)
        for engine in clients:
            assert await engine.get_weight_version() == good
            assert await engine.health_generate()
        pending = [asyncio.create_task(e.generate(PROMPTS[0], GREEDY)) for e in clients]
        if method in BUCKETED:
            # The earlier buckets landed: until a publish completes, the engines admit
            # nothing rather than sample with weights that may be a mix.
            await asyncio.sleep(0.5)
            assert not any(task.done() for task in pending)
        else:
            for out in await asyncio.gather(*pending):
                assert (out.weight_version, out.output_ids) == (good, expected)
        # The same sync object recovers (the distributed one on a new process group).
        again = next_version()
        await sync.publish(trainer.named_weights(), again)
        assert [await e.get_weight_version() for e in clients] == [again] * len(clients)
        if method in BUCKETED:
            for out in await asyncio.gather(*pending):
                assert (out.weight_version, out.output_ids) == (again, expected)
    finally:
        await sync.close()


async def test_an_unreachable_engine_fails_the_publish_instead_of_hanging(
    engine_urls: list[str],
    clients: list[EngineClient],
    make_trainer: Callable[..., TorchTrainerBackend],
    next_version: Callable[[], int],
) -> None:
    """The live engine waits in the group for a peer that never comes (until the timeout);
    the trainer must not: it fails as soon as the dead engine's call does."""
    dead = f"http://127.0.0.1:{free_port()}"
    version = await clients[0].get_weight_version()
    sync = make_weight_sync(WeightSyncConfig(timeout_s=120), [engine_urls[0], dead])
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=dead):
            await sync.publish(make_trainer().named_weights(), next_version())
    finally:
        await sync.close()
    assert time.monotonic() - started < 30
    assert await clients[0].get_weight_version() == version
    assert (await clients[0].generate(PROMPTS[0], GREEDY)).weight_version == version


async def test_the_weight_group_endpoints_answer_sglang_style(engine_urls: list[str]) -> None:
    async with httpx.AsyncClient(base_url=engine_urls[0], timeout=30) as http:
        nccl = await http.post(
            "/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": 29999,
                "rank_offset": 1,
                "world_size": 2,
                "backend": "nccl",
            },
        )
        assert nccl.status_code == 400
        assert nccl.json()["success"] is False
        assert "gloo" in nccl.json()["message"]

        bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
        unknown = await http.post(
            "/update_weights_from_distributed", json=bucket | {"group_name": "nope"}
        )
        assert unknown.status_code == 400
        assert "init_weights_update_group" in unknown.json()["message"]

        mismatched = await http.post(
            "/update_weights_from_distributed", json=bucket | {"dtypes": []}
        )
        assert mismatched.status_code == 400
        assert "one of each per tensor" in mismatched.json()["message"]

        gone = await http.post("/destroy_weights_update_group", json={"group_name": "nope"})
        assert gone.status_code == 400
        assert gone.json()["success"] is False
