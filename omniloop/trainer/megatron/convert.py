"""Hugging Face Llama / Qwen2 models as megatron-core `GPTModel`s: the config and the weights,
both ways.

megatron-bridge does this for many families, but its releases that install beside our pinned
transformers 5 do not exist yet (0.3.1 needs transformers 4; see ENVIRONMENT.md), so this is
our own mapping for the two families whose layout megatron's local layer spec reproduces
exactly: RMSNorm, SwiGLU, rotary embeddings (non-interleaved halves, as Hugging Face rotates),
grouped-query attention, optional q/k/v biases (Qwen2), tied or separate output embeddings.

The layouts that differ:
- attention: Hugging Face keeps `q_proj`, `k_proj`, `v_proj`; megatron one `linear_qkv`
  whose rows are grouped by key/value head: for each group, its query heads, then its key
  head, then its value head;
- MLP: `gate_proj` and `up_proj` are megatron's `linear_fc1` stacked (gate first).
Every other weight is renamed only. Round trips are exact (the same bytes come back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omniloop.errors import ConfigError

FAMILIES = ("llama", "qwen2")


@dataclass(frozen=True)
class GPTShape:
    """What the mapping needs of a model's shape."""

    layers: int
    heads: int
    groups: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


def gpt_shape(hf_config: Any) -> GPTShape:
    """The shape of a Llama or Qwen2 config; ConfigError naming what is not supported."""
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ConfigError(
            f"trainer.backend=megatron builds Llama and Qwen2 models ({', '.join(FAMILIES)}), "
            f"not {family!r}; use trainer.backend=torch for this model"
        )
    scaling = rope_parameters(hf_config).get("rope_type", "default")
    if scaling not in ("default", None):
        raise ConfigError(
            f"trainer.backend=megatron: rope scaling {scaling!r} is not mapped; "
            "use trainer.backend=torch for this model"
        )
    heads = hf_config.num_attention_heads
    return GPTShape(
        layers=hf_config.num_hidden_layers,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
    )


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rotary settings (`rope_theta`, `rope_type`) of a transformers 5 config."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return {**params, "rope_theta": float(theta)}


def transformer_config(hf_config: Any, **overrides: Any) -> Any:
    """megatron-core's `TransformerConfig` for a Hugging Face config: fp32, no dropout, every
    fusion off (the fused kernels are CUDA-only), weights initialised on the CPU (then
    overwritten by the checkpoint's)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    shape = gpt_shape(hf_config)
    settings: dict[str, Any] = {
        "num_layers": shape.layers,
        "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size,
        "num_attention_heads": shape.heads,
        "num_query_groups": shape.groups,
        "kv_channels": shape.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": shape.qkv_bias,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "params_dtype": torch.float32,
    }
    settings.update(overrides)
    return TransformerConfig(**settings)


def _layer_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def to_megatron(
    hf: Mapping[str, Tensor],
    shape: GPTShape,
    layers: range | None = None,
    wanted: Callable[[str], bool] = lambda name: True,
) -> dict[str, Tensor]:
    """A Hugging Face state dict (`model.…`, `lm_head.weight`) as `GPTModel`'s: the decoder
    layers `layers` (default: all) and those of the other weights (embedding, final norm,
    output layer) whose `GPTModel` name `wanted` accepts. `hf` is read only for those, so it
    may load tensors as they are read."""
    ends = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    if not shape.tied:
        ends["output_layer.weight"] = "lm_head.weight"
    out = {name: hf[hf_name] for name, hf_name in ends.items() if wanted(name)}
    rows = (shape.heads_per_group * shape.head_dim, shape.head_dim, shape.head_dim)
    for i in layers if layers is not None else range(shape.layers):
        h, m = _layer_names(i)
        attn = f"{h}self_attn."
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            parts = [
                hf[f"{attn}{p}_proj.{suffix}"].reshape(shape.groups, n, -1)
                for p, n in zip("qkv", rows, strict=True)
            ]
            fused = torch.cat(parts, dim=1)
            out[f"{m}self_attention.linear_qkv.{suffix}"] = (
                fused.reshape(-1, fused.shape[-1]) if suffix == "weight" else fused.reshape(-1)
            )
        out[f"{m}self_attention.linear_proj.weight"] = hf[f"{attn}o_proj.weight"]
        out[f"{m}input_layernorm.weight"] = hf[f"{h}input_layernorm.weight"]
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{h}post_attention_layernorm.weight"]
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [hf[f"{h}mlp.gate_proj.weight"], hf[f"{h}mlp.up_proj.weight"]]
        )
        out[f"{m}mlp.linear_fc2.weight"] = hf[f"{h}mlp.down_proj.weight"]
    return out


def to_hf(megatron: Mapping[str, Tensor], shape: GPTShape) -> Iterator[tuple[str, Tensor]]:
    """`GPTModel`'s weights under Hugging Face names, one tensor at a time (each tied tensor
    once: `lm_head.weight` only when untied), in the order of the Hugging Face model."""
    yield "model.embed_tokens.weight", megatron["embedding.word_embeddings.weight"]
    rows = [shape.heads_per_group * shape.head_dim, shape.head_dim, shape.head_dim]
    for i in range(shape.layers):
        h, m = _layer_names(i)
        yield f"{h}input_layernorm.weight", megatron[f"{m}input_layernorm.weight"]
        for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
            fused = megatron[f"{m}self_attention.linear_qkv.{suffix}"]
            grouped = fused.reshape(shape.groups, sum(rows), -1)
            for p, part in zip("qkv", grouped.split(rows, dim=1), strict=True):
                flat = part.reshape(-1, fused.shape[-1]) if suffix == "weight" else part.reshape(-1)
                yield f"{h}self_attn.{p}_proj.{suffix}", flat
        yield f"{h}self_attn.o_proj.weight", megatron[f"{m}self_attention.linear_proj.weight"]
        yield f"{h}post_attention_layernorm.weight", megatron[f"{m}pre_mlp_layernorm.weight"]
        gate, up = megatron[f"{m}mlp.linear_fc1.weight"].chunk(2)
        yield f"{h}mlp.gate_proj.weight", gate
        yield f"{h}mlp.up_proj.weight", up
        yield f"{h}mlp.down_proj.weight", megatron[f"{m}mlp.linear_fc2.weight"]
    yield "model.norm.weight", megatron["decoder.final_layernorm.weight"]
    if not shape.tied:
        yield "lm_head.weight", megatron["output_layer.weight"]


def split_dim(name: str) -> int | None:
    """The dimension along which tensor parallelism splits `GPTModel`'s weight `name` (0: its
    output rows, a column-parallel layer or the vocabulary; 1: its input columns, a
    row-parallel layer); None when every rank holds all of it (the norms)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    return None


def shard(name: str, tensor: Tensor, rank: int, size: int) -> Tensor:
    """Rank `rank`'s part of the whole weight `name` among `size` tensor-parallel ranks.

    The fused q/k/v rows are grouped by key/value head, so a contiguous chunk is whole
    groups. `linear_fc1` stacks gate and up: a rank holds its chunk of each, stacked. Parts
    are contiguous copies: gloo sends a tensor's storage, not a strided view of it.
    """
    dim = split_dim(name)
    if dim is None or size == 1:
        return tensor
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]).contiguous()
    return tensor.chunk(size, dim=dim)[rank].contiguous()


def unshard(name: str, parts: list[Tensor]) -> Tensor:
    """The whole weight `name` from every rank's part, in rank order (`shard` undone)."""
    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [part.chunk(2) for part in parts]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    return torch.cat(parts, dim=dim)
