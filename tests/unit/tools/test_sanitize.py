"""Odd tool output is data: whatever a tool returns becomes an observation the tokenizer and the
stores accept (UTF-8 without NUL, capped), and what was replaced or cut is counted.

The tokenizer and chat template are the real SmolLM2 ones; the scripted engine and in-memory
sandbox of the episode test are fakes inside this unit test of the tool boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from omniloop import Task, ToolAgent, reward
from omniloop.agents.chat import ChatFormat
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.models import load_tokenizer
from omniloop.platform.control.episode import EpisodeSettings, run_episode
from omniloop.sandboxes.base import ExecResult
from omniloop.tools import (
    DEFAULT_MAX_OUTPUT_CHARS,
    ParsedCall,
    ToolContext,
    Toolset,
    render_result,
    sanitize_output,
    tool,
    tool_call_metrics,
)
from omniloop.tools.base import OUTPUT_TRUNCATION_MARKER

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Every code point, surrogates included, plus dense surrogates, NUL and other controls.
ANY_CHAR = st.one_of(
    st.characters(codec=None, exclude_categories=()),
    SURROGATES,
    st.sampled_from(["\x00", "\x1b", "\r", "\x7f", "\x85", "\ufffd", "\ufeff"]),
)
ANY_TEXT = st.text(alphabet=ANY_CHAR, max_size=300)


def unsafe(text: str) -> int:
    return sum(c == "\x00" or 0xD800 <= ord(c) <= 0xDFFF for c in text)


def assert_observation(text: str) -> None:
    """What every observation must be: valid UTF-8 without NUL."""
    assert isinstance(text, str)
    text.encode("utf-8")  # raises on a lone surrogate
    assert "\x00" not in text


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def chat(tokenizer) -> ChatFormat:
    return ChatFormat(tokenizer)


# -- sanitize_output ---------------------------------------------------------------------------


@given(text=ANY_TEXT)
def test_sanitized_text_is_utf8_and_each_unsafe_character_is_one_counted_replacement(text):
    clean = sanitize_output(text)
    assert_observation(clean.text)
    assert clean.truncated == 0
    assert clean.replaced == unsafe(text)
    assert len(clean.text) == len(text)
    for before, after in zip(text, clean.text, strict=True):
        assert after == ("\ufffd" if unsafe(before) else before)


@given(text=ANY_TEXT, cap=st.integers(2, 40))
def test_long_text_keeps_head_and_tail_around_a_marker(text, cap):
    clean = sanitize_output(text, cap)
    assert_observation(clean.text)
    if len(text) <= cap:
        assert clean.truncated == 0
        return
    head, tail = cap // 2, cap - cap // 2
    assert clean.truncated == len(text) - cap
    marker = OUTPUT_TRUNCATION_MARKER.format(n=len(text) - cap)
    kept = text[:head] + marker + text[-tail:]
    expected = "".join("\ufffd" if unsafe(c) else c for c in kept)
    assert clean.text == expected
    assert clean.replaced == unsafe(text[:head]) + unsafe(text[-tail:])


def test_a_huge_output_is_cut_to_the_default_cap_without_scanning_it_whole():
    text = "a" * (50 * 1024 * 1024) + "\udcff"
    clean = sanitize_output(text)
    assert clean.truncated == len(text) - DEFAULT_MAX_OUTPUT_CHARS
    assert len(clean.text) < DEFAULT_MAX_OUTPUT_CHARS + 64
    assert f"[truncated {clean.truncated} characters]" in clean.text
    assert clean.text.endswith("a\ufffd")
    assert clean.replaced == 1


def test_a_cap_below_two_is_refused():
    with pytest.raises(ValueError, match="max_chars must be at least 2, got 1"):
        sanitize_output("abc", 1)
    with pytest.raises(ValueError, match="max_output_chars must be at least 2, got 0"):
        Toolset([], max_output_chars=0)


# -- render_result -------------------------------------------------------------------------


@dataclasses.dataclass
class Point:
    x: int
    label: str


class Reading(BaseModel):
    value: float
    unit: str


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "null"),
        (3, "3"),
        (1.5, "1.5"),
        (True, "true"),
        ({"a": [1, None]}, '{"a":[1,null]}'),
        ((1, "x"), '[1,"x"]'),
        (Point(1, "p"), '{"x":1,"label":"p"}'),
        (Reading(value=2.0, unit="V"), '{"value":2.0,"unit":"V"}'),
        (b"caf\xc3\xa9", "café"),
        (bytearray(b"ok"), "ok"),
        (memoryview(b"ok"), "ok"),
    ],
)
def test_non_text_return_values_are_rendered_as_documented(value, shown):
    assert render_result(value) == shown


def test_invalid_bytes_and_surrogates_inside_values_survive_rendering_as_surrogates():
    assert render_result(b"a\xff\xfeb") == "a\udcff\udcfeb"
    assert sanitize_output(render_result(b"a\xff\xfeb")).text == "a\ufffd\ufffdb"
    rendered = render_result({"name": "\udcff.txt", "raw": b"\xff", "\udc80key": [b"ok"]})
    assert json.loads(sanitize_output(rendered).text) == {
        "name": "\ufffd.txt",
        "raw": "\ufffd",
        "\ufffdkey": ["ok"],
    }


# -- the toolset boundary --------------------------------------------------------------------


@tool
def give(ctx: ToolContext) -> object:
    """Return whatever the test put in the episode state."""
    return ctx.state["value"]


class RawTool:
    """A `Tool` outside the contract: its `call` returns whatever it was given, not text."""

    name = "raw"
    description = "Return a raw value."
    timeout: float | None = None
    schema: dict[str, Any] = {
        "type": "function",
        "function": {"name": "raw", "description": "", "parameters": {"type": "object"}},
    }

    async def call(self, arguments: Mapping[str, Any], ctx: ToolContext) -> Any:
        return ctx.state["value"]


GIVE = ParsedCall(name="give", arguments={}, raw="<tool_call>give</tool_call>")
RAW = ParsedCall(name="raw", arguments={}, raw="<tool_call>raw</tool_call>")

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    ANY_TEXT,
    st.binary(max_size=50),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(ANY_TEXT, inner, max_size=4),
    ),
    max_leaves=12,
)
huge_text = st.builds(
    lambda chunk, n: chunk * n,
    st.text(alphabet=ANY_CHAR, min_size=1, max_size=5),
    st.integers(1, 3000),
)
returns = st.one_of(
    ANY_TEXT,
    st.binary(max_size=300),
    huge_text,
    json_value,
    st.builds(Point, st.integers(), ANY_TEXT),
)


@given(value=returns, cap=st.integers(2, 2000), raw=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_return_value_becomes_an_observation_the_episode_can_continue_with(
    chat, value, cap, raw
):
    toolset = Toolset([give, RawTool()], max_output_chars=cap)
    ctx = ToolContext(state={"value": value})
    record = asyncio.run(toolset.execute(RAW if raw else GIVE, ctx, turn=0))
    assert record.error is None, record.output
    assert_observation(record.output)
    marker = OUTPUT_TRUNCATION_MARKER.format(n=record.truncated_chars)
    assert len(record.output) <= cap + (len(marker) if record.truncated_chars else 0)
    text = render_result(value)
    assert record.truncated_chars == max(0, len(text) - cap)
    if not record.truncated_chars:
        assert record.sanitized_chars == unsafe(text)
    # The record is storable, and the observation tokenizes into the next prompt.
    json.loads(record.model_dump_json())
    ids = chat.observation_ids([{"role": "tool", "content": record.output}], closed=True)
    assert ids
    metrics = tool_call_metrics([record])
    assert metrics.get("tool_calls/sanitized_chars", 0) == record.sanitized_chars
    assert metrics.get("tool_calls/truncated", 0) == (1 if record.truncated_chars else 0)


async def test_bytes_with_nul_and_invalid_utf8_are_decoded_and_counted():
    @tool
    def dump() -> bytes:
        """Raw bytes."""
        return b"\x00ok\xff"

    record = await Toolset([dump]).execute(
        ParsedCall(name="dump", arguments={}, raw=""), ToolContext()
    )
    assert record.error is None
    assert record.output == "\ufffdok\ufffd"
    assert record.sanitized_chars == 2
    assert record.truncated_chars == 0


async def test_an_error_message_with_an_undecodable_file_name_is_sanitized(tmp_path):
    (tmp_path / os.fsdecode(b"\xff-locked")).write_text("x")
    folder = os.fsdecode(tmp_path)

    @tool
    def open_first() -> str:
        """Refuse to open the first file, naming it."""
        raise ValueError(f"{os.listdir(folder)[0]} is locked")

    record = await Toolset([open_first]).execute(
        ParsedCall(name="open_first", arguments={}, raw=""), ToolContext()
    )
    assert record.error == "tool_error"
    assert record.output == "Error: tool 'open_first' failed: ValueError: \ufffd-locked is locked"
    assert record.sanitized_chars == 1


async def test_a_huge_output_is_capped_and_counted_at_the_toolset_cap():
    @tool
    def flood() -> str:
        """Print a lot."""
        return "x" * 5000 + "END"

    record = await Toolset([flood], max_output_chars=100).execute(
        ParsedCall(name="flood", arguments={}, raw=""), ToolContext()
    )
    assert record.error is None
    assert record.truncated_chars == 4903
    assert record.output == "x" * 50 + "\n[truncated 4903 characters]\n" + "x" * 47 + "END"
    assert tool_call_metrics([record])["tool_calls/truncated"] == 1


# -- a whole episode -------------------------------------------------------------------------


class ScriptedEngine:
    """Says the scripted texts turn by turn (the last one again if it runs out)."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = [[*tokenizer.encode(t, add_special_tokens=False), end] for t in texts]
        self.calls = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        ids = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[-1.0] * len(ids),
            finish_reason="stop",
            weight_version=0,
        )


class UnusedSandboxes:
    async def acquire(self) -> Any:
        raise AssertionError("no tool in this episode needs a sandbox")

    async def release(self, sandbox: Any) -> None: ...


@reward
def lists_a_file(task: dict, response: str) -> float:
    return float("file" in response)


async def test_an_episode_whose_tool_returns_a_lone_surrogate_finishes(tokenizer, tmp_path: Path):
    # A real non-UTF-8 file name: os.listdir gives it back as a lone surrogate.
    (tmp_path / os.fsdecode(b"report-\xff.txt")).write_text("x")
    folder = os.fsdecode(tmp_path)

    @tool
    def list_files() -> str:
        """List the files of the work folder."""
        return "\n".join(sorted(os.listdir(folder)))

    assert "\udcff" in list_files()
    agent = ToolAgent([list_files])
    engine = ScriptedEngine(
        tokenizer,
        ['<tool_call>{"name": "list_files", "arguments": {}}</tool_call>', "There is one file."],
    )
    trajectory = await run_episode(
        agent,
        Task(id="t", prompt="What is in the folder?"),
        engine=engine,
        chat=ChatFormat(tokenizer, agent.tool_schemas),
        sandbox_provider=UnusedSandboxes(),
        rewards=[lists_a_file],
        settings=EpisodeSettings(run_id="r", episode_id="t/0", max_turns=4),
    )
    assert trajectory.meta.stop_reason == "stop", trajectory.meta.error
    assert trajectory.meta.error is None
    assert trajectory.reward == 1.0
    [call] = trajectory.meta.tool_calls
    assert call.error is None
    assert call.output == "report-\ufffd.txt"
    assert call.sanitized_chars == 1
    assert trajectory.meta.metrics["tool_calls/sanitized_chars"] == 1
    # The model was shown the replacement character, and the trajectory stores as JSON.
    assert "report-\ufffd.txt" in tokenizer.decode(trajectory.input_ids)
    assert json.loads(trajectory.model_dump_json())["meta"]["tool_calls"][0]["sanitized_chars"] == 1


def test_sandbox_exec_results_pass_the_boundary_unchanged_when_clean():
    result = ExecResult(exit_code=1, stdout="\x1b[31mred\x1b[0m\r\n", stderr="", duration=0.0)
    clean = sanitize_output(render_result(result))
    assert clean.text == "\x1b[31mred\x1b[0m\r\n\n[exit code 1]"
    assert (clean.replaced, clean.truncated) == (0, 0)
