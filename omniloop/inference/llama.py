"""A pure-PyTorch Llama forward over a slot-based KV cache, for the CPU engine.

It reads a Hugging Face `LlamaForCausalLM` folder (config.json + safetensors) and computes the
same logits as transformers in fp32 (RMSNorm, RoPE with `rope_theta` and the `default` or
`llama3` rope type, grouped-query attention, SwiGLU, tied or untied embeddings).

Weights are kept fused (q|k|v and gate|up, one matrix each per layer) because one large matmul
is faster on CPU than three small ones. `LlamaWeights.load` still takes Hugging Face names and
copies each tensor into its slice of the fused matrix, so a state dict from disk, from a trainer
or from a broadcast bucket can replace any subset of the weights in place.

Matmuls go through oneDNN with weights prepacked into its blocked layout when this torch build
has the (inductor-internal) `mkldnn._linear_pointwise` op and it agrees with `F.linear` on a
probe; otherwise through `F.linear`. On the AMD CPUs we run on, MKL's `F.linear` picks slow
kernels for the small row counts of decoding: the packed path is ~1.8x faster at 8 rows and
makes the decode step memory-bound. Packed copies are rebuilt lazily after any weight load.

The KV cache holds `max_slots` sequences of up to `max_context` tokens each, preallocated with
`torch.empty` (pages are only committed as tokens are written). The decode step runs on slots
`0..B-1` so the cache slice it reads is a view; the caller keeps active sequences packed at the
front of the cache (`KVCache.move`).

Not covered: attention or MLP biases, sliding windows, rope types other than `default` and
`llama3`, quantised weights, devices other than CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omniloop.errors import ConfigError
from omniloop.inference.weight_names import checked_names


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of a Hugging Face Llama config.json that the forward depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Parse a config.json dict; raise `ConfigError` for anything this forward cannot run."""
        archs = raw.get("architectures") or []
        if raw.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise ConfigError(
                f"the CPU engine runs Llama models only; this config has model_type "
                f"{raw.get('model_type')!r} and architectures {archs!r}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ConfigError(f"Llama configs with {flag}=true are not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        # transformers 5 nests rope settings under `rope_parameters`; 4.x has flat keys.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ConfigError(f"rope type {rope_type!r} is not supported (default, llama3)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of {kv_heads}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> LlamaConfig:
        """Read `folder/config.json`; the EOS ids also include generation_config.json's."""
        path = folder / "config.json"
        if not path.is_file():
            raise ConfigError(f"{folder} has no config.json")
        config = cls.from_dict(json.loads(path.read_text()))
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
            config = cls(**{**config.__dict__, "eos_token_ids": merged})
        return config

    def same_shapes(self, other: LlamaConfig) -> bool:
        """Whether `other`'s weights fit this model's tensors (what a weight update needs)."""
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "tie_word_embeddings",
        )
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, computed as transformers does (fp32)."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by `factor`, short
    # ones kept, and the band between interpolated.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class LlamaWeights:
    """The model's tensors, fused per layer, addressable by Hugging Face parameter names.

    Layer tensors: `qkv` [(H + 2·KV)·D, hidden], `o` [hidden, H·D], `gate_up` [2·I, hidden],
    `down` [hidden, I], and the two RMSNorm weights. With tied embeddings `lm_head` is the same
    tensor as `embed`, so updating either updates both.
    """

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> None:
        c = config
        self.config = c
        self.generation = 0
        """Incremented by every `load`, so derived copies (packed matrices) know to refresh."""
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def new(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype)

        self.embed = new(c.vocab_size, c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else new(c.vocab_size, c.hidden_size)
        self.norm = new(c.hidden_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        # name -> (tensor, first row, row count); row count -1 means the whole tensor.
        self._slots: dict[str, tuple[torch.Tensor, int, int]] = {
            "model.embed_tokens.weight": (self.embed, 0, -1),
            "model.norm.weight": (self.norm, 0, -1),
            "lm_head.weight": (self.lm_head, 0, -1),
        }
        for i in range(c.num_layers):
            layer = {
                "ln_in": new(c.hidden_size),
                "qkv": new(q_rows + 2 * kv_rows, c.hidden_size),
                "o": new(c.hidden_size, q_rows),
                "ln_post": new(c.hidden_size),
                "gate_up": new(2 * c.intermediate_size, c.hidden_size),
                "down": new(c.hidden_size, c.intermediate_size),
            }
            self.layers.append(layer)
            p = f"model.layers.{i}."
            self._slots.update(
                {
                    p + "input_layernorm.weight": (layer["ln_in"], 0, -1),
                    p + "post_attention_layernorm.weight": (layer["ln_post"], 0, -1),
                    p + "self_attn.q_proj.weight": (layer["qkv"], 0, q_rows),
                    p + "self_attn.k_proj.weight": (layer["qkv"], q_rows, kv_rows),
                    p + "self_attn.v_proj.weight": (layer["qkv"], q_rows + kv_rows, kv_rows),
                    p + "self_attn.o_proj.weight": (layer["o"], 0, -1),
                    p + "mlp.gate_proj.weight": (layer["gate_up"], 0, c.intermediate_size),
                    p + "mlp.up_proj.weight": (
                        layer["gate_up"],
                        c.intermediate_size,
                        c.intermediate_size,
                    ),
                    p + "mlp.down_proj.weight": (layer["down"], 0, -1),
                }
            )

    def names(self) -> list[str]:
        """Every Hugging Face name a full state dict must have (`lm_head` only when untied)."""
        return [
            n for n in self._slots if n != "lm_head.weight" or not self.config.tie_word_embeddings
        ]

    def target(self, name: str) -> torch.Tensor:
        """The model's tensor (or the view of a fused one) that weight `name` is;
        `ConfigError` for a name the model has not."""
        return self._target(name)

    def _target(self, name: str) -> torch.Tensor:
        slot = self._slots.get(name)
        if slot is None:
            raise ConfigError(f"unknown Llama weight {name!r}")
        tensor, start, rows = slot
        return tensor if rows < 0 else tensor[start : start + rows]

    def check(self, named: Iterable[tuple[str, torch.Tensor]], *, full: bool) -> None:
        """Raise `ConfigError` unless every tensor has a known name and the right shape.

        With `full`, every weight of the model must be present (a complete checkpoint).
        """
        seen = checked_names(named, self._target)
        if full:
            missing = [n for n in self.names() if n not in seen]
            if missing:
                raise ConfigError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    @torch.inference_mode()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (Hugging Face name, tensor) into place; shapes must match (see `check`)."""
        for name, tensor in named:
            self._target(name).copy_(tensor)
        self.generation += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names (views into the fused tensors)."""
        return {name: self._target(name) for name in self.names()}


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder's safetensors files (one file or an index of shards)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} has no .safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_weights(folder: Path, config: LlamaConfig) -> LlamaWeights:
    """Build `LlamaWeights` from a model folder's safetensors; raise `ConfigError` if unfit."""
    weights = LlamaWeights(config)
    state = read_safetensors(folder)
    named = [(n, t) for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")]
    weights.check(named, full=True)
    weights.load(named)
    return weights


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def onednn_linear_available() -> bool:
    """Whether the packed oneDNN linear runs here and matches `F.linear` on a probe."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen)
        x = torch.randn(5, 32, generator=gen)
        out = _onednn_linear(x, _onednn_pack(w))
        return bool(torch.allclose(out, F.linear(x, w), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError):
        return False


class KVCache:
    """Keys and values of `max_slots` sequences: [layers, slots, kv_heads, max_context, D].

    Allocated with `torch.empty`, so memory is committed only as positions are used. A batched
    decode reads every slot up to the longest sequence and masks the rest; masking only works
    on finite numbers (NaN garbage times a zero weight is still NaN), so `prepare` zeroes each
    slot's never-written positions before a forward may read them.
    """

    ZERO_AHEAD = 64

    def __init__(
        self,
        config: LlamaConfig,
        max_slots: int,
        max_context: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (config.num_layers, max_slots, config.num_kv_heads, max_context, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self.max_slots = max_slots
        self.max_context = max_context
        self._finite = [0] * max_slots
        """Per slot: positions below this hold finite values (written or zeroed)."""

    def prepare(self, slots: int, span: int) -> None:
        """Make positions [0, span) of slots 0..slots-1 finite."""
        # Zero ahead in chunks: decode grows the span by one per step, and two small fills
        # per slot per step would cost more than the attention they protect.
        end = min(self.max_context, span + self.ZERO_AHEAD)
        for slot in range(slots):
            start = self._finite[slot]
            if start < span:
                self.k[:, slot, :, start:end] = 0
                self.v[:, slot, :, start:end] = 0
                self._finite[slot] = end

    def written(self, slot: int, length: int) -> None:
        """Record that positions [0, length) of `slot` were written."""
        self._finite[slot] = max(self._finite[slot], length)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (all layers)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.written(dst, length)


class LlamaModel:
    """The forward passes the scheduler needs: packed prefill and batched one-token decode."""

    def __init__(
        self, weights: LlamaWeights, max_context: int, *, onednn: bool | None = None
    ) -> None:
        """`onednn`: use packed oneDNN matmuls (None: when `onednn_linear_available()`)."""
        self.weights = weights
        self.config = c = weights.config
        self.max_context = max_context
        self.onednn = onednn_linear_available() if onednn is None else onednn
        self._packed: dict[int, torch.Tensor] = {}
        self._packed_generation = -1
        self._refresh()
        positions = torch.arange(max_context, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos()
        # rotate_half(x) * sin == flip_halves(x) * (sin with its first half negated); one
        # multiply by a precomputed signed table saves a negation and a concat per layer.
        half = c.head_dim // 2
        sin = emb.sin()
        self._sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self._q_width = c.num_heads * c.head_dim
        self._qk_heads = c.num_heads + c.num_kv_heads
        self._group = c.num_heads // c.num_kv_heads

    def _refresh(self) -> None:
        """Repack matrices if the weights changed since the last forward."""
        if not self.onednn or self._packed_generation == self.weights.generation:
            return
        w = self.weights
        mats = [w.lm_head] + [
            layer[k] for layer in w.layers for k in ("qkv", "o", "gate_up", "down")
        ]
        self._packed = {id(m): _onednn_pack(m) for m in mats}
        self._packed_generation = w.generation

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return _onednn_linear(x, self._packed[id(weight)])
        return F.linear(x, weight)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate [N, heads, D] by the angles of `positions` [N]."""
        half = self.config.head_dim // 2
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin_signed[positions].unsqueeze(1)
        flipped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos + flipped * sin

    def _qkv(
        self, layer: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input [N, hidden] -> q [N, H, D], k [N, KV, D], v [N, KV, D], rope applied."""
        c = self.config
        h = F.rms_norm(x, (c.hidden_size,), layer["ln_in"], c.rms_norm_eps)
        qkv = self._linear(h, layer["qkv"])
        n = qkv.shape[0]
        split = self._qk_heads * c.head_dim
        qk = self._rope(qkv[:, :split].view(n, self._qk_heads, c.head_dim), positions)
        v = qkv[:, split:].view(n, c.num_kv_heads, c.head_dim)
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _mlp(self, layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = F.rms_norm(x, (c.hidden_size,), layer["ln_post"], c.rms_norm_eps)
        gate, up = self._linear(h, layer["gate_up"]).chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, layer["down"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = F.rms_norm(x, (c.hidden_size,), self.weights.norm, c.rms_norm_eps)
        return self._linear(h, self.weights.lm_head)

    @torch.inference_mode()
    def prefill(
        self,
        cache: KVCache,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        *,
        offsets: Sequence[int] | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run prompts, writing their keys/values into `slots`.

        `offsets[i]`: positions of slot `slots[i]` that already hold the keys/values of the
        tokens before `prompts[i]` (a cached prefix; 0 by default): the prompt's tokens take the
        positions after them and attend to them too. The prompts are packed into one
        [sum(T), hidden] activation so every linear layer reads its weights once; attention
        runs per prompt (causal). Returns the last position's logits per prompt [P, vocab], or
        with `all_logits` every position's [sum(T), vocab].
        """
        self._refresh()
        lengths = [len(p) for p in prompts]
        before = list(offsets) if offsets is not None else [0] * len(prompts)
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        positions = torch.cat(
            [torch.arange(o, o + n) for o, n in zip(before, lengths, strict=True)]
        )
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        for slot, o, n in zip(slots, before, lengths, strict=True):
            cache.written(slot, o + n)
        x = self.weights.embed[tokens]
        for li, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, positions)
            outs = []
            for slot, start, n, o in zip(slots, starts, lengths, before, strict=True):
                kj = k[start : start + n].transpose(0, 1)
                vj = v[start : start + n].transpose(0, 1)
                cache.k[li, slot, :, o : o + n] = kj
                cache.v[li, slot, :, o : o + n] = vj
                qj = q[start : start + n].transpose(0, 1).unsqueeze(0)
                if o == 0:
                    out = F.scaled_dot_product_attention(
                        qj, kj.unsqueeze(0), vj.unsqueeze(0), is_causal=True, enable_gqa=True
                    )
                else:
                    # Token i of the prompt sits at position o + i: it sees the cached prefix
                    # and the prompt's tokens up to itself.
                    seen = torch.arange(o + n).unsqueeze(0) <= (o + torch.arange(n)).unsqueeze(1)
                    out = F.scaled_dot_product_attention(
                        qj,
                        cache.k[li, slot, :, : o + n].unsqueeze(0),
                        cache.v[li, slot, :, : o + n].unsqueeze(0),
                        attn_mask=seen,
                        enable_gqa=True,
                    )
                outs.append(out[0].transpose(0, 1).reshape(n, self._q_width))
            x = x + self._linear(torch.cat(outs), layer["o"])
            x = self._mlp(layer, x)
        if not all_logits:
            x = x[[s + n - 1 for s, n in zip(starts, lengths, strict=True)]]
        return self._logits(x)

    @torch.inference_mode()
    def decode(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of the sequences in slots 0..B-1.

        `tokens` [B] are the last sampled ids, `positions` [B] their positions (the number of
        tokens already cached per slot). Returns the next-token logits [B, vocab].
        """
        self._refresh()
        c = self.config
        b = tokens.shape[0]
        span = int(positions.max()) + 1
        # Row i may attend to cached keys 0..positions[i]; the rest of the slice is stale.
        mask = (torch.arange(span).unsqueeze(0) <= positions.unsqueeze(1)).view(b, 1, 1, span)
        rows = torch.arange(b)
        cache.prepare(b, span)
        x = self.weights.embed[tokens]
        for li, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, positions)
            k_cache, v_cache = cache.k[li], cache.v[li]
            k_cache[rows, :, positions] = k
            v_cache[rows, :, positions] = v
            # Grouped-query attention without repeating keys: the G query heads that share a
            # kv head become G query rows against that head's keys.
            o = F.scaled_dot_product_attention(
                q.reshape(b, c.num_kv_heads, self._group, c.head_dim),
                k_cache[:b, :, :span],
                v_cache[:b, :, :span],
                attn_mask=mask,
            )
            x = x + self._linear(o.reshape(b, self._q_width), layer["o"])
            x = self._mlp(layer, x)
        return self._logits(x)
