"""The engine's generic model runner: a Hugging Face model's own forward, batched and KV-cached.

`HFRunner` serves any transformers causal-LM or conditional-generation model whose decoder
attends fully to its past (no sliding windows, no linear-attention or recurrent layers), in
fp32 with sdpa attention. The Qwen2.5-Omni thinker (`model_type: qwen2_5_omni_thinker`, e.g.
`tiny-omni`) also takes images, audio and video in the prompt; every other model is text only.

How it runs (the slot contract of `omniloop.inference.runner`):
- prefill: each new sequence alone, with its media inputs (`concat_inputs` of its
  `ProcessedMedia`, in order) and explicit position ids: 1-D `0..n-1`, or for the Qwen2.5-Omni
  thinker the 3-D mRoPE positions of its `get_rope_index`, whose delta (the last position + 1
  minus the length) the sequence keeps;
- decode: one forward for every running sequence: each sequence's cached keys and values are
  left-padded into one batch of the longest length, masked by an attention mask, with explicit
  positions: the cached length, plus for the Omni thinker the sequence's rope delta on all
  three axes (text after the prompt advances all three together, as transformers' own
  `generate` does). The new column of keys and values goes back into each sequence's cache.
- Each sequence's keys and values are its own tensors ([layers, kv heads, capacity, head
  dim], grown by doubling up to the context length), kept between steps; `move` hands them
  to another slot without copying.

Weights are the model's in-memory `named_parameters()` (e.g. `model.language_model.layers.0.
self_attn.q_proj.weight` for the Omni thinker), the names a trainer holding the same class
publishes; tied aliases are accepted as well. A folder saved with `save_pretrained` (whose keys
transformers may rename on load) is read back through `from_pretrained` for a disk update.

Not covered (differences from the fast Llama path): the prefix cache (a prompt that extends a
finished one is prefilled whole: reusing keys and values would also have to match the media
behind identical placeholder ids and the mRoPE delta; `cached_tokens` stays 0), several
prompts per prefill forward, chunked prefill. Each decode step copies the batch's cached keys
and values into the padded batch, so a step costs time linear in the tokens cached; the
outputs equal a sequence decoded alone up to float rounding of the attention over padding.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from omniloop.errors import ConfigError
from omniloop.inference.llama import read_safetensors
from omniloop.inference.models import OMNI_THINKER_MODEL_TYPE, load_omni_model
from omniloop.inference.runner import RunnerInfo, context_length
from omniloop.inference.weight_names import checked_names
from omniloop.modalities import MediaKind, ProcessedMedia, concat_inputs

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class HFWeights:
    """A transformers model's parameters by their in-memory names (`RunnerWeights`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = [name for name, _ in model.named_parameters()]
        # Every alias of a tied parameter too (`lm_head.weight` of a tied model), each the
        # parameter's own storage: copying into it updates the model.
        self._targets = {
            name: param.detach() for name, param in model.named_parameters(remove_duplicate=False)
        }
        self._arch = type(model).__name__

    def names(self) -> list[str]:
        """Every parameter name, each tied tensor once (what `named_parameters()` lists)."""
        return list(self._names)

    def target(self, name: str) -> torch.Tensor:
        tensor = self._targets.get(name)
        if tensor is None:
            raise ConfigError(
                f"unknown weight {name!r} for {self._arch}: it has no such parameter "
                f"(names look like {self._names[0]!r}, those of its named_parameters())"
            )
        return tensor

    def check(self, named: Iterable[tuple[str, torch.Tensor]], *, full: bool) -> None:
        seen = checked_names(named, self.target)
        if full:
            # A tied alias given instead of its parameter's first name counts for it.
            given = {self._targets[n].data_ptr() for n in seen}
            missing = [n for n in self._names if self._targets[n].data_ptr() not in given]
            if missing:
                raise ConfigError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self.target(name).copy_(tensor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self._targets[name] for name in self._names}


@dataclass
class _SeqCache:
    """One sequence's keys and values: [layers, kv heads, capacity, head dim] each."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int
    rope_delta: int

    def reserve(self, length: int, limit: int) -> None:
        """Room for `length` positions (capacity doubled, at most `limit`)."""
        capacity = self.keys.shape[2]
        if length <= capacity:
            return
        grown = min(max(2 * capacity, length), max(limit, length))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], grown, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


class _Preallocated(DynamicLayer):
    """One layer of a padded decode batch: [B, kv heads, past + new, head dim] allocated
    up front, so the forward writes its new keys and values into the last columns instead of
    concatenating (transformers' `DynamicLayer` would copy the whole batch once more)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> None:
        super().__init__()
        self._k, self._v, self._end = keys, values, past
        self.keys, self.values = keys[:, :, :past], values[:, :, :past]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._end + key_states.shape[-2]
        self._k[:, :, self._end : end] = key_states
        self._v[:, :, self._end : end] = value_states
        self._end = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values


def _padded_cache(keys: torch.Tensor, values: torch.Tensor, past: int) -> DynamicCache:
    """A `DynamicCache` over the padded batch `keys`/`values` [layers, B, kv heads, past + 1,
    head dim] whose positions `0..past-1` hold the past."""
    cache = DynamicCache()
    cache.layers = [_Preallocated(keys[i], values[i], past) for i in range(keys.shape[0])]
    return cache


class _OmniPositions:
    """The Qwen2.5-Omni thinker's 3-D mRoPE positions of a prompt with its media."""

    kinds = (MediaKind.IMAGE, MediaKind.AUDIO, MediaKind.VIDEO)

    def __init__(self, model: PreTrainedModel) -> None:
        self._rope_index = getattr(model, "get_rope_index")  # noqa: B009 (not on the base class)

    def __call__(
        self, ids: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, int]:
        """Position ids (3, 1, n) and the rope delta of `ids` [1, n]."""
        features = inputs.get("feature_attention_mask")
        positions, delta = self._rope_index(
            ids,
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            torch.ones_like(ids),
            False,
            features.sum(-1) if features is not None else None,
            inputs.get("video_second_per_grid"),
        )
        return positions, int(delta.reshape(-1)[0])


def _omni_token_ids(config: PretrainedConfig) -> tuple[int, ...]:
    """The media ids of a Qwen2.5-Omni thinker config, in `RunnerInfo.media_token_ids` order."""
    names = (
        "image_token_id", "audio_token_id", "video_token_id", "vision_start_token_id",
        "vision_end_token_id", "audio_start_token_id", "audio_end_token_id",
    )  # fmt: skip
    return tuple(int(getattr(config, name)) for name in names)


def _eos_ids(folder: Path, config: PretrainedConfig) -> tuple[int, ...]:
    """The model's EOS ids: its (text) config's, then generation_config.json's."""
    found: list[int] = []
    text = config.get_text_config(decoder=True)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    for eos in (getattr(text, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        found += eos if isinstance(eos, list) else [] if eos is None else [eos]
    eos = gen.get("eos_token_id")
    found += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(int(t) for t in found))


def _check_attention(config: PretrainedConfig) -> None:
    """`ConfigError` unless every decoder layer attends fully to its past."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        raise ConfigError(
            f"model type {config.model_type!r} has {sorted(kinds)} layers; the CPU engine's "
            "generic runner serves full-attention decoders only (no sliding windows or "
            "linear attention)"
        )
    if (
        not kinds
        and getattr(text, "sliding_window", None)
        and getattr(text, "use_sliding_window", True)
    ):
        raise ConfigError(
            f"model type {config.model_type!r} uses a sliding attention window; the CPU "
            "engine's generic runner serves full-attention decoders only"
        )


def load_hf_model(folder: Path, config: PretrainedConfig) -> PreTrainedModel:
    """The folder's model in fp32, eval mode, without gradients (`ConfigError` if no
    transformers auto class generates text with it)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if config.model_type == OMNI_THINKER_MODEL_TYPE:
        model: PreTrainedModel = load_omni_model(folder)
    else:
        errors = []
        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            try:
                model = auto.from_pretrained(
                    folder, dtype=torch.float32, attn_implementation="sdpa"
                )
                break
            except ValueError as err:  # not a model of this auto class
                errors.append(f"{auto.__name__}: {err}")
        else:
            raise ConfigError(
                f"{folder} holds a {config.model_type!r} model that neither "
                f"AutoModelForCausalLM nor AutoModelForImageTextToText loads: {errors}"
            )
    model.eval()
    model.requires_grad_(False)
    return model


class HFRunner:
    """A transformers model behind the scheduler (module docstring)."""

    def __init__(self, model_path: Path, *, max_context: int | None) -> None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        _check_attention(config)
        self.model = load_hf_model(model_path, config)
        text = config.get_text_config(decoder=True)
        limit = int(getattr(text, "max_position_embeddings", None) or 4096)
        self._context = context_length(max_context, limit)
        omni = config.model_type == OMNI_THINKER_MODEL_TYPE
        self._omni = _OmniPositions(self.model) if omni else None
        self.weights = HFWeights(self.model)
        self.info = RunnerInfo(
            vocab_size=int(text.vocab_size),
            eos_token_ids=_eos_ids(model_path, config),
            max_context=self._context,
            model_type=str(config.model_type),
            architectures=tuple(config.architectures or [type(self.model).__name__]),
            media_kinds=self._omni.kinds if self._omni is not None else (),
            prefix_cache=False,
            media_token_ids=_omni_token_ids(config) if self._omni is not None else (),
        )
        params = inspect.signature(self.model.forward).parameters
        # Only the last position's logits are needed; models that say so compute only them.
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._slots: dict[int, _SeqCache] = {}
        self._probe()

    def _probe(self) -> None:
        """Run one token, to fail at start (not at the first request) on a cache layout this
        runner cannot batch."""
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.zeros((1, 1), dtype=torch.long),
                position_ids=self._positions(1)[0],
                past_key_values=self._new_cache(),
                use_cache=True,
            )
        layers = out.past_key_values.layers
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ConfigError(
                f"{type(self.model).__name__} keeps a {kinds} cache; the CPU engine's generic "
                "runner batches plain per-layer keys and values only"
            )

    @staticmethod
    def _new_cache() -> DynamicCache:
        return DynamicCache()

    def _positions(self, n: int) -> tuple[torch.Tensor, int]:
        """1-D position ids (1, n) of a text prompt, and a rope delta of 0."""
        return torch.arange(n).unsqueeze(0), 0

    # -- ModelRunner --------------------------------------------------------------------------

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        *,
        offsets: Sequence[int],
        media: Sequence[Sequence[ProcessedMedia]],
    ) -> torch.Tensor:
        if any(offsets):
            raise ValueError("the generic runner has no prefix cache: offsets must be 0")
        logits = []
        for slot, prompt, items in zip(slots, prompts, media, strict=True):
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            inputs = concat_inputs(list(items)) if items else {}
            if self._omni is not None:
                positions, delta = self._omni(ids, inputs)
            else:
                positions, delta = self._positions(ids.shape[1])
            out = self.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=positions,
                past_key_values=self._new_cache(),
                use_cache=True,
                **inputs,
                **self._last_only,
            )
            logits.append(out.logits[0, -1].float())
            layers = out.past_key_values.layers
            n = ids.shape[1]
            seq = _SeqCache(
                keys=torch.cat([layer.keys for layer in layers]),
                values=torch.cat([layer.values for layer in layers]),
                length=n,
                rope_delta=delta,
            )
            seq.reserve(n + 1, self._context)
            self._slots[slot] = seq
        return torch.stack(logits)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        for slot in [s for s in self._slots if s >= b]:
            del self._slots[slot]  # past the running batch: a finished sequence's
        seqs = [self._slots[i] for i in range(b)]
        past = max(s.length for s in seqs)
        first = seqs[0].keys
        shape = (first.shape[0], b, first.shape[1], past + 1, first.shape[3])
        # Zeros, not garbage: a masked position still meets the values in a matmul, and NaN
        # times a zero weight is NaN.
        keys = first.new_zeros(shape)
        values = first.new_zeros(shape)
        mask = torch.zeros((b, past + 1), dtype=torch.long)
        for i, seq in enumerate(seqs):
            start = past - seq.length
            keys[:, i, :, start:past] = seq.keys[:, :, : seq.length]
            values[:, i, :, start:past] = seq.values[:, :, : seq.length]
            mask[i, start:] = 1
        if self._omni is not None:
            deltas = torch.tensor([s.rope_delta for s in seqs], dtype=torch.long)
            position_ids = (positions + deltas).view(1, b, 1).expand(3, b, 1)
        else:
            position_ids = positions.view(b, 1)
        out = self.model(
            input_ids=tokens.view(b, 1),
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=_padded_cache(keys, values, past),
            use_cache=True,
        )
        for i, seq in enumerate(seqs):
            seq.reserve(seq.length + 1, self._context)
            seq.keys[:, :, seq.length] = keys[:, i, :, past]
            seq.values[:, :, seq.length] = values[:, i, :, past]
            seq.length += 1
        return out.logits[:, -1].float()

    def move(self, src: int, dst: int, length: int) -> None:
        seq = self._slots.pop(src, None)
        if seq is not None:
            self._slots[dst] = seq

    def checkpoint(self, folder: Path) -> list[tuple[str, torch.Tensor]]:
        """The folder's weights by in-memory name: its safetensors as they are when their
        keys are those names (what a trainer writes), else through `from_pretrained` (a
        `save_pretrained` folder, whose keys transformers may rename on load)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        if config.model_type != self.info.model_type:
            raise ConfigError(
                f"{folder} holds a {config.model_type!r} model, the engine serves a "
                f"{self.info.model_type!r}"
            )
        names = self.weights.names()
        state = read_safetensors(folder)
        if all(name in state for name in names):
            return [(name, state[name]) for name in names]
        del state
        try:
            # With output_loading_info, from_pretrained returns (model, info).
            loaded: Any = type(self.model).from_pretrained(
                folder, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
            )
            other, loading = loaded
        except (RuntimeError, OSError, ValueError) as err:
            raise ConfigError(f"cannot load {folder} as the model served: {err}") from err
        # from_pretrained fills a weight the folder lacks with random values: refuse instead.
        lacking = [*loading.get("missing_keys", ()), *loading.get("mismatched_keys", ())]
        if lacking:
            raise ConfigError(
                f"{folder} lacks {len(lacking)} weights of the model served (or has other "
                f"shapes), e.g. {sorted(map(str, lacking))[:3]}"
            )
        named = [(name, param.detach()) for name, param in other.named_parameters()]
        self.weights.check(named, full=True)
        return named
