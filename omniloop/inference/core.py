"""The CPU engine's generation core: continuous batching over a slot-based KV cache.

One scheduler thread owns the model (a `runner.ModelRunner`: the fast Llama forward for Llama
models, a transformers model's own forward for others, `hf_runner`), its KV cache and the
tokenizer. Each iteration it applies control requests (pause, continue, weight updates),
admits waiting requests into free slots and prefills them, then decodes one token for every
active sequence in one batched forward. A sequence leaves the batch as soon as it finishes;
its slot is refilled by the next waiting request on the following iteration. Callers talk to
the thread through `concurrent.futures.Future`s, so the HTTP server's event loop never runs
torch code.

Contracts:
- Greedy at temperature 0 (below 1e-6, as SGLang); otherwise temperature, then top-k, then
  top-p, sampled with a per-request `torch.Generator` seeded from `seed` (same seed, same
  prompt, same weights: same tokens).
- Logprobs are of the sampled token under the raw model distribution (temperature 1, no top-k
  or top-p truncation): `log_softmax(logits)[token]`, the quantity a trainer scoring at
  temperature 1 recomputes. (SGLang can also return processed-distribution logprobs; not here.)
  A request's `top_logprobs_num` most likely tokens per step come from that same distribution
  (`GenerationResult.output_top_logprobs`), computed only for the rows that ask.
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
- Media: a request's `media` (processed items, one per placeholder block of `input_ids`,
  checked by `validate`) go with its prompt into the prefill; the model's media inputs and
  3-D positions are the runner's business. A model that takes no media refuses them.
- Prefix cache (`prefix_cache.PrefixIndex`, Llama runner only: others prefill every prompt
  whole and report `cached_tokens` 0): a finished sequence's keys and values are copied
  into one of `prefix_cache_slots` retained slots; a request whose prompt extends a retained
  prefix (found by blocks of 16 tokens, matched to the token) copies it back and prefills
  only the rest, reported as `cached_tokens`. Prompts admitted together share their common
  prefixes (to the token) the same way (a GRPO group's samples, a common system prompt), with
  a running sequence (copied from its slot before the prefill; only one admitted since the
  last weight update) or with each other (a prompt is prefilled, then the others copy the
  shared part from its slot and prefill the rest in a further forward: a GRPO group's first
  sample copies a system prompt from another group's, its group-mates copy from it in the
  forward after; only when that saves at least `MIN_SHARED_TOKENS`); the copied tokens count
  as `cached_tokens` too. A weight update or `flush_cache` empties it. The outputs are those
  of a full prefill up to float rounding (the attention over the cached part is computed in
  another order).
- Weight-update groups (`weight_groups.WeightGroups`): `init_weights_update_group` joins a
  trainer's torch.distributed group and `update_weights_from_distributed` receives one
  broadcast bucket on the calling thread, so generation goes on while the bytes arrive; only
  the copy into the model waits for the drain. Weights are named as the Hugging Face model's
  parameters (`RunnerWeights`). Sampling is `sampling.sample`, the prefix cache
  `prefix_cache`'s.

Not covered: chunked prefill (a prompt is prefilled
in one forward), preemption, multiple samples per request (`n`), penalties, grammars.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omniloop.errors import ConfigError, EngineError
from omniloop.inference.engine_config import EngineServerConfig
from omniloop.inference.generation import (
    FinishType,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    WeightUpdateResult,
)
from omniloop.inference.media_input import check_placeholders
from omniloop.inference.prefix_cache import PrefixIndex, shared_prefixes
from omniloop.inference.runner import ModelRunner, RunnerInfo, RunnerWeights, load_runner
from omniloop.inference.sampling import GREEDY_EPS, sample
from omniloop.inference.weight_groups import WeightGroups, WeightSpec
from omniloop.modalities import MediaKind, MediaTokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from omniloop.modalities import ProcessedMedia

__all__ = [
    "EngineCore",
    "EngineServerConfig",
    "FinishType",
    "GenerationRequest",
    "GenerationResult",
    "PauseMode",
    "WeightUpdateResult",
    "available_cores",
    "build_core",
]

log = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 64
"""Fewest prompt tokens that sharing prefixes within one prefill must save, and that a prompt
made a source for others (a further forward) must save them: each forward reads every weight
again, which costs about what prefilling a few dozen tokens does on a CPU."""


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    loads_at_admission: int = 0
    """The engine's count of weight loads when it was admitted: while that count is the same,
    its cached keys and values are those of the weights loaded now."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Filled only when the request asks (`top_logprobs_num` above 0)."""
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


def _resolve(future: concurrent.futures.Future[GenerationResult], result: GenerationResult) -> None:
    # The caller may have given up (HTTP client gone): its future is cancelled, not resolvable.
    if not future.done():
        future.set_result(result)


def _token_ids(tokens: MediaTokens) -> tuple[int, ...]:
    return (
        tokens.image, tokens.audio, tokens.video, tokens.vision_bos, tokens.vision_eos,
        tokens.audio_bos, tokens.audio_eos,
    )  # fmt: skip


class EngineCore:
    """A model (its `ModelRunner`) behind a continuous-batching scheduler thread.

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
        """Load the model folder's weights (`runner.load_runner` picks the runner) and
        tokenizer; see `EngineServerConfig` for the knobs.

        `max_context` is capped at the model's `max_position_embeddings` (default: that, at
        most 4096). The scheduler thread sets torch's thread count to `threads`, which in
        torch is process-wide. `ConfigError` if the model cannot be served, or takes media
        and its tokenizer does not name the same media tokens as its config.
        """
        from transformers import AutoTokenizer

        self.model_path = Path(model_path)
        self.runner: ModelRunner = load_runner(
            self.model_path,
            max_batch=max_batch,
            max_context=max_context,
            prefix_cache_slots=prefix_cache_slots,
        )
        self.info: RunnerInfo = self.runner.info
        self.max_context = self.info.max_context
        self.max_batch = max_batch
        self.threads = threads or available_cores()
        self.prefill_tokens = prefill_tokens
        # Slots 0..max_batch-1 hold the running sequences (packed), the rest retained prefixes.
        retained = prefix_cache_slots if self.info.prefix_cache else 0
        self._prefixes = PrefixIndex(range(max_batch, max_batch + retained))
        self._weight_loads = 0
        """Weight updates applied so far (each one's keys and values differ from the last's)."""
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.model_path)
        self.media_tokens: MediaTokens | None = None
        """The placeholder ids of a model that takes media (None for a text-only one)."""
        if self.info.media_kinds:
            self.media_tokens = MediaTokens.from_tokenizer(self.tokenizer)
            ids = self.info.media_token_ids
            if ids and ids != _token_ids(self.media_tokens):
                raise ConfigError(
                    f"{self.model_path}: the tokenizer's media tokens "
                    f"{_token_ids(self.media_tokens)} are not the model config's {ids} "
                    "(image, audio, video, vision begin/end, audio begin/end)"
                )
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
        self.finished: collections.Counter[str] = collections.Counter()
        """Requests answered so far, by finish type (`stop`, `length`, `abort`)."""
        self.prompt_tokens = 0
        """Prompt tokens of the requests answered so far."""
        self.generated_tokens = 0
        """Tokens sampled for the requests answered so far."""
        self._direct = 0
        """Buckets being written straight into the model now (`receiving_in_place`)."""
        self.weight_groups = WeightGroups(self.update_weights, in_place=self)
        """A trainer's broadcast groups (`init_weights_update_group`,
        `update_weights_from_distributed`, `destroy_weights_update_group`)."""

    # -- public API -------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version of the weights now loaded (0 at start)."""
        return self._weight_version

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def weights(self) -> RunnerWeights:
        """The model's weights by Hugging Face name."""
        return self.runner.weights

    @property
    def media_kinds(self) -> tuple[MediaKind, ...]:
        """Media the model takes in its prompt (empty: text only)."""
        return self.info.media_kinds

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def running(self) -> int:
        """Requests being generated now."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiting)

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
        if not 0 <= req.top_logprobs_num <= self.vocab_size:
            raise ValueError(
                f"top_logprobs_num must be between 0 and the vocabulary size "
                f"({self.vocab_size}), got {req.top_logprobs_num}"
            )
        self.validate_media(req.input_ids, req.media)

    def validate_media(self, input_ids: Sequence[int], media: Sequence[ProcessedMedia]) -> None:
        """Raise `ValueError` unless the model takes `media` and `input_ids` hold exactly
        their placeholder blocks (`media_input.check_placeholders`)."""
        kinds = sorted({m.kind.value for m in media if m.kind not in self.info.media_kinds})
        if kinds:
            raise ValueError(
                f"the model served ({', '.join(self.info.architectures)}) takes no "
                f"{'/'.join(kinds)} input: send input_ids alone, or serve a model that takes "
                "media (e.g. tiny-omni)"
            )
        if self.media_tokens is not None:
            check_placeholders(input_ids, media, self.media_tokens)

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

    def direct_targets(self, specs: Sequence[WeightSpec]) -> list[torch.Tensor] | None:
        """The model's own tensors for a bucket's `specs`, to receive it straight into them
        (no buffer, no copy), when that is safe: generation is paused in place, no queued
        update still copies tensors in, and each spec is a weight of the model with that dtype
        and shape. None otherwise (the bucket goes through a buffer and a queued update)."""
        with self._cv:
            if not self._paused or any(u.named for u in self._updates):
                return None
        targets = []
        for name, dtype, shape in specs:
            try:
                target = self.weights.target(name)
            except ConfigError:
                return None
            if target.dtype != dtype or tuple(target.shape) != shape:
                return None
            if not target.is_contiguous():
                return None
            targets.append(target)
        return targets

    @contextlib.contextmanager
    def receiving_in_place(self) -> Iterator[None]:
        """Hold forward passes while a bucket is written into the model; if writing fails, the
        weights are partly written: admit nothing until a complete update."""
        with self._cv:
            self._direct += 1
        try:
            yield
        except BaseException:
            with self._cv:
                self._holding = True
            raise
        finally:
            with self._cv:
                self._direct -= 1
                self._cv.notify_all()

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        *,
        version: int | None = None,
        abort_all: bool = False,
        keep_pause: bool = False,
    ) -> concurrent.futures.Future[WeightUpdateResult]:
        """Load a model folder's weights (same architecture) as a full weight update.

        Reads the files on the calling thread, so the scheduler only pauses for the copy.
        Raises `ConfigError` if the folder's model does not have this model's shapes
        (`ModelRunner.checkpoint`).
        """
        named = self.runner.checkpoint(Path(model_path))
        return self.update_weights(
            named, version=version, abort_all=abort_all, keep_pause=keep_pause, full=True
        )

    def init_weights_update_group(self, **kwargs: Any) -> None:
        """Join a trainer's weight-update group (`WeightGroups.init_weights_update_group`)."""
        self.weight_groups.init_weights_update_group(**kwargs)

    def weight_update_groups(self) -> list[str]:
        """Names of the weight-update groups joined so far."""
        return self.weight_groups.weight_update_groups()

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave `group_name` (`WeightGroups.destroy_weights_update_group`)."""
        self.weight_groups.destroy_weights_update_group(group_name)

    def update_weights_from_distributed(
        self, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[WeightUpdateResult]:
        """Receive one broadcast bucket and queue it as an update
        (`WeightGroups.update_weights_from_distributed`)."""
        future: concurrent.futures.Future[WeightUpdateResult] = (
            self.weight_groups.update_weights_from_distributed(*args, **kwargs)
        )
        return future

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
        return (
            not self._paused
            and not self._holding
            and not self._direct
            and bool(self._active or self._waiting)
        )

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
                    if self._paused or self._holding or self._direct:
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
        self._weight_loads += 1
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
                seq.loads_at_admission = self._weight_loads
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
            self.runner.move(seq.slot, len(self._active), seq.cached)
        seq.slot = len(self._active)
        self._active.append(seq)

    def _remove(self, index: int) -> None:
        """Take the sequence at `index` out, moving the last one into its slot."""
        last = self._active.pop()
        if index < len(self._active):
            self.runner.move(last.slot, index, last.cached)
            last.slot = index
            self._active[index] = last

    def _prefill(self, seqs: list[_Sequence]) -> None:
        base = len(self._active)
        for i, seq in enumerate(seqs):
            seq.slot = base + i
            hit = self._prefixes.lookup(seq.req.input_ids)
            if hit is not None:
                held, seq.prefix_hit = hit
                self.runner.move(held, seq.slot, seq.prefix_hit)
        running = self._sharing_sources()
        sources = [*running, *seqs]
        followers = self._shared_prefixes(seqs, running)
        # Followers of a running sequence copy before the first forward; those of a prompt of
        # this batch before the forward after the one that prefilled that prompt.
        level = [0] * len(seqs)
        for i, (source, _) in sorted(followers.items()):
            if source >= len(running):
                level[i] = level[source - len(running)] + 1
        rows: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        for depth in range(max(level) + 1):
            part = [i for i in range(len(seqs)) if level[i] == depth]
            for i in part:
                if i in followers:
                    source, length = followers[i]
                    self.runner.move(sources[source].slot, seqs[i].slot, length)
                    seqs[i].prefix_hit = length
            for i, row in zip(part, self._prefill_rows([seqs[i] for i in part]), strict=True):
                rows[i] = row
        for seq in seqs:
            self.cached_tokens += seq.prefix_hit
            seq.cached = len(seq.req.input_ids)
            seq.generator = self._generator(seq.req)
        self._active.extend(seqs)
        self._sample_and_finish(torch.stack(rows), seqs)

    def _sharing_sources(self) -> list[_Sequence]:
        """The running sequences whose cached keys and values a new prompt may copy: those of
        the weights now loaded (one admitted before an update in place holds older ones, and an
        update may keep the version number)."""
        if not self._prefixes.slots:
            return []
        return [s for s in self._active if s.loads_at_admission == self._weight_loads]

    def _shared_prefixes(
        self, seqs: list[_Sequence], running: list[_Sequence]
    ) -> dict[int, tuple[int, int]]:
        """The prompts of `seqs` that copy a prefix from a `running` sequence or another prompt
        of `seqs` (sources numbered in that order): `shared_prefixes`'s answer, without
        the followers of `seqs` when what they save is below `MIN_SHARED_TOKENS` (they cost a
        second forward, and each further link of a chain one more). None without a prefix
        cache (no retained slots: a runner without one, or `prefix_cache_slots=0`) or with a
        prompt's media (their placeholders are alike, the media not)."""
        if not self._prefixes.slots or any(s.req.media for s in seqs):
            return {}
        held = [[*s.req.input_ids, *s.output_ids][: s.cached] for s in running]
        followers = shared_prefixes(
            [s.req.input_ids for s in seqs],
            [s.prefix_hit for s in seqs],
            held=held,
            min_gain=MIN_SHARED_TOKENS,
        )
        saved = sum(
            length - seqs[i].prefix_hit
            for i, (source, length) in followers.items()
            if source >= len(running)
        )
        if saved < MIN_SHARED_TOKENS:
            followers = {i: f for i, f in followers.items() if f[0] < len(running)}
        return followers

    def _prefill_rows(self, seqs: list[_Sequence]) -> torch.Tensor:
        """Prefill `seqs` into their slots past their `prefix_hit`; their next-token logits."""
        return self.runner.prefill(
            [s.slot for s in seqs],
            [s.req.input_ids[s.prefix_hit :] for s in seqs],
            offsets=[s.prefix_hit for s in seqs],
            media=[s.req.media for s in seqs],
        )

    def _decode_step(self, seqs: list[_Sequence]) -> None:
        tokens = torch.tensor([s.output_ids[-1] for s in seqs], dtype=torch.long)
        positions = torch.tensor([s.cached for s in seqs], dtype=torch.long)
        logits = self.runner.decode(tokens, positions)
        for seq in seqs:
            seq.cached += 1
        self._sample_and_finish(logits, seqs)

    def _sample_and_finish(self, logits: torch.Tensor, seqs: list[_Sequence]) -> None:
        sampled = sample(
            logits,
            [s.req for s in seqs],
            [s.generator for s in seqs],
            [s.req.top_logprobs_num for s in seqs],
        )
        done = []
        for seq, token, logprob, top in zip(
            seqs, sampled.ids, sampled.logprobs, sampled.top_logprobs, strict=True
        ):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top_logprobs.append(top)
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
            self.runner.move(seq.slot, *target)

    def _check_finish(self, seq: _Sequence) -> tuple[FinishType, int | str | None, None] | None:
        req = seq.req
        token = seq.output_ids[-1]
        if (not req.ignore_eos and token in self.info.eos_token_ids) or (
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
        self.finished[kind] += 1
        self.prompt_tokens += len(req.input_ids)
        self.generated_tokens += len(seq.output_ids)
        text = self.decode_text(seq.output_ids, skip_special_tokens=req.skip_special_tokens)
        if kind == "stop" and isinstance(matched, str) and not req.no_stop_trim:
            cut = text.find(matched)
            text = text[:cut] if cut >= 0 else text
        token_texts = (
            [self.decode_text([t], False) for t in seq.output_ids] if req.token_texts else None
        )
        top = list(seq.top_logprobs) if req.top_logprobs_num > 0 else None
        top_texts = (
            [[self.decode_text([t], False) for _, t in step] for step in top]
            if top is not None and req.token_texts
            else None
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
                output_top_logprobs=top,
                top_token_texts=top_texts,
            ),
        )


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
