"""`/generate` of the CPU engine over real HTTP: SGLang's shapes, batching, sampling, stops."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch

from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient
from omniloop.inference.models import resolve_model
from omniloop.inference.router import EngineRouter

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30],
    [1, 4093, 314, 260, 3575, 282, 4649, 47],
    [1, 22, 23, 24, 25],
    [1, 504, 3032, 314, 260, 1234, 282, 3641, 284, 2059, 30, 198],
    [1, 7],
    [1, 1780, 1780, 1780, 1780, 1780, 1780],
]


async def generate(http: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(max_new_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra}


def seeded(max_new_tokens: int = 16, seed: int = 5, **extra: Any) -> dict[str, Any]:
    # The tiny random model's greedy output repeats the last prompt token; seeded sampling
    # gives varied, reproducible outputs for tests that need different tokens.
    return {"max_new_tokens": max_new_tokens, "temperature": 1.0, "sampling_seed": seed, **extra}


async def test_single_result_has_sglang_fields(http: httpx.AsyncClient) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": greedy(6), "return_logprob": True}
    out = await generate(http, body)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"} <= set(
        meta
    )
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPTS[0])
    assert meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert meta["cached_tokens"] == 0
    # SGLang's weight_version is a string; this engine's holds an integer counter.
    assert isinstance(meta["weight_version"], str)
    assert int(meta["weight_version"]) >= 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(len(t) == 3 and isinstance(t[0], float) and t[0] <= 0 for t in triples)
    assert all(t[2] is None for t in triples)
    assert isinstance(out["text"], str)


async def test_logprobs_only_when_asked(http: httpx.AsyncClient) -> None:
    out = await generate(http, {"input_ids": PROMPTS[1], "sampling_params": greedy(3)})
    assert "output_token_logprobs" not in out["meta_info"]
    assert len(out["output_ids"]) == 3


async def test_return_text_in_logprobs_fills_the_text_slot(
    http: httpx.AsyncClient, tokenizer: Any
) -> None:
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": greedy(4),
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    out = await generate(http, body)
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[2] for t in triples] == [tokenizer.decode([t[1]]) for t in triples]


async def test_batched_request_returns_a_list_in_prompt_order(http: httpx.AsyncClient) -> None:
    singles = [
        await generate(http, {"input_ids": p, "sampling_params": greedy(5 + i)})
        for i, p in enumerate(PROMPTS[:3])
    ]
    batch = await generate(
        http,
        {
            "input_ids": PROMPTS[:3],
            "sampling_params": [greedy(5 + i) for i in range(3)],
            "return_logprob": [True, False, True],
            "rid": "job",
        },
    )
    assert isinstance(batch, list)
    assert len(batch) == 3
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    assert [b["meta_info"]["id"] for b in batch] == ["job_0", "job_1", "job_2"]
    assert ["output_token_logprobs" in b["meta_info"] for b in batch] == [True, False, True]


async def test_rid_is_echoed_as_id(http: httpx.AsyncClient) -> None:
    out = await generate(
        http, {"input_ids": PROMPTS[4], "rid": "abc", "sampling_params": greedy(1)}
    )
    assert out["meta_info"]["id"] == "abc"


async def test_greedy_is_deterministic(engine: EngineClient) -> None:
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0)
    first = await engine.generate(PROMPTS[3], sampling)
    second = await engine.generate(PROMPTS[3], sampling)
    assert first.output_ids == second.output_ids
    assert first.output_logprobs == second.output_logprobs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_concurrent_requests_batch_to_the_same_tokens_as_sequential(
    engine: EngineClient, temperature: float
) -> None:
    """Continuous batching must not change results (one at a time vs all at once)."""
    sampling = [
        SamplingParams(max_new_tokens=8 + 4 * i, temperature=temperature, seed=i) for i in range(6)
    ]
    sequential = [await engine.generate(p, s) for p, s in zip(PROMPTS, sampling, strict=True)]
    concurrent = await asyncio.gather(
        *(engine.generate(p, s) for p, s in zip(PROMPTS, sampling, strict=True))
    )
    for seq, con in zip(sequential, concurrent, strict=True):
        assert con.output_ids == seq.output_ids
        assert con.output_logprobs == pytest.approx(seq.output_logprobs, abs=1e-4)
        assert con.finish_reason == "length"


async def test_seeded_sampling_is_deterministic_per_seed(engine: EngineClient) -> None:
    def sampling(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed)

    # The same seed twice, even while other sampled requests share the batch.
    runs = await asyncio.gather(
        engine.generate(PROMPTS[0], sampling(7)),
        engine.generate(PROMPTS[1], sampling(8)),
        engine.generate(PROMPTS[0], sampling(7)),
        engine.generate(PROMPTS[0], sampling(9)),
    )
    alone = await engine.generate(PROMPTS[0], sampling(7))
    assert runs[0].output_ids == runs[2].output_ids == alone.output_ids
    assert runs[3].output_ids != runs[0].output_ids


async def test_top_k_one_samples_the_greedy_tokens(engine: EngineClient) -> None:
    greedy_out = await engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=12, temperature=0))
    topk_out = await engine.generate(
        PROMPTS[3], SamplingParams(max_new_tokens=12, temperature=1.3, top_k=1, seed=3)
    )
    assert topk_out.output_ids == greedy_out.output_ids


async def test_logprobs_are_of_the_raw_distribution(engine: EngineClient) -> None:
    """Logprobs are log_softmax of the temperature-1 logits, whatever the sampling settings."""
    from transformers import LlamaForCausalLM

    out = await engine.generate(
        PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=1)
    )
    model = LlamaForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1] + out.output_ids])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(PROMPTS[1]) - 1
    expected = [logprobs[start + i, t].item() for i, t in enumerate(out.output_ids)]
    assert out.output_logprobs == pytest.approx(expected, abs=1e-4)


async def test_stop_token_ids_stop_and_keep_the_token(http: httpx.AsyncClient) -> None:
    base = await generate(http, {"input_ids": PROMPTS[0], "sampling_params": seeded(20)})
    ids = base["output_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = await generate(
        http, {"input_ids": PROMPTS[0], "sampling_params": seeded(20, stop_token_ids=[ids[k]])}
    )
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}


async def test_stop_string_stops_and_trims_the_text(
    http: httpx.AsyncClient, tokenizer: Any
) -> None:
    def sampling(**extra: Any) -> dict[str, Any]:
        return seeded(20, skip_special_tokens=False, **extra)

    base = await generate(http, {"input_ids": PROMPTS[1], "sampling_params": sampling()})
    ids = base["output_ids"]

    def first_at(i: int) -> bool:
        # The token's text occurs in the output for the first time when token i is sampled.
        stop = tokenizer.decode([ids[i]])
        before = tokenizer.decode(ids[:i])
        return bool(stop.strip()) and tokenizer.decode(ids[: i + 1]).find(stop) == len(before)

    k = next(i for i in range(2, len(ids)) if first_at(i))
    stop = tokenizer.decode([ids[k]])
    out = await generate(
        http, {"input_ids": PROMPTS[1], "sampling_params": sampling(stop=[stop, "\x00never"])}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[: k + 1]
    assert out["text"] == tokenizer.decode(ids[:k])
    kept = await generate(
        http, {"input_ids": PROMPTS[1], "sampling_params": sampling(stop=stop, no_stop_trim=True)}
    )
    assert kept["text"].endswith(stop)


async def test_max_new_tokens_and_zero_tokens(http: httpx.AsyncClient) -> None:
    out = await generate(http, {"input_ids": PROMPTS[2], "sampling_params": greedy(7)})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    empty = await generate(http, {"input_ids": PROMPTS[2], "sampling_params": greedy(0)})
    assert empty["output_ids"] == []
    assert empty["meta_info"]["finish_reason"]["type"] == "length"


async def test_context_length_ends_generation(
    http: httpx.AsyncClient, tiny_engine_max_context: int
) -> None:
    prompt = [1] + [30] * (tiny_engine_max_context - 6)
    out = await generate(
        http, {"input_ids": prompt, "sampling_params": greedy(100, ignore_eos=True)}
    )
    assert len(prompt) + len(out["output_ids"]) == tiny_engine_max_context
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_neutral_sglang_fields_are_accepted(http: httpx.AsyncClient) -> None:
    body = {
        "input_ids": PROMPTS[4],
        "stream": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "log_metrics": False,
        "sampling_params": greedy(2, n=1, repetition_penalty=1.0, min_p=0.0, top_k=-1),
    }
    out = await generate(http, body)
    assert len(out["output_ids"]) == 2


async def test_client_generate_batch(engine: EngineClient) -> None:
    sampling = SamplingParams(max_new_tokens=5, temperature=0.0)
    batch = await engine.generate_batch(PROMPTS[:2], sampling)
    singles = [await engine.generate(p, sampling) for p in PROMPTS[:2]]
    assert [b.output_ids for b in batch] == [s.output_ids for s in singles]
    assert all(b.prompt_tokens == len(p) for b, p in zip(batch, PROMPTS, strict=False))


# -- top logprobs ----------------------------------------------------------------------------


def raw_top(prompt: list[int], output_ids: list[int], n: int) -> list[list[tuple[int, float]]]:
    """The `n` most likely tokens after each output position, from transformers' forward."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output_ids])).logits[0].float()
    top = torch.topk(torch.log_softmax(logits, dim=-1), n, dim=-1)
    start = len(prompt) - 1
    return [
        list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
        for i in range(start, start + len(output_ids))
    ]


async def test_top_logprobs_over_http_in_sglang_shape(
    http: httpx.AsyncClient, tokenizer: Any
) -> None:
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": seeded(4),
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "top_logprobs_num": 3,
    }
    out = await generate(http, body)
    meta = out["meta_info"]
    top = meta["output_top_logprobs"]
    assert len(top) == len(out["output_ids"]) == 4
    for step, (logprob, token, _) in zip(top, meta["output_token_logprobs"], strict=True):
        assert len(step) == 3
        assert all(len(t) == 3 and t[2] == tokenizer.decode([t[1]]) for t in step)
        values = [t[0] for t in step]
        assert values == sorted(values, reverse=True)
        # The sampled token, when among the top, carries exactly its sampled logprob.
        assert {t[1]: t[0] for t in step}.get(token, logprob) == logprob
    # Without return_logprob (as SGLang) or with 0 there are none.
    del body["return_logprob"]
    assert "output_top_logprobs" not in (await generate(http, body))["meta_info"]
    zero = {**body, "return_logprob": True, "top_logprobs_num": 0}
    assert "output_top_logprobs" not in (await generate(http, zero))["meta_info"]


async def test_client_top_logprobs_equal_the_engine_and_the_raw_distribution(
    http: httpx.AsyncClient, engine: EngineClient
) -> None:
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    out = await engine.generate(PROMPTS[1], sampling, top_logprobs=5)
    assert out.top_logprobs is not None
    # Greedy: each step's first entry is the sampled token with its sampled logprob.
    assert [step[0] for step in out.top_logprobs] == list(
        zip(out.output_ids, out.output_logprobs, strict=True)
    )
    # The same numbers as the engine's own answer (through the client unchanged) ...
    wire = await generate(
        http,
        {
            "input_ids": PROMPTS[1],
            "sampling_params": greedy(4),
            "return_logprob": True,
            "top_logprobs_num": 5,
        },
    )
    assert out.top_logprobs == [
        [(t[1], t[0]) for t in step] for step in wire["meta_info"]["output_top_logprobs"]
    ]
    # ... and those of the raw (temperature-1, untruncated) distribution.
    expected = raw_top(PROMPTS[1], out.output_ids, 5)
    for got, want in zip(out.top_logprobs, expected, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    plain = await engine.generate(PROMPTS[1], sampling)
    assert plain.top_logprobs is None
    assert plain.output_ids == out.output_ids


async def test_batched_top_logprobs_per_item(http: httpx.AsyncClient) -> None:
    body = {
        "input_ids": PROMPTS[:3],
        "sampling_params": greedy(3),
        "return_logprob": [True, True, False],
        "top_logprobs_num": [2, 0, 4],
    }
    asks, zero, no_logprob = await generate(http, body)
    assert [len(step) for step in asks["meta_info"]["output_top_logprobs"]] == [2, 2, 2]
    assert "output_top_logprobs" not in zero["meta_info"]
    assert "output_top_logprobs" not in no_logprob["meta_info"]
    scalar = await generate(http, {**body, "return_logprob": True, "top_logprobs_num": 1})
    assert [len(r["meta_info"]["output_top_logprobs"]) for r in scalar] == [3, 3, 3]


async def test_router_forwards_top_logprobs(tiny_engine_url: str) -> None:
    router = EngineRouter.over([tiny_engine_url])
    try:
        sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
        out = await router.session("episode").generate(PROMPTS[2], sampling, top_logprobs=2)
        assert out.top_logprobs is not None
        assert [len(step) for step in out.top_logprobs] == [2, 2]
        assert (await router.generate(PROMPTS[2], sampling)).top_logprobs is None
    finally:
        await router.aclose()


def engine_series(text: str) -> dict[str, float]:
    """`omniloop_engine_*` samples of a `/metrics` text: name (with its finish label) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            finish = sample.labels.get("finish")
            out[sample.name + (f"/{finish}" if finish else "")] = sample.value
    return out


async def test_metrics_count_requests_tokens_and_cache_hits(http: httpx.AsyncClient) -> None:
    before = engine_series((await http.get("/metrics")).text)
    first = await generate(http, {"input_ids": PROMPTS[2] * 8, "sampling_params": greedy(4)})
    history = [*(PROMPTS[2] * 8), *first["output_ids"], 7, 8]
    second = await generate(http, {"input_ids": history, "sampling_params": greedy(4)})
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    after = engine_series(response.text)

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("omniloop_engine_requests_total/length") == 2
    assert grew("omniloop_engine_requests_total/stop") == 0
    assert grew("omniloop_engine_prompt_tokens_total") == len(PROMPTS[2]) * 8 + len(history)
    assert grew("omniloop_engine_generation_tokens_total") == 8
    assert second["meta_info"]["cached_tokens"] > 0
    assert grew("omniloop_engine_cached_tokens_total") == second["meta_info"]["cached_tokens"]
    # 4 passes a request; the last one of the second may be counted just after its answer.
    assert grew("omniloop_engine_forward_passes_total") >= 7
    assert after["omniloop_engine_running_requests"] == 0
    assert after["omniloop_engine_waiting_requests"] == 0
    version = (await http.get("/get_weight_version")).json()["weight_version"]
    assert after["omniloop_engine_weight_version"] == int(version)
    assert after["omniloop_engine_paused"] == 0
