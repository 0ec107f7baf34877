"""The engine's side of the DCS `tcp` backend: fetch a version's weight buckets over HTTP.

`WeightFetcher.fetch(source_url, ...)` reads `{source_url}/manifest` (a `WeightManifest`),
then each bucket from `{source_url}/buckets/{i}` into one of two reusable receive buffers, and
queues it on the core as one part of a multi-part update (`EngineCore.update_weights(...,
partial=True)`; the last bucket sets the version). The next bucket arrives while the one
before is copied into the model.

Per bucket, up to `retries` times: a broken connection (reset, timeout, short body) fetches
again from the byte reached (an HTTP `Range` request; a server that answers the whole body is
read from the start); a bucket whose xxHash3-128 differs from the one its response carries
(`BUCKET_CHECKSUM_HEADER`) is refused and fetched whole again. Past that the update fails
with `EngineError`, and as on the distributed path an engine that loaded some buckets admits
nothing until a later update completes (it never samples with a mix of versions).
Blocking: run it off the event loop.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import threading
import time
import urllib.parse
from dataclasses import dataclass

import torch
import xxhash

from omniloop.errors import ConfigError, EngineError
from omniloop.inference.core import EngineCore, WeightUpdateResult
from omniloop.inference.protocol import BUCKET_CHECKSUM_HEADER, BucketEntry, WeightManifest
from omniloop.inference.weight_groups import parse_dtype, tensor_views

RETRY_PAUSE_S = 0.2
"""Pause before the first retry of a bucket; doubled for each further one."""


class BucketFetchError(EngineError):
    """A bucket could not be fetched intact within its retries."""


@dataclass
class FetchStats:
    """What one `fetch` did."""

    bytes: int = 0
    seconds: float = 0.0
    resumed: int = 0
    """Fetches that went on from the byte reached after a broken connection."""
    refetched: int = 0
    """Buckets fetched whole again after a checksum mismatch."""


class _Source:
    """One keep-alive HTTP connection to a bucket server, reopened after a failure."""

    def __init__(self, source_url: str, token: str | None, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(source_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"source_url {source_url!r} is not an http(s) URL")
        self._parts = parts
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            kind = (
                http.client.HTTPSConnection
                if self._parts.scheme == "https"
                else http.client.HTTPConnection
            )
            self._conn = kind(self._parts.hostname or "", self._parts.port, timeout=self._timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def get(self, path: str, byte_range: tuple[int, int] | None = None) -> http.client.HTTPResponse:
        """Send `GET base/path`; the response's body is not read yet. Raises `OSError` or
        `http.client.HTTPException` on a transport failure, `BucketFetchError` on a non-2xx
        status (not worth retrying: the server has no such version, or refuses the token)."""
        headers = dict(self._headers)
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        conn = self._connection()
        conn.request("GET", f"{self._parts.path}/{path}", headers=headers)
        response = conn.getresponse()
        if response.status not in (200, 206):
            body = response.read(2000).decode("utf-8", "replace")
            raise BucketFetchError(
                f"GET {self._parts.path}/{path} answered {response.status}: {body.strip()}"
            )
        return response


class WeightFetcher:
    """Fetches weight updates for one `EngineCore` (module docstring); one at a time."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._pending: list[concurrent.futures.Future[WeightUpdateResult] | None] = [None, None]

    def fetch(
        self,
        source_url: str,
        *,
        token: str | None = None,
        version: int | None = None,
        retries: int = 3,
        timeout_s: float = 60.0,
        abort_all: bool = False,
    ) -> tuple[WeightUpdateResult, FetchStats]:
        """Fetch and load the version at `source_url` (`version` None: the manifest's).

        Raises `BucketFetchError` (a bucket did not arrive intact), `ConfigError` (the
        manifest's tensors do not fit this model) or `EngineError` (loading failed).
        """
        started = time.perf_counter()
        stats = FetchStats()
        source = _Source(source_url, token, timeout_s)
        with self._lock:
            try:
                manifest = self._manifest(source)
                target = manifest.version if version is None else version
                parts: list[concurrent.futures.Future[WeightUpdateResult]] = []
                last = len(manifest.buckets) - 1
                for i, bucket in enumerate(manifest.buckets):
                    flat = self._receive(source, i, bucket, retries, stats)
                    named = tensor_views(
                        flat,
                        [
                            (t.name, parse_dtype(t.dtype), tuple(t.shape), t.offset)
                            for t in bucket.tensors
                        ],
                    )
                    named = [(n, t) for n, t in named if not n.endswith("rotary_emb.inv_freq")]
                    if i == last:
                        _raise_if_a_part_failed(parts)
                    future = self._core.update_weights(
                        named,
                        version=target if i == last else None,
                        abort_all=abort_all,
                        partial=i < last,
                    )
                    self._pending[i % 2] = future
                    parts.append(future)
                result = parts[-1].result()
            finally:
                source.close()
        stats.seconds = time.perf_counter() - started
        return result, stats

    @staticmethod
    def _manifest(source: _Source) -> WeightManifest:
        try:
            response = source.get("manifest")
            return WeightManifest.model_validate_json(response.read())
        except (OSError, http.client.HTTPException) as err:
            raise BucketFetchError(f"fetching the manifest: {err!r}") from err
        except ValueError as err:
            raise ConfigError(f"the bucket server's manifest is malformed: {err}") from err

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of receive buffer `slot`, once the update reading it is done."""
        pending = self._pending[slot]
        if pending is not None:
            # The tensors of the bucket before last are views of this buffer.
            concurrent.futures.wait([pending])
            self._pending[slot] = None
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            self._buffers[slot] = None  # free the old one before allocating anew
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._buffers[slot] = buffer
        return buffer[:nbytes]

    def _receive(
        self, source: _Source, index: int, bucket: BucketEntry, retries: int, stats: FetchStats
    ) -> torch.Tensor:
        """Bucket `index`, intact, in a receive buffer."""
        flat = self._buffer(index % 2, bucket.nbytes)
        view = flat.numpy().data.cast("B")
        got = 0
        expected: str | None = None
        failures = 0
        while True:
            try:
                got, expected = _read_into(source, f"buckets/{index}", view, got, expected)
            except (OSError, http.client.HTTPException) as err:
                if isinstance(err, _Partial):
                    got, expected = err.got, err.expected
                source.close()
                failures += 1
                if failures > retries:
                    raise BucketFetchError(
                        f"bucket {index}: connection failed {failures} times, last at byte "
                        f"{got} of {bucket.nbytes}: {err!r}"
                    ) from err
                stats.resumed += 1
                time.sleep(RETRY_PAUSE_S * 2 ** (failures - 1))
                continue
            digest = xxhash.xxh3_128_hexdigest(view)
            if digest == expected:
                stats.bytes += bucket.nbytes
                return flat
            failures += 1
            if failures > retries:
                raise BucketFetchError(
                    f"bucket {index}: checksum mismatch {failures} times (xxh3_128 {digest}, "
                    f"the server's {expected}); refused"
                )
            stats.refetched += 1
            got, expected = 0, None


def _read_into(
    source: _Source, path: str, view: memoryview, start: int, expected: str | None
) -> tuple[int, str]:
    """Read `path`'s body from byte `start` into `view[start:]`; returns the bytes now held and
    the bucket's checksum. A server that ignores the range, or whose checksum changed since
    the bytes before `start` arrived, is read from byte 0."""
    total = len(view)
    response = source.get(path, (start, total - 1) if start else None)
    digest = response.getheader(BUCKET_CHECKSUM_HEADER)
    if not digest:
        response.close()
        raise BucketFetchError(f"GET {path} came without its {BUCKET_CHECKSUM_HEADER} header")
    if start and digest != expected:
        response.close()
        raise _Partial(0, None)  # another bucket than the one begun: start again
    if response.status == 200:
        start = 0
    length = response.getheader("Content-Length")
    if length is not None and int(length) != total - start:
        response.close()
        raise BucketFetchError(
            f"GET {path} sent {length} bytes where {total - start} were expected: the bucket "
            "server holds another version"
        )
    got = start
    try:
        while got < total:
            n = response.readinto(view[got:])
            if not n:
                raise http.client.IncompleteRead(b"", total - got)
            got += n
    except (OSError, http.client.HTTPException):
        # What arrived is kept: the next fetch resumes from `got`.
        raise _Partial(got, digest) from None
    return got, digest


class _Partial(http.client.HTTPException):
    """A body cut short at byte `got` of the bucket whose checksum is `expected` (the bytes
    before `got` are in the buffer)."""

    def __init__(self, got: int, expected: str | None) -> None:
        super().__init__(f"connection broken at byte {got}")
        self.got = got
        self.expected = expected


def _raise_if_a_part_failed(parts: list[concurrent.futures.Future[WeightUpdateResult]]) -> None:
    concurrent.futures.wait(parts)
    failed = [f.exception() for f in parts if f.exception() is not None]
    if failed:
        raise EngineError(
            f"{len(failed)} earlier bucket(s) of this update failed to load ({failed[0]}); "
            "no request is admitted until a complete update"
        )
