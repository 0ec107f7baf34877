"""The `tcp` backend: engines fetch checksummed weight buckets over HTTP from the trainer.

For engines in another cluster, or anywhere a torch.distributed group cannot form: an engine
needs to reach one HTTP port of the trainer (`tcp_advertise_url`, through a proxy or a tunnel
if need be), nothing more. The trainer runs a `BucketServer` (stdlib `ThreadingHTTPServer`,
one thread per engine connection, bodies sent from the packed buffer without a copy), and a
publish:

1. plans the buckets and offers version `v` at `{base}/v{v}`: its manifest (names, dtypes,
   shapes, byte offsets per bucket) at once, each bucket as soon as it is packed, with its
   xxHash3-128 in a header; packing runs on a thread while the first buckets travel;
2. pauses the engines (`in_place`) and asks each to fetch (`/update_weights_from_tcp`: the
   engine side is `omniloop.inference.weight_fetch`), all at once;
3. withdraws the offer once every engine answered.

Each engine resumes a broken bucket from the byte it reached (HTTP ranges) and refuses a bucket
whose checksum does not match, fetching it again, up to `tcp_retries` times. Only holders of
the sync's bearer token (made per sync, sent to the engines in the request body) may read.

Memory: one packed copy of the weights here while a version is offered (kept between
publishes), two bucket-sized receive buffers on each engine.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import xxhash
from torch import Tensor

from omniloop.inference.client import EngineClient
from omniloop.inference.protocol import (
    BUCKET_CHECKSUM_HEADER,
    BucketEntry,
    TensorEntry,
    WeightManifest,
)
from omniloop.inference.weight_groups import dtype_name
from omniloop.platform.dcs.base import (
    all_or_fail,
    engines_paused,
    materialize,
    nbytes_of,
    pack_into,
    plan_buckets,
    tagged,
)
from omniloop.platform.dcs.config import UpdateMode

log = logging.getLogger(__name__)

BUCKET_WAIT_S = 600.0
"""Longest a request for a bucket waits for the bucket to be packed."""
FETCH_SOCKET_TIMEOUT_S = 60.0
"""An engine's socket timeout per fetch (at most): a stalled connection is retried after it."""

_PATH = re.compile(r"^/v(?P<version>-?\d+)/(?:(?P<manifest>manifest)|buckets/(?P<bucket>\d+))$")
_RANGE = re.compile(r"^bytes=(?P<start>\d+)-(?P<end>\d*)$")


@dataclass
class Offer:
    """One version on offer: its manifest, and its buckets as they are packed."""

    version: int
    manifest: bytes
    flat: Tensor
    """Every bucket's bytes, back to back (uint8, CPU)."""
    spans: list[tuple[int, int]]
    """Per bucket: (start, nbytes) in `flat`."""
    digests: list[str | None] = field(init=False)
    ready: list[threading.Event] = field(init=False)
    failure: str | None = None
    """Set when packing failed: every request still waiting for a bucket is answered 500."""

    def __post_init__(self) -> None:
        self.digests = [None] * len(self.spans)
        self.ready = [threading.Event() for _ in self.spans]

    def bucket(self, index: int) -> memoryview:
        start, nbytes = self.spans[index]
        return self.flat[start : start + nbytes].numpy().data.cast("B")

    def mark_packed(self, index: int) -> None:
        self.digests[index] = xxhash.xxh3_128_hexdigest(self.bucket(index))
        self.ready[index].set()

    def fail(self, message: str) -> None:
        self.failure = message
        for event in self.ready:
            event.set()


class BucketServer:
    """Serves the offered version's manifest and buckets to holders of `token` (one thread
    per connection; HTTP/1.1 keep-alive; single byte ranges)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self._token = token
        self.offer: Offer | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                log.debug("bucket server: " + format, *args)

            def do_GET(self) -> None:
                try:
                    server._answer(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the engine went away mid-body: it resumes, or gives up

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="dcs-bucket-server", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            _reply(request, 401, b"a bearer token is required (the one the sync sent)\n")
            return
        match = _PATH.match(request.path)
        if match is None:
            _reply(request, 404, b"paths: /v{version}/manifest, /v{version}/buckets/{i}\n")
            return
        offer = self.offer
        version = int(match["version"])
        if offer is None or offer.version != version:
            now = "nothing" if offer is None else f"v{offer.version}"
            _reply(request, 404, f"v{version} is not on offer (now: {now})\n".encode())
            return
        if match["manifest"]:
            _reply(request, 200, offer.manifest, content_type="application/json")
            return
        index = int(match["bucket"])
        if index >= len(offer.spans):
            _reply(request, 404, f"v{version} has {len(offer.spans)} buckets\n".encode())
            return
        if not offer.ready[index].wait(BUCKET_WAIT_S) or offer.failure is not None:
            _reply(request, 500, f"bucket {index} was not packed: {offer.failure}\n".encode())
            return
        body = offer.bucket(index)
        status, start, end = 200, 0, len(body)
        wanted = request.headers.get("Range")
        if wanted:
            span = _RANGE.match(wanted)
            first = int(span["start"]) if span else -1
            last = int(span["end"]) + 1 if span and span["end"] else len(body)
            if span is None or not first < last <= len(body):
                request.send_response(416)
                request.send_header("Content-Range", f"bytes */{len(body)}")
                request.send_header("Content-Length", "0")
                request.end_headers()
                return
            status, start, end = 206, first, last
        request.send_response(status)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(end - start))
        request.send_header(BUCKET_CHECKSUM_HEADER, str(offer.digests[index]))
        if status == 206:
            request.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        request.end_headers()
        request.wfile.write(body[start:end])


def _reply(
    request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str = "text/plain"
) -> None:
    request.send_response(status)
    request.send_header("Content-Type", content_type)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


def manifest_of(version: int, buckets: Sequence[Sequence[tuple[str, Tensor]]]) -> WeightManifest:
    """What the buckets hold, with each tensor's byte offset in its bucket."""
    entries = []
    for bucket in buckets:
        tensors, offset = [], 0
        for name, tensor in bucket:
            tensors.append(
                TensorEntry(
                    name=name,
                    dtype=dtype_name(tensor.dtype),
                    shape=list(tensor.shape),
                    offset=offset,
                )
            )
            offset += tensor.numel() * tensor.element_size()
        entries.append(BucketEntry(nbytes=offset, tensors=tensors))
    return WeightManifest(version=version, buckets=entries)


def advertised_base(host: str, port: int, advertise_url: str | None) -> str:
    """The bucket server's base URL as engines reach it."""
    if advertise_url:
        return advertise_url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"http://{host}:{port}"


class TcpWeightSync:
    """Publishes by having every engine fetch the buckets from this process (module
    docstring). Concurrent `publish` calls are serialized."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        bucket_mb: float = 256.0,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_url: str | None = None,
        retries: int = 3,
        timeout_s: float = 600.0,
        update_mode: UpdateMode = "in_place",
    ) -> None:
        if not engine_urls:
            raise ValueError("no engines to publish to")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self._clients = [EngineClient(url, timeout=timeout_s) for url in engine_urls]
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self._retries = retries
        self._fetch_timeout = min(timeout_s, FETCH_SOCKET_TIMEOUT_S)
        self._update_mode = update_mode
        self._token = secrets.token_urlsafe(24)
        self._server = BucketServer(host, port, self._token)
        self.base_url = advertised_base(host, self._server.port, advertise_url)
        self._staging: Tensor | None = None
        self._lock = asyncio.Lock()

    @property
    def port(self) -> int:
        """The port the bucket server listens on."""
        return self._server.port

    def _buffer(self, nbytes: int) -> Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old buffer before allocating the larger one
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes]

    async def publish(
        self, named_weights: Iterable[tuple[str, Tensor]], version: int
    ) -> dict[str, float]:
        """Offer the weights as `version` and have every engine fetch them."""
        async with self._lock:
            started = time.perf_counter()
            named = materialize(named_weights)
            buckets = plan_buckets(named, self.bucket_bytes)
            manifest = manifest_of(version, buckets)
            flat = self._buffer(nbytes_of(named))
            spans, start = [], 0
            for entry in manifest.buckets:
                spans.append((start, entry.nbytes))
                start += entry.nbytes
            offer = Offer(version, manifest.model_dump_json().encode(), flat, spans)

            def pack() -> float:
                begun = time.perf_counter()
                try:
                    for i, bucket in enumerate(buckets):
                        pack_into(bucket, offer.flat[spans[i][0] : spans[i][0] + spans[i][1]])
                        offer.mark_packed(i)
                except BaseException as err:
                    offer.fail(repr(err))
                    raise
                return time.perf_counter() - begun

            self._server.offer = offer
            packing = asyncio.ensure_future(asyncio.to_thread(pack))
            try:
                async with engines_paused(
                    self._clients, self._update_mode, failed_leaves_paused=True
                ) as paused:
                    results = await all_or_fail(
                        [
                            tagged(
                                c,
                                c.update_weights_from_tcp(
                                    f"{self.base_url}/v{version}",
                                    token=self._token,
                                    weight_version=version,
                                    retries=self._retries,
                                    timeout_s=self._fetch_timeout,
                                ),
                            )
                            for c in self._clients
                        ],
                        f"publishing v{version} over tcp from {self.base_url}",
                    )
            finally:
                self._server.offer = None
                # The packing thread writes the staging buffer: let it end before the next use.
                await asyncio.wait([packing])
            packed = packing.result()
            seconds = time.perf_counter() - started
            nbytes = flat.numel()
            return {
                "weight_sync/seconds": seconds,
                "weight_sync/pack_seconds": packed,
                "weight_sync/slowest_engine_seconds": max(r.seconds for r in results),
                "weight_sync/bytes": float(nbytes),
                "weight_sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
                "weight_sync/buckets": float(len(buckets)),
                "weight_sync/resumed": float(sum(r.resumed for r in results)),
                "weight_sync/refetched": float(sum(r.refetched for r in results)),
                "weight_sync/engines": float(len(self._clients)),
                "weight_sync/version": float(version),
                **paused,
            }

    async def close(self) -> None:
        """Stop the bucket server and close the HTTP clients."""
        async with self._lock:
            await asyncio.to_thread(self._server.close)
            self._staging = None
            for client in self._clients:
                await client.aclose()
