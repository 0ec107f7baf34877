"""The check every runner's weight table makes of tensors offered to it by name."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from omniloop.errors import ConfigError


def checked_names(
    named: Iterable[tuple[str, torch.Tensor]], target: Callable[[str], torch.Tensor]
) -> set[str]:
    """The names of `named`, once each has been found (`target` raises `ConfigError` for an
    unknown name) with the shape of the model's tensor; `ConfigError` naming the first weight
    whose shape differs."""
    seen = set()
    for name, tensor in named:
        expected = target(name)
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ConfigError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model needs "
                f"{tuple(expected.shape)}"
            )
        seen.add(name)
    return seen
