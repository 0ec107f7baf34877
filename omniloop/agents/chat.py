"""Chat formatting in token space: the prompt once, then observation deltas.

The model's chat template is the source of truth for *glue* (role headers, separators, the
generation prompt); message *content* is tokenized as plain text, so a tool that prints
`<|im_end|>` or `<tool_call>` gives the model those characters, never the special tokens.

How: the template is rendered with a sentinel in place of each content string; the rendered text
is split at the sentinels; glue pieces are tokenized with special tokens recognised, contents with
`split_special_tokens=True`. An observation is rendered as the difference between a conversation
with and without the new messages, which is how the template would have continued it, and is
appended after the sampled tokens, which are never rendered again.

Media: a message's content may also be a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image" | "audio" | "video", "tokens": n, ...}` (n: the placeholder count its processor
reported; other keys, such as the `Media` reference, ride along untouched). A media part is
rendered as its placeholder block (`MediaTokens.block`), assembled as ids: the template never
sees or re-tokenizes it, and placeholder text inside a text part stays text.

Not covered: templates that rewrite earlier turns when a new one is added (e.g. ones that drop
past `<think>` blocks) are not append-only; `ChatFormat` refuses them with a clear error instead
of silently diverging from what the template would render.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from omniloop.errors import ConfigError
from omniloop.modalities.media import MediaKind
from omniloop.modalities.processing import MediaTokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SENTINEL = "\u2063OMNILOOP{}SENTINEL\u2063"
_SENTINEL_RE = re.compile("\u2063OMNILOOP(\\d+)SENTINEL\u2063")
# Stand-in conversation whose rendering is subtracted to get a delta.
_PROBE_USER = "\u2063OMNILOOPPROBEUSER\u2063"
_PROBE_ASSISTANT = "\u2063OMNILOOPPROBEASSISTANT\u2063"

Message = dict[str, Any]
# What stands at a sentinel: a text segment (tokenized once) or a media block's ids.
Segment = str | list[int]


class ChatFormat:
    """Token-exact rendering of a conversation for one tokenizer and its chat template."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None
    ):
        if not tokenizer.chat_template:
            raise ConfigError(
                f"tokenizer {tokenizer.name_or_path!r} has no chat template; "
                "set tokenizer.chat_template (omniloop's model aliases ship one)"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._media_tokens: MediaTokens | None = None
        self.stop_token_ids = self._stop_token_ids()
        self._assistant_suffix = self._probe_assistant_suffix()
        self._probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]
        self._probe_text = self._apply(self._probe, add_generation_prompt=False)

    # -- public API ---------------------------------------------------------------------------

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt."""
        text, contents = self._render_with_sentinels(messages, add_generation_prompt=True)
        return self._tokenize(text, contents)

    def observation_ids(self, messages: list[Message], *, closed: bool) -> list[int]:
        """Token ids to append after a sampled assistant turn: `messages`, then the next
        generation prompt.

        `closed` says whether the sampled turn ended with the template's end-of-turn token
        (finish reason `stop` on a stop token); if not, the end-of-turn glue is added here.
        """
        before = self._probe_text
        after, contents = self._render_with_sentinels(
            [*self._probe, *messages], add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ConfigError(
                "the chat template is not append-only: adding messages changes how earlier "
                "turns render, so token-exact trajectories are impossible with it"
            )
        delta = after[len(before) :]
        suffix = self._assistant_suffix
        if closed:
            suffix = suffix[len(self._end_of_turn_text) :]
        return self._tokenize(suffix + delta, contents)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` with special tokens shown (what the model was shown)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def is_closing(self, token_id: int) -> bool:
        """True if `token_id` ends an assistant turn."""
        return token_id in self.stop_token_ids

    # -- internals ------------------------------------------------------------------------

    @property
    def _end_of_turn_text(self) -> str:
        return str(self.tokenizer.convert_ids_to_tokens(self.stop_token_ids[0]))

    def _stop_token_ids(self) -> list[int]:
        tok = self.tokenizer
        candidates = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"]
        vocab = tok.get_vocab()
        ids = [vocab[c] for c in candidates if c in vocab]
        if tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.append(tok.eos_token_id)
        if not ids:
            raise ConfigError(f"tokenizer {tok.name_or_path!r} has no end-of-turn token")
        return ids

    def _probe_assistant_suffix(self) -> str:
        """Template text that follows an assistant message's content (e.g. `<|im_end|>\\n`)."""
        rendered = self._apply(
            [
                {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_ASSISTANT},
            ],
            add_generation_prompt=False,
        )
        suffix = rendered.split(_PROBE_ASSISTANT, 1)[1]
        if not suffix.startswith(self._end_of_turn_text):
            raise ConfigError(
                f"chat template closes assistant turns with {suffix[:20]!r}, not with the "
                f"end-of-turn token {self._end_of_turn_text!r}; unsupported template"
            )
        return suffix

    def _apply(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,  # type: ignore[arg-type]
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text

    def _render_with_sentinels(
        self, messages: list[Message], *, add_generation_prompt: bool
    ) -> tuple[str, list[Segment]]:
        contents: list[Segment] = []
        stand_ins = []
        for message in messages:
            content = message.get("content")
            if content in (_PROBE_USER, _PROBE_ASSISTANT):
                stand_ins.append(message)
                continue
            if isinstance(content, str):
                parts: list[Segment] = [content]
            elif isinstance(content, list):
                parts = []
                for part in content:
                    segment = self._segment(part, message.get("role"))
                    if isinstance(segment, str) and parts and isinstance(parts[-1], str):
                        # Adjacent text parts are one text, tokenized once (as "a" "b" would
                        # not be as "ab").
                        parts[-1] += segment
                    else:
                        parts.append(segment)
            else:
                raise ConfigError(
                    f"message content must be a string or a list of parts, got "
                    f"{type(content).__name__} in a {message.get('role')!r} message"
                )
            sentinels = "".join(_SENTINEL.format(len(contents) + i) for i in range(len(parts)))
            stand_ins.append({**message, "content": sentinels})
            contents += parts
        return self._apply(stand_ins, add_generation_prompt=add_generation_prompt), contents

    def _segment(self, part: Any, role: Any) -> Segment:
        """A content part as a text segment or a media block's ids."""
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            return str(part["text"])
        if kind in tuple(MediaKind):
            tokens = part.get("tokens")
            if not isinstance(tokens, int) or tokens < 1:
                raise ConfigError(
                    f"a {kind} part of a {role!r} message needs 'tokens' (its placeholder "
                    f"count from the model's media processor), got {tokens!r}"
                )
            return self.media_tokens.block(MediaKind(kind), tokens)
        raise ConfigError(
            f"content part {str(part)[:80]!r} of a {role!r} message is not text, image, audio "
            "or video; parts look like {'type': 'text', 'text': ...} or "
            "{'type': 'image', 'tokens': n}"
        )

    @property
    def media_tokens(self) -> MediaTokens:
        """The tokenizer's media token ids (`ConfigError` if it has none)."""
        if self._media_tokens is None:
            self._media_tokens = MediaTokens.from_tokenizer(self.tokenizer)
        return self._media_tokens

    def _tokenize(self, text: str, contents: list[Segment]) -> list[int]:
        ids: list[int] = []
        pos = 0
        seen = 0
        for match in _SENTINEL_RE.finditer(text):
            ids += self._encode_glue(text[pos : match.start()])
            index = int(match.group(1))
            if index != seen:
                raise ConfigError("the chat template reorders or repeats message contents")
            seen += 1
            segment = contents[index]
            if isinstance(segment, list):
                ids += segment
            elif segment:
                ids += self.tokenizer.encode(
                    segment, add_special_tokens=False, split_special_tokens=True
                )
            pos = match.end()
        ids += self._encode_glue(text[pos:])
        if seen != len(contents):
            raise ConfigError(
                "the chat template dropped or altered a message's content; omniloop needs "
                "templates that render each content string verbatim"
            )
        return ids

    def _encode_glue(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))
