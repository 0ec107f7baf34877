"""Clients of the session's tiny engine (`tiny_engine_url`, started in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from omniloop.inference.client import EngineClient


@pytest.fixture
async def http(tiny_engine_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """Raw HTTP to the engine, for checking the wire format itself."""
    async with httpx.AsyncClient(base_url=tiny_engine_url, timeout=120) as client:
        yield client


@pytest.fixture
async def engine(tiny_engine_url: str) -> AsyncIterator[EngineClient]:
    async with EngineClient(tiny_engine_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The tiny model's tokenizer (SmolLM2's)."""
    from omniloop.inference.models import load_tokenizer

    return load_tokenizer("tiny")
