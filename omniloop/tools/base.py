"""Tools: typed Python functions the model can call, and the toolset that runs them.

A tool is a plain function (sync or async) decorated with `@tool`. Its JSON schema is built by
pydantic from the signature; parameter descriptions come from the docstring's parameter section
(Google `Args:`, reST `:param name:` or numpydoc `Parameters`, read by `docstring_parser`), the
tool description from the docstring's first paragraph. A parameter annotated
`ToolContext` receives the episode's context (sandbox, task, episode id, per-episode state) and
is not part of the schema.

`Toolset.execute` is the boundary between the model and tool code: whatever the model asked for
(an unknown tool, bad arguments, a tool that raises or hangs) comes back as an observation the
model can read plus an error code on the `ToolCallRecord`. Only three things propagate:
cancellation, `SandboxError` (the sandbox itself is broken: the rollout records the episode as
`sandbox_error` instead of training on it), and errors that are not `Exception`s.

A tool may also return media: `ToolResult(text, media=[MediaData(kind="image", data=png)])`
(a crop of an image, a clip cut from a video, a recorded sound). The text is rendered and
sanitized like any result; the media travel on the `ToolCallRecord` and the session shows them
to the model after the text, as placeholder blocks of a media-taking model.

Whatever a tool returns is data too: `render_result` turns any return value into text, and
`sanitize_output` makes every observation text the tokenizer and the stores accept (UTF-8
without NUL, at most `max_output_chars` characters), counting what it replaced or cut.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time
import types
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    Generic,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
    runtime_checkable,
)

import docstring_parser
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema

from omniloop.errors import SandboxError, ToolError
from omniloop.modalities.media import MediaData
from omniloop.sandboxes.base import ExecResult, Sandbox
from omniloop.tools.parser import ParsedCall
from omniloop.trajectory import ToolCallRecord

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

ToolErrorCode = typing.Literal[
    "parse_error", "unknown_tool", "invalid_arguments", "tool_error", "tool_timeout"
]
"""Why a tool call failed, as recorded in `ToolCallRecord.error`."""

METRIC_KEYS: dict[str, str] = {
    "parse_error": "tool_calls/parse_errors",
    "unknown_tool": "tool_calls/unknown_tools",
    "invalid_arguments": "tool_calls/invalid_arguments",
    "tool_error": "tool_calls/tool_errors",
    "tool_timeout": "tool_calls/timeouts",
}
"""Metric key counted for each error code; `tool_calls/total` and `tool_calls/ok` count all."""

SANITIZED_METRIC = "tool_calls/sanitized_chars"
"""Metric key: characters of tool observations replaced by U+FFFD (see `sanitize_output`)."""

TRUNCATED_METRIC = "tool_calls/truncated"
"""Metric key: tool observations cut to `max_output_chars` (see `sanitize_output`)."""

DEFAULT_TOOL_TIMEOUT = 300.0
"""Seconds a tool may run when neither the tool nor the toolset sets a timeout. Sandbox tools
are normally stopped sooner by the sandbox's own per-command limit; this is the backstop."""

DEFAULT_MAX_OUTPUT_CHARS = 256 * 1024
"""Characters of one tool observation kept when the toolset sets no other cap. Above what the
sandbox's default output cap lets through (64 KiB each of stdout and stderr), so sandbox output
is not cut twice; it bounds what a function tool returning a huge string costs to tokenize."""

OUTPUT_TRUNCATION_MARKER = "\n[truncated {n} characters]\n"
"""Placed between the head and the tail of a tool observation longer than the cap."""

_MAX_SHOWN_INPUT = 120
"""Longest repr of a bad argument value quoted back to the model."""

# Lone surrogates cannot be encoded as UTF-8 (the tokenizer raises TypeError on them); NUL is
# valid UTF-8 but PostgreSQL text and jsonb cannot hold it. Other control characters are kept:
# they encode and tokenize fine, and real command output uses them (ANSI colours, `\r`
# progress bars), so the model is shown what the tool printed.
_UNSAFE_CHARS = re.compile("[\x00\ud800-\udfff]")


class ToolResult(BaseModel):
    """A tool's result with media: text, then images, audio clips or videos shown after it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = ""
    """What the tool says (rendered and sanitized like any result)."""
    media: list[MediaData] = Field(default_factory=list)
    """The items, in the order they are shown."""


class ToolContext:
    """What a tool may know about the episode it runs in.

    A tool receives it by declaring a parameter annotated `ToolContext` (any name; it is never
    part of the schema). `state` is one dict per episode, shared by every tool call in it: tools
    use it to keep what must survive between calls (an open file, a counter).
    """

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        task: Mapping[str, Any] | None = None,
        episode_id: str = "",
        state: dict[str, Any] | None = None,
    ) -> None:
        self._sandbox = sandbox
        self.task: dict[str, Any] = dict(task or {})
        self.episode_id = episode_id
        self.state: dict[str, Any] = state if state is not None else {}

    @property
    def has_sandbox(self) -> bool:
        """True when the episode has a sandbox."""
        return self._sandbox is not None

    @property
    def sandbox(self) -> Sandbox:
        """The episode's sandbox; `SandboxError` if the episode was started without one."""
        if self._sandbox is None:
            raise SandboxError(
                f"episode {self.episode_id!r} has no sandbox, but a tool needs one; "
                "configure a sandbox for agents that use sandbox tools"
            )
        return self._sandbox


class ToolArgumentError(ToolError):
    """The model's arguments do not fit the tool's schema; the message says how."""


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI/Qwen function schema of a tool: `{"type": "function", "function": {...}}`."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


@runtime_checkable
class Tool(Protocol):
    """Anything the model can call: a `@tool` function, or a tool served elsewhere (MCP).

    Contract of `call`: it validates `arguments` (raising `ToolArgumentError` with a message
    the model can act on), runs the tool and returns the observation text. A failure the model
    should see is a `ToolError` (or any other exception); `SandboxError` means infrastructure.
    """

    name: str
    description: str
    timeout: float | None

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema: `{"type": "function", "function": {...}}`."""
        ...

    async def call(self, arguments: Mapping[str, Any], ctx: ToolContext) -> str | ToolResult:
        """Validate the arguments, run the tool, and return what the model is shown.

        A return value that is not a `str` or a `ToolResult` is rendered by `render_result`
        (JSON, bytes decoded); whatever text comes back is passed through `sanitize_output`.
        """
        ...


# ---------------------------------------------------------------------------------------------
# Docstrings


_PARAM_KINDS = frozenset({"param", "parameter", "arg", "argument", "key", "keyword", "other_param"})
"""`docstring_parser` meta kinds that describe a function parameter (not `attribute`, which it
also reports as a parameter)."""

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _one_line(text: str) -> str:
    """`text` with its lines stripped and joined by single spaces (blank lines dropped)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a docstring into (description, {parameter: description}).

    Parsed by `docstring_parser`, whose style (Google `Args:`, reST `:param name:`, numpydoc
    `Parameters`, epydoc `@param name:`) is detected per docstring. The description is the
    first paragraph, its lines joined by spaces. Parameter descriptions come from the parameter
    sections (`Args`/`Arguments`/`Parameters`/`Params`, keyword and other parameters; not
    `Attributes`), their lines joined the same way; other sections are ignored. A docstring the
    library cannot parse gives its first paragraph and no parameter descriptions.
    """
    if not doc or not doc.strip():
        return "", {}
    params: dict[str, str] = {}
    try:
        parsed = docstring_parser.parse(doc)
    except docstring_parser.ParseError:
        text = inspect.cleandoc(doc)
    else:
        text = parsed.description or ""
        for param in parsed.params:
            if param.args and param.args[0] in _PARAM_KINDS and param.description:
                params[param.arg_name] = _one_line(param.description)
    first = _PARAGRAPH_BREAK.split(text.strip(), maxsplit=1)[0]
    return _one_line(first), params


# ---------------------------------------------------------------------------------------------
# Schemas


class _ToolJsonSchema(GenerateJsonSchema):
    """Pydantic's JSON schema without the auto-generated titles: they cost prompt tokens and
    repeat the property names."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _is_context(annotation: Any) -> bool:
    """True if `annotation` is `ToolContext`, possibly inside `Optional`/`Annotated`."""
    if annotation is ToolContext:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _is_context(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_is_context(a) for a in typing.get_args(annotation))
    return False


def _has_description(annotation: Any) -> bool:
    """True if an `Annotated[..., Field(description=...)]` already describes the parameter."""
    if typing.get_origin(annotation) is not Annotated:
        return False
    return any(isinstance(m, FieldInfo) and m.description for m in typing.get_args(annotation)[1:])


def _type_summary(prop: Mapping[str, Any]) -> str:
    """A short human name for a JSON-schema property's type (`integer`, `'a' | 'b'`, ...)."""
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "$ref" in prop:
        return "object"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " | ".join(_type_summary(p) for p in prop[key])
    kind = prop.get("type")
    if kind == "array" and isinstance(prop.get("items"), Mapping):
        return f"array of {_type_summary(prop['items'])}"
    if isinstance(kind, list):
        return " | ".join(str(k) for k in kind)
    return str(kind) if kind else "any value"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN_INPUT else text[: _MAX_SHOWN_INPUT - 3] + "..."


class FunctionTool(Generic[P, R]):
    """A Python function made callable by the model (built by `@tool`).

    Calling the object directly calls the function unchanged (for tests and reuse); the model's
    path is `call(arguments, ctx)`. Sync functions run in a worker thread so they never block
    the event loop; a sync tool that overruns its timeout is abandoned, not killed.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"tool timeout must be positive, got {timeout}")
        self.fn = fn
        self.name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", self.name):
            raise ValueError(
                f"tool name {self.name!r} must start with a letter or _ and hold only letters, "
                "digits, _, . or - (at most 64 characters)"
            )
        doc_description, doc_params = parse_docstring(fn.__doc__)
        self.description = description if description is not None else doc_description
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn)
        self._context_param: str | None = None
        # Parameters become fields named p0, p1, ... with the real name as alias: a parameter
        # called `json`, `schema` or `copy` would otherwise shadow a BaseModel attribute.
        self._fields: dict[str, str] = {}
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception as err:
            raise TypeError(f"tool {self.name!r}: cannot resolve type annotations: {err}") from err
        definitions: dict[str, Any] = {}
        for index, param in enumerate(inspect.signature(fn).parameters.values()):
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise TypeError(
                    f"tool {self.name!r}: parameter {param.name!r} must be an ordinary named "
                    "parameter (no *args, **kwargs or positional-only parameters)"
                )
            if param.name not in hints:
                raise TypeError(
                    f"tool {self.name!r}: parameter {param.name!r} needs a type annotation "
                    "(it becomes the argument's JSON schema)"
                )
            annotation = hints[param.name]
            if _is_context(annotation):
                if self._context_param is not None:
                    raise TypeError(f"tool {self.name!r}: more than one ToolContext parameter")
                self._context_param = param.name
                continue
            field_kwargs: dict[str, Any] = {"alias": param.name}
            if param.default is not inspect.Parameter.empty:
                field_kwargs["default"] = param.default
            if param.name in doc_params and not _has_description(annotation):
                field_kwargs["description"] = doc_params[param.name]
            definitions[f"p{index}"] = (annotation, Field(**field_kwargs))
            self._fields[f"p{index}"] = param.name
        try:
            self.arguments_model: type[BaseModel] = create_model(
                f"{self.name}_arguments",
                __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=False),
                **definitions,
            )
            parameters = self.arguments_model.model_json_schema(schema_generator=_ToolJsonSchema)
        except Exception as err:
            raise TypeError(
                f"tool {self.name!r}: its parameters cannot be described as JSON schema: {err}"
            ) from err
        parameters.pop("title", None)
        self.parameters: dict[str, Any] = parameters

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<tool {self.name}>"

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema: `{"type": "function", "function": {...}}`."""
        return function_schema(self.name, self.description, self.parameters)

    def signature_text(self) -> str:
        """The expected arguments in one line, e.g. `add(a: integer, b: integer = 1)`."""
        props: Mapping[str, Any] = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", []))
        parts = []
        for arg, prop in props.items():
            part = f"{arg}: {_type_summary(prop)}"
            if arg not in required and "default" in prop:
                part += f" = {json.dumps(prop['default'])}"
            elif arg not in required:
                part += " (optional)"
            parts.append(part)
        return f"{self.name}({', '.join(parts)})"

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check the model's arguments; return keyword arguments for the function.

        Raises `ToolArgumentError` whose message names each bad argument, what was wrong and
        what the tool expects. Pydantic's own error text is never shown verbatim.
        """
        if not isinstance(arguments, Mapping):
            raise ToolArgumentError(
                f"arguments for tool {self.name!r} must be a JSON object, got "
                f"{type(arguments).__name__}. Expected: {self.signature_text()}"
            )
        try:
            validated = self.arguments_model.model_validate(dict(arguments))
        except ValidationError as err:
            raise ToolArgumentError(self._describe_errors(err)) from None
        return {self._fields[field]: getattr(validated, field) for field in self._fields}

    def _describe_errors(self, err: ValidationError) -> str:
        props: Mapping[str, Any] = self.parameters.get("properties", {})
        lines = [f"invalid arguments for tool {self.name!r}:"]
        for e in err.errors(include_url=False):
            loc = [str(p) for p in e["loc"]]
            where = ".".join(loc) or "<arguments>"
            top = props.get(loc[0], {}) if loc else {}
            expected = f" (expected {_type_summary(top)})" if top and len(loc) == 1 else ""
            if e["type"] == "missing":
                lines.append(f"- {where}: missing required argument{expected}")
            elif e["type"] == "extra_forbidden":
                lines.append(f"- {where}: unexpected argument")
            else:
                lines.append(f"- {where}: {e['msg']}, got {_short(e.get('input'))}{expected}")
        lines.append(f"Expected: {self.signature_text()}")
        return "\n".join(lines)

    async def call(self, arguments: Mapping[str, Any], ctx: ToolContext) -> str | ToolResult:
        """Validate `arguments`, run the function (with `ctx` if it asks for it), render (a
        `ToolResult` is returned as it is: its text is rendered by the toolset)."""
        kwargs = self.validate(arguments)
        if self._context_param is not None:
            kwargs[self._context_param] = ctx
        fn: Callable[..., Any] = self.fn
        if self.is_async:
            result = await fn(**kwargs)
        else:
            result = await asyncio.to_thread(fn, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        if isinstance(result, ToolResult):
            return result
        return render_result(result)


def render_result(value: Any) -> str:
    """What the model sees for a tool's return value, before `sanitize_output`.

    A `str` as it is; an `ExecResult` as its `.text()`; `bytes`, `bytearray` or `memoryview`
    decoded as UTF-8 with each invalid byte kept as a lone surrogate (so that `sanitize_output`
    replaces and counts it); anything else as compact JSON (`None` is `null`, `1.5` is `1.5`,
    dicts, lists, tuples, sets, pydantic models and dataclasses as JSON values). Strings and
    bytes nested in JSON values are kept the same way. A value JSON cannot represent raises
    `ToolError`. The result may hold lone surrogates and any length: `Toolset.execute` cleans
    and caps it.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, ExecResult):
        return value.text()
    if isinstance(value, bytes | bytearray | memoryview):
        return _decode_bytes(value)
    try:
        return pydantic_core.to_json(value).decode()
    except pydantic_core.PydanticSerializationError as err:
        problem = str(err)
    # pydantic refuses invalid UTF-8 bytes and lone surrogates inside a value; the standard
    # library's encoder keeps them as text (made safe by `sanitize_output`).
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_jsonable)
    except (TypeError, ValueError):
        raise ToolError(
            f"the tool returned a {type(value).__name__}, which cannot be shown as text: {problem}"
        ) from None


def _decode_bytes(data: bytes | bytearray | memoryview) -> str:
    return bytes(data).decode("utf-8", errors="surrogateescape")


def _jsonable(value: Any) -> Any:
    """`json.dumps` hook for what the standard encoder does not know."""
    if isinstance(value, bytes | bytearray | memoryview):
        return _decode_bytes(value)
    try:
        return pydantic_core.to_jsonable_python(value)
    except Exception as err:
        raise TypeError(str(err)) from None


@dataclass(frozen=True)
class SanitizedOutput:
    """A tool observation made safe for the model, with what it took."""

    text: str
    """Valid UTF-8 without NUL, at most the cap plus the truncation marker."""
    replaced: int
    """Characters replaced by U+FFFD: lone surrogates and NUL."""
    truncated: int
    """Characters cut from the middle (0 when the text fit)."""


def sanitize_output(text: str, max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> SanitizedOutput:
    """Make `text` an observation every tokenizer and store accepts.

    Text longer than `max_chars` characters keeps its first `max_chars // 2` and last
    `max_chars - max_chars // 2` characters with `OUTPUT_TRUNCATION_MARKER` between them (cut
    first, so a huge output is never scanned whole). Then each lone surrogate (what
    `os.listdir` gives for a file name that is not UTF-8, or `render_result` for an invalid
    byte) and each NUL becomes U+FFFD. Every other character is kept, control characters
    included.
    """
    if max_chars < 2:
        raise ValueError(f"max_chars must be at least 2, got {max_chars}")
    truncated = max(0, len(text) - max_chars)
    if truncated:
        head = max_chars // 2
        text = (
            text[:head] + OUTPUT_TRUNCATION_MARKER.format(n=truncated) + text[-(max_chars - head) :]
        )
    text, replaced = _UNSAFE_CHARS.subn("\ufffd", text)
    return SanitizedOutput(text=text, replaced=replaced, truncated=truncated)


@overload
def tool(fn: Callable[P, R], /) -> FunctionTool[P, R]: ...


@overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout: float | None = None
) -> Callable[[Callable[P, R]], FunctionTool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> FunctionTool[P, R] | Callable[[Callable[P, R]], FunctionTool[P, R]]:
    """Make a sync or async function a tool the model can call.

    Use as `@tool` or `@tool(name=..., description=..., timeout=...)`. Every parameter needs a
    type annotation (any type pydantic can validate: str, int, Literal, Enum, list, nested
    BaseModel, `X | None`, ...); defaults make arguments optional. A parameter annotated
    `ToolContext` receives the episode's context and is left out of the schema. `name` defaults
    to the function's name, `description` to the docstring's first paragraph, and `timeout`
    (seconds) to the toolset's default.
    """

    def wrap(f: Callable[P, R]) -> FunctionTool[P, R]:
        return FunctionTool(f, name=name, description=description, timeout=timeout)

    return wrap(fn) if fn is not None else wrap


# ---------------------------------------------------------------------------------------------
# Execution


def _error_text(detail: str) -> str:
    """The observation shown to the model for a failed call."""
    return f"Error: {detail}"


def tool_call_metrics(records: Iterable[ToolCallRecord]) -> dict[str, float]:
    """Counters for a trajectory's `meta.metrics`: total, ok, one key per error code, the
    characters `sanitize_output` replaced (`tool_calls/sanitized_chars`) and the outputs it cut
    (`tool_calls/truncated`). A key whose count is zero is left out."""
    counts: Counter[str] = Counter()
    for record in records:
        _count(counts, record)
    return {key: float(value) for key, value in counts.items()}


def _count(counts: Counter[str], record: ToolCallRecord) -> None:
    counts["tool_calls/total"] += 1
    if record.error is None:
        counts["tool_calls/ok"] += 1
    else:
        counts[METRIC_KEYS.get(record.error, f"tool_calls/{record.error}")] += 1
    if record.sanitized_chars:
        counts[SANITIZED_METRIC] += record.sanitized_chars
    if record.truncated_chars:
        counts[TRUNCATED_METRIC] += 1


class Toolset:
    """The tools of an agent, by name, and the one place tool calls are executed.

    `execute` never raises for anything the model did or any tool failure: it returns a
    `ToolCallRecord` whose `output` is the observation and whose `error` is one of
    `parse_error`, `unknown_tool`, `invalid_arguments`, `tool_error`, `tool_timeout` (None on
    success). It does raise `asyncio.CancelledError`, `SandboxError` (the sandbox broke: the
    episode is an infrastructure failure, not a model mistake) and non-`Exception` errors.
    Every `output`, error messages included, has passed `sanitize_output` with
    `max_output_chars`; the record counts what was replaced and cut. `metrics` counts every
    executed call, under the keys of `tool_call_metrics`.
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        *,
        default_timeout: float | None = DEFAULT_TOOL_TIMEOUT,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        if max_output_chars < 2:
            raise ValueError(
                f"max_output_chars must be at least 2, got {max_output_chars}; it is how many "
                "characters of a tool's output the model is shown"
            )
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"{t!r} is not a tool; decorate the function with @tool")
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
            self._tools[t.name] = t
        self.default_timeout = default_timeout
        self.max_output_chars = max_output_chars
        self.metrics: Counter[str] = Counter()

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        """Tool names in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The list to pass as the chat template's `tools`."""
        return [t.schema for t in self._tools.values()]

    async def execute(self, call: ParsedCall, ctx: ToolContext, *, turn: int = 0) -> ToolCallRecord:
        """Run one parsed call and record what the model will be shown (see the class doc)."""
        started = time.monotonic()
        code: ToolErrorCode | None = None
        output: str | ToolResult
        if call.error is not None or call.name is None:
            code = "parse_error"
            output = _error_text(
                f"could not parse the tool call: {call.error or 'no tool name'}. Write each "
                'call as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>',
            )
        elif call.name not in self._tools:
            code = "unknown_tool"
            available = ", ".join(self._tools) or "none"
            output = _error_text(f"unknown tool {call.name!r}. Available tools: {available}.")
        else:
            code, output = await self._run(self._tools[call.name], call, ctx)
        media: list[MediaData] = []
        if isinstance(output, ToolResult):
            media = list(output.media)
            output = output.text
        clean = sanitize_output(output, self.max_output_chars)
        record = ToolCallRecord(
            turn=turn,
            name=call.name,
            arguments=call.arguments,
            raw=call.raw,
            output=clean.text,
            error=code,
            duration=time.monotonic() - started,
            sanitized_chars=clean.replaced,
            truncated_chars=clean.truncated,
            media=media,
        )
        _count(self.metrics, record)
        return record

    async def execute_all(
        self, calls: Sequence[ParsedCall], ctx: ToolContext, *, turn: int = 0
    ) -> list[ToolCallRecord]:
        """Run a turn's calls one after another, in the order the model wrote them.

        Sequential on purpose: calls of one turn share a sandbox and often depend on each
        other (write a file, then run it).
        """
        return [await self.execute(call, ctx, turn=turn) for call in calls]

    async def _run(
        self, t: Tool, call: ParsedCall, ctx: ToolContext
    ) -> tuple[ToolErrorCode | None, str | ToolResult]:
        timeout = t.timeout if t.timeout is not None else self.default_timeout
        arguments = call.arguments if call.arguments is not None else {}
        try:
            # asyncio.timeout (not wait_for) so a TimeoutError raised *by* the tool is told
            # apart from the tool running out of time.
            async with asyncio.timeout(timeout) as scope:
                output = await t.call(arguments, ctx)
            if not isinstance(output, str | ToolResult):
                # Outside the `Tool` contract (an MCP adapter returning content parts, say),
                # but still data: shown the way a `@tool` function's return value would be.
                output = render_result(output)
        except ToolArgumentError as err:
            return "invalid_arguments", _error_text(str(err))
        except SandboxError:
            raise
        except TimeoutError as err:
            if scope.expired():
                return "tool_timeout", _error_text(
                    f"tool {t.name!r} did not finish within {timeout:g}s."
                )
            return "tool_error", _error_text(f"tool {t.name!r} failed: {_describe_exception(err)}")
        except ToolError as err:
            return "tool_error", _error_text(f"tool {t.name!r} failed: {err}")
        except Exception as err:
            logger.info("tool %r raised", t.name, exc_info=True)
            return "tool_error", _error_text(f"tool {t.name!r} failed: {_describe_exception(err)}")
        return None, output


def _describe_exception(err: BaseException) -> str:
    message = str(err)
    return f"{type(err).__name__}: {message}" if message else type(err).__name__
