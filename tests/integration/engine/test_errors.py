"""Malformed or unservable requests get a 4xx that says why; the client surfaces it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omniloop.errors import EngineError
from omniloop.inference.base import SamplingParams
from omniloop.inference.client import EngineClient, EngineHTTPError


async def rejected(http: httpx.AsyncClient, body: Any) -> str:
    """POST /generate, require a 400 in SGLang's ErrorResponse shape, return its message."""
    response = await http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["object"] == "error"
    assert error["code"] == 400
    return str(error["message"])


async def test_text_prompt_is_rejected_with_a_pointer_to_input_ids(
    http: httpx.AsyncClient,
) -> None:
    message = await rejected(http, {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert "input_ids" in message
    assert "tokens-in" in message


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": [""]}}, "stop"),
    ],
)
async def test_out_of_range_sampling_params(
    http: httpx.AsyncClient, body: dict[str, Any], needle: str
) -> None:
    assert needle in await rejected(http, body)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids.1"),
        ({"input_ids": [1, 2.5]}, "input_ids.1"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
        ({"input_ids": [1, 2], "sampling_params": [{"max_new_tokens": 2}]}, "single prompt"),
    ],
)
async def test_wrong_types(http: httpx.AsyncClient, body: dict[str, Any], needle: str) -> None:
    assert needle in await rejected(http, body)


@pytest.mark.parametrize(
    "extra",
    [
        {"top_logprobs_num": -1},
        {"top_logprobs_num": 21},
        {"top_logprobs_num": "3"},
        {"top_logprobs_num": 2.0},
        {"top_logprobs_num": True},
        {"top_logprobs_num": [2]},
        {"input_ids": [[1, 2], [1, 3]], "top_logprobs_num": [2, 2, 2]},
        {"input_ids": [[1, 2], [1, 3]], "top_logprobs_num": [2, 99]},
    ],
)
async def test_bad_top_logprobs_num(http: httpx.AsyncClient, extra: dict[str, Any]) -> None:
    body = {"input_ids": [1, 2], "return_logprob": True, **extra}
    message = await rejected(http, body)
    assert "top_logprobs_num" in message
    if extra["top_logprobs_num"] in (-1, 21) or extra["top_logprobs_num"] == [2, 99]:
        assert "between 0 and 20" in message


async def test_client_refuses_an_answer_without_asked_top_logprobs() -> None:
    """An engine that ignores `top_logprobs_num` (an older one) is an error, not silence."""

    async def answer(request: web.Request) -> web.Response:
        meta = {
            "id": "r",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, 7, None]],
        }
        return web.json_response({"text": "", "output_ids": [7], "meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", answer)
    async with TestServer(app) as server, EngineClient(str(server.make_url(""))) as client:
        plain = await client.generate([1, 2], SamplingParams(max_new_tokens=1))
        assert plain.top_logprobs is None
        with pytest.raises(EngineError, match="top_logprobs_num=2"):
            await client.generate([1, 2], SamplingParams(max_new_tokens=1), top_logprobs=2)


async def test_empty_prompts(http: httpx.AsyncClient) -> None:
    assert "empty" in await rejected(http, {"input_ids": []})
    assert "at least one token" in await rejected(http, {"input_ids": [[1, 2], []]})
    assert "input_ids" in await rejected(http, {"sampling_params": {"max_new_tokens": 1}})


async def test_prompt_longer_than_the_context(
    http: httpx.AsyncClient, tiny_engine_max_context: int
) -> None:
    message = await rejected(http, {"input_ids": [1] * tiny_engine_max_context})
    assert "context length" in message
    assert str(tiny_engine_max_context) in message


async def test_token_id_outside_the_vocabulary(http: httpx.AsyncClient) -> None:
    assert "vocabulary" in await rejected(http, {"input_ids": [1, 10**9]})
    assert "vocabulary" in await rejected(http, {"input_ids": [1, -3]})


async def test_unimplemented_sglang_fields_are_named(http: httpx.AsyncClient) -> None:
    message = await rejected(
        http, {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}
    )
    assert "frequency_penalty" in message
    assert "not implemented" in message
    assert "stream" in await rejected(http, {"input_ids": [1, 2], "stream": True})
    message = await rejected(http, {"input_ids": [1, 2], "sampling_params": {"seed": 3}})
    assert "sampling_params.seed: unknown field" in message


async def test_batch_list_lengths_must_match(http: httpx.AsyncClient) -> None:
    body = {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}]}
    assert "1 entries for a batch of 2" in await rejected(http, body)


async def test_non_json_body(http: httpx.AsyncClient) -> None:
    response = await http.post("/generate", content=b"input_ids=1")
    assert response.status_code == 400
    assert "JSON" in response.json()["message"]


async def test_client_raises_engine_error_with_status_and_body(
    engine: EngineClient, tiny_engine_max_context: int
) -> None:
    with pytest.raises(EngineHTTPError) as info:
        await engine.generate([1] * tiny_engine_max_context, SamplingParams(max_new_tokens=1))
    assert info.value.status_code == 400
    assert "context length" in info.value.body
    assert isinstance(info.value, EngineError)


async def test_client_against_a_dead_server() -> None:
    async with EngineClient("http://127.0.0.1:9", timeout=5, retries=2) as dead:
        assert await dead.health() is False
        with pytest.raises(EngineError):
            await dead.generate([1, 2], SamplingParams(max_new_tokens=1))
        with pytest.raises(EngineError):
            await dead.get_model_info()
