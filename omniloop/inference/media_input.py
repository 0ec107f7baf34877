"""Media in `/generate` requests: reading the items, processing them, matching them to `input_ids`.

An item arrives as SGLang sends it: a `data:` URI (base64 or percent-encoded), a bare base64
string, or a path on the engine's file system (as SGLang, the engine reads any path its
clients name: expose it only to trusted clients). URLs are refused (nothing is fetched). The
bytes go through the model family's processor (`modalities.families.processor_for`, built
from the engine's `MediaConfig`) on a small thread pool, never on the event loop.

Or a prompt's items of one kind arrive already processed, as SGLang's one `processor_output`
dict (`modalities.processing`): the family's processor splits and checks it instead. As in
SGLang, a prompt's media come all as files or all as `processor_output` dicts, never mixed;
`precomputed_embedding` dicts are refused.

`input_ids` are used verbatim, never re-tokenized: every item's placeholder block must already
be in them, expanded (`MediaTokens.block`: begin marker, as many placeholder ids as the
processor makes of the item, end marker), in the order the items were sent, per kind.
`check_placeholders` refuses a prompt whose blocks do not match its items in number, kind or
length, or that holds a placeholder or marker id outside a well-formed block; each message
names the item (`image 0: ...`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omniloop.errors import MediaError
from omniloop.modalities import (
    MediaKind,
    MediaProcessor,
    MediaTokens,
    ProcessedMedia,
    read_source,
)
from omniloop.modalities.processing import PROCESSOR_OUTPUT

MediaItem = tuple[MediaKind, str | dict[str, Any]]
"""One item of a request: its kind and its source as sent, or one `processor_output` dict
holding all of the prompt's items of that kind."""


def _pads(tokens: MediaTokens) -> dict[int, MediaKind]:
    return {
        tokens.image: MediaKind.IMAGE,
        tokens.audio: MediaKind.AUDIO,
        tokens.video: MediaKind.VIDEO,
    }


def _markers(tokens: MediaTokens, kind: MediaKind) -> tuple[int, int]:
    if kind is MediaKind.AUDIO:
        return tokens.audio_bos, tokens.audio_eos
    return tokens.vision_bos, tokens.vision_eos


def placeholder_blocks(
    input_ids: Sequence[int], tokens: MediaTokens
) -> list[tuple[MediaKind, int]]:
    """The placeholder blocks of `input_ids` in order: (kind, placeholder count) each.

    `ValueError` for a placeholder run not between its kind's begin and end markers, or a
    marker id that opens or closes no block (the model's 3-D positions would go astray)."""
    pads = _pads(tokens)
    blocks: list[tuple[MediaKind, int]] = []
    used: set[int] = set()
    i, n = 0, len(input_ids)
    while i < n:
        kind = pads.get(input_ids[i])
        if kind is None:
            i += 1
            continue
        start = i
        while i < n and input_ids[i] == input_ids[start]:
            i += 1
        bos, eos = _markers(tokens, kind)
        if start == 0 or input_ids[start - 1] != bos or i == n or input_ids[i] != eos:
            raise ValueError(
                f"input_ids hold {i - start} {kind} placeholder ids at {start} that are not "
                f"one block between its begin ({bos}) and end ({eos}) markers"
            )
        used.update((start - 1, i))
        blocks.append((kind, i - start))
    markers = {tokens.vision_bos, tokens.vision_eos, tokens.audio_bos, tokens.audio_eos}
    stray = next((j for j, t in enumerate(input_ids) if t in markers and j not in used), None)
    if stray is not None:
        raise ValueError(
            f"input_ids hold a media marker ({input_ids[stray]}) at {stray} that opens or "
            "closes no placeholder block"
        )
    return blocks


def check_counts(
    blocks: Sequence[tuple[MediaKind, int]], kinds: Sequence[MediaKind], where: str = ""
) -> None:
    """`ValueError` unless `blocks` hold, per kind, as many blocks as `kinds` has items."""
    for kind in MediaKind:
        have = sum(1 for k, _ in blocks if k is kind)
        sent = sum(1 for k in kinds if k is kind)
        if have != sent:
            raise ValueError(
                f"{where}input_ids hold {have} {kind} placeholder block(s) but {kind}_data has "
                f"{sent} item(s): send one item per block, in block order"
            )


def check_placeholders(
    input_ids: Sequence[int],
    media: Sequence[ProcessedMedia],
    tokens: MediaTokens,
    where: str = "",
) -> None:
    """`ValueError` unless `input_ids` hold exactly one block per item of `media`, per kind
    in order, each with the item's placeholder count (module docstring)."""
    blocks = placeholder_blocks(input_ids, tokens)
    check_counts(blocks, [m.kind for m in media], where)
    for kind in MediaKind:
        counts = [count for k, count in blocks if k is kind]
        items = [m for m in media if m.kind is kind]
        for index, (count, item) in enumerate(zip(counts, items, strict=True)):
            if count != item.tokens:
                raise ValueError(
                    f"{where}{kind} {index}: its placeholder block has {count} tokens but the "
                    f"processor makes {item.tokens} of it (engine and client media configs "
                    "differ?)"
                )


def _names_a_file(source: str) -> bool:
    if source.startswith("file://"):
        return True
    try:
        return Path(source).expanduser().is_file()
    except (OSError, ValueError):  # too long for a path, or a NUL in it: base64 then
        return False


def source_bytes(source: str, max_bytes: int, label: str) -> bytes:
    """The encoded bytes of an item as sent (module docstring); `MediaError` naming `label`.

    A `data:` URI, then an existing file (or `file://`), then base64; a string that is none
    of them is reported as a file that cannot be read."""
    try:
        if source.startswith("data:") or _names_a_file(source):
            data = read_source(source, max_bytes=max_bytes)
        else:
            try:
                data = base64.b64decode(source, validate=True)
            except (binascii.Error, ValueError):
                data = read_source(source, max_bytes=max_bytes)
    except MediaError as err:
        raise MediaError(f"{label}: {err}") from None
    if not data:
        raise MediaError(f"{label} is empty")
    if len(data) > max_bytes:
        raise MediaError(f"{label} is {len(data):,} bytes, above media.max_bytes={max_bytes:,}")
    return data


class MediaPreparer:
    """Reads and processes the media of requests on its own threads (module docstring)."""

    def __init__(self, processor: MediaProcessor, max_bytes: int, workers: int = 2) -> None:
        """`processor`: the model family's (`modalities.families.processor_for`);
        `max_bytes`: the largest encoded item accepted (`MediaConfig.max_bytes`)."""
        self.processor = processor
        self.max_bytes = max_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="omniloop-media"
        )

    def process(self, items: Sequence[MediaItem], where: str = "") -> tuple[ProcessedMedia, ...]:
        """Read and process `items` on the calling thread; `MediaError` naming the item."""
        dicts = [kind for kind, source in items if not isinstance(source, str)]
        if dicts:
            return self._split(items, where)
        out = []
        seen: dict[MediaKind, int] = {}
        for kind, source in items:
            assert isinstance(source, str)
            index = seen.get(kind, 0)
            seen[kind] = index + 1
            label = f"{where}{kind} {index}"
            data = source_bytes(source, self.max_bytes, label)
            out.append(self.processor.process(kind, data, label=label))
        return tuple(out)

    def _split(self, items: Sequence[MediaItem], where: str) -> tuple[ProcessedMedia, ...]:
        """The items of a prompt whose media come as `processor_output` dicts, one per kind."""
        out: list[ProcessedMedia] = []
        kinds: set[MediaKind] = set()
        for kind, source in items:
            label = f"{where}{kind}_data"
            if isinstance(source, str):
                raise MediaError(
                    f"{where}media mix files and processor_output dicts: send all of a "
                    "prompt's media one way (as SGLang requires)"
                )
            form = source.get("format")
            if form != PROCESSOR_OUTPUT:
                raise MediaError(
                    f"{label}: a media dict needs format {PROCESSOR_OUTPUT!r} (got {form!r}); "
                    "precomputed embeddings are not supported"
                )
            if kind in kinds:
                raise MediaError(
                    f"{label}: one processor_output dict holds all of a prompt's {kind} items; "
                    "got several"
                )
            kinds.add(kind)
            out += self.processor.split_processor_output(kind, source, label=label)
        return tuple(out)

    async def prepare(
        self, items: Sequence[MediaItem], where: str = ""
    ) -> tuple[ProcessedMedia, ...]:
        """`process` on the pool, awaited."""
        if not items:
            return ()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.process, items, where)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
