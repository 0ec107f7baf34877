"""Multi-part weight updates in the engine core (in process), and how buckets are planned."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import pytest
import torch

from omniloop.inference.core import EngineCore, GenerationRequest, GenerationResult
from omniloop.inference.models import resolve_model
from omniloop.inference.weight_groups import dtype_name, parse_dtype
from omniloop.platform.dcs import plan_buckets

PROMPT = [1, 4093, 314, 260, 3575]


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    engine = EngineCore(resolve_model("tiny"), max_batch=4, max_context=128, threads=1)
    engine.start()
    yield engine
    engine.shutdown()


def request(seed: int = 0) -> GenerationRequest:
    return GenerationRequest(input_ids=PROMPT, max_new_tokens=4, temperature=1.0, seed=seed)


def still_waiting(future: concurrent.futures.Future[GenerationResult], seconds: float) -> bool:
    time.sleep(seconds)
    return not future.done()


def halves(core: EngineCore, scale: float) -> tuple[list, list]:
    named = [(n, t.clone() * scale) for n, t in core.weights.state_dict().items()]
    return named[: len(named) // 2], named[len(named) // 2 :]


def test_no_request_is_admitted_between_the_parts_of_an_update(core: EngineCore) -> None:
    first, rest = halves(core, 1.0)
    version = core.weight_version
    done = core.update_weights(first, partial=True).result(timeout=30)
    assert done.weight_version == version  # a part leaves the version alone
    assert core.updating
    waiting = core.submit(request())
    assert still_waiting(waiting, 0.5)

    core.update_weights(rest, version=version + 7).result(timeout=30)
    assert not core.updating
    assert waiting.result(timeout=30).weight_version == version + 7


def test_resume_gives_up_on_an_unfinished_update(core: EngineCore) -> None:
    first, _ = halves(core, 1.0)
    version = core.weight_version
    core.update_weights(first, partial=True).result(timeout=30)
    waiting = core.submit(request(1))
    assert still_waiting(waiting, 0.3)
    core.resume().result(timeout=30)
    assert not core.updating
    assert waiting.result(timeout=30).weight_version == version


def test_a_failed_part_keeps_admission_closed(core: EngineCore) -> None:
    first, rest = halves(core, 1.0)
    core.update_weights(first, partial=True).result(timeout=30)
    # Right name and shape, so it passes the check, but it has no data to copy.
    bad = [(rest[0][0], torch.empty(rest[0][1].shape, device="meta"))]
    with pytest.raises(Exception, match="weight update failed"):
        core.update_weights(bad, partial=True).result(timeout=30)
    assert core.updating
    waiting = core.submit(request(2))
    assert still_waiting(waiting, 0.3)
    core.update_weights(rest, version=3).result(timeout=30)
    assert waiting.result(timeout=30).weight_version == 3


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert parse_dtype(dtype_name(dtype)) == dtype
    assert parse_dtype("torch.float32") == torch.float32
    with pytest.raises(ValueError, match="not a torch dtype"):
        parse_dtype("Tensor")


def test_buckets_keep_order_and_size_and_a_big_tensor_travels_alone() -> None:
    sizes = [10, 20, 5, 100, 30, 30, 1]  # float32 elements: 4 bytes each
    named = [(f"w{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = plan_buckets(named, bucket_bytes=40 * 4)
    assert [[n for n, _ in b] for b in buckets] == [
        ["w0", "w1", "w2"],
        ["w3"],
        ["w4"],
        ["w5", "w6"],
    ]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(named, 0)


def test_a_bucket_is_received_into_the_model_only_while_paused_in_place(core: EngineCore) -> None:
    specs = [
        (name, tensor.dtype, tuple(tensor.shape))
        for name, tensor in list(core.weights.state_dict().items())[:3]
    ]
    assert core.direct_targets(specs) is None  # generating: a forward pass may read them
    core.pause("in_place").result(timeout=30)
    try:
        targets = core.direct_targets(specs)
        assert targets is not None
        for (name, _, _), target in zip(specs, targets, strict=True):
            assert target.data_ptr() == core.weights.target(name).data_ptr()
        name, dtype, shape = specs[0]
        assert core.direct_targets([(name, torch.float16, shape)]) is None
        assert core.direct_targets([(name, dtype, (1, *shape))]) is None
        assert core.direct_targets([("model.no_such.weight", dtype, shape)]) is None
    finally:
        core.resume().result(timeout=30)


def test_nothing_is_sampled_while_a_bucket_is_written_into_the_model(core: EngineCore) -> None:
    core.pause("in_place").result(timeout=30)
    with core.receiving_in_place():
        core.resume().result(timeout=30)  # even continued, no forward pass runs meanwhile
        waiting = core.submit(request(2))
        assert still_waiting(waiting, 0.5)
    assert waiting.result(timeout=30).finish_type == "length"


def test_a_failed_write_into_the_model_keeps_admission_closed(core: EngineCore) -> None:
    core.pause("in_place").result(timeout=30)
    with pytest.raises(RuntimeError), core.receiving_in_place():
        raise RuntimeError("the broadcast broke half-way")
    assert core.updating  # written partly: nothing is admitted until a complete update
    version = core.weight_version
    named = [(n, t.clone()) for n, t in core.weights.state_dict().items()]
    core.update_weights(named, version=version + 1).result(timeout=30)
    assert not core.updating
    core.resume().result(timeout=30)
    assert core.submit(request(3)).result(timeout=30).weight_version == version + 1
