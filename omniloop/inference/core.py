"""The CPU engine's generation core: continuous batching over a slot-based KV cache.

One scheduler thread owns the model, the KV cache and the tokenizer. Each iteration it applies
control requests (pause, continue, weight updates), admits waiting requests into free slots and
prefills them in one packed forward, then decodes one token for every active sequence in one
batched forward. A sequence leaves the batch as soon as it finishes; its slot is refilled by the
next waiting request on the following iteration. Callers talk to the thread through
`concurrent.futures.Future`s, so the HTTP server's event loop never runs torch code.

Contracts:
- Greedy at temperature 0 (below 1e-6, as SGLang); otherwise temperature, then top-k, then
  top-p, sampled with a per-request `torch.Generator` seeded from `seed` (same seed, same
  prompt, same weights: same tokens).
- Logprobs are of the sampled token under the raw model distribution (temperature 1, no top-k
  or top-p truncation): `log_softmax(logits)[token]`, the quantity a trainer scoring at
  temperature 1 recomputes. (SGLang can also return processed-distribution logprobs; not here.)
- Stop order after each sampled token: an EOS id (unless `ignore_eos`) or a `stop_token_ids`
  id (the token is kept in `output_ids`), then a stop string found in the decoded tail, then
  `max_new_tokens`, then the context length. SGLang checks `max_new_tokens` first; here a
  stop token that is also the last allowed token reports `stop`, which is the more useful fact.
- Weight versions, two ways for an update to land (never aborting a request unless asked):
  - in place, when generation is paused (`pause`, mode `in_place` or `retract`, as a trainer
    does before it publishes): the weights are swapped between two decode steps, running
    sequences keep their cached keys and values and go on under the new weights after
    `resume`. Each token records the version that sampled it (`output_versions`), so a
    response may change version mid-way, exactly at the update;
  - drained, otherwise: the update stops admission, lets active sequences finish, swaps the
    weights and bumps the version; only then are waiting requests admitted, and every result
    is sampled by one version.
- Multi-part updates (a trainer broadcasting its weights in buckets): every part but the last
  is `partial`; from the first part on nothing is sampled (drained: admission stays closed;
  in place: generation is paused anyway) until the last part sets the version, so no token is
  sampled with a mix of old and new weights.
- Prefix cache (`prefix_cache.PrefixIndex`): a finished sequence's keys and values are copied
  into one of `prefix_cache_slots` retained slots; a request whose prompt extends a retained
  prefix (whole blocks of 16 tokens) copies it back and prefills only the rest, reported as
  `cached_tokens`. A weight update or `flush_cache` empties it. The outputs are those of a full
  prefill up to float rounding (the attention over the cached part is computed in another
  order).
- Weight-update groups: `init_weights_update_group` joins a trainer's torch.distributed group
  (gloo; its own store and name, never the default group) and
  `update_weights_from_distributed` receives one broadcast bucket on the calling thread, so
  generation goes on while the bytes arrive; only the copy into the model waits for the drain.

Not covered: chunked prefill (a prompt is prefilled
in one forward), preemption, multiple samples per request (`n`), penalties, grammars.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist
from pydantic import Field

from omniloop.config import StrictModel
from omniloop.errors import ConfigError, EngineError
from omniloop.inference.llama import (
    KVCache,
    LlamaConfig,
    LlamaModel,
    LlamaWeights,
    load_weights,
    read_safetensors,
)
from omniloop.inference.prefix_cache import PrefixIndex

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

GREEDY_EPS = 1e-6
"""Temperatures below this are greedy (SGLang's threshold)."""

WEIGHT_UPDATE_TIMEOUT = timedelta(seconds=600)
"""How long a weight-update group waits for its peers (joining, or a broadcast to start)."""

FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's `load_format` for a bucket broadcast as one uint8 tensor: each tensor's bytes,
flattened, one after the other in the order of `names`."""

T = TypeVar("T")

PauseMode = Literal["abort", "retract", "in_place"]
FinishType = Literal["stop", "length", "abort"]


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class EngineServerConfig(StrictModel):
    """How to run omniloop's CPU engine (`omniloop engine serve`)."""

    model: str = "tiny"
    """`smollm2`, `tiny`, or a path to a Hugging Face Llama folder with safetensors."""
    host: str = "127.0.0.1"
    """Interface the HTTP server binds."""
    port: int = Field(default=30000, ge=0, le=65535)
    """TCP port of the HTTP server; 0 picks a free one (the ready line prints it)."""
    threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads for the forward passes; None uses every core of the affinity mask."""
    max_batch: int = Field(default=32, ge=1)
    """Most sequences decoded together (KV cache slots)."""
    max_context: int | None = Field(default=None, ge=2)
    """Most tokens per sequence, prompt included; None: the model's limit, capped at 4096."""
    prefill_tokens: int = Field(default=2048, ge=1)
    """Most prompt tokens packed into one prefill forward (a longer prompt runs alone)."""
    prefix_cache_slots: int = Field(default=32, ge=0)
    """Finished sequences whose keys and values are kept for prompts that extend them (the
    next turn of an episode); 0 turns the prefix cache off. Memory is committed only as
    slots fill: up to this many times `max_context` positions of keys and values."""


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete. Field meanings follow SGLang's `sampling_params`."""

    input_ids: list[int]
    rid: str = ""
    max_new_tokens: int | None = 128
    """None: until a stop condition or the context is full."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps the whole vocabulary."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    """Seed of this request's sampling generator; None draws a random one."""
    skip_special_tokens: bool = True
    """Only for `GenerationResult.text`."""
    no_stop_trim: bool = False
    """Keep a matched stop string at the end of `GenerationResult.text`."""
    token_texts: bool = False
    """Also decode each output token on its own (`GenerationResult.token_texts`)."""


@dataclass(frozen=True)
class GenerationResult:
    """What came of one `GenerationRequest`."""

    rid: str
    output_ids: list[int]
    """Sampled ids, verbatim, including a matched stop or EOS token."""
    output_logprobs: list[float]
    """Raw-distribution logprob of each sampled id (see the module docstring)."""
    finish_type: FinishType
    matched: int | str | None
    """The stop token id or stop string for `stop`; None otherwise."""
    finish_message: str | None
    """Why a request was aborted."""
    prompt_tokens: int
    weight_version: int
    """The version of the weights that sampled the first output token (the one the request was
    admitted under)."""
    output_versions: list[int]
    """The version of the weights that sampled each output token: an update applied in place
    changes it mid-response."""
    cached_tokens: int
    """Prompt tokens whose keys and values came from the prefix cache instead of a prefill."""
    text: str
    """The output decoded (special tokens per the request; a matched stop string trimmed)."""
    token_texts: list[str] | None
    e2e_latency: float
    """Seconds from submission to the result."""


@dataclass(frozen=True)
class WeightUpdateResult:
    """Outcome of a weight update applied by the scheduler."""

    weight_version: int
    num_aborted: int
    """Requests aborted because the update asked for `abort_all_requests`."""
    num_waiting: int
    """Requests that were held in the queue while the weights changed."""


@dataclass
class _Sequence:
    req: GenerationRequest
    future: concurrent.futures.Future[GenerationResult]
    submitted: float
    generator: torch.Generator | None = None
    slot: int = -1
    cached: int = 0
    """Tokens whose keys/values are in the cache (the next decode position)."""
    version: int = 0
    prefix_hit: int = 0
    """Prompt tokens taken from the prefix cache."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: tuple[FinishType, int | str | None, str | None] | None = None


@dataclass
class _Update:
    named: list[tuple[str, torch.Tensor]]
    version: int | None
    abort_all: bool
    keep_pause: bool
    partial: bool
    future: concurrent.futures.Future[WeightUpdateResult]


@dataclass
class _UpdateGroup:
    """A joined weight-update group and what receiving into it needs."""

    name: str
    group: dist.ProcessGroup
    store: dist.Store
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a bucket is received: broadcasts of one group must not interleave."""
    buffers: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    """Two receive buffers, used in turn: one bucket arrives while the previous one is copied
    into the model. Reused, so their pages are not faulted in again for every bucket."""
    pending: list[concurrent.futures.Future[WeightUpdateResult] | None] = field(
        default_factory=lambda: [None, None]
    )
    """Per buffer, the update that still reads it (its tensors are views of the buffer)."""
    slot: int = 0
    """The buffer the next bucket goes to."""
    parts: list[concurrent.futures.Future[WeightUpdateResult]] = field(default_factory=list)
    """Parts queued since the last bucket with a version: that bucket checks they all loaded."""


def _resolve(future: concurrent.futures.Future[GenerationResult], result: GenerationResult) -> None:
    # The caller may have given up (HTTP client gone): its future is cancelled, not resolvable.
    if not future.done():
        future.set_result(result)


class EngineCore:
    """A Llama model behind a continuous-batching scheduler thread.

    Thread-safe: `submit`, `pause`, `resume`, `update_weights` and `shutdown` may be called
    from any thread; all torch work happens on the scheduler thread started by `start`.
    """

    def __init__(
        self,
        model_path: Path,
        *,
        max_batch: int = 32,
        max_context: int | None = None,
        threads: int | None = None,
        prefill_tokens: int = 2048,
        prefix_cache_slots: int = 32,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """Load the model folder's weights and tokenizer; see `EngineServerConfig` for the knobs.

        `max_context` is capped at the model's `max_position_embeddings` (default: that, at
        most 4096). The scheduler thread sets torch's thread count to `threads`, which in
        torch is process-wide.
        """
        from transformers import AutoTokenizer

        self.model_path = Path(model_path)
        self.config = LlamaConfig.from_folder(self.model_path)
        limit = self.config.max_position_embeddings
        self.max_context = min(max_context or min(limit, 4096), limit)
        self.max_batch = max_batch
        self.threads = threads or available_cores()
        self.prefill_tokens = prefill_tokens
        self.weights: LlamaWeights = load_weights(self.model_path, self.config)
        self.model = LlamaModel(self.weights, self.max_context)
        # Slots 0..max_batch-1 hold the running sequences (packed), the rest retained prefixes.
        self.cache = KVCache(self.config, max_batch + prefix_cache_slots, self.max_context)
        self._prefixes = PrefixIndex(range(max_batch, max_batch + prefix_cache_slots))
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.model_path)
        self._weight_version = 0
        self._cv = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._controls: deque[Callable[[], None]] = deque()
        self._updates: deque[_Update] = deque()
        self._paused = False
        self._holding = False
        """A multi-part weight update is under way: admit nothing until its last part."""
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.forward_passes = 0
        """Forward passes completed so far (a liveness signal for health checks)."""
        self.cached_tokens = 0
        """Prompt tokens served from the prefix cache so far."""
        self._groups: dict[str, _UpdateGroup] = {}
        self._joining: set[str] = set()
        self._groups_lock = threading.Lock()

    # -- public API -------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version of the weights now loaded (0 at start)."""
        return self._weight_version

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def updating(self) -> bool:
        """Whether a multi-part weight update has begun and its last part has not landed."""
        return self._holding

    def is_alive(self) -> bool:
        """Whether the scheduler thread is running and has not crashed."""
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    def start(self) -> None:
        """Start the scheduler thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="omniloop-engine-scheduler", daemon=True
            )
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the scheduler; requests still queued or running fail with `EngineError`."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        # Controls queued after the last iteration only flip flags or abort; run them here so
        # their callers are answered.
        while self._controls:
            self._controls.popleft()()
        error = EngineError("the engine is shutting down")
        for seq in [*self._active, *self._waiting]:
            if not seq.future.done():
                seq.future.set_exception(error)
        for update in self._updates:
            if not update.future.done():
                update.future.set_exception(error)
        self._active.clear()
        self._waiting.clear()
        self._updates.clear()

    def validate(self, req: GenerationRequest) -> None:
        """Raise `ValueError` with the reason if `req` cannot run on this engine."""
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("input_ids cannot be empty")
        if n >= self.max_context:
            raise ValueError(
                f"the input ({n} tokens) is longer than the engine's context length "
                f"({self.max_context} tokens, prompt and output together)"
            )
        bad = next((t for t in req.input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"input_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        if req.max_new_tokens is not None and req.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {req.max_new_tokens}")

    def submit(self, req: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queue `req` (validated first: `ValueError`); the future resolves to its result.

        Cancelling the future drops the request at the scheduler's next iteration.
        """
        self.validate(req)
        if self._stopping:
            raise EngineError("the engine is shutting down")
        if self._failure is not None:
            raise EngineError(f"the engine scheduler crashed: {self._failure!r}")
        future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        seq = _Sequence(req=req, future=future, submitted=time.perf_counter())
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify_all()
        return future

    def pause(self, mode: PauseMode = "in_place") -> concurrent.futures.Future[int]:
        """Stop scheduling forward passes; resolves (to the number aborted) once in effect.

        `in_place` and `retract` keep running sequences (their KV cache stays) to resume on
        `resume`; `abort` finishes every running and waiting request with `abort`.
        Requests submitted while paused wait in the queue.
        """

        def apply() -> int:
            self._paused = True
            if mode == "abort":
                return self._abort_all("generation aborted by pause_generation")
            return 0

        return self._control(apply)

    def resume(self) -> concurrent.futures.Future[int]:
        """Undo `pause`; resolves once the scheduler runs again.

        It also ends an unfinished multi-part weight update (the trainer gave up after some
        parts): generation goes on with the weights as they are, version unchanged.
        """

        def apply() -> int:
            if self._holding:
                log.warning(
                    "continue_generation ends an unfinished multi-part weight update; "
                    "serving partly updated weights at version %d",
                    self._weight_version,
                )
            self._paused = False
            self._holding = False
            return 0

        return self._control(apply)

    def flush_cache(self) -> concurrent.futures.Future[int]:
        """Empty the prefix cache; resolves to the number of prefixes dropped."""
        return self._control(self._prefixes.clear)

    def update_weights(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        abort_all: bool = False,
        keep_pause: bool = False,
        full: bool = False,
        partial: bool = False,
    ) -> concurrent.futures.Future[WeightUpdateResult]:
        """Replace weights (Hugging Face names) between sequences, and set the version.

        Shapes and names are checked here, before anything changes (`ConfigError`); with
        `full` every weight must be given. While generation is paused the update lands in
        place at once: running sequences keep their keys and values and go on under the new
        weights after `resume`. Otherwise the scheduler stops admitting requests and waits for
        running sequences to finish (or aborts them with `abort_all`) first. It then copies the
        tensors in, empties the prefix cache, and sets the version to `version` or, when None,
        to the current one plus 1.

        `partial`: this is one part of a multi-part update. It is applied as above but leaves
        the version alone (`version` is ignored) and keeps admission closed afterwards, so
        nothing is sampled until a later non-partial update (the last part) sets the version,
        or `resume` gives up on the rest. A part that fails to load keeps admission closed too:
        the weights may be half-updated, and the trainer is expected to publish them again.
        """
        self.weights.check(named, full=full)
        future: concurrent.futures.Future[WeightUpdateResult] = concurrent.futures.Future()
        update = _Update(list(named), version, abort_all, keep_pause, partial, future)
        with self._cv:
            self._updates.append(update)
            self._cv.notify_all()
        return future

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        *,
        version: int | None = None,
        abort_all: bool = False,
        keep_pause: bool = False,
    ) -> concurrent.futures.Future[WeightUpdateResult]:
        """Load a model folder's safetensors (same architecture) as a full weight update.

        Reads the files on the calling thread, so the scheduler only pauses for the copy.
        Raises `ConfigError` if the folder's model does not have this model's shapes.
        """
        folder = Path(model_path)
        other = LlamaConfig.from_folder(folder)
        if not self.config.same_shapes(other):
            raise ConfigError(
                f"{folder} holds a model of another shape than the one served "
                f"({other} vs {self.config})"
            )
        state = read_safetensors(folder)
        named = [(n, t) for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")]
        return self.update_weights(
            named, version=version, abort_all=abort_all, keep_pause=keep_pause, full=True
        )

    # -- weight-update groups (a trainer's broadcast) ---------------------------------------

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout: timedelta = WEIGHT_UPDATE_TIMEOUT,
    ) -> None:
        """Join the trainer's group `group_name` as rank `rank_offset` (the trainer is rank 0).

        Blocks the calling thread until every rank has joined (or `timeout`); generation goes
        on meanwhile. Raises `ConfigError` for a backend this CPU engine cannot use (only
        gloo) or a name already joined, and `EngineError` if joining fails.
        """
        if backend != "gloo":
            raise ConfigError(
                f"backend {backend!r}: the CPU engine receives weights over gloo only "
                "(NCCL needs GPU tensors; use SGLang on GPUs)"
            )
        if not 0 < rank_offset < world_size:
            raise ConfigError(f"rank_offset {rank_offset} is outside 1..{world_size - 1}")
        with self._groups_lock:
            if group_name in self._groups or group_name in self._joining:
                raise ConfigError(
                    f"weight-update group {group_name!r} exists; destroy it first "
                    "(/destroy_weights_update_group)"
                )
            # Reserve the name while joining, so a second init cannot race this one.
            self._joining.add(group_name)
        try:
            store = weight_update_store(
                master_address,
                master_port,
                rank=rank_offset,
                world_size=world_size,
                timeout=timeout,
            )
            group = new_weight_update_group(
                store,
                backend=backend,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                timeout=timeout,
            )
        except Exception as err:
            with self._groups_lock:
                self._joining.discard(group_name)
            raise EngineError(
                f"could not join weight-update group {group_name!r} at "
                f"{master_address}:{master_port} as rank {rank_offset} of {world_size}: {err}"
            ) from err
        with self._groups_lock:
            self._joining.discard(group_name)
            self._groups[group_name] = _UpdateGroup(group_name, group, store)

    def weight_update_groups(self) -> list[str]:
        """Names of the weight-update groups joined so far."""
        with self._groups_lock:
            return list(self._groups)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave `group_name` (`ConfigError` if unknown); waits for a receive in progress."""
        update_group = self._joined(group_name)
        with update_group.lock:
            with self._groups_lock:
                self._groups.pop(group_name, None)
            dist.destroy_process_group(update_group.group)
            update_group.buffers = [None, None]

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        flattened: bool,
        version: int | None,
        abort_all: bool = False,
    ) -> concurrent.futures.Future[WeightUpdateResult]:
        """Receive one bucket broadcast by rank 0 of `group_name`, then queue it as an update.

        Blocks the calling thread while the bytes arrive (`flattened`: one uint8 broadcast of
        every tensor's bytes in order, SGLang's `flattened_bucket`; otherwise one broadcast per
        tensor, in order). The bucket is received before its names and shapes are checked, so
        a bad bucket fails this call (`ConfigError`) without leaving the sender blocked
        half-way through a collective.

        `version` None makes the bucket a partial update (see `update_weights`); its future
        need not be awaited, since the last bucket (the one with a version) first waits for
        every earlier part to load, and if one failed it loads nothing and raises
        `EngineError` (admission stays closed: the weights are incomplete); otherwise it sets
        the version and lets generation resume. Rotary `inv_freq` buffers are skipped, as on
        the disk path.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ConfigError(
                f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: "
                "one of each per tensor"
            )
        update_group = self._joined(group_name)
        specs = [
            (n, parse_dtype(d), tuple(int(x) for x in s))
            for n, d, s in zip(names, dtypes, shapes, strict=True)
        ]
        with update_group.lock:
            slot = update_group.slot
            update_group.slot ^= 1
            pending = update_group.pending[slot]
            if pending is not None:
                # The tensors of the bucket before last are views of this buffer.
                concurrent.futures.wait([pending])
                update_group.pending[slot] = None
            if flattened:
                named = self._receive_flattened(update_group, slot, specs)
            else:
                named = self._receive_each(update_group, slot, specs)
            named = [(n, t) for n, t in named if not n.endswith("rotary_emb.inv_freq")]
            if version is not None:
                parts, update_group.parts = update_group.parts, []
                concurrent.futures.wait(parts)
                failed = [f.exception() for f in parts if f.exception() is not None]
                if failed:
                    raise EngineError(
                        f"{len(failed)} earlier bucket(s) of this update failed to load "
                        f"({failed[0]}); no request is admitted until a complete update"
                    )
            future = self.update_weights(
                named, version=version, abort_all=abort_all, partial=version is None
            )
            update_group.pending[slot] = future
            if version is None:
                update_group.parts.append(future)
            return future

    def _joined(self, group_name: str) -> _UpdateGroup:
        with self._groups_lock:
            update_group = self._groups.get(group_name)
        if update_group is None:
            raise ConfigError(
                f"no weight-update group {group_name!r} (joined: {self.weight_update_groups()}); "
                "call /init_weights_update_group first"
            )
        return update_group

    @staticmethod
    def _buffer(update_group: _UpdateGroup, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of receive buffer `slot`, grown if too small."""
        buffer = update_group.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            update_group.buffers[slot] = None  # free the old one before allocating anew
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            update_group.buffers[slot] = buffer
        return buffer[:nbytes]

    @classmethod
    def _receive_flattened(
        cls,
        update_group: _UpdateGroup,
        slot: int,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    ) -> list[tuple[str, torch.Tensor]]:
        sizes = [_numel(shape) * dtype.itemsize for _, dtype, shape in specs]
        flat = cls._buffer(update_group, slot, sum(sizes))
        dist.broadcast(flat, src=0, group=update_group.group)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return tensor_views(
            flat, [(n, d, s, o) for (n, d, s), o in zip(specs, offsets, strict=True)]
        )

    @classmethod
    def _receive_each(
        cls,
        update_group: _UpdateGroup,
        slot: int,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    ) -> list[tuple[str, torch.Tensor]]:
        # Each tensor gets a 64-byte aligned view of the buffer: any dtype can view it.
        sizes = [_numel(shape) * dtype.itemsize for _, dtype, shape in specs]
        starts = []
        end = 0
        for size in sizes:
            starts.append(end)
            end += -(-size // 64) * 64
        buffer = cls._buffer(update_group, slot, end)
        named = [
            (name, buffer[start : start + size].view(dtype).view(shape))
            for (name, dtype, shape), start, size in zip(specs, starts, sizes, strict=True)
        ]
        works = [
            dist.broadcast(t, src=0, group=update_group.group, async_op=True) for _, t in named
        ]
        for work in works:
            if work is not None:
                work.wait()
        return named

    def decode_text(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    # -- scheduler thread -------------------------------------------------------------------

    def _control(self, fn: Callable[[], int]) -> concurrent.futures.Future[int]:
        future: concurrent.futures.Future[int] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)

        with self._cv:
            self._controls.append(run)
            self._cv.notify_all()
        return future

    def _has_work(self) -> bool:
        if self._controls or self._updates:
            return True
        return not self._paused and not self._holding and bool(self._active or self._waiting)

    def _run(self) -> None:
        # Process-wide in torch: an in-process core also sets the caller's thread count.
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while not self._stopping and not self._has_work():
                            self._cv.wait()
                        if self._stopping:
                            return
                        controls = list(self._controls)
                        self._controls.clear()
                    for control in controls:
                        control()
                    self._drop_cancelled()
                    if self._updates and not self._apply_update():
                        # Draining for an update: finish what runs, admit nothing new.
                        if not self._paused and self._active:
                            self._guarded(self._decode_step, self._active)
                        continue
                    if self._paused or self._holding:
                        continue
                    admitted = self._admit()
                    if admitted:
                        self._guarded(self._prefill, admitted)
                    if self._active:
                        self._guarded(self._decode_step, self._active)
        except BaseException as err:  # a bug: fail loudly, and let /health report it
            log.exception("engine scheduler crashed")
            self._failure = err
            failure = EngineError(f"engine scheduler crashed: {err!r}")
            with self._cv:
                pending = [*self._active, *self._waiting]
            for seq in pending:
                if not seq.future.done():
                    seq.future.set_exception(failure)

    def _guarded(self, step: Callable[[list[_Sequence]], None], seqs: list[_Sequence]) -> None:
        """Run a forward step; if it raises, fail those sequences and keep the engine up."""
        try:
            step(seqs)
            self.forward_passes += 1
        except Exception as err:
            log.exception("forward step failed")
            failed = list(seqs)
            error = EngineError(f"forward pass failed: {err!r}")
            for seq in failed:
                if not seq.future.done():
                    seq.future.set_exception(error)
            active = [s for s in self._active if s not in failed]
            self._active = []
            for seq in active:  # repack the survivors at the front of the cache
                self._place(seq)

    def _drop_cancelled(self) -> None:
        with self._cv:
            if any(s.future.cancelled() for s in self._waiting):
                self._waiting = deque(s for s in self._waiting if not s.future.cancelled())
        gone = [i for i, s in enumerate(self._active) if s.future.cancelled()]
        for i in reversed(gone):
            self._remove(i)

    def _abort_all(self, message: str) -> int:
        with self._cv:
            victims = [*self._active, *self._waiting]
            self._waiting.clear()
        for seq in victims:
            seq.finish = ("abort", None, message)
            self._deliver(seq)
        self._active = []
        return len(victims)

    def _apply_update(self) -> bool:
        """Apply the first pending update, in place if generation is paused, else once no
        sequence runs; True when every pending update is done."""
        update = self._updates[0]
        aborted = 0
        if update.abort_all:
            aborted = self._abort_all("generation aborted for a weight update")
        if self._active and not self._paused:
            return False  # drained: the running sequences finish under the old weights first
        self._updates.popleft()
        # Keys and values of the old weights serve no new request (the running sequences keep
        # theirs: an update in place goes on from them).
        self._prefixes.clear()
        try:
            self.weights.load(update.named)
        except Exception as err:
            # Some tensors may have been copied: if this was part of a multi-part update,
            # keep admission closed rather than sample with a mix of versions.
            self._holding = self._holding or update.partial
            update.future.set_exception(EngineError(f"weight update failed: {err!r}"))
            return not self._updates
        if update.partial:
            self._holding = True
        else:
            self._holding = False
            self._weight_version = (
                update.version if update.version is not None else self._weight_version + 1
            )
        if update.keep_pause:
            self._paused = True
        update.future.set_result(
            WeightUpdateResult(self._weight_version, aborted, len(self._waiting))
        )
        return not self._updates

    def _admit(self) -> list[_Sequence]:
        """Take waiting requests into free slots, within the prefill token budget."""
        admitted: list[_Sequence] = []
        budget = self.prefill_tokens
        with self._cv:
            while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                seq = self._waiting[0]
                n = len(seq.req.input_ids)
                if admitted and n > budget:
                    break
                self._waiting.popleft()
                seq.version = self._weight_version
                if seq.req.max_new_tokens == 0:
                    seq.finish = ("length", None, None)
                    self._deliver(seq)
                    continue
                budget -= n
                admitted.append(seq)
        return admitted

    def _place(self, seq: _Sequence) -> None:
        """Append `seq` to the active batch; its slot is its index (the batch stays packed)."""
        if seq.slot >= 0 and seq.slot != len(self._active):
            self.cache.move(seq.slot, len(self._active), seq.cached)
        seq.slot = len(self._active)
        self._active.append(seq)

    def _remove(self, index: int) -> None:
        """Take the sequence at `index` out, moving the last one into its slot."""
        last = self._active.pop()
        if index < len(self._active):
            self.cache.move(last.slot, index, last.cached)
            last.slot = index
            self._active[index] = last

    def _prefill(self, seqs: list[_Sequence]) -> None:
        base = len(self._active)
        slots = list(range(base, base + len(seqs)))
        for seq, slot in zip(seqs, slots, strict=True):
            hit = self._prefixes.lookup(seq.req.input_ids)
            if hit is not None:
                held, seq.prefix_hit = hit
                self.cache.move(held, slot, seq.prefix_hit)
                self.cached_tokens += seq.prefix_hit
        logits = self.model.prefill(
            self.cache,
            slots,
            [s.req.input_ids[s.prefix_hit :] for s in seqs],
            offsets=[s.prefix_hit for s in seqs],
        )
        for seq, slot in zip(seqs, slots, strict=True):
            seq.slot = slot
            seq.cached = len(seq.req.input_ids)
            seq.generator = self._generator(seq.req)
        self._active.extend(seqs)
        self._sample_and_finish(logits, seqs)

    def _decode_step(self, seqs: list[_Sequence]) -> None:
        tokens = torch.tensor([s.output_ids[-1] for s in seqs], dtype=torch.long)
        positions = torch.tensor([s.cached for s in seqs], dtype=torch.long)
        logits = self.model.decode(self.cache, tokens, positions)
        for seq in seqs:
            seq.cached += 1
        self._sample_and_finish(logits, seqs)

    def _sample_and_finish(self, logits: torch.Tensor, seqs: list[_Sequence]) -> None:
        tokens, logprobs = sample(logits, [s.req for s in seqs], [s.generator for s in seqs])
        done = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self._weight_version)
            seq.finish = self._check_finish(seq)
            if seq.finish is not None:
                done.append(seq)
        for seq in done:
            self._retain(seq)
            self._remove(self._active.index(seq))
            self._deliver(seq)

    def _retain(self, seq: _Sequence) -> None:
        """Keep the keys and values `seq` computed for a prompt that extends it. Only those of
        the weights now loaded: a sequence that ran across an update in place is not kept."""
        if seq.versions and seq.versions[0] != self._weight_version:
            return
        tokens = [*seq.req.input_ids, *seq.output_ids][: seq.cached]
        target = self._prefixes.store(tokens)
        if target is not None:
            self.cache.move(seq.slot, *target)

    def _check_finish(self, seq: _Sequence) -> tuple[FinishType, int | str | None, None] | None:
        req = seq.req
        token = seq.output_ids[-1]
        if (not req.ignore_eos and token in self.config.eos_token_ids) or (
            token in req.stop_token_ids
        ):
            return ("stop", token, None)
        if req.stop:
            matched = self._match_stop(seq.output_ids, req.stop)
            if matched is not None:
                return ("stop", matched, None)
        if req.max_new_tokens is not None and len(seq.output_ids) >= req.max_new_tokens:
            return ("length", None, None)
        if len(req.input_ids) + len(seq.output_ids) >= self.max_context:
            return ("length", None, None)
        return None

    def _match_stop(self, output_ids: list[int], stops: Sequence[str]) -> str | None:
        # Each token decodes to at least one byte, so a window of (longest stop in bytes + 2)
        # tokens covers any match that ends in the newest token; earlier matches would have
        # stopped the sequence at an earlier step.
        window = max(len(s.encode()) for s in stops) + 2
        tail = self.decode_text(output_ids[-window:], skip_special_tokens=False)
        return next((s for s in stops if s in tail), None)

    def _generator(self, req: GenerationRequest) -> torch.Generator | None:
        if req.temperature < GREEDY_EPS:
            return None
        gen = torch.Generator()
        gen.manual_seed(req.seed if req.seed is not None else secrets.randbits(63))
        return gen

    def _deliver(self, seq: _Sequence) -> None:
        assert seq.finish is not None
        kind, matched, message = seq.finish
        req = seq.req
        text = self.decode_text(seq.output_ids, skip_special_tokens=req.skip_special_tokens)
        if kind == "stop" and isinstance(matched, str) and not req.no_stop_trim:
            cut = text.find(matched)
            text = text[:cut] if cut >= 0 else text
        token_texts = (
            [self.decode_text([t], False) for t in seq.output_ids] if req.token_texts else None
        )
        _resolve(
            seq.future,
            GenerationResult(
                rid=req.rid,
                output_ids=list(seq.output_ids),
                output_logprobs=list(seq.logprobs),
                finish_type=kind,
                matched=matched,
                finish_message=message,
                prompt_tokens=len(req.input_ids),
                weight_version=seq.version,
                output_versions=list(seq.versions),
                cached_tokens=seq.prefix_hit,
                text=text,
                token_texts=token_texts,
                e2e_latency=time.perf_counter() - seq.submitted,
            ),
        )


def tensor_views(
    flat: torch.Tensor, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...], int]]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors (name, dtype, shape, byte offset) packed in the uint8 tensor `flat`, as
    views of it (a copy where the offset is not aligned to the dtype). `ConfigError` if one
    reaches past the end."""
    named = []
    for name, dtype, shape, offset in specs:
        size = _numel(shape) * dtype.itemsize
        if offset + size > flat.numel():
            raise ConfigError(
                f"tensor {name!r} ({dtype}, {list(shape)}) at byte {offset} ends past the "
                f"bucket's {flat.numel()} bytes"
            )
        chunk = flat[offset : offset + size]
        if offset % dtype.itemsize:
            chunk = chunk.clone()  # a dtype view needs an aligned start
        named.append((name, chunk.view(dtype).view(shape)))
    return named


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def sample(
    logits: torch.Tensor,
    reqs: Sequence[GenerationRequest],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, vocab]; return the ids and raw logprobs.

    Greedy rows take the argmax (the first one on ties). Sampled rows divide by temperature,
    keep the top-k, then the smallest set whose probability reaches top-p, and draw with the
    row's generator.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    for i, (req, gen) in enumerate(zip(reqs, generators, strict=True)):
        if req.temperature < GREEDY_EPS:
            continue
        row = logits[i] / req.temperature
        if 0 < req.top_k < vocab:
            kth = torch.topk(row, req.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if req.top_p < 1.0:
            sorted_row, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_row, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop = (torch.cumsum(probs, dim=-1) - probs) > req.top_p
            row = torch.full_like(row, float("-inf")).scatter(
                0, order, sorted_row.masked_fill(drop, float("-inf"))
            )
        probs = torch.softmax(row, dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()


async def in_daemon_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run a blocking call on a new daemon thread and await its result.

    For calls that can block until a torch.distributed timeout (joining a group, a broadcast
    whose peer never comes): unlike `asyncio.to_thread`, a thread left behind by a caller
    that failed or was cancelled holds up neither the event loop's shutdown nor the
    interpreter's exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(*args, **kwargs), None)
        except BaseException as err:
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name=f"omniloop-{fn.__name__}", daemon=True).start()
    return await future


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype SGLang's `dtypes` field names: `float32`, `bfloat16` (`torch.` allowed)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of `dtype` (`torch.float32` -> `float32`)."""
    return str(dtype).removeprefix("torch.")


def weight_update_store(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta = WEIGHT_UPDATE_TIMEOUT,
) -> dist.TCPStore:
    """The rendezvous store of a weight-update group; rank 0 serves it.

    Rank 0 may pass port 0 to bind a free port (read it back from `.port`); it does not wait
    for the others here, so it can tell them the port first. The store is the one
    `torch.distributed.rendezvous("tcp://...")` would build, which is what SGLang's
    `init_weights_update_group` connects to.
    """
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )


def new_weight_update_group(
    store: dist.Store,
    *,
    backend: str,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta = WEIGHT_UPDATE_TIMEOUT,
) -> dist.ProcessGroup:
    """Join the process group `group_name` over `store`; blocks until all ranks have joined.

    The group is independent of the default process group (which need not exist, and is left
    alone if it does) and is laid out as SGLang's `init_custom_process_group` lays out its
    own (store keys prefixed by the group name), so a trainer can broadcast to real SGLang
    engines and to omniloop's engine alike. Use it with `dist.broadcast(..., group=group)`
    (ranks in the group are the global ranks), and end it with `dist.destroy_process_group`.

    torch has no public constructor for a second "world" group, so this goes through
    `torch.distributed.distributed_c10d._new_process_group_helper`, as SGLang, slime and
    OpenRLHF do. With NCCL, create the process's default group (if any) without `device_id`:
    torch would otherwise try to split this group's communicator from the default one, whose
    ranks the engines are not.
    """
    from torch.distributed import distributed_c10d as c10d

    helper: Any = c10d._new_process_group_helper
    # The options keyword was renamed across torch releases (pg_options -> backend_options).
    params = inspect.signature(helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    assert isinstance(group, dist.ProcessGroup)
    return group


def build_core(config: EngineServerConfig) -> EngineCore:
    """Resolve `config.model` and load it into an `EngineCore` (not started)."""
    from omniloop.inference.models import resolve_model

    return EngineCore(
        resolve_model(config.model),
        max_batch=config.max_batch,
        max_context=config.max_context,
        threads=config.threads,
        prefill_tokens=config.prefill_tokens,
        prefix_cache_slots=config.prefix_cache_slots,
    )
