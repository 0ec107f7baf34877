"""`Toolset.execute`: every failure the model can cause is an observation with an error code."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pydantic import BaseModel

from omniloop.errors import SandboxError, ToolError
from omniloop.sandboxes.base import ExecResult
from omniloop.tools import ParsedCall, ToolContext, Toolset, parse_tool_calls, tool
from omniloop.tools.base import tool_call_metrics


class Item(BaseModel):
    name: str
    qty: int


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


@tool
async def order(items: list[Item], express: bool = False) -> dict:
    """Place an order."""
    return {"count": sum(i.qty for i in items), "express": express}


@tool
def explode(message: str) -> str:
    """Raise."""
    raise ValueError(message)


@tool
def refuse() -> str:
    """Raise a ToolError."""
    raise ToolError("the file is locked; try again later")


@tool(timeout=0.2)
async def sleepy(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "woke"


RELEASE_SYNC_SLEEPY = threading.Event()
"""Set by a test to end `sync_sleepy`'s wait early (after its timeout was asserted)."""


@tool(timeout=0.2)
def sync_sleepy(seconds: float) -> str:
    """Sleep in a thread."""
    RELEASE_SYNC_SLEEPY.wait(seconds)
    return "woke"


@tool
async def raises_timeout_itself() -> str:
    """A TimeoutError from inside the tool, not from its time limit."""
    raise TimeoutError("upstream took too long")


@tool
def remember(key: str, value: str, ctx: ToolContext) -> str:
    """Store a value in the episode state."""
    ctx.state[key] = value
    return f"{ctx.episode_id}:{ctx.task['id']}:{sorted(ctx.state)}"


@tool
def shell_result() -> ExecResult:
    """Return an ExecResult."""
    return ExecResult(exit_code=2, stdout="out\n", stderr="err", duration=0.1)


@tool
def unserializable() -> object:
    """Return something JSON cannot hold."""
    return object()


@tool
async def needs_sandbox(ctx: ToolContext) -> str:
    """Touch the sandbox."""
    return (await ctx.sandbox.exec("true")).text()


@tool
async def broken_sandbox() -> str:
    """The sandbox itself fails."""
    raise SandboxError("container vanished")


@pytest.fixture
def toolset() -> Toolset:
    return Toolset(
        [
            add,
            order,
            explode,
            refuse,
            sleepy,
            sync_sleepy,
            raises_timeout_itself,
            remember,
            shell_result,
            unserializable,
            needs_sandbox,
            broken_sandbox,
        ]
    )


@pytest.fixture
def ctx() -> ToolContext:
    return ToolContext(task={"id": "t1"}, episode_id="ep")


def call(name: str, **arguments: object) -> ParsedCall:
    return ParsedCall(name=name, arguments=dict(arguments), raw=f"<tool_call>{name}</tool_call>")


async def test_successful_call_returns_the_output_and_no_error(toolset, ctx):
    record = await toolset.execute(call("add", a=2, b=3), ctx, turn=4)
    assert record.output == "5"
    assert record.error is None
    assert record.turn == 4
    assert record.name == "add"
    assert record.arguments == {"a": 2, "b": 3}
    assert record.duration >= 0


async def test_unknown_tool_lists_the_available_tools(toolset, ctx):
    record = await toolset.execute(call("subtract", a=1), ctx)
    assert record.error == "unknown_tool"
    assert record.output.startswith("Error: unknown tool 'subtract'.")
    assert "add, order, explode" in record.output


async def test_bad_arguments_message_names_each_argument_problem_and_the_signature(toolset, ctx):
    record = await toolset.execute(call("add", a="two", c=1), ctx)
    assert record.error == "invalid_arguments"
    lines = record.output.splitlines()
    assert lines[0] == "Error: invalid arguments for tool 'add':"
    assert lines[1].startswith("- a: Input should be a valid integer")
    assert "got 'two'" in lines[1]
    assert lines[1].endswith("(expected integer)")
    assert lines[2] == "- c: unexpected argument"
    assert lines[3] == "Expected: add(a: integer, b: integer = 1)"
    assert "pydantic" not in record.output
    assert "Traceback" not in record.output


async def test_missing_argument_and_nested_errors_are_located(toolset, ctx):
    record = await toolset.execute(call("order", items=[{"name": "x", "qty": "many"}]), ctx)
    assert record.error == "invalid_arguments"
    assert "- items.0.qty: Input should be a valid integer" in record.output
    record = await toolset.execute(call("order"), ctx)
    assert "- items: missing required argument (expected array of object)" in record.output


async def test_valid_nested_arguments_reach_the_function_as_models(toolset, ctx):
    record = await toolset.execute(call("order", items=[{"name": "x", "qty": 2}] * 2), ctx)
    assert record.error is None
    assert record.output == '{"count":4,"express":false}'


async def test_raising_tool_becomes_a_tool_error_without_a_traceback(toolset, ctx):
    record = await toolset.execute(call("explode", message="bad input"), ctx)
    assert record.error == "tool_error"
    assert record.output == "Error: tool 'explode' failed: ValueError: bad input"


async def test_tool_error_message_is_shown_as_written(toolset, ctx):
    record = await toolset.execute(call("refuse"), ctx)
    assert record.error == "tool_error"
    assert record.output == "Error: tool 'refuse' failed: the file is locked; try again later"


async def test_async_tool_past_its_timeout_is_stopped(toolset, ctx):
    started = time.monotonic()
    record = await toolset.execute(call("sleepy", seconds=30), ctx)
    assert time.monotonic() - started < 5
    assert record.error == "tool_timeout"
    assert record.output == "Error: tool 'sleepy' did not finish within 0.2s."


async def test_sync_tool_past_its_timeout_is_abandoned(toolset, ctx):
    # The tool blocks for 10 s unless released: the toolset must give up at its 0.2 s timeout,
    # so returning within 5 s (room for a loaded machine) tells abandoning from waiting.
    RELEASE_SYNC_SLEEPY.clear()
    started = time.monotonic()
    try:
        record = await toolset.execute(call("sync_sleepy", seconds=10.0), ctx)
        elapsed = time.monotonic() - started
    finally:
        RELEASE_SYNC_SLEEPY.set()  # the abandoned thread ends now instead of after 10 s
    assert elapsed < 5, f"execute returned after {elapsed:.1f}s: it waited for the tool"
    assert record.error == "tool_timeout"


async def test_toolset_default_timeout_applies_to_tools_without_one(ctx):
    @tool
    async def slow() -> str:
        """Slow."""
        await asyncio.sleep(30)
        return ""

    record = await Toolset([slow], default_timeout=0.1).execute(call("slow"), ctx)
    assert record.error == "tool_timeout"


async def test_timeout_error_raised_by_the_tool_is_a_tool_error(toolset, ctx):
    record = await toolset.execute(call("raises_timeout_itself"), ctx)
    assert record.error == "tool_error"
    assert "TimeoutError: upstream took too long" in record.output


async def test_context_carries_task_episode_and_state_across_calls(toolset, ctx):
    await toolset.execute(call("remember", key="a", value="1"), ctx)
    record = await toolset.execute(call("remember", key="b", value="2"), ctx)
    assert record.output == "ep:t1:['a', 'b']"
    assert ctx.state == {"a": "1", "b": "2"}


async def test_exec_result_is_rendered_as_its_text(toolset, ctx):
    record = await toolset.execute(call("shell_result"), ctx)
    assert record.error is None
    assert record.output == "out\n\nerr\n[exit code 2]"


async def test_unserializable_return_value_is_a_tool_error(toolset, ctx):
    record = await toolset.execute(call("unserializable"), ctx)
    assert record.error == "tool_error"
    assert "cannot be shown as text" in record.output


async def test_parse_errors_become_observations_with_the_expected_format(toolset, ctx):
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>')
    record = await toolset.execute(parsed.calls[0], ctx, turn=1)
    assert record.error == "parse_error"
    assert record.name is None
    assert record.output.startswith("Error: could not parse the tool call: the call is not valid")
    assert '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>' in record.output
    assert record.raw == parsed.calls[0].raw


async def test_sandbox_failures_propagate_as_infrastructure_errors(toolset, ctx):
    with pytest.raises(SandboxError, match="container vanished"):
        await toolset.execute(call("broken_sandbox"), ctx)
    with pytest.raises(SandboxError, match="has no sandbox"):
        await toolset.execute(call("needs_sandbox"), ctx)


async def test_cancellation_propagates(toolset, ctx):
    task = asyncio.create_task(toolset.execute(call("sleepy", seconds=0.15), ctx))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_metrics_count_every_outcome(toolset, ctx):
    parsed = parse_tool_calls(
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "nope"}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>'
        '<tool_call>{"name": "explode", "arguments": {"message": "m"}}</tool_call>'
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 5}}</tool_call>'
    )
    records = await toolset.execute_all(parsed.calls, ctx, turn=0)
    assert [r.error for r in records] == [
        "parse_error",
        None,
        "unknown_tool",
        "invalid_arguments",
        "tool_error",
        "tool_timeout",
    ]
    expected = {
        "tool_calls/total": 6,
        "tool_calls/ok": 1,
        "tool_calls/parse_errors": 1,
        "tool_calls/unknown_tools": 1,
        "tool_calls/invalid_arguments": 1,
        "tool_calls/tool_errors": 1,
        "tool_calls/timeouts": 1,
    }
    assert tool_call_metrics(records) == expected
    assert dict(toolset.metrics) == expected


def test_duplicate_tool_names_are_rejected():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        Toolset([add, add])


def test_non_tools_are_rejected():
    def plain(a: int) -> int:
        return a

    with pytest.raises(TypeError, match="decorate the function with @tool"):
        Toolset([plain])  # type: ignore[list-item]


def test_toolset_exposes_names_and_schemas(toolset):
    assert toolset.names[:2] == ["add", "order"]
    assert "add" in toolset
    assert toolset["add"] is add
    assert len(toolset.schemas()) == len(toolset)
    assert toolset.schemas()[0]["function"]["name"] == "add"
