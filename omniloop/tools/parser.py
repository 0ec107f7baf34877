"""Tool-call parsing for the Hermes/Qwen format.

The format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Parsing never raises: whatever the model wrote becomes a list of `ParsedCall`s (each either a
call or a parse error with the reason) plus the free text around them. The rules, chosen to
match what a served model's parser (vLLM/SGLang `hermes`) would accept, so that training does
not reward a format that fails at inference:

- A call is `<tool_call>`, optional whitespace, one JSON object, optional whitespace,
  `</tool_call>`. Several calls per turn are parsed in order; text between them is free text.
- The object needs a string `name`. `arguments` may be an object, a string holding a JSON
  object (decoded), `null` or absent (both mean `{}`); anything else is an error. Other keys
  are ignored.
- The JSON is read with a real JSON decoder from the opening tag on, so a `<tool_call>` or
  `</tool_call>` inside a JSON string (e.g. file content) is data, not a tag.
- Anything other than whitespace between the JSON and `</tool_call>` (an extra `}`, a second
  object) is an error; we do not guess which part the model meant.
- Missing `</tool_call>` at the very end of the text: if a complete JSON object follows the
  opening tag it is parsed as a call, because engines that stop on `</tool_call>` strip the
  stop string from the output; if the JSON is incomplete (the model hit its token limit) it
  is an error. A missing closing tag before the next `<tool_call>` is an error.
- `<think>...</think>` is reasoning: calls inside it are not calls. An unclosed `<think>`
  makes the rest of the text reasoning. A `</think>` with no `<think>` before it closes a
  block the chat template opened in the prompt: everything before it, calls included, is
  reasoning. Tags inside a tool call's JSON strings are data; a literal `<think>` or
  `</think>` anywhere else is read as a tag.
- A stray `</tool_call>` with no opening tag is left in the free text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_WHITESPACE = " \t\n\r"
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as the model wrote it.

    `error` is None for a well-formed call, else why it could not be parsed; `name` and
    `arguments` are filled as far as they could be read (a call with a bad `arguments` still
    has its `name`). `raw` is the call's text, tags included, exactly as in the input.
    """

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the call parsed cleanly."""
        return self.error is None


@dataclass(frozen=True)
class ParseResult:
    """The calls of one assistant turn, the free text around them, and the reasoning."""

    calls: list[ParsedCall] = field(default_factory=list)
    text: str = ""
    """The turn with tool calls and reasoning blocks removed, stripped of outer whitespace."""
    reasoning: str = ""
    """The contents of `<think>` blocks, joined by blank lines."""

    @property
    def errors(self) -> list[ParsedCall]:
        """The calls that could not be parsed."""
        return [c for c in self.calls if c.error is not None]


def parse_tool_calls(text: str) -> ParseResult:
    """Parse an assistant turn in the Hermes/Qwen format (see the module doc for the rules)."""
    find = _Finder(text)
    calls: list[ParsedCall] = []
    free: list[str] = []
    reasoning: list[str] = []
    # Until a <think> opens, a </think> may close a block the chat template opened.
    implicit_block = True
    pos = 0
    while pos < len(text):
        next_open = find(THINK_OPEN, pos)
        next_call = find(TOOL_CALL_OPEN, pos)
        next_close = find(THINK_CLOSE, pos) if implicit_block else -1
        found = [i for i in (next_open, next_call, next_close) if i >= 0]
        if not found:
            free.append(text[pos:])
            break
        first = min(found)
        if first == next_close:
            # Everything so far, calls included, was reasoning.
            implicit_block = False
            calls.clear()
            free.clear()
            reasoning.append(text[:first])
            pos = first + len(THINK_CLOSE)
        elif first == next_open:
            implicit_block = False
            free.append(text[pos:first])
            body = first + len(THINK_OPEN)
            end = find(THINK_CLOSE, body)
            if end < 0:
                reasoning.append(text[body:])
                break
            reasoning.append(text[body:end])
            pos = end + len(THINK_CLOSE)
        else:
            free.append(text[pos:first])
            call, pos = _parse_one(text, first, find)
            calls.append(call)
    return ParseResult(
        calls=calls,
        text="".join(free).strip(),
        reasoning="\n\n".join(r.strip() for r in reasoning if r.strip()),
    )


class _Finder:
    """`str.find` that remembers its last answer per needle.

    Parsing only moves forward, so a remembered hit (or miss) from an earlier position answers
    a later query without rescanning; this keeps degenerate output (thousands of unclosed
    `<tool_call>` tags) linear instead of quadratic.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self._last: dict[str, tuple[int, int]] = {}

    def __call__(self, needle: str, pos: int) -> int:
        cached = self._last.get(needle)
        if cached is not None:
            asked_from, hit = cached
            if asked_from <= pos and (hit < 0 or hit >= pos):
                return hit
        hit = self.text.find(needle, pos)
        self._last[needle] = (pos, hit)
        return hit


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _span_end(text: str, start: int, find: _Finder) -> tuple[int, str | None]:
    """Where a call that could not be read cleanly ends, and why if that is itself an error.

    The call runs to the next `</tool_call>`, unless another `<tool_call>` opens first or the
    text ends: then the call was never closed.
    """
    body = start + len(TOOL_CALL_OPEN)
    close = find(TOOL_CALL_CLOSE, body)
    reopen = find(TOOL_CALL_OPEN, body)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close + len(TOOL_CALL_CLOSE), None
    if reopen >= 0:
        return reopen, "<tool_call> is not closed before the next <tool_call>"
    return len(text), "<tool_call> is not closed (the output ended inside the call)"


def _parse_one(text: str, start: int, find: _Finder) -> tuple[ParsedCall, int]:
    """Parse the call whose `<tool_call>` tag starts at `start`; return it and where it ends."""
    json_start = _skip_ws(text, start + len(TOOL_CALL_OPEN))
    try:
        obj, json_end = _decode(text, json_start, find)
    except (ValueError, RecursionError) as err:
        end, unclosed = _span_end(text, start, find)
        reason = unclosed or f"the call is not valid JSON ({_json_reason(err)})"
        return ParsedCall(None, None, text[start:end], reason), end
    after = _skip_ws(text, json_end)
    if text.startswith(TOOL_CALL_CLOSE, after):
        end = after + len(TOOL_CALL_CLOSE)
    elif after == len(text):
        end = after  # the closing tag was a stop string, stripped by the engine
    else:
        end, unclosed = _span_end(text, start, find)
        reason = unclosed or "unexpected text after the JSON object, before </tool_call>"
        name = obj.get("name") if isinstance(obj, dict) else None
        name = name if isinstance(name, str) and name.strip() else None
        return ParsedCall(name, None, text[start:end], reason), end
    return _from_object(obj, text[start:end]), end


def _decode(text: str, start: int, find: _Finder) -> tuple[Any, int]:
    """Decode one JSON value at `start`; return it and the index just after it.

    The decoder sees the text only up to the next `<tool_call>`: on the full text a failure
    costs time proportional to the whole text (the error computes its line number), which
    made thousands of broken calls in one turn quadratic. When the value may have been cut
    short (a string runs to the cut, or the error is at the cut) the window grows to the
    following `<tool_call>`, because the call's JSON strings may contain that tag.
    """
    cut = find(TOOL_CALL_OPEN, start)
    while True:
        window = text[start:] if cut < 0 else text[start:cut]
        try:
            obj, end = _decoder.raw_decode(window)
        except json.JSONDecodeError as err:
            # A cut inside a string shows up as an unterminated string, or as a bad escape when
            # it falls right after a `\uXXXX` (the scanner then reports the escape's start).
            cut_short = err.pos >= len(window) - 6 or err.msg.startswith("Unterminated string")
            if cut < 0 or not cut_short:
                raise
            cut = text.find(TOOL_CALL_OPEN, cut + 1)
            continue
        return obj, start + end


def _json_reason(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at character {err.pos} of the call"
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return str(err)


def _from_object(obj: Any, raw: str) -> ParsedCall:
    """Check a decoded call object's shape."""
    if not isinstance(obj, dict):
        return ParsedCall(
            None,
            None,
            raw,
            f'the call must be a JSON object with "name" and "arguments", got {_json_type(obj)}',
        )
    name = obj.get("name")
    if name is None:
        return ParsedCall(None, None, raw, 'the call has no "name"')
    if not isinstance(name, str) or not name.strip():
        return ParsedCall(
            None, None, raw, f'"name" must be a non-empty string, got {_json_type(name)}'
        )
    arguments = obj.get("arguments")
    if arguments is None:
        return ParsedCall(name, {}, raw)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return ParsedCall(name, None, raw, '"arguments" is a string that is not valid JSON')
    if not isinstance(arguments, dict):
        return ParsedCall(
            name, None, raw, f'"arguments" must be a JSON object, got {_json_type(arguments)}'
        )
    return ParsedCall(name, arguments, raw)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call written the way Qwen's chat template writes one (the inverse of parsing)."""
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


class _HasSchema(Protocol):
    @property
    def schema(self) -> dict[str, Any]: ...


def format_tool_schemas(tools: Iterable[_HasSchema]) -> list[dict[str, Any]]:
    """The list to pass as `tools=` to a chat template (`apply_chat_template(..., tools=...)`).

    Accepts any iterable of tools, including a `Toolset`.
    """
    return [t.schema for t in tools]
