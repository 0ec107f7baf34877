"""The CPU engine's Llama forward against transformers' LlamaForCausalLM, and its core.

The forward must give transformers' logits (fp32) through every path the scheduler uses:
packed prefill of several prompts, batched decode of sequences of different lengths, with
either matmul backend, after a partial weight update, for tied and untied embeddings and both
rope types. The scheduler-level checks run an `EngineCore` in process (no HTTP).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.errors import ConfigError
from omniloop.inference.core import EngineCore, GenerationRequest
from omniloop.inference.llama import (
    KVCache,
    LlamaConfig,
    LlamaModel,
    load_weights,
    onednn_linear_available,
)
from omniloop.inference.models import resolve_model
from omniloop.inference.sampling import sample

BACKENDS = [False, pytest.param(True, id="onednn")]


def hf_model(folder: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def check_against_hf(folder: Path, onednn: bool, atol: float) -> None:
    """Packed prefill and ragged batched decode equal HF's logits position by position."""
    config = LlamaConfig.from_folder(folder)
    model = LlamaModel(load_weights(folder, config), max_context=64, onednn=onednn)
    hf = hf_model(folder)
    prompts = random_prompts(config.vocab_size, [7, 13, 2])
    cache = KVCache(config, max_slots=4, max_context=64)
    # Unwritten cache memory may hold anything, NaN included; the batched decode reads it
    # (masked) for the shorter sequences, so it must be made harmless, not assumed zero.
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    packed = model.prefill(cache, [0, 1, 2], prompts, all_logits=True)
    start = 0
    for prompt in prompts:
        torch.testing.assert_close(
            packed[start : start + len(prompt)], hf_logits(hf, prompt), rtol=0, atol=atol
        )
        start += len(prompt)
    # Five decode steps for the three sequences at once (positions 7, 13 and 2 onwards).
    extra = random_prompts(config.vocab_size, [5, 5, 5], seed=1)
    positions = torch.tensor([len(p) for p in prompts])
    for step in range(5):
        tokens = torch.tensor([e[step] for e in extra])
        logits = model.decode(cache, tokens, positions)
        for i, (prompt, more) in enumerate(zip(prompts, extra, strict=True)):
            expected = hf_logits(hf, prompt + more[: step + 1])[-1]
            torch.testing.assert_close(logits[i], expected, rtol=0, atol=atol)
        positions += 1


@pytest.mark.parametrize("onednn", BACKENDS)
def test_tiny_logits_equal_transformers(onednn: bool) -> None:
    if onednn and not onednn_linear_available():
        pytest.skip("this torch build has no packed oneDNN linear")
    check_against_hf(resolve_model("tiny"), onednn, atol=1e-5)


@pytest.fixture(scope="module")
def llama3_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with untied embeddings and llama3 rope scaling."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("llama3")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("onednn", BACKENDS)
def test_llama3_rope_and_untied_embeddings_equal_transformers(
    llama3_untied: Path, onednn: bool
) -> None:
    assert LlamaConfig.from_folder(llama3_untied).rope_scaling is not None
    if onednn and not onednn_linear_available():
        pytest.skip("this torch build has no packed oneDNN linear")
    check_against_hf(llama3_untied, onednn, atol=1e-5)


def test_partial_weight_update_by_hf_name() -> None:
    """Replacing one projection and one norm by HF name gives HF's logits for the same change."""
    folder = resolve_model("tiny")
    config = LlamaConfig.from_folder(folder)
    weights = load_weights(folder, config)
    model = LlamaModel(weights, max_context=32)
    hf = hf_model(folder)
    gen = torch.Generator().manual_seed(5)
    changes = {
        "model.layers.1.self_attn.k_proj.weight": torch.randn(32, 64, generator=gen) * 0.1,
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=gen) * 0.1,
        "model.norm.weight": torch.rand(64, generator=gen) + 0.5,
    }
    weights.check(changes.items(), full=False)
    weights.load(changes.items())
    hf.load_state_dict(changes, strict=False)
    prompt = random_prompts(config.vocab_size, [9])[0]
    cache = KVCache(config, 1, 32)
    ours = model.prefill(cache, [0], [prompt], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(hf, prompt), rtol=0, atol=1e-5)
    assert torch.equal(weights.state_dict()["model.norm.weight"], changes["model.norm.weight"])


def test_weights_reject_unknown_names_and_wrong_shapes() -> None:
    folder = resolve_model("tiny")
    weights = load_weights(folder, LlamaConfig.from_folder(folder))
    with pytest.raises(ConfigError, match="unknown"):
        weights.check([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))], full=False)
    with pytest.raises(ConfigError, match="shape"):
        weights.check([("model.norm.weight", torch.zeros(65))], full=False)
    with pytest.raises(ConfigError, match="lacks"):
        weights.check([("model.norm.weight", torch.zeros(64))], full=True)


def test_smollm2_matches_transformers_and_its_greedy_tokens() -> None:
    """SmolLM2: the same greedy continuation as HF `generate`, and close logits, at no more
    than a few times HF's time for it.

    fp32 matmuls in a different order (oneDNN vs MKL, packed vs single) differ in the last
    bits; over 30 layers that is ~1e-3 on logits of magnitude ~30 (4e-5 relative).
    """
    folder = resolve_model("smollm2")
    config = LlamaConfig.from_folder(folder)
    model = LlamaModel(load_weights(folder, config), max_context=128)
    hf = hf_model(folder)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198]

    def greedy_hf() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=2
            )
        return list(out[0, len(prompt) :].tolist())

    def greedy_ours() -> tuple[torch.Tensor, list[int]]:
        cache = KVCache(config, 1, 128)
        logits = model.prefill(cache, [0], [prompt], all_logits=True)
        tokens = [int(logits[-1].argmax())]
        for step in range(11):
            step_logits = model.decode(
                cache, torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + step])
            )
            tokens.append(int(step_logits[0].argmax()))
        return logits, tokens

    # Both sides alternately, twice each, and the best time of each: a speed compared at the
    # same moment, so the load of the machine weighs on both alike.
    hf_seconds: list[float] = []
    our_seconds: list[float] = []
    for _ in range(2):
        start = time.perf_counter()
        expected = greedy_hf()
        hf_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        logits, tokens = greedy_ours()
        our_seconds.append(time.perf_counter() - start)
    reference = hf_logits(hf, prompt)
    scale = reference.abs().max().item()
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4 * scale)
    assert tokens == expected
    # Each decode step is one token's work on the KV cache, as in HF: recomputing the prefix,
    # or any other slow path, shows as a multiple of HF's time.
    assert min(our_seconds) < 3 * min(hf_seconds), f"ours {our_seconds} s, HF {hf_seconds} s"


# -- sampling --------------------------------------------------------------------------------


def test_sampling_rules() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    greedy = GenerationRequest(input_ids=[1], temperature=0.0)
    top1 = GenerationRequest(input_ids=[1], temperature=2.0, top_k=1)
    tiny_p = GenerationRequest(input_ids=[1], temperature=1.0, top_p=1e-6)
    free = GenerationRequest(input_ids=[1], temperature=1.0)
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    sampled = sample(logits, [greedy, top1, tiny_p, free], [*gens, gen])
    tokens, logprobs = sampled.ids, sampled.logprobs
    argmax = logits.argmax(dim=-1).tolist()
    # top_k=1 and a vanishing top_p both leave only the most likely token.
    assert tokens[:3] == argmax[:3]
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(tokens)])


def test_top_k_and_top_p_never_pick_outside_their_set() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(200, 1)
    top_k = GenerationRequest(input_ids=[1], temperature=5.0, top_k=2)
    top_p = GenerationRequest(input_ids=[1], temperature=1.0, top_p=0.8)
    gen = torch.Generator().manual_seed(0)
    k_tokens = sample(logits, [top_k] * 200, [gen] * 200).ids
    p_tokens = sample(logits, [top_p] * 200, [gen] * 200).ids
    assert set(k_tokens) == {0, 1}
    # softmax: 0.64, 0.24, 0.09, ...: the smallest set reaching 0.8 is {0, 1}.
    assert set(p_tokens) == {0, 1}


def check_top_lists(
    top: list[list[tuple[float, int]]], ids: list[int], logprobs: list[float], n: int
) -> None:
    """Each step's list has `n` entries sorted by logprob, highest first, and a sampled token in
    it carries exactly its sampled logprob (the same raw distribution)."""
    assert len(top) == len(ids) == len(logprobs)
    for step, token, logprob in zip(top, ids, logprobs, strict=True):
        values = [lp for lp, _ in step]
        assert len(step) == n
        assert values == sorted(values, reverse=True)
        assert len({t for _, t in step}) == n
        assert logprob <= values[0]
        if token in {t for _, t in step}:
            assert dict((t, lp) for lp, t in step)[token] == logprob


def test_top_logprobs_come_from_the_raw_distribution_only_for_rows_that_ask() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    greedy = GenerationRequest(input_ids=[1], temperature=0.0)
    hot = GenerationRequest(input_ids=[1], temperature=2.0, top_p=0.9)
    gens = [None, torch.Generator().manual_seed(1), None]
    sampled = sample(logits, [greedy, hot, greedy], gens, [4, 50, 0])
    raw = torch.log_softmax(logits, dim=-1)
    expected = torch.topk(raw, 50, dim=-1)
    assert sampled.top_logprobs[2] is None
    for row, n in ((0, 4), (1, 50)):
        top = sampled.top_logprobs[row]
        assert top is not None
        assert [t for _, t in top] == expected.indices[row, :n].tolist()
        assert [lp for lp, _ in top] == pytest.approx(expected.values[row, :n].tolist())
        check_top_lists([top], sampled.ids[row : row + 1], sampled.logprobs[row : row + 1], n)
    # Greedy: the sampled token heads the list; a whole-vocabulary list holds any token.
    greedy_top, hot_top = sampled.top_logprobs[0] or [], sampled.top_logprobs[1] or []
    assert greedy_top[0] == (sampled.logprobs[0], sampled.ids[0])
    assert (sampled.logprobs[1], sampled.ids[1]) in hot_top
    # Without asking: the same tokens and logprobs, and no lists.
    again = [None, torch.Generator().manual_seed(1), None]
    plain = sample(logits, [greedy, hot, greedy], again)
    assert (plain.ids, plain.logprobs) == (sampled.ids, sampled.logprobs)
    assert plain.top_logprobs == [None] * 3


# -- the scheduler, in process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def core_with_eos(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An `EngineCore` on a copy of tiny whose EOS id is the token greedy decoding emits."""
    folder = tmp_path_factory.mktemp("tiny-eos")
    for f in resolve_model("tiny").iterdir():
        shutil.copy(f, folder / f.name)
    # The tiny random model greedily repeats the last prompt token: make 30 its EOS.
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((folder / name).read_text())
        raw["eos_token_id"] = 30
        (folder / name).write_text(json.dumps(raw))
    core = EngineCore(folder, max_batch=4, max_context=40, threads=1)
    core.start()
    yield core
    core.shutdown()


def run(core: EngineCore, **kwargs: Any) -> Any:
    return core.submit(GenerationRequest(**kwargs)).result(timeout=60)


def test_eos_stops_unless_ignored(core_with_eos: EngineCore) -> None:
    prompt = [1, 5, 30]
    stopped = run(core_with_eos, input_ids=prompt, temperature=0.0, max_new_tokens=10)
    assert stopped.output_ids == [30]
    assert (stopped.finish_type, stopped.matched) == ("stop", 30)
    ignored = run(
        core_with_eos, input_ids=prompt, temperature=0.0, max_new_tokens=10, ignore_eos=True
    )
    assert ignored.output_ids == [30] * 10
    assert ignored.finish_type == "length"


def test_context_limit_and_unbounded_max_new_tokens(core_with_eos: EngineCore) -> None:
    prompt = [1] + [7] * 29
    out = run(core_with_eos, input_ids=prompt, temperature=0.0, max_new_tokens=None)
    assert len(prompt) + len(out.output_ids) == core_with_eos.max_context
    assert out.finish_type == "length"
    with pytest.raises(ValueError, match="context length"):
        core_with_eos.submit(GenerationRequest(input_ids=[1] * 40))


def test_more_requests_than_slots_all_finish_correctly(core_with_eos: EngineCore) -> None:
    """10 requests on 4 slots: sequences leave and join mid-flight, results stay per request."""
    requests = [
        GenerationRequest(input_ids=[1, 8 + i], temperature=1.0, seed=i, max_new_tokens=3 + i)
        for i in range(10)
    ]
    alone = [core_with_eos.submit(r).result(timeout=60) for r in requests]
    futures = [core_with_eos.submit(r) for r in requests]
    together = [f.result(timeout=60) for f in futures]
    for a, t in zip(alone, together, strict=True):
        assert t.output_ids == a.output_ids
        assert t.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-5)


def test_cancelled_request_leaves_the_batch(core_with_eos: EngineCore) -> None:
    core_with_eos.pause("in_place").result(timeout=10)
    future = core_with_eos.submit(
        GenerationRequest(input_ids=[1, 2], max_new_tokens=20, ignore_eos=True)
    )
    assert future.cancel()
    core_with_eos.resume().result(timeout=10)
    after = run(core_with_eos, input_ids=[1, 5], temperature=0.0, max_new_tokens=3)
    assert after.output_ids == [5, 5, 5]


def test_core_returns_top_logprobs_per_output_token(core_with_eos: EngineCore) -> None:
    prompt = [1, 8, 9, 10]
    greedy = run(core_with_eos, input_ids=prompt, temperature=0.0, max_new_tokens=4,
                 top_logprobs_num=3, ignore_eos=True)  # fmt: skip
    check_top_lists(greedy.output_top_logprobs, greedy.output_ids, greedy.output_logprobs, 3)
    assert [step[0] for step in greedy.output_top_logprobs] == list(
        zip(greedy.output_logprobs, greedy.output_ids, strict=True)
    )
    seeded = dict(input_ids=prompt, temperature=1.0, seed=4, max_new_tokens=4, ignore_eos=True)
    sampled = run(core_with_eos, **seeded, top_logprobs_num=5, token_texts=True)
    check_top_lists(sampled.output_top_logprobs, sampled.output_ids, sampled.output_logprobs, 5)
    assert sampled.top_token_texts == [
        [core_with_eos.decode_text([t], False) for _, t in step]
        for step in sampled.output_top_logprobs
    ]
    # Asking changes nothing else: same tokens and logprobs as without, which gets None.
    plain = run(core_with_eos, **seeded)
    assert plain.output_top_logprobs is None
    assert plain.top_token_texts is None
    assert plain.output_ids == sampled.output_ids
    assert plain.output_logprobs == sampled.output_logprobs
    with pytest.raises(ValueError, match="top_logprobs_num"):
        core_with_eos.submit(GenerationRequest(input_ids=prompt, top_logprobs_num=-1))
