"""The media of an episode: parts of messages turned into placeholder blocks, kept for the engine
and placed in the trajectory.

A message's content may hold media parts in either form:

- as given by a task, an agent or a tool: `{"type": "image", "image": <source>}` (likewise
  `audio`, `video`), the source being bytes, a `data:` URI or a file path, or a `MediaData`;
- as prepared here: `{"type": "image", "tokens": n, "media": Media}`, which `ChatFormat` renders
  as the item's placeholder block.

`EpisodeMedia.prepare` turns the first form into the second: it stores the bytes once by hash,
runs the model's processor to count the item's placeholder tokens, and keeps the bytes so that
every later turn sends the engine every item so far (an image a tool returned in turn 2 is still
in the model's input in turn 5). `EpisodeMedia.place` then finds where the new blocks landed in
the token stream; their placements become `Trajectory.multimodal`.

Errors: an unusable item in a prompt raises `MediaError` (the episode is recorded as
`media_error`); an unusable item in a tool result becomes a text part saying why, so the model
reads the failure as it reads any tool error, and it is counted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniloop.agents.chat import Message
from omniloop.errors import MediaError
from omniloop.modalities.config import MediaConfig
from omniloop.modalities.families import processor_for
from omniloop.modalities.media import (
    Media,
    MediaData,
    MediaKind,
    MediaPlacement,
    MediaStore,
    read_source,
)
from omniloop.modalities.processing import (
    MediaProcessor,
    MediaTokens,
    ProcessedMedia,
    concat_inputs,
)

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

KINDS = tuple(kind.value for kind in MediaKind)


def media_resolver(
    model_folder: Path,
    tokenizer: PreTrainedTokenizerBase,
    config: MediaConfig,
    store_dir: Path,
    *,
    allow_files: bool = True,
) -> MediaResolver:
    """The resolver of a worker's episodes: the model family's processor (none for a text
    model: every media part is then refused, naming the item) and a store in `store_dir`."""
    processor = processor_for(model_folder, config)
    tokens = MediaTokens.from_tokenizer(tokenizer) if processor is not None else None
    store = MediaStore(store_dir, max_bytes=config.max_bytes)
    return MediaResolver(store, processor, tokens, config=config, allow_files=allow_files)


class MediaResolver:
    """Stores and processes media for the episodes of one worker (shared by its episodes).

    Processing is cached by content hash (the `cache_items` most recent), so the image of a
    task that 16 episodes of a group share is decoded and measured once. Thread-safe.
    """

    def __init__(
        self,
        store: MediaStore,
        processor: MediaProcessor | None,
        tokens: MediaTokens | None,
        *,
        config: MediaConfig | None = None,
        cache_items: int = 256,
        allow_files: bool = True,
    ) -> None:
        """`allow_files`: whether a part may name a file path (tasks from a config: yes;
        prompts submitted over the API: no, it would read the server's files)."""
        self.allow_files = allow_files
        self.store = store
        self.processor = processor
        self.tokens = tokens
        self.config = config or MediaConfig()
        self._cache: OrderedDict[tuple[str, str], ProcessedMedia] = OrderedDict()
        self._cache_items = cache_items
        self._lock = threading.Lock()

    @property
    def takes_media(self) -> bool:
        """Whether the model has a processor and placeholder tokens."""
        return self.processor is not None and self.tokens is not None

    def resolve(self, kind: MediaKind, data: bytes) -> ProcessedMedia:
        """Store `data` and process it (cached); `MediaError` naming the item if either fails
        or the model takes no media."""
        media = self.store.put(data, kind)
        if self.processor is None or self.tokens is None:
            raise MediaError(f"{media.label}: the model takes no {kind} input (no media tokens)")
        key = (kind.value, media.sha256)
        hit = self._cached(key)
        if hit is not None:
            return hit
        processed = self.processor.process(kind, data, label=media.label)
        processed = ProcessedMedia(
            kind=processed.kind, tokens=processed.tokens, inputs=processed.inputs, media=media,
            seconds=processed.seconds,
        )  # fmt: skip
        with self._lock:
            self._cache[key] = processed
            while len(self._cache) > self._cache_items:
                self._cache.popitem(last=False)
        return processed

    def _cached(self, key: tuple[str, str]) -> ProcessedMedia | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def model_inputs(self, entries: Sequence[Mapping[str, Any]]) -> dict[str, Tensor] | None:
        """The forward inputs of a trajectory's media (`Trajectory.multimodal` entries), read
        from the store and processed as the rollout processed them (cached by hash), in
        order; None when there are none. `MediaError` if an item is missing or unusable."""
        if not entries:
            return None
        items = []
        for entry in entries:
            media = MediaPlacement.model_validate(entry).media
            # A group's rows share their prompt's items: read and hash them once.
            processed = self._cached((media.kind.value, media.sha256)) or self.resolve(
                media.kind, self.store.read(media)
            )
            if processed.tokens != entry["tokens"]:
                raise MediaError(
                    f"{media.label} makes {processed.tokens} placeholder tokens here but "
                    f"{entry['tokens']} in the trajectory: the rollout's and the trainer's "
                    "media settings differ (rollout.media)"
                )
            items.append(processed)
        return concat_inputs(items)


@dataclass
class _Pending:
    """An item prepared but not yet placed in the token stream."""

    media: Media
    tokens: int
    data: bytes


@dataclass
class EpisodeMedia:
    """One episode's media: what the engine is sent each turn, and where each item sits."""

    resolver: MediaResolver
    base_dir: Path | None = None
    """Where relative file paths in parts are resolved (the task file's folder)."""
    items: list[MediaData] = field(default_factory=list)
    """Every placed item, in the order of its block: what each turn sends the engine."""
    placements: list[MediaPlacement] = field(default_factory=list)
    """Where every placed item sits (becomes `Trajectory.multimodal`)."""
    counts: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    """`media/<kind>` items placed, `media/<kind>_tokens`, `media/errors`, and
    `media/preprocess_seconds` (decoding and features, cache misses only)."""
    _pending: list[_Pending] = field(default_factory=list)

    def prepare(self, messages: Sequence[Message], *, strict: bool) -> list[Message]:
        """`messages` with every media part resolved (stored, processed, counted).

        `strict`: an unusable item raises `MediaError` (a prompt); otherwise it becomes a text
        part saying why (a tool result). Call `place` with the ids the messages render to.
        """
        out: list[Message] = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                out.append(dict(message))
                continue
            parts: list[Any] = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in KINDS or "tokens" in part:
                    parts.append(part)
                    continue
                try:
                    parts.append(self._resolve(MediaKind(kind), part))
                except MediaError as err:
                    if strict:
                        raise
                    self.counts["media/errors"] += 1
                    parts.append({"type": "text", "text": f"[{kind} not shown: {err}]"})
            out.append({**message, "content": parts})
        return out

    def place(self, ids: Sequence[int], start: int) -> None:
        """Record where the pending items' blocks are in `ids` (appended at `start` of the
        token stream), in order. Raises `MediaError` if the blocks found are not the pending
        items' (a bug in the chat format, never expected)."""
        tokens = self.resolver.tokens
        pending, self._pending = self._pending, []
        if not pending:
            return
        assert tokens is not None
        pads = {tokens.image, tokens.audio, tokens.video}
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] in pads:
                j = i
                while j < len(ids) and ids[j] == ids[i]:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if [n for _, n in runs] != [p.tokens for p in pending]:
            raise MediaError(
                f"placeholder blocks of {[n for _, n in runs]} tokens rendered for items of "
                f"{[p.tokens for p in pending]}"
            )
        for (offset, n), item in zip(runs, pending, strict=True):
            self.placements.append(
                MediaPlacement(**item.media.model_dump(), offset=start + offset, tokens=n)
            )
            self.items.append(MediaData(kind=item.media.kind, data=item.data))
            self.counts[f"media/{item.media.kind}"] += 1
            self.counts[f"media/{item.media.kind}_tokens"] += n

    def placeholder_ids(self) -> frozenset[int]:
        """Ids the model must not be fed as sampled text (`MediaTokens.placeholders`)."""
        tokens = self.resolver.tokens
        return tokens.placeholders if tokens is not None else frozenset()

    def _resolve(self, kind: MediaKind, part: dict[str, Any]) -> dict[str, Any]:
        source = part.get(kind.value)
        if isinstance(source, MediaData):
            if source.kind is not kind:
                raise MediaError(f"a {kind} part holds a {source.kind}")
            data = source.data
        elif isinstance(source, bytes) or (isinstance(source, str) and source.startswith("data:")):
            data = read_source(source, max_bytes=self.resolver.config.max_bytes)
        elif isinstance(source, str | Path) and self.resolver.allow_files:
            data = read_source(
                source, base_dir=self.base_dir, max_bytes=self.resolver.config.max_bytes
            )
        else:
            files = "a file path, " if self.resolver.allow_files else ""
            raise MediaError(
                f"a {kind} part needs its source under {kind.value!r} (a data: URI, {files}bytes "
                f"or MediaData), got {type(source).__name__}"
                + (
                    ""
                    if self.resolver.allow_files or not isinstance(source, str)
                    else ": file paths are not accepted here, inline the file as a data: URI"
                )
            )
        processed = self.resolver.resolve(kind, data)
        assert processed.media is not None
        self.counts["media/preprocess_seconds"] += processed.seconds
        self._pending.append(_Pending(processed.media, processed.tokens, data))
        return {"type": kind.value, "tokens": processed.tokens, "media": processed.media}


def absolute_sources(messages: Sequence[Message], base_dir: Path) -> list[Message]:
    """`messages` with every relative file path of a media part made absolute against
    `base_dir` (a task file's folder), so the task reads the same from any process."""
    out: list[Message] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [_absolute(part, base_dir) for part in content]
        out.append({**message, "content": content})
    return out


def _absolute(part: Any, base_dir: Path) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    source = part.get(kind) if kind in KINDS else None
    if not isinstance(source, str) or source.startswith(("data:", "http:", "https:")):
        return part
    path = Path(source.removeprefix("file://")).expanduser()
    return part if path.is_absolute() else {**part, kind: str(base_dir / path)}
