"""The CPU engine's prefix cache and its weight updates in place, on the tiny model in process.

A multi-turn episode's next prompt is its last prompt, the tokens sampled, and an observation:
with the prefix cache the engine prefills only the new part, and must sample exactly what a
full prefill would (greedy and seeded), up to float rounding of the logprobs. An update that
lands while generation is paused goes on in place: the running request is not aborted, and
each of its tokens reports the version that sampled it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omniloop.inference.core import EngineCore, GenerationRequest, GenerationResult
from omniloop.inference.llama import read_safetensors
from omniloop.inference.models import resolve_model
from omniloop.inference.prefix_cache import PrefixIndex, shared_prefixes


def test_the_longest_held_prefix_is_found_by_blocks_and_matched_to_the_token() -> None:
    index = PrefixIndex([10, 11], block=4)
    assert index.store(list(range(10))) == (11, 10)  # all ten tokens
    assert index.lookup(list(range(12))) == (11, 10)
    assert index.lookup(list(range(9))) == (11, 8)
    # At least one token is left to prefill: a prompt equal to the prefix matches all but one.
    assert index.lookup(list(range(10))) == (11, 9)
    assert index.lookup([0, 1, 2, 3, 99, 5, 6, 7, 8]) == (11, 4)
    assert index.lookup([9, 1, 2, 3, 4]) is None
    assert index.lookup([0, 1, 2, 9]) is None  # no whole block in common
    assert index.store([0, 1, 2]) is None  # shorter than a block
    assert index.store(list(range(8))) is None  # held already
    # Two held sequences alike for their first two blocks: the one that goes on as the
    # prompt does is found.
    assert index.store([*range(8), 50, 51]) == (10, 10)
    assert index.lookup([*range(8), 50, 51, 52]) == (10, 10)
    assert index.lookup([*range(9), 99]) == (11, 9)


def test_the_least_recently_used_prefix_makes_room() -> None:
    index = PrefixIndex([0, 1], block=2)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    slot_a, _ = index.store(a) or (None, 0)
    index.store(b)
    assert index.lookup([*a, 9]) == (slot_a, 4)  # a is now the most recent
    index.store(c)  # evicts b
    assert index.lookup([*b, 9]) is None
    assert index.lookup([*a, 9]) is not None
    assert index.lookup([*c, 9]) is not None
    assert index.clear() == 2
    assert index.lookup([*a, 9]) is None
    assert len(index) == 0


def test_prompts_of_one_batch_share_their_common_prefixes() -> None:
    group = list(range(10))
    other = [*range(6), 99, 98, 97]
    prompts = [group, [50, 51, 52, 53, 54], group, other, group[:8], [*group, 7]]
    # Index 2 (the same prompt) follows 0 and keeps one token to prefill, 3 copies the six
    # tokens it shares, 4 (the first 8 tokens of 0) all but its last; 5 already has 8 cached
    # from elsewhere and copies all 10 of 0.
    assert shared_prefixes(prompts, [0, 0, 0, 0, 0, 8]) == {
        2: (0, 9),
        3: (0, 6),
        4: (0, 7),
        5: (0, 10),
    }
    assert shared_prefixes([group, [1, *group]], [0, 0]) == {}
    assert shared_prefixes([[1, 2, 3], [1, 2, 3]], [0, 0]) == {1: (0, 2)}
    # Sources are numbered running sequences first: prompts 0 and 1 copy 10 tokens from
    # running sequence 1; prompt 2 shares nothing.
    held = [[7] * 12, [*group, 5, 5]]
    assert shared_prefixes([[*group, 1], [*group, 1], [9] * 9], [0, 0, 0], held=held) == {
        0: (1, 10),
        1: (1, 10),
    }


def test_a_group_copies_from_its_first_prompt_which_copies_the_system_prompt() -> None:
    """Two GRPO groups whose prompts open with one system prompt: the first prompt of the
    second group copies the system prompt from the first group's and is copied by its
    group-mates (rather than those copying only the system prompt too): three forwards."""
    system = [1, 2, 3, 4, 5]
    a, b = [*system, *range(10, 16)], [*system, *range(20, 26)]
    assert shared_prefixes([a, a, b, b, a, b], [0] * 6) == {
        1: (0, 10),
        2: (0, 5),
        3: (2, 10),
        4: (0, 10),
        5: (2, 10),
    }
    # A running sequence (source 0) holds the system prompt: each group's first prompt copies
    # it, its group-mates copy from it (batch prompt k is source 1 + k).
    assert shared_prefixes([a, a, b, b], [0] * 4, held=[[*system, 9]]) == {
        0: (0, 5),
        1: (1, 10),
        2: (0, 5),
        3: (3, 10),
    }
    # A prompt becomes a source only when its followers save `min_gain` tokens by it.
    c, d = [*system, 30, 31, 7], [*system, 30, 31, 8]
    assert shared_prefixes([a, c, d], [0] * 3) == {1: (0, 5), 2: (1, 7)}
    assert shared_prefixes([a, c, d], [0] * 3, min_gain=3) == {1: (0, 5), 2: (0, 5)}


@pytest.fixture(scope="module")
def cores() -> Iterator[tuple[EngineCore, EngineCore]]:
    """The tiny model twice: with a prefix cache, and without one."""
    folder = resolve_model("tiny")
    cached = EngineCore(folder, max_batch=4, max_context=256, threads=1, prefix_cache_slots=4)
    plain = EngineCore(folder, max_batch=4, max_context=256, threads=1, prefix_cache_slots=0)
    for core in (cached, plain):
        core.start()
    yield cached, plain
    for core in (cached, plain):
        core.shutdown()


def generate(core: EngineCore, ids: list[int], **sampling: Any) -> GenerationResult:
    request = GenerationRequest(input_ids=ids, max_new_tokens=20, ignore_eos=True, **sampling)
    return core.submit(request).result(timeout=120)


def three_turns(core: EngineCore, **sampling: Any) -> list[GenerationResult]:
    """An episode of three turns, each prompt extending the last with an observation."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 2000, (37,), generator=gen).tolist()
    turns = []
    for turn in range(3):
        out = generate(core, prompt, **sampling)
        turns.append(out)
        observation = torch.randint(3, 2000, (11 + turn,), generator=gen).tolist()
        prompt = [*prompt, *out.output_ids, *observation]
    return turns


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"]
)
def test_a_turn_that_extends_the_last_prefills_only_what_is_new(
    cores: tuple[EngineCore, EngineCore], sampling: dict[str, Any]
) -> None:
    cached, plain = cores
    cached.flush_cache().result(timeout=10)
    with_cache = three_turns(cached, **sampling)
    without = three_turns(plain, **sampling)
    assert [t.cached_tokens for t in without] == [0, 0, 0]
    assert with_cache[0].cached_tokens == 0
    prompt_length = 37
    for turn in (1, 2):
        # The last turn's prompt and sampled tokens but the newest (not yet run through the
        # model when it finished).
        computed = prompt_length + len(with_cache[turn - 1].output_ids) - 1
        assert with_cache[turn].cached_tokens == computed
        prompt_length += len(with_cache[turn - 1].output_ids) + 11 + turn - 1
    for a, b in zip(with_cache, without, strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)


def batch(core: EngineCore, prompts: list[list[int]], **sampling: Any) -> list[GenerationResult]:
    """`prompts` admitted in one prefill: submitted while the engine is paused."""
    core.pause().result(timeout=10)
    futures = [
        core.submit(GenerationRequest(input_ids=p, max_new_tokens=12, ignore_eos=True, **sampling))
        for p in prompts
    ]
    core.resume().result(timeout=10)
    return [f.result(timeout=120) for f in futures]


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"]
)
def test_a_group_of_one_prompt_is_prefilled_once(
    cores: tuple[EngineCore, EngineCore], sampling: dict[str, Any]
) -> None:
    """A GRPO group (the same prompt three times) and a prompt sharing its first 40 tokens, in
    one prefill: the first is prefilled whole, the others copy what they share from it."""
    cached, plain = cores
    cached.flush_cache().result(timeout=10)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 2000, (50,), generator=gen).tolist()
    sibling = [*prompt[:40], *torch.randint(3, 2000, (20,), generator=gen).tolist()]
    prompts = [prompt, prompt, sibling, prompt]
    shared = batch(cached, prompts, **sampling)
    without = batch(plain, prompts, **sampling)
    assert [r.cached_tokens for r in without] == [0, 0, 0, 0]
    assert [r.cached_tokens for r in shared] == [0, 49, 40, 49]
    for a, b in zip(shared, without, strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)


def _started(core: EngineCore, request: GenerationRequest) -> Any:
    """Submit `request` and return its future once its prefill and a few decode steps ran."""
    passes = core.forward_passes
    future = core.submit(request)
    deadline = time.monotonic() + 60
    while core.forward_passes < passes + 5:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.001)
    return future


def test_a_prompt_copies_what_it_shares_with_a_running_sequence(
    cores: tuple[EngineCore, EngineCore],
) -> None:
    """A group's later samples, arriving while the first already runs, copy the prompt from
    its slot; not once an update has landed since that one was admitted."""
    cached, plain = cores
    cached.flush_cache().result(timeout=10)
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(3, 2000, (50,), generator=gen).tolist()
    extended = [*prompt, *torch.randint(3, 2000, (9,), generator=gen).tolist()]
    long = GenerationRequest(input_ids=prompt, max_new_tokens=300, ignore_eos=True)
    running = _started(cached, long)
    cached.pause().result(timeout=10)
    assert cached.running == 1  # admitted in the step after `resume`, beside it
    futures = [
        cached.submit(
            GenerationRequest(input_ids=p, max_new_tokens=12, ignore_eos=True, temperature=0.0)
        )
        for p in (prompt, extended)
    ]
    cached.resume().result(timeout=10)
    copied = [f.result(timeout=120) for f in futures]
    assert [r.cached_tokens for r in copied] == [49, 50]
    full = batch(plain, [prompt, extended], temperature=0.0)
    for ours, theirs in zip(copied, full, strict=True):
        assert ours.output_ids == theirs.output_ids
        assert ours.output_logprobs == pytest.approx(theirs.output_logprobs, abs=1e-4)
    running.result(timeout=120)
    # The same weights again under the same version: still an update, after which the running
    # sequence's keys and values are not copied (and the retained prefixes are gone).
    running = _started(cached, long)
    same = read_safetensors(resolve_model("tiny"))
    cached.pause().result(timeout=10)
    assert cached.running == 1
    cached.update_weights(list(same.items()), version=cached.weight_version).result(timeout=60)
    late = cached.submit(
        GenerationRequest(input_ids=extended, max_new_tokens=12, ignore_eos=True, temperature=0.0)
    )
    cached.resume().result(timeout=10)
    assert late.result(timeout=120).cached_tokens == 0
    running.result(timeout=120)


def test_a_weight_update_or_a_flush_empties_the_prefix_cache(
    cores: tuple[EngineCore, EngineCore],
) -> None:
    cached, _ = cores
    first = generate(cached, list(range(3, 40)), temperature=0.0)
    extended = [*range(3, 40), *first.output_ids, 5, 6, 7]
    assert generate(cached, extended, temperature=0.0).cached_tokens > 0
    assert cached.flush_cache().result(timeout=10) > 0
    assert generate(cached, extended, temperature=0.0).cached_tokens == 0
    same = read_safetensors(resolve_model("tiny"))
    version = cached.weight_version
    cached.update_weights(list(same.items()), version=version).result(timeout=60)
    assert generate(cached, extended, temperature=0.0).cached_tokens == 0


def test_an_update_while_paused_lands_in_place_and_each_token_has_its_version(
    cores: tuple[EngineCore, EngineCore],
) -> None:
    _, core = cores
    prompt = [1, 4093, 314, 260, 3575]
    long = GenerationRequest(input_ids=prompt, max_new_tokens=200, ignore_eos=True, seed=5)
    reference = core.submit(long).result(timeout=120)
    original = read_safetensors(resolve_model("tiny"))
    changed = [(name, tensor * 1.5) for name, tensor in original.items()]
    v0 = core.weight_version
    passes = core.forward_passes
    running = core.submit(long)
    deadline = time.monotonic() + 60
    while core.forward_passes < passes + 10:  # its prefill and a few decode steps
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.001)
    core.pause("in_place").result(timeout=10)
    try:
        update = core.update_weights(changed, version=v0 + 1).result(timeout=60)
    finally:
        core.resume().result(timeout=10)
    out = running.result(timeout=120)
    try:
        assert update.num_aborted == 0
        assert out.finish_type == "length"
        assert len(out.output_ids) == 200
        switch = out.output_versions.index(v0 + 1)
        assert 0 < switch < 200, "the update did not land mid-response"
        assert out.output_versions == [v0] * switch + [v0 + 1] * (200 - switch)
        assert out.weight_version == v0
        # Up to the update the same tokens as without one; after it, other weights.
        assert out.output_ids[:switch] == reference.output_ids[:switch]
        assert out.output_logprobs[switch:] != pytest.approx(
            reference.output_logprobs[switch:], abs=1e-3
        )
    finally:
        core.update_weights(list(original.items()), version=v0).result(timeout=60)
