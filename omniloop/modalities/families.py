"""Which media processor a model family takes, read from its folder's `config.json`."""

from __future__ import annotations

import json
from pathlib import Path

from omniloop.modalities.config import MediaConfig
from omniloop.modalities.processing import MediaProcessor

MEDIA_MODEL_TYPES = ("qwen2_5_omni_thinker",)
"""`model_type`s whose media this package processes."""


def model_type(folder: Path) -> str:
    """The `model_type` of a Hugging Face model folder ('' when its config names none)."""
    config = json.loads((folder / "config.json").read_text())
    return str(config.get("model_type", ""))


def processor_for(folder: Path, config: MediaConfig | None = None) -> MediaProcessor | None:
    """The media processor of the model in `folder`, or None for a model that takes only
    text."""
    if model_type(folder) == "qwen2_5_omni_thinker":
        from omniloop.modalities.qwen_omni import QwenOmniProcessor

        return QwenOmniProcessor(config)
    return None
