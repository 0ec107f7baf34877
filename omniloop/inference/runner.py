"""The seam between the engine's scheduler and a model: `ModelRunner`.

`EngineCore` decides which sequences run, samples and keeps the books (versions, stops,
updates); a `ModelRunner` owns the model, its weights and the keys and values of each cache
slot, and runs the forward passes. `load_runner` picks one from the model folder's config.json:

- `model_type: llama`: `LlamaRunner`, omniloop's own fused Llama forward over a preallocated
  slot cache (`omniloop.inference.llama`): the fast path, with the prefix cache.
- anything else: `omniloop.inference.hf_runner.HFRunner`, the model's own transformers forward
  (the Qwen2.5-Omni thinker takes images, audio and video in the prompt).

Slot contract (what the scheduler relies on, and each runner keeps):
- slots `0..B-1` hold the `B` running sequences, packed; `prefill` writes new sequences into
  the slots it is given (right after the running ones) and returns their next-token logits;
  `decode` runs one token for each of slots `0..B-1`;
- `move(src, dst, n)` moves the first `n` positions of `src` to `dst`; a runner without
  `RunnerInfo.prefix_cache` may then consider `src` free (the scheduler never reads it again);
  one with it keeps `src` as it was: the scheduler copies retained prefixes and, within one
  prefill, a prompt's shared prefix out of a slot it goes on using;
- slots from `max_batch` on are retained prefixes of the prefix cache, only where
  `RunnerInfo.prefix_cache` is true (the scheduler gives a runner without it no such slot).

Weights are addressed by Hugging Face parameter names (`RunnerWeights`); the names are those
a trainer holding the same Hugging Face class publishes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from omniloop.errors import ConfigError
from omniloop.inference.llama import (
    KVCache,
    LlamaConfig,
    LlamaModel,
    LlamaWeights,
    load_weights,
    read_safetensors,
)

if TYPE_CHECKING:
    from omniloop.modalities import MediaKind, ProcessedMedia

DEFAULT_MAX_CONTEXT = 4096
"""Context length when none is asked for (capped by the model's own limit)."""


class RunnerWeights(Protocol):
    """A model's weights by Hugging Face parameter name (`LlamaWeights` is one)."""

    def names(self) -> list[str]:
        """Every name a full state dict must have."""
        ...

    def target(self, name: str) -> torch.Tensor:
        """The model's own tensor (or view) that weight `name` is; `ConfigError` if unknown."""
        ...

    def check(self, named: Iterable[tuple[str, torch.Tensor]], *, full: bool) -> None:
        """`ConfigError` unless every name is known with the right shape (and, with `full`,
        every weight is given)."""
        ...

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into place (checked before)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their names (the model's own tensors or views of them)."""
        ...


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler and the server need to know about the model a runner serves."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    """Most tokens per sequence, prompt included."""
    model_type: str
    architectures: tuple[str, ...]
    media_kinds: tuple[MediaKind, ...]
    """Media the model takes in its prompt; empty for a text-only model."""
    prefix_cache: bool
    """Whether retained slots work (`move` into and out of slots from `max_batch` on)."""
    media_token_ids: tuple[int, ...] = ()
    """The ids the model's forward reads as media (image, audio, video placeholders, vision
    begin and end, audio begin and end), when it takes media: the tokenizer must agree."""


class ModelRunner(Protocol):
    """A model behind the scheduler (module docstring: the slot contract). Called from the
    scheduler thread only, except `weights.target`/`check` and `checkpoint`."""

    @property
    def info(self) -> RunnerInfo: ...

    @property
    def weights(self) -> RunnerWeights: ...

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        *,
        offsets: Sequence[int],
        media: Sequence[Sequence[ProcessedMedia]],
    ) -> torch.Tensor:
        """Run each prompt (after `offsets[i]` positions of `slots[i]` already cached), with
        its media, writing keys and values into `slots`; the last position's logits
        [P, vocab]."""
        ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of slots 0..B-1 (`tokens` [B] at `positions` [B], the number of
        tokens already cached per slot); the next-token logits [B, vocab]."""
        ...

    def move(self, src: int, dst: int, length: int) -> None:
        """Move the first `length` cached positions of slot `src` to slot `dst` (a copy, where
        `info.prefix_cache`: module docstring)."""
        ...

    def checkpoint(self, folder: Path) -> list[tuple[str, torch.Tensor]]:
        """A model folder's weights as a full update for this model; `ConfigError` if the
        folder holds another architecture or other shapes."""
        ...


def context_length(requested: int | None, limit: int) -> int:
    """The context length to serve: `requested` or the default, capped at the model's limit."""
    return min(requested or min(limit, DEFAULT_MAX_CONTEXT), limit)


class LlamaRunner:
    """The fast path: `LlamaModel` over a `KVCache` of `max_batch + prefix_cache_slots` slots."""

    def __init__(
        self,
        model_path: Path,
        *,
        max_batch: int,
        max_context: int | None,
        prefix_cache_slots: int,
    ) -> None:
        self.config = LlamaConfig.from_folder(model_path)
        c = self.config
        context = context_length(max_context, c.max_position_embeddings)
        self.weights: LlamaWeights = load_weights(model_path, c)
        self.model = LlamaModel(self.weights, context)
        self.cache = KVCache(c, max_batch + prefix_cache_slots, context)
        self.info = RunnerInfo(
            vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids,
            max_context=context,
            model_type="llama",
            architectures=("LlamaForCausalLM",),
            media_kinds=(),
            prefix_cache=True,
        )

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        *,
        offsets: Sequence[int],
        media: Sequence[Sequence[ProcessedMedia]],
    ) -> torch.Tensor:
        # The scheduler admits no media to a runner without `media_kinds`.
        return self.model.prefill(self.cache, slots, prompts, offsets=offsets)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decode(self.cache, tokens, positions)

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def checkpoint(self, folder: Path) -> list[tuple[str, torch.Tensor]]:
        other = LlamaConfig.from_folder(folder)
        if not self.config.same_shapes(other):
            raise ConfigError(
                f"{folder} holds a model of another shape than the one served "
                f"({other} vs {self.config})"
            )
        state = read_safetensors(folder)
        return [(n, t) for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")]


def model_type(folder: Path) -> str:
    """The `model_type` of a model folder's config.json; `ConfigError` without one."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder} has no config.json")
    raw = json.loads(path.read_text())
    return str(raw.get("model_type") or "")


def load_runner(
    model_path: Path,
    *,
    max_batch: int,
    max_context: int | None,
    prefix_cache_slots: int,
) -> ModelRunner:
    """The runner for a model folder (module docstring); `ConfigError` if it cannot run."""
    if model_type(model_path) == "llama":
        return LlamaRunner(
            model_path,
            max_batch=max_batch,
            max_context=max_context,
            prefix_cache_slots=prefix_cache_slots,
        )
    from omniloop.inference.hf_runner import HFRunner

    return HFRunner(model_path, max_context=max_context)
