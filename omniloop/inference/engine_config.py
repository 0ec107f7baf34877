"""`EngineServerConfig`: how `omniloop engine serve` runs (model, server, batching, media)."""

from __future__ import annotations

from pydantic import Field

from omniloop.config import StrictModel
from omniloop.modalities.config import MediaConfig


class EngineServerConfig(StrictModel):
    """How to run omniloop's CPU engine (`omniloop engine serve`)."""

    model: str = "tiny"
    """`smollm2`, `tiny`, `tiny-omni`, or a path to a Hugging Face model folder: a Llama
    (`model_type: llama`) runs on the engine's own fast Llama forward, any other causal-LM or
    conditional-generation model on its transformers forward (`hf_runner`; the Qwen2.5-Omni
    thinker with images, audio and video)."""
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
    slots fill: up to this many times `max_context` positions of keys and values. Llama
    models only: the generic runner of other models has no prefix cache (it prefills every
    prompt whole and reports `cached_tokens` 0), and ignores this."""
    media: MediaConfig = Field(default_factory=MediaConfig)
    """How `/generate`'s `image_data`, `audio_data` and `video_data` are decoded and sampled
    (bounds, frame rate, pixels). It decides each item's placeholder count, so it must equal
    the media config of whoever assembles the prompts' ids (the rollout's); an item whose
    block in `input_ids` has another count is refused. Unused by text-only models."""
