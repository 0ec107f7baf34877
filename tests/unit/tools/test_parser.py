"""The Hermes/Qwen tool-call parser: malformed and adversarial output is data, never a crash."""

from __future__ import annotations

import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from omniloop.tools import format_tool_call, parse_tool_calls


def test_single_call_with_text_around_it():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    result = parse_tool_calls(text)
    assert len(result.calls) == 1
    call = result.calls[0]
    assert (call.name, call.arguments, call.error) == ("add", {"a": 1, "b": 2}, None)
    assert call.raw == text[text.index("<tool_call>") :]
    assert result.text == "Let me add."


def test_several_calls_per_turn_keep_their_order_and_the_text_between():
    text = (
        "first "
        + format_tool_call("a", {"x": 1})
        + " then "
        + format_tool_call("b", {})
        + format_tool_call("c", {"y": [1, 2]})
        + " done"
    )
    result = parse_tool_calls(text)
    assert [c.name for c in result.calls] == ["a", "b", "c"]
    assert all(c.ok for c in result.calls)
    assert result.text == "first  then  done"


def test_whitespace_and_newlines_inside_the_tags_are_allowed():
    text = '<tool_call>  \n\t{"name":"f",\n "arguments":\n {"k": "v"}}  \n\n</tool_call>'
    assert parse_tool_calls(text).calls[0].arguments == {"k": "v"}


def test_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>'
    call = parse_tool_calls(text).calls[0]
    assert call.ok
    assert call.arguments == {"k": 2}


def test_missing_or_null_arguments_mean_no_arguments():
    for body in ('{"name": "f"}', '{"name": "f", "arguments": null}'):
        call = parse_tool_calls(f"<tool_call>{body}</tool_call>").calls[0]
        assert call.ok
        assert call.arguments == {}


def test_arguments_string_that_is_not_json_is_an_error_that_keeps_the_name():
    call = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>').calls[0]
    assert call.name == "f"
    assert call.arguments is None
    assert "not valid JSON" in (call.error or "")


def test_non_object_arguments_are_an_error():
    for args in ("[1, 2]", "3", '"[1]"', "true"):
        call = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>')
        assert call.calls[0].error is not None, args
        assert "must be a JSON object" in call.calls[0].error


def test_malformed_json_is_a_parse_error_spanning_to_the_closing_tag():
    text = 'a <tool_call>{"name": "f", "arguments": {"x": 1}</tool_call> b'
    result = parse_tool_calls(text)
    assert len(result.calls) == 1
    call = result.calls[0]
    assert call.error is not None
    assert "not valid JSON" in call.error
    assert call.raw == '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>'
    assert result.text == "a  b"


def test_extra_closing_brace_is_an_error_not_a_guess():
    call = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}}</tool_call>').calls[0]
    assert call.name == "f"
    assert call.error is not None
    assert "unexpected text" in call.error


def test_non_object_call_is_an_error():
    for body in ('["f", {}]', '"f"', "42", "null"):
        call = parse_tool_calls(f"<tool_call>{body}</tool_call>").calls[0]
        assert call.error is not None, body
        assert "JSON object" in call.error


def test_missing_name_is_an_error():
    call = parse_tool_calls('<tool_call>{"arguments": {"x": 1}}</tool_call>').calls[0]
    assert call.name is None
    assert call.error == 'the call has no "name"'


def test_name_that_is_not_a_non_empty_string_is_an_error():
    for name in ("1", "[]", '""', '"   "', "{}"):
        call = parse_tool_calls(f'<tool_call>{{"name": {name}}}</tool_call>').calls[0]
        assert call.name is None, name
        assert call.error is not None
        assert '"name" must be a non-empty string' in call.error


def test_missing_closing_tag_at_the_end_with_complete_json_is_a_call():
    # Engines that stop on "</tool_call>" strip the stop string from the output.
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
    call = parse_tool_calls(text).calls[0]
    assert call.ok
    assert call.arguments == {"x": 1}
    assert call.raw == text[3:]


def test_missing_closing_tag_with_truncated_json_is_an_error():
    text = 'ok <tool_call>{"name": "f", "arguments": {"x": '
    result = parse_tool_calls(text)
    assert len(result.calls) == 1
    assert "not closed" in (result.calls[0].error or "")
    assert result.calls[0].raw == text[3:]
    assert result.text == "ok"


def test_unclosed_call_before_another_call_is_an_error_and_the_next_call_still_parses():
    text = '<tool_call>{"name": "a", <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    calls = parse_tool_calls(text).calls
    assert len(calls) == 2
    assert "not closed before the next" in (calls[0].error or "")
    assert calls[0].raw == '<tool_call>{"name": "a", '
    assert calls[1].ok
    assert calls[1].name == "b"


def test_nested_tags_inside_json_strings_are_data():
    content = "<tool_call>{not a call}</tool_call> and </tool_call>"
    text = format_tool_call("write_file", {"path": "x", "content": content})
    result = parse_tool_calls(text)
    assert len(result.calls) == 1
    assert result.calls[0].arguments == {"path": "x", "content": content}
    assert result.text == ""


def test_stray_closing_tag_stays_in_the_text():
    result = parse_tool_calls("no call here </tool_call> really")
    assert result.calls == []
    assert result.text == "no call here </tool_call> really"


def test_calls_inside_think_are_reasoning_not_calls():
    text = (
        '<think>maybe <tool_call>{"name": "a", "arguments": {}}</tool_call></think>'
        + format_tool_call("b", {})
    )
    result = parse_tool_calls(text)
    assert [c.name for c in result.calls] == ["b"]
    assert result.reasoning == 'maybe <tool_call>{"name": "a", "arguments": {}}</tool_call>'


def test_unclosed_think_makes_the_rest_reasoning():
    text = "answer first <think>still thinking " + format_tool_call("a", {})
    result = parse_tool_calls(text)
    assert result.calls == []
    assert result.text == "answer first"


def test_close_think_without_open_ends_a_block_the_template_opened():
    text = "reasoning " + format_tool_call("a", {}) + "</think>\nfinal " + format_tool_call("b", {})
    result = parse_tool_calls(text)
    assert [c.name for c in result.calls] == ["b"]
    assert result.text == "final"
    assert result.reasoning.startswith("reasoning")


def test_deeply_nested_json_is_an_error_not_a_crash():
    text = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    result = parse_tool_calls(text)
    assert len(result.calls) == 1
    assert result.calls[0].error is not None


def test_degenerate_repetition_parses_in_linear_time():
    # CPU time of this thread, not wall time: time spent descheduled on a loaded machine does
    # not count, and the best of three drops what cache and allocator noise remain.
    def seconds(n: int) -> float:
        text = "<tool_call>{" * n + "x" * 5_000
        best = float("inf")
        for _ in range(3):
            started = time.thread_time()
            result = parse_tool_calls(text)
            best = min(best, time.thread_time() - started)
        assert len(result.calls) == n
        assert all(c.error is not None for c in result.calls)
        return best

    small, large = seconds(4_000), seconds(16_000)
    # 4x the calls: about 4x the time when linear, 16x when quadratic.
    assert large < 8 * small + 0.05


def test_raw_spans_cover_the_calls_exactly():
    text = "x" + format_tool_call("a", {"q": "<"}) + "y<tool_call>{bad}</tool_call>z"
    result = parse_tool_calls(text)
    rebuilt = "x" + result.calls[0].raw + "y" + result.calls[1].raw + "z"
    assert rebuilt == text


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**12), max_value=10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", '"', "\\", "\n", "["]
_NOISE = st.lists(st.sampled_from(_TAGS) | st.text(max_size=12), max_size=30).map("".join)
_PLAIN = st.text(max_size=40).filter(lambda s: "<" not in s)


@settings(max_examples=400, deadline=None)
@given(_NOISE)
def test_parser_never_raises_on_arbitrary_text(text: str):
    result = parse_tool_calls(text)
    for call in result.calls:
        assert call.raw.startswith("<tool_call>")
        assert call.raw in text
        assert (call.error is None) == (call.arguments is not None and call.name is not None)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parser_never_raises_on_unicode_text(text: str):
    parse_tool_calls(text)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=20).filter(str.strip),
            st.dictionaries(st.text(max_size=10), _JSON, max_size=5),
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(_PLAIN, min_size=5, max_size=5),
)
def test_well_formed_calls_round_trip(calls: list[tuple[str, dict]], gaps: list[str]):
    text = gaps[0]
    for i, (name, arguments) in enumerate(calls):
        text += format_tool_call(name, arguments) + gaps[(i + 1) % len(gaps)]
    result = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in result.calls] == [
        (name, json.loads(json.dumps(arguments)), None) for name, arguments in calls
    ]


def test_tag_inside_a_json_string_right_after_a_unicode_escape_is_data():
    # json.dumps escapes non-ASCII, so the tag follows `\u00a0` directly inside the string.
    text = "<tool_call>\n" + json.dumps({"name": "echo", "arguments": {"text": "\xa0<tool_call>"}})
    text += "\n</tool_call>"
    result = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in result.calls] == [
        ("echo", {"text": "\xa0<tool_call>"}, None)
    ]
