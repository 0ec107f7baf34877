"""OpenAI's chat-completions request as pydantic models, and the messages in omniloop's form.

Requests follow OpenAI's shapes (`messages` with `tool_calls` and `tool_call_id`, `tools`,
`tool_choice`, `temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `stop`, `n`,
`seed`, `stream`, `logprobs`, `top_logprobs`). A field OpenAI defines that the gateway cannot
honour is refused with a message naming it (a `tool_choice` that forces a call, penalties,
media parts); fields that change nothing here (`user`, `metadata`, `store`, `parallel_tool_calls`,
`stream_options` other than `include_usage`, ...) are accepted and ignored; any other field is
an error naming it.

`to_chat` turns the wire messages into omniloop's chat form: `content` a string and, for an
assistant message, `tool_calls` as `[{"name", "arguments": dict}]`; `render_form` gives what
`ChatFormat` renders of a message (an assistant's calls written back into its text in the
Hermes form the model samples, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omniloop.agents.chat import Message

IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "frequency_penalty",
        "presence_penalty",
        "prompt_cache_key",
        "safety_identifier",
    }
)
"""OpenAI fields accepted and ignored (the penalties only at 0, checked below)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """Send a last chunk with the usage before `[DONE]`."""


class ChatCompletionRequest(BaseModel):
    """Body of `POST /v1/chat/completions`."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """Any name: the gateway serves one model (`GET /v1/models` lists it)."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation so far, OpenAI's message shapes."""
    tools: list[dict[str, Any]] | None = None
    """Function tools, `{"type": "function", "function": {...}}`, shown to the model by the
    chat template (a different list starts a different trajectory segment)."""
    tool_choice: str | dict[str, Any] | None = None
    """`auto` (default) or `none` (tool-call text is returned as content, not parsed)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    """Choice `i` samples with `seed + i`."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in ("frequency_penalty", "presence_penalty"):
            if data.get(name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported (send 0 or leave it out)")
        return {k: v for k, v in data.items() if k not in IGNORED_FIELDS}

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError(
                f"tool_choice {self.tool_choice!r} is not supported: the gateway cannot force a "
                "call; send 'auto' or 'none'"
            )
        if self.stop is not None and len(self.stop_list) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Role = Literal["system", "user", "assistant", "tool"]
_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"{where}: content part of type {kind!r} is not supported by the gateway "
                    "(text parts only)"
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"{where}: content must be a string, null or a list of text parts")


def _calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"{where}: tool_calls must be a list")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: tool_calls[{j}] needs function.name")
        arguments = function.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}: tool_calls[{j}].function.arguments is not JSON ({err.msg})"
            ) from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: tool_calls[{j}].function.arguments is not a JSON object")
        calls.append({"name": function["name"], "arguments": parsed})
    return calls


def to_chat(messages: list[dict[str, Any]]) -> list[Message]:
    """The wire messages in omniloop's chat form; `ValueError` naming the message."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = _ROLES.get(str(message.get("role")))
        if role is None:
            raise ValueError(
                f"{where}: role {message.get('role')!r} is not one of system, developer, user, "
                "assistant, tool"
            )
        chat: Message = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant":
            calls = _calls(message.get("tool_calls"), where)
            if calls:
                chat["tool_calls"] = calls
        out.append(chat)
    return out


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the Hermes form the model samples."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def render_form(message: Message) -> Message:
    """What `ChatFormat` renders of a chat-form message (module docstring)."""
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message["content"]}
    blocks = [hermes_call(c["name"], c["arguments"]) for c in calls]
    text = "\n".join([message["content"], *blocks] if message["content"] else blocks)
    return {"role": "assistant", "content": text}
