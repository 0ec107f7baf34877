"""The `Media` type: an image, audio clip or video, stored once by content hash.

A trajectory never holds media bytes: it holds `Media` references (kind, SHA-256, size,
format). The bytes live in a `MediaStore`, a folder addressed by hash, so an image that 16
episodes of a group share, or that a tool returns twice, is stored once.

Sources a task or a tool may give: raw bytes, a `data:` URI (base64 or percent-encoded), or a
file path (relative paths are resolved against the task file's folder). URLs are refused: a
rollout never reaches the network for media; download them and reference the files.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
import urllib.parse
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from omniloop.errors import MediaError


class MediaKind(StrEnum):
    """The three modalities besides text."""

    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


# Leading bytes of the containers the decoders read (offset, magic, format).
_SIGNATURES: list[tuple[int, bytes, str]] = [
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"\xff\xd8\xff", "jpeg"),
    (0, b"GIF87a", "gif"),
    (0, b"GIF89a", "gif"),
    (8, b"WEBP", "webp"),
    (0, b"BM", "bmp"),
    (8, b"WAVE", "wav"),
    (0, b"fLaC", "flac"),
    (0, b"OggS", "ogg"),
    (0, b"ID3", "mp3"),
    (4, b"ftyp", "mp4"),
    (0, b"\x1a\x45\xdf\xa3", "matroska"),
    (8, b"AVI ", "avi"),
]


def sniff_format(data: bytes) -> str:
    """The container format named by `data`'s leading bytes, or `unknown`."""
    for offset, magic, name in _SIGNATURES:
        if data[offset : offset + len(magic)] == magic:
            return name
    return "unknown"


class Media(BaseModel):
    """A reference to one media item in a `MediaStore` (what trajectories and messages hold)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MediaKind
    """Image, audio or video."""
    sha256: str
    """Hex SHA-256 of the encoded bytes: the item's address in the store."""
    size: int
    """Encoded size in bytes."""
    format: str
    """Container sniffed from the bytes (`png`, `wav`, `mp4`, ..., or `unknown`)."""

    @property
    def label(self) -> str:
        """Short name for messages and logs: `image:3f2a9c01b7e4`."""
        return f"{self.kind}:{self.sha256[:12]}"


class MediaData(BaseModel):
    """One media item in hand: its kind and encoded bytes (what a tool returns, what an engine
    is sent). Not for persisting: trajectories hold `Media` references instead."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MediaKind
    """Image, audio or video."""
    data: bytes
    """The encoded file (PNG, JPEG, WAV, FLAC, MP4, ...), exactly as stored."""

    def __repr__(self) -> str:
        return f"MediaData(kind={self.kind.value!r}, {len(self.data)} bytes)"


class MediaPlacement(Media):
    """A media item where it sits in a trajectory: what `Trajectory.multimodal` holds (as
    dicts), ordered by `offset`."""

    offset: int
    """Index in `input_ids` of the item's first placeholder token (its begin marker is just
    before, its end marker just after the last one)."""
    tokens: int
    """Placeholder tokens standing for the item."""

    @property
    def media(self) -> Media:
        """The reference alone (without its placement)."""
        return Media(kind=self.kind, sha256=self.sha256, size=self.size, format=self.format)


class MediaStore:
    """Media bytes in a folder, each stored once under its SHA-256.

    Writes are atomic (a temporary file renamed into place), so concurrent writers of the same
    item (rollout replicas sharing a run folder) are safe. Nothing is ever deleted here; the
    run's folder owns the lifetime.
    """

    def __init__(self, root: Path, *, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def put(self, data: bytes, kind: MediaKind | str) -> Media:
        """Store `data` (if not yet stored) and return its reference.

        Raises `MediaError` for empty data or data over `max_bytes`. The bytes are not decoded
        here; a decoder says whether they are a valid image, clip or video.
        """
        kind = MediaKind(kind)
        if not data:
            raise MediaError(f"{kind} is empty (0 bytes); give the file's contents")
        if len(data) > self.max_bytes:
            raise MediaError(
                f"{kind} is {len(data):,} bytes, above media.max_bytes={self.max_bytes:,}; "
                "shrink it or raise the bound"
            )
        media = Media(
            kind=kind, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
            format=sniff_format(data),
        )  # fmt: skip
        path = self.path(media)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return media

    def read(self, media: Media) -> bytes:
        """The bytes of `media`; `MediaError` if this store does not hold them."""
        path = self.path(media)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MediaError(
                f"{media.label} is not in the media store at {self.root}; it was stored "
                "elsewhere (pass the run's media folder)"
            ) from None
        if len(data) != media.size:
            raise MediaError(
                f"{media.label} in {self.root} has {len(data)} bytes, not {media.size}"
            )
        return data

    def path(self, media: Media) -> Path:
        """Where `media`'s bytes are kept: `<root>/<first two hex digits>/<sha256>`."""
        return self.root / media.sha256[:2] / media.sha256


def read_source(
    source: str | bytes | Path, *, base_dir: Path | None = None, max_bytes: int = 64 * 1024 * 1024
) -> bytes:
    """The encoded bytes named by `source`: bytes as given, a `data:` URI, or a file path.

    Relative paths resolve against `base_dir` (the task file's folder). Raises `MediaError`
    naming the source when it cannot be read or is over `max_bytes`.
    """
    if isinstance(source, bytes):
        return source
    if isinstance(source, str) and source.startswith("data:"):
        return _data_uri_bytes(source)
    if isinstance(source, str) and source.split(":", 1)[0] in ("http", "https"):
        raise MediaError(
            f"media source {source[:80]!r} is a URL; omniloop does not fetch media during a "
            "rollout: download it and reference the file (or inline it as a data: URI)"
        )
    text = str(source)
    path = Path(text.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise MediaError(
                f"media file {path} is {size:,} bytes, above media.max_bytes={max_bytes:,}"
            )
        return path.read_bytes()
    except OSError as exc:
        raise MediaError(f"cannot read media file {path}: {exc.strerror or exc}") from None


def _data_uri_bytes(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise MediaError(f"data URI {uri[:40]!r}... has no ',' before its payload")
    if header.endswith(";base64") or header == "data:":
        # SGLang's convention: `data:,<base64>` (no media type) carries base64 too.
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            if header == "data:":
                return urllib.parse.unquote_to_bytes(payload)
            raise MediaError(f"data URI {header!r} says base64 but its payload is not") from None
    return urllib.parse.unquote_to_bytes(payload)
