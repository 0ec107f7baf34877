"""Where omniloop keeps what it makes once and reuses (converted models, sandbox base images):
`$OMNILOOP_CACHE`, default `~/.cache/omniloop`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache folder (module docstring); it may not exist yet."""
    root = os.environ.get("OMNILOOP_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "omniloop"
